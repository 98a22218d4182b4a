#!/usr/bin/env bash
# Runs on the device machine (../shared/device/README.md): constrained against unconstrained
# decoding on the GPU (`bench/structured.sh`: JSON schema, json_object, regex, the lowercase
# constraint plugin; each paired with unconstrained runs in the same process) and a
# constrained request in a batch of 8 through `host serve` (`bench/structured_batch.py`) for SmolLM2
# bfloat16 and the kit's llama-1b shape (random weights, bfloat16). Needs the MLX site
# bundle (/tmp/site) and the data bundle (/tmp/data: the SmolLM2 GGUF, gguf_to_hf.py, the
# gguf wheel).
#   bash bench/device/structured.sh /tmp/host
set -uo pipefail
HOST=${1:-/tmp/host}
. /tmp/site/env.sh
export PYTHONPATH=$PYTHONPATH:$(ls /tmp/data/whl/gguf-*.whl)
M=/dev/shm/m
mkdir -p $M
echo "== device"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
lscpu | grep -m1 'Model name'
[ -f $M/smollm2-bfloat16/model.safetensors ] ||
  python3 /tmp/data/gguf_to_hf.py /tmp/data/SmolLM2-135M-Instruct.Q4_1.gguf $M/smollm2-bfloat16 --dtype bfloat16 > /dev/null
bash bench/device/kit-models.sh llama-1b
for model in $M/smollm2-bfloat16 /tmp/llama-1b; do
  echo "== $model"
  RUNS=${RUNS:-5} GEN=${GEN:-200} bash bench/structured.sh "$HOST" --model "$model" --device gpu
  timeout 240 python3 bench/structured_batch.py --host "$HOST" --model "$model" --device gpu --clients 8 --max-tokens 128
done
