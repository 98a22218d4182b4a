"""What a constrained step's separate sampling dispatch costs MLX on the host (issue 23).

A constrained decode step that samples needs its mask, which needs the token before it, so
its sampling is started behind its forward in an evaluation of its own (host/src/engine/
decode.rs, `queue_pick`); `host bench --constraint` reports that at ~0.23 ms a step on the
H200 for llama-1b (128,256 tokens). This times the pieces of such a sampling graph alone on
a `[1, V]` row of logits already on the device: the graph's building, MLX's `async_eval` of
it, and the wait for its token, median over ITERS, for graphs of growing size. Run on the
device after `. /tmp/site/env.sh`:
  python3 bench/device/pick-cost.py [VOCAB] [ITERS]
"""

import statistics
import sys
import time

import mlx.core as mx
import numpy as np

V = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
ITERS = int(sys.argv[2]) if len(sys.argv) > 2 else 300
W = (V + 31) // 32

rng = np.random.default_rng(0)
logits = mx.random.normal((1, V)).astype(mx.bfloat16)
bits = rng.integers(0, 2**32, size=W, dtype=np.uint32)
pow2 = mx.array([1 << b for b in range(32)], dtype=mx.uint32).reshape(1, 32)
zero = mx.array(0, dtype=mx.uint32)
ninf = mx.array(float("-inf"), dtype=mx.bfloat16)
kept_words = mx.array(bits).reshape(-1, 1)
# Per token: its word's index and its bit, for a gather instead of the expand-and-slice.
word_of = mx.arange(V, dtype=mx.int32) // 32
bit_of = mx.array([1 << (t % 32) for t in range(V)], dtype=mx.uint32)
mx.eval(logits, pow2, zero, ninf, kept_words, word_of, bit_of)


def masked(x, words):
    refused = ((words & pow2) == zero).reshape(1, -1)[:, :V]
    return mx.where(refused, ninf, x)


@mx.compile
def masked_gather(x, words):
    refused = (words[word_of] & bit_of) == zero
    return mx.where(refused[None], ninf, x)


def pick(x):
    lp = x - mx.logsumexp(x, -1, keepdims=True)
    return mx.argmax(lp, -1), lp


def upload():
    return mx.array(bits).reshape(-1, 1)


ways = {
    "x + 1 (one op)": lambda: (logits + 1,),
    "argmax": lambda: (mx.argmax(logits, -1),),
    "log-softmax + argmax (the plain step's sampling)": lambda: pick(logits),
    "mask kept on the device + sampling": lambda: pick(masked(logits, kept_words)),
    "mask uploaded + sampling (the engine's)": lambda: pick(masked(logits, upload())),
    "mask uploaded, gathered and compiled + sampling": lambda: pick(masked_gather(logits, mx.array(bits))),
}

print(f"mlx {mx.__version__}, {mx.default_device()}, vocab {V}, {ITERS} iterations, median us")
print("| sampling graph | build | async_eval | wait for the token | whole |")
print("|---|---|---|---|---|")
for name, build in ways.items():
    for _ in range(20):
        mx.eval(*build())
    b, d, w, t = [], [], [], []
    for _ in range(ITERS):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.async_eval(*out)
        t2 = time.perf_counter()
        out[0].item() if out[0].size == 1 else mx.eval(out[0])
        t3 = time.perf_counter()
        b.append(t1 - t0)
        d.append(t2 - t1)
        w.append(t3 - t2)
        t.append(t3 - t0)
    m = lambda xs: statistics.median(xs) * 1e6
    print(f"| {name} | {m(b):.0f} | {m(d):.0f} | {m(w):.0f} | {m(t):.0f} |")
