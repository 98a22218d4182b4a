//! @NAME@: a sampler plugin for host (ABI v1, plugin-sdk/ABI.md §5.1).
//! This skeleton picks the most likely candidate (greedy decoding at any temperature): change
//! `sample`. Use it with `"plugins": {"sampler": {"name": "@NAME@"}}` in a request.

use plugin_sdk::{Candidate, Choice, Sampler};

#[derive(Default)]
pub struct Plugin {
    seed: u64,
}

impl Sampler for Plugin {
    /// The request's `config` for this plugin (JSON, `{}` when none); an `Err` refuses it
    /// and the request gets a 400 with the message.
    fn init(&mut self, _config: &str) -> Result<(), String> {
        Ok(())
    }

    /// Start of the request: its `params` (JSON) and its random seed.
    fn begin(&mut self, _params: &str, seed: u64) -> Result<(), String> {
        self.seed = seed;
        Ok(())
    }

    /// The prompt's tokens (in several calls for a long prompt), then each committed token.
    fn accept(&mut self, _tokens: &[u32]) {}

    /// Candidates come sorted, most likely first. This must not change state: take
    /// randomness from `plugin_sdk::rng(self.seed, position)`. `Choice::Defer` lets the host
    /// sample natively from the (edited) candidates.
    fn sample(&self, _position: usize, candidates: &mut [Candidate]) -> Choice {
        Choice::Token(candidates[0].token)
    }
}

plugin_sdk::export_sampler!(Plugin, r#"@MANIFEST@"#);
