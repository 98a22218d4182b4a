#!/usr/bin/env python3
"""Merges `host bench --json` rows and the device kit's `mlx-lm-bench.py` JSON lines (same
models, same machine, same run) into one markdown table of host vs mlx-lm.

    bench/side_by_side.py --host host.jsonl --mlx-lm mlx.jsonl [--decode-prompt 512]

Decode tok/s is compared at --decode-prompt tokens of prompt; prefill at every prompt length
both have. Models are matched by folder name.
"""
import argparse
import json


def load(path):
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", required=True)
    ap.add_argument("--mlx-lm", required=True)
    ap.add_argument("--decode-prompt", type=int, default=512)
    a = ap.parse_args()
    host = {(r["model"], r["prompt_tokens"]): r for r in load(a.host)}
    mlx = {(r["model"], r["prompt"]): r for r in load(a.mlx_lm) if r.get("batch", 1) == 1 and "decode_tps" in r}
    models = list(dict.fromkeys(m for m, _ in host))
    lengths = sorted({p for _, p in host if any((m, p) in mlx for m in models)})
    print("| model | weights/token GB | floor tok/s | mlx-lm decode | host decode | host/mlx-lm | host % of floor | "
          + " | ".join(f"prefill {p}: mlx-lm / host / ratio" for p in lengths) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(lengths))
    for m in models:
        h, x = host.get((m, a.decode_prompt)), mlx.get((m, a.decode_prompt))
        if not h:
            continue
        floor = h.get("floor_tps")
        cells = [m, f"{h['weight_bytes_per_token'] / 1e9:.3f}", f"{floor:.0f}" if floor else "-"]
        cells += [f"{x['decode_tps']:.1f}" if x else "-", f"{h['decode_tps']:.1f}",
                  f"{h['decode_tps'] / x['decode_tps']:.2f}x" if x else "-",
                  f"{h['pct_of_floor']:.0f}%" if h.get("pct_of_floor") else "-"]
        for p in lengths:
            hp, xp = host.get((m, p)), mlx.get((m, p))
            if hp and xp:
                cells.append(f"{xp['prefill_tps']:.0f} / {hp['prefill_tps']:.0f} / {hp['prefill_tps'] / xp['prefill_tps']:.2f}x")
            else:
                cells.append("-")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
