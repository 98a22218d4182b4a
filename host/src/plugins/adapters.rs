//! The adapters that plug a plugin instance into the engine: a sampler as its
//! `ExternalSampler`, a constraint as its `Constraint`, a tool-call adapter and a reasoning
//! parser as the text pipeline's, a scheduler as its `Policy`. Each turns a plugin's
//! answers (ABI.md §5) into the engine's types and its faults into the engine's errors.

use super::abi_v1::{Kind, SamplerInput};
use super::runtime::{self, Instance, Plugin};
use super::{PluginRegistry, Selected, Selection};
use crate::engine::constraint::{Allowed, Constraint, ConstraintSpec};
pub use crate::engine::hooks::ToolOutput;
use crate::engine::hooks::{self, ExternalSampler, Frame, Pick, ReasoningOutput, RequestHooks, Started, StopRule};
use crate::engine::scheduler::MakePolicy;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::sync::{Arc, Mutex};

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

/// A streaming text-parser instance (a tool adapter or a reasoning parser) on one request's
/// output. With a fallback allowed, a fault turns it off and the text passes through as
/// content from then on.
struct Parser {
    instance: Option<Instance>,
    fallback: bool,
}

impl Parser {
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
    parser: Parser,
    /// Calls reported so far: the next call's index.
    calls: usize,
}

impl PluginTools {
    pub fn new(instance: Instance, fallback: bool) -> PluginTools {
        PluginTools { parser: Parser { instance: Some(instance), fallback }, calls: 0 }
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

impl hooks::TextParser<ToolOutput> for PluginTools {
    fn feed(&mut self, text: &str) -> Result<Vec<ToolOutput>> {
        self.run(text, "tool_feed", |i| i.tool_feed(text))
    }

    fn finish(&mut self) -> Result<Vec<ToolOutput>> {
        self.run("", "tool_finish", Instance::tool_finish)
    }
}

/// A reasoning-parser instance on one request's output: splits the model's thinking from
/// its answer.
pub struct PluginReasoning {
    parser: Parser,
}

impl PluginReasoning {
    pub fn new(instance: Instance, fallback: bool) -> PluginReasoning {
        PluginReasoning { parser: Parser { instance: Some(instance), fallback } }
    }
}

impl hooks::TextParser<ReasoningOutput> for PluginReasoning {
    fn feed(&mut self, text: &str) -> Result<Vec<ReasoningOutput>> {
        self.parser.run(
            text,
            "reasoning_feed",
            |i| i.reasoning_feed(text),
            parse_reasoning_events,
            ReasoningOutput::Content,
        )
    }

    fn finish(&mut self) -> Result<Vec<ReasoningOutput>> {
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

/// A stop-rule plugin instance as the engine's `StopRule`.
pub struct PluginStopRule {
    instance: Instance,
    hold: usize,
    fallback: bool,
}

impl StopRule for PluginStopRule {
    fn name(&self) -> &str {
        self.instance.plugin().name()
    }

    fn hold(&self) -> usize {
        self.hold
    }

    fn check(&mut self, token: u32, text: &str) -> Result<Option<usize>> {
        self.instance.stop_check(token, text)
    }

    fn fallback(&self) -> bool {
        self.fallback
    }
}

/// The plugins a request selected, as the engine's `RequestHooks`: started on the engine
/// thread when the request starts.
#[derive(Debug)]
pub struct PluginHooks {
    registry: Option<Arc<PluginRegistry>>,
    selection: Selection,
}

impl PluginHooks {
    /// The hooks of a request's selection (`None` when it selects nothing the engine runs);
    /// `registry` is the server's plugin runtime, if it has one.
    pub fn of(registry: Option<Arc<PluginRegistry>>, selection: Selection) -> Option<Arc<dyn RequestHooks>> {
        if selection.is_empty() {
            return None;
        }
        Some(Arc::new(PluginHooks { registry, selection }))
    }
}

impl RequestHooks for PluginHooks {
    /// Starts the request's plugin instances: the sampler (fed the whole prompt), the stop
    /// rules with how many characters each needs held back, the tool adapter and the
    /// reasoning parser.
    fn start(&self, prompt: &[u32], seed: u64, vocab: usize) -> Result<Started> {
        let selection = &self.selection;
        let registry = self.registry.as_ref().context("this server has no plugin runtime")?;
        // A plugin that faults while starting is skipped when the request allows a fallback
        // (a refused config is still the client's error).
        let skip = |selected: &Selected, e: anyhow::Error| {
            let refused = e.chain().any(|c| c.downcast_ref::<runtime::PluginRefused>().is_some());
            if selected.fallback && !refused {
                tracing::warn!("plugin {} skipped for this request: {e:#}", selected.plugin.name());
                Ok(None)
            } else {
                Err(e)
            }
        };
        let start = |selected| registry.start(selected, seed).map(Some).or_else(|e| skip(selected, e));
        let mut started = Started::default();
        if let Some(selected) = &selection.sampler {
            // The sampler is fed the whole prompt as part of starting.
            let instance = registry.start(selected, seed).and_then(|mut instance| {
                instance.accept(prompt)?;
                Ok(instance)
            });
            if let Some(instance) = instance.map(Some).or_else(|e| skip(selected, e))? {
                let sampler = PluginSampler::new(instance, vocab).with_fallback(selected.fallback);
                started.sampler = Some(Box::new(sampler));
            }
        }
        for selected in &selection.stops {
            if let Some(instance) = start(selected)? {
                let hold = selected.plugin.manifest.stop().hold;
                started.stops.push(Box::new(PluginStopRule { instance, hold, fallback: selected.fallback }));
            }
        }
        if let Some(selected) = &selection.tool {
            if let Some(instance) = start(selected)? {
                started.tools = Some(Box::new(PluginTools::new(instance, selected.fallback)));
            }
        }
        if let Some(selected) = &selection.reasoning {
            if let Some(instance) = start(selected)? {
                started.reasoning = Some(Box::new(PluginReasoning::new(instance, selected.fallback)));
            }
        }
        Ok(started)
    }
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

    /// The engine's maker of this policy (`EngineConfig::policy`).
    pub fn maker(registry: Arc<PluginRegistry>, name: String, config: Value) -> MakePolicy {
        MakePolicy(Arc::new(move || Box::new(PluginScheduler::new(registry.clone(), name.clone(), config.clone()))))
    }
}

impl crate::engine::scheduler::Policy for PluginScheduler {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn decide(&mut self, view: &crate::engine::scheduler::QueueView) -> Result<crate::engine::scheduler::Decision> {
        if !self.ready()? {
            // First come, first served until it is back.
            return Ok(crate::engine::scheduler::Decision::default());
        }
        self.call("schedule", view, |instance, text| instance.schedule(text))
    }

    fn chooses_drafts(&mut self) -> bool {
        self.ready().unwrap_or(false) && self.current.as_ref().is_some_and(|(_, i)| i.has_schedule_drafts())
    }

    fn drafts(
        &mut self,
        view: &crate::engine::scheduler::DraftView,
    ) -> Result<Option<crate::engine::scheduler::DraftDecision>> {
        if !self.chooses_drafts() {
            return Ok(None);
        }
        self.call("schedule_drafts", view, |instance, text| instance.schedule_drafts(text)).map(Some)
    }
}

impl PluginScheduler {
    /// The current version's instance started (a new one when hot reload swapped the plugin);
    /// false while the plugin is quarantined (said once, not at every decision).
    fn ready(&mut self) -> Result<bool> {
        let plugin = self
            .registry
            .get(&self.name)
            .filter(|p| p.manifest.has(Kind::Scheduler))
            .with_context(|| format!("scheduling policy {:?} is not loaded", self.name))?;
        if let Some(q) = plugin.quarantine() {
            if !std::mem::replace(&mut self.quarantine_told, true) {
                tracing::warn!(
                    "{q}; serving first come first served, speculative drafts by the built-in rule, meanwhile"
                );
            }
            self.current = None;
            return Ok(false);
        }
        self.quarantine_told = false;
        if !self.current.as_ref().is_some_and(|(p, _)| Arc::ptr_eq(p, &plugin)) {
            let instance = self.registry.runtime.instantiate(&plugin, &self.config)?;
            tracing::info!(policy = self.name, version = plugin.manifest.version, "scheduling policy instance started");
            self.current = Some((plugin, instance));
        }
        Ok(true)
    }

    /// One call of the started instance's `entry` with `input` as JSON, its answer parsed.
    fn call<T: serde::de::DeserializeOwned>(
        &mut self,
        entry: &str,
        input: &impl serde::Serialize,
        f: impl FnOnce(&mut Instance, &str) -> Result<String>,
    ) -> Result<T> {
        let (plugin, instance) = self.current.as_mut().context("the scheduling policy has no instance")?;
        let result = f(instance, &serde_json::to_string(input).expect("JSON serializes")).and_then(|text| {
            serde_json::from_str(&text).map_err(|e| {
                instance.fault(format!("plugin {} returned a bad decision from {entry}: {e}", plugin.name()))
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
