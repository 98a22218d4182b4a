"""KV cache bytes of one sequence as its context grows: the host's caches (sliding layers
bounded to their window plus 256 positions of rollback slack), the host's with every
position kept, and mlx-lm's own (`make_prompt_cache`: `RotatingKVCache` on sliding layers),
measured in the same run on the same model. Prints a markdown table.

    python bench/kv_memory.py HF_FOLDER [HOST_MODEL] [--tokens 1024 4096 8192]

HOST_MODEL (default: HF_FOLDER) may be the GGUF file the folder was converted from. Run with
the mlx-lm oracle's Python (`scripts/test-fixtures.sh` prints it as HOST_ORACLE_PYTHON).
"""

import argparse
import json
import subprocess
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

CHUNK = 512
ROOT = Path(__file__).resolve().parent.parent


def mlx_lm_bytes(folder, lengths):
    model, _ = load(folder)
    vocab = model.args.vocab_size
    cache = make_prompt_cache(model)
    out, done = [], 0
    for n in lengths:
        while done < n:
            size = min(CHUNK, n - done)
            ids = mx.array([[(i * 7919 + 13) % vocab for i in range(done, done + size)]])
            mx.eval(model.model(ids, cache=cache))
            done += size
        out.append(sum(c.nbytes for c in cache))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("host_model", nargs="?")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    a = p.parse_args()
    lengths = sorted(a.tokens)
    subprocess.run(["cargo", "build", "-q", "-p", "models", "--example", "kv_memory"], cwd=ROOT, check=True)
    cmd = [str(ROOT / "target/debug/examples/kv_memory"), a.host_model or a.folder]
    rows = [json.loads(line) for line in subprocess.run(cmd + [str(n) for n in lengths], cwd=ROOT,
                                                        check=True, capture_output=True, text=True).stdout.splitlines()]
    theirs = mlx_lm_bytes(a.folder, lengths)
    mb = lambda b: f"{b / 1e6:.1f}"
    print("| context | mlx-lm KV MB | host KV MB | host/mlx-lm | host, every position kept, MB |")
    print("|---|---|---|---|---|")
    for r, m in zip(rows, theirs):
        print(f"| {r['tokens']} | {mb(m)} | {mb(r['host'])} | {r['host'] / m:.2f}x | {mb(r['host_full'])} |")


if __name__ == "__main__":
    main()
