#!/usr/bin/env bash
# On the H200 (after `. /tmp/site/env.sh`): issue 6's whole side-by-side table in one call
# (~6 min): the kit's Llama-3.1-8B shape in bf16 and 4-bit (group 64), Llama-3.2-1B and
# Qwen2.5-0.5B shapes, and SmolLM2-135M bf16 when the data bundle is in /tmp/data; each run
# by bench/device/side-by-side.sh (mlx-lm, then `host bench`, merged into one ratio table).
#   bash bench/device/side-by-side-all.sh HOST OUTDIR
set -uo pipefail
HOST=$1 OUTDIR=$2
# `--quantize 4` also writes the 4-bit copy to OUT-q4.
[ -f /tmp/llama-8b-q4/config.json ] || python3 .device/kit/make-model.py llama-8b /tmp/llama-8b --quantize 4 > /dev/null
for m in llama-1b qwen-0.5b; do
  [ -f /tmp/$m/config.json ] || python3 .device/kit/make-model.py $m /tmp/$m > /dev/null
done
models=(/tmp/llama-8b /tmp/llama-8b-q4 /tmp/llama-1b /tmp/qwen-0.5b)
if [ -d /tmp/data/whl ]; then
  . bench/device/smollm2-models.sh
  models+=("$M/smollm2-bfloat16")
fi
bash bench/device/side-by-side.sh "$HOST" "$OUTDIR" "${models[@]}"
