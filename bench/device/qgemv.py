#!/usr/bin/env python3
"""The host's 4-bit matrix-vector kernel (issue 6's 8B 4-bit target), run through
`mx.fast.cuda_kernel` exactly as `host/mlx/cpp/shim.cc` runs it (the source is read from
shim.cc, between its `// BEGIN qmv4` and `// END qmv4` lines): checked against
`mx.quantized_matmul` on random inputs and timed against it on the Llama-3.1-8B projection
shapes, for 1, 2 and 4 rows per warp (the shim uses `kQmv4RowsPerWarp`), on the GPU.

    python3 bench/device/qgemv.py [--iters 50] [--reps 20] [--check-only]

Each timing evaluates `--reps` independent products in one graph (as a decode step does), so
launch overhead is amortized the way it is inside MLX's CUDA graphs; the time is per product.
Prints one row per shape and dtype: max relative error, MLX's and the kernel's time and
effective GB/s (weights + scales + biases read once).
"""
import argparse
import pathlib
import re
import time

import mlx.core as mx

GROUP = 64
SHIM = pathlib.Path(__file__).resolve().parents[2] / "host/mlx/cpp/shim.cc"


def kernel_source(name="qmv4"):
    """The header and source strings of shim.cc's kernel `name` (between its BEGIN/END lines)."""
    text = SHIM.read_text()
    block = text[text.index(f"// BEGIN {name}"):text.index(f"// END {name}")]
    found = re.findall(r'R"CUDA\((.*?)\)CUDA"', block, re.S)
    # qmv4 has a header and a source; qmm4 only a source (it uses qmv4's header).
    return (found[0], found[1]) if len(found) == 2 else (None, found[0])


HEADER, SOURCE = kernel_source()
KERNEL = mx.fast.cuda_kernel(
    name="host_qmv4",
    input_names=["x", "w", "scales", "biases"],
    output_names=["y"],
    source=SOURCE,
    header=HEADER,
)

# (rows, in) of one Llama-3.1-8B layer's projections (separate and fused) and its head.
SHAPES = [(4096, 4096), (1024, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def qmv(x, w, scales, biases, rows_per_warp):
    rows, in_ = w.shape[0], w.shape[1] * 8
    warps = (rows + rows_per_warp - 1) // rows_per_warp
    (y,) = KERNEL(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("ROWS", rows), ("IN", in_), ("GROUP", GROUP), ("R", rows_per_warp)],
        grid=(warps * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[x.shape[:-1] + (rows,)],
        output_dtypes=[x.dtype],
    )
    return y


def timed(f, xs, iters):
    def step():
        mx.eval([f(x) for x in xs])
    for _ in range(3):
        step()
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    mx.synchronize()
    return (time.perf_counter() - t) / iters / len(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check-only", action="store_true")
    a = ap.parse_args()
    mx.random.seed(0)
    variants = (1, 2, 4)
    print("| rows x in | dtype | max rel. error | MLX us | " + " | ".join(f"R={r} us" for r in variants)
          + " | MLX GB/s | best GB/s | best speed-up |")
    print("|---|---|---|---|" + "---|" * len(variants) + "---|---|---|")
    bad = 0
    for dtype in (mx.bfloat16, mx.float16):
        for rows, in_ in SHAPES:
            w = (mx.random.normal((rows, in_)) * 0.02).astype(dtype)
            wq, scales, biases = mx.quantize(w, group_size=GROUP, bits=4)
            xs = [mx.random.normal((1, 1, in_)).astype(dtype) for _ in range(a.reps)]
            ref = mx.quantized_matmul(xs[0], wq, scales, biases, transpose=True, group_size=GROUP, bits=4)
            r32 = ref.astype(mx.float32)
            err = 0.0
            for r in variants:
                g32 = qmv(xs[0], wq, scales, biases, r).astype(mx.float32)
                err = max(err, (mx.abs(r32 - g32).max() / mx.abs(r32).max()).item())
            # Both accumulate in float32; the bound is the output rounding of a 16-bit float.
            bound = 1e-2 if dtype == mx.bfloat16 else 2e-3
            bad += err > bound
            if a.check_only:
                print(f"| {rows} x {in_} | {dtype} | {err:.2e} |", flush=True)
                continue
            nbytes = wq.nbytes + scales.nbytes + biases.nbytes
            t_ref = timed(lambda x: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=GROUP,
                                                        bits=4), xs, a.iters)
            t_new = [timed(lambda x: qmv(x, wq, scales, biases, r), xs, a.iters) for r in variants]
            best = min(t_new)
            print(f"| {rows} x {in_} | {dtype} | {err:.2e} | {t_ref * 1e6:.1f} | "
                  + " | ".join(f"{t * 1e6:.1f}" for t in t_new)
                  + f" | {nbytes / t_ref / 1e9:.0f} | {nbytes / best / 1e9:.0f} | {t_ref / best:.2f}x |", flush=True)
            del w, wq, scales, biases, xs
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
