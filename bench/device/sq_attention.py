#!/usr/bin/env python3
"""The host's short-query causal attention kernel (issue 5: one op per layer for a speculative
verification), run through `mx.fast.cuda_kernel` exactly as `host/mlx/cpp/shim.cc` runs it
(the source is read from shim.cc, between its `// BEGIN sq_attention` and `// END
sq_attention` lines): checked against attention computed in float32 with MLX's own ops, on
random inputs over the shapes a verification meets, and timed against the host's unfused
graph (what verifications run without the kernel) for 30 layers' worth per forward.

    python3 bench/device/sq_attention.py [--reps 30]

Prints one row per case: max absolute error against the float32 reference (bf16/f16 inputs:
the reference is computed from the same rounded inputs), then a timing table.
"""
import argparse
import struct

import mlx.core as mx

from qgemv import kernel_source  # noqa: E402  (this directory is on sys.path when run as a script)
from verify_matmul import timed  # noqa: E402

THREADS, MAXS = 128, 4096
HEADER, SOURCE = kernel_source("sq_attention")
KERNEL = mx.fast.cuda_kernel(
    name="host_sq_attention", input_names=["q", "k", "v", "meta"], output_names=["o"], source=SOURCE, header=HEADER
)


def kernel(q, k, v, scale):
    h, l, d = q.shape[1], q.shape[2], q.shape[3]
    kvh, s = k.shape[1], k.shape[2]
    bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    meta = mx.array([s, l, bits], dtype=mx.int32)
    (o,) = KERNEL(
        inputs=[q, k, v, meta],
        template=[("T", q.dtype), ("H", h), ("KVH", kvh), ("D", d), ("MAXS", MAXS)],
        grid=(h * l * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return o


def mask(l, s):
    return mx.arange(s - l, s)[:, None] >= mx.arange(s)[None]


def reference(q, k, v, scale):
    # float32 on the CPU (the GPU's float32 products may use TF32), KV heads repeated, the
    # causal mask of a query block that ends the sequence.
    with mx.stream(mx.cpu):
        return _reference(q, k, v, scale)


def _reference(q, k, v, scale):
    q, k, v = (a.astype(mx.float32) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    scores = mx.where(mask(q.shape[2], k.shape[2]), scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


def unfused(q, k, v, scale, m):
    # The host's `attention_unfused` (models/src/layers.rs), op for op.
    b, h, l, d = q.shape
    kvh = k.shape[1]
    rep = h // kvh
    q = mx.array(scale, dtype=q.dtype) * q
    if rep > 1:
        q = q.reshape(b, kvh, rep, l, d)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    scores = mx.softmax(mx.where(m, scores, mx.finfo(q.dtype).min), axis=-1, precise=True)
    out = scores @ v
    return out.reshape(b, h, l, d) if rep > 1 else out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    print("| dtype | heads / KV heads | head dim | L | S | max abs error | reference max abs |")
    print("|---|---|---|---|---|---|---|")
    failures = []
    for dt, bound in [(mx.float32, 1e-4), (mx.bfloat16, 2e-2), (mx.float16, 4e-3)]:
        for h, kvh, d in [(9, 3, 64), (32, 8, 128), (4, 4, 64)]:
            for l, s in [(2, 2), (9, 40), (9, 400), (17, 1000), (32, 4096)]:
                q, k, v = (mx.random.normal(shape).astype(dt) for shape in [(1, h, l, d), (1, kvh, s, d), (1, kvh, s, d)])
                scale = d**-0.5
                got = kernel(q, k, v, scale).astype(mx.float32)
                ref = reference(q, k, v, scale)
                err = mx.max(mx.abs(got - ref)).item()
                print(f"| {dt} | {h}/{kvh} | {d} | {l} | {s} | {err:.2e} | {mx.max(mx.abs(ref)).item():.2f} |")
                if err > bound:
                    failures.append(f"{dt} {h}/{kvh} {d} L={l} S={s}: error {err:.2e} > {bound}")
    # A strided key/value view (a cache buffer sliced to the positions held), as the host passes.
    buf = mx.random.normal((1, 3, 512, 64)).astype(mx.bfloat16)
    q = mx.random.normal((1, 9, 9, 64)).astype(mx.bfloat16)
    kv = buf[:, :, :300, :]
    err = mx.max(mx.abs(kernel(q, kv, kv, 0.125).astype(mx.float32) - reference(q, kv, kv, 0.125))).item()
    print(f"strided view (a cache buffer of 512 sliced to 300): max abs error {err:.2e}")
    if err > 2e-2:
        failures.append(f"strided view: error {err:.2e}")
    print("FAILED: " + "; ".join(failures) if failures else "all within bounds")
    print()
    print("| 30 layers, SmolLM2 shapes (9/3 heads, 64), bf16 | L | S | kernel ms | unfused ms | one-token fused ms |")
    print("|---|---|---|---|---|---|")
    for l, s in [(9, 400), (5, 1200), (17, 3000)]:
        q, k, v = (mx.random.normal(shape).astype(mx.bfloat16) for shape in [(1, 9, l, 64), (1, 3, s, 64), (1, 3, s, 64)])
        q1 = q[:, :, :1]
        m = mask(l, s)
        tk = timed(lambda: [kernel(q + i * 1e-3, k, v, 0.125) for i in range(30)], a.reps)
        tu = timed(lambda: [unfused(q + i * 1e-3, k, v, 0.125, m) for i in range(30)], a.reps)
        t1 = timed(lambda: [mx.fast.scaled_dot_product_attention(q1 + i * 1e-3, k, v, scale=0.125) for i in range(30)], a.reps)
        print(f"| | {l} | {s} | {tk:.2f} | {tu:.2f} | {t1:.2f} |")


if __name__ == "__main__":
    main()
