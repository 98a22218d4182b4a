#!/usr/bin/env bash
# On the H200, after `. /tmp/site/env.sh`: the decode step split per term, host vs mlx-lm's
# own loop (bench/step_split_mlx_lm.py, on a stream of its own as stream_generate runs),
# interleaved: the first model in ROUNDS rounds (default 2), the others once. One JSON line
# per run.
#   [MODELS="llama-8b llama-1b qwen-0.5b"] [ROUNDS=2] [AB=VAR=value] [B_HOST=PATH] bash bench/device/step-split.sh HOST OUTDIR
# MODELS are the kit's shapes, made under /tmp once (kit-models.sh); NAME-q4 is NAME quantized
# to 4 bits (group 64). AB=VAR=value adds a host run with that environment after each default
# one (e.g. AB=HOST_QGEMV=0: MLX's 4-bit kernel; AB_FUSE=1 is AB=HOST_FUSE_PROJECTIONS=0);
# B_HOST=PATH adds a run of another host binary (the build before a change) after each.
set -uo pipefail
HOST=$1 OUTDIR=$2
MODELS=(${MODELS:-llama-8b llama-1b qwen-0.5b})
AB=${AB:-}
[ -n "${AB_FUSE:-}" ] && AB=HOST_FUSE_PROJECTIONS=0
bash bench/device/kit-models.sh "${MODELS[@]}"
host() {  # model, environment ("" or VAR=value)[, binary]
  env $2 timeout 150 "${3:-$HOST}" bench --model /tmp/$1 --device gpu --prompt-lengths 512 --gen 128 --runs 3 --json \
    | python3 -c "import json,sys; r=json.loads(sys.stdin.readlines()[-1]); print(json.dumps({'bench':'host','model':'$1','env':'$2','binary':'${3:-$HOST}','decode_tps':round(r['decode_tps'],1),'step_ms':round(r['step_ms'],2),'build_ms':round(r['build_ms'],2),'dispatch_ms':round(r['dispatch_ms'],2),'wait_ms':round(r['wait_ms'],2)}))"
}
one() {  # model
  timeout 150 python3 bench/step_split_mlx_lm.py /tmp/$1 --prompt 512 --gen 128 --runs 3 | tail -1
  host $1 ""
  [ -n "$AB" ] && host $1 "$AB"
  [ -n "${B_HOST:-}" ] && host $1 "" "$B_HOST"
}
{
  for _ in $(seq "${ROUNDS:-2}"); do one "${MODELS[0]}"; done
  for m in "${MODELS[@]:1}"; do one "$m"; done
} 2>&1 | tee "$OUTDIR/step-split.jsonl"
