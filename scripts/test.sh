#!/usr/bin/env bash
# The test command: prepares the fixtures (mlx-lm oracle and SDK virtualenvs, SmolLM2 and
# tiny random models, all cached outside git), runs every Rust test of the workspace, then
# the end-to-end tests of `host serve` (tests/e2e, pytest with the official SDKs).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# System packages: g++ (the MLX shim), OpenBLAS (linked by the host binary), clang and lld
# (the C example plugin), Chromium (the web page's tests, tests/e2e/test_ui.py), iproute2 and
# openssh-server (the network namespaces and the ssh-started rank of
# tests/e2e/test_multihost.py). Installed with apt-get when running as root, else named.
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v clang >/dev/null || missing+=(clang)
command -v wasm-ld >/dev/null || missing+=(lld)
[ -e /usr/lib/x86_64-linux-gnu/libopenblas.so.0 ] || [ "$(uname -s)" != Linux ] || missing+=(libopenblas0-pthread)
command -v chromium >/dev/null || missing+=(chromium)
command -v ip >/dev/null || missing+=(iproute2)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test.sh: installing ${missing[*]} with apt-get" >&2
    apt-get update -qq && apt-get install -y -qq "${missing[@]}" >&2
  else
    echo "test.sh: missing system packages: ${missing[*]}; install them (Debian: sudo apt-get install ${missing[*]}) and run again" >&2
    exit 1
  fi
fi
command -v npm >/dev/null || echo "test.sh: npm is missing: the agent-harness tests will fail (Debian: apt-get install nodejs npm)" >&2
# (An assignment, so a failing fixture script stops here instead of leaving the tests to
# fail one by one on missing fixtures.)
# Each phase's time goes to stderr, and pytest lists its slowest tests: where CI's time goes.
started=$SECONDS
fixtures=$(scripts/test-fixtures.sh)
eval "$fixtures"
echo "test.sh: fixtures ready in $((SECONDS - started)) s" >&2
started=$SECONDS
cargo test --workspace --locked --no-run "$@"
echo "test.sh: build in $((SECONDS - started)) s" >&2
# The test phases run several model processes at once (two test threads, two pytest workers,
# each with servers and clients), so each takes one BLAS thread: OpenBLAS's second thread
# would spin between a decode step's products on a core another process needs (perf: 16% of
# a CI run's CPU was its threads yielding). On this 2-core machine kind the integration tests
# took 267 s with OpenBLAS's default and 207 s so; the end-to-end tests in two workers 827 s
# against 1,164 s serially with the default (bench/RESULTS.md, "CI in session 32").
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
started=$SECONDS
cargo test --workspace --locked "$@"
echo "test.sh: cargo test in $((SECONDS - started)) s" >&2
started=$SECONDS
HOST_BIN="$ROOT/target/debug/host" "$HOST_E2E_PYTHON" -m pytest -q -n 2 --durations=15 tests/e2e
echo "test.sh: end-to-end tests in $((SECONDS - started)) s" >&2
