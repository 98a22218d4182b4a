#!/usr/bin/env python3
"""Speculation inside the batch: plain vs prompt-lookup requests under N concurrent clients,
with speculative requests as batch rows and as they were before (decoded alone beside the
batch, `HOST_SPEC_ROWS=0`), in one run.

    bench/spec_batch.py --model DIR|FILE [--host target/release/host] [--clients 1,8]
        [--max-tokens 160] [--rounds 2] [--device cpu|gpu] [--draft-model DIR]

Workload: edit-style prompts (bench/edit_prompt.txt's file, each client asking for a
different rename, so most of what the model writes is in its prompt), greedy, streamed
chat completions of `--max-tokens` each. Two servers on free loopback ports, started from
the same binary: "rows" (this build) and "beside" (`HOST_SPEC_ROWS=0`). For each client
count: plain requests to "rows", `"speculative": "prompt-lookup"` requests to "rows" and to
"beside" (and with --draft-model, `"draft"` to both and to a third server, "alone", whose
rows each run the draft model alone, `HOST_DRAFT_BATCH=0`); the median aggregate tok/s of
--rounds (tokens streamed by all clients over the wall time from the first request to the
last token). Prints a markdown table with each mode's ratio to plain in the same run, the
rows/beside ratio, tokens per target step (`usage.speculative`), and whether every reply's
text equals the plain reply's (greedy speculation is exact). The modes take turns within
each round, so the machine's drift falls on all of them alike.

Run it with the e2e virtualenv's Python (it needs httpx).
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import Server, free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RENAMES = [("merge", "merge_configs"), ("load_config", "read_config"), ("save_config", "write_config"),
           ("merge", "combine"), ("load_config", "load_settings"), ("save_config", "store_config"),
           ("merge", "merge_dicts"), ("load_config", "open_config")]


def prompts():
    base = open(os.path.join(HERE, "edit_prompt.txt")).read()
    ask = "Rewrite the whole file, renaming the function merge to merge_configs."
    assert ask in base
    return [base.replace(ask, f"Rewrite the whole file, renaming the function {a} to {b}.") for a, b in RENAMES]


def stream(server, text, max_tokens, speculative):
    """One streamed greedy chat request: (start, end, tokens, text, usage)."""
    body = {"model": server.model, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": text}]}
    # "off" for the plain requests: a server with --draft-model speculates unless told not to.
    body["speculative"] = speculative or "off"
    start, out, usage = time.time(), [], {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event.get("choices") or []:
                out.append((c.get("delta") or {}).get("content") or "")
    return start, time.time(), usage.get("completion_tokens", 0), "".join(out), usage


def load(server, texts, clients, max_tokens, speculative):
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda i: stream(server, texts[i % len(texts)], max_tokens, speculative), range(clients)))
    t0, t1 = min(r[0] for r in runs), max(r[1] for r in runs)
    tokens = sum(r[2] for r in runs)
    spec = [r[4].get("speculative") or {} for r in runs]
    steps = sum(s.get("target_steps", 0) for s in spec)
    return {"aggregate": tokens / (t1 - t0), "texts": [r[3] for r in runs],
            "per_step": tokens / steps if steps else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="target/release/host")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--draft-model")
    ap.add_argument("--max-batch", type=int, default=8)
    a = ap.parse_args()
    texts = prompts()
    cmd = lambda port: [a.host, "serve", "--model", a.model, "--device", a.device, "--port", str(port),  # noqa: E731
                        "--max-batch", str(a.max_batch)] + (["--draft-model", a.draft_model] if a.draft_model else [])
    port_rows, port_beside = free_port(), free_port()
    rows = Server("rows", cmd(port_rows), port_rows)
    beside = Server("beside", cmd(port_beside), port_beside, env={"HOST_SPEC_ROWS": "0"})
    modes = [("plain", rows, None), ("lookup rows", rows, "prompt-lookup"), ("lookup beside", beside, "prompt-lookup")]
    servers = [rows, beside]
    if a.draft_model:
        # A third server whose rows each run the draft model alone (`HOST_DRAFT_BATCH=0`).
        port_alone = free_port()
        alone = Server("alone", cmd(port_alone), port_alone, env={"HOST_DRAFT_BATCH": "0"})
        servers.append(alone)
        modes += [("draft rows", rows, "draft"), ("draft rows drafting alone", alone, "draft"),
                  ("draft beside", beside, "draft")]
    try:
        for server in servers:  # warm-up: every shape once
            load(server, texts, 2, 16, "prompt-lookup")
            load(server, texts, 2, 16, None)
        results = {}
        for clients in [int(c) for c in a.clients.split(",")]:
            got = {name: [] for name, _, _ in modes}
            for _ in range(a.rounds):
                for name, server, spec in modes:
                    got[name].append(load(server, texts, clients, a.max_tokens, spec))
            for name, runs in got.items():
                results[(clients, name)] = {
                    "aggregate": statistics.median(g["aggregate"] for g in runs),
                    "spread": (min(g["aggregate"] for g in runs), max(g["aggregate"] for g in runs)),
                    "texts": runs[0]["texts"], "per_step": runs[0]["per_step"]}
    finally:
        for server in servers:
            server.stop()
    print(f"\nmodel {a.model}, {a.device}, {a.max_tokens} tokens per client, greedy, median of {a.rounds} rounds\n")
    print("| clients | mode | aggregate tok/s (min-max) | vs plain | rows / beside | tokens per step | text = plain |")
    print("|---|---|---|---|---|---|---|")
    for clients in [int(c) for c in a.clients.split(",")]:
        plain = results[(clients, "plain")]
        for name, _, _ in modes:
            r = results[(clients, name)]
            other = name.split(" rows")[0] + " beside"
            vs_beside = (f"{r['aggregate'] / results[(clients, other)]['aggregate']:.2f}x"
                         if " rows" in name else "")
            per_step = f"{r['per_step']:.2f}" if r["per_step"] else ""
            print(f"| {clients} | {name} | {r['aggregate']:.1f} ({r['spread'][0]:.1f}-{r['spread'][1]:.1f}) | "
                  f"{r['aggregate'] / plain['aggregate']:.2f}x | {vs_beside} | {per_step} | "
                  f"{r['texts'] == plain['texts']} |")


if __name__ == "__main__":
    main()
