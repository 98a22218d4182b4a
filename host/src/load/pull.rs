//! Downloading a model from the Hugging Face hub into the hub's own cache (`host pull`, and
//! `--model org/name` when the cache lacks it), with the `hf-hub` crate: the files a model
//! folder needs (config, tokenizer, chat template, weights; or one GGUF file), each kept
//! where the hub's tools keep it (`blobs/<etag>`, `snapshots/<commit>/<file>`,
//! `refs/<revision>`), so `huggingface-cli` and `host` share it. A cut download resumes from
//! its `.sync.part` file; a weight file whose bytes do not hash to the hub's (LFS) etag is
//! removed and refused. `HF_ENDPOINT` picks the hub (a mirror, or a test's server),
//! `HF_TOKEN` (or the token file `huggingface-cli login` writes) opens gated models, and
//! `HF_HUB_OFFLINE=1` forbids the network.

use super::hub::{self, HubName};
use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};
use sha2::{Digest, Sha256};
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The files of a model folder (or GGUF repository) `host` reads.
fn wanted(file: &str) -> bool {
    let name = file.rsplit('/').next().unwrap_or(file);
    !file.contains('/')
        && (name.ends_with(".safetensors")
            || matches!(
                name,
                "config.json"
                    | "generation_config.json"
                    | "model.safetensors.index.json"
                    | "tokenizer.json"
                    | "tokenizer_config.json"
                    | "special_tokens_map.json"
                    | "chat_template.jinja"
                    | "chat_template.json"
            ))
}

/// Whether the environment forbids the network (`HF_HUB_OFFLINE`, as the hub's tools read it).
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false" | "False" | "no"))
}

fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.trim_end_matches('/').to_string())
        .unwrap_or_else(|| "https://huggingface.co".into())
}

/// `HF_TOKEN`, else the token file next to the hub cache (`$HF_HOME/token`).
fn token(root: &Path) -> Option<String> {
    if let Some(t) = std::env::var("HF_TOKEN").ok().filter(|t| !t.trim().is_empty()) {
        return Some(t.trim().to_string());
    }
    Cache::new(root.to_path_buf()).token()
}

/// What a failed hub request means for `name`, in words that say what to do.
fn explain(e: ApiError, name: &HubName, what: &str) -> anyhow::Error {
    let repo = name.repo();
    let status = match &e {
        ApiError::RequestError(r) => match r.as_ref() {
            ureq::Error::StatusCode(code) => Some(*code),
            _ => None,
        },
        _ => None,
    };
    match status {
        Some(401) | Some(403) => anyhow!(
            "the hub refused {what} of {repo} ({}): it is gated or private; accept its terms on the hub and set \
             HF_TOKEN (or run `huggingface-cli login`)",
            status.unwrap_or_default()
        ),
        Some(404) if what == "the file list" => anyhow!(
            "the hub has no model {repo} at revision {:?} (404 from {}): check the name and the revision \
             (org/name[@revision]); a gated model also answers 404 without HF_TOKEN",
            name.revision,
            endpoint()
        ),
        Some(code) => anyhow!("the hub answered {code} for {what} of {repo} ({})", endpoint()),
        None => anyhow!("{what} of {repo} from {} failed: {e}", endpoint()),
    }
}

/// What `--model` names, as `hub::resolve_model_arg` finds it; a hub name the cache lacks is
/// downloaded first, unless `HF_HUB_OFFLINE` is set (then the cache's error, which says how
/// to fetch it).
pub fn resolve_model_arg(arg: &Path) -> Result<PathBuf> {
    let found = hub::resolve_model_arg(arg);
    let name = match (&found, arg.exists()) {
        (Err(_), false) => HubName::parse(&arg.to_string_lossy()),
        _ => None,
    };
    match (found, name) {
        (Err(missing), Some(name)) if !offline() => {
            let root = hub::cache_root()?;
            eprintln!("{}: {missing:#}; downloading it", name.repo());
            pull(&name, &root, &[]).map_err(|e| {
                anyhow!(
                    "{}: not in the Hugging Face cache at {}, and downloading it failed: {e:#}. Fetch it with \
                     `host pull {}` where the hub is reachable, or set HF_HUB_OFFLINE=1 to use the cache only",
                    name.repo(),
                    root.display(),
                    name.repo()
                )
            })
        }
        (found, _) => found,
    }
}

/// Downloads what `name` needs into the hub cache at `root` (files already there are kept)
/// and returns the model path `--model` then loads. `include`, when not empty, picks the
/// repository files to fetch by name instead (`*` matches any run of characters).
pub fn pull(name: &HubName, root: &Path, include: &[String]) -> Result<PathBuf> {
    if offline() {
        bail!("HF_HUB_OFFLINE is set, so {} cannot be downloaded: unset it, or fetch the model where the network is reachable", name.repo());
    }
    std::fs::create_dir_all(root).with_context(|| format!("creating the hub cache {}", root.display()))?;
    let api = ApiBuilder::from_cache(Cache::new(root.to_path_buf()))
        .with_endpoint(endpoint())
        .with_token(token(root))
        .with_progress(false)
        .with_retries(0)
        .build()
        .context("starting the hub client")?;
    let repo = api.repo(Repo::with_revision(name.repo(), RepoType::Model, name.revision.clone()));
    let info = repo.info().map_err(|e| explain(e, name, "the file list"))?;
    let files: Vec<String> = info.siblings.iter().map(|s| s.rfilename.clone()).collect();
    let chosen: Vec<&String> = if include.is_empty() {
        let mut chosen: Vec<&String> = files.iter().filter(|f| wanted(f)).collect();
        if !chosen.iter().any(|f| f.ends_with(".safetensors")) {
            let ggufs: Vec<&String> = files.iter().filter(|f| f.to_ascii_lowercase().ends_with(".gguf")).collect();
            match ggufs.len() {
                1 => chosen = ggufs,
                0 => bail!(
                    "{} at {:?} has neither safetensors weights nor a GGUF file ({} files: {}); it is not a model host can load",
                    name.repo(),
                    name.revision,
                    files.len(),
                    files.iter().take(8).cloned().collect::<Vec<_>>().join(", ")
                ),
                _ => bail!(
                    "{} holds {} GGUF files; pick one with `host pull {} --include FILE`: {}",
                    name.repo(),
                    ggufs.len(),
                    name.repo(),
                    ggufs.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                ),
            }
        }
        chosen
    } else {
        let chosen: Vec<&String> = files.iter().filter(|f| include.iter().any(|p| glob(p, f))).collect();
        if chosen.is_empty() {
            bail!("no file of {} matches {}; it holds: {}", name.repo(), include.join(", "), files.join(", "));
        }
        chosen
    };
    let cache =
        Cache::new(root.to_path_buf()).repo(Repo::with_revision(name.repo(), RepoType::Model, name.revision.clone()));
    for file in chosen {
        let pointer = match cache.get(file) {
            Some(p) if verified(&p)? => {
                eprintln!("{file}: cached");
                p
            }
            _ => repo
                .download_with_progress(file, Meter::new(file))
                .map_err(|e| explain(e, name, &format!("the file {file}")))?,
        };
        if !verified(&pointer)? {
            let blob = std::fs::canonicalize(&pointer).unwrap_or_else(|_| pointer.clone());
            let _ = std::fs::remove_file(&blob);
            let _ = std::fs::remove_file(&pointer);
            bail!(
                "{file} of {} arrived corrupt (its bytes do not hash to the hub's sha256 {}); it was removed: run \
                 `host pull {}` again",
                name.repo(),
                etag_of(&pointer).unwrap_or_default(),
                name.repo()
            );
        }
    }
    hub::resolve(name, root)
}

/// `*` matches any run of characters; everything else itself.
fn glob(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((head, rest)) => {
            let Some(tail) = text.strip_prefix(head) else { return false };
            (0..=tail.len()).filter(|&i| tail.is_char_boundary(i)).any(|i| glob(rest, &tail[i..]))
        }
    }
}

/// The blob's name (the hub's etag) a cached file links to.
fn etag_of(pointer: &Path) -> Option<String> {
    let target = std::fs::read_link(pointer).ok().unwrap_or_else(|| pointer.to_path_buf());
    target.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// Whether a cached file's bytes hash to its etag, where the etag is a sha256 (the hub's LFS
/// files: the weights); other files (git blobs, etag a sha1 of a git header) pass.
fn verified(pointer: &Path) -> Result<bool> {
    let Some(etag) = etag_of(pointer) else { return Ok(true) };
    if etag.len() != 64 || !etag.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Ok(true);
    }
    Ok(sha256_file(pointer)?.eq_ignore_ascii_case(&etag))
}

/// The sha256 of a file's bytes, in lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Download progress on stderr: a line redrawn in place on a terminal, else a line at the
/// start, every quarter and the end.
struct Meter {
    file: String,
    total: usize,
    done: usize,
    started: Instant,
    shown: Instant,
    quarter: usize,
    terminal: bool,
    /// `init` was just called: the next update is the bytes a part file already held.
    starting: bool,
}

impl Meter {
    fn new(file: &str) -> Meter {
        Meter {
            file: file.to_string(),
            total: 0,
            done: 0,
            started: Instant::now(),
            shown: Instant::now(),
            quarter: 0,
            terminal: std::io::stderr().is_terminal(),
            starting: false,
        }
    }

    fn line(&self) -> String {
        let mb = |b: usize| b as f64 / 1e6;
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let pct = if self.total > 0 { 100.0 * self.done as f64 / self.total as f64 } else { 100.0 };
        format!(
            "{}: {:.1}/{:.1} MB ({pct:.0}%, {:.1} MB/s)",
            self.file,
            mb(self.done),
            mb(self.total),
            mb(self.done) / secs
        )
    }
}

impl Progress for Meter {
    fn init(&mut self, size: usize, _filename: &str) {
        self.total = size;
        self.starting = true;
    }

    fn update(&mut self, size: usize) {
        // hf-hub reports a resumed download's part file as the first update after `init`.
        if std::mem::take(&mut self.starting) && size > 0 && self.done == 0 {
            eprintln!("{}: resuming at {:.1} MB", self.file, size as f64 / 1e6);
        }
        self.done += size;
        if self.terminal {
            if self.shown.elapsed() > Duration::from_millis(200) {
                self.shown = Instant::now();
                eprint!("\r{}", self.line());
                let _ = std::io::stderr().flush();
            }
        } else if self.total > 0 && self.done * 4 / self.total > self.quarter {
            self.quarter = self.done * 4 / self.total;
            eprintln!("{}", self.line());
        }
    }

    fn finish(&mut self) {
        if self.terminal {
            eprintln!("\r{}", self.line());
        } else if self.quarter < 4 {
            eprintln!("{}", self.line());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_folder_takes_its_config_tokenizer_and_weights_only() {
        for f in ["config.json", "model-00001-of-00002.safetensors", "tokenizer.json", "chat_template.jinja"] {
            assert!(wanted(f), "{f}");
        }
        for f in ["README.md", ".gitattributes", "original/consolidated.safetensors", "pytorch_model.bin", "x.gguf"] {
            assert!(!wanted(f), "{f}");
        }
        assert!(glob("*Q4_K_M.gguf", "model-Q4_K_M.gguf") && glob("config.json", "config.json"));
        assert!(!glob("*.gguf", "model.safetensors") && glob("a*b*c", "aXXbYc"));
    }
}
