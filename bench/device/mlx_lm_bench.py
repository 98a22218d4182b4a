#!/usr/bin/env python3
"""mlx_lm_bench.py ARGS...: the device kit's mlx-lm-bench.py (same arguments) for models whose
mlx-lm `ModelArgs` keep the text model's keys in `text_config` (qwen3_5, qwen3_5_moe): the
kit reads `model.args.vocab_size` and the layer counts, so `model.args` is given those keys
flat. Anything else runs as the kit runs it."""
import os
import runpy
import sys
import types

import mlx_lm

_load = mlx_lm.load


def load(path, *args, **kwargs):
    model, tok = _load(path, *args, **kwargs)
    margs = model.args
    text = getattr(margs, "text_config", None)
    if isinstance(text, dict) and not hasattr(margs, "vocab_size"):
        model.args = types.SimpleNamespace(**{**vars(margs), **text})
    return model, tok


mlx_lm.load = load
kit = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".device", "kit", "mlx-lm-bench.py")
sys.argv[0] = kit
runpy.run_path(kit, run_name="__main__")
