#!/usr/bin/env bash
# Builds @NAME@.ts into @NAME@.wasm with AssemblyScript 0.28 (ASC may name the compiler,
# default: node_modules/.bin/asc, installed from package.json with npm on first use), adds
# the manifest from @NAME@.json and checks the result the way the server loads it. HOST may
# name the host binary. `--runtime stub` is a bump allocator with no garbage collector to
# drive; `--use abort=` drops the env.abort import (a plugin may import only host.log).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
HOST=${HOST:-host}
if [ -z "${ASC:-}" ]; then
  [ -x "$HERE/node_modules/.bin/asc" ] || (cd "$HERE" && npm install --no-audit --no-fund --loglevel=error)
  ASC=$HERE/node_modules/.bin/asc
fi
$ASC "$HERE/@NAME@.ts" --outFile "$HERE/@NAME@.wasm" --runtime stub --use abort= -O3
"$HOST" plugins add-manifest "$HERE/@NAME@.wasm" "$HERE/@NAME@.json"
"$HOST" plugins check "$HERE/@NAME@.wasm"
