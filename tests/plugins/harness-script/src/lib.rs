//! Test fixture for the agent-harness tests: scripts one agent round trip on a real model.
//! At the first generated position it looks at the prompt and replays one of its scripts:
//! `answer` when the prompt holds a tool result (`tool_marker`, the tokens of
//! `<|im_start|>tool`), else `call` (a tool call in the adapter's format); when the prompt
//! holds any of `plain_markers` it samples nothing itself (the model's own output) and ends
//! the turn with `eos` after `plain_limit` tokens.

use plugin_sdk::{Candidate, Choice, Sampler};
use serde::Deserialize;
use std::cell::Cell;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Params {
    call: Vec<u32>,
    answer: Vec<u32>,
    tool_marker: Vec<u32>,
    #[serde(default)]
    plain_markers: Vec<Vec<u32>>,
    #[serde(default)]
    plain_limit: usize,
    eos: u32,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Call,
    Answer,
    Plain,
}

#[derive(Default)]
pub struct Script {
    params: Params,
    history: Vec<u32>,
    /// The first generated position and the mode chosen there.
    first: Cell<Option<(usize, Mode)>>,
}

fn contains(haystack: &[u32], needle: &[u32]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

impl Sampler for Script {
    fn begin(&mut self, params: &str, _seed: u64) -> Result<(), String> {
        self.params = plugin_util::parse::<Params>("harness-script", "params", params)?;
        Ok(())
    }

    fn accept(&mut self, tokens: &[u32]) {
        self.history.extend_from_slice(tokens);
    }

    fn rollback(&mut self, n: usize) -> bool {
        self.history.truncate(self.history.len().saturating_sub(n));
        true
    }

    fn sample(&self, position: usize, _candidates: &mut [Candidate]) -> Choice {
        let (first, mode) = *self.first.get().get_or_insert_with(|| {
            let prompt = &self.history[..position.min(self.history.len())];
            let mode = if self.params.plain_markers.iter().any(|m| contains(prompt, m)) {
                Mode::Plain
            } else if contains(prompt, &self.params.tool_marker) {
                Mode::Answer
            } else {
                Mode::Call
            };
            (position, mode)
        });
        self.first.set(Some((first, mode)));
        let i = position - first;
        let script = match mode {
            Mode::Plain if i >= self.params.plain_limit => return Choice::Token(self.params.eos),
            Mode::Plain => return Choice::Defer,
            Mode::Call => &self.params.call,
            Mode::Answer => &self.params.answer,
        };
        match script.get(i) {
            Some(&t) => Choice::Token(t),
            None => Choice::Token(self.params.eos),
        }
    }
}

plugin_sdk::export_sampler!(
    Script,
    r#"{"abi": 1, "name": "harness-script", "version": "0.1.0", "kinds": ["sampler"], "sampler": {"k": 1}, "description": "test fixture: scripts a tool call, then the answer after the tool result"}"#
);
