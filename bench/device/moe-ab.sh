#!/usr/bin/env bash
# On the H200 (after `. /tmp/site/env.sh`): where a MoE decode step's time goes. One
# random-weight model (default: Qwen3-30B-A3B's shape, 12 layers, 4-bit); mlx-lm's decode,
# then the host's with each of its GPU-specific paths off in turn (HOST_QGEMV=0: MLX's
# quantized kernels; HOST_FUSE_PROJECTIONS=0: separate q/k/v), and one decode step's graph of
# each (host: HOST_DEBUG_STEP_GRAPH; mlx-lm: mx.export_to_dot) to count their primitives.
#   bash bench/device/moe-ab.sh HOST OUTDIR [SHAPE LAYERS BITS]
set -uo pipefail
HOST=$1 OUTDIR=$2 SHAPE=${3:-qwen3-30b-a3b} LAYERS=${4:-12} BITS=${5:-4}
mkdir -p "$OUTDIR"
dir=/dev/shm/m/$SHAPE-l$LAYERS-q$BITS
python3 bench/device/make_moe.py "$SHAPE" "$dir" --layers "$LAYERS" --bits "$BITS" 2>&1 | tail -1
timeout 300 python3 .device/kit/mlx-lm-bench.py "$dir" --prompt 512 --gen 128 --trials 2 \
  --json-out "$OUTDIR/mlx.jsonl" > "$OUTDIR/mlx.log" 2>&1 || tail -5 "$OUTDIR/mlx.log"
grep -o '"decode_tps": [0-9.]*' "$OUTDIR/mlx.jsonl" | head -1
python3 - "$dir" "$OUTDIR/mlx.dot" <<'PY'
import sys, mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
m, _ = load(sys.argv[1]); c = make_prompt_cache(m)
y = m(mx.array([[1, 2, 3, 4]]), cache=c); mx.eval(y)
out = m(mx.argmax(y[:, -1:], -1), cache=c)
lp = out - mx.logsumexp(out, -1, keepdims=True)
mx.export_to_dot(sys.argv[2], mx.argmax(lp, -1), lp)
PY
for v in "" HOST_QGEMV=0 HOST_FUSE_PROJECTIONS=0; do
  env $v HOST_DEBUG_STEP_GRAPH="$OUTDIR/host${v:+-$v}.dot" timeout 200 "$HOST" bench --device gpu --model "$dir" \
    --prompt-lengths 512 --gen 128 --runs 2 --json > "$OUTDIR/host${v:+-$v}.jsonl" 2> "$OUTDIR/host${v:+-$v}.log"
  echo "host ${v:-default}: $(grep -o '"decode_tps":[0-9.]*\|"dispatch_ms":[0-9.]*\|"build_ms":[0-9.]*' "$OUTDIR/host${v:+-$v}.jsonl" | tr '\n' ' ')"
done
for f in "$OUTDIR"/*.dot; do echo "$(basename "$f"): $(grep -c label "$f") nodes"; done
