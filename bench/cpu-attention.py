"""Where a long prefill's time goes on the CPU: MLX's matmul (with the BLAS the host links)
against its attention at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size 64),
one prefill chunk of 2048 queries over a growing context. Prints a table.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \
        ~/.cache/host/oracle/bin/python bench/cpu-attention.py

(The oracle virtualenv of scripts/test-fixtures.sh has mlx-cpu; LD_PRELOAD gives it the
OpenBLAS the host binary links, as tests/parity.rs does.)"""
import time

import mlx.core as mx

mx.set_default_device(mx.cpu)
H, KV, D, L = 9, 3, 64, 2048


def secs(f, runs=3):
    mx.eval(f())
    t = time.perf_counter()
    for _ in range(runs):
        mx.eval(f())
    return (time.perf_counter() - t) / runs


print("| part | shape | s | GFLOP/s |")
print("|---|---|---|---|")
for m, k, n in [(L, 576, 1536), (L, 1536, 576)]:
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b)
    s = secs(lambda: a @ b)
    print(f"| matmul | {m}x{k} @ {k}x{n} | {s:.3f} | {2 * m * k * n / s / 1e9:.0f} |")
for S in [2048, 8192]:
    q, k, v = mx.random.normal((1, H, L, D)), mx.random.normal((1, KV, S, D)), mx.random.normal((1, KV, S, D))
    mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    mx.eval(q, k, v, mask)
    flops = 4 * H * L * S * D
    s = secs(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask))
    print(f"| sdpa (one layer) | {L} queries x {S} keys | {s:.3f} | {flops / s / 1e9:.0f} |")
    scores = (q.reshape(1, KV, H // KV * L, D) @ k.transpose(0, 1, 3, 2))
    mx.eval(scores)
    s = secs(lambda: mx.softmax(scores, axis=-1))
    print(f"| of which softmax | {H}x{L}x{S} | {s:.3f} | - |")
