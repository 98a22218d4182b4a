#!/usr/bin/env python3
"""A 4-bit matrix-vector kernel for decoding (issue 6's 8B 4-bit target), prototyped through
`mx.fast.cuda_kernel` before it goes into the host: checked against `mx.quantized_matmul` on
random inputs and timed against it on the Llama-3.1-8B projection shapes, on the GPU.

    python3 bench/device/qgemv.py [--iters 200] [--check-only]

Format (MLX affine quantization, bits 4, group 64): `w` uint32 `[rows, in/8]`, eight 4-bit
values per word, lowest bits first; `scales`, `biases` `[rows, in/64]` in the activation
dtype; `y[r] = sum_g scales[r,g] * dot(q[r,g], x[g]) + biases[r,g] * sum(x[g])`.

Kernel: one warp per output row, each lane reading 16 bytes (32 weights, half a group) of
the row per iteration, coalesced; `x` read as 16-byte vectors (L1/L2-resident: every warp
reads it), its partial sums taken on the way for the bias term; float accumulation, a warp
shuffle reduction. Written in session 5 without a GPU (its CUDA compiles with the
wheel's nvcc for sm_90 in a wrapper like MLX's); NOT YET RUN. Prints one row per shape:
max relative error, MLX's and this kernel's time per call and effective GB/s.
"""
import argparse
import time

import mlx.core as mx

GROUP = 64

# The kernel body; MLX wraps it as `template <typename T, int ROWS, int IN> __global__ void
# ...(const T* x, const uint32_t* w, const T* scales, const T* biases, T* y)`.
SOURCE = r"""
    const int lane = threadIdx.x & 31;
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= ROWS) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row) * (IN / 8));
    const T* srow = scales + static_cast<size_t>(row) * (IN / 64);
    const T* brow = biases + static_cast<size_t>(row) * (IN / 64);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    float acc = 0.f;
#pragma unroll 2
    for (int v = lane; v < IN / 32; v += 32) {
        // 32 weights (4 words of 8) and their 32 activations (4 vectors of 8).
        const uint4 q = wrow[v];
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
        float dot = 0.f, sx = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 xr = xv[v * 4 + i];
            const T* xe = reinterpret_cast<const T*>(&xr);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float xf = static_cast<float>(xe[j]);
                dot += static_cast<float>((words[i] >> (4 * j)) & 0xFu) * xf;
                sx += xf;
            }
        }
        const int g = v >> 1;  // 64 weights per group: two iterations' worth
        acc += static_cast<float>(srow[g]) * dot + static_cast<float>(brow[g]) * sx;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[row] = static_cast<T>(acc);
"""

KERNEL = mx.fast.cuda_kernel(
    name="qgemv4_g64",
    input_names=["x", "w", "scales", "biases"],
    output_names=["y"],
    source=SOURCE,
)

# (rows, in) of one Llama-3.1-8B layer's projections (separate and fused) and its head.
SHAPES = [(4096, 4096), (1024, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def qgemv(x, w, scales, biases):
    rows, in_ = w.shape[0], w.shape[1] * 8
    assert in_ % 256 == 0 and x.dtype in (mx.bfloat16, mx.float16), "bf16/f16 activations, in a multiple of 256"
    (y,) = KERNEL(
        inputs=[x.reshape(-1), w, scales, biases],
        template=[("T", x.dtype), ("ROWS", rows), ("IN", in_)],
        grid=(rows * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(rows,)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(1, rows)


def timed(f, iters):
    for _ in range(5):
        mx.eval(f())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - t) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--check-only", action="store_true")
    a = ap.parse_args()
    mx.random.seed(0)
    print("| rows x in | dtype | max rel. error | MLX us | kernel us | MLX GB/s | kernel GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for dtype in (mx.bfloat16, mx.float16):
        for rows, in_ in SHAPES:
            w = (mx.random.normal((rows, in_)) * 0.02).astype(dtype)
            wq, scales, biases = mx.quantize(w, group_size=GROUP, bits=4)
            x = mx.random.normal((1, in_)).astype(dtype)
            ref = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=GROUP, bits=4)
            got = qgemv(x, wq, scales, biases)
            r32, g32 = ref.astype(mx.float32), got.astype(mx.float32)
            err = (mx.abs(r32 - g32).max() / mx.abs(r32).max()).item()
            # Both accumulate in float32; the bound is the output rounding of a 16-bit float.
            bound = 1e-2 if dtype == mx.bfloat16 else 2e-3
            bad += err > bound
            if a.check_only:
                print(f"| {rows} x {in_} | {dtype} | {err:.2e} | | | | | |")
                continue
            nbytes = wq.nbytes + scales.nbytes + biases.nbytes
            t_ref = timed(lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=GROUP, bits=4), a.iters)
            t_new = timed(lambda: qgemv(x, wq, scales, biases), a.iters)
            print(f"| {rows} x {in_} | {dtype} | {err:.2e} | {t_ref * 1e6:.1f} | {t_new * 1e6:.1f} | "
                  f"{nbytes / t_ref / 1e9:.0f} | {nbytes / t_new / 1e9:.0f} | {t_ref / t_new:.2f}x |", flush=True)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
