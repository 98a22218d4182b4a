#!/usr/bin/env bash
# Assembles @NAME@.wat into @NAME@.wasm (keeping its manifest) and checks the result the way
# the server loads it. HOST may name the host binary (default: the one that wrote this skeleton).
set -euo pipefail
# The host binary: HOST, else the one that wrote this skeleton, else `host` on PATH.
for h in "${HOST:-}" '@HOST_BIN@' host; do
  if [ -n "$h" ] && command -v "$h" >/dev/null; then HOST=$h; break; fi
done
command -v "${HOST:-}" >/dev/null || { echo "build.sh: no host binary found; set HOST=/path/to/host (cargo build puts it in target/debug/host)" >&2; exit 127; }
cd "$(dirname "$0")"
"$HOST" plugins build-wat @NAME@.wat @NAME@.wasm
"$HOST" plugins check @NAME@.wasm
