#!/usr/bin/env python3
"""A constrained row in a running batch, through `host serve`: does it slow the others?

    bench/structured_batch.py --host target/release/host --model DIR [--device cpu|gpu]
        [--clients 8] [--max-tokens 128] [--rounds 3]

Starts `host serve` on a free loopback port and warms it up. Then, for each of three mixes
of N concurrent greedy completions (`/v1/completions`, so models without a chat template
serve too; all unconstrained; one with `response_format: json_schema` and N-1 without; all
constrained), measures the aggregate completion tok/s
(tokens over the wall time of the round), every request's mean tok/s (completion tokens over
its latency: the rate its client sees) and the unconstrained requests' mean tok/s, median over
rounds, and prints a markdown table with each mix's ratios to the unconstrained one and its
mean completion length. The aggregate also counts length: a JSON answer that ends early
leaves the batch with fewer rows for the rest of the round (a host-bound step costs about the
same with fewer rows), so the per-request rate is the decode speed to compare. Only the
standard library is needed.
"""
import argparse
import concurrent.futures
import json
import socket
import statistics
import subprocess
import time
import urllib.request

SCHEMA = {"type": "object", "properties": {
    "people": {"type": "array", "minItems": 4, "maxItems": 8, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
        "required": ["name", "age", "city", "hobbies"]}}}, "required": ["people"]}
TOPICS = ["the sea", "a city at night", "an old library", "a mountain road", "a winter market", "a small robot",
          "the first snow", "a lighthouse", "a desert well", "a train journey", "a garden in spring", "a lost key"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.load(r)
    return reply["usage"]["completion_tokens"], time.perf_counter() - t


def body(i, constrained, max_tokens):
    if constrained:
        text = f"List {4 + i % 3} people who live near {TOPICS[i % len(TOPICS)]} as JSON: name, age, city, hobbies."
    else:
        text = f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}, number {i}."
    b = {"prompt": text + "\n", "max_tokens": max_tokens, "temperature": 0}
    if constrained:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    return b


def round_of(port, flags, max_tokens):
    with concurrent.futures.ThreadPoolExecutor(len(flags)) as pool:
        t = time.perf_counter()
        done = list(pool.map(lambda a: post(port, body(a[0], a[1], max_tokens)), enumerate(flags)))
        wall = time.perf_counter() - t
    free = [n / s for (n, s), c in zip(done, flags) if not c]
    every = statistics.mean(n / s for n, s in done)
    length = statistics.mean(n for n, _ in done)
    return sum(n for n, _ in done) / wall, statistics.mean(free) if free else None, every, length


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="target/release/host")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([a.host, "serve", "--model", a.model, "--port", str(port), "--device", a.device],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        n = a.clients
        mixes = {"unconstrained": [False] * n, "one constrained": [True] + [False] * (n - 1), "all constrained": [True] * n}
        round_of(port, [True, False] * 2, 16)  # warm-up (and the token trie's first build)
        results = {}
        for _ in range(a.rounds):
            for name, flags in mixes.items():
                results.setdefault(name, []).append(round_of(port, flags, a.max_tokens))
        print(f"model: {a.model}; device: {a.device}; {n} concurrent greedy completions, max_tokens {a.max_tokens}; "
              f"median of {a.rounds} rounds\n")
        print("| mix | aggregate tok/s | ratio | every request's mean tok/s | ratio "
              "| unconstrained requests' mean tok/s | ratio | mean tokens |")
        print("|---|---|---|---|---|---|---|---|")
        base = results["unconstrained"]
        base_agg, base_free, base_every = (statistics.median(r[i] for r in base) for i in (0, 1, 2))
        for name, rs in results.items():
            agg, every, length = (statistics.median(r[i] for r in rs) for i in (0, 2, 3))
            free = [r[1] for r in rs if r[1] is not None]
            free_cell = f"{statistics.median(free):.1f} | {statistics.median(free) / base_free:.2f}x" if free else "- | -"
            print(f"| {name} | {agg:.1f} | {agg / base_agg:.2f}x | {every:.1f} | {every / base_every:.2f}x "
                  f"| {free_cell} | {length:.0f} |")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
