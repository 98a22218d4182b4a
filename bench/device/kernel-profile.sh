#!/usr/bin/env bash
# On the H200, after `. /tmp/site/env.sh`: per-kernel GPU time of ~2 decode steps of each
# engine on the same model, side by side (Nsight Compute, installed on the device image), to
# name the kernel(s) behind the 8B gap (bench/NOTES.md, session 4: same graph as mlx-lm's,
# yet ≥1 ms more GPU time per step). NOT YET RUN: written in session 4 with no device time
# left; expect to adjust SKIP (launches before the profiled window) on the first run.
#   bash bench/device/kernel-profile.sh HOST MODEL_DIR OUTDIR
# Both engines: prompt 64, a 16-token warm-up, then one run of 40 tokens; SKIP launches
# (default 25000, ~36 steps of the 8B's ~690 kernels) are skipped, the next COUNT (1400)
# profiled node by node inside MLX's CUDA graphs.
set -uo pipefail
HOST=$1 MODEL=$2 OUTDIR=$3
SKIP=${SKIP:-25000} COUNT=${COUNT:-1400}
prof() {  # name, command...
  local name=$1; shift
  timeout 280 ncu --graph-profiling node --metrics gpu__time_duration.sum --csv --page raw --print-units base \
    --launch-skip "$SKIP" --launch-count "$COUNT" --target-processes all "$@" \
    > "$OUTDIR/ncu-$name.csv" 2> "$OUTDIR/ncu-$name.log" || tail -5 "$OUTDIR/ncu-$name.log"
}
prof host "$HOST" bench --model "$MODEL" --device gpu --prompt-lengths 64 --gen 40 --runs 1
prof mlx-lm python3 bench/step_split_mlx_lm.py "$MODEL" --prompt 64 --gen 40 --runs 1
python3 - "$OUTDIR" <<'PY' | tee "$OUTDIR/kernel-profile.md"
import csv, collections, sys
def load(name):
    rows = list(csv.reader(l for l in open(f"{sys.argv[1]}/ncu-{name}.csv") if l.startswith('"')))
    if not rows:
        return collections.Counter(), collections.Counter()
    head, body = rows[0], rows[2:]  # the second row holds units
    k, t = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    total, count = collections.Counter(), collections.Counter()
    for r in body:
        total[r[k][:80]] += float(r[t].replace(",", ""))
        count[r[k][:80]] += 1
    return total, count
(ht, hc), (mt, mc) = load("host"), load("mlx-lm")
print(f"host: {sum(hc.values())} kernels, {sum(ht.values())/1e3:.1f} us; mlx-lm: {sum(mc.values())} kernels, {sum(mt.values())/1e3:.1f} us")
print("| kernel | host n | host us | mlx-lm n | mlx-lm us |\n|---|---|---|---|---|")
for name in sorted(set(ht) | set(mt), key=lambda n: -max(ht[n], mt[n]))[:30]:
    print(f"| {name} | {hc[name]} | {ht[name]/1e3:.1f} | {mc[name]} | {mt[name]/1e3:.1f} |")
PY
