#!/usr/bin/env bash
# Runs on the device machine (see ../shared/device/README.md): the host binary built here
# against mlx-cpu's headers, run against mlx-cuda-13's libmlx, compared with mlx-lm on the
# same GPU. Needs the MLX site bundle (/tmp/site) and the data bundle (/tmp/data: the
# SmolLM2 GGUF, gguf_to_hf.py, make-tiny-random.py, make-tiny-extra.py, the gguf wheel).
#   bash bench/device/gpu-smoke.sh /tmp/host
set -uo pipefail
HOST=${1:-/tmp/host}
. /tmp/site/env.sh
export PYTHONPATH=$PYTHONPATH:$(ls /tmp/data/whl/gguf-*.whl)
M=/dev/shm/m
mkdir -p $M
echo "== device"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
echo "== models"
for dt in float32 bfloat16; do
  [ -f $M/smollm2-$dt/model.safetensors ] || python3 /tmp/data/gguf_to_hf.py /tmp/data/SmolLM2-135M-Instruct.Q4_1.gguf $M/smollm2-$dt --dtype $dt
done
[ -f $M/tiny-qwen2/model.safetensors ] || python3 /tmp/data/make-tiny-random.py $M --tokenizer-dir $M/smollm2-float32 --dtype float32
mkdir -p /tmp/shared-models/models && cp /tmp/data/make-tiny-random.py /tmp/shared-models/models/
[ -f $M/tiny-qwen3/model.safetensors ] || python3 /tmp/data/make-tiny-extra.py $M --tokenizer-dir $M/smollm2-float32 --shared-dir /tmp/shared-models --dtype float32
echo "== host on the GPU"
$HOST generate --device gpu --model /tmp/data/SmolLM2-135M-Instruct.Q4_1.gguf --prompt "What is the capital of France?" --max-tokens 32
echo "== parity"
timeout 300 python3 bench/device/gpu_parity.py --host $HOST --oracle tests/oracle/mlx_lm_oracle.py --max-tokens 32 \
  $M/smollm2-float32 $M/smollm2-bfloat16 $M/tiny-llama $M/tiny-qwen2 $M/tiny-qwen3 $M/tiny-llama3
echo "== speed (greedy, 128 tokens)"
timeout 200 python3 bench/generate_vs_mlx_lm.py --device gpu --host $HOST --oracle-python python3 --model $M/smollm2-bfloat16 --runs 2
