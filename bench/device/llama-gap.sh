#!/usr/bin/env bash
# On the device (after `. /tmp/site/env.sh`): the Llama-shape A/B of bench/NOTES.md. Makes
# the Llama-3.2-1B shape twice — as is (llama3 RoPE scaling: rope with explicit freqs) and with
# the scaling removed (plain RoPE) — plus the Qwen2.5-0.5B shape for reference, and measures
# decode with host bench and mlx-lm on each, in one run.
#   bash bench/device/llama-gap.sh HOST OUTDIR
set -uo pipefail
HOST=$1 OUTDIR=$2
mkdir -p "$OUTDIR"
python3 .device/kit/make-model.py llama-1b /tmp/gap/llama-1b > /dev/null
rm -rf /tmp/gap/llama-1b-plainrope && cp -r /tmp/gap/llama-1b /tmp/gap/llama-1b-plainrope
python3 - /tmp/gap/llama-1b-plainrope/config.json <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.pop("rope_scaling", None)
if isinstance(c.get("rope_parameters"), dict):
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_parameters"].get("rope_theta", c.get("rope_theta"))}
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
python3 .device/kit/make-model.py qwen-0.5b /tmp/gap/qwen-0.5b > /dev/null
for m in /tmp/gap/llama-1b /tmp/gap/llama-1b-plainrope /tmp/gap/qwen-0.5b; do
  name=$(basename "$m")
  timeout 300 python3 .device/kit/mlx-lm-bench.py "$m" --prompt 512 --gen 128 --trials 3 --copy-bw 4221 \
    --json-out "$OUTDIR/mlx-$name.jsonl" > "$OUTDIR/mlx-$name.log" 2>&1 || tail -5 "$OUTDIR/mlx-$name.log"
  cat "$OUTDIR/mlx-$name.jsonl" >> "$OUTDIR/mlx-lm.jsonl"
  timeout 300 "$HOST" bench --device gpu --model "$m" --prompt-lengths 512 --gen 128 --runs 3 --bandwidth 4221 \
    --json >> "$OUTDIR/host.jsonl" 2> "$OUTDIR/host-$name.log" || tail -5 "$OUTDIR/host-$name.log"
done
python3 bench/side_by_side.py --host "$OUTDIR/host.jsonl" --mlx-lm "$OUTDIR/mlx-lm.jsonl" | tee "$OUTDIR/llama-gap.md"
