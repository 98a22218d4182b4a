#!/usr/bin/env bash
# On the H200, after `. /tmp/site/env.sh`: what one decode step costs on the GPU, per kernel,
# host vs mlx-lm on the same weights, from GPU activity traces (bench/device/cupti_trace.c,
# injected with CUDA_INJECTION64_PATH; no profiler needs to be installed on the device).
# Also prints whether weight pages migrate (Unified Memory traffic) while decoding.
#   bash bench/device/kernel-trace.sh HOST CUPTI_DIR MODEL_DIR OUTDIR
# CUPTI_DIR holds libcupti_trace.so (built here, see cupti_trace.c) and libcupti.so.13 (from
# the nvidia-cuda-cupti wheel). Each engine: prompt 512, 128 tokens, one measured run after
# its warm-up; the last 100 decode steps of the trace are analysed (bench/device/gpu_trace.py).
# AB=VAR=value adds a host run with that environment (labelled host-ab; AB_FUSE=1 is
# AB=HOST_FUSE_PROJECTIONS=0). CUPTI_TRACE_API=1 also records the CUDA driver calls each
# engine's CPU makes per step (slows both a little). PROMPT=N sets the prompt length (512);
# PREFILL=1 analyses the measured run's prefill instead of its decode steps (gpu_trace.py
# --prefill), e.g. PROMPT=4096 PREFILL=1 for issue 6's long-prompt prefill.
set -uo pipefail
AB=${AB:-}
[ -n "${AB_FUSE:-}" ] && AB=HOST_FUSE_PROJECTIONS=0
HOST=$1 CUPTI=$2 MODEL=$3 OUTDIR=$4
T=${TRACE_DIR:-/tmp/traces}
mkdir -p "$T"
trace() {  # label, command...
  local label=$1; shift
  CUDA_INJECTION64_PATH=$CUPTI/libcupti_trace.so CUPTI_TRACE_OUT=$T/$label.tsv timeout 200 "$@" 2>&1 | tail -2
}
trace host "$HOST" bench --model "$MODEL" --device gpu --prompt-lengths "${PROMPT:-512}" --gen 128 --runs 1
trace mlx-lm python3 bench/step_split_mlx_lm.py "$MODEL" --prompt "${PROMPT:-512}" --gen 128 --runs 1
[ -n "$AB" ] && env $AB CUDA_INJECTION64_PATH=$CUPTI/libcupti_trace.so CUPTI_TRACE_OUT=$T/host-ab.tsv \
  timeout 200 "$HOST" bench --model "$MODEL" --device gpu --prompt-lengths "${PROMPT:-512}" --gen 128 --runs 1 2>&1 | tail -2
args=(host=$T/host.tsv mlx-lm=$T/mlx-lm.tsv)
[ -n "$AB" ] && args+=(host-ab=$T/host-ab.tsv)
what=$([ -n "${PREFILL:-}" ] && echo prefill- || true)
python3 bench/device/gpu_trace.py --top 30 ${PREFILL:+--prefill} "${args[@]}" \
  | tee "$OUTDIR/kernel-trace-$what$(basename "$MODEL")-${PROMPT:-512}.md"
