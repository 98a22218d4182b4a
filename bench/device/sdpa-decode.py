#!/usr/bin/env python3
"""One-token attention on the GPU: which route MLX's fused op takes, and what each costs.

    python3 bench/device/sdpa-decode.py [--steps 128]
    MLX_CUDA_USE_CUDNN_SDPA=0 python3 bench/device/sdpa-decode.py   # cuDNN off (per process)

A decode step's attention, alone: for each of a model's layers, `mx.fast.scaled_dot_product_
attention` of one query over the first S positions of a preallocated bf16 cache, S growing by
one per step from 512 as in decoding; one evaluation per step. Variants of the mask argument:
none (mlx-lm's choice at decode), "causal", an all-true boolean [1, S] array (made once per
step, shared by the layers), an all-zero additive bf16 array, and the unfused graph (matmul,
softmax, matmul). Prints ms per step (median over --steps after a warm-up of 16) and the
maximum difference of the last step's output from the no-mask variant.
"""
import argparse
import statistics
import time

import mlx.core as mx

SHAPES = {  # heads, kv heads, head dim, layers
    "qwen-0.5b": (14, 2, 64, 24),
    "llama-1b": (32, 8, 64, 16),
    "llama-8b": (32, 8, 128, 32),
}


def unfused(q, k, v, scale):
    h, kvh = q.shape[1], k.shape[1]
    r = h // kvh
    qq = (q * scale).reshape(1, kvh, r, 1, q.shape[-1])
    s = qq @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    p = mx.softmax(s, axis=-1, precise=True)
    return (p @ mx.expand_dims(v, 2)).reshape(q.shape)


def run(shape, variant, steps, start=512):
    h, kvh, d, layers = shape
    total = start + steps + 16 + 1
    mx.random.seed(0)
    ks = [mx.random.normal((1, kvh, total, d)).astype(mx.bfloat16) for _ in range(layers)]
    vs = [mx.random.normal((1, kvh, total, d)).astype(mx.bfloat16) for _ in range(layers)]
    qs = [mx.random.normal((1, h, 1, d)).astype(mx.bfloat16) for _ in range(layers)]
    mx.eval(ks, vs, qs)
    scale = d ** -0.5
    times, out = [], None
    for i in range(steps + 16):
        s = start + i
        t = time.perf_counter()
        if variant == "bool":
            mask = mx.ones((1, s), dtype=mx.bool_)
        elif variant == "additive":
            mask = mx.zeros((1, s), dtype=mx.bfloat16)
        else:
            mask = {"none": None, "causal": "causal"}.get(variant)
        outs = []
        for q, k, v in zip(qs, ks, vs):
            k, v = k[:, :, :s, :], v[:, :, :s, :]
            if variant == "unfused":
                outs.append(unfused(q, k, v, scale))
            else:
                outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
        mx.eval(outs)
        if i >= 16:
            times.append(time.perf_counter() - t)
        out = outs
    return statistics.median(times) * 1e3, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=128)
    a = p.parse_args()
    mx.set_default_device(mx.gpu)
    print("| model shape | mask | ms per step | max abs diff vs none |")
    print("|---|---|---|---|")
    for name, shape in SHAPES.items():
        ref = None
        for variant in ["none", "causal", "bool", "additive", "unfused"]:
            try:
                ms, out = run(shape, variant, a.steps)
            except Exception as e:  # a variant MLX refuses: say so, go on
                print(f"| {name} | {variant} | error: {e} | |", flush=True)
                continue
            if ref is None:
                ref = out
            diff = max(mx.abs(o.astype(mx.float32) - r.astype(mx.float32)).max().item() for o, r in zip(out, ref))
            print(f"| {name} | {variant} | {ms:.3f} | {diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
