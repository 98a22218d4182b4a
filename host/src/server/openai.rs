//! OpenAI wire types (`/v1/chat/completions`, `/v1/completions`) and their translation to
//! engine jobs and back. Unknown request fields are accepted and ignored (SDKs send many);
//! known fields are type- and range-checked with messages that name them.

use super::error::ApiError;
use crate::engine::job::{Finish, SpecUsage, TokenLogprob, Usage};
use crate::engine::{SamplingParams, SpecConfig, SpecMethod, Verify};
use crate::plugins::request::PluginsField;
use crate::structured::Structure;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// For a field that must be a JSON object (serde would also read a struct from an array,
/// which no client means): absent or `null` is `None`.
pub fn object<'de, D: serde::Deserializer<'de>, T: serde::de::DeserializeOwned>(d: D) -> Result<Option<T>, D::Error> {
    use serde::de::Error;
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => serde_json::from_value(v).map(Some).map_err(D::Error::custom),
        Some(other) => {
            let kind = match other {
                Value::Array(_) => "a list",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                _ => "a boolean",
            };
            Err(D::Error::custom(format!("expected an object, got {kind}")))
        }
    }
}

/// Sampling fields shared by the OpenAI routes and Responses. They are flattened into each
/// request, where the parser cannot say which field failed: read as any JSON here, and
/// type-checked by [`to_params`](Self::to_params) with the field named.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    temperature: Option<Value>,
    top_p: Option<Value>,
    top_k: Option<Value>,
    min_p: Option<Value>,
    presence_penalty: Option<Value>,
    frequency_penalty: Option<Value>,
    repetition_penalty: Option<Value>,
    logit_bias: Option<Value>,
    seed: Option<Value>,
}

/// A JSON value's kind, for error messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A number field (`null` or absent: `None`).
fn number(v: &Option<Value>, name: &str) -> Result<Option<f32>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64().map(|x| x as f32)),
        Some(other) => Err(ApiError::invalid(name, format!("`{name}` must be a number, got {}", kind(other)))),
    }
}

/// An integer field (`null` or absent: `None`).
fn integer(v: &Option<Value>, name: &str) -> Result<Option<i64>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.is_i64() => Ok(n.as_i64()),
        Some(Value::Number(n)) if n.is_u64() => Ok(Some(i64::MAX)), // past i64: out of every range
        Some(other) => Err(ApiError::invalid(name, format!("`{name}` must be an integer, got {}", kind(other)))),
    }
}

impl SamplingFields {
    pub fn temperature(&self) -> Option<f32> {
        number(&self.temperature, "temperature").ok().flatten()
    }

    pub fn top_p(&self) -> Option<f32> {
        number(&self.top_p, "top_p").ok().flatten()
    }

    /// The engine's sampling parameters, type- and range-checked as OpenAI documents them.
    pub fn to_params(&self, default_temperature: f32) -> Result<SamplingParams, ApiError> {
        let temperature = number(&self.temperature, "temperature")?.unwrap_or(default_temperature);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = number(&self.top_p, "top_p")?.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&top_p) {
            return Err(ApiError::invalid("top_p", format!("`top_p` must be between 0 and 1, got {top_p}")));
        }
        let top_k = match integer(&self.top_k, "top_k")? {
            None | Some(-1) => 0,
            Some(k) if k >= 0 => k as usize,
            Some(k) => return Err(ApiError::invalid("top_k", format!("`top_k` must be 0 (off) or positive, got {k}"))),
        };
        let min_p = number(&self.min_p, "min_p")?.unwrap_or(0.0);
        let presence_penalty = number(&self.presence_penalty, "presence_penalty")?;
        let frequency_penalty = number(&self.frequency_penalty, "frequency_penalty")?;
        let repetition_penalty = number(&self.repetition_penalty, "repetition_penalty")?;
        let seed = integer(&self.seed, "seed")?;
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid("min_p", format!("`min_p` must be between 0 and 1, got {min_p}")));
        }
        for (name, v) in [("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)] {
            if let Some(v) = v {
                if !(-2.0..=2.0).contains(&v) {
                    return Err(ApiError::invalid(name, format!("`{name}` must be between -2 and 2, got {v}")));
                }
            }
        }
        if let Some(p) = repetition_penalty {
            if !(p > 0.0 && p <= 10.0) {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    format!("`repetition_penalty` must be in (0, 10], got {p}"),
                ));
            }
        }
        let mut logit_bias = BTreeMap::new();
        let bias = match &self.logit_bias {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(other) => {
                let why = format!("`logit_bias` must be an object of token id -> bias, got {}", kind(other));
                return Err(ApiError::invalid("logit_bias", why));
            }
        };
        for (k, v) in &bias {
            let v = v.as_f64().map(|x| x as f32).ok_or_else(|| {
                ApiError::invalid("logit_bias", format!("`logit_bias` values must be numbers, got {}", kind(v)))
            })?;
            let id: u32 = k.parse().map_err(|_| {
                ApiError::invalid("logit_bias", format!("`logit_bias` keys must be token ids, got {k:?}"))
            })?;
            if !(-100.0..=100.0).contains(&v) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` values must be between -100 and 100, got {v}"),
                ));
            }
            logit_bias.insert(id, v);
        }
        Ok(SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias,
            seed: seed.map(|s| s as u64),
            ..SamplingParams::default()
        })
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Value>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, deserialize_with = "object")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `false`: at most one tool call in the reply.
    pub parallel_tool_calls: Option<bool>,
    pub n: Option<i64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(flatten)]
    pub structured: StructuredFields,
    pub modalities: Option<Vec<String>>,
    #[serde(default, deserialize_with = "object")]
    pub plugins: Option<PluginsField>,
    /// Speculative decoding for this request (extension; see `speculative`).
    pub speculative: Option<Value>,
    /// The end user; the scheduling policy sees it as the request's client.
    pub user: Option<String>,
    /// Scheduling priority (extension, as vLLM's): higher is served first by the
    /// `priority` policy. Default 0.
    pub priority: Option<i64>,
}

impl ChatRequest {
    /// Refuses fields that would change what the client gets in ways this server cannot honour.
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if let Some(m) = self.modalities.iter().flatten().find(|m| *m != "text") {
            return Err(ApiError::invalid(
                "modalities",
                format!("output modality {m:?} is not supported; this server produces text"),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, deserialize_with = "object")]
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    pub n: Option<i64>,
    #[serde(flatten)]
    pub structured: StructuredFields,
    #[serde(default, deserialize_with = "object")]
    pub plugins: Option<PluginsField>,
    pub speculative: Option<Value>,
    pub user: Option<String>,
    pub priority: Option<i64>,
}

/// The structured-output fields of chat and completion requests: OpenAI's
/// `response_format`, and llama.cpp's and vLLM's `grammar` and `regex` (extensions).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredFields {
    pub response_format: Option<Value>,
    /// A Lark grammar (llguidance's dialect) or a GBNF one.
    pub grammar: Option<Value>,
    pub regex: Option<Value>,
}

/// What a request's structured-output fields hold its output to (at most one of them).
pub fn structure(fields: &StructuredFields) -> Result<Option<Structure>, ApiError> {
    let mut found = Vec::new();
    if let Some(format) = fields.response_format.as_ref().filter(|v| !v.is_null()) {
        if let Some(s) = response_format(format, "response_format")? {
            found.push(("response_format", s));
        }
    }
    for (name, value, make) in [
        ("grammar", &fields.grammar, Structure::Grammar as fn(String) -> Structure),
        ("regex", &fields.regex, Structure::Regex),
    ] {
        match value {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if !s.trim().is_empty() => found.push((name, make(s.clone()))),
            Some(Value::String(_)) => return Err(ApiError::invalid(name, format!("`{name}` is empty"))),
            Some(other) => {
                return Err(ApiError::invalid(name, format!("`{name}` must be a string, got {}", kind(other))))
            }
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
        return Err(ApiError::invalid(
            names[1],
            format!("give one of `response_format`, `grammar` and `regex`, not {}", names.join(" and ")),
        ));
    }
    Ok(found.pop().map(|(_, s)| s))
}

/// A `response_format` (chat: `{"type": "json_schema", "json_schema": {"schema": ...}}`) or
/// a Responses `text.format` (`{"type": "json_schema", "schema": ...}`) as a structure;
/// `None` for plain text. `strict` or not, the schema is enforced; `strict: true` also
/// closes its objects to properties they do not name (`structured::strict`).
pub fn response_format(format: &Value, param: &str) -> Result<Option<Structure>, ApiError> {
    let Some(obj) = format.as_object() else {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must be an object such as {{\"type\": \"json_object\"}}, got {}", kind(format)),
        ));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Structure::JsonObject)),
        Some("json_schema") => {
            let (holder, at) = match obj.get("json_schema") {
                Some(Value::Object(js)) => (js, format!("{param}.json_schema.schema")),
                Some(other) => {
                    return Err(ApiError::invalid(
                        &format!("{param}.json_schema"),
                        format!("`{param}.json_schema` must be an object holding the `schema`, got {}", kind(other)),
                    ))
                }
                None => (obj, format!("{param}.schema")),
            };
            let strict = holder.get("strict").and_then(Value::as_bool).unwrap_or(false);
            match holder.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) if strict => {
                    Ok(Some(Structure::JsonSchema(crate::structured::strict(schema.clone()))))
                }
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(Some(Structure::JsonSchema(schema.clone()))),
                Some(other) => {
                    Err(ApiError::invalid(&at, format!("`{at}` must be a JSON schema object, got {}", kind(other))))
                }
                None => {
                    Err(ApiError::invalid(&at, format!("`{at}` is missing: give the JSON schema the output follows")))
                }
            }
        }
        Some(other) => Err(ApiError::invalid(
            &format!("{param}.type"),
            format!(
                "`{param}` of type {} is not supported; use \"text\", \"json_object\" or \"json_schema\"",
                super::error::quoted(other)
            ),
        )),
        None => Err(ApiError::invalid(param, format!("`{param}` needs a `type`"))),
    }
}

/// Checks `n`, which this server supports only as 1.
pub fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("`n` must be 1 (one choice per request), got {n}; send several requests instead"),
        )),
    }
}

/// `max_tokens` (or its newer name): at least 1 when given.
pub fn max_tokens(value: Option<i64>, name: &str, default: usize) -> Result<usize, ApiError> {
    match value {
        None => Ok(default),
        Some(n) if n >= 1 => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(name, format!("`{name}` must be at least 1, got {n}"))),
    }
}

pub fn stops(stop: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let stops = stop.map(Stop::into_vec).unwrap_or_default();
    if stops.len() > 16 {
        return Err(ApiError::invalid("stop", format!("at most 16 stop sequences are supported, got {}", stops.len())));
    }
    if stops.iter().any(|s| s.len() > 1024) {
        return Err(ApiError::invalid("stop", "stop sequences must be at most 1024 bytes"));
    }
    Ok(stops)
}

/// Text of a message `content`: a string, or an array of `{"type": "text", "text": ...}` parts.
pub fn content_text(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some(other), _) if other != "text" => {
                        return Err(ApiError::invalid(
                            param,
                            format!(
                                "content parts of type {} are not supported; this model takes text",
                                super::error::quoted(other)
                            ),
                        ))
                    }
                    _ => return Err(ApiError::invalid(param, "a text content part needs a string `text`")),
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(param, "`content` must be a string or an array of content parts")),
    }
}

/// Normalizes chat messages for the template: checks roles, flattens content parts, and
/// turns tool-call arguments given as JSON strings into objects (as templates expect).
pub fn template_messages(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must contain at least one message"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let param = format!("messages[{i}]");
        let obj = m.as_object().ok_or_else(|| ApiError::invalid(&param, format!("{param} must be an object")))?;
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                &param,
                format!("{param} needs a string `role` (system, developer, user, assistant or tool)"),
            )
        })?;
        let role = match role {
            "developer" => "system",
            "system" | "user" | "assistant" | "tool" => role,
            other => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    format!(
                        "unknown role {}; use system, developer, user, assistant or tool",
                        super::error::quoted(other)
                    ),
                ))
            }
        };
        let content = obj.get("content").unwrap_or(&Value::Null);
        if content.is_null() && role != "assistant" {
            return Err(ApiError::invalid(
                &format!("{param}.content"),
                format!("{param} ({role}) needs a `content`: a string or an array of text parts"),
            ));
        }
        let content = content_text(content, &format!("{param}.content"))?;
        let mut msg = json!({"role": role, "content": content});
        if let Some(calls) = obj.get("tool_calls").and_then(Value::as_array) {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let mut c = c.clone();
                    if let Some(args) = c.pointer("/function/arguments").and_then(Value::as_str) {
                        if let Ok(parsed) = serde_json::from_str::<Value>(args) {
                            c["function"]["arguments"] = parsed;
                        }
                    }
                    c
                })
                .collect();
            msg["tool_calls"] = Value::Array(calls);
        }
        for key in ["tool_call_id", "name"] {
            if let Some(v) = obj.get(key) {
                msg[key] = v.clone();
            }
        }
        // An assistant turn's thinking, for templates that keep it (Qwen3's, in a tool loop).
        let reasoning = ["reasoning_content", "reasoning"].iter().find_map(|k| obj.get(*k).and_then(Value::as_str));
        if let (Some(r), "assistant") = (reasoning.filter(|r| !r.is_empty()), role) {
            msg["reasoning_content"] = json!(r);
        }
        out.push(msg);
    }
    Ok(out)
}

/// The function name of a tool in OpenAI's shape.
pub fn tool_name(tool: &Value) -> Option<&str> {
    tool.pointer("/function/name").and_then(Value::as_str)
}

/// What a request's `tool_choice` asks for (both APIs), checked against its tools. `Required`
/// and `Named` force a call through the tool adapter's `tool_force` opener, when it has one
/// (`AppState::force_tool`; ABI.md §5.3).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    Named(String),
}

impl ToolChoice {
    /// The tools the prompt and the adapter see: none when the choice is `None`.
    pub fn tools(&self, tools: Option<Vec<Value>>) -> Option<Vec<Value>> {
        if *self == ToolChoice::None {
            None
        } else {
            tools
        }
    }

    /// A choice that needs tools has some, and a named one is among them (`tools` in
    /// OpenAI's shape, as both APIs hold them by now).
    pub(super) fn check(self, tools: Option<&Vec<Value>>) -> Result<ToolChoice, String> {
        let names: Vec<&str> = tools.into_iter().flatten().filter_map(tool_name).collect();
        match &self {
            ToolChoice::Required | ToolChoice::Named(_) if names.is_empty() => {
                Err("`tool_choice` asks for a tool call, but the request has no `tools`".into())
            }
            ToolChoice::Named(name) if !names.contains(&name.as_str()) => Err(format!(
                "`tool_choice` names the function {name:?}, which is not among the request's tools ({})",
                names.join(", ")
            )),
            _ => Ok(self),
        }
    }
}

/// [`check_tools`] over tools converted to OpenAI's shape from another API's: an error names
/// the tool and its field as the request wrote them, in its path and in its message.
/// `at[j]`: the request's index of converted tool `j`; `fields`: (OpenAI's path under a tool,
/// the API's), most specific first.
pub fn check_converted_tools(chat: &Vec<Value>, at: &[usize], fields: &[(&str, &str)]) -> Result<(), ApiError> {
    check_tools(Some(chat)).map_err(|mut e| {
        let Some((j, rest)) = e.param.as_deref().and_then(|p| p.strip_prefix("tools[")).and_then(|p| {
            let (j, rest) = p.split_once(']')?;
            Some((j.parse::<usize>().ok()?, rest.to_string()))
        }) else {
            return e;
        };
        let i = at.get(j).copied().unwrap_or(j);
        let (from, to) =
            fields.iter().find(|(from, _)| rest == *from).copied().unwrap_or((rest.as_str(), rest.as_str()));
        let param = format!("tools[{i}]{to}");
        let mut message = e.message.clone();
        for (from, to) in fields {
            message = message.replace(&format!("tools[{j}]{from}"), &format!("tools[{i}]{to}"));
        }
        message = message.replace(&format!("tools[{j}]"), &format!("tools[{i}]"));
        // The field's own name in the message (`parameters` -> `input_schema`).
        let (ours, theirs) = (from.rsplit('.').next().unwrap_or(""), to.rsplit('.').next().unwrap_or(""));
        if !ours.is_empty() && !theirs.is_empty() && ours != theirs {
            message = message
                .replace(&format!("`{ours}`"), &format!("`{theirs}`"))
                .replace(&format!("the {ours} "), &format!("the {theirs} "));
        }
        if !message.contains(&param) {
            message = format!("`{param}`: {message}");
        }
        e.param = Some(param);
        e.message = message;
        e
    })
}

/// Checks `tools` (OpenAI shape): a list of `{"type": "function", "function": {"name",
/// "description"?, "parameters"?}}`, names unique.
pub fn check_tools(tools: Option<&Vec<Value>>) -> Result<(), ApiError> {
    let mut seen = std::collections::HashSet::new();
    let count = tools.map_or(0, Vec::len);
    if count > MAX_TOOLS {
        return Err(ApiError::invalid("tools", format!("{count} tools; at most {MAX_TOOLS} per request")));
    }
    for (i, t) in tools.into_iter().flatten().enumerate() {
        let param = format!("tools[{i}]");
        let kind = t.get("type").and_then(Value::as_str);
        if kind != Some("function") {
            return Err(ApiError::invalid(
                &param,
                format!(
                    "{param} has type {}; this server takes tools of type \"function\"",
                    kind.map_or("none".into(), super::error::quoted)
                ),
            ));
        }
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| ApiError::invalid(&param, format!("{param} needs a `function` object with a `name`")))?;
        let name = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| {
            ApiError::invalid(
                &format!("{param}.function.name"),
                format!("{param}.function needs a non-empty string `name`"),
            )
        })?;
        if name.len() > MAX_TOOL_NAME || name.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(ApiError::invalid(
                &format!("{param}.function.name"),
                format!("a tool name is at most {MAX_TOOL_NAME} bytes, without spaces or control characters (e.g. get_weather)"),
            ));
        }
        if !seen.insert(name) {
            return Err(ApiError::invalid(&param, format!("two tools are named {name:?}; tool names must be unique")));
        }
        if f.get("parameters").is_some_and(|p| !p.is_object()) {
            return Err(ApiError::invalid(
                &format!("{param}.function.parameters"),
                "`parameters` must be a JSON Schema object",
            ));
        }
        if f.get("description").is_some_and(|d| !d.is_string()) {
            return Err(ApiError::invalid(&format!("{param}.function.description"), "`description` must be a string"));
        }
        let described = f.get("description").and_then(Value::as_str).map_or(0, str::len);
        if described > MAX_TOOL_DESCRIPTION {
            return Err(ApiError::invalid(
                &format!("{param}.function.description"),
                format!("the description is {described} bytes; at most {MAX_TOOL_DESCRIPTION}"),
            ));
        }
        let schema = f.get("parameters").map_or(0, |p| p.to_string().len());
        if schema > MAX_TOOL_SCHEMA {
            return Err(ApiError::invalid(
                &format!("{param}.function.parameters"),
                format!("`parameters` is {schema} bytes of JSON; at most {MAX_TOOL_SCHEMA}"),
            ));
        }
    }
    let total = tools.map_or(0, |t| Value::Array(t.clone()).to_string().len());
    if total > MAX_TOOLS_BYTES {
        return Err(ApiError::invalid(
            "tools",
            format!("the tools are {total} bytes of JSON; at most {MAX_TOOLS_BYTES} per request"),
        ));
    }
    Ok(())
}

/// Limits on a request's tools (all three APIs), so what reaches the tool adapter's
/// `tool_render` (and the prompt) is bounded. Agent harnesses send a few dozen tools of a few
/// KiB each (Claude Code 2.1: 24 tools, 80 KiB).
pub const MAX_TOOLS: usize = 256;
pub const MAX_TOOLS_BYTES: usize = 512 << 10;
pub const MAX_TOOL_NAME: usize = 128;
pub const MAX_TOOL_DESCRIPTION: usize = 32 << 10;
pub const MAX_TOOL_SCHEMA: usize = 64 << 10;

/// OpenAI's `tool_choice`: `"auto"` (the default), `"none"`, `"required"` or `{"type":
/// "function", "function": {"name": ...}}`.
pub fn tool_choice(choice: Option<&Value>, tools: Option<&Vec<Value>>) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("unknown `tool_choice` {}; use \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", super::error::quoted(other)),
                ))
            }
        },
        Some(v) => match (v.get("type").and_then(Value::as_str), v.pointer("/function/name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => ToolChoice::Named(name.to_string()),
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "an object `tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    choice.check(tools).map_err(|m| ApiError::invalid("tool_choice", m))
}

/// OpenAI's chat `logprobs.content` entries.
pub fn chat_logprobs(entries: &[TokenLogprob]) -> Value {
    let item = |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    Value::Array(
        entries
            .iter()
            .map(|e| {
                let mut v = item(&e.token, e.logprob);
                v["top_logprobs"] = Value::Array(e.top.iter().map(|(t, lp)| item(t, *lp)).collect());
                v
            })
            .collect(),
    )
}

/// The legacy completions `logprobs` object.
pub fn completion_logprobs(entries: &[TokenLogprob], text_start: usize) -> Value {
    let mut offset = text_start;
    let mut offsets = Vec::new();
    for e in entries {
        offsets.push(offset);
        offset += e.token.len();
    }
    json!({
        "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(|e| e.top.iter().map(|(t, lp)| (t.clone(), json!(lp))).collect::<Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

pub fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    });
    if let Some(s) = &u.speculative {
        v["speculative"] = speculative_json(s, u.completion_tokens);
    }
    v
}

/// The `speculative` object in `usage` (both APIs).
pub fn speculative_json(s: &SpecUsage, completion_tokens: usize) -> Value {
    // Rounded to 3 decimals; 0 when nothing was drafted or no step ran.
    let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { (a as f64 / b as f64 * 1000.0).round() / 1000.0 };
    json!({
        "method": s.method.as_str(),
        "drafted_tokens": s.drafted_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": ratio(s.accepted_tokens, s.drafted_tokens),
        "target_steps": s.target_steps,
        "tokens_per_step": ratio(completion_tokens, s.target_steps),
    })
}

/// The `speculative` extension field (both APIs), over the server's defaults: `"off"`,
/// `"prompt-lookup"`, `"draft"`, or `{"method": ..., "num_draft_tokens": 1-64, "verify":
/// "exact"|"lossless", "ngram_max": n, "ngram_min": n, "candidates": 1-32}` (absent keys keep
/// the defaults).
pub fn speculative(field: Option<Value>, defaults: &SpecConfig, has_draft: bool) -> Result<SpecConfig, String> {
    let mut config = defaults.clone();
    let method = |v: &Value| -> Result<SpecMethod, String> {
        match v.as_str() {
            Some("off") => Ok(SpecMethod::Off),
            Some("prompt-lookup" | "prompt_lookup") => Ok(SpecMethod::PromptLookup),
            Some("draft") => Ok(SpecMethod::Draft),
            _ => Err(format!("`speculative` method must be \"off\", \"prompt-lookup\" or \"draft\", got {v}")),
        }
    };
    let count = |key: &str, v: &Value| -> Result<usize, String> {
        v.as_u64().map(|n| n as usize).ok_or_else(|| format!("`speculative.{key}` must be a positive integer, got {v}"))
    };
    match field {
        None | Some(Value::Null) => return Ok(config),
        Some(v @ Value::String(_)) => config.method = method(&v)?,
        Some(Value::Object(o)) => {
            for (key, v) in &o {
                match key.as_str() {
                    "method" => config.method = method(v)?,
                    "num_draft_tokens" => config.num_draft_tokens = count(key, v)?,
                    "ngram_max" => config.ngram_max = count(key, v)?,
                    "ngram_min" => config.ngram_min = count(key, v)?,
                    "candidates" => config.candidates = Some(count(key, v)?),
                    "verify" => {
                        config.verify = match v.as_str() {
                            Some("exact") => Verify::Exact,
                            Some("lossless") => Verify::Lossless,
                            _ => return Err(format!("`speculative.verify` must be \"exact\" or \"lossless\", got {v}")),
                        }
                    }
                    other => {
                        return Err(format!(
                            "unknown key `speculative.{other}`; known: method, num_draft_tokens, verify, ngram_max, ngram_min, candidates"
                        ))
                    }
                }
            }
            if !o.contains_key("method") && config.method == SpecMethod::Off {
                config.method = if has_draft { SpecMethod::Draft } else { SpecMethod::PromptLookup };
            }
        }
        Some(other) => {
            return Err(format!("`speculative` must be a method name or an object, got {other}"));
        }
    }
    if config.method == SpecMethod::Draft && !has_draft {
        return Err("speculative method \"draft\" needs a draft model, and this server has none (start it with --draft-model PATH); use \"prompt-lookup\"".into());
    }
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

pub fn finish_reason(f: &Finish) -> &'static str {
    f.reason()
}

/// A tool call as the collector gathers it: id, function name, JSON arguments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// `message.tool_calls` of a chat completion.
pub fn tool_calls_json(calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect(),
    )
}

/// Checks `priority`: an integer within +-1,000,000.
pub fn priority(p: Option<i64>) -> Result<i64, ApiError> {
    match p {
        None => Ok(0),
        Some(p) if (-1_000_000..=1_000_000).contains(&p) => Ok(p),
        Some(p) => {
            Err(ApiError::invalid("priority", format!("`priority` must be between -1000000 and 1000000, got {p}")))
        }
    }
}
