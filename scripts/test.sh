#!/usr/bin/env bash
# The test command: prepares the fixtures (mlx-lm oracle and SDK virtualenvs, SmolLM2 and
# tiny random models, all cached outside git), runs every Rust test of the workspace, then
# the end-to-end tests of `host serve` (tests/e2e, pytest with the official SDKs).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# (An assignment, so a failing fixture script stops here instead of leaving the tests to
# fail one by one on missing fixtures.)
fixtures=$(scripts/test-fixtures.sh)
eval "$fixtures"
cargo test --workspace --locked "$@"
HOST_BIN="$ROOT/target/debug/host" "$HOST_E2E_PYTHON" -m pytest -q tests/e2e
