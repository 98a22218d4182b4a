#!/usr/bin/env bash
# Builds the plugin for wasm32 into @NAME@.wasm and checks it the way the server loads it.
# Needs the target once: rustup target add wasm32-unknown-unknown. HOST may name the host
# binary. Then copy @NAME@.wasm into the server's plugins folder (hot-reloaded).
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release --target wasm32-unknown-unknown
cp "${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/release/@IDENT@.wasm" @NAME@.wasm
"${HOST:-host}" plugins check @NAME@.wasm
