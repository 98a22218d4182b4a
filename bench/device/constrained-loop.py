"""Ways of running a constrained decode step, tried in mlx-lm's own model (issue 23).

A constrained step's sampling needs a mask worked out on the host from the token before it,
so it cannot be part of the forward's evaluation as an unconstrained step's sampling is. This
decodes GEN greedy tokens of MODEL (an mlx-lm folder) with a fixed mask uploaded every step
(the mask's own cost left out) in each way, and prints tok/s and the ratio to plain pipelined
decoding, the ways alternating over ROUNDS:

  plain      forward + sampling one evaluation, the next step started before the token is read
  two-evals  the next forward started, the token read, its sampling started behind it (the
             engine's `HOST_MASK_OVERLAP=never`)
  merged     the token read first, then the next forward and its sampling one evaluation
  chained    a step's sampling and the next step's forward one evaluation; the token read
             after it
  chained-2s as chained, the sampling on a second stream, so its token is ready when the
             sampling is done rather than when the whole evaluation is

Run on the device after `. /tmp/site/env.sh`:
  python3 bench/device/constrained-loop.py /tmp/llama-1b [GEN] [ROUNDS]
"""

import statistics
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

MODEL = sys.argv[1]
GEN = int(sys.argv[2]) if len(sys.argv) > 2 else 200
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3

model, _ = load(MODEL)
V = model.args.vocab_size
W = (V + 31) // 32
rng = np.random.default_rng(0)
# Every token allowed but a random tenth.
bits = np.full(W, 0xFFFFFFFF, dtype=np.uint32)
for t in rng.choice(V, V // 10, replace=False):
    bits[t // 32] &= ~np.uint32(1 << (t % 32))
pow2 = mx.array([1 << b for b in range(32)], dtype=mx.uint32).reshape(1, 32)
zero = mx.array(0, dtype=mx.uint32)
prompt = mx.array(rng.integers(0, V, 45), dtype=mx.int32)
side = mx.new_stream(mx.default_device())


def forward(y, cache):
    return model(y[None], cache=cache)[:, -1, :]


def sample(logits):
    lp = logits - mx.logsumexp(logits, -1, keepdims=True)
    return mx.argmax(lp, -1).astype(mx.int32)


def masked(logits):
    words = mx.array(bits).reshape(-1, 1)
    refused = ((words & pow2) == zero).reshape(1, -1)[:, :V]
    return mx.where(refused, mx.array(float("-inf"), logits.dtype), logits)


def pick(logits):
    return sample(masked(logits))


def start():
    cache = make_prompt_cache(model)
    model(prompt[None, :-1], cache=cache)
    return cache


def plain(cache):
    y = sample(forward(prompt[-1:], cache))
    mx.async_eval(y)
    t = time.perf_counter()
    for _ in range(GEN):
        nxt = sample(forward(y, cache))
        mx.async_eval(nxt)
        y.item()
        y = nxt
    return t


def separate(forward_first):
    """The sampling started after the token is read: behind the next forward already
    started (`forward_first`, two evaluations) or with it (merged, one)."""

    def run(cache):
        y = pick(forward(prompt[-1:], cache))
        mx.async_eval(y)
        t = time.perf_counter()
        for _ in range(GEN):
            logits = forward(y, cache)
            if forward_first:
                mx.async_eval(logits)
            y.item()
            y = pick(logits)
            mx.async_eval(y)
        return t

    return run


def chained(stream):
    def run(cache):
        y = pick(forward(prompt[-1:], cache))
        logits = forward(y, cache)
        mx.async_eval(y, logits)
        t = time.perf_counter()
        for _ in range(GEN):
            y.item()
            with mx.stream(stream):
                y = pick(logits)
            logits = forward(y, cache)
            mx.async_eval(y, logits)
        return t

    return run


ways = {
    "plain": plain,
    "two-evals": separate(forward_first=True),
    "merged": separate(forward_first=False),
    "chained": chained(mx.default_stream(mx.default_device())),
    "chained-2s": chained(side),
}
rates = {name: [] for name in ways}
for name, way in ways.items():
    way(start())
    mx.synchronize()
for _ in range(ROUNDS):
    for name, way in ways.items():
        cache = start()
        mx.eval([c.state for c in cache])
        t = way(cache)
        mx.synchronize()
        rates[name].append(GEN / (time.perf_counter() - t))
plain_rate = statistics.median(rates["plain"])
print(f"mlx {mx.__version__}, {MODEL}, vocab {V}, {GEN} tokens, median of {ROUNDS} rounds")
print("| way | tok/s | vs plain |")
print("|---|---|---|")
for name, r in rates.items():
    print(f"| {name} | {statistics.median(r):.1f} | {statistics.median(r) / plain_rate:.2f}x |")
