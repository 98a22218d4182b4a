//! Test fixture for the agent-harness tests: scripts an agent session on a real model.
//! At the first generated position it looks at the prompt and replays one of its scripts:
//!
//! - when the prompt holds any of `plain_markers`: nothing of its own (the model's output),
//!   ending the turn with `eos` after `plain_limit` tokens;
//! - when it holds any of `compact_markers` (the harness's own compaction request, a second
//!   one holding the first's summary too): `summary`;
//! - when it holds `summary_marker` (a compacted session, its summary in the prompt): `answer`;
//! - else, with `n` tool results in the prompt (occurrences of `tool_marker`, the tokens of
//!   `<|im_start|>tool`): `calls[n]`, a tool call in the adapter's format, while there is one;
//!   `answer` after the last; with `per_turn`, at most that many calls a user turn (the tool
//!   results after the last `user_marker`), then `answer`.

use plugin_sdk::{Candidate, Choice, Sampler};
use serde::Deserialize;
use std::cell::Cell;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Params {
    calls: Vec<Vec<u32>>,
    answer: Vec<u32>,
    tool_marker: Vec<u32>,
    #[serde(default)]
    plain_markers: Vec<Vec<u32>>,
    #[serde(default)]
    plain_limit: usize,
    #[serde(default)]
    compact_markers: Vec<Vec<u32>>,
    #[serde(default)]
    summary: Vec<u32>,
    #[serde(default)]
    summary_marker: Vec<u32>,
    #[serde(default)]
    per_turn: usize,
    #[serde(default)]
    user_marker: Vec<u32>,
    eos: u32,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Call(usize),
    Answer,
    Summary,
    Plain,
}

#[derive(Default)]
pub struct Script {
    params: Params,
    history: Vec<u32>,
    /// The first generated position and the mode chosen there.
    first: Cell<Option<(usize, Mode)>>,
}

/// Where `needle` last starts in `haystack` (never, for an empty one).
fn last(haystack: &[u32], needle: &[u32]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

fn count(haystack: &[u32], needle: &[u32]) -> usize {
    if needle.is_empty() {
        return 0;
    }
    haystack.windows(needle.len()).filter(|w| *w == needle).count()
}

impl Script {
    fn mode(&self, prompt: &[u32]) -> Mode {
        let p = &self.params;
        let holds = |m: &[u32]| last(prompt, m).is_some();
        if p.plain_markers.iter().any(|m| holds(m)) {
            return Mode::Plain;
        }
        if p.compact_markers.iter().any(|m| holds(m)) {
            return Mode::Summary;
        }
        let n = count(prompt, &p.tool_marker);
        let this_turn = || count(&prompt[last(prompt, &p.user_marker).unwrap_or(0)..], &p.tool_marker);
        if holds(&p.summary_marker) || n >= p.calls.len() || (p.per_turn > 0 && this_turn() >= p.per_turn) {
            Mode::Answer
        } else {
            Mode::Call(n)
        }
    }

    /// What the params leave unplayable, said before the first turn.
    fn check(p: &Params) -> Result<(), String> {
        if p.calls.is_empty() {
            return Err("harness-script: params.calls is empty (give at least one tool call)".into());
        }
        if !p.compact_markers.is_empty() && (p.summary.is_empty() || p.summary_marker.is_empty()) {
            return Err("harness-script: compact_markers needs a summary and a summary_marker".into());
        }
        if p.per_turn > 0 && p.user_marker.is_empty() {
            return Err("harness-script: per_turn needs a user_marker (the tokens that start a user turn)".into());
        }
        Ok(())
    }
}

impl Sampler for Script {
    fn begin(&mut self, params: &str, _seed: u64) -> Result<(), String> {
        self.params = plugin_util::parse::<Params>("harness-script", "params", params)?;
        Script::check(&self.params)
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
            let mode = self.mode(prompt);
            let what = match mode {
                Mode::Call(n) => format!("tool call {n}"),
                Mode::Answer => "answer".into(),
                Mode::Summary => "summary (the harness's compaction request)".into(),
                Mode::Plain => "the model's own words".into(),
            };
            plugin_sdk::log(2, &format!("scripted turn: {what}; prompt of {} tokens", prompt.len()));
            (position, mode)
        });
        self.first.set(Some((first, mode)));
        let i = position - first;
        let script = match mode {
            Mode::Plain if i >= self.params.plain_limit => return Choice::Token(self.params.eos),
            Mode::Plain => return Choice::Defer,
            Mode::Call(n) => &self.params.calls[n],
            Mode::Answer => &self.params.answer,
            Mode::Summary => &self.params.summary,
        };
        match script.get(i) {
            Some(&t) => Choice::Token(t),
            None => Choice::Token(self.params.eos),
        }
    }
}

plugin_sdk::export_sampler!(
    Script,
    r#"{"abi": 1, "name": "harness-script", "version": "0.2.0", "kinds": ["sampler"], "sampler": {"k": 1}, "description": "test fixture: scripts an agent session (tool calls, the harness's compaction, the answer)"}"#
);
