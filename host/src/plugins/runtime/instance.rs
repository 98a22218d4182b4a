//! One live plugin instance (`Instance`): a store per (plugin, request) with its memory cap,
//! the host-owned buffers it exchanges data through, and every ABI call with its deadline,
//! its result checked, and its faults blamed on the plugin or on the request's own data.

use super::*;

/// A fault while the plugin worked on a request's own data: for a built-in plugin that is
/// the request's error (a 400, counted in `request_faults`); otherwise the plugin's fault.
pub(super) fn blame(plugin: &Plugin, request_data: bool, message: String) -> anyhow::Error {
    if request_data && plugin.builtin {
        plugin.request_faults.fetch_add(1, Ordering::Relaxed);
        let message = plugin_text(&message);
        anyhow::Error::new(PluginRefused(format!(
            "{message}: this request's own data (its tools, plugin config or params) made the built-in plugin fail; send less or simpler data"
        )))
    } else {
        plugin.fault(message)
    }
}

/// A wasmtime error as a message that names the plugin and the entry point. `denied`: a
/// `memory.grow` past the cap was refused in this instance, so a trap is the memory limit.
pub(super) fn describe(name: &str, memory_mib: usize, denied: bool, entry: &str, e: wasmtime::Error) -> anyhow::Error {
    let over_memory = || {
        anyhow!(
            "plugin {name} exceeded its memory limit of {memory_mib} MiB in {entry} (raise memory_mib in its settings file if it needs more)"
        )
    };
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) if denied => anyhow!(
            "plugin {name} exceeded its deadline in {entry} after reaching its memory limit of {memory_mib} MiB (memory.grow returned -1)"
        ),
        Some(Trap::Interrupt) => anyhow!("plugin {name} exceeded its deadline in {entry} (CPU time; deadline_ms in its settings file sets it)"),
        Some(Trap::AllocationTooLarge) => over_memory(),
        Some(_) if denied => over_memory(),
        Some(Trap::MemoryOutOfBounds) => anyhow!("plugin {name} accessed memory out of bounds in {entry}"),
        Some(trap) => anyhow!("plugin {name} trapped in {entry}: {trap}"),
        None => {
            let text = format!("{e:#}");
            if denied || (text.contains("memory") && (text.contains("limit") || text.contains("grow"))) {
                over_memory()
            } else {
                anyhow!("plugin {name} failed in {entry}: {text}")
            }
        }
    }
}

#[derive(Clone, Copy)]
pub(super) enum Slot {
    Json = 0,
    Tokens = 1,
    Frame = 2,
}

pub(super) struct Funcs {
    pub(super) init: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) begin: Option<TypedFunc<(i32, i32, i64), i32>>,
    pub(super) end: Option<TypedFunc<(), ()>>,
    pub(super) accept: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) sample: Option<TypedFunc<(i32, i32, i32), i32>>,
    pub(super) rollback: Option<TypedFunc<i32, i32>>,
    pub(super) stop: Option<TypedFunc<(i32, i32, i32), i32>>,
    pub(super) tool_feed: Option<TypedFunc<(i32, i32), i64>>,
    pub(super) tool_finish: Option<TypedFunc<(), i64>>,
    pub(super) tool_render: Option<TypedFunc<(i32, i32), i64>>,
    pub(super) tool_force: Option<TypedFunc<(i32, i32), i64>>,
    pub(super) tool_render_calls: Option<TypedFunc<(i32, i32), i64>>,
    pub(super) tool_grammar: Option<TypedFunc<(i32, i32), i64>>,
    pub(super) tool_trigger: Option<TypedFunc<(), i64>>,
    pub(super) reasoning_feed: Option<TypedFunc<(i32, i32), i64>>,
    pub(super) reasoning_finish: Option<TypedFunc<(), i64>>,
    pub(super) schedule: Option<TypedFunc<(i32, i32), i64>>,
    pub(super) schedule_drafts: Option<TypedFunc<(i32, i32), i64>>,
    pub(super) constraint_vocab: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) constraint_mask: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) constraint_accept: Option<TypedFunc<i32, i32>>,
    pub(super) constraint_rollback: Option<TypedFunc<i32, i32>>,
}

/// One live instance, serving one request.
pub struct Instance {
    pub(super) plugin: Arc<Plugin>,
    pub(super) store: Store<StoreState>,
    pub(super) memory: Memory,
    pub(super) alloc: TypedFunc<i32, i32>,
    pub(super) funcs: Funcs,
    /// Host-owned buffers in plugin memory, reused across calls: (ptr, capacity) per slot.
    pub(super) buffers: [(i32, usize); 3],
    /// Between `begin` and `end`: the request is under way, so `host_end` is owed.
    pub(super) serving: bool,
    /// The instance is working on a request's own data (its config, params or tools).
    pub(super) request_data: bool,
    /// A call returned; a fault happened.
    pub(super) used: bool,
    pub(super) faulted: bool,
}

/// An instance that served a request gets its `host_end` however the request ended
/// (finished, failed, cancelled, paused and dropped); one that served without a fault
/// clears the plugin's faults in a row.
impl Drop for Instance {
    fn drop(&mut self) {
        self.end();
        if self.used && !self.faulted {
            self.plugin.succeeded();
        }
    }
}

impl Instance {
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// A fault of this instance (a trap, a deadline, the memory cap, a bad result), counted
    /// against the plugin; for a built-in working on the request's own data, the request's
    /// error instead (see [`blame`]).
    pub fn fault(&mut self, message: String) -> anyhow::Error {
        self.faulted = true;
        blame(&self.plugin, self.request_data, message)
    }

    /// This instance works on the request's own data from now on (a prompt-time tool adapter).
    pub fn on_request_data(mut self) -> Instance {
        self.request_data = true;
        self
    }

    pub(super) fn call<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &mut self,
        f: &TypedFunc<P, R>,
        args: P,
        deadline: Duration,
        entry: &str,
    ) -> Result<R> {
        self.plugin.calls.fetch_add(1, Ordering::Relaxed);
        self.store.data_mut().budget = Budget::start(deadline);
        self.store.set_epoch_deadline(ticks(deadline));
        match f.call(&mut self.store, args) {
            Ok(r) => {
                self.used = true;
                Ok(r)
            }
            Err(e) => {
                let (name, mib, denied) =
                    (&self.plugin.manifest.name, self.plugin.settings.memory_mib, self.store.data().limits.denied);
                let message = format!("{:#}", describe(name, mib, denied, entry, e));
                Err(self.fault(message))
            }
        }
    }

    /// Copies `bytes` into the slot's buffer (allocating a larger one when needed).
    pub(super) fn write(&mut self, slot: Slot, bytes: &[u8]) -> Result<(i32, i32)> {
        let ptr = self.fill(slot, bytes.len(), |buffer| buffer.copy_from_slice(bytes))?;
        Ok((ptr, bytes.len() as i32))
    }

    /// The slot's buffer of at least `len` bytes (allocating a larger one when needed), its
    /// first `len` bytes handed to `f` to fill; returns the pointer.
    pub(super) fn fill(&mut self, slot: Slot, len: usize, f: impl FnOnce(&mut [u8])) -> Result<i32> {
        let (mut ptr, cap) = self.buffers[slot as usize];
        if len > cap || ptr == 0 {
            let want = len.max(64).next_power_of_two();
            let alloc = self.alloc.clone();
            ptr = self.call(&alloc, want as i32, SETUP_DEADLINE, "host_alloc")?;
            if ptr == 0 {
                let name = &self.plugin.manifest.name;
                let limit = self.plugin.settings.memory_mib;
                let message = format!(
                    "plugin {name} could not allocate {want} bytes (host_alloc returned 0; its memory limit is {limit} MiB)"
                );
                return Err(self.fault(message));
            }
            self.buffers[slot as usize] = (ptr, want);
        }
        let start = ptr as u32 as usize;
        match self.memory.data_mut(&mut self.store).get_mut(start..start + len) {
            Some(buffer) => f(buffer),
            None => {
                let message = format!(
                    "plugin {}: host_alloc returned {ptr}, outside its memory, for {len} bytes",
                    self.plugin.manifest.name
                );
                return Err(self.fault(message));
            }
        }
        Ok(ptr)
    }

    pub(super) fn read(&self, ptr: i32, len: usize) -> Result<Vec<u8>> {
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
        self.request_data = true;
        let status = self.call(&begin, (ptr, len, seed as i64), SETUP_DEADLINE, "host_begin");
        self.request_data = false;
        let status = status?;
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
                return Err(self.fault(format!(
                    "plugin {} failed in sampler_accept (it returned {status}; ABI v1 expects 0)",
                    self.plugin.manifest.name
                )));
            }
        }
        Ok(())
    }

    /// `sampler_rollback`, if the plugin has it; `false` means the caller must replay.
    pub fn rollback(&mut self, n: usize) -> Result<bool> {
        let Some(rollback) = self.funcs.rollback.clone() else { return Ok(false) };
        let status = self.call(&rollback, n as i32, self.plugin.settings.deadline(), "sampler_rollback")?;
        if status != 0 {
            return Err(self.fault(format!(
                "plugin {} failed in sampler_rollback (it returned {status}; ABI v1 expects 0)",
                self.plugin.manifest.name
            )));
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
            r => Err(self.fault(format!(
                "plugin {} returned {r} from stop_check; ABI v1 allows -1 or a count >= 0",
                self.plugin.manifest.name
            ))),
        }
    }

    /// Copies out a packed slice (`ptr << 32 | len`) the plugin returned, at most `limit` bytes.
    pub(super) fn packed(&mut self, packed: i64, entry: &str, limit: usize) -> Result<Vec<u8>> {
        let (ptr, len) = ((packed as u64 >> 32) as i32, (packed as u64 & 0xffff_ffff) as usize);
        if len > limit {
            let name = &self.plugin.manifest.name;
            return Err(
                self.fault(format!("plugin {name} returned {len} bytes from {entry}, more than the {limit} allowed"))
            );
        }
        if len == 0 {
            return Ok(Vec::new());
        }
        self.read(ptr, len).map_err(|e| self.fault(format!("{e:#} (the packed slice returned from {entry})")))
    }

    /// A packed-slice result as UTF-8 text.
    pub(super) fn packed_text(&mut self, packed: i64, entry: &str, limit: usize) -> Result<String> {
        let bytes = self.packed(packed, entry, limit)?;
        String::from_utf8(bytes).map_err(|_| {
            let name = &self.plugin.manifest.name;
            self.fault(format!("plugin {name} returned text that is not UTF-8 from {entry}"))
        })
    }

    pub(super) fn tool_call(
        &mut self,
        f: Option<TypedFunc<(i32, i32), i64>>,
        input: &[u8],
        entry: &str,
    ) -> Result<String> {
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
    pub(super) fn finish_call(&mut self, f: Option<TypedFunc<(), i64>>, entry: &str, kind: &str) -> Result<String> {
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

    /// `tool_grammar`, if exported: the Lark grammar of the rest of a forced call (`request`:
    /// `{"name", "tools"}`), or with `"lazy": true` of a call from just after
    /// `tool_trigger`'s text; `None` when absent or empty.
    pub fn tool_grammar(&mut self, request: &str) -> Result<Option<String>> {
        self.optional_text(self.funcs.tool_grammar.clone(), request.as_bytes(), "tool_grammar")
    }

    /// `tool_trigger`, if exported: the text that opens a call the model writes on its own,
    /// after which the lazy `tool_grammar` holds the call; `None` when absent or empty.
    pub fn tool_trigger(&mut self) -> Result<Option<String>> {
        let Some(f) = self.funcs.tool_trigger.clone() else { return Ok(None) };
        let packed = self.call(&f, (), self.plugin.settings.deadline(), "tool_trigger")?;
        Ok(Some(self.packed_text(packed, "tool_trigger", MAX_RESULT_BYTES)?).filter(|t| !t.is_empty()))
    }

    /// An optional export that returns text: `None` when the plugin lacks it or returns
    /// nothing.
    pub(super) fn optional_text(
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

    /// Whether the instance exports `schedule_drafts` (ABI.md §5.4, optional).
    pub fn has_schedule_drafts(&self) -> bool {
        self.funcs.schedule_drafts.is_some()
    }

    /// `schedule_drafts`: the policy's draft budgets (JSON) for a batch's verification.
    pub fn schedule_drafts(&mut self, view: &str) -> Result<String> {
        self.tool_call(self.funcs.schedule_drafts.clone(), view.as_bytes(), "schedule_drafts")
    }

    /// `constraint_vocab`: every token's bytes, once, before the instance's first request
    /// (the encoding is ABI.md §5.6's).
    pub fn constraint_vocab(&mut self, vocab: &[u8]) -> Result<()> {
        let f = self.constraint_func(self.funcs.constraint_vocab.clone())?;
        let (ptr, len) = self.write(Slot::Json, vocab)?;
        match self.call(&f, (ptr, len), SETUP_DEADLINE, "constraint_vocab")? {
            0 => Ok(()),
            status => {
                let why = self.store.data_mut().last_complaint.take();
                let why = why.map(|w| format!(": {w}")).unwrap_or_else(|| " (it logged no reason)".into());
                let name = &self.plugin.manifest.name;
                Err(self.fault(format!(
                    "plugin {name} refused the model's vocabulary (constraint_vocab returned {status}){why}"
                )))
            }
        }
    }

    /// `constraint_mask` into a zeroed buffer of `words` u32 words: the plugin's answer (0
    /// anything, 1 end, 2 the bitset) and the words as it left them.
    pub fn constraint_mask(&mut self, words: usize) -> Result<(i32, Vec<u32>)> {
        let f = self.constraint_func(self.funcs.constraint_mask.clone())?;
        let ptr = self.fill(Slot::Frame, words * 4, |buffer| buffer.fill(0))?;
        let answer = self.call(&f, (ptr, words as i32), self.plugin.settings.deadline(), "constraint_mask")?;
        if answer != 2 {
            return Ok((answer, Vec::new()));
        }
        let start = ptr as u32 as usize;
        let bytes = self.memory.data(&self.store).get(start..start + words * 4).with_context(|| {
            format!("plugin {}: its mask buffer at {ptr} is outside its memory", self.plugin.manifest.name)
        })?;
        Ok((answer, bytes.chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes"))).collect()))
    }

    /// `constraint_accept`: `token` comes next.
    pub fn constraint_accept(&mut self, token: u32) -> Result<()> {
        let f = self.constraint_func(self.funcs.constraint_accept.clone())?;
        self.constraint_status(f, token, "constraint_accept")
    }

    /// `constraint_rollback`: forget the last `n` accepted tokens.
    pub fn constraint_rollback(&mut self, n: u32) -> Result<()> {
        let f = self.constraint_func(self.funcs.constraint_rollback.clone())?;
        self.constraint_status(f, n, "constraint_rollback")
    }

    /// A `(i32) -> status` constraint call.
    pub(super) fn constraint_status(&mut self, f: TypedFunc<i32, i32>, arg: u32, entry: &str) -> Result<()> {
        match self.call(&f, arg as i32, self.plugin.settings.deadline(), entry)? {
            0 => Ok(()),
            status => {
                let name = &self.plugin.manifest.name;
                Err(self
                    .fault(format!("plugin {name} failed in {entry}({arg}) (it returned {status}; ABI v1 expects 0)")))
            }
        }
    }

    pub(super) fn constraint_func<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &self,
        f: Option<TypedFunc<P, R>>,
    ) -> Result<TypedFunc<P, R>> {
        f.with_context(|| format!("plugin {} is not a constraint", self.plugin.manifest.name))
    }

    pub fn sampler_input(&self) -> (SamplerInput, usize) {
        let s = self.plugin.manifest.sampler();
        (s.input, s.k)
    }
}
