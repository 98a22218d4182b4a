#!/usr/bin/env python3
"""The mlx-lm oracle for parity tests: greedy token ids and last-position logits.

    mlx_lm_oracle.py MODEL_DIR MAX_TOKENS PROMPT...

prints one JSON line per prompt: {"prompt", "prompt_ids", "gen_ids", "last_logits"}.
Prompts go through the chat template as ../shared/models/mlx-golden.py does (as they
are, with the tokenizer's BOS, for a model without one);
`last_logits` are the float32 logits of the last prompt position from one full forward.
Runs on the CPU unless HOST_ORACLE_DEVICE=gpu.
"""
import json
import os
import sys

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

model_dir, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
mx.set_default_device(mx.gpu if os.environ.get("HOST_ORACLE_DEVICE") == "gpu" else mx.cpu)
model, tok = load(model_dir)
for p in prompts:
    if tok.chat_template is None:
        # A base model (Gemma 3 270M): the prompt as is, with the tokenizer's BOS.
        ids = tok.encode(p)
    else:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    ids = list(ids)
    gen = [r.token for r in stream_generate(model, tok, ids, max_tokens=max_tokens,
                                            sampler=make_sampler(temp=0.0))]
    logits = model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    print(json.dumps({"prompt": p, "prompt_ids": ids, "gen_ids": gen,
                      "last_logits": logits.tolist()}), flush=True)
