//! @NAME@: a tool-call adapter plugin for host (ABI v1, plugin-sdk/ABI.md §5.3).
//! This skeleton reads calls written as `<call name="NAME">{"arg": 1}</call>`, streaming the
//! arguments, and tells the model that format (`render`, for templates without tools).
//! Use it with `"plugins": {"tool": {"name": "@NAME@"}}` next to a request's `tools`.

use plugin_sdk::{ToolAdapter, ToolEvent};

const OPEN: &str = "<call name=\"";
const NAME_END: &str = "\">";
const CLOSE: &str = "</call>";

#[derive(Default, PartialEq)]
enum State {
    #[default]
    Text,
    Name,
    Args,
}

#[derive(Default)]
pub struct Plugin {
    /// Output not reported yet (it may be the start of a marker).
    held: String,
    state: State,
    /// Calls reported so far (the next call's index).
    calls: usize,
}

/// How many bytes at the end of `text` could be the start of `marker`.
fn partial(text: &str, marker: &str) -> usize {
    (1..marker.len()).rev().find(|&k| text.ends_with(&marker[..k])).unwrap_or(0)
}

impl Plugin {
    /// Reports the held text up to `end` as content or arguments, and drops it.
    fn report(&mut self, end: usize, out: &mut Vec<ToolEvent>) {
        let text: String = self.held.drain(..end).collect();
        if text.is_empty() {
            return;
        }
        out.push(match self.state {
            State::Args => ToolEvent::Args { index: self.calls, delta: text },
            _ => ToolEvent::Content(text),
        });
    }
}

impl ToolAdapter for Plugin {
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.held.push_str(text);
        loop {
            let marker = match self.state {
                State::Text => OPEN,
                State::Name => NAME_END,
                State::Args => CLOSE,
            };
            let Some(at) = self.held.find(marker) else {
                if self.state != State::Name {
                    let keep = partial(&self.held, marker);
                    self.report(self.held.len() - keep, out);
                }
                return;
            };
            match self.state {
                State::Text => {
                    self.report(at, out);
                    self.held.drain(..marker.len());
                    self.state = State::Name;
                }
                State::Name => {
                    let name: String = self.held.drain(..at).collect();
                    self.held.drain(..marker.len());
                    out.push(ToolEvent::Call { index: self.calls, id: format!("call_{}", self.calls), name });
                    self.state = State::Args;
                }
                State::Args => {
                    self.report(at, out);
                    self.held.drain(..marker.len());
                    self.calls += 1;
                    self.state = State::Text;
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        if self.state == State::Name {
            // A call that never got its name: give the text back as it was.
            self.held.insert_str(0, OPEN);
            self.state = State::Text;
        }
        self.report(self.held.len(), out);
    }

    /// The tools (a JSON array, OpenAI shape) as system-prompt text.
    fn render(&mut self, tools: &str) -> Option<String> {
        Some(format!(
            "You can call these tools: {tools}\nTo call one, write <call name=\"TOOL NAME\">JSON ARGUMENTS</call>."
        ))
    }

    /// What opens a call to `name` (a request that forces one): the reply starts with it.
    fn force(&mut self, name: &str) -> Option<String> {
        Some(if name.is_empty() { OPEN.to_string() } else { format!("{OPEN}{name}{NAME_END}") })
    }
}

plugin_sdk::export_tool_adapter!(Plugin, r#"@MANIFEST@"#);
