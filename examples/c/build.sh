#!/usr/bin/env bash
# Builds examples/c/scripted.c into a plugin (needs clang and lld; Debian: clang lld), then
# appends the `host.plugin` custom section from scripted.json: a custom section is the byte
# 0x00, the LEB128 size of the rest, the LEB128 length of the name, the name, the payload.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-scripted-c.wasm}
clang --target=wasm32 -O2 -nostdlib -Wl,--no-entry -Wl,--export-dynamic -o "$OUT" "$HERE/scripted.c"
python3 - "$OUT" "$HERE/scripted.json" <<'PY'
import sys
def leb(n):
    out = bytearray()
    while True:
        b = n & 0x7f
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)
name, payload = b"host.plugin", open(sys.argv[2], "rb").read().strip()
body = leb(len(name)) + name + payload
with open(sys.argv[1], "ab") as f:
    f.write(b"\x00" + leb(len(body)) + body)
PY
