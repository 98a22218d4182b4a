#!/usr/bin/env bash
# On the H200, after `. /tmp/site/env.sh`: the decode step split per term, host vs mlx-lm's
# own loop (bench/step_split_mlx_lm.py, on a stream of its own as stream_generate runs),
# interleaved: the Llama-3.1-8B shape in ROUNDS rounds (default 2), then the Llama-3.2-1B and
# Qwen2.5-0.5B shapes once. One JSON line per run. AB_FUSE=1 adds a host run with the
# projections unfused (HOST_FUSE_PROJECTIONS=0; fused is the default) after each default one.
#   bash bench/device/step-split.sh HOST OUTDIR
set -uo pipefail
HOST=$1 OUTDIR=$2
for m in llama-8b llama-1b qwen-0.5b; do
  [ -f /tmp/$m/config.json ] || python3 .device/kit/make-model.py $m /tmp/$m > /dev/null
done
host() {  # model, fused (0/1)
  HOST_FUSE_PROJECTIONS=$2 timeout 150 "$HOST" bench --model /tmp/$1 --device gpu --prompt-lengths 512 --gen 128 --runs 3 --json \
    | python3 -c "import json,sys; r=json.loads(sys.stdin.readlines()[-1]); print(json.dumps({'bench':'host','model':'$1','fused':$2,'decode_tps':round(r['decode_tps'],1),'step_ms':round(r['step_ms'],2),'build_ms':round(r['build_ms'],2),'dispatch_ms':round(r['dispatch_ms'],2),'wait_ms':round(r['wait_ms'],2)}))"
}
one() {  # model
  timeout 150 python3 bench/step_split_mlx_lm.py /tmp/$1 --prompt 512 --gen 128 --runs 3 | tail -1
  host $1 1
  # AB_FUSE=1: the host again with q/k/v and gate/up as separate matmuls.
  [ -n "${AB_FUSE:-}" ] && host $1 0
}
{
  for _ in $(seq "${ROUNDS:-2}"); do one llama-8b; done
  one llama-1b
  one qwen-0.5b
} 2>&1 | tee "$OUTDIR/step-split.jsonl"
