#!/usr/bin/env python3
"""Greedy parity of `host generate` with mlx-lm on the GPU (MLX CUDA backend), run on the
device machine: for each model folder, mlx-lm's ids (tests/oracle/mlx_lm_oracle.py with
HOST_ORACLE_DEVICE=gpu) against `host generate --json --device gpu`, three chat prompts.

    gpu_parity.py --host /tmp/host --oracle tests/oracle/mlx_lm_oracle.py \
        --max-tokens 32 MODEL_DIR...

Prints one markdown row per (model, prompt) and exits 1 if any ids differ.
"""
import argparse
import json
import os
import subprocess
import sys

PROMPTS = ["What is the capital of France?", "Write a haiku about the ocean.", "List three primary colors."]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--oracle", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("models", nargs="+")
    a = ap.parse_args()
    env = dict(os.environ, HOST_ORACLE_DEVICE="gpu")
    bad = 0
    print("| model | prompt | ids equal | first difference | host gen tok/s |")
    print("|---|---|---|---|---|")
    for model in a.models:
        out = subprocess.run([sys.executable, a.oracle, model, str(a.max_tokens), *PROMPTS],
                             env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"| {os.path.basename(model)} | oracle failed | | {out.stderr[-300:]!r} | |")
            bad += 1
            continue
        ref = [json.loads(l) for l in out.stdout.splitlines()]
        for p, r in zip(PROMPTS, ref):
            h = subprocess.run([a.host, "generate", "--json", "--device", "gpu", "--model", model,
                                "--max-tokens", str(a.max_tokens), "--prompt", p], capture_output=True, text=True)
            if h.returncode != 0:
                print(f"| {os.path.basename(model)} | {p} | host failed | {h.stderr[-300:]!r} | |")
                bad += 1
                continue
            got = json.loads(h.stdout)
            same = got["token_ids"] == r["gen_ids"] and got["prompt_token_ids"] == r["prompt_ids"]
            diff = next((i for i, (x, y) in enumerate(zip(got["token_ids"], r["gen_ids"])) if x != y), None)
            bad += 0 if same else 1
            print(f"| {os.path.basename(model)} | {p} | {'yes' if same else 'NO'} | "
                  f"{'' if same else diff} | {got['generation_tps']:.1f} |", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
