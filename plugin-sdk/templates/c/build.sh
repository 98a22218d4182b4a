#!/usr/bin/env bash
# Builds @NAME@.c into @NAME@.wasm with clang and lld (Debian: apt-get install clang lld), adds
# the manifest from @NAME@.json (clang cannot emit custom sections from C) and checks the
# result the way the server loads it. HOST may name the host binary.
set -euo pipefail
cd "$(dirname "$0")"
clang --target=wasm32 -O2 -nostdlib -Wl,--no-entry -Wl,--export-dynamic -o @NAME@.wasm @NAME@.c
"${HOST:-host}" plugins add-manifest @NAME@.wasm @NAME@.json
"${HOST:-host}" plugins check @NAME@.wasm
