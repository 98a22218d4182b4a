#!/usr/bin/env bash
# Builds @NAME@.zig into @NAME@.wasm with Zig 0.14 (ZIG may name the compiler, default `zig`;
# `pip install ziglang==0.14.1` gives `python3 -m ziglang`), adds the manifest from
# @NAME@.json and checks the result the way the server loads it. HOST may name the host binary.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ZIG=${ZIG:-zig}
HOST=${HOST:-host}
(cd "$(mktemp -d)" && $ZIG build-exe "$HERE/@NAME@.zig" -target wasm32-freestanding -fno-entry -rdynamic \
  -O ReleaseSmall -femit-bin="$HERE/@NAME@.wasm")
"$HOST" plugins add-manifest "$HERE/@NAME@.wasm" "$HERE/@NAME@.json"
"$HOST" plugins check "$HERE/@NAME@.wasm"
