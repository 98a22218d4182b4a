#!/usr/bin/env bash
# On the device (after `. /tmp/site/env.sh`, with the data bundle in /tmp/data):
# bench/speculative.py on SmolLM2 bf16 (from the kit's GGUF) with its 8-layer draft, on the GPU.
#   bash bench/device/speculative.sh HOST OUTDIR [bench/speculative.py options, e.g. --skip-mlx-draft]
set -uo pipefail
HOST=$1 OUTDIR=$2
shift 2
. bench/device/smollm2-models.sh
timeout 500 python3 bench/speculative.py --device gpu --host "$HOST" --oracle-python python3 \
  --model $M/smollm2-bfloat16 --draft-model $M/smollm2-draft8 --runs 3 --max-tokens 256 "$@" | tee "$OUTDIR/speculative.md"
