#!/usr/bin/env bash
# Builds examples/c/scripted.c into a plugin (needs clang and lld; Debian: clang lld), then
# appends the `host.plugin` custom section from scripted.json (clang cannot emit one from C).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-scripted-c.wasm}
clang --target=wasm32 -O2 -nostdlib -Wl,--no-entry -Wl,--export-dynamic -o "$OUT" "$HERE/scripted.c"
python3 "$HERE/../append-manifest.py" "$OUT" "$HERE/scripted.json"
