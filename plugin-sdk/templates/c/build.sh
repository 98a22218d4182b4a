#!/usr/bin/env bash
# Builds @NAME@.c into @NAME@.wasm with clang and lld (Debian: apt-get install clang lld), adds
# the manifest from @NAME@.json (clang cannot emit custom sections from C) and checks the
# result the way the server loads it. HOST may name the host binary (default: the one that wrote this skeleton).
set -euo pipefail
# The host binary: HOST, else the one that wrote this skeleton, else `host` on PATH.
for h in "${HOST:-}" '@HOST_BIN@' host; do
  if [ -n "$h" ] && command -v "$h" >/dev/null; then HOST=$h; break; fi
done
command -v "${HOST:-}" >/dev/null || { echo "build.sh: no host binary found; set HOST=/path/to/host (cargo build puts it in target/debug/host)" >&2; exit 127; }
cd "$(dirname "$0")"
clang --target=wasm32 -O2 -nostdlib -Wl,--no-entry -Wl,--export-dynamic -o @NAME@.wasm @NAME@.c
"$HOST" plugins add-manifest @NAME@.wasm @NAME@.json
"$HOST" plugins check @NAME@.wasm
