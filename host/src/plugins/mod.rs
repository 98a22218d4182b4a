//! Wasm plugins (ABI v1, `plugin-sdk/ABI.md`): the manifest (`abi_v1.rs`), the wasmtime
//! runtime (`runtime.rs`) and here the registry of loaded plugins and the adapters that plug
//! an instance into the engine (a sampler) or the text pipeline (a stop rule).

pub mod abi_v1;
pub mod new;
pub mod reload;
pub mod request;
pub mod runtime;

/// The built-in plugins (`plugins/*`, built to wasm by `build.rs`): (crate name, module).
mod builtin {
    include!(concat!(env!("OUT_DIR"), "/builtin_plugins.rs"));
}

use crate::engine::constraint::{Allowed, Constraint, ConstraintSpec};
use crate::engine::{ExternalSampler, Frame, Pick};
use abi_v1::{Kind, SamplerInput};
use anyhow::{bail, Context, Result};
use runtime::{Instance, Plugin, PluginRuntime, PluginSettings};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};

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
    /// The tool-call adapter over the output (its params carry the request's tools).
    pub tool: Option<Selected>,
    /// The reasoning parser over the output (ahead of the tool adapter): the model's
    /// thinking split from its answer.
    pub reasoning: Option<Selected>,
    /// The constraint plugin the request chose; the server turns it into the request's
    /// `ConstraintSpec` ([`constraint_spec`]) and leaves `None` here.
    pub constraint: Option<Selected>,
    /// Text that opens the reply: a call the request forces (`tool_choice`), already at the
    /// end of the prompt; fed to the tool adapter ahead of the output.
    pub reply_prefix: Option<String>,
    /// The adapter's grammar for the rest of that forced call (`tool_grammar`); the server
    /// makes it the request's constraint and leaves `None` here.
    pub reply_grammar: Option<String>,
    /// For calls the model starts on its own: the adapter's trigger and lazy grammar
    /// (`tool_trigger`, `tool_grammar` with `"lazy": true`); the server makes them the
    /// request's constraint and leaves `None` here.
    pub call_grammar: Option<(String, String)>,
    /// At most one tool call (OpenAI `parallel_tool_calls: false`, Anthropic
    /// `disable_parallel_tool_use`): generation ends when the adapter reports a second.
    pub one_tool_call: bool,
}

impl Selection {
    pub fn is_empty(&self) -> bool {
        self.sampler.is_none() && self.stops.is_empty() && self.tool.is_none() && self.reasoning.is_none()
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

/// Loaded plugins by name, and the files that failed to load with their reasons. A plugin
/// loaded from a file replaces a built-in one of the same name (until the file goes away).
/// A name has one file: a second file that declares a name another file already provides
/// is refused (and loads if the first one goes away or renames its plugin).
pub struct PluginRegistry {
    runtime: Arc<PluginRuntime>,
    builtins: BTreeMap<String, Arc<Plugin>>,
    plugins: RwLock<BTreeMap<String, Arc<Plugin>>>,
    failed: RwLock<BTreeMap<PathBuf, Refusal>>,
}

/// Why a file was refused, and the plugin name its manifest declares (when readable).
#[derive(Debug, Clone)]
struct Refusal {
    name: Option<String>,
    error: String,
    /// Refused because another file provides the name.
    duplicate: bool,
}

impl Refusal {
    /// The name a refused file goes by: its manifest's, else its file stem.
    fn shown_name(&self, path: &Path) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default())
    }
}

/// The one spelling of a plugin file's path that the registry keeps: absolute, its folder
/// with links resolved (the file itself may be gone). The start-up scan of a relative
/// `--plugins` folder and the watcher's absolute paths must name a file the same way, or a
/// file present at start could be neither replaced ("a duplicate of" itself) nor removed.
pub fn file_key(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (absolute.parent().and_then(|d| d.canonicalize().ok()), absolute.file_name()) {
        (Some(dir), Some(name)) => dir.join(name),
        _ => absolute,
    }
}

/// The settings file of the plugin `name` loaded from `path`: `NAME.toml` beside it, or one
/// named like the `.wasm` file; both at once is an error.
fn settings_for(path: &Path, name: Option<&str>) -> Result<PluginSettings> {
    let by_stem = path.with_extension("toml");
    let by_name = name.map(|n| path.with_file_name(format!("{n}.toml"))).filter(|p| p.is_file());
    match (by_name, by_stem.is_file()) {
        (Some(a), true) if a != by_stem => bail!(
            "two settings files for plugin {}: {} and {}; keep one (NAME.toml, named after the plugin)",
            name.unwrap_or_default(),
            a.display(),
            by_stem.display()
        ),
        (Some(a), _) => PluginSettings::from_file(&a),
        (None, true) => PluginSettings::from_file(&by_stem),
        (None, false) => Ok(PluginSettings::default()),
    }
}

impl std::fmt::Debug for PluginRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PluginRegistry({:?})", self.names())
    }
}

impl PluginRegistry {
    /// A registry without built-in plugins.
    pub fn new() -> Result<Arc<PluginRegistry>> {
        Ok(Arc::new(PluginRegistry {
            runtime: PluginRuntime::new()?,
            builtins: BTreeMap::new(),
            plugins: Default::default(),
            failed: Default::default(),
        }))
    }

    /// A registry holding the built-in plugins, compiled in parallel (or read from the
    /// compiled-module cache).
    pub fn with_builtins() -> Result<Arc<PluginRegistry>> {
        let runtime = PluginRuntime::new()?;
        let loaded: Vec<Result<Plugin>> = std::thread::scope(|scope| {
            let handles: Vec<_> = builtin::BUILTIN
                .iter()
                .map(|(name, wasm)| {
                    let runtime = &runtime;
                    scope.spawn(move || {
                        let source = PathBuf::from(format!("builtin:{name}"));
                        runtime.load(wasm, &source, true, PluginSettings::default())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("built-in plugin loader thread")).collect()
        });
        let mut builtins = BTreeMap::new();
        for plugin in loaded {
            let plugin = plugin.context("a built-in plugin failed to load (a build problem)")?;
            builtins.insert(plugin.manifest.name.clone(), Arc::new(plugin));
        }
        Ok(Arc::new(PluginRegistry { runtime, builtins, plugins: Default::default(), failed: Default::default() }))
    }

    pub fn runtime(&self) -> &Arc<PluginRuntime> {
        &self.runtime
    }

    /// Validates and loads one `.wasm` file (with its settings file, see [`settings_for`]);
    /// on success it replaces the plugin of the same name that this file provided before.
    /// Refused when another file already provides the name.
    pub fn load_file(&self, path: &Path) -> Result<Arc<Plugin>> {
        let key = file_key(path);
        let path = key.as_path();
        let mut name = None;
        let result = std::fs::read(path).with_context(|| format!("reading {}", path.display())).and_then(|wasm| {
            name = abi_v1::declared_name(&wasm);
            let settings = settings_for(path, name.as_deref())?;
            self.runtime.load(&wasm, path, false, settings)
        });
        let plugin = match result {
            Ok(plugin) => Arc::new(plugin),
            Err(e) => return Err(self.refuse(path, name, e, false)),
        };
        let name = plugin.manifest.name.clone();
        let mut plugins = self.plugins.write().expect("registry lock");
        if let Some(owner) = plugins.get(&name).filter(|p| p.source != path) {
            let e = anyhow::anyhow!(
                "{} declares the plugin name {name:?}, which {} already provides; one file per name: rename the plugin in one manifest or remove one file",
                path.display(),
                owner.source.display()
            );
            drop(plugins);
            return Err(self.refuse(path, Some(name), e, true));
        }
        // A file that now declares another name no longer provides the old one.
        let renamed: Vec<String> =
            plugins.iter().filter(|(n, p)| p.source == path && **n != name).map(|(n, _)| n.clone()).collect();
        for old in &renamed {
            plugins.remove(old);
        }
        plugins.insert(name, plugin.clone());
        drop(plugins);
        self.failed.write().expect("registry lock").remove(path);
        tracing::info!(plugin = plugin.name(), file = %path.display(), "plugin loaded");
        self.load_waiting_for(&renamed);
        Ok(plugin)
    }

    /// Records a refused file (the reason shows at `/v1/plugins` and in requests that name it).
    fn refuse(&self, path: &Path, name: Option<String>, e: anyhow::Error, duplicate: bool) -> anyhow::Error {
        // The reason may quote the module (export names, its manifest): one escaped line.
        let error = runtime::plugin_text(&format!("{e:#}"));
        tracing::warn!(file = %path.display(), "plugin refused: {error}");
        let refusal = Refusal { name, error, duplicate };
        self.failed.write().expect("registry lock").insert(path.to_path_buf(), refusal);
        e
    }

    /// Loads the files refused only because another file provided one of `names`, now free.
    fn load_waiting_for(&self, names: &[String]) {
        let waiting: Vec<PathBuf> = self
            .failed
            .read()
            .expect("registry lock")
            .iter()
            .filter(|(_, r)| r.duplicate && r.name.as_ref().is_some_and(|n| names.contains(n)))
            .map(|(p, _)| p.clone())
            .collect();
        for path in waiting {
            let _ = self.load_file(&path);
        }
    }

    /// The `.wasm` files a settings file `toml` may belong to: those whose plugin is named
    /// after it and the one named like it.
    pub fn files_for_settings(&self, toml: &Path) -> Vec<PathBuf> {
        let key = file_key(toml);
        let toml = key.as_path();
        let Some(stem) = toml.file_stem().map(|s| s.to_string_lossy().into_owned()) else { return vec![] };
        let dir = toml.parent();
        let mut files: Vec<PathBuf> = vec![toml.with_extension("wasm")];
        for (name, p) in self.plugins.read().expect("registry lock").iter() {
            if *name == stem && p.source.parent() == dir {
                files.push(p.source.clone());
            }
        }
        for (path, r) in self.failed.read().expect("registry lock").iter() {
            if r.name.as_deref() == Some(stem.as_str()) && path.parent() == dir {
                files.push(path.clone());
            }
        }
        files.sort();
        files.dedup();
        files
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

    /// Drops whatever was loaded from `path` (the file was deleted); a file refused because
    /// this one had its name loads now.
    pub fn remove_file(&self, path: &Path) {
        let key = file_key(path);
        let path = key.as_path();
        self.failed.write().expect("registry lock").remove(path);
        let mut plugins = self.plugins.write().expect("registry lock");
        let gone: Vec<String> = plugins.iter().filter(|(_, p)| p.source == path).map(|(n, _)| n.clone()).collect();
        for name in &gone {
            plugins.remove(name);
            tracing::info!(plugin = name, file = %path.display(), "plugin removed");
        }
        drop(plugins);
        self.load_waiting_for(&gone);
    }

    pub fn get(&self, name: &str) -> Option<Arc<Plugin>> {
        self.plugins.read().expect("registry lock").get(name).or_else(|| self.builtins.get(name)).cloned()
    }

    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.plugins.read().expect("registry lock").keys().cloned().collect();
        names.extend(self.builtins.keys().cloned());
        names.sort();
        names.dedup();
        names
    }

    /// Every plugin (a built-in replaced by a file shows as `overridden`) and refused file.
    pub fn status(&self) -> Vec<PluginStatus> {
        let user = self.plugins.read().expect("registry lock");
        let show = |p: &Plugin, state: &'static str| {
            let quarantine = p.quarantine().filter(|_| state == "ready");
            PluginStatus {
                name: p.manifest.name.clone(),
                kinds: p.manifest.kinds.clone(),
                version: p.manifest.version.clone(),
                source: p.source.display().to_string(),
                sha256: p.sha256.clone(),
                state: match &quarantine {
                    Some(_) => "quarantined",
                    None if state == "ready" && !p.healthy() => "unhealthy",
                    None => state,
                },
                error: quarantine.map(|q| q.message).or_else(|| p.last_fault().filter(|_| !p.healthy())),
                calls: p.calls.load(Ordering::Relaxed),
                faults: p.faults.load(Ordering::Relaxed),
            }
        };
        let mut out: Vec<PluginStatus> = user.values().map(|p| show(p, "ready")).collect();
        for (name, p) in &self.builtins {
            out.push(show(p, if user.contains_key(name) { "overridden" } else { "ready" }));
        }
        drop(user);
        for (path, refusal) in self.failed.read().expect("registry lock").iter() {
            out.push(PluginStatus {
                name: refusal.shown_name(path),
                kinds: vec![],
                version: String::new(),
                source: path.display().to_string(),
                sha256: String::new(),
                state: "refused",
                error: Some(refusal.error.clone()),
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
            if let Some((path, refusal)) =
                self.failed.read().expect("registry lock").iter().find(|(p, r)| r.shown_name(p) == name)
            {
                bail!(
                    "{kind} plugin {name:?} is not loaded: its file {} was refused: {} (GET /v1/plugins lists every refusal)",
                    path.display(),
                    refusal.error
                );
            }
            let names = self.names_of(kind);
            bail!(
                "unknown {kind} plugin {name:?}; loaded {kind} plugins: {}",
                if names.is_empty() { "none".into() } else { names.join(", ") }
            );
        };
        if !plugin.manifest.has(kind) {
            let kinds: Vec<String> = plugin.manifest.kinds.iter().map(|k| format!("a {k} plugin")).collect();
            bail!("plugin {name:?} is not a {kind} plugin (it is {})", kinds.join(" and "));
        }
        if let Some(q) = plugin.quarantine().filter(|_| !fallback) {
            return Err(anyhow::Error::new(q));
        }
        let config = config.or_else(|| plugin.settings.config.clone()).unwrap_or_else(|| serde_json::json!({}));
        let params = params.or_else(|| plugin.settings.params.clone()).unwrap_or_else(|| serde_json::json!({}));
        Ok(Selected { plugin, config, params, fallback })
    }

    /// The loaded plugins of `kind`.
    fn names_of(&self, kind: Kind) -> Vec<String> {
        self.names().into_iter().filter(|n| self.get(n).is_some_and(|p| p.manifest.has(kind))).collect()
    }

    /// A started instance for one request: `host_init(config)` then `host_begin(params, seed)`.
    /// A quarantined plugin does not start.
    pub fn start(&self, selected: &Selected, seed: u64) -> Result<Instance> {
        if let Some(q) = selected.plugin.quarantine() {
            bail!(runtime::PluginFault(q.message));
        }
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
    fn fault(&mut self, message: String) -> anyhow::Error {
        self.instance.fault(message)
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

/// A constraint plugin (ABI.md §5.6) as the request's constraint: each start (on the
/// engine thread, when the request starts) makes an instance, hands it the vocabulary and
/// begins the request with its params and seed — or, after `ConstraintSpec::prepare` (the
/// server's, before the request reaches the engine), takes the instance it made and handed
/// the vocabulary, and begins it.
pub fn constraint_spec(registry: Arc<PluginRegistry>, selected: Selected, vocab: Arc<Vec<u8>>) -> ConstraintSpec {
    let kind = selected.plugin.name().to_string();
    let tokens = vocab.get(..4).map_or(0, |n| u32::from_le_bytes(n.try_into().expect("4 bytes")) as usize);
    let words = tokens.div_ceil(32);
    let selected = Arc::new(selected);
    let make = {
        let selected = selected.clone();
        move || -> Result<Instance> {
            let mut instance = registry.runtime.instantiate(&selected.plugin, &selected.config)?;
            instance.constraint_vocab(&vocab)?;
            Ok(instance)
        }
    };
    let made: Arc<Mutex<Option<Result<Instance>>>> = Arc::default();
    let prepare = {
        let (made, make) = (made.clone(), make.clone());
        move || {
            let instance = make();
            *made.lock().unwrap_or_else(|p| p.into_inner()) = Some(instance);
        }
    };
    ConstraintSpec::new(kind, move |seed| {
        if let Some(q) = selected.plugin.quarantine() {
            bail!(runtime::PluginFault(q.message));
        }
        let prepared = made.lock().unwrap_or_else(|p| p.into_inner()).take();
        let started = prepared.unwrap_or_else(&make).and_then(|mut instance| {
            instance.begin(&selected.params, seed)?;
            Ok(instance)
        });
        match started {
            Ok(instance) => {
                Ok(Box::new(PluginConstraint { instance: Some(instance), fallback: selected.fallback, words })
                    as Box<dyn Constraint>)
            }
            Err(e) if selected.fallback && !e.chain().any(|c| c.downcast_ref::<runtime::PluginRefused>().is_some()) => {
                tracing::warn!("constraint plugin {} skipped for this request: {e:#}", selected.plugin.name());
                Ok(Box::new(PluginConstraint { instance: None, fallback: true, words }) as Box<dyn Constraint>)
            }
            Err(e) => Err(e),
        }
    })
    .with_prepare(prepare)
}

/// Every token's bytes as a constraint plugin receives them (ABI.md §5.6): the token count,
/// the end-of-sequence ids, then each token as a u32 length and its bytes.
pub fn encode_vocab(words: &[Vec<u8>], eos: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 4 * eos.len() + words.iter().map(|w| 4 + w.len()).sum::<usize>());
    out.extend((words.len() as u32).to_le_bytes());
    out.extend((eos.len() as u32).to_le_bytes());
    out.extend(eos.iter().flat_map(|e| e.to_le_bytes()));
    for w in words {
        out.extend((w.len() as u32).to_le_bytes());
        out.extend_from_slice(w);
    }
    out
}

/// A constraint plugin's instance serving one request. Without an instance (it faulted and
/// the request allowed a fallback) anything goes.
struct PluginConstraint {
    instance: Option<Instance>,
    fallback: bool,
    /// u32 words in a bitset over the vocabulary.
    words: usize,
}

impl PluginConstraint {
    /// Runs `f` on the instance; a fault under a fallback drops the constraint for the rest
    /// of the request.
    fn with<T>(&mut self, otherwise: T, f: impl FnOnce(&mut Instance) -> Result<T>) -> Result<T> {
        let Some(instance) = self.instance.as_mut() else { return Ok(otherwise) };
        match f(instance) {
            Ok(t) => Ok(t),
            Err(e) if self.fallback => {
                tracing::warn!(
                    "constraint plugin {} dropped for the rest of this request: {e:#}",
                    instance.plugin().name()
                );
                self.instance = None;
                Ok(otherwise)
            }
            Err(e) => Err(e),
        }
    }
}

impl Constraint for PluginConstraint {
    fn allowed(&mut self) -> Result<Allowed> {
        let words = self.words;
        self.with(Allowed::Anything, |instance| {
            match instance.constraint_mask(words)? {
                (0, _) => Ok(Allowed::Anything),
                (1, _) => Ok(Allowed::End),
                (2, bits) => Ok(Allowed::Tokens(bits)),
                (r, _) => {
                    let name = instance.plugin().name().to_string();
                    Err(instance.fault(format!(
                        "plugin {name} returned {r} from constraint_mask; ABI v1 allows 0 (anything), 1 (end) or 2 (the bitset)"
                    )))
                }
            }
        })
    }

    fn accept(&mut self, token: u32) -> Result<()> {
        self.with((), |instance| instance.constraint_accept(token))
    }

    fn rollback(&mut self, tokens: usize) -> Result<()> {
        self.with((), |instance| instance.constraint_rollback(tokens as u32))
    }
}

/// What a tool adapter reports (ABI.md §5.3), checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolOutput {
    Content(String),
    Call { index: usize, id: String, name: String },
    Args { index: usize, delta: String },
}

/// A streaming text-parser instance (a tool adapter or a reasoning parser) on one request's
/// output. With a fallback allowed, a fault turns it off and the text passes through as
/// content from then on.
struct TextParser {
    instance: Option<Instance>,
    fallback: bool,
}

impl TextParser {
    /// Runs `call` (one entry point) and `parse` over its JSON lines; `plain` wraps the text
    /// that passes through once the parser is off.
    fn run<E>(
        &mut self,
        text: &str,
        entry: &str,
        call: impl FnOnce(&mut Instance) -> Result<String>,
        parse: impl FnOnce(&str, &str, &str) -> Result<Vec<E>, String>,
        plain: impl Fn(String) -> E,
    ) -> Result<Vec<E>> {
        let passthrough = || if text.is_empty() { vec![] } else { vec![plain(text.to_string())] };
        let Some(instance) = self.instance.as_mut() else { return Ok(passthrough()) };
        let result = call(instance).and_then(|lines| {
            let name = instance.plugin().name().to_string();
            parse(&name, entry, &lines).map_err(|m| instance.fault(m))
        });
        match result {
            Ok(events) => Ok(events),
            Err(e) if self.fallback => {
                tracing::warn!("{entry}: plugin dropped for this request, passing text through: {e:#}");
                self.instance = None;
                Ok(passthrough())
            }
            Err(e) => Err(e),
        }
    }
}

/// A tool-adapter instance on one request's output.
pub struct PluginTools {
    parser: TextParser,
    /// Calls reported so far: the next call's index.
    calls: usize,
}

impl PluginTools {
    pub fn new(instance: Instance, fallback: bool) -> PluginTools {
        PluginTools { parser: TextParser { instance: Some(instance), fallback }, calls: 0 }
    }

    /// Feeds the next piece of output text.
    pub fn feed(&mut self, text: &str) -> Result<Vec<ToolOutput>> {
        self.run(text, "tool_feed", |i| i.tool_feed(text))
    }

    /// End of output: what the adapter still holds.
    pub fn finish(&mut self) -> Result<Vec<ToolOutput>> {
        self.run("", "tool_finish", Instance::tool_finish)
    }

    fn run(
        &mut self,
        text: &str,
        entry: &str,
        call: impl FnOnce(&mut Instance) -> Result<String>,
    ) -> Result<Vec<ToolOutput>> {
        let calls = &mut self.calls;
        let parse = |name: &str, entry: &str, lines: &str| {
            let (events, n) = parse_tool_events(name, entry, lines, *calls)?;
            *calls = n;
            Ok(events)
        };
        self.parser.run(text, entry, call, parse, ToolOutput::Content)
    }
}

/// What a reasoning parser reports (ABI.md §5.5), checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningOutput {
    Content(String),
    Reasoning(String),
}

/// A reasoning-parser instance on one request's output: splits the model's thinking from
/// its answer.
pub struct PluginReasoning {
    parser: TextParser,
}

impl PluginReasoning {
    pub fn new(instance: Instance, fallback: bool) -> PluginReasoning {
        PluginReasoning { parser: TextParser { instance: Some(instance), fallback } }
    }

    /// Feeds the next piece of output text.
    pub fn feed(&mut self, text: &str) -> Result<Vec<ReasoningOutput>> {
        self.parser.run(
            text,
            "reasoning_feed",
            |i| i.reasoning_feed(text),
            parse_reasoning_events,
            ReasoningOutput::Content,
        )
    }

    /// End of output: what the parser still holds.
    pub fn finish(&mut self) -> Result<Vec<ReasoningOutput>> {
        self.parser.run(
            "",
            "reasoning_finish",
            Instance::reasoning_finish,
            parse_reasoning_events,
            ReasoningOutput::Content,
        )
    }
}

/// Parses a reasoning parser's JSON-lines events: `{"content": ..}` or `{"reasoning": ..}`.
fn parse_reasoning_events(plugin: &str, entry: &str, lines: &str) -> Result<Vec<ReasoningOutput>, String> {
    let mut out = Vec::new();
    for line in lines.lines().filter(|l| !l.trim().is_empty()) {
        let bad = |why: &str| format!("plugin {plugin} returned a bad reasoning event from {entry}: {line:?}: {why}");
        let v: Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        let text = |key: &str| v.get(key).and_then(Value::as_str).map(str::to_string);
        match (text("content"), text("reasoning")) {
            (Some(c), None) => out.push(ReasoningOutput::Content(c)),
            (None, Some(r)) => out.push(ReasoningOutput::Reasoning(r)),
            _ => return Err(bad("expected an object with one string, content or reasoning")),
        }
    }
    Ok(out)
}

/// Parses and checks a tool adapter's JSON-lines events: call indexes must count up from
/// `calls`, arguments must name a reported call. Returns the events and the new call count.
fn parse_tool_events(
    plugin: &str,
    entry: &str,
    lines: &str,
    mut calls: usize,
) -> Result<(Vec<ToolOutput>, usize), String> {
    let bad =
        |line: &str, why: &str| format!("plugin {plugin} returned a bad tool event from {entry}: {line:?}: {why}");
    let mut out = Vec::new();
    for line in lines.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| bad(line, &e.to_string()))?;
        let index = |o: &Value| o.get("index").and_then(Value::as_u64).map(|i| i as usize);
        let text = |o: &Value, key: &str| o.get(key).and_then(Value::as_str).map(str::to_string);
        if let Some(c) = text(&v, "content") {
            out.push(ToolOutput::Content(c));
        } else if let Some(call) = v.get("tool_call") {
            let i = index(call).ok_or_else(|| bad(line, "tool_call needs an integer index"))?;
            if i != calls {
                return Err(bad(line, &format!("expected call index {calls}")));
            }
            let name =
                text(call, "name").filter(|n| !n.is_empty()).ok_or_else(|| bad(line, "tool_call needs a name"))?;
            let id = text(call, "id").filter(|n| !n.is_empty()).unwrap_or_else(|| format!("call_{i}"));
            calls += 1;
            out.push(ToolOutput::Call { index: i, id, name });
        } else if let Some(args) = v.get("tool_call_args") {
            let i = index(args)
                .filter(|&i| i < calls)
                .ok_or_else(|| bad(line, "tool_call_args needs the index of a reported call"))?;
            let delta = text(args, "delta").ok_or_else(|| bad(line, "tool_call_args needs a string delta"))?;
            out.push(ToolOutput::Args { index: i, delta });
        } else {
            return Err(bad(line, "expected one of content, tool_call, tool_call_args"));
        }
    }
    Ok((out, calls))
}

/// A short-lived instance of a tool adapter (`host_init` only, no `host_begin`), for what it
/// contributes while the prompt is built: `tool_render`, `tool_force` (ABI.md §5.3).
/// Its input is the request's own data (see `Instance::fault`).
pub fn prompt_instance(registry: &PluginRegistry, selected: &Selected) -> Result<runtime::Instance> {
    if let Some(q) = selected.plugin.quarantine() {
        bail!(runtime::PluginFault(q.message));
    }
    Ok(registry.runtime.instantiate(&selected.plugin, &selected.config)?.on_request_data())
}

/// The scheduling policy as a plugin: one long-lived instance, replaced when hot reload
/// swaps the plugin (the registry's current version is looked up at every decision).
pub struct PluginScheduler {
    registry: Arc<PluginRegistry>,
    name: String,
    config: Value,
    current: Option<(Arc<Plugin>, Instance)>,
    /// The log has said the policy is quarantined.
    quarantine_told: bool,
}

impl PluginScheduler {
    pub fn new(registry: Arc<PluginRegistry>, name: String, config: Value) -> PluginScheduler {
        PluginScheduler { registry, name, config, current: None, quarantine_told: false }
    }
}

impl crate::engine::scheduler::Policy for PluginScheduler {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn decide(&mut self, view: &crate::engine::scheduler::QueueView) -> Result<crate::engine::scheduler::Decision> {
        let plugin = self
            .registry
            .get(&self.name)
            .filter(|p| p.manifest.has(Kind::Scheduler))
            .with_context(|| format!("scheduling policy {:?} is not loaded", self.name))?;
        if let Some(q) = plugin.quarantine() {
            // First come, first served until it is back (said once, not at every decision).
            if !std::mem::replace(&mut self.quarantine_told, true) {
                tracing::warn!("{q}; serving first come first served meanwhile");
            }
            return Ok(crate::engine::scheduler::Decision::default());
        }
        self.quarantine_told = false;
        if !self.current.as_ref().is_some_and(|(p, _)| Arc::ptr_eq(p, &plugin)) {
            let instance = self.registry.runtime.instantiate(&plugin, &self.config)?;
            tracing::info!(policy = self.name, version = plugin.manifest.version, "scheduling policy instance started");
            self.current = Some((plugin, instance));
        }
        let (plugin, instance) = self.current.as_mut().expect("set above");
        let result = instance.schedule(&serde_json::to_string(view).expect("JSON serializes")).and_then(|text| {
            serde_json::from_str(&text).map_err(|e| {
                instance.fault(format!("plugin {} returned a bad decision from schedule: {e}", plugin.name()))
            })
        });
        match &result {
            // A long-lived instance: each good decision counts as a use without a fault.
            Ok(_) => plugin.succeeded(),
            // A fresh instance next time: a trapped one may be in any state.
            Err(_) => self.current = None,
        }
        result
    }
}

/// `host plugins ...`: offline validation and listing.
#[derive(Debug, clap::Subcommand)]
pub enum PluginsCommand {
    /// Validate a plugin the way the server loads it: manifest, imports, exports,
    /// compilation, its settings file (NAME.toml beside it), instantiation under the memory
    /// cap and deadline, then host_init with a config and host_begin with params.
    Check {
        file: PathBuf,
        /// The config (JSON) for host_init, as a request's `plugins` entry gives it.
        /// Default: the settings file's `config`, else `{}`.
        #[arg(long)]
        config: Option<String>,
        /// The params (JSON) for host_begin. Default: the settings file's `params`, else `{}`.
        #[arg(long)]
        params: Option<String>,
    },
    /// Show the built-in plugins and what a plugins folder holds (and why any file is refused).
    List { dir: PathBuf },
    /// Assemble a hand-written WebAssembly text plugin (.wat) into a .wasm file, keeping its
    /// `(@custom "host.plugin" ...)` manifest (which wabt's wat2wasm drops).
    BuildWat { input: PathBuf, output: PathBuf },
    /// Write a buildable plugin skeleton (source, manifest, build.sh that ends with `host
    /// plugins check`) into a new folder.
    New {
        /// The plugin's name (its manifest's): [a-z0-9][a-z0-9_-]*.
        name: String,
        /// sampler, stop, tool, reasoning or scheduler (C, Zig, AssemblyScript and WAT:
        /// sampler or stop).
        #[arg(long, value_parser = new::parse_kind)]
        kind: Kind,
        #[arg(long, value_enum)]
        lang: new::Lang,
        /// Where to write it. Default: ./NAME.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Set a module's `host.plugin` manifest (from a JSON file), replacing any it has: for
    /// toolchains that cannot emit custom sections (clang, Zig, AssemblyScript, wat2wasm).
    AddManifest {
        wasm: PathBuf,
        /// A JSON file with the manifest (ABI.md §2).
        manifest: PathBuf,
        /// Where to write the result. Default: over WASM.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
}

fn json_arg(flag: &str, text: Option<String>) -> Result<Option<Value>> {
    text.map(|t| serde_json::from_str(&t).with_context(|| format!("--{flag} is not valid JSON: {t}"))).transpose()
}

pub fn run_command(command: PluginsCommand) -> Result<()> {
    let registry = if matches!(command, PluginsCommand::List { .. }) {
        PluginRegistry::with_builtins()?
    } else {
        PluginRegistry::new()?
    };
    match command {
        PluginsCommand::Check { file, config, params } => {
            let (config, params) = (json_arg("config", config)?, json_arg("params", params)?);
            let plugin = registry.load_file(&file)?;
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
            let s = &plugin.settings;
            println!(
                "limits: deadline {} ms of CPU time per call, memory {} MiB, quarantine {} s",
                s.deadline_ms, s.memory_mib, s.quarantine_secs
            );
            let given = config.is_some() || s.config.is_some();
            let config = config.or_else(|| s.config.clone()).unwrap_or_else(|| serde_json::json!({}));
            let mut instance = match registry.runtime().instantiate(&plugin, &config) {
                Ok(instance) => instance,
                Err(e) if !given && e.downcast_ref::<runtime::PluginRefused>().is_some() => {
                    println!("note: {e:#}; requests must give it a config: check one with --config JSON");
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            println!("host_init: accepted {config}");
            let params = params.or_else(|| s.params.clone()).unwrap_or_else(|| serde_json::json!({}));
            instance.begin(&params, 0)?;
            println!("host_begin: accepted {params}");
            Ok(())
        }
        PluginsCommand::BuildWat { input, output } => {
            let wasm = wat::parse_file(&input).map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
            std::fs::write(&output, wasm).with_context(|| format!("writing {}", output.display()))?;
            Ok(())
        }
        PluginsCommand::New { name, kind, lang, dir } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            let written = new::write(&name, kind, lang, &dir)?;
            println!("wrote {}: {}", dir.display(), written.join(", "));
            println!(
                "next: {}/build.sh (it builds {name}.wasm and runs host plugins check), then copy {name}.wasm into the server's plugins folder",
                dir.display()
            );
            Ok(())
        }
        PluginsCommand::AddManifest { wasm, manifest, output } => {
            let module = std::fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;
            let json = std::fs::read_to_string(&manifest).with_context(|| format!("reading {}", manifest.display()))?;
            let out = abi_v1::with_manifest(&module, &json).with_context(|| manifest.display().to_string())?;
            let output = output.unwrap_or(wasm);
            std::fs::write(&output, out).with_context(|| format!("writing {}", output.display()))?;
            Ok(())
        }
        PluginsCommand::List { dir } => {
            registry.load_dir(&dir)?;
            for s in registry.status() {
                let kinds: Vec<String> = s.kinds.iter().map(Kind::to_string).collect();
                match &s.error {
                    Some(e) if s.state == "refused" => println!("{:<24} refused: {e} ({})", s.name, s.source),
                    _ => println!("{:<24} {:<10} {:<16} {}", s.name, s.version, kinds.join(","), s.source),
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin_wasm(name: &str, kind: &str, version: &str) -> Vec<u8> {
        let export = match kind {
            "stop" => r#"(func (export "stop_check") (param i32 i32 i32) (result i32) (i32.const -1))"#,
            _ => r#"(func (export "sampler_sample") (param i32 i32 i32) (result i32) (i32.const 0))"#,
        };
        wat::parse_str(format!(
            r#"(module (@custom "host.plugin" "{{\"abi\": 1, \"name\": \"{name}\", \"version\": \"{version}\", \"kinds\": [\"{kind}\"]}}")
            (memory (export "memory") 1)
            (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
            {export})"#
        ))
        .unwrap()
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("registry-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// One file per name: a second file declaring a taken name is refused and shown under
    /// that name; deleting it changes nothing else; deleting the owner lets it load.
    #[test]
    fn a_plugin_name_has_one_file() {
        let dir = temp_dir("dup");
        std::fs::write(dir.join("a.wasm"), plugin_wasm("dup", "stop", "1")).unwrap();
        std::fs::write(dir.join("b.wasm"), plugin_wasm("dup", "stop", "2")).unwrap();
        let registry = PluginRegistry::new().unwrap();
        assert_eq!(registry.load_dir(&dir).unwrap(), 1);
        assert_eq!(registry.get("dup").unwrap().manifest.version, "1");
        let status = registry.status();
        let refused = status.iter().find(|s| s.state == "refused").unwrap();
        assert_eq!(refused.name, "dup");
        let error = refused.error.as_deref().unwrap();
        assert!(error.contains("already provides") && error.contains("a.wasm"), "{error}");
        // Reloading the refused file keeps it refused; deleting it leaves the owner serving.
        assert!(registry.load_file(&dir.join("b.wasm")).is_err());
        std::fs::remove_file(dir.join("b.wasm")).unwrap();
        registry.remove_file(&dir.join("b.wasm"));
        assert_eq!(registry.get("dup").unwrap().manifest.version, "1");
        assert!(registry.status().iter().all(|s| s.state != "refused"));
        // Back again, then the owner goes: the waiting file takes the name.
        std::fs::write(dir.join("b.wasm"), plugin_wasm("dup", "stop", "2")).unwrap();
        assert!(registry.load_file(&dir.join("b.wasm")).is_err());
        std::fs::remove_file(dir.join("a.wasm")).unwrap();
        registry.remove_file(&dir.join("a.wasm"));
        assert_eq!(registry.get("dup").unwrap().manifest.version, "2");
        // The owner renaming its plugin frees the name too.
        std::fs::write(dir.join("a.wasm"), plugin_wasm("dup", "stop", "3")).unwrap();
        assert!(registry.load_file(&dir.join("a.wasm")).is_err());
        std::fs::write(dir.join("b.wasm"), plugin_wasm("other", "stop", "4")).unwrap();
        registry.load_file(&dir.join("b.wasm")).unwrap();
        assert_eq!(registry.get("dup").unwrap().manifest.version, "3");
        assert_eq!(registry.get("other").unwrap().manifest.version, "4");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A file refused at manifest validation is listed under the name its manifest declares,
    /// and a request naming it is told of the refusal (not "unknown sampler plugin").
    #[test]
    fn a_refused_manifest_is_known_by_its_declared_name() {
        let dir = temp_dir("refused-name");
        let wasm = wat::parse_str(
            r#"(module (@custom "host.plugin" "{\"abi\": 1, \"name\": \"wide\", \"kinds\": [\"sampler\"], \"sampler\": {\"k\": 5000}}"))"#,
        )
        .unwrap();
        std::fs::write(dir.join("wide-file.wasm"), wasm).unwrap();
        let registry = PluginRegistry::new().unwrap();
        assert_eq!(registry.load_dir(&dir).unwrap(), 0);
        let refused: Vec<_> = registry.status().into_iter().filter(|s| s.state == "refused").collect();
        assert_eq!(refused.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["wide"]);
        let e = format!("{:#}", registry.select(Kind::Sampler, "wide", None, None, false).err().unwrap());
        assert!(e.contains("was refused") && e.contains("wide-file.wasm") && e.contains("sampler.k"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A folder given as a relative path (the start-up scan) and the watcher's absolute
    /// paths name the same files: a file present at start can be replaced, then removed.
    #[test]
    fn a_relative_plugins_folder_names_its_files_as_the_watcher_does() {
        let rel = PathBuf::from(format!("registry-relative-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&rel);
        std::fs::create_dir_all(&rel).unwrap();
        std::fs::write(rel.join("hot.wasm"), plugin_wasm("hot", "stop", "0")).unwrap();
        let registry = PluginRegistry::new().unwrap();
        assert_eq!(registry.load_dir(&rel).unwrap(), 1);
        let absolute = std::env::current_dir().unwrap().join(&rel).join("hot.wasm");
        std::fs::write(&absolute, plugin_wasm("hot", "stop", "1")).unwrap();
        let replaced = registry.load_file(&absolute);
        assert!(replaced.is_ok(), "{:#}", replaced.unwrap_err());
        assert_eq!(registry.get("hot").unwrap().manifest.version, "1");
        std::fs::remove_file(&absolute).unwrap();
        registry.remove_file(&absolute);
        assert!(registry.get("hot").is_none() && registry.status().iter().all(|s| s.state != "refused"));
        std::fs::remove_dir_all(rel).unwrap();
    }

    /// Settings are matched by the plugin's name (or the file's stem; both is an error), and
    /// a settings file maps back to the files it may belong to.
    #[test]
    fn settings_files_are_matched_by_plugin_name() {
        let dir = temp_dir("settings");
        let wasm = dir.join("dl_spin.wasm");
        std::fs::write(&wasm, plugin_wasm("dl-spin", "stop", "1")).unwrap();
        std::fs::write(dir.join("dl-spin.toml"), "deadline_ms = 7\n").unwrap();
        let registry = PluginRegistry::new().unwrap();
        assert_eq!(registry.load_file(&wasm).unwrap().settings.deadline_ms, 7);
        assert_eq!(
            registry.files_for_settings(&dir.join("dl-spin.toml")),
            vec![dir.join("dl-spin.wasm"), wasm.clone()]
        );
        std::fs::write(dir.join("dl_spin.toml"), "deadline_ms = 8\n").unwrap();
        let e = registry.load_file(&wasm).unwrap_err();
        assert!(format!("{e:#}").contains("two settings files for plugin dl-spin"), "{e:#}");
        std::fs::remove_file(dir.join("dl-spin.toml")).unwrap();
        assert_eq!(registry.load_file(&wasm).unwrap().settings.deadline_ms, 8);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Errors for a request's plugin name: a refused file is named with its reason; the
    /// list of loaded plugins holds only the kind asked for; a wrong kind says which it is.
    #[test]
    fn selecting_a_plugin_explains_what_is_wrong() {
        let dir = temp_dir("select");
        std::fs::write(dir.join("stopper.wasm"), plugin_wasm("stopper", "stop", "1")).unwrap();
        std::fs::write(dir.join("picker.wasm"), plugin_wasm("picker", "sampler", "1")).unwrap();
        let mut broken = plugin_wasm("broken", "stop", "1");
        broken.truncate(broken.len() - 3);
        std::fs::write(dir.join("broken.wasm"), broken).unwrap();
        let registry = PluginRegistry::new().unwrap();
        registry.load_dir(&dir).unwrap();
        let e = |kind, name: &str| format!("{:#}", registry.select(kind, name, None, None, false).unwrap_err());
        let refused = e(Kind::Stop, "broken");
        assert!(refused.contains("broken.wasm was refused"), "{refused}");
        assert_eq!(e(Kind::Sampler, "nope"), "unknown sampler plugin \"nope\"; loaded sampler plugins: picker");
        assert_eq!(e(Kind::Sampler, "stopper"), "plugin \"stopper\" is not a sampler plugin (it is a stop plugin)");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn add_manifest_replaces_the_section_and_checks_it() {
        let wasm = plugin_wasm("first", "stop", "1");
        let renamed = abi_v1::with_manifest(&wasm, r#"{"abi": 1, "name": "second", "kinds": ["stop"]}"#).unwrap();
        assert_eq!(abi_v1::manifest(&renamed).unwrap().name, "second");
        let runtime = PluginRuntime::new().unwrap();
        runtime.load(&renamed, Path::new("second.wasm"), false, PluginSettings::default()).unwrap();
        let bare = wat::parse_str(r#"(module (memory (export "memory") 1))"#).unwrap();
        assert!(abi_v1::manifest(&bare).is_err());
        let added = abi_v1::with_manifest(&bare, r#"{"abi": 1, "name": "x", "kinds": ["stop"]}"#).unwrap();
        assert_eq!(abi_v1::manifest(&added).unwrap().name, "x");
        let e = abi_v1::with_manifest(&bare, r#"{"abi": 1, "name": "Bad Name", "kinds": ["stop"]}"#).unwrap_err();
        assert!(format!("{e:#}").contains("is invalid"), "{e:#}");
    }

    #[test]
    fn reasoning_events_are_checked() {
        let ok = "{\"reasoning\": \"hm\"}\n\n{\"content\": \"yes\"}\n";
        let events = parse_reasoning_events("p", "reasoning_feed", ok).unwrap();
        assert_eq!(events, vec![ReasoningOutput::Reasoning("hm".into()), ReasoningOutput::Content("yes".into())]);
        for bad in ["garbage", r#"{"reasoning": 1}"#, r#"{"content": "a", "reasoning": "b"}"#, r#"{"tool_call": {}}"#] {
            let e = parse_reasoning_events("p", "reasoning_finish", bad).unwrap_err();
            assert!(e.starts_with("plugin p returned a bad reasoning event from reasoning_finish"), "{e}");
        }
    }

    #[test]
    fn tool_events_are_checked() {
        let ok = "{\"content\": \"Hi \"}\n{\"tool_call\": {\"index\": 0, \"id\": \"c\", \"name\": \"f\"}}\n{\"tool_call_args\": {\"index\": 0, \"delta\": \"{}\"}}\n";
        let (events, calls) = parse_tool_events("p", "tool_feed", ok, 0).unwrap();
        assert_eq!(calls, 1);
        assert_eq!(
            events,
            vec![
                ToolOutput::Content("Hi ".into()),
                ToolOutput::Call { index: 0, id: "c".into(), name: "f".into() },
                ToolOutput::Args { index: 0, delta: "{}".into() },
            ]
        );
        let bad = [
            ("garbage", "expected value"),
            (r#"{"tool_call": {"index": 1, "name": "f"}}"#, "expected call index 0"),
            (r#"{"tool_call": {"index": 0}}"#, "needs a name"),
            (r#"{"tool_call_args": {"index": 0, "delta": "x"}}"#, "index of a reported call"),
            (r#"{"other": 1}"#, "expected one of content"),
        ];
        for (line, want) in bad {
            let e = parse_tool_events("p", "tool_finish", line, 0).unwrap_err();
            assert!(e.contains(want) && e.starts_with("plugin p returned a bad tool event from tool_finish"), "{e}");
        }
        // Ids are optional; the host numbers calls after those already reported.
        let (events, _) =
            parse_tool_events("p", "tool_feed", r#"{"tool_call": {"index": 2, "name": "g"}}"#, 2).unwrap();
        assert_eq!(events, vec![ToolOutput::Call { index: 2, id: "call_2".into(), name: "g".into() }]);
    }

    /// The example constraint plugin (examples/wat/lowercase.wat) through the engine's
    /// `Guard`: the vocabulary's bytes decide the mask, spaces follow the history, drafts are
    /// rolled back, and an end-of-sequence token is allowed once the output has a token.
    #[test]
    fn the_lowercase_constraint_plugin_masks_from_the_vocabulary_and_its_history() {
        let registry = PluginRegistry::new().unwrap();
        let wasm = wat::parse_str(include_str!("../../../examples/wat/lowercase.wat")).unwrap();
        let plugin = Arc::new(
            registry.runtime.load(&wasm, Path::new("lowercase.wat"), false, PluginSettings::default()).unwrap(),
        );
        let words: Vec<Vec<u8>> = ["the", " cat", "Dog", "sat ", "", "\u{ff}<s>", "</s>", " ", "a.b", "on"]
            .iter()
            .map(|w| w.as_bytes().to_vec())
            .collect();
        let (eos, vocab) = (6u32, words.len());
        let selected = Selected {
            plugin: plugin.clone(),
            config: serde_json::json!({}),
            params: serde_json::json!({}),
            fallback: false,
        };
        let spec = constraint_spec(registry.clone(), selected, Arc::new(encode_vocab(&words, &[eos])));
        // Prepared ahead (as the server does, off the engine thread), a start only begins the
        // instance made and handed the vocabulary; the next start makes its own.
        spec.prepare();
        let calls = || plugin.calls.load(Ordering::Relaxed);
        let prepared = calls();
        let mut guard = crate::engine::Guard::start(&spec, 7, &[eos], vocab).unwrap();
        assert_eq!(calls() - prepared, 1, "constraint_begin only");
        let begun = calls();
        drop(crate::engine::Guard::start(&spec, 7, &[eos], vocab).unwrap());
        assert_eq!(calls() - begun, 3, "host_alloc and constraint_vocab, then constraint_begin");
        let open = |m: Option<crate::engine::constraint::Bits>| crate::engine::constraint::tests::open(&m, vocab);
        // Nothing written: no leading space, no end yet; "Dog", "", the special token and
        // "a.b" never.
        assert_eq!(open(guard.mask().unwrap()), vec![0, 3, 9]);
        guard.accept(0).unwrap(); // "the"
        assert_eq!(open(guard.mask().unwrap()), vec![0, 1, 3, 6, 7, 9]);
        guard.accept(3).unwrap(); // "sat ": a space may not follow
        assert_eq!(open(guard.mask().unwrap()), vec![0, 3, 6, 9]);
        // Drafts "on" then " ": one mask per position, each after the drafts before it.
        let masks = guard.draft_masks(&[9, 7]).unwrap();
        assert_eq!(open(masks[0].clone()), vec![0, 3, 6, 9]);
        assert_eq!(open(masks[1].clone()), vec![0, 1, 3, 6, 7, 9], "after \"on\"");
        assert_eq!(open(masks[2].clone()), vec![0, 3, 6, 9], "after \" \"");
        // Rolled back to where it was.
        assert_eq!(open(guard.mask().unwrap()), vec![0, 3, 6, 9]);
    }

    /// A constraint plugin's bad answer fails the request with the plugin's name, unless the
    /// request allowed a fallback: then the output goes unconstrained.
    #[test]
    fn a_constraint_plugin_that_answers_badly_faults_or_falls_back() {
        let registry = PluginRegistry::new().unwrap();
        let wasm = wat::parse_str(
            r#"(module (@custom "host.plugin" "{\"abi\": 1, \"name\": \"seven\", \"kinds\": [\"constraint\"]}")
            (memory (export "memory") 2)
            (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
            (func (export "constraint_vocab") (param i32 i32) (result i32) (i32.const 0))
            (func (export "constraint_mask") (param i32 i32) (result i32) (i32.const 7))
            (func (export "constraint_accept") (param i32) (result i32) (i32.const 0))
            (func (export "constraint_rollback") (param i32) (result i32) (i32.const 0)))"#,
        )
        .unwrap();
        let plugin =
            Arc::new(registry.runtime.load(&wasm, Path::new("seven.wat"), false, PluginSettings::default()).unwrap());
        let vocab = Arc::new(encode_vocab(&[b"a".to_vec(), b"b".to_vec()], &[1]));
        for fallback in [false, true] {
            let selected = Selected {
                plugin: plugin.clone(),
                config: serde_json::json!({}),
                params: serde_json::json!({}),
                fallback,
            };
            let spec = constraint_spec(registry.clone(), selected, vocab.clone());
            let mut guard = crate::engine::Guard::start(&spec, 0, &[1], 2).unwrap();
            match guard.mask() {
                Err(e) => {
                    assert!(!fallback);
                    let e = format!("{e:#}");
                    assert!(e.contains("plugin seven returned 7 from constraint_mask"), "{e}");
                }
                Ok(mask) => assert!(fallback && mask.is_none(), "a fallback leaves the output unconstrained"),
            }
        }
        assert_eq!(plugin.faults.load(Ordering::Relaxed), 2);
    }
}
