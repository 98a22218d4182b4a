#!/usr/bin/env bash
# Builds @NAME@.ts into @NAME@.wasm with AssemblyScript 0.28 (ASC may name the compiler,
# default: node_modules/.bin/asc, installed from package.json with npm on first use), adds
# the manifest from @NAME@.json and checks the result the way the server loads it. HOST may
# name the host binary (default: the one that wrote this skeleton). `--runtime stub` is a bump allocator with no garbage collector to
# drive; `--use abort=` drops the env.abort import (a plugin may import only host.log).
set -euo pipefail
# The host binary: HOST, else the one that wrote this skeleton, else `host` on PATH.
for h in "${HOST:-}" '@HOST_BIN@' host; do
  if [ -n "$h" ] && command -v "$h" >/dev/null; then HOST=$h; break; fi
done
command -v "${HOST:-}" >/dev/null || { echo "build.sh: no host binary found; set HOST=/path/to/host (cargo build puts it in target/debug/host)" >&2; exit 127; }
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -z "${ASC:-}" ]; then
  [ -x "$HERE/node_modules/.bin/asc" ] || (cd "$HERE" && npm install --no-audit --no-fund --loglevel=error)
  ASC=$HERE/node_modules/.bin/asc
fi
$ASC "$HERE/@NAME@.ts" --outFile "$HERE/@NAME@.wasm" --runtime stub --use abort= -O3
"$HOST" plugins add-manifest "$HERE/@NAME@.wasm" "$HERE/@NAME@.json"
"$HOST" plugins check "$HERE/@NAME@.wasm"
