//! ABI v1 as `plugin-sdk/ABI.md` defines it: the `host.plugin` manifest (read from the
//! module's custom section before compilation) and the names of imports and exports.

use anyhow::{bail, Context, Result};
use serde::Deserialize;

pub const ABI_VERSION: u32 = 1;
/// Oldest ABI version this host still loads.
pub const MIN_ABI_VERSION: u32 = 1;
pub const MANIFEST_SECTION: &str = "host.plugin";
pub const IMPORT_MODULE: &str = "host";
pub const IMPORT_LOG: &str = "log";

/// Plugin kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Sampler,
    Stop,
    Tool,
    Scheduler,
    Reasoning,
    /// Constrained decoding: which tokens may come next (added within v1).
    Constraint,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Sampler => "sampler",
            Kind::Stop => "stop",
            Kind::Tool => "tool",
            Kind::Scheduler => "scheduler",
            Kind::Reasoning => "reasoning",
            Kind::Constraint => "constraint",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SamplerInput {
    Candidates,
    Logits,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplerSpec {
    #[serde(default = "default_input")]
    pub input: SamplerInput,
    #[serde(default = "default_k")]
    pub k: usize,
}

fn default_input() -> SamplerInput {
    SamplerInput::Candidates
}
fn default_k() -> usize {
    64
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopSpec {
    #[serde(default)]
    pub hold: usize,
}

/// The `host.plugin` manifest.
#[derive(Debug, Clone, Deserialize)]
pub struct Manifest {
    pub abi: u32,
    pub name: String,
    #[serde(default)]
    pub version: String,
    pub kinds: Vec<Kind>,
    pub sampler: Option<SamplerSpec>,
    pub stop: Option<StopSpec>,
    #[serde(default)]
    pub description: String,
}

impl Manifest {
    pub fn sampler(&self) -> SamplerSpec {
        self.sampler.clone().unwrap_or(SamplerSpec { input: default_input(), k: default_k() })
    }
    pub fn stop(&self) -> StopSpec {
        self.stop.clone().unwrap_or_default()
    }
    pub fn has(&self, kind: Kind) -> bool {
        self.kinds.contains(&kind)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if !(MIN_ABI_VERSION..=ABI_VERSION).contains(&self.abi) {
            bail!(
                "plugin {} was built for ABI v{}, this host supports v{MIN_ABI_VERSION}..=v{ABI_VERSION}; rebuild it against plugin-sdk {}",
                self.name,
                self.abi,
                env!("CARGO_PKG_VERSION")
            );
        }
        if !name_ok(&self.name) {
            bail!("plugin name {:?} is invalid: use [a-z0-9][a-z0-9_-]*, at most 64 bytes", self.name);
        }
        if self.kinds.is_empty() {
            bail!(
                "plugin {} declares no kinds; give at least one of sampler, stop, tool, scheduler, reasoning, constraint",
                self.name
            );
        }
        let k = self.sampler().k;
        if !(1..=1024).contains(&k) {
            bail!("plugin {}: sampler.k must be between 1 and 1024, got {k}", self.name);
        }
        if self.stop().hold > 1024 {
            bail!("plugin {}: stop.hold must be at most 1024, got {}", self.name, self.stop().hold);
        }
        Ok(())
    }
}

fn leb_u32(bytes: &[u8], pos: &mut usize) -> Result<u32> {
    let mut result: u64 = 0;
    for shift in (0..35).step_by(7) {
        let b = *bytes.get(*pos).context("truncated LEB128 number")?;
        *pos += 1;
        result |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return u32::try_from(result).context("LEB128 number out of range");
        }
    }
    bail!("LEB128 number too long")
}

/// The payload of the custom section `name`, walking the module's section headers only.
pub fn custom_section<'a>(wasm: &'a [u8], name: &str) -> Result<Option<&'a [u8]>> {
    if wasm.len() < 8 || &wasm[..4] != b"\0asm" {
        bail!("not a WebAssembly module (bad magic number)");
    }
    if wasm[4..8] != [1, 0, 0, 0] {
        bail!("not a WebAssembly core module (version {:?}); components are not plugins", &wasm[4..8]);
    }
    let mut pos = 8;
    while pos < wasm.len() {
        let id = wasm[pos];
        pos += 1;
        let size = leb_u32(wasm, &mut pos)? as usize;
        let end =
            pos.checked_add(size).filter(|&e| e <= wasm.len()).context("a section runs past the end of the file")?;
        if id == 0 {
            let mut p = pos;
            let len = leb_u32(wasm, &mut p)? as usize;
            let name_end = p.checked_add(len).filter(|&e| e <= end).context("bad custom section name")?;
            if &wasm[p..name_end] == name.as_bytes() {
                return Ok(Some(&wasm[name_end..end]));
            }
        }
        pos = end;
    }
    Ok(None)
}

/// `wasm` with its manifest set to `manifest` (JSON, validated first): any `host.plugin`
/// section it had is dropped and the new one appended, for toolchains that cannot emit
/// custom sections (clang, Zig, AssemblyScript, `wat2wasm`, which drops `@custom`).
pub fn with_manifest(wasm: &[u8], manifest: &str) -> Result<Vec<u8>> {
    let parsed: Manifest =
        serde_json::from_str(manifest).context("the manifest is not valid JSON of the shape ABI.md §2 gives")?;
    parsed.validate()?;
    custom_section(wasm, MANIFEST_SECTION)?; // Checks the header and the section layout.
    let mut out = wasm[..8].to_vec();
    let mut pos = 8;
    while pos < wasm.len() {
        let start = pos;
        let id = wasm[pos];
        pos += 1;
        let size = leb_u32(wasm, &mut pos)? as usize;
        let end = pos + size;
        let mut p = pos;
        let ours = id == 0 && {
            let len = leb_u32(wasm, &mut p)? as usize;
            wasm.get(p..p + len) == Some(MANIFEST_SECTION.as_bytes())
        };
        if !ours {
            out.extend_from_slice(&wasm[start..end]);
        }
        pos = end;
    }
    let mut body = leb(MANIFEST_SECTION.len() as u32);
    body.extend_from_slice(MANIFEST_SECTION.as_bytes());
    body.extend_from_slice(manifest.trim().as_bytes());
    out.push(0);
    out.extend(leb(body.len() as u32));
    out.extend(body);
    Ok(out)
}

fn leb(mut n: u32) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        out.push(if n == 0 { b } else { b | 0x80 });
        if n == 0 {
            return out;
        }
    }
}

/// Reads and validates the manifest of a module.
/// Whether `name` is a valid plugin name: `[a-z0-9][a-z0-9_-]*`, at most 64 bytes.
fn name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'_')
}

/// The plugin name a module's manifest declares, when it is a valid name, even if the rest
/// of the manifest is refused: a refused file is listed, and a request naming it told why,
/// under the name its author gave it.
pub fn declared_name(wasm: &[u8]) -> Option<String> {
    let payload = custom_section(wasm, MANIFEST_SECTION).ok().flatten()?;
    let value: serde_json::Value = serde_json::from_slice(payload).ok()?;
    value.get("name")?.as_str().filter(|n| name_ok(n)).map(str::to_string)
}

pub fn manifest(wasm: &[u8]) -> Result<Manifest> {
    let payload = custom_section(wasm, MANIFEST_SECTION)?.with_context(|| {
        format!("no `{MANIFEST_SECTION}` custom section: every plugin declares its ABI version, name and kinds there (see plugin-sdk/ABI.md)")
    })?;
    let manifest: Manifest = serde_json::from_slice(payload)
        .with_context(|| format!("the `{MANIFEST_SECTION}` section is not a valid manifest"))?;
    manifest.validate()?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(manifest: &str) -> Vec<u8> {
        wat::parse_str(format!("(module (@custom \"host.plugin\" \"{}\"))", manifest.replace('"', "\\\""))).unwrap()
    }

    #[test]
    fn the_manifest_is_read_from_the_custom_section() {
        let m =
            manifest(&module(r#"{"abi": 1, "name": "greedy", "kinds": ["sampler"], "sampler": {"k": 8}}"#)).unwrap();
        assert_eq!((m.name.as_str(), m.sampler().k, m.sampler().input), ("greedy", 8, SamplerInput::Candidates));
    }

    #[test]
    fn bad_manifests_are_refused_with_the_reason() {
        let err = |m: &str| format!("{:#}", manifest(&module(m)).unwrap_err());
        assert!(err(r#"{"abi": 7, "name": "x", "kinds": ["stop"]}"#)
            .contains("built for ABI v7, this host supports v1..=v1"));
        assert!(err(r#"{"abi": 1, "name": "Bad Name", "kinds": ["stop"]}"#).contains("is invalid"));
        // A refused manifest still tells its (valid) name.
        let big_k = module(r#"{"abi": 1, "name": "wide", "kinds": ["sampler"], "sampler": {"k": 5000}}"#);
        assert!(manifest(&big_k).is_err());
        assert_eq!(declared_name(&big_k).as_deref(), Some("wide"));
        assert_eq!(declared_name(&module(r#"{"abi": 1, "name": "Bad Name"}"#)), None);
        assert!(err(r#"{"abi": 1, "name": "x", "kinds": []}"#).contains("declares no kinds"));
        assert!(err(r#"{"abi": 1, "name": "x", "kinds": ["sampler"], "sampler": {"k": 0}}"#).contains("sampler.k"));
        assert!(err(r#"{"abi": 1, "name": "x", "kinds": ["magic"]}"#).contains("not a valid manifest"));
        let none = manifest(&wat::parse_str("(module)").unwrap()).unwrap_err().to_string();
        assert!(none.contains("no `host.plugin` custom section"), "{none}");
        assert!(manifest(b"\0asm\x0d\0\x01\0").unwrap_err().to_string().contains("components are not plugins"));
        assert!(manifest(b"hello").unwrap_err().to_string().contains("bad magic"));
    }
}
