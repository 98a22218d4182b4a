#!/usr/bin/env bash
# Builds examples/zig/scripted.zig into a plugin with Zig 0.14 (`pip install ziglang==0.14.1`;
# ZIG may name the compiler, default `python3 -m ziglang`), then appends the `host.plugin`
# custom section from scripted.json.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=$(realpath -m "${1:-scripted-zig.wasm}")
ZIG=${ZIG:-python3 -m ziglang}
cd "$(mktemp -d)"
$ZIG build-exe "$HERE/scripted.zig" -target wasm32-freestanding -fno-entry -rdynamic -O ReleaseSmall \
  -femit-bin="$OUT"
python3 "$HERE/../append-manifest.py" "$OUT" "$HERE/scripted.json"
