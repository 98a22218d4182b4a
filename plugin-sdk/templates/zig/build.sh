#!/usr/bin/env bash
# Builds @NAME@.zig into @NAME@.wasm with Zig 0.14 (ZIG may name the compiler, default `zig`;
# `pip install ziglang==0.14.1` gives `python3 -m ziglang`), adds the manifest from
# @NAME@.json and checks the result the way the server loads it. HOST may name the host binary (default: the one that wrote this skeleton).
set -euo pipefail
# The host binary: HOST, else the one that wrote this skeleton, else `host` on PATH.
for h in "${HOST:-}" '@HOST_BIN@' host; do
  if [ -n "$h" ] && command -v "$h" >/dev/null; then HOST=$h; break; fi
done
command -v "${HOST:-}" >/dev/null || { echo "build.sh: no host binary found; set HOST=/path/to/host (cargo build puts it in target/debug/host)" >&2; exit 127; }
HERE=$(cd "$(dirname "$0")" && pwd)
ZIG=${ZIG:-zig}
(cd "$(mktemp -d)" && $ZIG build-exe "$HERE/@NAME@.zig" -target wasm32-freestanding -fno-entry -rdynamic \
  -O ReleaseSmall -femit-bin="$HERE/@NAME@.wasm")
"$HOST" plugins add-manifest "$HERE/@NAME@.wasm" "$HERE/@NAME@.json"
"$HOST" plugins check "$HERE/@NAME@.wasm"
