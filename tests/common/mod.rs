//! Helpers shared by the integration tests that run the `host` binary on the fixture models
//! (`eval "$(scripts/test-fixtures.sh)"` sets `HOST_TEST_MODELS`).

#![allow(dead_code)]

use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long one run of the binary may take before a test calls it a hang (the slowest, a
/// debug build decoding SmolLM2 on a loaded 2-core machine, takes seconds).
pub const HANG: Duration = Duration::from_secs(300);

/// `Command::output` with a deadline: a child that hangs is killed and the test fails with
/// its stderr, instead of the whole suite waiting for CI's time limit.
pub trait OutputWithin {
    fn output_within(&mut self, limit: Duration) -> Output;
}

impl OutputWithin for Command {
    fn output_within(&mut self, limit: Duration) -> Output {
        let mut child = self
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {self:?}: {e}"));
        // Each pipe is read on its own thread (a full pipe would block the child) into a
        // shared buffer, so a killed child's pipe held open by a grandchild cannot block the
        // test, and what it wrote before the kill is still there to show.
        let drain = |mut pipe: Box<dyn Read + Send>| {
            let bytes = Arc::new(Mutex::new(Vec::new()));
            let sink = bytes.clone();
            let reader = std::thread::spawn(move || {
                let mut chunk = [0u8; 8192];
                while let Ok(n @ 1..) = pipe.read(&mut chunk) {
                    sink.lock().unwrap().extend_from_slice(&chunk[..n]);
                }
            });
            (bytes, reader)
        };
        let (stdout, stdout_reader) = drain(Box::new(child.stdout.take().unwrap()));
        let (stderr, stderr_reader) = drain(Box::new(child.stderr.take().unwrap()));
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("waiting for the child") {
                break status;
            }
            if started.elapsed() > limit {
                child.kill().ok();
                child.wait().ok();
                std::thread::sleep(Duration::from_millis(100));
                let err = stderr.lock().unwrap().clone();
                panic!(
                    "{self:?} did not finish within {} s and was killed (a hang); its stderr:\n{}",
                    limit.as_secs(),
                    String::from_utf8_lossy(&err)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        stdout_reader.join().unwrap();
        stderr_reader.join().unwrap();
        let take = |bytes: Arc<Mutex<Vec<u8>>>| std::mem::take(&mut *bytes.lock().unwrap());
        Output { status, stdout: take(stdout), stderr: take(stderr) }
    }
}

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
        .output_within(HANG)
}

/// As `run`, which must succeed; its JSON output.
pub fn generate(model: &Path, prompt: &str, max_tokens: usize, extra: &[&str]) -> Value {
    let out = run(model, prompt, max_tokens, extra);
    assert!(out.status.success(), "host generate {extra:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}
