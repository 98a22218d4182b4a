#!/usr/bin/env bash
# Two host binaries on this CPU, a `host bench --batch` run of each in turn per round (this
# 2-core VM drifts by tens of percent over minutes, so a ratio within a round is steadier than
# two medians), then the median and range of the per-round ratios of decode tok/s, new / old.
#   [MODEL=FILE] [PROMPT=48] [GEN=96] bash bench/cpu-ab.sh OLD NEW ROUNDS BATCH [bench args...]
# The default model is the default GGUF (SmolLM2-135M-Instruct Q4_1).
set -euo pipefail
OLD=$1 NEW=$2 ROUNDS=$3 BATCH=$4
shift 4
MODEL=${MODEL:-$HOME/.cache/host/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf}
decode() {
  "$1" bench --device cpu --model "$MODEL" --batch "$BATCH" --prompt-lengths "${PROMPT:-48}" --gen "${GEN:-96}" \
    --runs 1 --json "${@:2}" 2>/dev/null | python3 -c "import json,sys; print(json.loads(sys.stdin.readlines()[-1])['decode_tps'])"
}
ratios=()
for round in $(seq "$ROUNDS"); do
  old=$(decode "$OLD" "$@")
  new=$(decode "$NEW" "$@")
  echo "round $round: old $old new $new tok/s"
  ratios+=("$(python3 -c "print($new / $old)")")
done
python3 -c "import statistics, sys; v = sorted(map(float, sys.argv[1:])); print(f'new / old: median {statistics.median(v):.3f}, min {v[0]:.3f}, max {v[-1]:.3f}')" "${ratios[@]}"
