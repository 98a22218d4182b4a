#!/usr/bin/env bash
# Decode on the CPU, in one run: OpenBLAS's sgemm against one sgemv per row on a decode
# step's shapes (bench/cpu-gemv.cc), then `host bench` with the host's few-rows product,
# the same binary with MLX's matmul (HOST_CPU_GEMV=0), and mlx-lm (same MLX, same OpenBLAS,
# same float32 weights) as the anchor.
#
#   bench/cpu-decode.sh [HOST_BIN] [MODEL_DIR]
#
# Defaults: target/debug/host, the smollm2-f32 test model; a 128-token prompt, 64 tokens.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOST=${1:-$ROOT/target/debug/host}
MODEL=${2:-${HOST_CACHE_DIR:-$HOME/.cache/host}/test-models/smollm2-f32}
ORACLE=${HOST_ORACLE_PYTHON:-${HOST_CACHE_DIR:-$HOME/.cache/host}/oracle/bin/python}
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
echo "## sgemm against sgemv per row (OpenBLAS, microseconds per product)"
g++ -O2 "$ROOT/bench/cpu-gemv.cc" "$BLAS" -o /tmp/host-cpu-gemv && /tmp/host-cpu-gemv
for gemv in 1 0; do
  echo "## host, HOST_CPU_GEMV=$gemv"
  HOST_CPU_GEMV=$gemv "$HOST" bench --model "$MODEL" --device cpu --prompt-lengths 128 --gen 64 --runs 3
done
echo "## mlx-lm (LD_PRELOAD=$BLAS)"
LD_PRELOAD=$BLAS "$ORACLE" "${HOST_SHARED_DIR:-$ROOT/../shared}/device/mlx-lm-bench.py" "$MODEL" --prompt 128 --gen 64 --trials 3 --copy-bw 10 \
  | grep '^{"bench"' || true
