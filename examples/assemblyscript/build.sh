#!/usr/bin/env bash
# Builds examples/assemblyscript/scripted.ts into a plugin with AssemblyScript 0.28 (npm;
# ASC may name the compiler, default: this folder's node_modules/.bin/asc, installed with
# `npm install` from package.json on first use), then adds the `host.plugin` section from
# scripted.json with `host plugins add-manifest` (HOST may name the host binary).
#
# The flags that matter: `--runtime stub` (a bump allocator, no garbage collector to drive)
# and `--use abort=` (the default build imports env.abort, and a plugin may import only
# host.log, so it would be refused).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=$(realpath -m "${1:-scripted-as.wasm}")
HOST=${HOST:-host}
if [ -z "${ASC:-}" ]; then
  [ -x "$HERE/node_modules/.bin/asc" ] || (cd "$HERE" && npm install --no-audit --no-fund --loglevel=error)
  ASC=$HERE/node_modules/.bin/asc
fi
$ASC "$HERE/scripted.ts" --outFile "$OUT" --runtime stub --use abort= -O3
"$HOST" plugins add-manifest "$OUT" "$HERE/scripted.json"
