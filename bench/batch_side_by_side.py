#!/usr/bin/env python3
"""Merges `host bench --batch ... --json` rows and the device kit's `mlx-lm-bench.py --batch`
JSON lines (same models, same machine, same run) into one table of batched decode tok/s.

    bench/batch_side_by_side.py --host host.jsonl --mlx-lm mlx.jsonl

Decode tok/s counts every row's tokens (mlx-lm: `batch_generate`'s generation tok/s at
batch > 1, `stream_generate`'s decode tok/s at batch 1). Models are matched by folder name.
"""
import argparse
import json


def load(path):
    return [json.loads(line) for line in open(path) if line.strip().startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", required=True)
    ap.add_argument("--mlx-lm", required=True)
    a = ap.parse_args()
    host = {(r["model"], r["batch"]): r for r in load(a.host) if "batch" in r}
    mlx = {(r["model"], r.get("batch", 1)): r for r in load(a.mlx_lm) if "decode_tps" in r}
    print("| model | batch | mlx-lm decode tok/s | host decode tok/s | host/mlx-lm | host per stream | host TTFT ms (all rows) |")
    print("|---|---|---|---|---|---|---|")
    for (m, b), h in host.items():
        x = mlx.get((m, b))
        cells = [m, str(b), f"{x['decode_tps']:.1f}" if x else "-", f"{h['decode_tps']:.1f}",
                 f"{h['decode_tps'] / x['decode_tps']:.2f}x" if x else "-", f"{h['per_stream_decode_tps']:.1f}",
                 f"{h['ttft_ms']:.0f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
