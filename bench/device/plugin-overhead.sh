#!/usr/bin/env bash
# Runs on the device machine: sampler-plugin overhead on the GPU (bench/plugin_overhead.rs)
# and a parity spot check, with the binaries and plugins carried in .device/bin.
# Needs /tmp/site (MLX CUDA) and /tmp/data (the SmolLM2 GGUF, gguf_to_hf.py, the gguf wheel).
set -uo pipefail
. /tmp/site/env.sh
export PYTHONPATH=$PYTHONPATH:$(ls /tmp/data/whl/gguf-*.whl)
B=${1:-/tmp/bin}
M=/dev/shm/m
mkdir -p $M
for dt in float32 bfloat16; do
  [ -f $M/smollm2-$dt/model.safetensors ] || python3 /tmp/data/gguf_to_hf.py /tmp/data/SmolLM2-135M-Instruct.Q4_1.gguf $M/smollm2-$dt --dtype $dt >/dev/null
done
for dt in bfloat16 float32; do
  echo "== plugin overhead, SmolLM2 $dt"
  timeout 200 $B/plugin_overhead $M/smollm2-$dt $B/top-n-sigma.wasm $B/argmax-full.wasm 64 5
done
echo "== parity spot check"
timeout 200 python3 bench/device/gpu_parity.py --host $B/host --oracle tests/oracle/mlx_lm_oracle.py --max-tokens 32 $M/smollm2-float32 $M/smollm2-bfloat16
