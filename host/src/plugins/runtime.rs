//! The wasmtime side of plugins: validate and compile modules (`PluginRuntime::load`),
//! pre-link them (`InstancePre`), and run one sandboxed instance per (plugin, request) with a
//! deadline per call (epoch interruption) and a memory cap. Only this module knows wasmtime.

use super::abi_v1::{self, Kind, Manifest, SamplerInput};
use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use wasmtime::{
    Caller, Config, Engine, Extern, ExternType, InstancePre, Linker, Memory, Module, ResourceLimiter, Store, Trap,
    TypedFunc, UpdateDeadline, ValType,
};

/// Epoch ticks per second (one tick per millisecond).
const TICKS_PER_MS: u64 = 1;
/// Deadlines, in CPU time of the calling thread: per-token calls, and setup (instantiation,
/// `host_init`, `host_begin`, the prompt-time tool calls).
pub const CALL_DEADLINE: Duration = Duration::from_millis(50);
pub const SETUP_DEADLINE: Duration = Duration::from_millis(1000);
/// A call also ends after this many times its deadline in wall-clock time (and at least
/// [`WALL_MIN`]), however little CPU it got: a starved machine delays a request; it does not
/// hang one.
const WALL_FACTOR: u32 = 20;
const WALL_MIN: Duration = Duration::from_secs(1);
/// Linear memory per instance.
pub const MEMORY_LIMIT: usize = 64 << 20;
/// Largest result a plugin may return through a packed slice.
pub const MAX_RESULT_BYTES: usize = 1 << 20;
/// Faults in a row after which a plugin file is quarantined.
pub const UNHEALTHY_AFTER: u32 = 3;
/// The first quarantine's length; each further one in a row doubles it, up to [`QUARANTINE_MAX`].
pub const QUARANTINE: Duration = Duration::from_secs(30);
const QUARANTINE_MAX: Duration = Duration::from_secs(600);

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
    /// Seconds a plugin is quarantined after [`UNHEALTHY_AFTER`] faults in a row (doubling
    /// while it keeps faulting, at most 600); 0 never quarantines it. Default: 30.
    pub quarantine_secs: u64,
}

impl Default for PluginSettings {
    fn default() -> Self {
        PluginSettings {
            config: None,
            params: None,
            deadline_ms: CALL_DEADLINE.as_millis() as u64,
            memory_mib: MEMORY_LIMIT >> 20,
            quarantine_secs: QUARANTINE.as_secs(),
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
        if settings.quarantine_secs > QUARANTINE_MAX.as_secs() {
            bail!("{}: quarantine_secs must be between 0 and 600, got {}", path.display(), settings.quarantine_secs);
        }
        Ok(settings)
    }
    fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }
}

pub struct StoreState {
    limits: Limiter,
    /// The call under way: when it started, in thread CPU time and wall-clock time, and its
    /// deadline.
    budget: Budget,
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

/// The longest fault message kept (a plugin's text in it is cut, not echoed whole).
const FAULT_MESSAGE_CHARS: usize = 1000;

/// A message that may hold a plugin's text (a trap or error it caused, its output) as it may
/// reach a log line or a client: one line, control characters escaped, cut short.
pub fn plugin_text(text: &str) -> String {
    let line = log_line(text);
    match line.char_indices().nth(FAULT_MESSAGE_CHARS) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line,
    }
}

/// The memory cap of one instance. A `memory.grow` past the cap returns -1 to the plugin
/// (which may handle it: `host_alloc` may return 0); the denial is remembered, so a trap that
/// follows is reported as the memory limit.
struct Limiter {
    max_bytes: usize,
    denied: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let ok = desired <= self.max_bytes;
        self.denied |= !ok;
        Ok(ok)
    }
    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }
    fn instances(&self) -> usize {
        1
    }
    fn memories(&self) -> usize {
        1
    }
}

#[derive(Clone, Copy)]
struct Budget {
    cpu_start: Duration,
    wall_start: Instant,
    deadline: Duration,
}

impl Budget {
    fn start(deadline: Duration) -> Budget {
        Budget { cpu_start: thread_cpu_time(), wall_start: Instant::now(), deadline }
    }

    /// At an epoch deadline: go on for the CPU time left, or stop the call.
    fn check(&self) -> UpdateDeadline {
        let used = thread_cpu_time().saturating_sub(self.cpu_start);
        if used >= self.deadline || self.wall_start.elapsed() >= (self.deadline * WALL_FACTOR).max(WALL_MIN) {
            UpdateDeadline::Interrupt
        } else {
            UpdateDeadline::Continue(ticks(self.deadline - used))
        }
    }
}

fn ticks(d: Duration) -> u64 {
    (d.as_millis() as u64 * TICKS_PER_MS).max(1)
}

/// CPU time of the calling thread (where wasmtime runs the plugin and the epoch callback).
#[cfg(unix)]
fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[cfg(not(unix))]
fn thread_cpu_time() -> Duration {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed()
}

/// A plugin file's health: faults in a row, and the quarantine they led to.
#[derive(Debug, Default)]
struct Health {
    in_a_row: u32,
    /// Quarantines in a row (each doubles the next one's length).
    strikes: u32,
    until: Option<Instant>,
    last_fault: Option<String>,
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
    /// Faults of the plugin itself (traps, deadlines, memory, bad results).
    pub faults: AtomicU64,
    /// Faults of a built-in plugin caused by a request's own data (its config, params or
    /// tools): that request's 400, not counted against the plugin.
    pub request_faults: AtomicU64,
    health: Mutex<Health>,
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

    /// Counts a fault of the plugin and returns it as an error for the request. After
    /// [`UNHEALTHY_AFTER`] in a row a plugin file is quarantined (a built-in never is: it is
    /// part of the server).
    pub fn fault(&self, message: String) -> anyhow::Error {
        let message = plugin_text(&message);
        self.faults.fetch_add(1, Ordering::Relaxed);
        let mut health = self.health.lock().expect("plugin health lock");
        health.in_a_row += 1;
        health.last_fault = Some(message.clone());
        let cooldown = Duration::from_secs(self.settings.quarantine_secs);
        if !self.builtin && health.in_a_row >= UNHEALTHY_AFTER && !cooldown.is_zero() {
            let length = (cooldown * 2u32.saturating_pow(health.strikes)).min(QUARANTINE_MAX);
            health.until = Some(Instant::now() + length);
            health.strikes += 1;
            health.in_a_row = 0;
            tracing::warn!(
                plugin = self.name(),
                "plugin quarantined for {} s after {UNHEALTHY_AFTER} faults in a row (last: {message}); replace its file to bring it back sooner",
                length.as_secs()
            );
        }
        anyhow::Error::new(PluginFault(message))
    }

    /// A use that ended without a fault: the faults in a row start again from zero.
    pub fn succeeded(&self) {
        let mut health = self.health.lock().expect("plugin health lock");
        if health.until.is_none_or(|t| Instant::now() >= t) {
            *health = Health { last_fault: health.last_fault.take(), ..Health::default() };
        }
    }

    /// While quarantined: how long it still lasts and why.
    pub fn quarantine(&self) -> Option<Quarantined> {
        let health = self.health.lock().expect("plugin health lock");
        let left = health.until?.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
        Some(Quarantined {
            message: format!(
                "plugin {} is quarantined for {} s more after {UNHEALTHY_AFTER} faults in a row (last: {}); it comes back when the time is up or when its file is replaced",
                self.name(),
                left.as_secs_f64().ceil() as u64,
                health.last_fault.as_deref().unwrap_or("unknown")
            ),
            retry_after: left,
        })
    }

    /// Not quarantined, and no fault since its last use without one (`GET /v1/plugins` shows
    /// `unhealthy` while faults in a row build up towards quarantine).
    pub fn healthy(&self) -> bool {
        let health = self.health.lock().expect("plugin health lock");
        health.in_a_row == 0 && health.until.is_none_or(|t| Instant::now() >= t)
    }

    /// The last fault's message, if it faulted.
    pub fn last_fault(&self) -> Option<String> {
        self.health.lock().expect("plugin health lock").last_fault.clone()
    }
}

/// A request selected a quarantined plugin: a 503 with `Retry-After`, unless the request
/// allows a fallback (then it runs without the plugin).
#[derive(Debug)]
pub struct Quarantined {
    pub message: String,
    pub retry_after: Duration,
}

impl std::fmt::Display for Quarantined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Quarantined {}

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
        Kind::Constraint => &[
            ("constraint_vocab", &[I32, I32], &[I32]),
            ("constraint_mask", &[I32, I32], &[I32]),
            ("constraint_accept", &[I32], &[I32]),
            ("constraint_rollback", &[I32], &[I32]),
        ],
    }
}

impl PluginRuntime {
    pub fn new() -> Result<Arc<PluginRuntime>> {
        let mut config = Config::new();
        // Deadlines: the epoch ticker wakes each call's check of its thread CPU time.
        config.epoch_interruption(true);
        // No wasm backtraces: they carry the module's `name` section (function and module
        // names of the plugin's choosing, unescaped, several lines) into fault messages,
        // which reach the log and the client. A fault names the plugin and its entry point.
        config.wasm_backtrace_max_frames(None);
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
                    // A plugin's "error" is at most a server WARN: most are a refusal of the
                    // client's config or params (the SDK logs why `host_init` said no), and
                    // the server's own ERROR lines mean the server failed.
                    match level {
                        0 => tracing::warn!(plugin, plugin_level = "error", "{text}"),
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
        if !builtin {
            // Instantiate once as a request would (start function, initial memory against the
            // cap, under the setup deadline), so a module that cannot start is refused here
            // instead of failing every request.
            let mut store = self.store(&manifest.name, &settings);
            if let Err(e) = pre.instantiate(&mut store) {
                let denied = store.data().limits.denied;
                bail!("{:#}", describe(&manifest.name, settings.memory_mib, denied, "instantiation", e));
            }
        }
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
            request_faults: AtomicU64::new(0),
            health: Mutex::default(),
        })
    }

    /// A store for one instance of the plugin `name`: its memory cap and its deadline clock.
    fn store(&self, name: &str, settings: &PluginSettings) -> Store<StoreState> {
        let state = StoreState {
            limits: Limiter { max_bytes: settings.memory_mib << 20, denied: false },
            budget: Budget::start(SETUP_DEADLINE),
            plugin: name.to_string(),
            logged: (0, 0),
            last_complaint: None,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        store.epoch_deadline_callback(|ctx| Ok(ctx.data().budget.check()));
        store.set_epoch_deadline(ticks(SETUP_DEADLINE));
        store
    }

    /// A fresh sandboxed instance of `plugin`, with its config passed to `host_init`.
    /// `request_data`: the config (and what follows) comes from a request, so a built-in
    /// plugin's fault is that request's (see [`Instance::fault`]).
    pub fn instantiate(&self, plugin: &Arc<Plugin>, config: &serde_json::Value) -> Result<Instance> {
        let mut store = self.store(&plugin.manifest.name, &plugin.settings);
        let name = plugin.manifest.name.clone();
        let instance = match plugin.pre.instantiate(&mut store) {
            Ok(instance) => instance,
            Err(e) => {
                let denied = store.data().limits.denied;
                let message = describe(&name, plugin.settings.memory_mib, denied, "instantiation", e);
                return Err(blame(plugin, true, format!("{message:#}")));
            }
        };
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
            tool_grammar: optional(&instance, &mut store, "tool_grammar", &name)?,
            tool_trigger: optional(&instance, &mut store, "tool_trigger", &name)?,
            reasoning_feed: optional(&instance, &mut store, "reasoning_feed", &name)?,
            reasoning_finish: optional(&instance, &mut store, "reasoning_finish", &name)?,
            schedule: optional(&instance, &mut store, "schedule", &name)?,
            schedule_drafts: optional(&instance, &mut store, "schedule_drafts", &name)?,
            constraint_vocab: optional(&instance, &mut store, "constraint_vocab", &name)?,
            constraint_mask: optional(&instance, &mut store, "constraint_mask", &name)?,
            constraint_accept: optional(&instance, &mut store, "constraint_accept", &name)?,
            constraint_rollback: optional(&instance, &mut store, "constraint_rollback", &name)?,
        };
        let mut inst = Instance {
            plugin: plugin.clone(),
            store,
            memory,
            alloc,
            funcs,
            buffers: [(0, 0); 3],
            serving: false,
            request_data: true,
            used: false,
            faulted: false,
        };
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
        inst.request_data = false;
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
    let dir = crate::load::default_model::cache_dir().ok()?.join("wasm-modules");
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

// The two errors at the seam are the engine's (it tells them apart); the runtime raises them.
pub use crate::engine::hooks::{PluginFault, PluginRefused};

mod instance;
pub use instance::Instance;
use instance::{blame, describe, Funcs, Slot};

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

    /// A plugin's `name` section (function and module names of its choosing) never reaches a
    /// fault message, and text from the plugin in one is a single escaped line.
    #[test]
    fn fault_messages_carry_no_name_section_and_no_forged_lines() {
        let module = |check: &str| {
            format!(
                r#"(module (@name "mod\nERROR host::server: forged")
                (@custom "host.plugin" "{{\"abi\": 1, \"name\": \"named\", \"kinds\": [\"stop\"]}}")
                (import "host" "log" (func $log (param i32 i32 i32)))
                (memory (export "memory") 1)
                (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
                (func $inner (@name "inner\nERROR host::server: forged") (result i32) {check})
                (func (export "stop_check") (param i32 i32 i32) (result i32) (call $inner)))"#
            )
        };
        let runtime = PluginRuntime::new().unwrap();
        for check in ["unreachable", "(call $log (i32.const 2) (i32.const 16) (i32.const -1)) (i32.const -1)"] {
            let wasm = wat::parse_str(module(check)).unwrap();
            let plugin =
                Arc::new(runtime.load(&wasm, Path::new("named.wasm"), false, PluginSettings::default()).unwrap());
            let e = runtime.instantiate(&plugin, &serde_json::json!({})).unwrap().stop_check(1, "x").unwrap_err();
            let text = format!("{e:#}");
            assert!(e.downcast_ref::<PluginFault>().is_some() && text.contains("stop_check"), "{text}");
            assert!(!text.contains("forged") && !text.contains('\n'), "{text}");
        }
        assert_eq!(plugin_text("a\nb\u{1b}"), "a\\nb\\u{1b}");
        assert_eq!(plugin_text(&"x".repeat(5000)).chars().count(), FAULT_MESSAGE_CHARS + 1);
    }

    fn stop_rule(name: &str, extra: &str, check: &str) -> Vec<u8> {
        wat::parse_str(format!(
            r#"(module (@custom "host.plugin" "{{\"abi\": 1, \"name\": \"{name}\", \"kinds\": [\"stop\"]}}")
            {extra}
            (func (export "stop_check") (param i32 i32 i32) (result i32) {check}))"#
        ))
        .unwrap()
    }

    const SIMPLE: &str = r#"(memory (export "memory") 1)
        (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))"#;

    /// The deadline counts the calling thread's CPU time: a trivial call on a starved machine
    /// (more busy threads than cores) never trips a 1 ms deadline, which a wall-clock
    /// deadline does, while a looping call still ends.
    #[test]
    fn the_deadline_is_cpu_time_so_a_starved_machine_does_not_fail_trivial_calls() {
        let runtime = PluginRuntime::new().unwrap();
        let settings = PluginSettings { deadline_ms: 1, ..PluginSettings::default() };
        let load = |check: &str| {
            let wasm = stop_rule("quick", SIMPLE, check);
            Arc::new(runtime.load(&wasm, Path::new("quick.wat"), false, settings.clone()).unwrap())
        };
        let trivial = load("(i32.const -1)");
        /// Stops the busy threads however the test ends (a panic must not leave them running).
        struct Stop(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Stop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let stop = Stop(Arc::new(std::sync::atomic::AtomicBool::new(false)));
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let spinners: Vec<_> = (0..cores * 3)
            .map(|_| {
                let stop = stop.0.clone();
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                    }
                })
            })
            .collect();
        let mut instance = runtime.instantiate(&trivial, &serde_json::json!({})).unwrap();
        let started = Instant::now();
        let mut calls = 0;
        while started.elapsed() < Duration::from_millis(1500) {
            assert_eq!(instance.stop_check(1, "x").unwrap(), None, "after {calls} calls");
            calls += 1;
        }
        drop(stop);
        spinners.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(trivial.faults.load(Ordering::Relaxed), 0);
        let looping = load("(loop $l (br $l)) (i32.const -1)");
        let e = runtime.instantiate(&looping, &serde_json::json!({})).unwrap().stop_check(1, "x").unwrap_err();
        assert!(format!("{e:#}").contains("exceeded its deadline in stop_check (CPU time"), "{e:#}");
        // The decision itself: much wall time with little CPU goes on; used CPU, or twenty
        // times the deadline (at least a second) in wall time, stops.
        let budget = |cpu_ago: Duration, wall_ago: Duration| Budget {
            cpu_start: thread_cpu_time().saturating_sub(cpu_ago),
            wall_start: Instant::now() - wall_ago,
            deadline: Duration::from_millis(50),
        };
        let ms = Duration::from_millis;
        assert!(matches!(budget(ms(0), ms(400)).check(), UpdateDeadline::Continue(t) if t >= 40));
        assert!(matches!(budget(ms(60), ms(60)).check(), UpdateDeadline::Interrupt));
        assert!(matches!(budget(ms(0), ms(1001)).check(), UpdateDeadline::Interrupt));
    }

    /// Modules that cannot start are refused at load (a looping start function, initial
    /// memory over the cap); a `memory.grow` past the cap returns -1 to the plugin, so an
    /// allocator that handles it makes `host_alloc` return 0: a fault naming the plugin.
    #[test]
    fn memory_and_start_failures_are_the_plugins_and_name_it() {
        let runtime = PluginRuntime::new().unwrap();
        let settings = PluginSettings { memory_mib: 2, ..PluginSettings::default() };
        let load = |extra: &str| {
            runtime.load(&stop_rule("mem", extra, "(i32.const -1)"), Path::new("mem.wat"), false, settings.clone())
        };
        let alloc = r#"(func (export "host_alloc") (param i32) (result i32) (i32.const 1024))"#;
        let e = load(&format!(r#"(memory (export "memory") 64) {alloc}"#)).unwrap_err();
        assert!(format!("{e:#}").contains("exceeded its memory limit of 2 MiB in instantiation"), "{e:#}");
        let e = load(&format!(r#"(memory (export "memory") 1) {alloc} (func $spin (loop $l (br $l))) (start $spin)"#))
            .unwrap_err();
        assert!(format!("{e:#}").contains("exceeded its deadline in instantiation"), "{e:#}");
        // host_alloc grows memory by the pages asked for and returns 0 when that fails.
        let growing = r#"(memory (export "memory") 1)
            (func (export "host_alloc") (param $n i32) (result i32) (local $old i32)
                (local.set $old (memory.grow (i32.add (i32.shr_u (local.get $n) (i32.const 16)) (i32.const 1))))
                (if (result i32) (i32.eq (local.get $old) (i32.const -1))
                    (then (i32.const 0))
                    (else (i32.shl (local.get $old) (i32.const 16)))))"#;
        let plugin = Arc::new(load(growing).unwrap());
        let mut instance = runtime.instantiate(&plugin, &serde_json::json!({})).unwrap();
        assert_eq!(instance.stop_check(1, "small").unwrap(), None);
        let e = instance.stop_check(1, &"x".repeat(3 << 20)).unwrap_err();
        let message = format!("{e:#}");
        assert!(e.downcast_ref::<PluginFault>().is_some(), "{message}");
        assert!(message.contains("plugin mem could not allocate") && message.contains("limit is 2 MiB"), "{message}");
        assert_eq!(plugin.faults.load(Ordering::Relaxed), 1);
    }

    /// Three faults in a row quarantine a plugin file (a use without a fault in between
    /// starts the count again); `quarantine_secs = 0` turns it off; a built-in is never
    /// quarantined, and its fault on a request's own data is that request's refusal.
    #[test]
    fn faults_in_a_row_quarantine_a_plugin_file_but_not_a_built_in() {
        let runtime = PluginRuntime::new().unwrap();
        // Faults when the text is "bad" (its first byte is 'b').
        let check = "(if (i32.eq (i32.load8_u (local.get 1)) (i32.const 98)) (then unreachable)) (i32.const -1)";
        let wasm = stop_rule("flaky", SIMPLE, check);
        let load = |builtin: bool, quarantine_secs: u64| {
            let settings = PluginSettings { quarantine_secs, ..PluginSettings::default() };
            Arc::new(runtime.load(&wasm, Path::new("flaky.wat"), builtin, settings).unwrap())
        };
        let request = |plugin: &Arc<Plugin>, text: &str| {
            runtime.instantiate(plugin, &serde_json::json!({})).unwrap().stop_check(1, text).map(|_| ())
        };
        let plugin = load(false, 30);
        for _ in 0..2 {
            assert!(request(&plugin, "bad").is_err());
            assert!(!plugin.healthy() && plugin.quarantine().is_none(), "unhealthy while faults build up");
        }
        request(&plugin, "good").unwrap();
        assert!(plugin.quarantine().is_none() && plugin.healthy());
        for _ in 0..3 {
            assert!(request(&plugin, "bad").is_err());
        }
        let q = plugin.quarantine().expect("quarantined after three faults in a row");
        assert!(q.retry_after > Duration::from_secs(25), "{q:?}");
        assert!(q.message.contains("quarantined for 30 s more") && q.message.contains("trapped in stop_check"), "{q}");
        assert!(!plugin.healthy());
        let off = load(false, 0);
        for _ in 0..5 {
            assert!(request(&off, "bad").is_err());
        }
        assert!(off.quarantine().is_none());
        let builtin = load(true, 30);
        for _ in 0..5 {
            assert!(request(&builtin, "bad").is_err());
        }
        assert!(builtin.quarantine().is_none());
        // A built-in working on the request's data: the request's error, not the plugin's.
        let e = runtime
            .instantiate(&builtin, &serde_json::json!({}))
            .unwrap()
            .on_request_data()
            .stop_check(1, "bad")
            .unwrap_err();
        assert!(e.downcast_ref::<PluginRefused>().is_some(), "{e:#}");
        assert!(format!("{e:#}").contains("this request's own data"), "{e:#}");
        assert_eq!((builtin.faults.load(Ordering::Relaxed), builtin.request_faults.load(Ordering::Relaxed)), (5, 1));
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
