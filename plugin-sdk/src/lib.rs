//! The Rust SDK for `host` plugins (ABI v1, see `ABI.md` next to this crate).
//!
//! Implement [`Sampler`] or [`StopRule`] on a type with `Default`, then register it once:
//!
//! ```ignore
//! #[derive(Default)]
//! struct Greedy;
//! impl plugin_sdk::Sampler for Greedy {
//!     fn sample(&self, _position: usize, candidates: &mut [plugin_sdk::Candidate]) -> plugin_sdk::Choice {
//!         plugin_sdk::Choice::Token(candidates[0].token)
//!     }
//! }
//! plugin_sdk::export_sampler!(Greedy, r#"{"abi": 1, "name": "greedy", "version": "1.0.0", "kinds": ["sampler"]}"#);
//! ```
//!
//! and build with `cargo build --release --target wasm32-unknown-unknown` (crate type `cdylib`).
//! The macro emits the `host.plugin` manifest section, the allocator and the ABI exports; the
//! raw ABI code lives in the hidden `abi` module.

#[doc(hidden)]
pub mod abi;

/// One candidate token, as the host sends it: highest logit first.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct Candidate {
    pub token: u32,
    pub logit: f32,
}

/// A sampler's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// This token id.
    Token(u32),
    /// Let the host sample natively from the (possibly edited) candidates.
    Defer,
}

/// A token sampler. `sample` must not change state: derive randomness from
/// `(seed, position)` (see [`rng`]), change state only in `accept`.
pub trait Sampler: Default {
    /// The plugin's JSON config; an `Err` refuses it (the request gets a 400).
    fn init(&mut self, _config: &str) -> Result<(), String> {
        Ok(())
    }
    /// Start of a request: its JSON params for this plugin and its random seed.
    fn begin(&mut self, _params: &str, _seed: u64) -> Result<(), String> {
        Ok(())
    }
    /// Appends committed tokens (first the prompt, then each generated token).
    fn accept(&mut self, _tokens: &[u32]) {}
    /// Forgets the last `n` accepted tokens; return `false` if unsupported (the host replays).
    fn rollback(&mut self, _n: usize) -> bool {
        false
    }
    /// Picks the token at sequence position `position`.
    fn sample(&self, position: usize, candidates: &mut [Candidate]) -> Choice;
}

/// A stop rule: `Some(n)` stops after this token and trims the last `n` characters.
pub trait StopRule: Default {
    fn init(&mut self, _config: &str) -> Result<(), String> {
        Ok(())
    }
    fn begin(&mut self, _params: &str, _seed: u64) -> Result<(), String> {
        Ok(())
    }
    fn check(&mut self, token: u32, text: &str) -> Option<usize>;
}

/// Writes to the host's log (0 error, 1 warn, 2 info, 3 debug).
pub fn log(level: i32, message: &str) {
    abi::log(level, message)
}

/// A small deterministic generator for `(seed, position)`-keyed randomness (SplitMix64).
pub fn rng(seed: u64, position: usize) -> impl FnMut() -> f64 {
    let mut state = seed ^ (position as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stops at the first newline, trimming it.
    #[derive(Default)]
    struct Newline;

    impl StopRule for Newline {
        fn check(&mut self, _token: u32, text: &str) -> Option<usize> {
            text.contains('\n').then_some(1)
        }
    }

    // The export macro must expand for a stop rule (the Rust example covers the sampler one).
    crate::export_stop_rule!(Newline, r#"{"abi": 1, "name": "newline", "kinds": ["stop"]}"#);

    #[test]
    fn stop_rule_defaults_and_check() {
        let mut rule = Newline;
        assert!(rule.init("{}").is_ok() && rule.begin("{}", 7).is_ok());
        assert_eq!(rule.check(1, "a\n"), Some(1));
        assert_eq!(rule.check(1, "a"), None);
    }

    #[test]
    fn rng_is_keyed_by_seed_and_position() {
        let draw = |seed, position| rng(seed, position)();
        assert_eq!(draw(1, 5), draw(1, 5));
        assert_ne!(draw(1, 5), draw(1, 6));
        assert_ne!(draw(1, 5), draw(2, 5));
        assert!((0.0..1.0).contains(&draw(3, 3)));
    }
}
