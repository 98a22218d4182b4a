#!/usr/bin/env bash
# Runs on the device machine: constrained requests through `host serve`
# (`bench/structured_batch.py`: unconstrained, one json_schema request among them, all
# constrained) for the kit's llama-1b shape and SmolLM2 bfloat16, at each client count given,
# with the engine's forced runs on (a lone constrained request decodes alone and takes them)
# and off (`HOST_FORCED_RUNS=off`: every request a batch row, every token sampled). Needs the
# MLX site (/tmp/site) and the data bundle (/tmp/data).
#   bash bench/device/structured-server.sh /tmp/host 1 8
set -uo pipefail
HOST=${1:-/tmp/host}
shift || true
CLIENTS=${*:-1 8}
. /tmp/site/env.sh
export PYTHONPATH=$PYTHONPATH:$(ls /tmp/data/whl/gguf-*.whl)
M=/dev/shm/m
mkdir -p $M
[ -f $M/smollm2-bfloat16/model.safetensors ] ||
  python3 /tmp/data/gguf_to_hf.py /tmp/data/SmolLM2-135M-Instruct.Q4_1.gguf $M/smollm2-bfloat16 --dtype bfloat16 > /dev/null
bash bench/device/kit-models.sh llama-1b > /dev/null
for model in /tmp/llama-1b $M/smollm2-bfloat16; do
  for n in $CLIENTS; do
    for runs in on off; do
      echo "== $(basename $model) clients $n forced runs $runs"
      env HOST_FORCED_RUNS=$runs timeout 240 python3 bench/structured_batch.py --host "$HOST" --model "$model" \
        --device gpu --clients "$n" --max-tokens 128 | grep '^|'
    done
  done
done
