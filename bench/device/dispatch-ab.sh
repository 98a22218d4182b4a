#!/usr/bin/env bash
# On the GPU (after `. /tmp/site/env.sh`): issue 44's batch-1 gap on a dispatch-bound step.
# The narrow Qwen3.5-35B-A3B (make_hybrid.py's `qwen3.5-35b-a3b-narrow`: the real model's
# 40 layers, 256 experts top-8 and heads at hidden 256, 4-bit — its decode graph at a sliver
# of its bytes), decoded by the host with its own 4-bit matrix-vector kernel (the default),
# by the host with MLX's (HOST_QGEMV=0), and by mlx-lm, in turn, ROUNDS rounds (default 2),
# batch 1 and 8 (BATCHES), prompt 128, 128 generated. Each engine warms up in its own process;
# ratios are read within a round (this device's speed moves by up to 30% within a call).
#   bash bench/device/dispatch-ab.sh HOST OUTDIR [MODEL_DIR]
set -uo pipefail
HOST=$1 OUTDIR=$2 MODEL=${3:-/dev/shm/n35}
BATCHES=${BATCHES:-1 8}
mkdir -p "$OUTDIR"
[ -e "$MODEL/config.json" ] || python3 bench/device/make_hybrid.py qwen3.5-35b-a3b-narrow "$MODEL" --quantize 4 2>&1 | tail -1
for round in $(seq "${ROUNDS:-2}"); do
  for engine in host host-qgemv0 mlx-lm; do
    out=$OUTDIR/$engine-$round.jsonl
    case $engine in
      host) timeout 200 "$HOST" bench --device gpu --model "$MODEL" --prompt-lengths 128 --gen 128 --runs 2 \
              --batch "$(echo $BATCHES | tr ' ' ,)" --json > "$out" 2> "$OUTDIR/$engine-$round.log" ;;
      host-qgemv0) HOST_QGEMV=0 timeout 200 "$HOST" bench --device gpu --model "$MODEL" --prompt-lengths 128 \
              --gen 128 --runs 2 --batch "$(echo $BATCHES | tr ' ' ,)" --json > "$out" 2> "$OUTDIR/$engine-$round.log" ;;
      mlx-lm) timeout 300 python3 bench/device/mlx_lm_bench.py "$MODEL" --prompt 128 --gen 128 --trials 2 \
              --batch $BATCHES --json-out "$out" > "$OUTDIR/$engine-$round.log" 2>&1 ;;
    esac || tail -3 "$OUTDIR/$engine-$round.log"
    echo "round $round $engine: $(grep -o '"batch[a-z_]*": *[0-9]*\|"decode_tps": *[0-9.]*' "$out" | tr '\n' ' ')"
  done
done | tee "$OUTDIR/dispatch-ab.txt"
