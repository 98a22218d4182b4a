#!/usr/bin/env bash
# On the H200 (after `. /tmp/site/env.sh`): speculative rows in the batch (issue 45), the
# kit's Llama-3.2-1B and Llama-3.1-8B shapes (bf16, random weights), the edit prompt
# (bench/edit_prompt.txt), 128 generated, batch 1, 8 and 32: `host bench --batch
# --speculative prompt-lookup`, every run paired with a plain batch of the same rows, with
# the draft length by measured cost (default) and with every draft verified
# (HOST_DRAFT_COST=off).
#   bash bench/device/spec-batch.sh HOST OUTDIR [MODEL...]   (default: llama-1b llama-8b)
set -uo pipefail
HOST=$1 OUTDIR=$2
shift 2
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(llama-1b llama-8b)
mkdir -p "$OUTDIR"
bash bench/device/kit-models.sh "${models[@]}"
for m in "${models[@]}"; do
  for cost in on off; do
    echo "== $m, draft cost $cost"
    env $([ $cost = off ] && echo HOST_DRAFT_COST=off) timeout 240 "$HOST" bench --device gpu --model /tmp/"$m" \
      --prompt-file bench/edit_prompt.txt --speculative prompt-lookup --gen 128 --runs 3 --batch 1,8,32 --json \
      > "$OUTDIR/spec-$m-$cost.jsonl" 2> "$OUTDIR/spec-$m-$cost.log" || tail -5 "$OUTDIR/spec-$m-$cost.log"
    python3 bench/device/spec_rows.py "$OUTDIR/spec-$m-$cost.jsonl" "$cost" | tee -a "$OUTDIR/spec-batch.md"
  done
done
