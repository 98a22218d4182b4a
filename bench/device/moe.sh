#!/usr/bin/env bash
# On the H200 (after `. /tmp/site/env.sh`): decode and prefill of random-weight MoE models of
# real shapes (bench/device/make_moe.py), host against mlx-lm in one call (issue 24):
# Qwen3-30B-A3B in 4-bit (all 48 layers) and bf16 (24 layers), gpt-oss-20b in 4-bit (all 24
# layers) and bf16 (12 layers); a 512-token prompt, 128 generated, batch 1. Both engines are
# bound by the CPU's kernel dispatch on these models (hundreds of small kernels a step), so
# the machine's CPU speed moves both from run to run: ROUNDS (default 2) alternates mlx-lm
# and the host per model and prints a table per round.
#   bash bench/device/moe.sh HOST OUTDIR [SPEC...]     SPEC: shape:layers:bits (bits 0 = bf16,
#                                                      mxfp4 = MXFP4 experts, the rest 8-bit)
set -uo pipefail
HOST=$1 OUTDIR=$2
shift 2
specs=("$@")
[ ${#specs[@]} -eq 0 ] && specs=(qwen3-30b-a3b:48:4 gpt-oss-20b:24:4 qwen3-30b-a3b:24:0 gpt-oss-20b:12:0)
mkdir -p "$OUTDIR"
ROUNDS=${ROUNDS:-2}
for spec in "${specs[@]}"; do
  IFS=: read -r shape layers bits <<< "$spec"
  name=$shape-l$layers-$([ "$bits" = 0 ] && echo bf16 || echo "q$bits")
  dir=/dev/shm/m/$name
  extra=()
  case $bits in 0) ;; mxfp4) extra=(--mxfp4) ;; *) extra=(--bits "$bits") ;; esac
  [ -f "$dir/config.json" ] || python3 bench/device/make_moe.py "$shape" "$dir" --layers "$layers" "${extra[@]}" 2>&1 | tail -1
  for r in $(seq 1 "$ROUNDS"); do
    echo "== $name round $r"
    mkdir -p "$OUTDIR/r$r"
    timeout 500 python3 .device/kit/mlx-lm-bench.py "$dir" --prompt 512 --gen 128 --trials 2 \
      --json-out "$OUTDIR/r$r/mlx-$name.jsonl" > "$OUTDIR/r$r/mlx-$name.log" 2>&1 || tail -5 "$OUTDIR/r$r/mlx-$name.log"
    cat "$OUTDIR/r$r/mlx-$name.jsonl" >> "$OUTDIR/r$r/mlx-lm.jsonl" 2>/dev/null
    timeout 400 "$HOST" bench --device gpu --model "$dir" --prompt-lengths 512 --gen 128 --runs 2 --json \
      >> "$OUTDIR/r$r/host.jsonl" 2> "$OUTDIR/r$r/host-$name.log" || tail -5 "$OUTDIR/r$r/host-$name.log"
  done
  [ -n "${KEEP:-}" ] || rm -rf "$dir"
done
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r"
  python3 bench/side_by_side.py --host "$OUTDIR/r$r/host.jsonl" --mlx-lm "$OUTDIR/r$r/mlx-lm.jsonl" | tee "$OUTDIR/moe-r$r.md"
done
