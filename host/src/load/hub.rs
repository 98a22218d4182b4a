//! Models named the way the Hugging Face hub names them, `org/name[@revision]`, found in the
//! hub's own cache as its tools lay it out (`huggingface-cli download`, `hf download`, any
//! `huggingface_hub` program): `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; in it
//! `models--org--name/refs/<revision>` holds a commit, `snapshots/<commit>/` the files
//! (links into `blobs/`). This file only reads the cache (`pull.rs` fills it, and its
//! `resolve_model_arg` downloads a name the cache lacks). `list` is what `host models` prints.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// A model's name on the hub and the revision asked for (a branch, tag or commit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubName {
    pub org: String,
    pub name: String,
    pub revision: String,
}

impl HubName {
    /// `org/name` or `org/name@revision` (revision `main` when none is given); `None` for
    /// anything else (a path, a single word). Organisation and name: letters, digits, `-`,
    /// `_`, `.`, as the hub allows, not starting with `.` or `-`.
    pub fn parse(s: &str) -> Option<HubName> {
        let (repo, revision) = match s.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (s, "main"),
        };
        let (org, name) = repo.split_once('/')?;
        let part = |p: &str| {
            !p.is_empty()
                && p.len() <= 96
                && !p.starts_with(['.', '-'])
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let rev_ok = !revision.is_empty()
            && !revision.contains("..")
            && revision.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
        (part(org) && part(name) && rev_ok).then(|| HubName {
            org: org.to_string(),
            name: name.to_string(),
            revision: revision.to_string(),
        })
    }

    /// `org/name`, as the hub and the APIs' `model` field say it.
    pub fn repo(&self) -> String {
        format!("{}/{}", self.org, self.name)
    }
}

/// The hub cache folder the hub's tools use here.
pub fn cache_root() -> Result<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var("HF_HUB_CACHE") {
        return Ok(d);
    }
    if let Some(d) = var("HF_HOME") {
        return Ok(d.join("hub"));
    }
    let base = var("XDG_CACHE_HOME")
        .or_else(|| var("HOME").map(|h| h.join(".cache")))
        .context("neither HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME nor HOME is set: set HF_HUB_CACHE to the hub cache")?;
    Ok(base.join("huggingface").join("hub"))
}

/// What `--model` names: an existing path as it is, else a hub name resolved in the cache
/// (`pull::resolve_model_arg` also downloads a name the cache lacks).
/// Anything else is returned as it is, for the loader to say what a model path must be; a
/// string shaped like `org/name` with characters the hub does not allow is refused here.
pub fn resolve_model_arg(arg: &Path) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let text = arg.to_string_lossy();
    match HubName::parse(&text) {
        Some(name) => resolve(&name, &cache_root()?)
            .with_context(|| format!("there is no file or folder {text:?} here, so it was looked up as a hub name")),
        None if text.contains('/') && !text.starts_with(['/', '.', '~']) && text.matches('/').count() == 1 => bail!(
            "{text:?} is not a model name the hub allows (org/name[@revision]: letters, digits, '-', '_', '.') \
             and no file or folder of that name exists"
        ),
        None => Ok(arg.to_path_buf()),
    }
}

/// The `org/name` that `arg` names on the hub, if it names one (for the served model's id).
pub fn hub_repo(arg: &Path) -> Option<String> {
    if arg.exists() {
        return None;
    }
    HubName::parse(&arg.to_string_lossy()).map(|n| n.repo())
}

/// The snapshot folder (or its one GGUF file) of `name` in the hub cache at `root`.
pub fn resolve(name: &HubName, root: &Path) -> Result<PathBuf> {
    let repo = name.repo();
    let dir = root.join(format!("models--{}--{}", name.org, name.name));
    let fetch = format!(
        "fetch it with `host pull {repo}{}` (or `huggingface-cli download`), which fills {}",
        if name.revision == "main" { String::new() } else { format!("@{}", name.revision) },
        root.display()
    );
    let offline = if std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0") {
        " (HF_HUB_OFFLINE is set)"
    } else {
        ""
    };
    if !dir.is_dir() {
        bail!("the model {repo} is not in the Hugging Face cache at {}{offline}: {fetch}", root.display());
    }
    let commit = match std::fs::read_to_string(dir.join("refs").join(&name.revision)) {
        Ok(c) => c.trim().to_string(),
        Err(_) if is_commit(&name.revision) => name.revision.clone(),
        Err(_) => {
            let known = revisions(&dir);
            bail!(
                "the revision {:?} of {repo} is not in the cache{offline} (cached: {}): {fetch}",
                name.revision,
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            );
        }
    };
    let snapshot = dir.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        bail!(
            "{repo}@{}: the cache names commit {commit} but has no snapshot {}{offline}: {fetch}",
            name.revision,
            snapshot.display()
        );
    }
    if snapshot.join("config.json").is_file() {
        return Ok(snapshot);
    }
    let mut ggufs: Vec<PathBuf> = std::fs::read_dir(&snapshot)
        .with_context(|| format!("reading {}", snapshot.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x.eq_ignore_ascii_case("gguf")))
        .collect();
    ggufs.sort();
    match ggufs.len() {
        1 => Ok(ggufs.remove(0)),
        0 => bail!(
            "the cached snapshot of {repo} ({}) has neither a config.json nor a .gguf file: the download is \
             incomplete or the repository holds no model; {fetch}",
            snapshot.display()
        ),
        _ => bail!(
            "{repo} holds {} GGUF files; pass the one to serve as a path: {}",
            ggufs.len(),
            ggufs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// A model the hub cache holds, as `host models` lists it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CachedModel {
    /// `org/name`.
    pub name: String,
    /// The revisions `refs/` names (`main`, tags), sorted.
    pub revisions: Vec<String>,
    /// Bytes on disk (the repository's blobs).
    pub bytes: u64,
    /// `config.json`'s `model_type`, or `gguf` for a repository of GGUF files.
    pub model_type: String,
    /// `4-bit (group 64)` for an MLX quantized folder, the quantization method of another
    /// quantized folder, the weights' dtype otherwise, or the GGUF files' names.
    pub quantization: String,
}

/// Every model repository in the hub cache at `root` (datasets and spaces left out), by name.
pub fn list(root: &Path) -> Vec<CachedModel> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut out: Vec<CachedModel> = entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            let (org, name) = file.strip_prefix("models--")?.split_once("--")?;
            Some(describe(&e.path(), format!("{org}/{name}")))
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn describe(dir: &Path, name: String) -> CachedModel {
    let revisions = revisions(dir);
    let bytes = std::fs::read_dir(dir.join("blobs"))
        .map(|d| d.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0);
    // The snapshot `main` names, else any.
    let snapshot = std::fs::read_to_string(dir.join("refs/main"))
        .ok()
        .map(|c| dir.join("snapshots").join(c.trim()))
        .filter(|p| p.is_dir())
        .or_else(|| std::fs::read_dir(dir.join("snapshots")).ok()?.flatten().map(|e| e.path()).next());
    let (model_type, quantization) = match snapshot {
        Some(s) => kind(&s),
        None => ("?".to_string(), "no snapshot".to_string()),
    };
    CachedModel { name, revisions, bytes, model_type, quantization }
}

/// A snapshot's model type and quantization (see `CachedModel`).
fn kind(snapshot: &Path) -> (String, String) {
    let config = std::fs::read(snapshot.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    if let Some(c) = config {
        let text = |v: &serde_json::Value| v.as_str().map(str::to_string);
        let model_type =
            text(&c["model_type"]).or_else(|| text(&c["text_config"]["model_type"])).unwrap_or_else(|| "?".into());
        let q = &c["quantization"];
        let quantization = if let Some(bits) = q["bits"].as_u64() {
            format!("{bits}-bit (group {})", q["group_size"].as_u64().unwrap_or(64))
        } else if let Some(method) = text(&c["quantization_config"]["quant_method"]) {
            method
        } else {
            text(&c["torch_dtype"]).or_else(|| text(&c["dtype"])).unwrap_or_else(|| "?".into())
        };
        return (model_type, quantization);
    }
    let mut ggufs: Vec<String> = std::fs::read_dir(snapshot)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.to_ascii_lowercase().ends_with(".gguf"))
                .collect()
        })
        .unwrap_or_default();
    ggufs.sort();
    if ggufs.is_empty() {
        ("?".into(), "no config.json or .gguf (incomplete?)".into())
    } else {
        ("gguf".into(), ggufs.join(", "))
    }
}

fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// The revisions `dir/refs` names (branches and tags, `refs/pr/N` included).
fn revisions(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, at: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(at) else { return };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                walk(base, &path, out);
            } else if let Ok(rel) = path.strip_prefix(base) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(&dir.join("refs"), &dir.join("refs"), &mut out);
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hub cache laid out as `huggingface_hub` writes it: files in `blobs/` by hash, the
    /// snapshot's entries links to them, `refs/main` the commit.
    fn cache(root: &Path, org: &str, name: &str, commit: &str, files: &[(&str, &str)], refs: &[&str]) -> PathBuf {
        let dir = root.join(format!("models--{org}--{name}"));
        let snapshot = dir.join("snapshots").join(commit);
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(dir.join("blobs")).unwrap();
        for (i, (file, body)) in files.iter().enumerate() {
            let blob = dir.join("blobs").join(format!("{i:040x}"));
            std::fs::write(&blob, body).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{i:040x}"), snapshot.join(file)).unwrap();
        }
        for r in refs {
            let path = dir.join("refs").join(r);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, commit).unwrap();
        }
        snapshot
    }

    fn temp(tag: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("host-hub-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        root
    }

    #[test]
    fn names_parse_as_the_hub_writes_them() {
        let n = HubName::parse("mlx-community/Qwen3.5-4B-4bit").unwrap();
        assert_eq!(
            (n.org.as_str(), n.name.as_str(), n.revision.as_str()),
            ("mlx-community", "Qwen3.5-4B-4bit", "main")
        );
        assert_eq!(HubName::parse("org/name@v1.0").unwrap().revision, "v1.0");
        assert_eq!(HubName::parse("org/name@refs/pr/3").unwrap().revision, "refs/pr/3");
        for bad in ["name", "a/b/c", "/abs/path", "./rel/x", "org/", "/name", "org/na me", "org/name@", "org/name@../x"]
        {
            assert_eq!(HubName::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_cached_name_resolves_to_its_snapshot_and_a_missing_one_says_how_to_fetch_it() {
        let root = temp("resolve");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let snap = cache(&root, "org", "model", commit, &[("config.json", "{}")], &["main", "v1"]);
        let at = |s: &str| resolve(&HubName::parse(s).unwrap(), &root);
        assert_eq!(at("org/model").unwrap(), snap);
        assert_eq!(at("org/model@v1").unwrap(), snap);
        assert_eq!(at(&format!("org/model@{commit}")).unwrap(), snap);
        assert!(snap
            .join("config.json")
            .canonicalize()
            .unwrap()
            .starts_with(root.canonicalize().unwrap().join("models--org--model/blobs")));
        let missing = at("org/other").unwrap_err().to_string();
        assert!(missing.contains("org/other") && missing.contains("host pull org/other"), "{missing}");
        let revision = at("org/model@v2").unwrap_err().to_string();
        assert!(revision.contains("\"v2\"") && revision.contains("cached: main, v1"), "{revision}");
        assert!(revision.contains("host pull org/model@v2"), "{revision}");
        // A GGUF repository: its one file; several: the error lists them.
        let gguf = cache(&root, "org", "gguf", commit, &[("m.Q4_K_M.gguf", "GGUF")], &["main"]);
        assert_eq!(at("org/gguf").unwrap(), gguf.join("m.Q4_K_M.gguf"));
        cache(&root, "org", "two", commit, &[("a.gguf", "x"), ("b.gguf", "y")], &["main"]);
        let two = at("org/two").unwrap_err().to_string();
        assert!(two.contains("2 GGUF files") && two.contains("a.gguf") && two.contains("b.gguf"), "{two}");
        // An interrupted download: a snapshot with no model files in it.
        cache(&root, "org", "partial", commit, &[("README.md", "x")], &["main"]);
        let partial = at("org/partial").unwrap_err().to_string();
        assert!(partial.contains("incomplete"), "{partial}");
        std::fs::remove_dir_all(root).ok();
    }

    #[test]
    fn the_cache_lists_its_models_with_type_quantization_and_size() {
        let root = temp("list");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let config = r#"{"model_type": "qwen3", "quantization": {"group_size": 32, "bits": 4}}"#;
        cache(
            &root,
            "mlx-community",
            "Qwen3-0.6B-4bit",
            commit,
            &[("config.json", config), ("model.safetensors", "0123456789")],
            &["main"],
        );
        cache(
            &root,
            "org",
            "plain",
            commit,
            &[("config.json", r#"{"model_type": "llama", "torch_dtype": "bfloat16"}"#)],
            &["main", "v1"],
        );
        cache(&root, "org", "ggufs", commit, &[("m.Q8_0.gguf", "x"), ("m.Q4_K_M.gguf", "y")], &["main"]);
        std::fs::create_dir_all(root.join("datasets--org--data")).unwrap();
        let listed = list(&root);
        let row = |name: &str| listed.iter().find(|m| m.name == name).unwrap_or_else(|| panic!("{name} in {listed:?}"));
        assert_eq!(listed.len(), 3, "{listed:?}");
        let q = row("mlx-community/Qwen3-0.6B-4bit");
        assert_eq!((q.model_type.as_str(), q.quantization.as_str()), ("qwen3", "4-bit (group 32)"));
        assert_eq!(q.bytes, (config.len() + 10) as u64);
        assert_eq!(row("org/plain").quantization, "bfloat16");
        assert_eq!(row("org/plain").revisions, ["main", "v1"]);
        assert_eq!(
            (row("org/ggufs").model_type.as_str(), row("org/ggufs").quantization.as_str()),
            ("gguf", "m.Q4_K_M.gguf, m.Q8_0.gguf")
        );
        assert!(list(&root.join("absent")).is_empty());
        std::fs::remove_dir_all(root).ok();
    }

    #[test]
    fn a_model_argument_is_a_path_first_then_a_hub_name() {
        let root = temp("arg");
        std::fs::create_dir_all(root.join("local")).unwrap();
        assert_eq!(resolve_model_arg(&root.join("local")).unwrap(), root.join("local"));
        assert_eq!(hub_repo(&root.join("local")), None);
        assert_eq!(hub_repo(Path::new("org/model@v1")).as_deref(), Some("org/model"));
        let bad = resolve_model_arg(Path::new("org/na me")).unwrap_err().to_string();
        assert!(bad.contains("not a model name the hub allows"), "{bad}");
        // Not a hub name: left to the loader, which says what a model path must be.
        assert_eq!(resolve_model_arg(Path::new("/nothing/here.gguf")).unwrap(), Path::new("/nothing/here.gguf"));
        std::fs::remove_dir_all(root).ok();
    }
}
