//! Test fixture: replays the token ids in its params (`{"tokens": [..]}`), one per generated
//! position, then defers to the host's sampler. Tests script exact outputs with it (a tool
//! call in a given format, a sentence for a stop rule) on a real model.

use plugin_sdk::{Candidate, Choice, Sampler};
use serde::Deserialize;
use std::cell::Cell;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Params {
    tokens: Vec<u32>,
}

#[derive(Default)]
pub struct Replay {
    tokens: Vec<u32>,
    /// The position of the first generated token (the first `sample` call's).
    first: Cell<Option<usize>>,
}

impl Sampler for Replay {
    fn begin(&mut self, params: &str, _seed: u64) -> Result<(), String> {
        self.tokens = plugin_util::parse::<Params>("replay", "params", params)?.tokens;
        Ok(())
    }

    fn sample(&self, position: usize, _candidates: &mut [Candidate]) -> Choice {
        let first = *self.first.get().get_or_insert(position);
        self.first.set(Some(first));
        match self.tokens.get(position - first) {
            Some(&t) => Choice::Token(t),
            None => Choice::Defer,
        }
    }
}

plugin_sdk::export_sampler!(
    Replay,
    r#"{"abi": 1, "name": "replay", "version": "0.1.0", "kinds": ["sampler"], "sampler": {"k": 1}, "description": "test fixture: replays params.tokens"}"#
);
