#!/usr/bin/env python3
"""What one serial forward of L positions costs mlx-lm on the GPU (issue 5: a speculative
verification of L-1 drafts is one such forward): after a prefill of the edit prompt, repeat
forward(L random tokens) -> argmax -> eval -> trim L-1 positions (the key count grows by one
per forward, as in decoding), and report the median wall ms per forward for each L, with the
key count held fixed too (trim L: the same shapes every time). mlx-lm sends causal queries of
L > 1 to the fused attention op (cuDNN on CUDA); L = 1 is a plain decode step, unpipelined.

    python3 bench/device/verify_cost_mlx_lm.py MODEL [--prompt-file bench/edit_prompt.txt]
"""
import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-file", default="bench/edit_prompt.txt")
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    model, tok = load(a.model)
    text = open(a.prompt_file).read()
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    print(f"| L | key count | ms per forward (median) | min |")
    print("|---|---|---|---|")
    for grow in [True, False]:
        for L in [1, 2, 4, 9]:
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array(ids)[None], cache=cache))
            times = []
            for i in range(a.reps + 5):
                x = mx.array([(i * 7919 + j * 104729) % 49152 for j in range(L)])[None]
                t = time.perf_counter()
                y = mx.argmax(model(x, cache=cache)[0], axis=-1)
                mx.eval(y)
                times.append((time.perf_counter() - t) * 1e3)
                trim_prompt_cache(cache, L - 1 if grow else L)
            times = times[5:]
            print(f"| {L} | {'grows' if grow else 'fixed'} | {statistics.median(times):.2f} | {min(times):.2f} |")


if __name__ == "__main__":
    main()
