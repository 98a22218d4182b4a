//! Wasm plugins (ABI v1, `plugin-sdk/ABI.md`): the manifest (`abi_v1.rs`), the wasmtime
//! runtime (`runtime.rs`) and here the registry of loaded plugins and the adapters that plug
//! an instance into the engine (a sampler) or the text pipeline (a stop rule).

pub mod abi_v1;
pub mod reload;
pub mod runtime;

use crate::engine::{ExternalSampler, Frame, Pick};
use abi_v1::{Kind, SamplerInput};
use anyhow::{bail, Context, Result};
use runtime::{Instance, Plugin, PluginRuntime, PluginSettings};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

/// A plugin chosen for one request, with its config (for `host_init`) and params (`host_begin`).
#[derive(Debug, Clone)]
pub struct Selected {
    pub plugin: Arc<Plugin>,
    pub config: Value,
    pub params: Value,
    /// Carry on without the plugin when it faults, instead of failing the request.
    pub fallback: bool,
}

/// The plugins one request uses.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub sampler: Option<Selected>,
    pub stops: Vec<Selected>,
}

impl Selection {
    pub fn is_empty(&self) -> bool {
        self.sampler.is_none() && self.stops.is_empty()
    }
}

/// What `GET /v1/plugins` and `host plugins list` show for each plugin or failed file.
#[derive(Debug, Clone, Serialize)]
pub struct PluginStatus {
    pub name: String,
    pub kinds: Vec<Kind>,
    pub version: String,
    pub source: String,
    pub sha256: String,
    pub state: &'static str,
    pub error: Option<String>,
    pub calls: u64,
    pub faults: u64,
}

/// Loaded plugins by name, and the files that failed to load with their reasons.
pub struct PluginRegistry {
    runtime: Arc<PluginRuntime>,
    plugins: RwLock<BTreeMap<String, Arc<Plugin>>>,
    failed: RwLock<BTreeMap<PathBuf, String>>,
}

impl std::fmt::Debug for PluginRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PluginRegistry({:?})", self.names())
    }
}

impl PluginRegistry {
    pub fn new() -> Result<Arc<PluginRegistry>> {
        Ok(Arc::new(PluginRegistry {
            runtime: PluginRuntime::new()?,
            plugins: Default::default(),
            failed: Default::default(),
        }))
    }

    pub fn runtime(&self) -> &Arc<PluginRuntime> {
        &self.runtime
    }

    /// Validates and loads one `.wasm` file; on success it replaces a plugin of the same name.
    pub fn load_file(&self, path: &Path) -> Result<Arc<Plugin>> {
        let settings_path = path.with_extension("toml");
        let settings = if settings_path.is_file() {
            PluginSettings::from_file(&settings_path)
        } else {
            Ok(PluginSettings::default())
        };
        let result = settings.and_then(|settings| {
            let wasm = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            self.runtime.load(&wasm, path, false, settings)
        });
        match result {
            Ok(plugin) => {
                let plugin = Arc::new(plugin);
                self.failed.write().expect("registry lock").remove(path);
                let mut plugins = self.plugins.write().expect("registry lock");
                // A file that now declares another name no longer provides the old one.
                plugins.retain(|name, p| p.source != path || *name == plugin.manifest.name);
                plugins.insert(plugin.manifest.name.clone(), plugin.clone());
                drop(plugins);
                tracing::info!(plugin = plugin.name(), file = %path.display(), "plugin loaded");
                Ok(plugin)
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), "plugin refused: {e:#}");
                self.failed.write().expect("registry lock").insert(path.to_path_buf(), format!("{e:#}"));
                Err(e)
            }
        }
    }

    /// Loads every `*.wasm` in `dir`; files that fail are recorded (see `status`) and skipped.
    pub fn load_dir(&self, dir: &Path) -> Result<usize> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading the plugins folder {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "wasm"))
            .collect();
        files.sort();
        Ok(files.iter().filter(|f| self.load_file(f).is_ok()).count())
    }

    /// Drops whatever was loaded from `path` (the file was deleted).
    pub fn remove_file(&self, path: &Path) {
        self.failed.write().expect("registry lock").remove(path);
        let mut plugins = self.plugins.write().expect("registry lock");
        let gone: Vec<String> = plugins.iter().filter(|(_, p)| p.source == path).map(|(n, _)| n.clone()).collect();
        for name in gone {
            plugins.remove(&name);
            tracing::info!(plugin = name, file = %path.display(), "plugin removed");
        }
    }

    pub fn get(&self, name: &str) -> Option<Arc<Plugin>> {
        self.plugins.read().expect("registry lock").get(name).cloned()
    }

    pub fn names(&self) -> Vec<String> {
        self.plugins.read().expect("registry lock").keys().cloned().collect()
    }

    pub fn status(&self) -> Vec<PluginStatus> {
        let mut out: Vec<PluginStatus> = self
            .plugins
            .read()
            .expect("registry lock")
            .values()
            .map(|p| PluginStatus {
                name: p.manifest.name.clone(),
                kinds: p.manifest.kinds.clone(),
                version: p.manifest.version.clone(),
                source: p.source.display().to_string(),
                sha256: p.sha256.clone(),
                state: if p.healthy() { "ready" } else { "unhealthy" },
                error: None,
                calls: p.calls.load(Ordering::Relaxed),
                faults: p.faults.load(Ordering::Relaxed),
            })
            .collect();
        for (path, error) in self.failed.read().expect("registry lock").iter() {
            out.push(PluginStatus {
                name: path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
                kinds: vec![],
                version: String::new(),
                source: path.display().to_string(),
                sha256: String::new(),
                state: "refused",
                error: Some(error.clone()),
                calls: 0,
                faults: 0,
            });
        }
        out
    }

    /// Looks up `name` for use as `kind`, with a message fit for a 400. A missing config or
    /// params falls back to the plugin's settings file, then to `{}`.
    pub fn select(
        &self,
        kind: Kind,
        name: &str,
        config: Option<Value>,
        params: Option<Value>,
        fallback: bool,
    ) -> Result<Selected> {
        let Some(plugin) = self.get(name) else {
            let names = self.names();
            bail!(
                "unknown {kind} plugin {name:?}; loaded plugins: {}",
                if names.is_empty() { "none".into() } else { names.join(", ") }
            );
        };
        if !plugin.manifest.has(kind) {
            bail!("plugin {name:?} is not a {kind} plugin (it is: {:?})", plugin.manifest.kinds);
        }
        let config = config.or_else(|| plugin.settings.config.clone()).unwrap_or_else(|| serde_json::json!({}));
        let params = params.or_else(|| plugin.settings.params.clone()).unwrap_or_else(|| serde_json::json!({}));
        Ok(Selected { plugin, config, params, fallback })
    }

    /// A started instance for one request: `host_init(config)` then `host_begin(params, seed)`.
    pub fn start(&self, selected: &Selected, seed: u64) -> Result<Instance> {
        let mut instance = self.runtime.instantiate(&selected.plugin, &selected.config)?;
        instance.begin(&selected.params, seed)?;
        Ok(instance)
    }
}

/// A sampler plugin instance as the engine's `ExternalSampler`.
pub struct PluginSampler {
    instance: Instance,
    vocab_size: usize,
    fallback: bool,
}

impl PluginSampler {
    pub fn new(instance: Instance, vocab_size: usize) -> PluginSampler {
        PluginSampler { instance, vocab_size, fallback: false }
    }

    /// Falls back to native sampling when the plugin faults (the request allowed it).
    pub fn with_fallback(mut self, fallback: bool) -> PluginSampler {
        self.fallback = fallback;
        self
    }

    /// A fault of this plugin: counted, and failing only the request.
    fn fault(&self, message: String) -> anyhow::Error {
        self.instance.plugin().faults.fetch_add(1, Ordering::Relaxed);
        anyhow::Error::new(runtime::PluginFault(message))
    }
}

impl ExternalSampler for PluginSampler {
    fn candidates(&self) -> Option<usize> {
        match self.instance.sampler_input() {
            (SamplerInput::Candidates, k) => Some(k),
            (SamplerInput::Logits, _) => None,
        }
    }

    fn sample(&mut self, position: usize, frame: Frame<'_>) -> Result<Pick> {
        let name = self.instance.plugin().manifest.name.clone();
        let result = match frame {
            Frame::Candidates(c) => {
                let mut bytes: Vec<u8> =
                    c.iter().flat_map(|(t, l)| t.to_le_bytes().into_iter().chain(l.to_le_bytes())).collect();
                let r = self.instance.sample(position, &mut bytes, c.len())?;
                if r == -1 {
                    for (i, rec) in bytes.chunks_exact(8).enumerate() {
                        c[i].1 = f32::from_le_bytes(rec[4..8].try_into().expect("8-byte records"));
                    }
                }
                r
            }
            Frame::Logits(row) => {
                let mut bytes: Vec<u8> = row.iter().flat_map(|l| l.to_le_bytes()).collect();
                let r = self.instance.sample(position, &mut bytes, row.len())?;
                if r == -1 {
                    for (i, v) in bytes.chunks_exact(4).enumerate() {
                        row[i] = f32::from_le_bytes(v.try_into().expect("4-byte values"));
                    }
                }
                r
            }
        };
        match result {
            -1 => Ok(Pick::Defer),
            t if t >= 0 && (t as usize) < self.vocab_size => Ok(Pick::Token(t as u32)),
            t if t >= 0 => Err(self.fault(format!(
                "plugin {name} picked token {t} in sampler_sample, outside the vocabulary of {}",
                self.vocab_size
            ))),
            r => {
                Err(self
                    .fault(format!("plugin {name} returned {r} from sampler_sample; ABI v1 allows a token id or -1")))
            }
        }
    }

    fn accept(&mut self, tokens: &[u32]) -> Result<()> {
        self.instance.accept(tokens)
    }

    fn fallback(&self) -> bool {
        self.fallback
    }
}

impl Drop for PluginSampler {
    fn drop(&mut self) {
        self.instance.end();
    }
}

/// `host plugins ...`: offline validation and listing.
#[derive(Debug, clap::Subcommand)]
pub enum PluginsCommand {
    /// Validate a plugin against ABI v1: manifest, imports, exports, compilation, instantiation.
    Check { file: PathBuf },
    /// Show what a plugins folder holds, and why any file is refused.
    List { dir: PathBuf },
    /// Assemble a hand-written WebAssembly text plugin (.wat) into a .wasm file.
    BuildWat { input: PathBuf, output: PathBuf },
}

pub fn run_command(command: PluginsCommand) -> Result<()> {
    let registry = PluginRegistry::new()?;
    match command {
        PluginsCommand::Check { file } => {
            let plugin = registry.load_file(&file)?;
            // Instantiating runs the start function and host_init with an empty config.
            let mut instance = registry.runtime().instantiate(&plugin, &serde_json::json!({}))?;
            instance.end();
            let m = &plugin.manifest;
            let kinds: Vec<String> = m.kinds.iter().map(Kind::to_string).collect();
            println!(
                "ok: {} {} (ABI v{}), kinds: {}, sha256 {}",
                m.name,
                m.version,
                m.abi,
                kinds.join(", "),
                plugin.sha256
            );
            Ok(())
        }
        PluginsCommand::BuildWat { input, output } => {
            let wasm = wat::parse_file(&input).map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
            std::fs::write(&output, wasm).with_context(|| format!("writing {}", output.display()))?;
            Ok(())
        }
        PluginsCommand::List { dir } => {
            registry.load_dir(&dir)?;
            for s in registry.status() {
                let kinds: Vec<String> = s.kinds.iter().map(Kind::to_string).collect();
                match &s.error {
                    None => println!("{:<24} {:<10} {:<16} {}", s.name, s.version, kinds.join(","), s.source),
                    Some(e) => println!("{:<24} refused: {e} ({})", s.name, s.source),
                }
            }
            Ok(())
        }
    }
}
