#!/usr/bin/env bash
# On the device (after `. /tmp/site/env.sh`): `host bench` and mlx-lm on the same model
# folders in one call, merged into a ratio table by bench/side_by_side.py.
#   bash bench/device/side-by-side.sh HOST OUTDIR MODEL_DIR...
# Decode at a 512-token prompt (256 generated, median of 3 after a warm-up); prefill at 512
# and 4096. Floor: weight bytes per token / 4221 GB/s (the H200's measured copy bandwidth).
set -uo pipefail
HOST=$1 OUTDIR=$2
shift 2
BW=${BW:-4221}
for m in "$@"; do
  name=$(basename "$m")
  echo "== $name"
  timeout 400 python3 .device/kit/mlx-lm-bench.py "$m" --prompt 512 --gen 256 --trials 3 --copy-bw "$BW" \
    --json-out "/tmp/mlx-$name-512.jsonl" > "/tmp/mlx-$name-512.log" 2>&1 || tail -5 "/tmp/mlx-$name-512.log"
  timeout 300 python3 .device/kit/mlx-lm-bench.py "$m" --prompt 4096 --gen 16 --trials 2 --copy-bw "$BW" \
    --json-out "/tmp/mlx-$name-4096.jsonl" > "/tmp/mlx-$name-4096.log" 2>&1 || tail -5 "/tmp/mlx-$name-4096.log"
  cat "/tmp/mlx-$name-512.jsonl" "/tmp/mlx-$name-4096.jsonl" >> "$OUTDIR/mlx-lm.jsonl" 2>/dev/null
  timeout 300 "$HOST" bench --device gpu --model "$m" --prompt-lengths 512,4096 --gen 256 --runs 3 \
    --bandwidth "$BW" --json >> "$OUTDIR/host.jsonl" 2> "/tmp/host-$name.log" || tail -5 "/tmp/host-$name.log"
  tail -2 "$OUTDIR/host.jsonl"
done
python3 bench/side_by_side.py --host "$OUTDIR/host.jsonl" --mlx-lm "$OUTDIR/mlx-lm.jsonl" | tee "$OUTDIR/side-by-side.md"
