#!/usr/bin/env bash
# On the H200 (after `. /tmp/site/env.sh`): batched decoding, host against mlx-lm's
# `batch_generate` in one call (issue 19): the kit's Llama-3.2-1B and Llama-3.1-8B shapes in
# bf16 and the 8B in 4-bit (group 64), 512-token prompts, 128 generated, batch 1, 8 and 32
# (`host bench --batch`, `mlx-lm-bench.py --batch`), merged by bench/batch_side_by_side.py.
#   bash bench/device/batch.sh HOST OUTDIR [MODEL...]   (default: llama-1b llama-8b llama-8b-q4)
set -uo pipefail
HOST=$1 OUTDIR=$2
shift 2
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(llama-1b llama-8b llama-8b-q4)
BATCHES=${BATCHES:-1 8 32}
mkdir -p "$OUTDIR"
for m in "${models[@]}"; do
  case $m in
    llama-8b|llama-8b-q4) [ -f /tmp/llama-8b-q4/config.json ] || python3 .device/kit/make-model.py llama-8b /tmp/llama-8b --quantize 4 > /dev/null ;;
    *) [ -f /tmp/$m/config.json ] || python3 .device/kit/make-model.py "$m" /tmp/"$m" > /dev/null ;;
  esac
  echo "== $m"
  timeout 400 python3 .device/kit/mlx-lm-bench.py /tmp/"$m" --prompt 512 --gen 128 --trials 2 --batch $BATCHES \
    --json-out "$OUTDIR/mlx-$m.jsonl" > "$OUTDIR/mlx-$m.log" 2>&1 || tail -5 "$OUTDIR/mlx-$m.log"
  timeout 400 "$HOST" bench --device gpu --model /tmp/"$m" --prompt-lengths 512 --gen 128 --runs 2 \
    --batch "$(echo $BATCHES | tr ' ' ,)" --json > "$OUTDIR/host-$m.jsonl" 2> "$OUTDIR/host-$m.log" || tail -5 "$OUTDIR/host-$m.log"
  cat "$OUTDIR/host-$m.jsonl"
done
cat "$OUTDIR"/mlx-*.jsonl > "$OUTDIR/mlx-lm.jsonl" 2>/dev/null
cat "$OUTDIR"/host-*.jsonl > "$OUTDIR/host.jsonl" 2>/dev/null
python3 bench/batch_side_by_side.py --host "$OUTDIR/host.jsonl" --mlx-lm "$OUTDIR/mlx-lm.jsonl" | tee "$OUTDIR/batch.md"
