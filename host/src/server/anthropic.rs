//! Anthropic wire types (`/v1/messages`, `/v1/messages/count_tokens`) and their translation
//! into chat-template messages: text blocks, `tool_use` (as assistant tool calls) and
//! `tool_result` (as tool messages); tool definitions become OpenAI-style function tools,
//! the shape Hugging Face chat templates take.

use super::error::{ApiError, Flavor};
use super::openai::ToolChoice;
use crate::engine::worker::{Finish, Usage};
use crate::engine::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub messages: Vec<Value>,
    pub system: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub plugins: Option<super::openai::PluginsField>,
    /// Speculative decoding for this request (extension; see `openai::speculative`).
    pub speculative: Option<Value>,
    /// `metadata.user_id` is the request's client for the scheduling policy.
    pub metadata: Option<Value>,
    /// Scheduling priority (extension; see `openai::priority`).
    pub priority: Option<i64>,
}

/// `count_tokens` takes the same fields except `max_tokens`.
#[derive(Debug, Clone, Deserialize)]
pub struct CountTokensRequest {
    pub model: Option<String>,
    pub messages: Vec<Value>,
    pub system: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message).flavor(Flavor::Anthropic)
}

/// Text of a `system` field or a `tool_result` content: a string or text blocks.
fn blocks_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for b in blocks {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => return Err(invalid(param, format!("{param} may hold only text blocks"))),
                }
            }
            Ok(text)
        }
        _ => Err(invalid(param, format!("{param} must be a string or a list of text blocks"))),
    }
}

/// Anthropic messages (and system prompt) as chat-template messages.
pub fn template_messages(system: Option<&Value>, messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(invalid("messages", "`messages` must contain at least one message"));
    }
    let mut out = Vec::new();
    if let Some(system) = system {
        let text = blocks_text(system, "system")?;
        if !text.is_empty() {
            out.push(json!({"role": "system", "content": text}));
        }
    }
    for (i, m) in messages.iter().enumerate() {
        let param = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "user" && role != "assistant" {
            return Err(invalid(
                &format!("{param}.role"),
                format!("{param}.role must be \"user\" or \"assistant\", got {role:?}"),
            ));
        }
        match m.get("content") {
            Some(Value::String(s)) => out.push(json!({"role": role, "content": s})),
            Some(Value::Array(blocks)) => {
                let mut text = String::new();
                let mut calls = Vec::new();
                for (j, b) in blocks.iter().enumerate() {
                    let bparam = format!("{param}.content[{j}]");
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => text.push_str(b.get("text").and_then(Value::as_str).ok_or_else(|| invalid(&bparam, "a text block needs a string `text`"))?),
                        Some("tool_use") => calls.push(json!({
                            "id": b.get("id").cloned().unwrap_or(Value::Null),
                            "type": "function",
                            "function": {"name": b.get("name").cloned().unwrap_or(Value::Null), "arguments": b.get("input").cloned().unwrap_or(json!({}))},
                        })),
                        Some("tool_result") => {
                            let content = match b.get("content") {
                                Some(c) => blocks_text(c, &format!("{bparam}.content"))?,
                                None => String::new(),
                            };
                            out.push(json!({"role": "tool", "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Value::Null), "content": content}));
                        }
                        Some(other) => return Err(invalid(&bparam, format!("content blocks of type {other:?} are not supported; use text, tool_use or tool_result"))),
                        None => return Err(invalid(&bparam, "a content block needs a `type`")),
                    }
                }
                if !text.is_empty() || !calls.is_empty() {
                    let mut msg = json!({"role": role, "content": text});
                    if !calls.is_empty() {
                        msg["tool_calls"] = Value::Array(calls);
                    }
                    out.push(msg);
                }
            }
            _ => {
                return Err(invalid(
                    &format!("{param}.content"),
                    "`content` must be a string or a list of content blocks",
                ))
            }
        }
    }
    Ok(out)
}

/// Anthropic tool definitions as OpenAI-style function tools.
pub fn tools(tools: Option<&Vec<Value>>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(tools) = tools else { return Ok(None) };
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(&format!("tools[{i}]"), "a tool needs a string `name`"))?;
            Ok(json!({"type": "function", "function": {
                "name": name,
                "description": t.get("description").cloned().unwrap_or(json!("")),
                "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
            }}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// Anthropic's `tool_choice`: `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name":
/// ...}`, against `tools` already converted to OpenAI's shape.
pub fn tool_choice(choice: Option<&Value>, tools: Option<&Vec<Value>>) -> Result<ToolChoice, ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else { return Ok(ToolChoice::Auto) };
    let choice = match (choice.get("type").and_then(Value::as_str), choice.get("name").and_then(Value::as_str)) {
        (Some("auto"), _) => ToolChoice::Auto,
        (Some("none"), _) => ToolChoice::None,
        (Some("any"), _) => ToolChoice::Required,
        (Some("tool"), Some(name)) => ToolChoice::Named(name.to_string()),
        (Some("tool"), None) => {
            return Err(invalid("tool_choice", "a `tool_choice` of type \"tool\" needs the tool's `name`"))
        }
        (other, _) => {
            return Err(invalid(
                "tool_choice",
                format!(
                    "`tool_choice` needs a `type` of \"auto\", \"any\", \"tool\" or \"none\", got {}",
                    other.map_or("none".into(), |t| format!("{t:?}"))
                ),
            ))
        }
    };
    choice.check(tools).map_err(|m| invalid("tool_choice", m))
}

/// `tool_choice.disable_parallel_tool_use`: at most one tool call in the reply.
pub fn one_tool_call(choice: Option<&Value>) -> Result<bool, ApiError> {
    match choice.and_then(|c| c.get("disable_parallel_tool_use")) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid("tool_choice", "`tool_choice.disable_parallel_tool_use` must be a boolean")),
    }
}

pub fn sampling(r: &MessagesRequest) -> Result<SamplingParams, ApiError> {
    let temperature = r.temperature.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(invalid("temperature", format!("`temperature` must be between 0 and 1, got {temperature}")));
    }
    let top_p = r.top_p.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(invalid("top_p", format!("`top_p` must be between 0 and 1, got {top_p}")));
    }
    let top_k = match r.top_k {
        None => 0,
        Some(k) if k >= 0 => k as usize,
        Some(k) => return Err(invalid("top_k", format!("`top_k` must be positive, got {k}"))),
    };
    Ok(SamplingParams { temperature, top_p, top_k, ..SamplingParams::default() })
}

pub fn max_tokens(r: &MessagesRequest) -> Result<usize, ApiError> {
    match r.max_tokens {
        Some(n) if n >= 1 => Ok(n as usize),
        Some(n) => Err(invalid("max_tokens", format!("`max_tokens` must be at least 1, got {n}"))),
        None => Err(invalid("max_tokens", "`max_tokens` is required")),
    }
}

pub fn stop_reason(f: &Finish) -> (&'static str, Value) {
    match f {
        Finish::Eos => ("end_turn", Value::Null),
        Finish::StopString(s) => ("stop_sequence", json!(s)),
        Finish::StopRule(_) => ("stop_sequence", Value::Null),
        Finish::Length => ("max_tokens", Value::Null),
        Finish::ToolCalls => ("tool_use", Value::Null),
    }
}

/// A tool call's id in Anthropic's style (`toolu_...`).
pub fn tool_use_id(id: &str) -> String {
    format!("toolu_{}", id.strip_prefix("call_").unwrap_or(id))
}

/// A `tool_use` content block; arguments that are not a JSON object are kept under
/// `arguments` as text (the model wrote something the adapter could not parse as an object).
pub fn tool_use_block(call: &super::openai::ToolCall) -> Value {
    let input = match serde_json::from_str::<Value>(&call.arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({"arguments": call.arguments}),
    };
    json!({"type": "tool_use", "id": tool_use_id(&call.id), "name": call.name, "input": input})
}

/// The client id in `metadata.user_id`, if any.
pub fn client(r: &MessagesRequest) -> Option<String> {
    r.metadata.as_ref()?.get("user_id")?.as_str().map(str::to_string)
}

pub fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    });
    if let Some(s) = &u.speculative {
        v["speculative"] = super::openai::speculative_json(s, u.completion_tokens);
    }
    v
}
