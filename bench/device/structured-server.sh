#!/usr/bin/env bash
# Runs on the device machine: constrained requests through `host serve`
# (`bench/structured_batch.py`: all unconstrained, one json_schema request among them, all
# constrained) for the kit's llama-1b shape and SmolLM2 bfloat16, at each client count in
# CLIENTS (default "1 8"; MODELS picks the model folders), under each way given: NAME or NAME:VAR=VALUE,... with the engine's
# measuring switches (host/src/engine/decode.rs): HOST_FORCED_RUNS (off: a lone constrained
# request stays a batch row and samples every token) and HOST_MASK_OVERLAP (never: a
# constrained batch step reads its tokens and works out its masks on the engine thread after
# the next forward's start). Needs the MLX site (/tmp/site) and the data bundle (/tmp/data).
#   CLIENTS="1 8" bash bench/device/structured-server.sh /tmp/host default runs-off:HOST_FORCED_RUNS=off
set -uo pipefail
HOST=${1:-/tmp/host}
shift || true
WAYS=${*:-default}
. bench/device/structured-models.sh
for model in ${MODELS:-/tmp/llama-1b $M/smollm2-bfloat16}; do
  for n in ${CLIENTS:-1 8}; do
    for way in $WAYS; do
      name=${way%%:*}
      vars=()
      [ "$name" != "$way" ] && IFS=, read -ra vars <<< "${way#*:}"
      echo "== $(basename $model) clients $n $name"
      env "${vars[@]}" timeout 240 python3 bench/structured_batch.py --host "$HOST" --model "$model" \
        --device gpu --clients "$n" --max-tokens 128 | grep '^| [a-z]'
    done
  done
done
