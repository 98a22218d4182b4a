#!/usr/bin/env python3
"""The mlx-lm batch oracle: greedy token ids of several prompts decoded together by
mlx-lm's `batch_generate` (its continuous-batching `BatchGenerator`).

    mlx_lm_batch_oracle.py MODEL_DIR MAX_TOKENS PROMPT...

prints one JSON line per prompt, in order: {"prompt", "prompt_ids", "gen_ids"}. Prompts go
through the chat template as mlx_lm_oracle.py does; `gen_ids` stop before an end-of-sequence
token (batch_generate leaves it out). Runs on the CPU unless HOST_ORACLE_DEVICE=gpu.
"""
import json
import os
import sys

import mlx.core as mx
from mlx_lm import batch_generate, load

model_dir, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
mx.set_default_device(mx.gpu if os.environ.get("HOST_ORACLE_DEVICE") == "gpu" else mx.cpu)
model, tok = load(model_dir)
all_ids = []
for p in prompts:
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    all_ids.append(list(ids))
out = batch_generate(model, tok, all_ids, max_tokens=max_tokens, return_token_ids=True)
for p, ids, gen in zip(prompts, all_ids, out.token_ids):
    print(json.dumps({"prompt": p, "prompt_ids": ids, "gen_ids": [int(t) for t in gen]}), flush=True)
