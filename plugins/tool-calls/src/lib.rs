//! The machinery behind the built-in tool-call adapters: a streaming scanner that passes
//! plain text through as content (holding back only what could be the start of a marker),
//! collects the text of each tool-call region, and hands it to a [`Format`] that turns it
//! into calls. A region that does not parse is given back as content, as written.
//!
//! Each adapter crate is `Adapter<TheFormat>` plus `export_tool_adapter!`.

pub mod formats;
mod partial;

use plugin_sdk::{ToolAdapter, ToolEvent};
use serde_json::Value;

/// One parsed call: the function name and its arguments as a JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

impl Call {
    /// A call whose arguments are a JSON value (an object, or a string holding JSON).
    pub fn new(name: &str, arguments: &Value) -> Call {
        let arguments = match arguments {
            Value::String(s) if serde_json::from_str::<Value>(s).is_ok() => s.clone(),
            Value::Null => "{}".into(),
            v => v.to_string(),
        };
        Call { name: name.to_string(), arguments }
    }
}

/// A tool-call syntax.
pub trait Format: Default {
    /// Markers that open a region: (marker, whether the marker is part of the region's text).
    fn open(&self) -> &'static [(&'static str, bool)];
    /// The marker that closes a region; `None`: it runs to the end of the output.
    fn close(&self) -> Option<&'static str>;
    /// Regions only at the start of the output (after whitespace), not inside prose.
    fn anchored(&self) -> bool {
        false
    }
    /// The calls in a region's text; `Err` gives the region back as content.
    fn parse(&self, region: &str, tools: &[Value]) -> Result<Vec<Call>, String>;
    /// System-prompt text describing `tools` (a JSON array) for templates that ignore them.
    fn render(&self, _tools: &[Value]) -> Option<String> {
        None
    }
    /// Regions hold JSON call objects (`{"name": .., "arguments": {..}}`), so calls can be
    /// streamed while the region is still being written: the header as soon as the name is
    /// complete, then the arguments as they come.
    fn streams_json(&self) -> bool {
        false
    }
    /// The start of a call to `name` (any function when `None`) as the model would write it:
    /// what the host puts at the start of the reply when the request forces a call.
    fn force(&self, _name: Option<&str>) -> Option<String> {
        None
    }
    /// `calls` as the model writes them: the assistant's earlier calls in the prompt, for
    /// templates that ignore tools (the template would drop them).
    fn write(&self, _calls: &[Call]) -> Option<String> {
        None
    }
    /// A Lark grammar (llguidance's dialect) for what follows [`force`](Self::force)'s
    /// opener, to the end of the reply: the call's arguments held to the tool's schema, then
    /// the format's closer. `None`: the format has no grammar yet.
    fn grammar(&self, _name: Option<&str>, _tools: &[Value]) -> Option<String> {
        None
    }
    /// The text that opens a call the model starts on its own, after which the host holds
    /// the rest of the call to [`lazy_grammar`](Adapter::lazy_grammar)'s grammar. It occurs
    /// in `force(None)`'s opener; what follows it there is the grammar's lead. `None`: calls
    /// the model starts are not constrained.
    fn trigger(&self) -> Option<&'static str> {
        None
    }
}

/// A [`Format`] as a streaming [`ToolAdapter`].
#[derive(Default)]
pub struct Adapter<F: Format> {
    format: F,
    tools: Vec<Value>,
    seed: u64,
    calls: usize,
    /// Text not yet classified (it may begin a marker).
    pending: String,
    /// Inside a region: the marker that opened it and the region text so far.
    region: Option<(String, String)>,
    /// Anchored formats: whether the output has shown non-space text yet.
    decided: bool,
    /// Calls of the open region already streamed: (call index, argument bytes sent).
    streamed: Vec<(usize, usize)>,
}

impl<F: Format> Adapter<F> {
    fn content(out: &mut Vec<ToolEvent>, text: &str) {
        if !text.is_empty() {
            match out.last_mut() {
                Some(ToolEvent::Content(c)) => c.push_str(text),
                _ => out.push(ToolEvent::Content(text.to_string())),
            }
        }
    }

    /// Streams what the open region's text now shows of its calls (JSON formats).
    fn stream(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        if !self.format.streams_json() {
            return;
        }
        for (i, call) in partial::calls(text).iter().enumerate() {
            if i == self.streamed.len() {
                let index = self.calls;
                self.calls += 1;
                out.push(ToolEvent::Call { index, id: self.call_id(index), name: call.name.clone() });
                self.streamed.push((index, 0));
            }
            let (index, sent) = self.streamed[i];
            let delta = match &call.arguments {
                partial::Arguments::Raw(raw) => &raw[sent.min(raw.len())..],
                partial::Arguments::Text { value: Some(v), .. } if sent == 0 => v.as_str(),
                _ => "",
            };
            if !delta.is_empty() {
                out.push(ToolEvent::Args { index, delta: delta.to_string() });
                self.streamed[i].1 = sent + delta.len();
            }
        }
    }

    fn call_id(&self, index: usize) -> String {
        format!("call_{:08x}{index}", self.seed as u32 ^ (self.seed >> 32) as u32)
    }

    /// Ends a region: its calls as events, or its text back as content.
    fn close_region(&mut self, marker: &str, text: &str, closed: bool, out: &mut Vec<ToolEvent>) {
        self.stream(text, out);
        let streamed = std::mem::take(&mut self.streamed);
        if !streamed.is_empty() {
            // A call written without arguments gets an empty object.
            for (index, sent) in streamed {
                if sent == 0 {
                    out.push(ToolEvent::Args { index, delta: "{}".into() });
                }
            }
            return;
        }
        let keep = self.format.open().iter().any(|(m, keep)| *m == marker && *keep);
        let parsed = self.format.parse(text, &self.tools).ok().filter(|c| !c.is_empty());
        match parsed {
            Some(calls) => {
                for call in calls {
                    let index = self.calls;
                    self.calls += 1;
                    out.push(ToolEvent::Call { index, id: self.call_id(index), name: call.name });
                    out.push(ToolEvent::Args { index, delta: call.arguments });
                }
            }
            None => {
                if !keep {
                    Self::content(out, marker);
                }
                Self::content(out, text);
                if closed {
                    Self::content(out, self.format.close().unwrap_or(""));
                }
            }
        }
    }

    fn scan(&mut self, out: &mut Vec<ToolEvent>, finished: bool) {
        loop {
            if let Some((marker, mut text)) = self.region.take() {
                match self.format.close() {
                    Some(close) => match self.pending.find(close) {
                        Some(at) => {
                            text.push_str(&self.pending[..at]);
                            self.pending.drain(..at + close.len());
                            self.close_region(&marker, &text, true, out);
                            continue;
                        }
                        None => {
                            let hold = if finished { 0 } else { plugin_util::partial_suffix(&self.pending, close) };
                            let take = self.pending.len() - hold;
                            text.extend(self.pending.drain(..take));
                        }
                    },
                    None => text.push_str(&std::mem::take(&mut self.pending)),
                }
                if finished {
                    self.close_region(&marker, &text, false, out);
                } else {
                    self.stream(&text, out);
                    self.region = Some((marker, text));
                }
                return;
            }
            if self.format.anchored() && !self.decided {
                let body = self.pending.trim_start();
                if body.is_empty() && !finished {
                    return;
                }
                let lead = self.pending.len() - body.len();
                if let Some((m, keep)) = self.format.open().iter().find(|(m, _)| body.starts_with(m)) {
                    self.decided = true;
                    let skip = lead + if *keep { 0 } else { m.len() };
                    self.pending.drain(..skip);
                    self.region = Some((m.to_string(), String::new()));
                    continue;
                }
                if !finished && self.format.open().iter().any(|(m, _)| m.starts_with(body)) {
                    return;
                }
                self.decided = true;
            }
            if self.format.anchored() {
                // Decided as prose: everything is content.
                Self::content(out, &std::mem::take(&mut self.pending));
                return;
            }
            let first =
                self.format.open().iter().filter_map(|(m, keep)| self.pending.find(m).map(|at| (at, *m, *keep))).min();
            match first {
                Some((at, marker, keep)) => {
                    let before: String = self.pending.drain(..at).collect();
                    Self::content(out, &before);
                    if !keep {
                        self.pending.drain(..marker.len());
                    }
                    self.region = Some((marker.to_string(), String::new()));
                }
                None => {
                    let hold = if finished {
                        0
                    } else {
                        self.format
                            .open()
                            .iter()
                            .map(|(m, _)| plugin_util::partial_suffix(&self.pending, m))
                            .max()
                            .unwrap_or(0)
                    };
                    let take = self.pending.len() - hold;
                    let text: String = self.pending.drain(..take).collect();
                    Self::content(out, &text);
                    return;
                }
            }
        }
    }
}

impl<F: Format> ToolAdapter for Adapter<F> {
    fn begin(&mut self, params: &str, seed: u64) -> Result<(), String> {
        let params: Value = plugin_util::parse("tool adapter", "params", params)?;
        self.tools = params.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
        self.seed = seed;
        Ok(())
    }

    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.pending.push_str(text);
        self.scan(out, false);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        self.scan(out, true);
    }

    fn render(&mut self, tools: &str) -> Option<String> {
        let tools: Vec<Value> = serde_json::from_str(tools).ok()?;
        self.format.render(&tools)
    }
    fn force(&mut self, name: &str) -> Option<String> {
        self.format.force(Some(name).filter(|n| !n.is_empty()))
    }
    fn grammar(&mut self, request: &str) -> Option<String> {
        let request: Value = serde_json::from_str(request).ok()?;
        let name = request.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
        let tools = request.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
        if request.get("lazy").and_then(Value::as_bool) == Some(true) {
            return self.lazy_grammar(&tools);
        }
        self.format.grammar(name, &tools)
    }
    fn trigger(&mut self) -> Option<String> {
        self.format.trigger().map(String::from)
    }
    fn render_calls(&mut self, calls: &str) -> Option<String> {
        let calls: Vec<Value> = serde_json::from_str(calls).ok()?;
        let calls: Vec<Call> = calls
            .iter()
            .filter_map(|c| Some(Call::new(c.get("name")?.as_str()?, c.get("arguments").unwrap_or(&Value::Null))))
            .collect();
        self.format.write(&calls)
    }
}

impl<F: Format> Adapter<F> {
    /// The grammar of a call the model starts on its own, from just after the format's
    /// trigger to the call's end: the rest of `force(None)`'s opener (the lead), then what a
    /// forced call to any of `tools` holds to.
    pub fn lazy_grammar(&self, tools: &[Value]) -> Option<String> {
        let opener = self.format.force(None)?;
        let (_, lead) = opener.split_once(self.format.trigger()?)?;
        let rest = self.format.grammar(None, tools)?;
        if lead.is_empty() {
            return Some(rest);
        }
        let (first, others) = rest.split_once('\n').unwrap_or((&rest, ""));
        let start = first.strip_prefix("start: ")?;
        Some(format!("start: {} ({start})\n{others}", Value::String(lead.to_string())))
    }
}

/// The function object of an OpenAI tool definition (`{"type": "function", "function": {..}}`).
pub fn function(tool: &Value) -> &Value {
    tool.get("function").unwrap_or(tool)
}

/// Feeds `pieces` through a fresh adapter and returns its events, merged: content pieces
/// joined, argument deltas joined per call. For tests.
pub fn run<F: Format>(pieces: &[&str], tools: &[Value]) -> (String, Vec<(String, String)>) {
    let mut adapter = Adapter::<F>::default();
    adapter.begin(&serde_json::json!({"tools": tools}).to_string(), 1).unwrap();
    let mut events = Vec::new();
    for p in pieces {
        adapter.feed(p, &mut events);
    }
    adapter.finish(&mut events);
    let mut content = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    for e in events {
        match e {
            ToolEvent::Content(c) => content.push_str(&c),
            ToolEvent::Call { index, name, .. } => {
                assert_eq!(index, calls.len());
                calls.push((name, String::new()));
            }
            ToolEvent::Args { index, delta } => calls[index].1.push_str(&delta),
        }
    }
    (content, calls)
}

/// Splits `text` into pieces of `n` characters (streaming in tests).
pub fn chunks(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(n).map(|c| c.iter().collect()).collect()
}
