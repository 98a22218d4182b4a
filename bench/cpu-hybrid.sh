#!/usr/bin/env bash
# Issue 44 on the CPU: `host bench` beside mlx-lm (same MLX, same OpenBLAS, same float32
# weights) on a random Qwen3.5-0.8B-shaped model (bench/device/make_hybrid.py, mlx-lm's own
# classes): prefill of a 128-token prompt and decode of 32 tokens, batch 1.
#
#   bench/cpu-hybrid.sh [HOST_BIN]        (default target/debug/host; it must link OpenBLAS, as
#                                          a build without HOST_BLAS=bundled does, or the two
#                                          engines do not run the same BLAS)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOST=${1:-$ROOT/target/debug/host}
ORACLE=${HOST_ORACLE_PYTHON:-${HOST_CACHE_DIR:-$HOME/.cache/host}/oracle/bin/python}
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
MODEL=${HOST_CACHE_DIR:-$HOME/.cache/host}/bench-models/qwen3.5-0.8b-f32
ldd "$HOST" | grep -q libopenblas || { echo "cpu-hybrid.sh: $HOST does not link OpenBLAS; build it without HOST_BLAS=bundled" >&2; exit 1; }
mkdir -p "$ROOT/.device/kit"
[ -f "$ROOT/.device/kit/make-model.py" ] || cp "${HOST_SHARED_DIR:-$ROOT/../shared}/device/make-model.py" "$ROOT/.device/kit/"
"$ORACLE" "$ROOT/bench/device/make_hybrid.py" qwen3.5-0.8b "$MODEL" --dtype float32
echo "## host ($HOST)"
"$HOST" bench --model "$MODEL" --device cpu --prompt-lengths 128 --gen 32 --runs 2
echo "## mlx-lm (LD_PRELOAD=$BLAS): stream_generate's own prompt and generation tok/s, median of 2"
LD_PRELOAD=$BLAS "$ORACLE" - "$MODEL" <<'PY'
import statistics, sys
import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
mx.set_default_device(mx.cpu)
model, tok = load(sys.argv[1])
prompt = [int(x) for x in mx.random.randint(1000, 100000, (128,), key=mx.random.key(0)).tolist()]
rows = []
for trial in range(3):
    last = None
    for r in stream_generate(model, tok, prompt, max_tokens=32, sampler=make_sampler(temp=0.0)):
        last = r
    if trial:  # the first run compiles
        rows.append((last.prompt_tps, last.generation_tps, last.peak_memory))
print("| model | prompt | prefill tok/s | decode tok/s | peak memory GB |")
print("|---|---|---|---|---|")
print(f"| {sys.argv[1].rstrip('/').split('/')[-1]} | 128 | {statistics.median(r[0] for r in rows):.1f} | "
      f"{statistics.median(r[1] for r in rows):.2f} | {max(r[2] for r in rows):.3f} |")
PY
