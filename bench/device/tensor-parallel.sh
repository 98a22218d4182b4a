#!/usr/bin/env bash
# On an nvidia-h200-x2 (or larger), after `. /tmp/site/env.sh`: issue 7's benchmark — the
# Llama-3.1-8B shape (bf16) at 1 and 2 ranks, host vs mlx-lm's own tensor parallelism
# (mlx-lm `sharded_load` under NCCL), in one call.
#   bash bench/device/tensor-parallel.sh HOST OUTDIR
set -uo pipefail
HOST=$1 OUTDIR=$2
export NCCL_NVLS_ENABLE=0
[ -f /tmp/llama-8b/config.json ] || python3 .device/kit/make-model.py llama-8b /tmp/llama-8b > /dev/null
python3 bench/tensor_parallel.py "$HOST" /tmp/llama-8b --ranks 2 --device gpu --python python3 | tee "$OUTDIR/tensor-parallel.md"
