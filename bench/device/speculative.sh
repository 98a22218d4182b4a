#!/usr/bin/env bash
# On the device (after `. /tmp/site/env.sh`, with the data bundle in /tmp/data):
# bench/speculative.py on SmolLM2 bf16 (from the kit's GGUF) with its 8-layer draft, on the GPU.
#   bash bench/device/speculative.sh HOST OUTDIR [bench/speculative.py options, e.g. --skip-mlx-draft]
set -uo pipefail
HOST=$1 OUTDIR=$2
shift 2
M=/dev/shm/m
mkdir -p $M
export PYTHONPATH=$PYTHONPATH:$(ls /tmp/data/whl/gguf-*.whl)
for dt in bfloat16 float16; do
  [ -f $M/smollm2-$dt/model.safetensors ] || python3 /tmp/data/gguf_to_hf.py /tmp/data/SmolLM2-135M-Instruct.Q4_1.gguf $M/smollm2-$dt --dtype $dt
done
[ -f $M/smollm2-draft8/model.safetensors ] || python3 .device/kit/make-layer-draft.py $M/smollm2-float16 $M/smollm2-draft8 --layers 8
timeout 500 python3 bench/speculative.py --device gpu --host "$HOST" --oracle-python python3 \
  --model $M/smollm2-bfloat16 --draft-model $M/smollm2-draft8 --runs 3 --max-tokens 256 "$@" | tee "$OUTDIR/speculative.md"
