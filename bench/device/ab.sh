#!/usr/bin/env bash
# On the H200, after `. /tmp/site/env.sh`: an A/B of host binaries alone (no mlx-lm runs in
# between, so more rounds fit a call), interleaved A B [C] per round on each of the kit's
# shapes, then per model the median decode and prefill tok/s of each binary and the median of
# the per-round ratios to A (the device drifts 1.5x between rounds; a ratio within a round is
# steadier). A "binary" may be a wrapper script, e.g. one that sets HOST_FUSE_PROJECTIONS=0.
#   [MODELS="qwen-0.5b llama-8b-q4"] [ROUNDS=6] [PROMPT=512] bash bench/device/ab.sh OUTDIR A B [C]
# Models: bench/device/kit-models.sh (NAME-q4 is NAME quantized to 4 bits, group 64).
set -uo pipefail
OUTDIR=$1
shift
BINS=("$@")
MODELS=(${MODELS:-qwen-0.5b llama-8b-q4})
bash bench/device/kit-models.sh "${MODELS[@]}"
for m in "${MODELS[@]}"; do
  for round in $(seq "${ROUNDS:-6}"); do
    for b in "${BINS[@]}"; do
      timeout 150 "$b" bench --model /tmp/$m --device gpu --prompt-lengths "${PROMPT:-512}" --gen 128 --runs 3 --json \
        | python3 -c "import json,sys; r=json.loads(sys.stdin.readlines()[-1]); print(json.dumps({'model':'$m','round':$round,'binary':'$b','decode_tps':round(r['decode_tps'],1),'prefill_tps':round(r['prefill_tps'],1),'build_ms':round(r['build_ms'],3),'dispatch_ms':round(r['dispatch_ms'],3),'wait_ms':round(r['wait_ms'],3),'peak_gb':round(r['peak_memory_bytes']/1e9,3)}))"
    done
  done
done | tee "$OUTDIR/ab.jsonl"
python3 - "$OUTDIR/ab.jsonl" "${BINS[@]}" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
bins = sys.argv[2:]
print("| model | binary | decode tok/s (median) | decode ratio to A, per round (median) | prefill tok/s (median) | prefill ratio to A | build ms | dispatch ms | peak GB (max) |")
print("|---|---|---|---|---|---|---|---|---|")
for m in dict.fromkeys(r["model"] for r in rows):
    runs = {b: {r["round"]: r for r in rows if r["model"] == m and r["binary"] == b} for b in bins}
    for b in bins:
        rs = runs[b]
        if not rs:
            continue
        med = lambda k: statistics.median(r[k] for r in rs.values())
        def ratio(k):
            ratios = [rs[n][k] / runs[bins[0]][n][k] for n in rs if n in runs[bins[0]]]
            return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)" if ratios else "-"
        print(f"| {m} | {b} | {med('decode_tps'):.1f} | {ratio('decode_tps')} | {med('prefill_tps'):.0f} | {ratio('prefill_tps')} | {med('build_ms'):.2f} | {med('dispatch_ms'):.2f} | {max(r.get('peak_gb', 0) for r in rs.values()):.2f} |")
PY
