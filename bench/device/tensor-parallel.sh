#!/usr/bin/env bash
# On an nvidia-h200-x2 (or larger), after `. /tmp/site/env.sh`: issue 7's GPU run in one call.
#   1. GPU token check through NCCL: `host generate --json` greedy at 1 and 2 ranks on the tiny
#      random models (float32; in TINY_DIR when set, made with ../shared/models scripts) and
#      the Llama-3.2-1B shape (bf16: split reductions add in another order, so random-weight
#      logits with near ties may part after a few tokens); prints where the ids first differ;
#   2. the Llama-3.1-8B shape (bf16) at 1 and 2 ranks, host vs mlx-lm's own tensor parallelism
#      (mlx-lm `sharded_load` under NCCL).
#   bash bench/device/tensor-parallel.sh HOST OUTDIR
set -uo pipefail
HOST=$1 OUTDIR=$2
export NCCL_NVLS_ENABLE=0
[ -f /tmp/llama-1b/config.json ] || python3 .device/kit/make-model.py llama-1b /tmp/llama-1b > /dev/null
models=(/tmp/llama-1b)
[ -n "${TINY_DIR:-}" ] && models=("$TINY_DIR"/tiny-* "${models[@]}")
for m in "${models[@]}"; do
  name=$(basename "$m")
  for r in 1 2; do
    timeout 180 "$HOST" generate --model "$m" --device gpu --tensor-parallel $r --raw --json \
      -p "The history of the printing press begins" -m 32 > "/tmp/tp-$name-$r.json" 2> "/tmp/tp-$name-$r.log" \
      || { echo "$name at $r ranks: exit $?"; tail -5 "/tmp/tp-$name-$r.log"; }
  done
done
python3 - "${models[@]}" <<'PY' | tee "$OUTDIR/tp-gpu-tokens.md"
import json, os, sys
print("| model | greedy ids equal to 1 rank at 2 ranks (GPU, NCCL) |\n|---|---|")
for m in sys.argv[1:]:
    name = os.path.basename(m)
    try:
        one, two = (json.load(open(f"/tmp/tp-{name}-{r}.json"))["token_ids"] for r in (1, 2))
    except Exception as e:
        print(f"| {name} | no result ({e}) |")
        continue
    same = next((i for i, (a, b) in enumerate(zip(one, two)) if a != b), min(len(one), len(two)))
    print(f"| {name} | {'all ' if same == len(one) == len(two) else 'first '}{same} of {len(one)} |")
PY
[ -f /tmp/llama-8b/config.json ] || python3 .device/kit/make-model.py llama-8b /tmp/llama-8b > /dev/null
python3 bench/tensor_parallel.py "$HOST" /tmp/llama-8b --ranks 2 --device gpu --python python3 --timeout 150 --rounds 2 \
  | tee "$OUTDIR/tensor-parallel.md"
