//! Built-in constraint plugin: llguidance — the JSON-schema, regex and Lark engine behind
//! `response_format`, `regex` and `grammar` — compiled to Wasm and run in the sandbox like a
//! user's constraint (ABI.md §5.6). The server's own structured output runs the same crate
//! natively (host/src/structured.rs); this plugin is that engine behind the plugin interface,
//! selectable as `"plugins": {"constraint": {"name": "guidance", "params": {...}}}` and
//! measured against the native one (bench/RESULTS.md).
//!
//! Params, one of: `{"json_schema": {...}}`, `{"json_object": true}`, `{"regex": "..."}`,
//! `{"lark": "..."}` (llguidance's Lark dialect).

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use plugin_sdk::{Allowed, Constraint, Vocab};
use serde_json::{json, Value};
use std::sync::Arc;

/// One request's constraint: the parser factory over the model's vocabulary (built in
/// `vocab`), then the request's matcher (built in `begin`).
#[derive(Default)]
pub struct Guidance {
    factory: Option<ParserFactory>,
    matcher: Option<Matcher>,
}

/// The token trie: text is tokenized greedily over it (the plugin has no tokenizer; llguidance
/// only tokenizes the bytes a grammar forces).
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }
}

/// An llguidance error's first line (its verbose errors append the parser's state).
fn brief(e: impl std::fmt::Display) -> String {
    format!("{e:#}").lines().next().unwrap_or_default().trim().to_string()
}

/// The grammar a request's params ask for. JSON is written compactly unless the schema's
/// own `x-guidance` says otherwise (as the native path does).
pub fn grammar(params: &str) -> Result<TopLevelGrammar, String> {
    let params: Value = serde_json::from_str(params).map_err(|e| format!("params are not JSON: {e}"))?;
    let compact = |mut schema: Value| {
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance")
                .or_insert(json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
        }
        schema
    };
    if let Some(schema) = params.get("json_schema") {
        if !schema.is_object() && !schema.is_boolean() {
            return Err("params.json_schema must be a JSON schema (an object)".into());
        }
        return Ok(TopLevelGrammar::from_json_schema(compact(schema.clone())));
    }
    if params.get("json_object").is_some_and(|v| v == &Value::Bool(true)) {
        return Ok(TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))));
    }
    if let Some(rx) = params.get("regex") {
        return rx.as_str().map(TopLevelGrammar::from_regex).ok_or_else(|| "params.regex must be a string".into());
    }
    if let Some(lark) = params.get("lark") {
        return lark
            .as_str()
            .map(|g| TopLevelGrammar::from_lark(g.to_string()))
            .ok_or_else(|| "params.lark must be a string".into());
    }
    Err("params need one of json_schema (a schema), json_object (true), regex or lark (strings)".into())
}

impl Constraint for Guidance {
    fn vocab(&mut self, vocab: Vocab) -> Result<(), String> {
        let first = *vocab.eos.first().ok_or("the model has no end-of-sequence token to end a constrained output")?;
        let info = TokRxInfo::new(vocab.tokens.len() as u32, first);
        let trie = TokTrie::from(&info, &vocab.tokens).with_eos_tokens(&vocab.eos);
        let env: TokEnv = Arc::new(Env { trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(brief)?;
        factory.quiet();
        self.factory = Some(factory);
        Ok(())
    }

    fn begin(&mut self, params: &str, _seed: u64) -> Result<(), String> {
        let factory = self.factory.as_ref().ok_or("begin before the vocabulary")?;
        let parser = factory.create_parser(grammar(params)?).map_err(brief)?;
        self.matcher = Some(Matcher::new(Ok(parser)));
        Ok(())
    }

    fn mask(&mut self, bits: &mut [u32]) -> Result<Allowed, String> {
        let matcher = self.matcher.as_mut().ok_or("mask before begin")?;
        if matcher.is_stopped() {
            return Ok(Allowed::End);
        }
        let mask = matcher.compute_mask().map_err(brief)?;
        let words = mask.as_slice();
        let n = words.len().min(bits.len());
        bits[..n].copy_from_slice(&words[..n]);
        Ok(Allowed::Tokens)
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        self.matcher.as_mut().ok_or("accept before begin")?.consume_token(token).map_err(brief)
    }

    fn rollback(&mut self, n: usize) -> Result<(), String> {
        self.matcher.as_mut().ok_or("rollback before begin")?.rollback(n).map_err(brief)
    }
}

plugin_sdk::export_constraint!(
    Guidance,
    r#"{"abi": 1, "name": "guidance", "version": "0.1.0", "kinds": ["constraint"], "description": "llguidance in Wasm: params {\"json_schema\": ...} | {\"json_object\": true} | {\"regex\": ...} | {\"lark\": ...}"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary: token `b` is byte `b`, 256 the end.
    fn bytes() -> Vocab {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.push(b"\xff<end>".to_vec());
        Vocab { tokens, eos: vec![256] }
    }

    fn allowed(bits: &[u32], t: u32) -> bool {
        bits[t as usize / 32] >> (t % 32) & 1 == 1
    }

    #[test]
    fn a_json_schema_allows_only_what_it_matches_and_rolls_back() {
        let mut g = Guidance::default();
        g.vocab(bytes()).unwrap();
        g.begin(r#"{"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}}"#, 1).unwrap();
        let mut bits = vec![0u32; 257usize.div_ceil(32)];
        for &b in br#"{"n": 4"# {
            bits.fill(0);
            assert_eq!(g.mask(&mut bits), Ok(Allowed::Tokens));
            assert!(allowed(&bits, b as u32), "{}", b as char);
            g.accept(b as u32).unwrap();
        }
        bits.fill(0);
        g.mask(&mut bits).unwrap();
        assert!(allowed(&bits, b'2' as u32) && allowed(&bits, b'}' as u32) && !allowed(&bits, b'"' as u32));
        assert!(!allowed(&bits, 256), "the object is not closed yet");
        g.accept(b'}' as u32).unwrap();
        assert!(matches!(g.mask(&mut bits), Ok(Allowed::End) | Ok(Allowed::Tokens)));
        g.rollback(2).unwrap();
        bits.fill(0);
        g.mask(&mut bits).unwrap();
        assert!(allowed(&bits, b'4' as u32) && !allowed(&bits, b'x' as u32));
        assert!(g.accept(b'x' as u32).is_err());
    }

    #[test]
    fn params_name_what_they_lack() {
        let mut g = Guidance::default();
        assert!(g.begin(r#"{"regex": "a+"}"#, 1).unwrap_err().contains("vocabulary"));
        g.vocab(bytes()).unwrap();
        assert!(g.begin("{}", 1).unwrap_err().contains("json_schema"));
        assert!(g.begin(r#"{"regex": 3}"#, 1).unwrap_err().contains("regex must be a string"));
        assert!(g.begin(r#"{"lark": "start: ("}"#, 1).is_err());
        g.begin(r#"{"regex": "ab"}"#, 1).unwrap();
        let mut bits = vec![0u32; 9];
        g.mask(&mut bits).unwrap();
        assert!(allowed(&bits, b'a' as u32) && !allowed(&bits, b'b' as u32));
    }
}
