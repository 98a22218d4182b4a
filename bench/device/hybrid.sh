#!/usr/bin/env bash
# On the H200 (after `. /tmp/site/env.sh`): issue 44's side by side with mlx-lm in one call.
# Random weights in real Qwen3.5 / Gemma 4 shapes (bench/device/make_hybrid.py, mlx-lm's own
# model classes), 512-token prompts, 128 generated, batch 1 and 8 (`host bench --batch`,
# `mlx-lm-bench.py --batch`: mlx-lm's stream_generate and batch_generate), merged by
# bench/batch_side_by_side.py.
#   bash bench/device/hybrid.sh HOST OUTDIR SHAPE[:q4]...   (ENGINES=host or mlx-lm: only that one)
set -uo pipefail
HOST=$1 OUTDIR=$2
shift 2
BATCHES=${BATCHES:-1 8}
GEN=${GEN:-128}
mkdir -p "$OUTDIR"
for spec in "$@"; do
  shape=${spec%%:*} q=${spec#*:}
  dir=/dev/shm/m/$shape
  if [ "$q" = q4 ]; then dir=$dir-q4; fi
  echo "== $spec ($(date +%T))"
  python3 bench/device/make_hybrid.py "$shape" "$dir" $([ "$q" = q4 ] && echo --quantize 4) 2>&1 | tail -2
  name=$(basename "$dir")
  [ "${ENGINES:-both}" = host ] || timeout 420 python3 bench/device/mlx_lm_bench.py "$dir" --prompt 512 --gen "$GEN" --trials 2 --batch $BATCHES \
    --json-out "$OUTDIR/mlx-$name.jsonl" > "$OUTDIR/mlx-$name.log" 2>&1 || tail -5 "$OUTDIR/mlx-$name.log"
  [ "${ENGINES:-both}" = mlx-lm ] || timeout 420 "$HOST" bench --device gpu --model "$dir" --prompt-lengths 512 --gen "$GEN" --runs 2 \
    --batch "$(echo $BATCHES | tr ' ' ,)" --json > "$OUTDIR/host-$name.jsonl" 2> "$OUTDIR/host-$name.log" \
    || tail -5 "$OUTDIR/host-$name.log"
  rm -rf "$dir"
done
cat "$OUTDIR"/mlx-*.jsonl > "$OUTDIR/mlx-lm.jsonl" 2>/dev/null
cat "$OUTDIR"/host-*.jsonl > "$OUTDIR/host.jsonl" 2>/dev/null
python3 bench/batch_side_by_side.py --host "$OUTDIR/host.jsonl" --mlx-lm "$OUTDIR/mlx-lm.jsonl" | tee "$OUTDIR/side.md"
