#!/usr/bin/env python3
"""Appends the `host.plugin` custom section (ABI.md §2) to a .wasm file, for toolchains that
cannot emit custom sections themselves (clang from C, Zig): the byte 0x00, the LEB128 size of
the rest, the LEB128 length of the name, the name, then the manifest JSON.

    append-manifest.py PLUGIN.wasm MANIFEST.json
"""
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
