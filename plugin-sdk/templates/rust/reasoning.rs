//! @NAME@: a reasoning-parser plugin for host (ABI v1, plugin-sdk/ABI.md §5.5).
//! This skeleton takes a reply that opens with `<think>` as thinking up to `</think>` and the
//! rest as the answer. Use it with `"plugins": {"reasoning": {"name": "@NAME@"}}`.

use plugin_sdk::{ReasoningEvent, ReasoningParser};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Default, PartialEq)]
enum State {
    /// Not yet known whether the reply opens with thinking.
    #[default]
    Start,
    Thinking,
    Answer,
}

#[derive(Default)]
pub struct Plugin {
    held: String,
    state: State,
    /// The thinking just closed: whitespace before the answer is dropped.
    closed: bool,
}

impl ReasoningParser for Plugin {
    fn feed(&mut self, text: &str, out: &mut Vec<ReasoningEvent>) {
        self.held.push_str(text);
        if self.state == State::Start {
            let start = self.held.trim_start();
            if start.starts_with(OPEN) {
                self.held = start[OPEN.len()..].to_string();
                self.state = State::Thinking;
            } else if OPEN.starts_with(start) {
                return; // Maybe the start of `<think>`: wait for more.
            } else {
                self.state = State::Answer;
            }
        }
        if self.state == State::Thinking {
            match self.held.find(CLOSE) {
                Some(at) => {
                    out.push(ReasoningEvent::Reasoning(self.held[..at].to_string()));
                    self.held = self.held[at + CLOSE.len()..].to_string();
                    self.state = State::Answer;
                    self.closed = true;
                }
                None => {
                    let keep = (1..CLOSE.len()).rev().find(|&k| self.held.ends_with(&CLOSE[..k])).unwrap_or(0);
                    let thought: String = self.held.drain(..self.held.len() - keep).collect();
                    if !thought.is_empty() {
                        out.push(ReasoningEvent::Reasoning(thought));
                    }
                    return;
                }
            }
        }
        if self.closed {
            self.held = self.held.trim_start().to_string();
            self.closed = self.held.is_empty();
        }
        if !self.held.is_empty() {
            out.push(ReasoningEvent::Content(std::mem::take(&mut self.held)));
        }
    }

    fn finish(&mut self, out: &mut Vec<ReasoningEvent>) {
        if !self.held.is_empty() {
            let text = std::mem::take(&mut self.held);
            out.push(if self.state == State::Thinking { ReasoningEvent::Reasoning(text) } else { ReasoningEvent::Content(text) });
        }
    }
}

plugin_sdk::export_reasoning_parser!(Plugin, r#"@MANIFEST@"#);
