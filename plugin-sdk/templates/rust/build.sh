#!/usr/bin/env bash
# Builds the plugin for wasm32 into @NAME@.wasm and checks it the way the server loads it.
# Needs the target once: rustup target add wasm32-unknown-unknown. HOST may name the host
# binary. Then copy @NAME@.wasm into the server's plugins folder (hot-reloaded).
set -euo pipefail
# The host binary: HOST, else the one that wrote this skeleton, else `host` on PATH.
for h in "${HOST:-}" '@HOST_BIN@' host; do
  if [ -n "$h" ] && command -v "$h" >/dev/null; then HOST=$h; break; fi
done
command -v "${HOST:-}" >/dev/null || { echo "build.sh: no host binary found; set HOST=/path/to/host (cargo build puts it in target/debug/host)" >&2; exit 127; }
cd "$(dirname "$0")"
cargo build --release --target wasm32-unknown-unknown
cp "${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/release/@IDENT@.wasm" @NAME@.wasm
"$HOST" plugins check @NAME@.wasm
