#!/usr/bin/env python3
"""mlx-lm's decode loop with `host bench`'s step split, for comparing the two per term:

    bench/step_split_mlx_lm.py MODEL_DIR [--prompt 512] [--gen 128] [--runs 3] [--stream new|default]

The loop is mlx-lm's `generate_step` (prompt prefilled in chunks, then: build step n+1's graph
from step n's lazy token, `async_eval` it, read step n's token), timed as the host times its
own: build (the model call, the logsumexp and the argmax), dispatch (`mx.async_eval`), wait
(`.item()` of the current token). `--stream new` runs on a stream of its own, as
`stream_generate` does; `default` on the thread's default stream. Prints one JSON line:
median decode tok/s and mean per-step ms of each term (of the median run).
"""
import argparse
import json
import random
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stream", choices=["new", "default"], default="new")
    ap.add_argument("--serial", action="store_true", help="no pipelining: read each token before building the next step")
    a = ap.parse_args()
    model, _ = load(a.model)
    vocab = model.args.vocab_size
    rng = random.Random(1)
    prompt = mx.array([rng.randrange(100, min(vocab, 30000)) for _ in range(a.prompt)])
    stream = mx.new_stream(mx.default_device()) if a.stream == "new" else mx.default_stream(mx.default_device())

    def step(y, cache):
        logits = model(y[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)

    def run(n):
        with mx.stream(stream):
            cache = make_prompt_cache(model)
            # As mlx-lm's generate_step prefills: evaluate each chunk, then clear the buffer cache.
            for i in range(0, a.prompt - 1, 2048):
                model(prompt[i:min(i + 2048, a.prompt - 1)][None], cache=cache)
                mx.eval([c.state for c in cache])
                mx.clear_cache()
            y, lp = step(prompt[-1:], cache)
            mx.async_eval(y, lp)
            build = dispatch = wait = 0.0
            first = None
            for k in range(n):
                if a.serial:
                    t0 = time.perf_counter()
                    y.item()
                    first = first or time.perf_counter()
                    if k + 1 < n:
                        y, lp = step(y, cache)
                        t1 = time.perf_counter()
                        mx.async_eval(y, lp)
                        build += t1 - t0
                        dispatch += time.perf_counter() - t1
                    continue
                t0 = time.perf_counter()
                queued = k + 1 < n
                if queued:
                    ny, nlp = step(y, cache)
                    t1 = time.perf_counter()
                    mx.async_eval(ny, nlp)
                    t2 = time.perf_counter()
                    build += t1 - t0
                    dispatch += t2 - t1
                t3 = time.perf_counter()
                y.item()
                if queued:
                    wait += time.perf_counter() - t3
                first = first or time.perf_counter()
                if queued:
                    y, lp = ny, nlp
            last = time.perf_counter()
            steps = max(n - 1, 1)
            return (n - 1) / (last - first), 1e3 * build / steps, 1e3 * dispatch / steps, 1e3 * wait / steps

    run(16)
    results = sorted((run(a.gen) for _ in range(a.runs)), key=lambda r: r[0])
    tps, b, d, w = results[len(results) // 2]
    print(json.dumps({"bench": "mlx-lm-step-split", "model": a.model.rstrip("/").split("/")[-1], "stream": a.stream,
                      "serial": a.serial,
                      "decode_tps": round(tps, 1), "trials_decode_tps": [round(r[0], 1) for r in results],
                      "build_ms": round(b, 3), "dispatch_ms": round(d, 3), "wait_ms": round(w, 3)}), flush=True)


if __name__ == "__main__":
    main()
