//! What the engine asks of a token picker outside it (a sampler plugin): the frame it sees
//! at a position and its pick. `plugins/` implements it; the engine knows only this trait.

use anyhow::Result;

/// What an external sampler (a plugin) sees at one position.
pub enum Frame<'a> {
    /// The top-k `(token, logit)` pairs, highest logit first.
    Candidates(&'a mut [(u32, f32)]),
    /// The whole logits row, indexed by token id.
    Logits(&'a mut [f32]),
}

/// An external sampler's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    Token(u32),
    /// Sample natively from the (possibly edited) frame.
    Defer,
}

/// A token picker outside the engine (a sampler plugin). With one, decoding is serial: each
/// step's logits are read back and the picker runs before the next step is built.
pub trait ExternalSampler {
    /// `Some(k)`: wants the top-k candidates; `None`: wants the full logits row.
    fn candidates(&self) -> Option<usize>;
    fn sample(&mut self, position: usize, frame: Frame<'_>) -> Result<Pick>;
    /// Called with each committed token, in order.
    fn accept(&mut self, tokens: &[u32]) -> Result<()>;
    /// Whether a failure should hand sampling back to the native sampler (for the rest of
    /// the request) instead of failing it.
    fn fallback(&self) -> bool {
        false
    }
}
