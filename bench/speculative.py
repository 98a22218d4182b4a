#!/usr/bin/env python3
"""Speculative decoding: plain vs prompt lookup vs a draft model, host and mlx-lm, one run.

    bench/speculative.py --model DIR [--draft-model DIR] [--host target/release/host]
        [--oracle-python PY] [--device cpu|gpu] [--max-tokens 256] [--runs 3]

Two workloads: "edit" (bench/edit_prompt.txt: a source file and a request to rewrite it
with a small change — the text the model writes is mostly in the prompt) and "chat" (a
free-form story: little to look up). For each, `host generate --json` runs plain, with
`--speculative prompt-lookup` and (with --draft-model) `--draft-model`; mlx-lm runs plain
and with its own draft-model speculation. All greedy, chat template, median of --runs.
Prints a markdown table: generation tok/s, the ratio to host plain and to mlx-lm plain,
acceptance, tokens per target step, and whether the ids equal the plain run's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

MLX_LM = r"""
import json, sys
import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
a = json.loads(sys.argv[1])
mx.set_default_device(mx.gpu if a["device"] == "gpu" else mx.cpu)
model, tok = load(a["model"])
draft = load(a["draft"])[0] if a.get("draft") else None
ids = tok.apply_chat_template([{"role": "user", "content": a["prompt"]}], add_generation_prompt=True)
if isinstance(ids, dict): ids = ids["input_ids"]
kw = {"draft_model": draft, "num_draft_tokens": a["k"]} if draft is not None else {}
for _ in range(a["runs"]):
    toks, last, drafted = [], None, 0
    for r in stream_generate(model, tok, list(ids), max_tokens=a["max_tokens"], sampler=make_sampler(temp=0.0), **kw):
        toks.append(r.token); last = r; drafted += int(getattr(r, "from_draft", False))
    print(json.dumps({"token_ids": toks, "generation_tps": last.generation_tps, "accepted_tokens": drafted}), flush=True)
"""

CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run_host(a, prompt, extra):
    cmd = [a.host, "generate", "--json", "--device", a.device, "--model", a.model,
           "--prompt", "-", "--max-tokens", str(a.max_tokens), *extra]
    outs = []
    for _ in range(a.runs + 1):  # the first run warms up (GPU kernel compilation)
        p = subprocess.run(cmd, input=prompt, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"host {extra} failed:\n{p.stderr}")
        outs.append(json.loads(p.stdout))
    return outs[1:]


def run_mlx_lm(a, prompt, draft):
    args = {"model": a.model, "draft": draft, "prompt": prompt, "max_tokens": a.max_tokens,
            "runs": a.runs + 1, "device": a.device, "k": a.mlx_draft_tokens}
    p = subprocess.run([a.oracle_python, "-c", MLX_LM, json.dumps(args)], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"mlx-lm failed:\n{p.stderr}")
    return [json.loads(l) for l in p.stdout.strip().splitlines()][1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model")
    ap.add_argument("--host", default="target/release/host")
    ap.add_argument("--oracle-python", default=os.path.expanduser("~/.cache/host/oracle/bin/python"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=8, help="host: the most drafted per step")
    ap.add_argument("--mlx-draft-tokens", type=int, default=3, help="mlx-lm: drafted per step (fixed)")
    a = ap.parse_args()
    workloads = {"edit": open(os.path.join(HERE, "edit_prompt.txt")).read(), "chat": CHAT}
    k = ["--num-draft-tokens", str(a.num_draft_tokens)]
    print(f"model: {a.model}; draft: {a.draft_model or '-'}; device: {a.device}; greedy; "
          f"max {a.max_tokens} tokens; median of {a.runs} runs after a warm-up\n")
    print("| workload | engine | tokens | generation tok/s | vs host plain | vs mlx-lm plain | acceptance | tokens/step | same ids |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, prompt in workloads.items():
        rows = [("host plain", run_host(a, prompt, []))]
        rows.append(("host prompt-lookup", run_host(a, prompt, ["--speculative", "prompt-lookup", *k])))
        if a.draft_model:
            rows.append(("host draft", run_host(a, prompt, ["--draft-model", a.draft_model, *k])))
        rows.append(("mlx-lm plain", run_mlx_lm(a, prompt, None)))
        if a.draft_model:
            rows.append((f"mlx-lm draft (k={a.mlx_draft_tokens})", run_mlx_lm(a, prompt, a.draft_model)))
        tps = {label: statistics.median(r["generation_tps"] for r in runs) for label, runs in rows}
        plain_ids = rows[0][1][0]["token_ids"]
        for label, runs in rows:
            r = runs[0]
            n = len(r["token_ids"])
            if "drafted_tokens" in r:
                acc = f"{r['acceptance_rate']:.0%}" if r["drafted_tokens"] else "-"
                per_step = f"{r['tokens_per_step']:.2f}"
            elif "draft" in label:
                acc, per_step = f"{r['accepted_tokens']}/{n} tokens drafted", "-"
            else:
                acc, per_step = "-", "1.00"
            same = "yes" if all(x["token_ids"] == plain_ids for x in runs) else "NO"
            print(f"| {name} | {label} | {n} | {tps[label]:.1f} | {tps[label] / tps['host plain']:.2f}x | "
                  f"{tps[label] / tps['mlx-lm plain']:.2f}x | {acc} | {per_step} | {same} |")


if __name__ == "__main__":
    main()
