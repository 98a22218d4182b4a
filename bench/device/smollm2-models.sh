# Sourced by the device scripts (after `. /tmp/site/env.sh`, with the data bundle in
# /tmp/data): SmolLM2-135M in bfloat16 and float16 from the kit's GGUF, and its 8-layer draft,
# under M=/dev/shm/m (made once per machine).
M=/dev/shm/m
mkdir -p $M
export PYTHONPATH=${PYTHONPATH:-}:$(ls /tmp/data/whl/gguf-*.whl)
for dt in bfloat16 float16; do
  [ -f $M/smollm2-$dt/model.safetensors ] || python3 /tmp/data/gguf_to_hf.py /tmp/data/SmolLM2-135M-Instruct.Q4_1.gguf $M/smollm2-$dt --dtype $dt
done
[ -f $M/smollm2-draft8/model.safetensors ] || python3 .device/kit/make-layer-draft.py $M/smollm2-float16 $M/smollm2-draft8 --layers 8
