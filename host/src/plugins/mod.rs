//! Wasm plugins (ABI v1, `plugin-sdk/ABI.md`): the manifest (`abi_v1.rs`), the wasmtime
//! runtime (`runtime.rs`) and here the registry of loaded plugins and the adapters that plug
//! an instance into the engine (a sampler) or the text pipeline (a stop rule).

pub mod abi_v1;
pub mod reload;
pub mod runtime;

/// The built-in plugins (`plugins/*`, built to wasm by `build.rs`): (crate name, module).
mod builtin {
    include!(concat!(env!("OUT_DIR"), "/builtin_plugins.rs"));
}

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
    /// The tool-call adapter over the output (its params carry the request's tools).
    pub tool: Option<Selected>,
    /// The reasoning parser over the output (ahead of the tool adapter): the model's
    /// thinking split from its answer.
    pub reasoning: Option<Selected>,
    /// Text that opens the reply: a call the request forces (`tool_choice`), already at the
    /// end of the prompt; fed to the tool adapter ahead of the output.
    pub reply_prefix: Option<String>,
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
pub struct PluginRegistry {
    runtime: Arc<PluginRuntime>,
    builtins: BTreeMap<String, Arc<Plugin>>,
    plugins: RwLock<BTreeMap<String, Arc<Plugin>>>,
    failed: RwLock<BTreeMap<PathBuf, String>>,
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
        let show = |p: &Plugin, state: &'static str| PluginStatus {
            name: p.manifest.name.clone(),
            kinds: p.manifest.kinds.clone(),
            version: p.manifest.version.clone(),
            source: p.source.display().to_string(),
            sha256: p.sha256.clone(),
            state: if state == "ready" && !p.healthy() { "unhealthy" } else { state },
            error: None,
            calls: p.calls.load(Ordering::Relaxed),
            faults: p.faults.load(Ordering::Relaxed),
        };
        let mut out: Vec<PluginStatus> = user.values().map(|p| show(p, "ready")).collect();
        for (name, p) in &self.builtins {
            out.push(show(p, if user.contains_key(name) { "overridden" } else { "ready" }));
        }
        drop(user);
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
            parse(&name, entry, &lines).map_err(|m| {
                instance.plugin().faults.fetch_add(1, Ordering::Relaxed);
                anyhow::Error::new(runtime::PluginFault(m))
            })
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
pub fn prompt_instance(registry: &PluginRegistry, selected: &Selected) -> Result<runtime::Instance> {
    registry.runtime.instantiate(&selected.plugin, &selected.config)
}

/// The scheduling policy as a plugin: one long-lived instance, replaced when hot reload
/// swaps the plugin (the registry's current version is looked up at every decision).
pub struct PluginScheduler {
    registry: Arc<PluginRegistry>,
    name: String,
    config: Value,
    current: Option<(Arc<Plugin>, Instance)>,
}

impl PluginScheduler {
    pub fn new(registry: Arc<PluginRegistry>, name: String, config: Value) -> PluginScheduler {
        PluginScheduler { registry, name, config, current: None }
    }
}

impl crate::engine::queue::Policy for PluginScheduler {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn decide(&mut self, view: &crate::engine::queue::QueueView) -> Result<crate::engine::queue::Decision> {
        let plugin = self
            .registry
            .get(&self.name)
            .filter(|p| p.manifest.has(Kind::Scheduler))
            .with_context(|| format!("scheduling policy {:?} is not loaded", self.name))?;
        if !self.current.as_ref().is_some_and(|(p, _)| Arc::ptr_eq(p, &plugin)) {
            let instance = self.registry.runtime.instantiate(&plugin, &self.config)?;
            tracing::info!(policy = self.name, version = plugin.manifest.version, "scheduling policy instance started");
            self.current = Some((plugin, instance));
        }
        let (plugin, instance) = self.current.as_mut().expect("set above");
        let result = instance.schedule(&serde_json::to_string(view).expect("JSON serializes")).and_then(|text| {
            serde_json::from_str(&text).map_err(|e| {
                plugin.faults.fetch_add(1, Ordering::Relaxed);
                anyhow::anyhow!("plugin {} returned a bad decision from schedule: {e}", plugin.name())
            })
        });
        if result.is_err() {
            // A fresh instance next time: a trapped one may be in any state.
            self.current = None;
        }
        result
    }
}

/// `host plugins ...`: offline validation and listing.
#[derive(Debug, clap::Subcommand)]
pub enum PluginsCommand {
    /// Validate a plugin against ABI v1: manifest, imports, exports, compilation, instantiation.
    Check { file: PathBuf },
    /// Show the built-in plugins and what a plugins folder holds (and why any file is refused).
    List { dir: PathBuf },
    /// Assemble a hand-written WebAssembly text plugin (.wat) into a .wasm file.
    BuildWat { input: PathBuf, output: PathBuf },
}

pub fn run_command(command: PluginsCommand) -> Result<()> {
    let registry = if matches!(command, PluginsCommand::List { .. }) {
        PluginRegistry::with_builtins()?
    } else {
        PluginRegistry::new()?
    };
    match command {
        PluginsCommand::Check { file } => {
            let plugin = registry.load_file(&file)?;
            // Instantiating runs the start function and host_init with an empty config.
            drop(registry.runtime().instantiate(&plugin, &serde_json::json!({}))?);
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
