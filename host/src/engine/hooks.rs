//! The plugin seam: what the engine asks of the code a request brings along (its plugins),
//! as traits. `plugins/` implements them (`plugins/adapters.rs`); the engine knows only
//! these, never the Wasm runtime: a token picker (`ExternalSampler`), stop rules, the
//! streaming text parsers over the output (tool calls, reasoning), how they start for a
//! request (`RequestHooks`), and the two errors that say whose fault a failure was.

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

/// A rule that ends the output (a stop-rule plugin), shown each token's text as it comes.
pub trait StopRule {
    /// Its name, for the finish reason it gives.
    fn name(&self) -> &str;
    /// Characters of output to hold back from the client until it has seen what follows.
    fn hold(&self) -> usize;
    /// `Some(n)`: stop here, cutting the last `n` characters (of the text held and this
    /// piece); `None`: go on.
    fn check(&mut self, token: u32, text: &str) -> Result<Option<usize>>;
    /// Whether a failure should drop the rule (for the rest of the request) instead of
    /// failing it.
    fn fallback(&self) -> bool;
}

/// What a tool-call parser reports: text, the start of a call, or a piece of its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolOutput {
    Content(String),
    Call { index: usize, id: String, name: String },
    Args { index: usize, delta: String },
}

/// What a reasoning parser reports: the answer's text or the model's thinking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningOutput {
    Content(String),
    Reasoning(String),
}

/// A streaming parser over one request's output text (a tool adapter: `O` = `ToolOutput`;
/// a reasoning parser: `ReasoningOutput`).
pub trait TextParser<O> {
    /// Feeds the next piece of output text.
    fn feed(&mut self, text: &str) -> Result<Vec<O>>;
    /// End of output: what the parser still holds.
    fn finish(&mut self) -> Result<Vec<O>>;
}

/// A request's hooks once started: each one optional.
#[derive(Default)]
pub struct Started {
    pub sampler: Option<Box<dyn ExternalSampler>>,
    pub stops: Vec<Box<dyn StopRule>>,
    pub tools: Option<Box<dyn TextParser<ToolOutput>>>,
    pub reasoning: Option<Box<dyn TextParser<ReasoningOutput>>>,
}

/// What a request brings along, made by whoever takes the request (the server, from the
/// plugins it selects) and started on the engine thread when the request starts.
pub trait RequestHooks: Send + Sync + std::fmt::Debug {
    /// Starts them for this request: the sampler has seen the whole `prompt`; `seed` is the
    /// request's, `vocab` the model's vocabulary size. A failure is the request's: `Refused`
    /// (its settings), `Fault` (a plugin), or another error.
    fn start(&self, prompt: &[u32], seed: u64, vocab: usize) -> Result<Started>;
}

/// A plugin said no to its config or params: the request's fault (a 400), not the plugin's.
#[derive(Debug)]
pub struct PluginRefused(pub String);

impl std::fmt::Display for PluginRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PluginRefused {}

/// A plugin failed while serving a request (trap, deadline, memory, bad result): the error
/// names the plugin and the entry point, and fails only that request.
#[derive(Debug)]
pub struct PluginFault(pub String);

impl std::fmt::Display for PluginFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PluginFault {}
