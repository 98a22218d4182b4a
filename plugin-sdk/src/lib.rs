//! The Rust SDK for `host` plugins (ABI v1, see `ABI.md` next to this crate).
//!
//! Implement [`Sampler`], [`StopRule`], [`ToolAdapter`], [`ReasoningParser`], [`Scheduler`] or [`Constraint`] on a type with
//! `Default`, then register it once:
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
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

/// What a tool adapter reports while it parses the model's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Plain text for the user.
    Content(String),
    /// A tool call starts: its index (0, 1, ... in this response), id and function name.
    Call { index: usize, id: String, name: String },
    /// More of call `index`'s JSON arguments string.
    Args { index: usize, delta: String },
}

impl ToolEvent {
    /// The event as one line of the ABI's JSON event stream.
    pub fn to_json(&self) -> String {
        match self {
            ToolEvent::Content(text) => format!("{{\"content\":{}}}", json_string(text)),
            ToolEvent::Call { index, id, name } => format!(
                "{{\"tool_call\":{{\"index\":{index},\"id\":{},\"name\":{}}}}}",
                json_string(id),
                json_string(name)
            ),
            ToolEvent::Args { index, delta } => {
                format!("{{\"tool_call_args\":{{\"index\":{index},\"delta\":{}}}}}", json_string(delta))
            }
        }
    }
}

/// A tool-call adapter: a streaming parser over the model's output text that separates
/// content from tool calls. One instance serves one request.
pub trait ToolAdapter: Default {
    fn init(&mut self, _config: &str) -> Result<(), String> {
        Ok(())
    }
    /// Params are `{"tools": [...]}`: the request's tool definitions (OpenAI shape).
    fn begin(&mut self, _params: &str, _seed: u64) -> Result<(), String> {
        Ok(())
    }
    /// Consumes the next piece of output text, pushing events to `out`.
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>);
    /// End of output: flush whatever is still held.
    fn finish(&mut self, out: &mut Vec<ToolEvent>);
    /// Renders tool definitions (a JSON array, OpenAI shape) as system-prompt text, for
    /// models whose chat template ignores `tools`; `None` leaves it to the host.
    fn render(&mut self, _tools: &str) -> Option<String> {
        None
    }
    /// The text that opens a call in this adapter's format, for a request that forces one
    /// (`tool_choice`): a call to `name`, or to any tool when `name` is empty. The host puts
    /// it at the start of the model's reply and feeds it to the adapter before the output.
    /// `None`: this adapter cannot force calls.
    fn force(&mut self, _name: &str) -> Option<String> {
        None
    }
    /// An assistant turn's earlier calls (a JSON array of `{"name", "arguments"}`, arguments
    /// an object) as the model writes them, for templates that ignore tools: the host writes
    /// the text into that turn. `None` leaves it to the host (the Hermes form).
    fn render_calls(&mut self, _calls: &str) -> Option<String> {
        None
    }
    /// A grammar (Lark, in llguidance's dialect) for the rest of a forced call: what the model
    /// writes after [`force`](Self::force)'s opener to the end of its reply. `request` is JSON
    /// `{"name": "f" or "", "tools": [...]}`. The host holds the output to it, so the call
    /// always parses and its arguments match the tool's schema. `None`: not constrained.
    /// With `"lazy": true` in the request: the grammar of a call the model starts on its own,
    /// from just after [`trigger`](Self::trigger)'s text to the call's end.
    fn grammar(&mut self, _request: &str) -> Option<String> {
        None
    }
    /// The text that opens a call the model writes on its own (e.g. `<tool_call>`): once the
    /// output holds it, the host holds the rest of the call to the lazy
    /// [`grammar`](Self::grammar) until it is complete. `None`: such calls are not constrained.
    fn trigger(&mut self) -> Option<String> {
        None
    }
}

/// What a reasoning parser reports: the model's output split into its thinking and the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningEvent {
    /// Text of the answer (it goes on to the tool adapter, if any, then to the user).
    Content(String),
    /// Text of the model's thinking.
    Reasoning(String),
}

impl ReasoningEvent {
    /// The event as one line of the ABI's JSON event stream.
    pub fn to_json(&self) -> String {
        match self {
            ReasoningEvent::Content(text) => format!("{{\"content\":{}}}", json_string(text)),
            ReasoningEvent::Reasoning(text) => format!("{{\"reasoning\":{}}}", json_string(text)),
        }
    }
}

/// A reasoning parser: a streaming parser over the model's output text that separates its
/// thinking from its answer. One instance serves one request.
pub trait ReasoningParser: Default {
    fn init(&mut self, _config: &str) -> Result<(), String> {
        Ok(())
    }
    /// Params are `{"prompt_tail": "..."}`: the end of the rendered prompt (a template may
    /// open the thinking itself, so the output starts inside it), merged into the request's.
    fn begin(&mut self, _params: &str, _seed: u64) -> Result<(), String> {
        Ok(())
    }
    /// Consumes the next piece of output text, pushing events to `out`.
    fn feed(&mut self, text: &str, out: &mut Vec<ReasoningEvent>);
    /// End of output: flush whatever is still held.
    fn finish(&mut self, out: &mut Vec<ReasoningEvent>);
}

/// A scheduling policy: one long-lived instance orders the server's queue.
pub trait Scheduler: Default {
    fn init(&mut self, _config: &str) -> Result<(), String> {
        Ok(())
    }
    /// Not called for schedulers (ABI.md §5.4); here so the export macro is uniform.
    fn begin(&mut self, _params: &str, _seed: u64) -> Result<(), String> {
        Ok(())
    }
    /// Given the queue as JSON (`{"now_ms", "running", "waiting"}`, see ABI.md), returns
    /// `{"order": [ids], "preempt": [ids], "cancel": [ids]}` as JSON.
    fn schedule(&mut self, queue: &str) -> String;
}

/// A scheduling policy that also sets the speculative rows' draft budgets (ABI.md §5.4, "Draft
/// budgets"); exported with `export_scheduler!(Type, MANIFEST, drafts)`.
pub trait DraftScheduler: Scheduler {
    /// Given the step's view as JSON (`{"rows": [{"id", "drafted", "survival", "rule"}],
    /// "batch_rows", "step_ms", "plain_step_ms"}`), returns `{"drafts": {id: budget},
    /// "default": budget}` as JSON (`{}` leaves every row to the host's rule).
    fn schedule_drafts(&mut self, view: &str) -> String;
}

/// What a [`Constraint`] allows next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowed {
    /// Any token.
    Anything,
    /// Only the end (an end-of-sequence token).
    End,
    /// The tokens whose bits [`Constraint::mask`] set.
    Tokens,
}

/// The model's vocabulary, as `constraint_vocab` receives it (ABI.md §5.6).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vocab {
    /// Every token id's bytes as the model writes them; a special token is its text after a
    /// `0xFF` byte; rows without a token are empty.
    pub tokens: Vec<Vec<u8>>,
    /// The end-of-sequence ids.
    pub eos: Vec<u32>,
}

impl Vocab {
    /// Reads the ABI's encoding (little-endian counts, ids and length-prefixed bytes).
    pub fn parse(raw: &[u8]) -> Result<Vocab, String> {
        let mut at = 0usize;
        let u32_at = |at: &mut usize| -> Result<u32, String> {
            let b = raw.get(*at..*at + 4).ok_or("the vocabulary is truncated")?;
            *at += 4;
            Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let n = u32_at(&mut at)? as usize;
        let e = u32_at(&mut at)? as usize;
        let eos = (0..e).map(|_| u32_at(&mut at)).collect::<Result<Vec<_>, _>>()?;
        let mut tokens = Vec::with_capacity(n.min(raw.len() / 4));
        for _ in 0..n {
            let len = u32_at(&mut at)? as usize;
            let bytes = raw.get(at..at + len).ok_or("the vocabulary is truncated")?;
            at += len;
            tokens.push(bytes.to_vec());
        }
        Ok(Vocab { tokens, eos })
    }
}

/// A constraint: which tokens may come next (ABI.md §5.6). One instance serves one request:
/// [`vocab`](Self::vocab) once, then [`begin`](Self::begin) with the request's spec, then a
/// mask per position, each allowed token accepted, drafts rolled back.
pub trait Constraint: Default {
    fn init(&mut self, _config: &str) -> Result<(), String> {
        Ok(())
    }
    /// The model's vocabulary, before the request begins.
    fn vocab(&mut self, vocab: Vocab) -> Result<(), String>;
    /// The request's params (the constraint's spec) and seed.
    fn begin(&mut self, _params: &str, _seed: u64) -> Result<(), String> {
        Ok(())
    }
    /// What may come next; for [`Allowed::Tokens`] set the allowed tokens' bits in `bits`
    /// (bit `t % 32` of word `t / 32`; it arrives zeroed). Depends only on the tokens
    /// accepted so far.
    fn mask(&mut self, bits: &mut [u32]) -> Result<Allowed, String>;
    /// `token` comes next.
    fn accept(&mut self, token: u32) -> Result<(), String>;
    /// Forget the last `n` accepted tokens.
    fn rollback(&mut self, n: usize) -> Result<(), String>;
}

/// `text` as a JSON string literal (quoted and escaped).
pub fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
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
    fn tool_events_are_json_lines() {
        let call = ToolEvent::Call { index: 1, id: "call_1".into(), name: "f".into() };
        assert_eq!(call.to_json(), r#"{"tool_call":{"index":1,"id":"call_1","name":"f"}}"#);
        let args = ToolEvent::Args { index: 0, delta: "{\"a\": \"x\\ny\"}".into() };
        assert_eq!(args.to_json(), r#"{"tool_call_args":{"index":0,"delta":"{\"a\": \"x\\ny\"}"}}"#);
        assert_eq!(ToolEvent::Content("\u{1}é\t".into()).to_json(), r#"{"content":"\u0001é\t"}"#);
    }

    #[test]
    fn a_vocabulary_reads_back_as_the_host_encodes_it() {
        let mut raw = Vec::new();
        for n in [3u32, 1, 2, 1] {
            raw.extend(n.to_le_bytes());
        }
        raw.extend(b"a");
        raw.extend(0u32.to_le_bytes());
        raw.extend(3u32.to_le_bytes());
        raw.extend(b"\xffxy");
        let vocab = Vocab::parse(&raw).unwrap();
        assert_eq!(vocab.eos, vec![2]);
        assert_eq!(vocab.tokens, vec![b"a".to_vec(), vec![], b"\xffxy".to_vec()]);
        assert!(Vocab::parse(&raw[..raw.len() - 1]).unwrap_err().contains("truncated"));
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
