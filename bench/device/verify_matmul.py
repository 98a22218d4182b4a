#!/usr/bin/env python3
"""What a speculative verification's products cost MLX to dispatch on the GPU, by formulation
(issue 5). A verification of L positions multiplies [1, L, K] activations by each weight; MLX
sends M > 1 products to cuBLAS, which its CUDA graphs capture call by call, where a one-row
product is MLX's own GEMV kernel (a plain graph node). This times, on SmolLM2-135M's shapes
(30 layers; qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536; 9 heads over 3 KV heads
of 64; random weights), the wall time of building and evaluating one forward's worth of
products and attention:

  gemm   x [1, L, K] @ W.T                       (what the host does now)
  rows   x as [L, 1, K] @ W.T broadcast to [L, K, N]: L one-row products in one batched op
  gather x as [L, 1, K] through gather_mm with one matrix (MLX's gather GEMV)
  one    x [1, 1, K] @ W.T                       (a plain decode step's products, for scale)

and attention over S cached keys: `unfused` (the host's short-query graph: two batched
products), `rows` (each query row its own one-row products), `gather` (the same through
gather_mm, each row picking its KV head), `sdpa1` (the fused op on one query, a plain
step's); and, as in decoding, products whose L changes every forward and attention whose key
count grows by one every forward. Prints a table of median ms per forward.

    python3 bench/device/verify_matmul.py [--L 9] [--S 400] [--reps 30] [--dtype bfloat16]
"""
import argparse
import statistics
import time

import mlx.core as mx

HIDDEN, FFN, LAYERS, HEADS, KV, D = 576, 1536, 30, 9, 3, 64


def products(x, ws, form):
    def mm(a, w):
        l, k = a.shape[1], a.shape[2]
        if form == "rows":
            return mx.matmul(a.reshape(l, 1, k), mx.broadcast_to(w.T, (l, k, w.shape[0]))).reshape(1, l, w.shape[0])
        if form == "gather":
            idx = mx.zeros((l,), dtype=mx.uint32)
            return mx.gather_mm(a.reshape(l, 1, k), w.T[None], rhs_indices=idx).reshape(1, l, w.shape[0])
        return a @ w.T

    for qkv, o, gu, down in ws:
        a = mm(x, qkv)
        b = mm(x, o)
        c = mm(x, gu)
        d = mm(c[..., :FFN], down)
        x = x + (a[..., :HIDDEN] + b + d) * 1e-3
    return x


def attention(q, k, v, mask, form):
    # q [1, H, L, D]; k, v [1, KV, S, D]; mask [L, S] bool.
    l, s = q.shape[2], k.shape[2]
    rep = HEADS // KV
    if form == "sdpa1":
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    q = (q * 0.125).reshape(1, KV, rep, l, D)
    if form == "unfused":
        scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)
        scores = mx.softmax(mx.where(mask, scores, -1e9), axis=-1, precise=True)
        return (scores @ mx.expand_dims(v, 2)).reshape(1, HEADS, l, D)
    if form == "gather":
        # Every (head, query) row a one-row product against its KV head's keys, gathered.
        idx = mx.repeat(mx.arange(KV, dtype=mx.uint32), rep * l)
        scores = mx.gather_mm(q.reshape(KV * rep * l, 1, D), k[0].swapaxes(-1, -2), rhs_indices=idx)
        scores = mx.softmax(mx.where(mask, scores.reshape(1, KV, rep, l, s), -1e9), axis=-1, precise=True)
        out = mx.gather_mm(scores.reshape(KV * rep * l, 1, s), v[0], rhs_indices=idx)
        return out.reshape(1, HEADS, l, D)
    # rows: every (head, query) row is a one-row product against its KV head's keys.
    qr = q.reshape(1, KV, rep * l, 1, D)
    kt = mx.broadcast_to(mx.expand_dims(k.swapaxes(-1, -2), 2), (1, KV, rep * l, D, s))
    scores = (qr @ kt).reshape(1, KV, rep, l, s)
    scores = mx.softmax(mx.where(mask, scores, -1e9), axis=-1, precise=True).reshape(1, KV, rep * l, 1, s)
    vb = mx.broadcast_to(mx.expand_dims(v, 2), (1, KV, rep * l, s, D))
    return (scores @ vb).reshape(1, HEADS, l, D)


def timed(fn, reps):
    for _ in range(3):
        mx.eval(fn())
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=9)
    ap.add_argument("--S", type=int, default=400)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16", help="float32 on the CPU (its gather_mm)")
    a = ap.parse_args()
    dt = getattr(mx, a.dtype)
    r = lambda *shape: (mx.random.normal(shape) * 0.02).astype(dt)
    ws = [(r(960, HIDDEN), r(HIDDEN, HIDDEN), r(2 * FFN, HIDDEN), r(HIDDEN, FFN)) for _ in range(LAYERS)]
    mx.eval(ws)
    rows = []
    xl, x1 = r(1, a.L, HIDDEN), r(1, 1, HIDDEN)
    ref = products(xl, ws, "gemm")
    for form in ["gemm", "rows", "gather"]:
        got = products(xl, ws, form)
        err = mx.max(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))).item()
        rows.append((f"products {form}, L={a.L}", timed(lambda: products(xl, ws, form), a.reps), err))
    rows.append(("products one, L=1", timed(lambda: products(x1, ws, "one"), a.reps), 0.0))
    # Shapes that change every forward, as in decoding: L cycles through 2..9.
    xs = [r(1, n, HIDDEN) for n in range(2, 10)]
    for form in ["gemm", "gather"]:
        it = iter(range(10**9))
        rows.append((f"products {form}, L cycling 2..9", timed(lambda: products(xs[next(it) % 8], ws, form), a.reps), 0.0))
    s = a.S
    q, k, v = r(1, HEADS, a.L, D), r(1, KV, s, D), r(1, KV, s, D)
    mask = mx.arange(s - a.L, s)[:, None] >= mx.arange(s)[None]
    layers = lambda form, q: [attention(q + i * 1e-3, k, v, mask, form) for i in range(LAYERS)]
    ref = attention(q, k, v, mask, "unfused")
    for form in ["unfused", "rows", "gather"]:
        got = attention(q, k, v, mask, form)
        err = mx.max(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))).item()
        rows.append((f"attention {form} x{LAYERS}, L={a.L}, S={s}", timed(lambda: layers(form, q), a.reps), err))
    # The key count growing by one every forward, as in decoding.
    kk, vv = r(1, KV, s + 200, D), r(1, KV, s + 200, D)
    for form in ["unfused", "gather"]:
        it = iter(range(10**9))

        def grown():
            n = s + next(it) % 200
            m = mx.arange(n - a.L, n)[:, None] >= mx.arange(n)[None]
            return [attention(q + i * 1e-3, kk[:, :, :n], vv[:, :, :n], m, form) for i in range(LAYERS)]

        rows.append((f"attention {form} x{LAYERS}, L={a.L}, S growing from {s}", timed(grown, a.reps), 0.0))
    q1 = r(1, HEADS, 1, D)
    rows.append((f"attention sdpa1 x{LAYERS}, L=1, S={s}", timed(lambda: layers("sdpa1", q1), a.reps), 0.0))
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    print("| what | ms per forward (median) | max abs diff vs the first form |")
    print("|---|---|---|")
    for name, ms, err in rows:
        print(f"| {name} | {ms:.2f} | {err:.2e} |")


if __name__ == "__main__":
    main()
