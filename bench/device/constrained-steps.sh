#!/usr/bin/env bash
# Runs on the device machine: constrained decoding under several ways of running a constrained
# step, each paired with unconstrained decoding in the same process (`host bench
# --paired-plain`), for the kit's llama-1b shape and SmolLM2 bfloat16: the JSON schema, the
# regex and the lowercase plugin of bench/structured.sh. A way is NAME or NAME:VAR=VALUE,...
# with the engine's measuring switches (host/src/engine/decode.rs): HOST_MASK_OVERLAP (auto,
# always, merged, never: when the mask is worked out) and HOST_FORCED_RUNS (off: every forced token
# sampled in a step of its own). MODELS picks the model folders (default both). BATCH=8
# measures batches of 8 rows each held to the constraint instead (`host bench --batch 8`, each
# run paired with a plain batch of the same row lengths). Needs the MLX site (/tmp/site) and
# the data bundle (/tmp/data).
#   bash bench/device/constrained-steps.sh /tmp/host default runs-off:HOST_FORCED_RUNS=off
set -uo pipefail
HOST=${1:-/tmp/host}
shift || true
WAYS=${*:-default}
. bench/device/structured-models.sh
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$HOST" plugins build-wat examples/wat/lowercase.wat "$WORK/lowercase.wasm"
echo '{"plugin": "lowercase.wasm"}' > "$WORK/lowercase.json"
S=bench/structured
pairing=(--paired-plain)
[ -n "${BATCH:-}" ] && pairing=(--batch "$BATCH")
for model in ${MODELS:-/tmp/llama-1b $M/smollm2-bfloat16}; do
  for c in $S/people.json $S/regex.json "$WORK/lowercase.json"; do
    for way in $WAYS; do
      name=${way%%:*}
      vars=()
      [ "$name" != "$way" ] && IFS=, read -ra vars <<< "${way#*:}"
      echo "== $(basename $model) $(basename $c) $name"
      env "${vars[@]}" "$HOST" bench --model "$model" --device gpu --prompt-file $S/prompt.txt \
        --constraint "$c" "${pairing[@]}" --runs "${RUNS:-5}" --gen "${GEN:-200}" 2>/dev/null | grep -v '^|--\|^| model'
    done
  done
done
