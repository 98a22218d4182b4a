#!/usr/bin/env bash
# Constrained against unconstrained decoding in one process (`host bench --constraint
# ... --paired-plain`): for each structure in bench/structured/ and the example constraint
# plugin (examples/wat/lowercase.wat), and people.json through the built-in `guidance` plugin
# (llguidance in Wasm, guidance-people.json), the decode tok/s ratio
# (median of paired runs), the constraint's mask time per step, and the token trie's build
# and the structure's compile time (a server's first constrained request pays both).
# Usage: bench/structured.sh [HOST_BIN] [extra host bench flags, e.g. --model DIR --device gpu]
set -euo pipefail
DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HOST=${1:-$DIR/../target/release/host}
shift || true
# The constraint plugin examples/wat/lowercase.wat, built into a scratch folder.
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$HOST" plugins build-wat "$DIR/../examples/wat/lowercase.wat" "$WORK/lowercase.wasm"
echo '{"plugin": "lowercase.wasm"}' > "$WORK/lowercase.json"
for c in "$DIR"/structured/{people,guidance-people,json_object,regex}.json "$WORK/lowercase.json"; do
  "$HOST" bench --prompt-file "$DIR/structured/prompt.txt" --constraint "$c" \
    --paired-plain --runs "${RUNS:-5}" --gen "${GEN:-200}" "$@" 2>/dev/null | grep -v '^|'
done
