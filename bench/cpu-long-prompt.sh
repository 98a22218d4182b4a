#!/usr/bin/env bash
# Long prompts on the CPU, in one run: `host bench` with the host's CPU attention, the same
# binary with MLX's (HOST_CPU_ATTENTION=0), and mlx-lm (same MLX, same OpenBLAS, same
# float32 weights; its prompt_tps). Prints the three JSON/markdown outputs; ratios are
# against mlx-lm from the same run.
#
#   bench/cpu-long-prompt.sh [HOST_BIN] [MODEL_DIR] [LENGTHS]
#
# Defaults: target/debug/host, the smollm2-f32 test model, 2048,8192.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOST=${1:-$ROOT/target/debug/host}
MODEL=${2:-${HOST_CACHE_DIR:-$HOME/.cache/host}/test-models/smollm2-f32}
LENGTHS=${3:-2048,8192}
ORACLE=${HOST_ORACLE_PYTHON:-${HOST_CACHE_DIR:-$HOME/.cache/host}/oracle/bin/python}
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
for attention in 1 0; do
  echo "## host, HOST_CPU_ATTENTION=$attention"
  HOST_CPU_ATTENTION=$attention "$HOST" bench --model "$MODEL" --device cpu --prompt-lengths "$LENGTHS" --gen 2 --runs 1
done
echo "## mlx-lm (LD_PRELOAD=$BLAS)"
for p in ${LENGTHS//,/ }; do
  LD_PRELOAD=$BLAS "$ORACLE" "${HOST_SHARED_DIR:-$ROOT/../shared}/device/mlx-lm-bench.py" "$MODEL" --prompt "$p" --gen 2 --trials 1 --copy-bw 10 \
    | grep '^{"bench"' || true
done
