#!/usr/bin/env bash
# Assembles @NAME@.wat into @NAME@.wasm (keeping its manifest) and checks the result the way
# the server loads it. HOST may name the host binary.
set -euo pipefail
cd "$(dirname "$0")"
"${HOST:-host}" plugins build-wat @NAME@.wat @NAME@.wasm
"${HOST:-host}" plugins check @NAME@.wasm
