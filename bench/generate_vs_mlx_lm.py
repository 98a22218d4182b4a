#!/usr/bin/env python3
"""`host generate` against `mlx_lm` on the same model, prompt and machine, in one run.

    bench/generate_vs_mlx_lm.py --model DIR [--host target/release/host]
        [--oracle-python PY] [--prompt TEXT] [--max-tokens 128] [--runs 3]

Runs the host and mlx-lm alternately (`--runs` times each, greedy, chat template, on
`--device cpu|gpu`),
checks they generated the same token ids, and prints a markdown table of median prompt and
generation tokens/s and the host/mlx-lm ratios. mlx-lm runs twice over: with the mlx-cpu
wheel's bundled BLAS, and with Debian's OpenBLAS preloaded ahead of libmlx (LD_PRELOAD),
which is what the host binary does by linking OpenBLAS when the build machine has it
(host/build.rs); the table says which BLAS the host binary uses.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

MLX_LM = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
mx.set_default_device(mx.gpu if sys.argv[4] == "gpu" else mx.cpu)
model, tok = load(sys.argv[1])
ids = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True)
if isinstance(ids, dict): ids = ids["input_ids"]
toks, last = [], None
for r in stream_generate(model, tok, list(ids), max_tokens=int(sys.argv[3]), sampler=make_sampler(temp=0.0)):
    toks.append(r.token); last = r
print(json.dumps({"token_ids": toks, "prompt_tps": last.prompt_tps, "generation_tps": last.generation_tps,
                  "peak_memory_bytes": int(last.peak_memory * 1e9), "prompt_tokens": len(ids)}))
"""

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def run(cmd, env):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def host_blas(binary):
    out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    return "openblas" if "libopenblas" in out else "bundled"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="target/release/host")
    ap.add_argument("--oracle-python", default=os.path.expanduser("~/.cache/host/oracle/bin/python"))
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    a = ap.parse_args()

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    variants = [("mlx-lm, bundled BLAS", env)]
    if os.path.exists(OPENBLAS) and a.device == "cpu":
        variants.append(("mlx-lm, OpenBLAS preloaded", dict(env, LD_PRELOAD=OPENBLAS)))
    host_cmd = [a.host, "generate", "--json", "--device", a.device, "--model", a.model,
                "--prompt", a.prompt, "--max-tokens", str(a.max_tokens)]
    mlx_cmd = [a.oracle_python, "-c", MLX_LM, a.model, a.prompt, str(a.max_tokens), a.device]
    runs = {"host": []} | {name: [] for name, _ in variants}
    for _ in range(a.runs):
        runs["host"].append(run(host_cmd, env))
        for name, venv in variants:
            runs[name].append(run(mlx_cmd, venv))
    med = lambda name, k: statistics.median(r[k] for r in runs[name])
    ids = runs["host"][0]["token_ids"]
    same = all(r["token_ids"] == ids for rs in runs.values() for r in rs)

    print(f"model: {a.model}; {runs['host'][0].get('prompt_tokens', '?')} prompt tokens, "
          f"{len(ids)} generated; greedy; median of {a.runs} runs each; same token ids: {'yes' if same else 'NO'}\n")
    print("| engine | prompt tok/s | generation tok/s | host prompt ratio | host generation ratio |")
    print("|---|---|---|---|---|")
    hp, hg = med("host", "prompt_tps"), med("host", "generation_tps")
    print(f"| host ({host_blas(a.host) if a.device == 'cpu' else 'gpu'}) | {hp:.1f} | {hg:.2f} | | |")
    for name, _ in variants:
        mp, mg = med(name, "prompt_tps"), med(name, "generation_tps")
        print(f"| {name} | {mp:.1f} | {mg:.2f} | {hp/mp:.2f}x | {hg/mg:.2f}x |")
    if not same:
        sys.exit("token ids differ between runs: the comparison is not like for like")


if __name__ == "__main__":
    main()
