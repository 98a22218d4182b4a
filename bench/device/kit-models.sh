#!/usr/bin/env bash
# On the H200: makes the kit's model shapes under /tmp once each (`.device/kit/make-model.py`,
# random weights in real shapes); NAME-q4 is NAME quantized to 4 bits (group 64), written
# beside /tmp/NAME.
#   bash bench/device/kit-models.sh llama-8b-q4 qwen-0.5b ...
set -euo pipefail
for m in "$@"; do
  shape=${m%-q4}
  quantize=()
  [ "$shape" != "$m" ] && quantize=(--quantize 4)
  [ -f /tmp/$m/config.json ] || python3 .device/kit/make-model.py "$shape" /tmp/"$shape" "${quantize[@]}" > /dev/null
done
