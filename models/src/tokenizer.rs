//! Tokenization (`tokenizers`), chat templates (minijinja with Hugging Face's semantics) and
//! incremental detokenization that never emits a broken UTF-8 sequence.

use crate::{Error, Result};
use minijinja::{Environment, Value as JinjaValue};
use serde_json::Value;
use std::path::Path;

/// A tokenizer with its chat template and special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// `tokenizer_config.json` token fields are either a string or `{"content": ...}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// From `tokenizer.json` and (optionally) `tokenizer_config.json` in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| Error::Config { path: config_path.clone(), message: e.to_string() })?,
            Err(_) => Value::Null,
        };
        // Newer checkpoints keep the template in its own file.
        let mut config = config;
        let jinja = dir.join("chat_template.jinja");
        if config.get("chat_template").is_none() {
            if let Ok(t) = std::fs::read_to_string(&jinja) {
                config = match config {
                    Value::Object(mut o) => {
                        o.insert("chat_template".into(), Value::String(t));
                        Value::Object(o)
                    }
                    _ => serde_json::json!({ "chat_template": t }),
                };
            }
        }
        Self::from_parts(&bytes, &config).map_err(|e| match e {
            Error::Tokenizer(m) => Error::Tokenizer(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// From `tokenizer.json` bytes and a `tokenizer_config.json` value.
    pub fn from_parts(tokenizer_json: &[u8], config: &Value) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let chat_template = match config.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            // A list of named templates: use "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            _ => None,
        };
        Ok(Tokenizer {
            inner,
            chat_template,
            bos_token: token_string(config.get("bos_token")),
            eos_token: token_string(config.get("eos_token")),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The tokenizer as `tokenizer.json` text (what reads each token's bytes works from it).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Every token string (added tokens included) with its id.
    pub fn vocabulary(&self) -> std::collections::HashMap<String, u32> {
        self.inner.get_vocab(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The id of `tokenizer_config.json`'s `eos_token`, if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The chat template's source, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Encodes text; `add_special_tokens` applies the tokenizer's post-processor (BOS etc.).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes raw bytes, refusing input that is not UTF-8 with the offending offset.
    pub fn encode_bytes(&self, bytes: &[u8], add_special_tokens: bool) -> Result<Vec<u32>> {
        let text = std::str::from_utf8(bytes).map_err(|e| {
            Error::Invalid(format!(
                "prompt is not valid UTF-8 (invalid byte at offset {}); send UTF-8 text",
                e.valid_up_to()
            ))
        })?;
        self.encode(text, add_special_tokens)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Renders the chat template as transformers does: `messages`, `tools` (if any),
    /// `add_generation_prompt`, `bos_token`, `eos_token`, plus `extra` keys
    /// (`chat_template_kwargs`).
    pub fn apply_chat_template(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: Option<&Value>,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            Error::Template(
                "this model has no chat template (a base model): send plain text instead, to /v1/completions or to `host generate --raw`".into(),
            )
        })?;
        let env = template_env();
        let tmpl = env.template_from_str(template).map_err(|e| Error::Template(format!("{e:#}")))?;
        let mut ctx = serde_json::Map::new();
        if let Some(Value::Object(kw)) = extra {
            ctx.extend(kw.clone());
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), Value::Bool(add_generation_prompt));
        ctx.insert("bos_token".into(), self.bos_token.clone().map_or(Value::Null, Value::String));
        ctx.insert("eos_token".into(), self.eos_token.clone().map_or(Value::Null, Value::String));
        if let Some(tools) = tools {
            ctx.insert("tools".into(), tools.clone());
        }
        tmpl.render(JinjaValue::from_serialize(&ctx)).map_err(|e| Error::Template(format!("{e:#}")))
    }

    /// Renders the template for `messages` and tokenizes the result without adding special
    /// tokens again (the template already has them), as `apply_chat_template(tokenize=True)`.
    pub fn encode_chat(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, tools, add_generation_prompt, None)?;
        self.encode(&text, false)
    }
}

/// A minijinja environment configured like transformers' sandboxed jinja2 one.
fn template_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<JinjaValue, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| -> String {
        // Templates use this for "today's date"; a fixed clock keeps prompts reproducible
        // enough, and the format string is passed through when it cannot be honoured.
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let days = (secs / 86_400) as i64;
        let (y, m, d) = civil_from_days(days);
        const MONTHS: [&str; 12] = [
            "January",
            "February",
            "March",
            "April",
            "May",
            "June",
            "July",
            "August",
            "September",
            "October",
            "November",
            "December",
        ];
        fmt.replace("%Y", &y.to_string())
            .replace("%m", &format!("{m:02}"))
            .replace("%d", &format!("{d:02}"))
            .replace("%B", MONTHS[(m - 1) as usize])
            .replace("%b", &MONTHS[(m - 1) as usize][..3])
    });
    env
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Turns a stream of token ids into text pieces, holding back bytes until they form
/// complete UTF-8 characters (the prefix/read-offset scheme of text-generation-inference).
pub struct Detokenizer<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl<'a> Detokenizer<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Detokenizer { tokenizer, tokens: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }

    /// Adds a token; returns the newly completed text, possibly empty.
    pub fn push(&mut self, token: u32) -> Result<String> {
        self.tokens.push(token);
        let prefix = self.tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let text = self.tokenizer.decode(&self.tokens[self.prefix_offset..])?;
        if text.len() > prefix.len() && !text.ends_with('\u{FFFD}') && text.is_char_boundary(prefix.len()) {
            let new = text[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            Ok(new)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back (an incomplete character at the end of generation).
    pub fn flush(&mut self) -> Result<String> {
        let prefix = self.tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let text = self.tokenizer.decode(&self.tokens[self.prefix_offset..])?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(if text.len() > prefix.len() && text.is_char_boundary(prefix.len()) {
            text[prefix.len()..].to_string()
        } else {
            String::new()
        })
    }
}
