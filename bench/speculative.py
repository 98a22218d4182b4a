#!/usr/bin/env python3
"""Speculative decoding: plain vs prompt lookup vs a draft model, host and mlx-lm, one run.

    bench/speculative.py --model DIR [--draft-model DIR] [--host target/release/host]
        [--oracle-python PY] [--device cpu|gpu] [--max-tokens 256] [--runs 3]

Two workloads: "edit" (bench/edit_prompt.txt: a source file and a request to rewrite it
with a small change — the text the model writes is mostly in the prompt) and "chat" (a
free-form story: little to look up). For each, `host generate --json` runs plain, with
`--speculative prompt-lookup` (on the GPU also with `--draft-candidates 8`) and (with
--draft-model) `--draft-model` (each `host bench
--prompt-file`: one process, a warm-up generation, then --runs timed ones); mlx-lm runs plain
and with its own draft-model speculation, also warmed up in-process. All greedy, chat
template; decode tok/s = (tokens - 1) / (first-to-last token time), median of --runs.
The host's warm-up generates from random tokens, so its first timed run meets the prompt's
verification shapes unseen, as a live request does (a cost paid per new shape shows as
"first run" below the median).
Prints a markdown table: generation tok/s (median, and the first run's), the ratio to host
plain and to mlx-lm plain,
acceptance, tokens per target step, and whether the ids equal the plain run's. A second
table gives each workload's prompt-lookup ceiling: the tokens per target step that lookup
would make on the plain run's text if every step verified a draft (`host bench`'s
`lookup_ceiling`, computed by the engine's own drafter), the most speculation can gain there
however cheap a verification gets.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

MLX_LM = r"""
import json, sys, time
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
    toks, ts, drafted = [], [], 0
    for r in stream_generate(model, tok, list(ids), max_tokens=a["max_tokens"], sampler=make_sampler(temp=0.0), **kw):
        toks.append(r.token); ts.append(time.perf_counter()); drafted += int(getattr(r, "from_draft", False))
    tps = (len(ts) - 1) / (ts[-1] - ts[0])
    print(json.dumps({"token_ids": toks, "decode_tps": tps, "accepted_tokens": drafted}), flush=True)
"""

CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run_host(a, prompt_file, extra):
    # `host bench` warms up in-process (GPU kernels compile on first use) and then times
    # --runs generations, as the mlx-lm side does.
    cmd = [a.host, "bench", "--json", "--device", a.device, "--model", a.model, "--prompt-file", prompt_file,
           "--gen", str(a.max_tokens), "--runs", str(a.runs), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"host {extra} failed:\n{p.stderr}")
    row = json.loads(p.stdout)
    return [dict(row, same_runs=row["runs_identical"])]


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
    ap.add_argument("--skip-mlx-draft", action="store_true", help="leave out mlx-lm's draft-model speculation")
    a = ap.parse_args()
    chat_file = os.path.join(tempfile.mkdtemp(), "chat.txt")
    open(chat_file, "w").write(CHAT)
    workloads = {"edit": os.path.join(HERE, "edit_prompt.txt"), "chat": chat_file}
    k = ["--num-draft-tokens", str(a.num_draft_tokens)]
    print(f"model: {a.model}; draft: {a.draft_model or '-'}; device: {a.device}; greedy; "
          f"max {a.max_tokens} tokens; median of {a.runs} runs after a warm-up\n")
    ceilings = []
    print("| workload | engine | tokens | generation tok/s | first run tok/s | vs host plain | vs mlx-lm plain | acceptance | tokens/step | same ids |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, prompt_file in workloads.items():
        prompt = open(prompt_file).read()
        rows = [("host plain", run_host(a, prompt_file, []))]
        rows.append(("host prompt-lookup", run_host(a, prompt_file, ["--speculative", "prompt-lookup", *k])))
        if a.device == "gpu":
            # Eight candidate continuations verified per step as one batch (the default is one).
            rows.append(("host prompt-lookup, 8 candidates",
                         run_host(a, prompt_file, ["--speculative", "prompt-lookup", "--draft-candidates", "8", *k])))
        if a.draft_model:
            rows.append(("host draft", run_host(a, prompt_file, ["--draft-model", a.draft_model, *k])))
        rows.append(("mlx-lm plain", run_mlx_lm(a, prompt, None)))
        if a.draft_model and not a.skip_mlx_draft:
            rows.append((f"mlx-lm draft (k={a.mlx_draft_tokens})", run_mlx_lm(a, prompt, a.draft_model)))
        tps = {label: statistics.median(r["decode_tps"] for r in runs) for label, runs in rows}
        plain_ids = rows[0][1][0]["token_ids"]
        for label, runs in rows:
            r = runs[0]
            n = len(r["token_ids"])
            if "drafted_tokens" in r:
                acc = f"{r['accepted_tokens'] / r['drafted_tokens']:.0%}" if r["drafted_tokens"] else "-"
                per_step = f"{r['tokens_per_step']:.2f}"
            elif "draft" in label:
                acc, per_step = f"{r['accepted_tokens']}/{n} tokens drafted", "-"
            else:
                acc, per_step = "-", "1.00"
            same = "yes" if all(x["token_ids"] == plain_ids and x.get("same_runs", True) for x in runs) else "NO"
            first = r.get("first_decode_tps", r["decode_tps"])
            print(f"| {name} | {label} | {n} | {tps[label]:.1f} | {first:.1f} | {tps[label] / tps['host plain']:.2f}x | "
                  f"{tps[label] / tps['mlx-lm plain']:.2f}x | {acc} | {per_step} | {same} |")
        plain = rows[0][1][0]
        ceilings.append((name, len(plain_ids), plain["lookup_ceiling"], plain["lookup_ceiling_unbounded"]))
    print(f"\n| workload | tokens | prompt-lookup ceiling, tokens/step: at most {a.num_draft_tokens} drafted | unbounded |")
    print("|---|---|---|---|")
    for name, n, bounded, unbounded in ceilings:
        print(f"| {name} | {n} | {bounded:.2f} | {unbounded:.2f} |")


if __name__ == "__main__":
    main()
