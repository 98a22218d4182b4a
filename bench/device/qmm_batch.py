#!/usr/bin/env python3
"""Batched 4-bit products on the GPU (issue 19's 8B 4-bit target): for M activation rows
(sequences decoding together, or a prefill chunk) against the Llama-3.1-8B projection shapes,
MLX's `quantized_matmul`, the shim's `qmm4` kernel (source read from host/mlx/cpp/shim.cc,
between its BEGIN/END lines, run through `mx.fast.cuda_kernel` as the shim runs it; M <= 32)
and "dequantize then multiply" (`mx.dequantize` to the activation dtype, then a bf16 matmul).

    python3 bench/device/qmm_batch.py [--rows 1 2 4 8 16 32 64 512] [--bits 4] [--iters 20] [--reps 8]

Each timing evaluates `--reps` independent products in one graph, as a decode step does; the
time is per product, summed over the 8B layer's seven projections (q, k, v, o, gate, up, down)
and reported per layer, plus the head once. Prints a markdown table and the errors against a
float32 reference.
"""
import argparse

import mlx.core as mx

from qgemv import GROUP, kernel_source, timed

HEADER, _ = kernel_source("qmv4")
_, SOURCE = kernel_source("qmm4")
KERNEL = mx.fast.cuda_kernel(name="host_qmm4", input_names=["x", "w", "scales", "biases", "meta"],
                             output_names=["y"], source=SOURCE, header=HEADER)
LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def qmm4(x, w, scales, biases):
    rows, in_ = w.shape[0], w.shape[1] * 8
    m = x.size // in_
    nb = 2
    while nb < m:
        nb *= 2
    (y,) = KERNEL(inputs=[x, w, scales, biases, mx.array([m], dtype=mx.int32)],
                  template=[("T", x.dtype), ("ROWS", rows), ("IN", in_), ("GROUP", GROUP), ("R", 2), ("NB", nb)],
                  grid=(((rows + 1) // 2) * 32, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[x.shape[:-1] + (rows,)], output_dtypes=[x.dtype])
    return y


BITS = 4


def mlx_q(x, w, scales, biases):
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=GROUP, bits=BITS)


def deq(x, w, scales, biases):
    return x @ mx.dequantize(w, scales, biases, group_size=GROUP, bits=BITS, dtype=x.dtype).T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 512])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    a = ap.parse_args()
    global BITS
    BITS = a.bits
    qmm = a.bits == 4  # the shim's kernel is 4-bit only
    mx.random.seed(0)
    dtype = mx.bfloat16
    weights = {}
    for shape in set(LAYER + [(128256, 4096)]):
        w = (mx.random.normal(shape) * 0.02).astype(dtype)
        weights[shape] = mx.quantize(w, group_size=GROUP, bits=BITS)
        mx.eval(weights[shape])
        del w
    print(f"{BITS}-bit, group {GROUP}, bfloat16 activations")
    print("| M rows | MLX quantized_matmul ms/layer | qmm4 ms/layer | dequantize+matmul ms/layer "
          "| head: MLX / qmm4 / dequant ms | max rel. err qmm4 / dequant |")
    print("|---|---|---|---|---|---|")
    for m in a.rows:
        tot = {"mlx": 0.0, "qmm4": 0.0, "deq": 0.0}
        head = {}
        err = {"qmm4": 0.0, "deq": 0.0}
        for shape in LAYER + [(128256, 4096)]:
            wq, s, b = weights[shape]
            xs = [mx.random.normal((m, shape[1])).astype(dtype) for _ in range(a.reps)]
            ref = (xs[0].astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=GROUP, bits=BITS,
                                                            dtype=mx.float32).T)
            fs = {"mlx": mlx_q, "deq": deq}
            if m <= 32 and qmm:
                fs["qmm4"] = qmm4
            for k, f in fs.items():
                t = timed(lambda x: f(x, wq, s, b), xs, a.iters)
                if shape == (128256, 4096):
                    head[k] = t
                else:
                    tot[k] += t
                if k in err:
                    got = f(xs[0], wq, s, b).astype(mx.float32)
                    err[k] = max(err[k], (mx.abs(got - ref).max() / mx.abs(ref).max()).item())
            del xs
        q = f"{tot['qmm4'] * 1e3:.3f}" if "qmm4" in head else "-"
        hq = f"{head['qmm4'] * 1e3:.3f}" if "qmm4" in head else "-"
        print(f"| {m} | {tot['mlx'] * 1e3:.3f} | {q} | {tot['deq'] * 1e3:.3f} | {head['mlx'] * 1e3:.3f} / {hq} / "
              f"{head['deq'] * 1e3:.3f} | {err['qmm4']:.1e} / {err['deq']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
