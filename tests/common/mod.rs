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
    run_with(model, prompt, max_tokens, extra, &[])
}

/// As `run`, with `env` added to its environment (and its workers').
pub fn run_with(model: &Path, prompt: &str, max_tokens: usize, extra: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["generate", "--json", "--device", "cpu", "--max-tokens", &max_tokens.to_string(), "--prompt", prompt])
        .arg("--model")
        .arg(model)
        .args(extra)
        .envs(env.iter().copied())
        .output_within(HANG)
}

/// As `run`, which must succeed; its JSON output.
pub fn generate(model: &Path, prompt: &str, max_tokens: usize, extra: &[&str]) -> Value {
    let out = run(model, prompt, max_tokens, extra);
    assert!(out.status.success(), "host generate {extra:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Runs the mlx-lm oracle `python script args...` (with the host's BLAS preloaded, so both
/// run the same kernels) and returns its stdout, reusing the output of an earlier run with
/// the same inputs: the script's bytes, the arguments, the preloaded library, and the name,
/// size and modification time of every file in `inputs` (model folders or files) and of the
/// oracle's mlx and mlx-lm packages. A fixture remade, a script edited or mlx-lm reinstalled
/// runs it again. Kept in `$HOST_CACHE_DIR/oracle-runs` (default `~/.cache/host`);
/// `HOST_ORACLE_RERUN=1` ignores what is kept.
pub fn oracle_output(python: &Path, script: &Path, args: &[String], inputs: &[&Path]) -> Vec<u8> {
    let blas = env!("HOST_LINKED_BLAS");
    let mut key = Fnv::default();
    key.write(&std::fs::read(script).unwrap_or_else(|e| panic!("{}: {e}", script.display())));
    for part in [python.to_string_lossy().as_ref(), blas].into_iter().chain(args.iter().map(String::as_str)) {
        key.write(part.as_bytes());
        key.write(&[0]);
    }
    let venv = python.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_default();
    let packages: Vec<PathBuf> = std::fs::read_dir(venv.join("lib"))
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|d| ["mlx_lm", "mlx"].map(|p| d.path().join("site-packages").join(p)))
        .collect();
    for input in inputs.iter().copied().chain(packages.iter().map(PathBuf::as_path)) {
        stamp(&mut key, input);
    }
    let root = std::env::var_os("HOST_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/host")))
        .unwrap_or_else(std::env::temp_dir);
    let kept = root.join("oracle-runs").join(format!("{:016x}.out", key.0));
    if std::env::var_os("HOST_ORACLE_RERUN").is_none() {
        if let Ok(bytes) = std::fs::read(&kept) {
            return bytes;
        }
    }
    let mut oracle = Command::new(python);
    if !blas.is_empty() {
        oracle.env("LD_PRELOAD", blas);
    }
    let out = oracle.arg(script).args(args).output_within(HANG);
    assert!(out.status.success(), "oracle failed: {}", String::from_utf8_lossy(&out.stderr));
    // Written whole, then renamed: a test running beside this one never reads half a file.
    let tmp = kept.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::create_dir_all(kept.parent().unwrap()).is_ok() && std::fs::write(&tmp, &out.stdout).is_ok() {
        let _ = std::fs::rename(&tmp, &kept);
    }
    out.stdout
}

/// FNV-1a, 64 bits: a key that stays the same across Rust versions.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf29ce484222325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
}

/// Adds `path` to `key`: for a file its name, size and modification time, for a folder those
/// of every file below it (sorted), for a missing path its name.
fn stamp(key: &mut Fnv, path: &Path) {
    key.write(path.to_string_lossy().as_bytes());
    let Ok(meta) = std::fs::metadata(path) else { return };
    if meta.is_dir() {
        let mut entries: Vec<PathBuf> =
            std::fs::read_dir(path).into_iter().flatten().flatten().map(|e| e.path()).collect();
        entries.sort();
        for entry in entries.iter().filter(|e| e.file_name().is_some_and(|n| n != "__pycache__")) {
            stamp(key, entry);
        }
        return;
    }
    let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
    key.write(&meta.len().to_le_bytes());
    key.write(&mtime.as_nanos().to_le_bytes());
}
