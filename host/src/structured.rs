//! Structured output: a request's JSON schema, regex or grammar compiled by llguidance (the
//! constraint library vLLM, SGLang, llama.cpp and mistral.rs use) into a [`ConstraintSpec`],
//! which the engine applies to each of the request's steps as a token mask.
//!
//! llguidance works on token bytes: [`Grammars`] reads every token's bytes from the
//! tokenizer (byte-level BPE, or SentencePiece with byte fallback) into its token trie once,
//! on the first constrained request, and compiles each request's grammar against it when the
//! request arrives, so an unsupported schema is refused before anything is queued.

use crate::engine::constraint::ConstraintFailed;
use crate::engine::{Allowed, Constraint, ConstraintSpec};
use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use models::Tokenizer;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// What a request holds its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Structure {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema.
    JsonSchema(Value),
    /// Text the regex matches as a whole.
    Regex(String),
    /// A grammar: Lark in llguidance's dialect, or llama.cpp's GBNF (`name ::= ...` rules,
    /// `root` the start), which is rewritten to it.
    Grammar(String),
    /// The rest of a forced tool call: the tool adapter's Lark grammar (`tool_grammar`).
    ToolCall(String),
}

impl Structure {
    pub fn kind(&self) -> &'static str {
        match self {
            Structure::JsonObject => "json_object",
            Structure::JsonSchema(_) => "json_schema",
            Structure::Regex(_) => "regex",
            Structure::Grammar(_) => "grammar",
            Structure::ToolCall(_) => "tool_call",
        }
    }

    /// The request field it came from, for errors.
    pub fn param(&self) -> &'static str {
        match self {
            Structure::JsonObject | Structure::JsonSchema(_) => "response_format",
            Structure::Regex(_) => "regex",
            Structure::Grammar(_) => "grammar",
            Structure::ToolCall(_) => "tool_choice",
        }
    }
}

/// Why a structure did not compile.
#[derive(Debug)]
pub enum CompileError {
    /// The request's: what was wrong with it (for a 400).
    Invalid(String),
    /// The server's (its tokenizer could not be read into a token trie).
    Internal(anyhow::Error),
}

/// Compiles structures against one model's tokenizer.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    vocab: usize,
    eos: Vec<u32>,
    /// Every token's bytes (special tokens marked with a leading 0xFF), read once.
    words: OnceLock<std::result::Result<Arc<Vec<Vec<u8>>>, String>>,
    factory: OnceLock<std::result::Result<Arc<ParserFactory>, String>>,
    /// The vocabulary as constraint plugins receive it (ABI.md §5.6).
    plugin_vocab: OnceLock<Arc<Vec<u8>>>,
}

impl Grammars {
    /// For a model of `vocab` tokens (its embedding rows, which may outnumber the
    /// tokenizer's) whose end-of-sequence tokens are `eos`.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, eos: Vec<u32>) -> Grammars {
        Grammars {
            tokenizer,
            vocab,
            eos,
            words: OnceLock::new(),
            factory: OnceLock::new(),
            plugin_vocab: OnceLock::new(),
        }
    }

    /// Builds the token trie now (else the first `compile` does).
    pub fn prepare(&self) -> Result<()> {
        self.factory().map(|_| ())
    }

    /// Compiles `structure` (the first call also builds the token trie).
    pub fn compile(&self, structure: &Structure) -> std::result::Result<ConstraintSpec, CompileError> {
        let factory = self.factory().map_err(CompileError::Internal)?;
        let started = Instant::now();
        let grammar = match structure {
            Structure::JsonObject => TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))),
            Structure::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(CompileError::Invalid("the JSON schema must be an object".into()));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Structure::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Structure::Grammar(g) => TopLevelGrammar::from_lark(lark(g)),
            Structure::ToolCall(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = guarded(|| factory.create_parser(grammar)).map_err(|e| CompileError::Invalid(brief(&e)))?;
        // The first mask, here: a structure too complex for llguidance's limits (its lexer's
        // expression count, its fuel per step) is refused now rather than failing the
        // request once it runs.
        let mut first = Matcher::new(Ok(parser.deep_clone()));
        if let Err(e) = guarded(|| first.compute_mask()) {
            return Err(CompileError::Invalid(format!(
                "the {} is too complex to apply: {}",
                structure.kind(),
                brief(&e)
            )));
        }
        tracing::debug!(kind = structure.kind(), ms = started.elapsed().as_secs_f64() * 1e3, "compiled a constraint");
        let parser = Mutex::new(parser);
        let param = structure.param();
        Ok(ConstraintSpec::new(structure.kind(), move |_| {
            let parser = parser.lock().map_err(|_| anyhow!("a constraint's parser was poisoned"))?.deep_clone();
            Ok(Box::new(Llg { matcher: Matcher::new(Ok(parser)), param, position: 0 }) as Box<dyn Constraint>)
        }))
    }

    /// Calls the model starts on its own, held to a tool adapter's lazy grammar: the output
    /// is free until it holds `trigger` (`tool_trigger`), then `grammar` (`tool_grammar` with
    /// `"lazy": true`) holds it from just after the trigger until the call is complete, and
    /// then it is free again ([`Lazy`]).
    pub fn compile_lazy(&self, trigger: &str, grammar: &str) -> std::result::Result<ConstraintSpec, CompileError> {
        if trigger.is_empty() {
            return Err(CompileError::Invalid("a tool adapter's trigger is empty".into()));
        }
        let env = self.factory().map_err(CompileError::Internal)?.tok_env().clone();
        let spec = Arc::new(LazySpec {
            trigger: trigger.as_bytes().to_vec(),
            words: self.words().map_err(CompileError::Internal)?,
            eos: self.eos.clone(),
            call: self.compile(&Structure::ToolCall(grammar.to_string()))?,
            tokenize: Arc::new(move |bytes: &[u8]| env.tokenize_bytes(bytes)),
        });
        Ok(ConstraintSpec::new("tool_call_lazy", move |seed| {
            Ok(Box::new(Lazy::new(spec.clone(), seed)) as Box<dyn Constraint>)
        }))
    }

    /// The model's vocabulary for a constraint plugin's `constraint_vocab` (built once).
    pub fn plugin_vocab(&self) -> Result<Arc<Vec<u8>>> {
        let words = self.words()?;
        Ok(self
            .plugin_vocab
            .get_or_init(|| Arc::new(crate::plugins::adapters::encode_vocab(&words, &self.eos)))
            .clone())
    }

    /// Every token's bytes, `vocab` of them (rows past the tokenizer's are empty).
    fn words(&self) -> Result<Arc<Vec<Vec<u8>>>> {
        let read = self.words.get_or_init(|| {
            guarded(|| {
                let json: Value =
                    serde_json::from_str(&self.tokenizer.to_json()?).context("reading the tokenizer's JSON")?;
                let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
                words.resize(self.vocab, Vec::new());
                Ok(Arc::new(words))
            })
            .map_err(|e| format!("{e:#}"))
        });
        read.clone().map_err(|e| anyhow!("this model's token bytes could not be read: {e}"))
    }

    fn factory(&self) -> Result<Arc<ParserFactory>> {
        let built = self.factory.get_or_init(|| {
            let started = Instant::now();
            let factory = self
                .words()
                .and_then(|words| guarded(|| build_factory(&self.tokenizer, &words, &self.eos)))
                .map_err(|e| format!("{e:#}"));
            tracing::info!(ms = started.elapsed().as_secs_f64() * 1e3, "built the token trie for structured output");
            factory.map(Arc::new)
        });
        built.clone().map_err(|e| anyhow!("structured output is unavailable for this model's tokenizer: {e}"))
    }
}

/// An llguidance error's first line (its verbose errors append the parser's state dump).
fn brief(e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    text.lines().next().unwrap_or_default().trim().to_string()
}

/// Runs `f`, turning a panic inside llguidance into an error.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let why = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            bail!("llguidance failed: {}", why.unwrap_or_else(|| "a panic".into()))
        }
    }
}

/// The token trie (every token's bytes; special tokens marked, so text never matches them)
/// and llguidance's parser factory over it.
fn build_factory(tokenizer: &Arc<Tokenizer>, words: &[Vec<u8>], eos: &[u32]) -> Result<ParserFactory> {
    let Some(&first) = eos.first() else { bail!("the model has no end-of-sequence token to end a constrained output") };
    let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, first), words).with_eos_tokens(eos);
    let env: TokEnv = Arc::new(Env { trie, tokenizer: tokenizer.clone() });
    let mut factory = ParserFactory::new_simple(&env)?;
    factory.quiet();
    Ok(factory)
}

struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        std::str::from_utf8(s)
            .ok()
            .and_then(|text| self.tokenizer.encode(text, false).ok())
            .unwrap_or_else(|| self.trie.greedy_tokenize(s))
    }
}

/// JSON written compactly (`{"a": 1, "b": [2, 3]}`): no free whitespace, which small models
/// otherwise spend their tokens on. A schema's own `x-guidance` options win.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert(json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// A schema under OpenAI's `strict: true`: objects that do not say otherwise take no
/// properties beyond theirs (`additionalProperties: false`, which OpenAI's strict mode
/// requires of every object and JSON Schema leaves open), so a model cannot wander into
/// keys of its own. Walks the keywords that hold subschemas.
pub fn strict(mut schema: Value) -> Value {
    close_objects(&mut schema, true);
    schema
}

/// A tool's arguments schema as its calls are held to it: objects that name properties take
/// no others unless they say otherwise (as [`strict`]); an object that names none (`{"type":
/// "object"}`, free-form arguments) stays open.
pub fn closed(mut schema: Value) -> Value {
    close_objects(&mut schema, false);
    schema
}

/// Closes the objects under `node` that do not set `additionalProperties` or
/// `patternProperties`: every object when `all`, else those with properties.
fn close_objects(node: &mut Value, all: bool) {
    let Some(o) = node.as_object_mut() else { return };
    let object = match all {
        true => {
            o.get("type").is_some_and(|t| t == "object" || t.as_array().is_some_and(|a| a.contains(&json!("object"))))
                || o.contains_key("properties")
        }
        false => o.get("properties").and_then(Value::as_object).is_some_and(|p| !p.is_empty()),
    };
    let close = |v: &mut Value| close_objects(v, all);
    if object && !o.contains_key("additionalProperties") && !o.contains_key("patternProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (key, value) in o.iter_mut() {
        match key.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" => {
                if let Some(m) = value.as_object_mut() {
                    m.values_mut().for_each(close);
                }
            }
            "items" | "additionalProperties" | "additionalItems" | "not" | "if" | "then" | "else" => {
                if let Some(a) = value.as_array_mut() {
                    a.iter_mut().for_each(close);
                } else {
                    close(value);
                }
            }
            "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                if let Some(a) = value.as_array_mut() {
                    a.iter_mut().for_each(close);
                }
            }
            _ => {}
        }
    }
}

/// A GBNF grammar (`name ::= ...`) as Lark (`name: ...`, `root` the start); Lark as it is.
fn lark(grammar: &str) -> String {
    if !grammar.contains("::=") {
        return grammar.to_string();
    }
    let mut out = String::from("start: root\n");
    for line in grammar.lines() {
        out.push_str(&line.replacen("::=", ":", 1));
        out.push('\n');
    }
    out
}

/// llguidance's matcher as an engine constraint.
struct Llg {
    matcher: Matcher,
    /// The request field the structure came from, for errors.
    param: &'static str,
    /// Output tokens accepted so far.
    position: usize,
}

impl Constraint for Llg {
    fn allowed(&mut self) -> Result<Allowed> {
        if self.matcher.is_stopped() {
            return Ok(Allowed::End);
        }
        let mask = self.matcher.compute_mask().map_err(|e| {
            // Past llguidance's limits here, though not at the first position (checked at
            // compile): what the request asked for is too much for it.
            anyhow::Error::new(ConstraintFailed {
                param: self.param,
                message: format!(
                    "the {} constraint cannot go on at output position {}: {}; simplify it (fewer nested or repeated patterns, alternatives and optional parts)",
                    self.param,
                    self.position,
                    brief(&e)
                ),
            })
        })?;
        Ok(Allowed::Tokens(mask.as_slice().to_vec()))
    }

    fn accept(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(|e| anyhow!(brief(&e)))?;
        self.position += 1;
        Ok(())
    }

    fn rollback(&mut self, tokens: usize) -> Result<()> {
        self.matcher.rollback(tokens).map_err(|e| anyhow!(brief(&e)))?;
        self.position = self.position.saturating_sub(tokens);
        Ok(())
    }
}

/// Text as tokens of the model's vocabulary.
pub type Tokenize = Arc<dyn Fn(&[u8]) -> Vec<u32> + Send + Sync>;

/// The most tokens a [`Lazy`] constraint can roll back (speculation drafts at most 64).
const LAZY_ROLLBACK: usize = 256;

/// A lazy grammar: anything goes until the output holds the trigger; from just after it,
/// the call's grammar holds every token until it is complete (it allows only the end of
/// sequence), and then anything goes again, until the next trigger. Where the trigger ends
/// inside a token, the token's remaining bytes go to the call's grammar as tokens of their
/// own; if they do not fit it, that call goes unconstrained (the model opened it in a way
/// the grammar does not expect).
pub struct Lazy {
    spec: Arc<LazySpec>,
    seed: u64,
    /// The last bytes of free text, fewer than the trigger's: a trigger may be starting there.
    tail: Vec<u8>,
    /// The call being held (`active`), or the last one, complete.
    current: Option<Box<dyn Constraint>>,
    active: bool,
    /// What each accepted token changed, to roll it back.
    journal: std::collections::VecDeque<Undo>,
}

/// What a [`Lazy`] constraint's requests share, made once per compile.
pub struct LazySpec {
    pub trigger: Vec<u8>,
    /// Every token's bytes (special tokens with their 0xFF mark).
    pub words: Arc<Vec<Vec<u8>>>,
    pub eos: Vec<u32>,
    /// The call's grammar, from just after the trigger.
    pub call: ConstraintSpec,
    pub tokenize: Tokenize,
}

/// The state before an accepted token.
struct Undo {
    tail: Vec<u8>,
    active: bool,
    /// Tokens the current call accepted for it.
    fed: usize,
    /// The call it started replaced this one.
    replaced: Option<Option<Box<dyn Constraint>>>,
}

impl Lazy {
    pub fn new(spec: Arc<LazySpec>, seed: u64) -> Lazy {
        Lazy { spec, seed, tail: Vec::new(), current: None, active: false, journal: Default::default() }
    }

    /// Starts a call whose output so far (after the trigger) is `opened`; `None` when those
    /// bytes do not fit its grammar.
    fn open(&self, opened: &[u8]) -> Result<Option<Box<dyn Constraint>>> {
        let mut call = self.spec.call.start(self.seed)?;
        for t in (self.spec.tokenize)(opened) {
            let fits = call.allowed()?.permits(t, &[]) && call.accept(t).is_ok();
            if !fits {
                tracing::debug!(opened = %String::from_utf8_lossy(opened), "a tool call opened off its grammar goes unconstrained");
                return Ok(None);
            }
        }
        Ok(Some(call))
    }
}

impl Constraint for Lazy {
    fn allowed(&mut self) -> Result<Allowed> {
        if !self.active {
            return Ok(Allowed::Anything);
        }
        let call = self.current.as_mut().expect("an active call");
        let allowed = call.allowed()?;
        let complete = match &allowed {
            Allowed::End => true,
            Allowed::Tokens(bits) => bits.iter().enumerate().filter(|(_, &word)| word != 0).all(|(w, &word)| {
                let mut word = word;
                while word != 0 {
                    if !self.spec.eos.contains(&(w as u32 * 32 + word.trailing_zeros())) {
                        return false;
                    }
                    word &= word - 1;
                }
                true
            }),
            Allowed::Anything => false,
        };
        if complete {
            // The call is written: free text again (the state the accepted tokens lead to,
            // so a rollback need not undo it).
            self.active = false;
            self.tail.clear();
            return Ok(Allowed::Anything);
        }
        Ok(allowed)
    }

    fn accept(&mut self, token: u32) -> Result<()> {
        let mut undo = Undo { tail: self.tail.clone(), active: self.active, fed: 0, replaced: None };
        if self.active {
            self.current.as_mut().expect("an active call").accept(token)?;
            undo.fed = 1;
        } else {
            let word = self.spec.words.get(token as usize).map_or(&[][..], Vec::as_slice);
            let word = word.strip_prefix(&[0xFF]).unwrap_or(word);
            let mut text = std::mem::take(&mut self.tail);
            text.extend_from_slice(word);
            let found = text.windows(self.spec.trigger.len()).position(|w| w == self.spec.trigger.as_slice());
            match found {
                Some(at) => {
                    if let Some(call) = self.open(&text[at + self.spec.trigger.len()..])? {
                        undo.replaced = Some(self.current.replace(call));
                        self.active = true;
                    }
                }
                None => {
                    let keep = text.len().min(self.spec.trigger.len() - 1);
                    self.tail = text[text.len() - keep..].to_vec();
                }
            }
        }
        if self.journal.len() == LAZY_ROLLBACK {
            self.journal.pop_front();
        }
        self.journal.push_back(undo);
        Ok(())
    }

    fn rollback(&mut self, tokens: usize) -> Result<()> {
        if tokens > self.journal.len() {
            bail!("cannot roll back {tokens} tokens; at most {} are kept", self.journal.len());
        }
        for _ in 0..tokens {
            let undo = self.journal.pop_back().expect("checked above");
            match undo.replaced {
                Some(previous) => self.current = previous,
                None if undo.fed > 0 => self.current.as_mut().expect("the call fed").rollback(undo.fed)?,
                None => {}
            }
            self.active = undo.active;
            self.tail = undo.tail;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_closes_every_object_that_does_not_say_otherwise() {
        let schema = json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"b": {"type": "string"}}},
                "open": {"type": "object", "additionalProperties": true},
                "list": {"type": "array", "items": {"properties": {"c": {"type": "integer"}}}},
                "either": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                "properties": {"type": "string"}
            },
            "$defs": {"d": {"type": ["object", "null"]}}
        });
        let s = strict(schema);
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["a"]["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["open"]["additionalProperties"], json!(true));
        assert_eq!(s["properties"]["list"]["items"]["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["either"]["anyOf"][0]["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["either"]["anyOf"][1].get("additionalProperties"), None);
        assert_eq!(s["$defs"]["d"]["additionalProperties"], json!(false));
        // A property named "properties" is a property, not a keyword.
        assert_eq!(s["properties"]["properties"], json!({"type": "string"}));
        assert_eq!(s["properties"].get("additionalProperties"), None);
    }

    #[test]
    fn a_tools_arguments_close_the_objects_that_name_properties_and_leave_free_form_ones_open() {
        let schema = json!({"type": "object", "properties": {
            "opts": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "extra": {"type": "object"},
            "open": {"type": "object", "properties": {"b": {}}, "additionalProperties": true}}});
        let c = closed(schema.clone());
        assert_eq!(c["additionalProperties"], json!(false));
        assert_eq!(c["properties"]["opts"]["additionalProperties"], json!(false));
        assert_eq!(c["properties"]["extra"].get("additionalProperties"), None, "free-form stays free");
        assert_eq!(c["properties"]["open"]["additionalProperties"], json!(true));
        assert_eq!(closed(json!({"type": "object"})), json!({"type": "object"}));
        assert_eq!(strict(schema)["properties"]["extra"]["additionalProperties"], json!(false));
    }

    /// A lazy grammar over a vocabulary of a few words, trigger `<tool>`, whose call must
    /// be `{`, then `x` or `y`, then `}`.
    fn lazy() -> Lazy {
        let mut words: Vec<Vec<u8>> = ["a", "<t", "ool>", "<tool>{", "x", "y", "}", "", "{", "<tool>x"]
            .iter()
            .map(|w| w.as_bytes().to_vec())
            .collect();
        words[7] = b"\xFF<tool>".to_vec(); // a special token: the 0xFF mark, then its text
        let words = Arc::new(words);
        let vocab = words.clone();
        // Longest match first.
        let tokenize: Tokenize = Arc::new(move |mut bytes: &[u8]| {
            let mut out = Vec::new();
            while !bytes.is_empty() {
                let (t, w) = vocab
                    .iter()
                    .enumerate()
                    .filter(|(_, w)| bytes.starts_with(w))
                    .max_by_key(|(_, w)| w.len())
                    .unwrap();
                out.push(t as u32);
                bytes = &bytes[w.len()..];
            }
            out
        });
        let call = crate::engine::constraint::tests::script(vec![vec![8], vec![4, 5], vec![6]], 10);
        Lazy::new(Arc::new(LazySpec { trigger: b"<tool>".to_vec(), words, eos: Vec::new(), call, tokenize }), 0)
    }

    fn open_tokens(a: Allowed) -> Vec<u32> {
        match a {
            Allowed::Tokens(bits) => {
                (0..320).filter(|&t| bits.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)).collect()
            }
            other => panic!("not a token set: {other:?}"),
        }
    }

    #[test]
    fn a_lazy_grammar_holds_only_the_calls_its_trigger_opens() {
        let mut l = lazy();
        // Free text, then a trigger split over two tokens.
        for t in [0, 1, 2] {
            assert_eq!(l.allowed().unwrap(), Allowed::Anything);
            l.accept(t).unwrap();
        }
        assert_eq!(open_tokens(l.allowed().unwrap()), vec![8]);
        l.accept(8).unwrap();
        assert_eq!(open_tokens(l.allowed().unwrap()), vec![4, 5]);
        l.accept(4).unwrap();
        l.accept(6).unwrap();
        // Complete: free again, and a trigger that ends inside a token feeds the rest of it
        // ("{") to the next call.
        assert_eq!(l.allowed().unwrap(), Allowed::Anything);
        l.accept(0).unwrap();
        l.accept(3).unwrap();
        assert_eq!(open_tokens(l.allowed().unwrap()), vec![4, 5]);
        // Rolled back over the second call's start and the free token: free; then back into
        // the first call, at its second position.
        l.rollback(2).unwrap();
        assert_eq!(l.allowed().unwrap(), Allowed::Anything);
        l.rollback(2).unwrap();
        assert_eq!(open_tokens(l.allowed().unwrap()), vec![4, 5]);
        l.rollback(1).unwrap();
        assert_eq!(open_tokens(l.allowed().unwrap()), vec![8]);
        l.rollback(1).unwrap();
        assert_eq!(l.allowed().unwrap(), Allowed::Anything, "before the trigger's last token");
        l.accept(2).unwrap();
        assert_eq!(open_tokens(l.allowed().unwrap()), vec![8], "the trigger's start was kept");
        assert!(l.rollback(9).is_err());
    }

    #[test]
    fn a_call_opened_off_its_grammar_is_left_unconstrained() {
        let mut l = lazy();
        l.accept(9).unwrap(); // "<tool>x": the call must start with "{"
        assert_eq!(l.allowed().unwrap(), Allowed::Anything);
        // A special token whose text is the trigger opens a call.
        l.accept(0).unwrap();
        l.accept(7).unwrap();
        assert_eq!(open_tokens(l.allowed().unwrap()), vec![8]);
        l.accept(8).unwrap();
        assert_eq!(open_tokens(l.allowed().unwrap()), vec![4, 5]);
    }

    /// A structure that first exceeds llguidance's limits past its first position fails its
    /// request as the client's (a `ConstraintFailed` naming the field and the position).
    #[test]
    fn a_constraint_past_llguidances_limits_later_fails_as_the_requests_fault() {
        struct Bytes(TokTrie);
        impl TokenizerEnv for Bytes {
            fn tok_trie(&self) -> &TokTrie {
                &self.0
            }
            fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
                s.iter().map(|&b| b as u32).collect()
            }
        }
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(b"\xff<end>".to_vec());
        let env: TokEnv = Arc::new(Bytes(TokTrie::from(&TokRxInfo::new(257, 256), &words)));
        let mut factory = ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        // Lexer fuel enough for the first masks, not for the regex once it is open.
        factory.limits_mut().step_lexer_fuel = 100;
        let g = TopLevelGrammar::from_lark("start: \"ab\" /[a-z]{1,8}[0-9]{5}/".to_string());
        let mut llg = Llg { matcher: Matcher::new(factory.create_parser(g)), param: "regex", position: 0 };
        let mut failure = None;
        for &b in b"abcdefg12345" {
            match llg.allowed() {
                Ok(_) => llg.accept(b as u32).unwrap(),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let e = failure.expect("the regex exceeds the lexer's fuel once open");
        let failed = e.downcast_ref::<ConstraintFailed>().expect("a ConstraintFailed");
        assert_eq!(failed.param, "regex");
        assert!(
            failed.message.contains("output position 3") && failed.message.contains("simplify"),
            "{}",
            failed.message
        );
    }

    #[test]
    fn gbnf_rules_become_lark_and_lark_stays_as_it_is() {
        assert_eq!(lark("start: \"a\"\n"), "start: \"a\"\n");
        assert_eq!(lark("root ::= \"a\" | b\nb ::= \"c\""), "start: root\nroot : \"a\" | b\nb : \"c\"\n");
    }
}
