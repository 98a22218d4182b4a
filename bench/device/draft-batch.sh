#!/usr/bin/env bash
# On the GPU (after `. /tmp/site/env.sh`): rows speculating with a draft model (issue 45),
# drafting as one batch of the draft model (the default) against row by row
# (HOST_DRAFT_BATCH=0), every draft verified (HOST_DRAFT_COST=off, so both verify the same
# steps), the edit prompt (bench/edit_prompt.txt), 128 generated, batch 1, 8 and 32; every
# run paired with a plain batch of the same rows in the same process. TARGET and DRAFT are
# kit shapes (random weights, made here) or paths; a model drafting for itself accepts
# every draft, random weights of another shape almost none.
#   [DEVICE=cpu] bash bench/device/draft-batch.sh HOST OUTDIR TARGET DRAFT [BATCHES]   (default 1,8,32)
set -uo pipefail
HOST=$1 OUTDIR=$2 TARGET=$3 DRAFT=$4 BATCHES=${5:-1,8,32}
mkdir -p "$OUTDIR"
path() { case $1 in /*) echo "$1" ;; *) bash bench/device/kit-models.sh "$1" >&2; echo "/tmp/$1" ;; esac; }
target=$(path "$TARGET") draft=$(path "$DRAFT")
name="$(basename "$target")-drafted-by-$(basename "$draft")"
for together in 1 0; do
  label=$([ $together = 1 ] && echo together || echo "row by row")
  echo "== $name, drafting $label"
  HOST_DRAFT_COST=off HOST_DRAFT_BATCH=$together timeout "${TIMEOUT:-280}" "$HOST" bench --device "${DEVICE:-gpu}" --model "$target" \
    --draft-model "$draft" --prompt-file bench/edit_prompt.txt --gen 128 --runs 3 --batch "$BATCHES" --json \
    > "$OUTDIR/$name-$together.jsonl" 2> "$OUTDIR/$name-$together.log" || tail -5 "$OUTDIR/$name-$together.log"
  python3 bench/device/spec_rows.py "$OUTDIR/$name-$together.jsonl" "$label" | tee -a "$OUTDIR/draft-batch.md"
done
