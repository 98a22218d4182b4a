//! The wasmtime side of plugins: validate and compile modules (`PluginRuntime::load`),
//! pre-link them (`InstancePre`), and run one sandboxed instance per (plugin, request) with a
//! deadline per call (epoch interruption) and a memory cap. Only this module knows wasmtime.

use super::abi_v1::{self, Kind, Manifest, SamplerInput};
use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use wasmtime::{
    Caller, Config, Engine, Extern, ExternType, InstancePre, Linker, Memory, Module, Store, StoreLimits,
    StoreLimitsBuilder, Trap, TypedFunc, ValType,
};

/// Epoch ticks per second (one tick per millisecond).
const TICKS_PER_MS: u64 = 1;
/// Deadlines: per-token calls, and `host_init`/`host_begin`.
pub const CALL_DEADLINE: Duration = Duration::from_millis(50);
pub const SETUP_DEADLINE: Duration = Duration::from_millis(1000);
/// Linear memory per instance.
pub const MEMORY_LIMIT: usize = 64 << 20;
/// Largest result a plugin may return through a packed slice.
pub const MAX_RESULT_BYTES: usize = 1 << 20;
/// Faults after which a plugin is reported unhealthy.
pub const UNHEALTHY_AFTER: u64 = 3;

/// A plugin's optional settings file, `NAME.toml` next to `NAME.wasm`.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginSettings {
    /// Config for `host_init` when a request gives none.
    pub config: Option<serde_json::Value>,
    /// Params for `host_begin` when a request gives none.
    pub params: Option<serde_json::Value>,
    /// Deadline of each per-token call, in milliseconds (1 to 10,000). Default: 50.
    pub deadline_ms: u64,
    /// Linear memory cap per instance, in MiB (1 to 4096). Default: 64.
    pub memory_mib: usize,
}

impl Default for PluginSettings {
    fn default() -> Self {
        PluginSettings {
            config: None,
            params: None,
            deadline_ms: CALL_DEADLINE.as_millis() as u64,
            memory_mib: MEMORY_LIMIT >> 20,
        }
    }
}

impl PluginSettings {
    /// Reads and checks a settings file.
    pub fn from_file(path: &Path) -> Result<PluginSettings> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let settings: PluginSettings =
            toml::from_str(&text).map_err(|e| anyhow!("{}: {}", path.display(), e.message()))?;
        if !(1..=10_000).contains(&settings.deadline_ms) {
            bail!("{}: deadline_ms must be between 1 and 10000, got {}", path.display(), settings.deadline_ms);
        }
        if !(1..=4096).contains(&settings.memory_mib) {
            bail!("{}: memory_mib must be between 1 and 4096, got {}", path.display(), settings.memory_mib);
        }
        Ok(settings)
    }
    fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }
}

pub struct StoreState {
    limits: StoreLimits,
    plugin: String,
    /// `host.log` lines and bytes written by this instance (bounded: [`LOG_LINES`], [`LOG_BYTES`]).
    logged: (usize, usize),
    /// The last error or warning the plugin logged: the reason a refused config gives.
    last_complaint: Option<String>,
}

/// The most `host.log` lines one instance writes; later ones are dropped (one line says so).
pub const LOG_LINES: usize = 100;
/// The most bytes of `host.log` text one instance writes.
pub const LOG_BYTES: usize = 64 << 10;
/// The longest `host.log` message kept (longer ones are cut).
const LOG_MESSAGE_BYTES: usize = 4096;

/// A plugin's log message as one line: control characters (newlines included) escaped, so a
/// plugin cannot write lines that look like the server's.
fn log_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A compiled, validated plugin, ready to instantiate.
pub struct Plugin {
    pub manifest: Manifest,
    pub settings: PluginSettings,
    pub source: PathBuf,
    pub sha256: String,
    pub builtin: bool,
    pre: InstancePre<StoreState>,
    pub calls: AtomicU64,
    pub faults: AtomicU64,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Plugin({} v{} from {})", self.manifest.name, self.manifest.version, self.source.display())
    }
}

impl Plugin {
    pub fn name(&self) -> &str {
        &self.manifest.name
    }
    pub fn healthy(&self) -> bool {
        self.faults.load(Ordering::Relaxed) < UNHEALTHY_AFTER
    }
}

/// The wasmtime engine, the linker with the `host.log` import, and the epoch ticker.
pub struct PluginRuntime {
    engine: Engine,
    linker: Linker<StoreState>,
}

fn func_sig(params: &[ValType], results: &[ValType]) -> String {
    let show = |v: &[ValType]| v.iter().map(|t| format!("{t}")).collect::<Vec<_>>().join(", ");
    format!("({}) -> ({})", show(params), show(results))
}

/// Required exports per kind: (name, params, results).
fn required_exports(kind: Kind) -> &'static [(&'static str, &'static [ValType], &'static [ValType])] {
    use ValType::{I32, I64};
    match kind {
        Kind::Sampler => &[("sampler_sample", &[I32, I32, I32], &[I32])],
        Kind::Stop => &[("stop_check", &[I32, I32, I32], &[I32])],
        Kind::Tool => &[("tool_feed", &[I32, I32], &[I64]), ("tool_finish", &[], &[I64])],
        Kind::Scheduler => &[("schedule", &[I32, I32], &[I64])],
        Kind::Reasoning => &[("reasoning_feed", &[I32, I32], &[I64]), ("reasoning_finish", &[], &[I64])],
    }
}

impl PluginRuntime {
    pub fn new() -> Result<Arc<PluginRuntime>> {
        let mut config = Config::new();
        config.epoch_interruption(true);
        if let Some(cache) = module_cache() {
            config.cache(Some(cache));
        }
        let engine = Engine::new(&config).map_err(|e| anyhow!("starting wasmtime: {e}"))?;
        let mut linker = Linker::new(&engine);
        linker
            .func_wrap(
                abi_v1::IMPORT_MODULE,
                abi_v1::IMPORT_LOG,
                |mut caller: Caller<'_, StoreState>, level: i32, ptr: i32, len: i32| -> wasmtime::Result<()> {
                    let Some(Extern::Memory(mem)) = caller.get_export("memory") else { return Ok(()) };
                    if len < 0 || ptr < 0 {
                        wasmtime::bail!("host.log called with a negative pointer or length ({ptr}, {len})");
                    }
                    let (start, n) = (ptr as usize, (len as usize).min(LOG_MESSAGE_BYTES));
                    let Some(bytes) = mem.data(&caller).get(start..start + len as usize) else {
                        wasmtime::bail!("host.log called with {len} bytes at {ptr}, outside the plugin's memory");
                    };
                    let text = log_line(&String::from_utf8_lossy(&bytes[..n]));
                    let state = caller.data_mut();
                    if level <= 1 {
                        state.last_complaint = Some(text.clone());
                    }
                    let (lines, logged) = state.logged;
                    state.logged = (lines + 1, logged + text.len());
                    let plugin = &state.plugin;
                    if lines == LOG_LINES || (logged < LOG_BYTES && logged + text.len() >= LOG_BYTES) {
                        tracing::warn!(plugin, "this request's further log messages from the plugin are dropped (over {LOG_LINES} lines or {LOG_BYTES} bytes)");
                    }
                    if lines >= LOG_LINES || logged + text.len() > LOG_BYTES {
                        return Ok(());
                    }
                    match level {
                        0 => tracing::error!(plugin, "{text}"),
                        1 => tracing::warn!(plugin, "{text}"),
                        2 => tracing::info!(plugin, "{text}"),
                        _ => tracing::debug!(plugin, "{text}"),
                    }
                    Ok(())
                },
            )
            .map_err(|e| anyhow!("linking host.log: {e}"))?;
        // The deadline clock: every instance's calls are measured in these ticks.
        let ticker = engine.weak();
        std::thread::Builder::new()
            .name("plugin-epoch".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(1));
                match ticker.upgrade() {
                    Some(engine) => engine.increment_epoch(),
                    None => return,
                }
            })
            .context("starting the plugin deadline thread")?;
        Ok(Arc::new(PluginRuntime { engine, linker }))
    }

    /// Validates and compiles a module. Refuses it, with the reason, if its manifest is
    /// missing or unsupported, it imports anything but `host.log`, or it lacks an export its
    /// kinds need. Compilation can take tens of milliseconds: call it off the async runtime.
    pub fn load(&self, wasm: &[u8], source: &Path, builtin: bool, settings: PluginSettings) -> Result<Plugin> {
        let manifest = abi_v1::manifest(wasm)?;
        let module =
            Module::new(&self.engine, wasm).map_err(|e| anyhow!("plugin {} does not compile: {e}", manifest.name))?;
        for import in module.imports() {
            let ok = import.module() == abi_v1::IMPORT_MODULE
                && import.name() == abi_v1::IMPORT_LOG
                && matches!(import.ty(), ExternType::Func(f) if f.params().all(|p| matches!(p, ValType::I32)) && f.params().len() == 3 && f.results().len() == 0);
            if !ok {
                bail!(
                    "plugin {} imports {}.{}: plugins may import only host.log(i32, i32, i32) (no WASI, files or network)",
                    manifest.name,
                    import.module(),
                    import.name()
                );
            }
        }
        let exports: HashMap<&str, ExternType> = module.exports().map(|e| (e.name(), e.ty())).collect();
        if !matches!(exports.get("memory"), Some(ExternType::Memory(_))) {
            bail!("plugin {} does not export its `memory`", manifest.name);
        }
        let mut needed: Vec<(&str, &[ValType], &[ValType])> = vec![("host_alloc", &[ValType::I32], &[ValType::I32])];
        for kind in &manifest.kinds {
            needed.extend_from_slice(required_exports(*kind));
        }
        for (name, params, results) in needed {
            match exports.get(name) {
                Some(ExternType::Func(f)) => {
                    let got_params: Vec<ValType> = f.params().collect();
                    let got_results: Vec<ValType> = f.results().collect();
                    let same = |a: &[ValType], b: &[ValType]| {
                        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| ValType::eq(x, y))
                    };
                    if !same(&got_params, params) || !same(&got_results, results) {
                        bail!(
                            "plugin {}: export `{name}` has type {}, ABI v1 needs {}",
                            manifest.name,
                            func_sig(&got_params, &got_results),
                            func_sig(params, results)
                        );
                    }
                }
                _ => bail!(
                    "plugin {} lacks the export `{name}` that its kinds need (see plugin-sdk/ABI.md)",
                    manifest.name
                ),
            }
        }
        let pre = self.linker.instantiate_pre(&module).map_err(|e| anyhow!("plugin {}: {e}", manifest.name))?;
        let sha256 = Sha256::digest(wasm).iter().map(|b| format!("{b:02x}")).collect();
        Ok(Plugin {
            manifest,
            settings,
            source: source.to_path_buf(),
            sha256,
            builtin,
            pre,
            calls: AtomicU64::new(0),
            faults: AtomicU64::new(0),
        })
    }

    /// A fresh sandboxed instance of `plugin`, with its config passed to `host_init`.
    pub fn instantiate(&self, plugin: &Arc<Plugin>, config: &serde_json::Value) -> Result<Instance> {
        let limits = StoreLimitsBuilder::new()
            .memory_size(plugin.settings.memory_mib << 20)
            .instances(1)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(
            &self.engine,
            StoreState { limits, plugin: plugin.manifest.name.clone(), logged: (0, 0), last_complaint: None },
        );
        store.limiter(|s| &mut s.limits);
        store.set_epoch_deadline(SETUP_DEADLINE.as_millis() as u64 * TICKS_PER_MS);
        let name = plugin.manifest.name.clone();
        let instance = plugin.pre.instantiate(&mut store).map_err(|e| fault(plugin, "instantiation", e))?;
        let memory =
            instance.get_memory(&mut store, "memory").with_context(|| format!("plugin {name} has no memory"))?;
        let alloc =
            instance.get_typed_func::<i32, i32>(&mut store, "host_alloc").map_err(|e| anyhow!("plugin {name}: {e}"))?;
        let funcs = Funcs {
            init: optional(&instance, &mut store, "host_init", &name)?,
            begin: optional(&instance, &mut store, "host_begin", &name)?,
            end: optional(&instance, &mut store, "host_end", &name)?,
            accept: optional(&instance, &mut store, "sampler_accept", &name)?,
            sample: optional(&instance, &mut store, "sampler_sample", &name)?,
            rollback: optional(&instance, &mut store, "sampler_rollback", &name)?,
            stop: optional(&instance, &mut store, "stop_check", &name)?,
            tool_feed: optional(&instance, &mut store, "tool_feed", &name)?,
            tool_finish: optional(&instance, &mut store, "tool_finish", &name)?,
            tool_render: optional(&instance, &mut store, "tool_render", &name)?,
            tool_force: optional(&instance, &mut store, "tool_force", &name)?,
            tool_render_calls: optional(&instance, &mut store, "tool_render_calls", &name)?,
            reasoning_feed: optional(&instance, &mut store, "reasoning_feed", &name)?,
            reasoning_finish: optional(&instance, &mut store, "reasoning_finish", &name)?,
            schedule: optional(&instance, &mut store, "schedule", &name)?,
        };
        let mut inst =
            Instance { plugin: plugin.clone(), store, memory, alloc, funcs, buffers: [(0, 0); 3], serving: false };
        let config = serde_json::to_vec(config).expect("JSON serializes");
        if let Some(init) = inst.funcs.init.clone() {
            let (ptr, len) = inst.write(Slot::Json, &config)?;
            let status = inst.call(&init, (ptr, len), SETUP_DEADLINE, "host_init")?;
            if status != 0 {
                let why = inst.store.data_mut().last_complaint.take();
                let why = why.map(|w| format!(": {w}")).unwrap_or_else(|| " (it logged no reason)".into());
                bail!(PluginRefused(format!("plugin {name} refused its config (host_init returned {status}){why}")));
            }
        }
        Ok(inst)
    }
}

/// The on-disk cache of compiled modules (wasmtime's, keyed by the module's bytes and the
/// compiler settings), in `<cache dir>/wasm-modules`; `HOST_PLUGIN_CACHE=off` disables it.
/// Compiling the built-in plugins takes seconds; loading them from the cache, milliseconds.
fn module_cache() -> Option<wasmtime::Cache> {
    if std::env::var("HOST_PLUGIN_CACHE").as_deref() == Ok("off") {
        return None;
    }
    let dir = crate::default_model::cache_dir().ok()?.join("wasm-modules");
    let mut config = wasmtime::CacheConfig::new();
    config.with_directory(&dir);
    match wasmtime::Cache::new(config) {
        Ok(cache) => Some(cache),
        Err(e) => {
            tracing::warn!("compiled-plugin cache at {} disabled: {e:#}", dir.display());
            None
        }
    }
}

/// The export `name` as a typed function, if the module has it.
fn optional<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
    instance: &wasmtime::Instance,
    store: &mut Store<StoreState>,
    name: &str,
    plugin: &str,
) -> Result<Option<TypedFunc<P, R>>> {
    match instance.get_func(&mut *store, name) {
        None => Ok(None),
        Some(_) => instance
            .get_typed_func(&mut *store, name)
            .map(Some)
            .map_err(|e| anyhow!("plugin {plugin}: export `{name}` does not have its ABI v1 type: {e}")),
    }
}

/// A plugin said no to its config or params: the request's fault (a 400), not the plugin's.
#[derive(Debug)]
pub struct PluginRefused(pub String);

impl std::fmt::Display for PluginRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PluginRefused {}

/// A plugin failed while serving a request (trap, deadline, memory, bad result): the error
/// names the plugin and the entry point, and fails only that request.
#[derive(Debug)]
pub struct PluginFault(pub String);

impl std::fmt::Display for PluginFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PluginFault {}

/// Turns a wasmtime error into one that names the plugin and the entry point, and counts it.
fn fault(plugin: &Plugin, entry: &str, e: wasmtime::Error) -> anyhow::Error {
    plugin.faults.fetch_add(1, Ordering::Relaxed);
    anyhow::Error::new(PluginFault(format!("{:#}", describe(plugin, entry, e))))
}

fn describe(plugin: &Plugin, entry: &str, e: wasmtime::Error) -> anyhow::Error {
    let name = &plugin.manifest.name;
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => anyhow!("plugin {name} exceeded its deadline in {entry}"),
        Some(Trap::MemoryOutOfBounds) => anyhow!("plugin {name} accessed memory out of bounds in {entry}"),
        Some(Trap::AllocationTooLarge) => {
            anyhow!("plugin {name} exceeded its memory limit of {} MiB in {entry}", plugin.settings.memory_mib)
        }
        Some(trap) => anyhow!("plugin {name} trapped in {entry}: {trap}"),
        None => {
            let text = format!("{e:#}");
            if text.contains("memory") && (text.contains("limit") || text.contains("grow")) {
                anyhow!("plugin {name} exceeded its memory limit of {} MiB in {entry}", plugin.settings.memory_mib)
            } else {
                anyhow!("plugin {name} failed in {entry}: {text}")
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Slot {
    Json = 0,
    Tokens = 1,
    Frame = 2,
}

struct Funcs {
    init: Option<TypedFunc<(i32, i32), i32>>,
    begin: Option<TypedFunc<(i32, i32, i64), i32>>,
    end: Option<TypedFunc<(), ()>>,
    accept: Option<TypedFunc<(i32, i32), i32>>,
    sample: Option<TypedFunc<(i32, i32, i32), i32>>,
    rollback: Option<TypedFunc<i32, i32>>,
    stop: Option<TypedFunc<(i32, i32, i32), i32>>,
    tool_feed: Option<TypedFunc<(i32, i32), i64>>,
    tool_finish: Option<TypedFunc<(), i64>>,
    tool_render: Option<TypedFunc<(i32, i32), i64>>,
    tool_force: Option<TypedFunc<(i32, i32), i64>>,
    tool_render_calls: Option<TypedFunc<(i32, i32), i64>>,
    reasoning_feed: Option<TypedFunc<(i32, i32), i64>>,
    reasoning_finish: Option<TypedFunc<(), i64>>,
    schedule: Option<TypedFunc<(i32, i32), i64>>,
}

/// One live instance, serving one request.
pub struct Instance {
    plugin: Arc<Plugin>,
    store: Store<StoreState>,
    memory: Memory,
    alloc: TypedFunc<i32, i32>,
    funcs: Funcs,
    /// Host-owned buffers in plugin memory, reused across calls: (ptr, capacity) per slot.
    buffers: [(i32, usize); 3],
    /// Between `begin` and `end`: the request is under way, so `host_end` is owed.
    serving: bool,
}

/// An instance that served a request gets its `host_end` however the request ended
/// (finished, failed, cancelled, paused and dropped).
impl Drop for Instance {
    fn drop(&mut self) {
        self.end();
    }
}

impl Instance {
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    fn call<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &mut self,
        f: &TypedFunc<P, R>,
        args: P,
        deadline: Duration,
        entry: &str,
    ) -> Result<R> {
        self.plugin.calls.fetch_add(1, Ordering::Relaxed);
        self.store.set_epoch_deadline(deadline.as_millis() as u64 * TICKS_PER_MS);
        f.call(&mut self.store, args).map_err(|e| fault(&self.plugin, entry, e))
    }

    /// Copies `bytes` into the slot's buffer (allocating a larger one when needed).
    fn write(&mut self, slot: Slot, bytes: &[u8]) -> Result<(i32, i32)> {
        let (mut ptr, cap) = self.buffers[slot as usize];
        if bytes.len() > cap || ptr == 0 {
            let want = bytes.len().max(64).next_power_of_two();
            let alloc = self.alloc.clone();
            ptr = self.call(&alloc, want as i32, SETUP_DEADLINE, "host_alloc")?;
            if ptr == 0 {
                self.plugin.faults.fetch_add(1, Ordering::Relaxed);
                let name = &self.plugin.manifest.name;
                bail!(PluginFault(format!("plugin {name} could not allocate {want} bytes (host_alloc returned 0)")));
            }
            self.buffers[slot as usize] = (ptr, want);
        }
        let name = &self.plugin.manifest.name;
        let start = ptr as u32 as usize;
        self.memory
            .data_mut(&mut self.store)
            .get_mut(start..start + bytes.len())
            .ok_or_else(|| {
                self.plugin.faults.fetch_add(1, Ordering::Relaxed);
                PluginFault(format!("plugin {name}: host_alloc returned {ptr}, outside its memory"))
            })?
            .copy_from_slice(bytes);
        Ok((ptr, bytes.len() as i32))
    }

    fn read(&self, ptr: i32, len: usize) -> Result<Vec<u8>> {
        let start = ptr as u32 as usize;
        self.memory
            .data(&self.store)
            .get(start..start + len)
            .map(<[u8]>::to_vec)
            .with_context(|| format!("plugin {}: buffer at {ptr} is outside its memory", self.plugin.manifest.name))
    }

    /// `host_begin` with the request's params and seed.
    pub fn begin(&mut self, params: &serde_json::Value, seed: u64) -> Result<()> {
        self.serving = true;
        let Some(begin) = self.funcs.begin.clone() else { return Ok(()) };
        let (ptr, len) = self.write(Slot::Json, &serde_json::to_vec(params).expect("JSON serializes"))?;
        let status = self.call(&begin, (ptr, len, seed as i64), SETUP_DEADLINE, "host_begin")?;
        if status != 0 {
            let why = self.store.data_mut().last_complaint.take();
            let why = why.map(|w| format!(": {w}")).unwrap_or_else(|| " (it logged no reason)".into());
            bail!(PluginRefused(format!(
                "plugin {} refused the request's params (host_begin returned {status}){why}",
                self.plugin.manifest.name
            )));
        }
        Ok(())
    }

    /// `host_end`, once, if the instance began a request (dropping the instance calls it).
    pub fn end(&mut self) {
        if !std::mem::take(&mut self.serving) {
            return;
        }
        if let Some(end) = self.funcs.end.clone() {
            let _ = self.call(&end, (), self.plugin.settings.deadline(), "host_end");
        }
    }

    /// `sampler_accept`: appends tokens to the plugin's history.
    pub fn accept(&mut self, tokens: &[u32]) -> Result<()> {
        let Some(accept) = self.funcs.accept.clone() else { return Ok(()) };
        for chunk in tokens.chunks(4096) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
            let (ptr, _) = self.write(Slot::Tokens, &bytes)?;
            let status =
                self.call(&accept, (ptr, chunk.len() as i32), self.plugin.settings.deadline(), "sampler_accept")?;
            if status != 0 {
                bail!("plugin {} failed in sampler_accept (status {status})", self.plugin.manifest.name);
            }
        }
        Ok(())
    }

    /// `sampler_rollback`, if the plugin has it; `false` means the caller must replay.
    pub fn rollback(&mut self, n: usize) -> Result<bool> {
        let Some(rollback) = self.funcs.rollback.clone() else { return Ok(false) };
        let status = self.call(&rollback, n as i32, self.plugin.settings.deadline(), "sampler_rollback")?;
        if status != 0 {
            bail!("plugin {} failed in sampler_rollback (status {status})", self.plugin.manifest.name);
        }
        Ok(true)
    }

    /// `sampler_sample` over a frame of `f32`/`(u32, f32)` records given as raw bytes; the
    /// frame is copied back (the plugin may edit it). Returns the plugin's raw result.
    pub fn sample(&mut self, position: usize, frame: &mut [u8], records: usize) -> Result<i32> {
        let sample = self
            .funcs
            .sample
            .clone()
            .with_context(|| format!("plugin {} is not a sampler", self.plugin.manifest.name))?;
        let (ptr, _) = self.write(Slot::Frame, frame)?;
        let result = self.call(
            &sample,
            (position as i32, ptr, records as i32),
            self.plugin.settings.deadline(),
            "sampler_sample",
        )?;
        if result == -1 {
            frame.copy_from_slice(&self.read(ptr, frame.len())?);
        }
        Ok(result)
    }

    /// `stop_check`: `Some(chars to trim)` to stop, `None` to continue.
    pub fn stop_check(&mut self, token: u32, text: &str) -> Result<Option<usize>> {
        let stop = self
            .funcs
            .stop
            .clone()
            .with_context(|| format!("plugin {} is not a stop rule", self.plugin.manifest.name))?;
        let (ptr, len) = self.write(Slot::Json, text.as_bytes())?;
        match self.call(&stop, (token as i32, ptr, len), self.plugin.settings.deadline(), "stop_check")? {
            -1 => Ok(None),
            r if r >= 0 => Ok(Some(r as usize)),
            r => bail!(
                "plugin {} returned {r} from stop_check; ABI v1 allows -1 or a count >= 0",
                self.plugin.manifest.name
            ),
        }
    }

    /// Copies out a packed slice (`ptr << 32 | len`) the plugin returned, at most `limit` bytes.
    fn packed(&self, packed: i64, entry: &str, limit: usize) -> Result<Vec<u8>> {
        let (ptr, len) = ((packed as u64 >> 32) as i32, (packed as u64 & 0xffff_ffff) as usize);
        if len > limit {
            self.plugin.faults.fetch_add(1, Ordering::Relaxed);
            bail!(PluginFault(format!(
                "plugin {} returned {len} bytes from {entry}, more than the {limit} allowed",
                self.plugin.manifest.name
            )));
        }
        if len == 0 {
            return Ok(Vec::new());
        }
        self.read(ptr, len).map_err(|e| {
            self.plugin.faults.fetch_add(1, Ordering::Relaxed);
            anyhow::Error::new(PluginFault(format!("{e:#} (the packed slice returned from {entry})")))
        })
    }

    /// A packed-slice result as UTF-8 text.
    fn packed_text(&self, packed: i64, entry: &str, limit: usize) -> Result<String> {
        String::from_utf8(self.packed(packed, entry, limit)?).map_err(|_| {
            self.plugin.faults.fetch_add(1, Ordering::Relaxed);
            anyhow::Error::new(PluginFault(format!(
                "plugin {} returned text that is not UTF-8 from {entry}",
                self.plugin.manifest.name
            )))
        })
    }

    fn tool_call(&mut self, f: Option<TypedFunc<(i32, i32), i64>>, input: &[u8], entry: &str) -> Result<String> {
        let f = f.with_context(|| format!("plugin {} has no {entry}", self.plugin.manifest.name))?;
        let (ptr, len) = self.write(Slot::Json, input)?;
        let packed = self.call(&f, (ptr, len), self.plugin.settings.deadline(), entry)?;
        self.packed_text(packed, entry, MAX_RESULT_BYTES)
    }

    /// `tool_feed`: the adapter's events (JSON lines) for the next piece of output text.
    pub fn tool_feed(&mut self, text: &str) -> Result<String> {
        self.tool_call(self.funcs.tool_feed.clone(), text.as_bytes(), "tool_feed")
    }

    /// `tool_finish`: the adapter's last events.
    pub fn tool_finish(&mut self) -> Result<String> {
        self.finish_call(self.funcs.tool_finish.clone(), "tool_finish", "a tool adapter")
    }

    /// `reasoning_feed`: the parser's events (JSON lines) for the next piece of output text.
    pub fn reasoning_feed(&mut self, text: &str) -> Result<String> {
        self.tool_call(self.funcs.reasoning_feed.clone(), text.as_bytes(), "reasoning_feed")
    }

    /// `reasoning_finish`: the parser's last events.
    pub fn reasoning_finish(&mut self) -> Result<String> {
        self.finish_call(self.funcs.reasoning_finish.clone(), "reasoning_finish", "a reasoning parser")
    }

    /// A `() -> packed slice` entry point: its text.
    fn finish_call(&mut self, f: Option<TypedFunc<(), i64>>, entry: &str, kind: &str) -> Result<String> {
        let f = f.with_context(|| format!("plugin {} is not {kind}", self.plugin.manifest.name))?;
        let packed = self.call(&f, (), self.plugin.settings.deadline(), entry)?;
        self.packed_text(packed, entry, MAX_RESULT_BYTES)
    }

    /// `tool_render`, if exported: system-prompt text for `tools`; `None` when the plugin
    /// lacks it or returns nothing.
    pub fn tool_render(&mut self, tools: &str) -> Result<Option<String>> {
        self.optional_text(self.funcs.tool_render.clone(), tools.as_bytes(), "tool_render")
    }

    /// `tool_force`, if exported: the text that opens a call to `name` (any function when
    /// empty) in the adapter's format; `None` when the plugin lacks it or returns nothing.
    pub fn tool_force(&mut self, name: &str) -> Result<Option<String>> {
        self.optional_text(self.funcs.tool_force.clone(), name.as_bytes(), "tool_force")
    }

    /// `tool_render_calls`, if exported: an assistant turn's `calls` (a JSON array of
    /// `{"name", "arguments"}`) as the model writes them; `None` when absent or empty.
    pub fn tool_render_calls(&mut self, calls: &str) -> Result<Option<String>> {
        self.optional_text(self.funcs.tool_render_calls.clone(), calls.as_bytes(), "tool_render_calls")
    }

    /// An optional export that returns text: `None` when the plugin lacks it or returns
    /// nothing.
    fn optional_text(
        &mut self,
        f: Option<TypedFunc<(i32, i32), i64>>,
        input: &[u8],
        entry: &str,
    ) -> Result<Option<String>> {
        if f.is_none() {
            return Ok(None);
        }
        Ok(Some(self.tool_call(f, input, entry)?).filter(|t| !t.is_empty()))
    }

    /// `schedule`: the policy's decision (JSON) for a queue description.
    pub fn schedule(&mut self, queue: &str) -> Result<String> {
        self.tool_call(self.funcs.schedule.clone(), queue.as_bytes(), "schedule")
    }

    pub fn sampler_input(&self) -> (SamplerInput, usize) {
        let s = self.plugin.manifest.sampler();
        (s.input, s.k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_end_is_called_once_for_an_instance_that_began_a_request() {
        let wat = r#"(module (@custom "host.plugin" "{\"abi\": 1, \"name\": \"ends\", \"kinds\": [\"stop\"]}")
            (memory (export "memory") 1)
            (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
            (func (export "host_begin") (param i32 i32 i64) (result i32) (i32.const 0))
            (func (export "host_end"))
            (func (export "stop_check") (param i32 i32 i32) (result i32) (i32.const -1)))"#;
        let runtime = PluginRuntime::new().unwrap();
        let wasm = wat::parse_str(wat).unwrap();
        let plugin = Arc::new(runtime.load(&wasm, Path::new("ends.wat"), false, PluginSettings::default()).unwrap());
        let calls = || plugin.calls.load(Ordering::Relaxed);
        // Never began (a render or a scheduler instance): no host_end.
        drop(runtime.instantiate(&plugin, &serde_json::json!({})).unwrap());
        let before = calls();
        let mut instance = runtime.instantiate(&plugin, &serde_json::json!({})).unwrap();
        instance.begin(&serde_json::json!({}), 1).unwrap();
        let begun = calls();
        assert!(begun > before);
        // Dropped without end(): host_end still runs, exactly once.
        drop(instance);
        assert_eq!(calls(), begun + 1);
        let mut instance = runtime.instantiate(&plugin, &serde_json::json!({})).unwrap();
        instance.begin(&serde_json::json!({}), 1).unwrap();
        let begun = calls();
        instance.end();
        drop(instance);
        assert_eq!(calls(), begun + 1);
    }

    /// `tool_force` is optional: an adapter without it cannot force calls (`None`); one with it
    /// gets the requested name and its opener comes back as text (an empty one is `None`).
    #[test]
    fn tool_force_is_optional_and_gets_the_name() {
        let adapter = |force: &str| {
            format!(
                r#"(module (@custom "host.plugin" "{{\"abi\": 1, \"name\": \"t\", \"kinds\": [\"tool\"]}}")
                (memory (export "memory") 1)
                (data (i32.const 16) "<call name=")
                (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
                (func (export "tool_feed") (param i32 i32) (result i64) (i64.const 0))
                (func (export "tool_finish") (result i64) (i64.const 0))
                {force})"#
            )
        };
        // Returns "<call name=" followed by the name, copied after it (at 27).
        let opener = r#"(func (export "tool_force") (param $p i32) (param $n i32) (result i64)
                (memory.copy (i32.const 27) (local.get $p) (local.get $n))
                (i64.or (i64.shl (i64.const 16) (i64.const 32)) (i64.extend_i32_u (i32.add (i32.const 11) (local.get $n)))))"#;
        let empty = r#"(func (export "tool_force") (param i32 i32) (result i64) (i64.const 0))"#;
        let runtime = PluginRuntime::new().unwrap();
        let force = |wat: String, name: &str| {
            let wasm = wat::parse_str(&wat).unwrap();
            let plugin = Arc::new(runtime.load(&wasm, Path::new("t.wat"), false, PluginSettings::default()).unwrap());
            runtime.instantiate(&plugin, &serde_json::json!({})).unwrap().tool_force(name).unwrap()
        };
        assert_eq!(force(adapter(""), "f"), None);
        assert_eq!(force(adapter(empty), "f"), None);
        assert_eq!(force(adapter(opener), "get_weather"), Some("<call name=get_weather".into()));
        assert_eq!(force(adapter(opener), ""), Some("<call name=".into()));
    }

    #[test]
    fn a_reasoning_parser_needs_both_exports_and_returns_json_lines() {
        let parser = |finish: &str| {
            format!(
                r#"(module (@custom "host.plugin" "{{\"abi\": 1, \"name\": \"r\", \"kinds\": [\"reasoning\"]}}")
                (memory (export "memory") 1)
                (data (i32.const 16) "{{\"reasoning\":\"hm\"}}\n")
                (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
                (func (export "reasoning_feed") (param i32 i32) (result i64)
                    (i64.or (i64.shl (i64.const 16) (i64.const 32)) (i64.const 19)))
                {finish})"#
            )
        };
        let runtime = PluginRuntime::new().unwrap();
        let load = |wat: String| {
            runtime.load(&wat::parse_str(&wat).unwrap(), Path::new("r.wat"), false, PluginSettings::default())
        };
        let e = load(parser("")).unwrap_err();
        assert!(format!("{e:#}").contains("reasoning_finish"), "{e:#}");
        let plugin =
            Arc::new(load(parser(r#"(func (export "reasoning_finish") (result i64) (i64.const 0))"#)).unwrap());
        let mut instance = runtime.instantiate(&plugin, &serde_json::json!({})).unwrap();
        assert_eq!(instance.reasoning_feed("<think>hm").unwrap(), "{\"reasoning\":\"hm\"}\n");
        assert_eq!(instance.reasoning_finish().unwrap(), "");
    }

    /// `host.log`: a message is one escaped line (no forged server lines); an instance's
    /// messages are bounded; a negative length faults; a refused config names the reason
    /// the plugin logged.
    #[test]
    fn plugin_logs_are_sanitized_bounded_and_give_the_refusal_reason() {
        assert_eq!(
            log_line("ok\nERROR host::server: forged\r\u{1b}[31m"),
            "ok\\nERROR host::server: forged\\r\\u{1b}[31m"
        );
        let wat = |init: &str, check: &str| {
            format!(
                r#"(module (@custom "host.plugin" "{{\"abi\": 1, \"name\": \"noisy\", \"kinds\": [\"stop\"]}}")
                (import "host" "log" (func $log (param i32 i32 i32)))
                (memory (export "memory") 1)
                (data (i32.const 16) "bad config: n must be > 0\nERROR forged")
                (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
                (func (export "host_init") (param i32 i32) (result i32) {init})
                (func (export "stop_check") (param i32 i32 i32) (result i32) {check}))"#
            )
        };
        let runtime = PluginRuntime::new().unwrap();
        let load = |w: String| {
            Arc::new(
                runtime
                    .load(&wat::parse_str(&w).unwrap(), Path::new("noisy.wat"), false, PluginSettings::default())
                    .unwrap(),
            )
        };
        let refusing =
            load(wat("(call $log (i32.const 0) (i32.const 16) (i32.const 25)) (i32.const 1)", "(i32.const -1)"));
        let e = runtime.instantiate(&refusing, &serde_json::json!({})).err().unwrap();
        assert!(
            format!("{e:#}").ends_with("refused its config (host_init returned 1): bad config: n must be > 0"),
            "{e:#}"
        );
        // 10,000 messages from one call: the instance stops logging after its budget.
        let looping = "(local $i i32) (loop $l (call $log (i32.const 2) (i32.const 16) (i32.const 38))
            (local.set $i (i32.add (local.get $i) (i32.const 1))) (br_if $l (i32.lt_u (local.get $i) (i32.const 10000)))) (i32.const -1)";
        let mut instance = runtime.instantiate(&load(wat("(i32.const 0)", looping)), &serde_json::json!({})).unwrap();
        assert_eq!(instance.stop_check(1, "x").unwrap(), None);
        assert_eq!(instance.store.data().logged.0, 10_000, "every call counted");
        let negative =
            load(wat("(i32.const 0)", "(call $log (i32.const 2) (i32.const 16) (i32.const -1)) (i32.const -1)"));
        let e = runtime.instantiate(&negative, &serde_json::json!({})).unwrap().stop_check(1, "x").unwrap_err();
        assert!(e.downcast_ref::<PluginFault>().is_some() && format!("{e:#}").contains("negative"), "{e:#}");
        assert_eq!(negative.faults.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn settings_files_are_strict_and_checked() {
        let dir = std::env::temp_dir().join(format!("plugin-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.toml");
        std::fs::write(&path, "deadline_ms = 200\nconfig = { n = 0.0001 }\n").unwrap();
        let s = PluginSettings::from_file(&path).unwrap();
        assert_eq!(s.deadline_ms, 200);
        assert_eq!(s.memory_mib, 64);
        assert_eq!(s.config, Some(serde_json::json!({"n": 0.0001})));
        std::fs::write(&path, "dedline_ms = 3\n").unwrap();
        assert!(PluginSettings::from_file(&path).unwrap_err().to_string().contains("unknown field `dedline_ms`"));
        std::fs::write(&path, "memory_mib = 0\n").unwrap();
        assert!(PluginSettings::from_file(&path)
            .unwrap_err()
            .to_string()
            .contains("memory_mib must be between 1 and 4096"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
