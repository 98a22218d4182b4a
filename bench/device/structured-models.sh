# Sourced by the structured-output device scripts: the MLX site's environment, and the two
# models they run in /dev/shm/m/smollm2-bfloat16 (SmolLM2 from the data bundle's GGUF) and
# /tmp/llama-1b (the kit's 1B shape, random weights); sets M=/dev/shm/m.
. /tmp/site/env.sh
export PYTHONPATH=$PYTHONPATH:$(ls /tmp/data/whl/gguf-*.whl)
M=/dev/shm/m
mkdir -p $M
[ -f $M/smollm2-bfloat16/model.safetensors ] ||
  python3 /tmp/data/gguf_to_hf.py /tmp/data/SmolLM2-135M-Instruct.Q4_1.gguf $M/smollm2-bfloat16 --dtype bfloat16 > /dev/null
bash bench/device/kit-models.sh llama-1b > /dev/null
