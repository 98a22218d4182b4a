//! Helpers shared by the integration tests that run the `host` binary on the fixture models
//! (`eval "$(scripts/test-fixtures.sh)"` sets `HOST_TEST_MODELS`).

#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The fixture models folder; `None` (the test is skipped) when fixtures are not set up,
/// a failure under CI.
pub fn models() -> Option<PathBuf> {
    match std::env::var_os("HOST_TEST_MODELS") {
        Some(m) => Some(PathBuf::from(m)),
        None if std::env::var_os("CI").is_some() => panic!("HOST_TEST_MODELS missing under CI"),
        None => {
            eprintln!("skipped: fixtures not set up (eval \"$(scripts/test-fixtures.sh)\")");
            None
        }
    }
}

/// `host generate --json --device cpu` (greedy unless `extra` says otherwise).
pub fn run(model: &Path, prompt: &str, max_tokens: usize, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["generate", "--json", "--device", "cpu", "--max-tokens", &max_tokens.to_string(), "--prompt", prompt])
        .arg("--model")
        .arg(model)
        .args(extra)
        .output()
        .expect("running host generate")
}

/// As `run`, which must succeed; its JSON output.
pub fn generate(model: &Path, prompt: &str, max_tokens: usize, extra: &[&str]) -> Value {
    let out = run(model, prompt, max_tokens, extra);
    assert!(out.status.success(), "host generate {extra:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}
