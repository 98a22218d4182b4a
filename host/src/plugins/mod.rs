//! Wasm plugins (ABI v1, `plugin-sdk/ABI.md`): the manifest (`abi_v1.rs`), the wasmtime
//! runtime (`runtime.rs`), the adapters that plug an instance into the engine
//! (`adapters.rs`: sampler, constraint, tool calls, reasoning, scheduler) and here the
//! registry of loaded plugins.

pub mod abi_v1;
pub mod adapters;
pub mod new;
pub mod reload;
pub mod request;
pub mod runtime;

/// The built-in plugins (`plugins/*`, built to wasm by `build.rs`): (crate name, module).
mod builtin {
    include!(concat!(env!("OUT_DIR"), "/builtin_plugins.rs"));
}

use abi_v1::Kind;
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
    /// Seconds of quarantine left (state "quarantined").
    pub quarantine_s: Option<u64>,
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
                quarantine_s: quarantine.as_ref().map(|q| q.retry_after.as_secs_f64().ceil() as u64),
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
                quarantine_s: None,
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

#[cfg(test)]
mod tests {
    use super::adapters::*;
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
