#!/usr/bin/env bash
# On the H200 (after `. /tmp/site/env.sh`, data bundle in /tmp/data): the speculation settings
# A/B'd in interleaved rounds on SmolLM2 bf16, edit and chat prompts, each `host bench
# --prompt-file ... --gen 256 --runs 3` (median of 3 after a warm-up on random tokens, and the
# first of the 3, which meets the prompt's verification shapes unseen): plain; prompt lookup
# (one candidate, the defaults); 8 candidates; plain and prompt lookup without MLX's CUDA
# graphs (MLX_USE_CUDA_GRAPHS=0); prompt lookup drafting up to 16 and 24 tokens
# (the default is 8); with the verification count, mean time and its split
# (draft, build, dispatch, wait ms; `host bench --json` verify_*_ms) and a plain step's split.
# (Sessions 6-7 also had "fixed-shapes", HOST_SPEC_FIXED_SHAPES=1, and "no-cost-backoff",
# HOST_SPEC_COST_BACKOFF=0, since removed.) This device varies by tens of percent between
# processes, so only ratios within a round, over several rounds, mean anything
# (bench/NOTES.md, session 5); each speculative run is also paired with plain runs in its own
# process (`host bench --paired-plain`, the "in-process" column), which cancels that; the
# pairing doubles a speculative setting's time (~15 s per workload and round on SmolLM2).
#   [SETTINGS="plain prompt-lookup ..."] bash bench/device/spec-ab.sh HOST OUTDIR [ROUNDS, default 3]
# SETTINGS picks some of the labels below (plain always runs: the ratios are to it).
set -uo pipefail
HOST=$1 OUTDIR=$2 ROUNDS=${3:-3}
. bench/device/smollm2-models.sh
CHAT=$(mktemp)
echo "Write a short story about a lighthouse keeper who finds a message in a bottle." > "$CHAT"
run() {  # round, label, environment ("" or VAR=value), host bench options...
  local round=$1 label=$2 environment=$3
  shift 3
  [ -z "${SETTINGS:-}" ] || [ "$label" = plain ] || [[ " $SETTINGS " == *" $label "* ]] || return 0
  for w in edit chat; do
    local f=bench/edit_prompt.txt
    [ $w = chat ] && f=$CHAT
    local paired=
    [[ " $* " == *" --speculative "* ]] && paired=--paired-plain
    env $environment timeout 180 "$HOST" bench --json --device gpu --model $M/smollm2-bfloat16 --prompt-file "$f" \
      --gen 256 --runs 3 $paired "$@" \
      | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(json.dumps({'round':$round,'label':'$label','workload':'$w','tps':round(r['decode_tps'],1),'first':round(r['first_decode_tps'],1),'tokens_per_step':round(r['tokens_per_step'],2),'gen':r['gen_tokens'],'drafted':r['drafted_tokens'],'accepted':r['accepted_tokens'],'verifications':r['verifications'],'verify_ms':round(r['verify_ms'],2),'verify_split_ms':[round(r[k],2) for k in ('verify_draft_ms','verify_build_ms','verify_dispatch_ms','verify_wait_ms')],'plain_split_ms':[round(r[k],2) for k in ('build_ms','dispatch_ms','wait_ms')],'pipelined_ms':round(r['build_ms']+r['dispatch_ms']+r['wait_ms'],2),'in_process':r.get('vs_plain')}))"
  done
}
for r in $(seq "$ROUNDS"); do
  run $r plain ""
  run $r prompt-lookup "" --speculative prompt-lookup
  run $r 8-candidates "" --speculative prompt-lookup --draft-candidates 8
  run $r plain-no-graphs MLX_USE_CUDA_GRAPHS=0
  run $r prompt-lookup-no-graphs MLX_USE_CUDA_GRAPHS=0 --speculative prompt-lookup
  run $r prompt-lookup-k16 "" --speculative prompt-lookup --num-draft-tokens 16
  run $r prompt-lookup-k24 "" --speculative prompt-lookup --num-draft-tokens 24
done | tee "$OUTDIR/spec-ab.jsonl"
python3 - "$OUTDIR/spec-ab.jsonl" <<'PY' | tee "$OUTDIR/spec-ab.md"
import collections, json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
plain = {(r["round"], r["workload"]): r["tps"] for r in rows if r["label"] == "plain"}
by = collections.defaultdict(list)
for r in rows:
    if (r["round"], r["workload"]) in plain:
        by[(r["workload"], r["label"])].append((r["tps"] / plain[(r["round"], r["workload"])], r["tps"], r["tokens_per_step"], r["first"], r.get("in_process")))
print("| workload | setting | vs plain, per round | median vs plain | in-process vs plain, per round | median tok/s | first-run tok/s | tokens/step |")
print("|---|---|---|---|---|---|---|---|")
for (w, label), v in by.items():
    ratios = ", ".join(f"{x[0]:.2f}x" for x in v)
    paired = ", ".join(f"{x[4]:.2f}x" for x in v if x[4] is not None) or "-"
    print(f"| {w} | {label} | {ratios} | {statistics.median(x[0] for x in v):.2f}x | {paired} | "
          f"{statistics.median(x[1] for x in v):.1f} | {statistics.median(x[3] for x in v):.1f} | "
          f"{statistics.median(x[2] for x in v):.2f} |")
PY
