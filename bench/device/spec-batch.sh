#!/usr/bin/env bash
# On the GPU (after `. /tmp/site/env.sh`): speculative rows in the batch (issue 45), the
# edit prompt (bench/edit_prompt.txt), 128 generated, batch 1, 8 and 32: `host bench --batch
# --speculative prompt-lookup`, every run paired with a plain batch of the same rows, under
# each draft rule of COSTS (default "on off"): on = the draft length by measured cost (the
# default), off = every draft verified (HOST_DRAFT_COST=off).
# MODEL is a kit shape (random weights, made here: llama-1b, llama-8b) or a path (a real
# model, e.g. a GGUF file carried to the device).
#   bash bench/device/spec-batch.sh HOST OUTDIR [MODEL...]   (default: llama-1b llama-8b)
set -uo pipefail
HOST=$1 OUTDIR=$2
shift 2
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(llama-1b llama-8b)
mkdir -p "$OUTDIR"
for m in "${models[@]}"; do
  case $m in
    /*) path=$m name=$(basename "$m") ;;
    *) path=/tmp/$m name=$m; bash bench/device/kit-models.sh "$m" ;;
  esac
  for cost in ${COSTS:-on off}; do
    echo "== $name, draft rule $cost"
    env $([ $cost != on ] && echo HOST_DRAFT_COST=$cost) timeout 240 "$HOST" bench --device gpu --model "$path" \
      --prompt-file bench/edit_prompt.txt --speculative prompt-lookup --gen 128 --runs 3 --batch 1,8,32 --json \
      > "$OUTDIR/spec-$name-$cost.jsonl" 2> "$OUTDIR/spec-$name-$cost.log" || tail -5 "$OUTDIR/spec-$name-$cost.log"
    python3 bench/device/spec_rows.py "$OUTDIR/spec-$name-$cost.jsonl" "$cost" | tee -a "$OUTDIR/spec-batch.md"
  done
done
