#!/usr/bin/env bash
# The test command: prepares the parity fixtures (mlx-lm oracle virtualenv, SmolLM2 and
# tiny random models, all cached outside git) and runs every test of the workspace.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
eval "$(scripts/test-fixtures.sh)"
cargo test --workspace --locked "$@"
