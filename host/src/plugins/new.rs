//! `host plugins new NAME --kind KIND --lang LANG`: writes a buildable plugin skeleton from
//! the templates in `plugin-sdk/templates/` (embedded here), so a first plugin takes minutes.

use super::abi_v1::{Kind, Manifest};
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The languages a skeleton can be written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    C,
    Zig,
    #[value(alias = "as")]
    Assemblyscript,
    Wat,
}

const SDK_LIB: &str = include_str!("../../../plugin-sdk/src/lib.rs");
const SDK_ABI: &str = include_str!("../../../plugin-sdk/src/abi.rs");
const PLUGIN_H: &str = include_str!("../../../plugin-sdk/include/plugin.h");

macro_rules! template {
    ($path:literal) => {
        include_str!(concat!("../../../plugin-sdk/templates/", $path))
    };
}

/// The files of a skeleton: (path in the folder, text with placeholders).
fn files(kind: Kind, lang: Lang) -> Result<Vec<(String, &'static str)>> {
    let source = |ext: &str, text| vec![(format!("@NAME@.{ext}"), text)];
    let mut files = match (lang, kind) {
        (Lang::Rust, _) => {
            let lib = match kind {
                Kind::Sampler => template!("rust/sampler.rs"),
                Kind::Stop => template!("rust/stop.rs"),
                Kind::Tool => template!("rust/tool.rs"),
                Kind::Reasoning => template!("rust/reasoning.rs"),
                Kind::Scheduler => template!("rust/scheduler.rs"),
                Kind::Constraint => bail!(
                    "there is no skeleton for a constraint plugin yet; examples/wat/lowercase.wat is one to start from (ABI.md §5.6)"
                ),
            };
            vec![
                ("Cargo.toml".into(), template!("rust/Cargo.toml")),
                ("src/lib.rs".into(), lib),
                ("sdk/src/lib.rs".into(), SDK_LIB),
                ("sdk/src/abi.rs".into(), SDK_ABI),
                ("build.sh".into(), template!("rust/build.sh")),
            ]
        }
        (Lang::C, Kind::Sampler) => source("c", template!("c/sampler.c")),
        (Lang::C, Kind::Stop) => source("c", template!("c/stop.c")),
        (Lang::Zig, Kind::Sampler) => source("zig", template!("zig/sampler.zig")),
        (Lang::Zig, Kind::Stop) => source("zig", template!("zig/stop.zig")),
        (Lang::Assemblyscript, Kind::Sampler) => source("ts", template!("assemblyscript/sampler.ts")),
        (Lang::Assemblyscript, Kind::Stop) => source("ts", template!("assemblyscript/stop.ts")),
        (Lang::Wat, Kind::Sampler) => source("wat", template!("wat/sampler.wat")),
        (Lang::Wat, Kind::Stop) => source("wat", template!("wat/stop.wat")),
        (lang, kind) => bail!(
            "there is no {lang:?} skeleton for a {kind} plugin (those are sampler and stop); use --lang rust, or write the exports ABI.md §5 lists for the kind"
        ),
    };
    if lang == Lang::C {
        files.push(("plugin.h".into(), PLUGIN_H));
    }
    let script = match lang {
        Lang::Rust => None,
        Lang::C => Some(template!("c/build.sh")),
        Lang::Zig => Some(template!("zig/build.sh")),
        Lang::Assemblyscript => Some(template!("assemblyscript/build.sh")),
        Lang::Wat => Some(template!("wat/build.sh")),
    };
    files.extend(script.map(|s| ("build.sh".to_string(), s)));
    if lang == Lang::Assemblyscript {
        files.push(("package.json".into(), template!("assemblyscript/package.json")));
    }
    if !matches!(lang, Lang::Rust | Lang::Wat) {
        files.push(("@NAME@.json".into(), "@MANIFEST@\n"));
    }
    Ok(files)
}

/// The allocator each language's sources share (`@ALLOC@`).
fn allocator(lang: Lang) -> &'static str {
    match lang {
        Lang::Rust => "",
        Lang::C => template!("c/alloc.c"),
        Lang::Zig => template!("zig/alloc.zig"),
        Lang::Assemblyscript => template!("assemblyscript/alloc.ts"),
        Lang::Wat => template!("wat/alloc.wat"),
    }
}

/// The skeleton's manifest (ABI.md §2), checked as the host checks one.
fn manifest(name: &str, kind: Kind) -> Result<String> {
    let mut m = serde_json::json!({
        "abi": 1, "name": name, "version": "0.1.0", "kinds": [kind],
        "description": format!("a {kind} plugin made with host plugins new"),
    });
    match kind {
        Kind::Sampler => m["sampler"] = serde_json::json!({"input": "candidates", "k": 8}),
        // Text after the sentence end may be trimmed: the host holds that much back.
        Kind::Stop => m["stop"] = serde_json::json!({"hold": 16}),
        _ => {}
    }
    let text = m.to_string();
    serde_json::from_str::<Manifest>(&text).expect("a manifest we wrote").validate()?;
    Ok(text)
}

/// Writes the skeleton of a `kind` plugin called `name` in `lang` into `dir` (which must not
/// exist or be empty). Returns the files written.
pub fn write(name: &str, kind: Kind, lang: Lang, dir: &Path) -> Result<Vec<String>> {
    let manifest = manifest(name, kind)?;
    if dir.read_dir().is_ok_and(|mut d| d.next().is_some()) {
        bail!("{} exists and is not empty; pick another --dir", dir.display());
    }
    let wat_string = manifest.replace('\\', "\\\\").replace('"', "\\\"");
    let deps = if (lang, kind) == (Lang::Rust, Kind::Scheduler) { "serde_json = \"1\"\n" } else { "" };
    // The build scripts call the binary that wrote them when HOST is not set (after `cargo
    // build` it is rarely on PATH); inside single quotes in the script.
    let binary = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "host".into());
    let binary = binary.replace('\'', "'\\''");
    let fill = |text: &str| {
        text.replace("@ALLOC@", allocator(lang))
            .replace("@HOST_BIN@", &binary)
            .replace("@MANIFEST_WAT@", &wat_string)
            .replace("@MANIFEST@", &manifest)
            .replace("@DEPENDENCIES@", deps)
            .replace("@IDENT@", &name.replace('-', "_"))
            .replace("@NAME@", name)
    };
    let mut written = Vec::new();
    for (path, text) in files(kind, lang)? {
        let path = fill(&path);
        let target = dir.join(&path);
        std::fs::create_dir_all(target.parent().expect("a file in the folder"))
            .with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(&target, fill(text)).with_context(|| format!("writing {}", target.display()))?;
        #[cfg(unix)]
        if path.ends_with(".sh") {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))?;
        }
        written.push(path);
    }
    if lang == Lang::Rust {
        let sdk = "[package]\nname = \"plugin-sdk\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n[dependencies]\n";
        std::fs::write(dir.join("sdk/Cargo.toml"), sdk).context("writing sdk/Cargo.toml")?;
        written.push("sdk/Cargo.toml".into());
    }
    Ok(written)
}

/// Parses `--kind`.
pub fn parse_kind(text: &str) -> Result<Kind, String> {
    serde_json::from_value(serde_json::Value::String(text.to_string()))
        .map_err(|_| format!("unknown kind {text:?}; one of sampler, stop, tool, reasoning, scheduler"))
}
