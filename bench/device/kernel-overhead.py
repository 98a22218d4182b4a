#!/usr/bin/env python3
"""What one operation costs MLX's CUDA backend to dispatch: built-in ops against custom
kernels (`mx.fast.cuda_kernel`, the route of the host's qmv4), on tiny arrays so that the
GPU work is negligible and the time is the CPU's.

    python3 bench/device/kernel-overhead.py [--ops 128] [--runs 30]

Each variant builds a chain of --ops dependent operations on a 4096-element bf16 vector
(y = x * 1.0001, or the same in a custom kernel) and evaluates it; prints the median over
--runs of the building time and the evaluation (dispatch + execution) time per operation.
Custom-kernel variants: with a template argument (as qmv4 passes T, ROWS, ...), without
one, and without `ensure_row_contiguous`.
"""
import argparse
import statistics
import time

import mlx.core as mx

SOURCE_T = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = static_cast<T>(static_cast<float>(x[i]) * 1.0001f);
"""
SOURCE = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 4096) y[i] = static_cast<__nv_bfloat16>(static_cast<float>(x[i]) * 1.0001f);
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=128)
    ap.add_argument("--runs", type=int, default=30)
    a = ap.parse_args()
    mx.set_default_device(mx.gpu)
    n = 4096
    k_t = mx.fast.cuda_kernel(name="ovh_t", input_names=["x"], output_names=["y"], source=SOURCE_T)
    k_plain = mx.fast.cuda_kernel(name="ovh", input_names=["x"], output_names=["y"], source=SOURCE)
    k_nc = mx.fast.cuda_kernel(name="ovh_nc", input_names=["x"], output_names=["y"], source=SOURCE,
                               ensure_row_contiguous=False)

    def custom(kernel, template):
        def f(x):
            kw = {"template": [("T", x.dtype), ("N", n)]} if template else {}
            return kernel(inputs=[x], grid=(n, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
                          output_dtypes=[x.dtype], **kw)[0]
        return f

    variants = {
        "built-in multiply": lambda x: x * 1.0001,
        "custom kernel, template T, N": custom(k_t, True),
        "custom kernel, no template": custom(k_plain, False),
        "custom kernel, no template, not ensure_row_contiguous": custom(k_nc, False),
    }
    print(f"| operation ({a.ops} chained, {n} bf16) | build us/op | evaluate us/op |")
    print("|---|---|---|")
    for name, f in variants.items():
        builds, evals = [], []
        for run in range(a.runs + 3):
            x = mx.ones((n,), dtype=mx.bfloat16)
            mx.eval(x)
            t0 = time.perf_counter()
            y = x
            for _ in range(a.ops):
                y = f(y)
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            if run >= 3:
                builds.append((t1 - t0) / a.ops)
                evals.append((t2 - t1) / a.ops)
        print(f"| {name} | {statistics.median(builds) * 1e6:.2f} | {statistics.median(evals) * 1e6:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
