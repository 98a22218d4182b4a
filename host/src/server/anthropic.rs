//! Anthropic wire types (`/v1/messages`, `/v1/messages/count_tokens`) and their translation
//! into chat-template messages: text blocks, `tool_use` (as assistant tool calls) and
//! `tool_result` (as tool messages); tool definitions become OpenAI-style function tools,
//! the shape Hugging Face chat templates take.

use super::error::ApiError;
use super::openai::ToolChoice;
use super::turn::{Api, Input, Turn};
use crate::engine::job::{Finish, Usage};
use crate::engine::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Value};

/// A Messages request, as the Anthropic SDKs and Claude Code send it. Fields this server
/// has no use for are accepted and answered deliberately: `thinking` switches the chat
/// template's thinking (`enable_thinking`), `cache_control` blocks are accepted (the prompt
/// cache reuses any shared prefix by itself), `context_management` and `output_config.effort`
/// are accepted and have no effect (no thinking blocks are kept between turns; effort has no
/// lever here), `metadata.user_id` is the client for the scheduling policy, and any `model`
/// name is served by the loaded model. The `anthropic-version`/`anthropic-beta` headers and
/// `?beta=true` need nothing.
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    /// Required by `/v1/messages`, not by `count_tokens`.
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
    /// `{"type": "enabled", "budget_tokens": n}`, `{"type": "adaptive"}` or `{"type": "disabled"}`.
    pub thinking: Option<Value>,
    /// `{"effort": ..., "format": {"type": "json_schema", "schema": ...}}`: structured output.
    pub output_config: Option<Value>,
    /// The structured-outputs beta's name for `output_config.format`.
    pub output_format: Option<Value>,
    #[serde(default, deserialize_with = "super::openai::object")]
    pub plugins: Option<crate::plugins::request::PluginsField>,
    /// Speculative decoding for this request (extension; see `openai::speculative`).
    pub speculative: Option<Value>,
    /// `metadata.user_id` is the request's client for the scheduling policy.
    #[serde(default, deserialize_with = "super::openai::object")]
    pub metadata: Option<Value>,
    /// Scheduling priority (extension; see `openai::priority`).
    pub priority: Option<i64>,
}

/// The protocol-neutral turn of a Messages request (`counting`: for `count_tokens`, where
/// `max_tokens` is not needed).
pub fn turn(r: &MessagesRequest, counting: bool) -> Result<Turn, ApiError> {
    let max_tokens = if counting { None } else { Some(max_tokens(r)?) };
    let sampling = sampling(r)?;
    let messages = template_messages(r.system.as_ref(), &r.messages)?;
    let tools = tools(r.tools.as_ref())?;
    let tool_choice = tool_choice(r.tool_choice.as_ref(), tools.as_ref())?;
    let stop = super::openai::stops(r.stop_sequences.clone().map(super::openai::Stop::Many))?;
    let mut turn = Turn {
        input: Input::Messages(messages),
        tools,
        tool_choice,
        one_tool_call: one_tool_call(r.tool_choice.as_ref())?,
        sampling,
        max_tokens,
        // Claude Code asks for up to 128k tokens on every turn: a ceiling, not a need.
        max_tokens_is_ceiling: true,
        stop,
        plugins: r.plugins.clone(),
        speculative: r.speculative.clone(),
        priority: super::openai::priority(r.priority)?,
        client: client(r),
        api: Api::Messages,
        model: r.model.clone(),
        ..Turn::default()
    };
    if let Some(enabled) = thinking(r.thinking.as_ref())? {
        turn.template_default("enable_thinking", json!(enabled));
    }
    turn.structure = output_format(r)?;
    Ok(turn)
}

/// `thinking`: whether the template's thinking is on (`None`: the template's default).
fn thinking(t: Option<&Value>) -> Result<Option<bool>, ApiError> {
    let Some(t) = t.filter(|t| !t.is_null()) else { return Ok(None) };
    match t.get("type").and_then(Value::as_str) {
        Some("enabled") => match t.get("budget_tokens") {
            None | Some(Value::Null) => Ok(Some(true)),
            Some(b) if b.as_u64().is_some_and(|b| b >= 1) => Ok(Some(true)),
            Some(b) => Err(invalid(
                "thinking.budget_tokens",
                format!("`thinking.budget_tokens` must be a positive integer, got {b}"),
            )),
        },
        Some("adaptive") => Ok(Some(true)),
        Some("disabled") => Ok(Some(false)),
        other => Err(invalid(
            "thinking.type",
            format!(
                "`thinking.type` must be \"enabled\", \"adaptive\" or \"disabled\", got {}",
                other.map_or("nothing".into(), |o| format!("{o:?}"))
            ),
        )),
    }
}

/// `output_config`: `effort` is accepted; a `format` other than text is structured output,
/// which this server does not constrain, so it is refused rather than ignored.
/// Structured output: `output_config.format` (or the beta's `output_format`),
/// `{"type": "json_schema", "schema": ...}`. Anthropic's structured outputs are strict: objects
/// take only the properties they name.
fn output_format(r: &MessagesRequest) -> Result<Option<crate::structured::Structure>, ApiError> {
    let config = r.output_config.as_ref().filter(|c| !c.is_null());
    if config.is_some_and(|c| !c.is_object()) {
        return Err(invalid("output_config", "`output_config` must be an object"));
    }
    let from_config = config.and_then(|c| c.get("format")).filter(|f| !f.is_null());
    let (format, param) = match (from_config, r.output_format.as_ref().filter(|f| !f.is_null())) {
        (Some(_), Some(_)) => {
            return Err(invalid("output_format", "give `output_config.format` or `output_format`, not both"));
        }
        (Some(f), None) => (f, "output_config.format"),
        (None, Some(f)) => (f, "output_format"),
        (None, None) => return Ok(None),
    };
    match super::openai::response_format(format, param)? {
        Some(crate::structured::Structure::JsonSchema(s)) => {
            Ok(Some(crate::structured::Structure::JsonSchema(crate::structured::strict(s))))
        }
        other => Ok(other),
    }
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

/// Claude Code's first system block, `x-anthropic-billing-header: cc_version=...;`, changes
/// with every prompt: kept in the prompt it would stop the prompt cache from reusing anything
/// after it, and it means nothing to a local model, so it is dropped.
const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// Refuses a block this server cannot read, saying why.
fn unreadable(param: &str, kind: &str) -> ApiError {
    let shown = super::error::quoted(kind);
    match kind {
        "image" | "document" | "search_result" => invalid(
            param,
            format!("{param} is a {shown} block, and this server's model reads text only; send the content as text"),
        ),
        _ => invalid(
            param,
            format!(
                "content blocks of type {shown} are not supported here; use text, tool_use, tool_result (or thinking)"
            ),
        ),
    }
}

/// Text of a `system` field or a `tool_result` content: a string or text blocks (their
/// `cache_control` accepted).
fn blocks_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) if t.starts_with(BILLING_HEADER) => {}
                    (Some("text"), Some(t)) => parts.push(t),
                    (Some("text"), None) => {
                        return Err(invalid(&format!("{param}[{i}]"), "a text block needs a string `text`"))
                    }
                    (Some(kind), _) => return Err(unreadable(&format!("{param}[{i}]"), kind)),
                    (None, _) => return Err(invalid(&format!("{param}[{i}]"), "a content block needs a `type`")),
                }
            }
            Ok(parts.concat())
        }
        _ => Err(invalid(param, format!("{param} must be a string or a list of text blocks"))),
    }
}

/// Anthropic messages (and system prompt) as chat-template messages. System messages among
/// `messages` (Claude Code's mid-conversation system beta) stay in place; the prompt builder
/// moves them into the first system message for templates that refuse them there.
/// Thinking blocks of earlier turns reach the template as the turn's `reasoning_content`
/// (templates that keep it, Qwen3's within a tool loop, show it; others drop it).
pub fn template_messages(system: Option<&Value>, messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(invalid("messages", "`messages` must contain at least one message"));
    }
    if messages.iter().all(|m| m.get("role").and_then(Value::as_str) == Some("system")) {
        return Err(invalid(
            "messages",
            "`messages` holds only system messages; it needs at least one user or assistant message",
        ));
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
        if !matches!(role, "user" | "assistant" | "system") {
            return Err(invalid(
                &format!("{param}.role"),
                format!(
                    "{param}.role must be \"user\", \"assistant\" or \"system\", got {}",
                    super::error::quoted(role)
                ),
            ));
        }
        if role == "system" {
            let text = blocks_text(m.get("content").unwrap_or(&Value::Null), &format!("{param}.content"))?;
            out.push(json!({"role": "system", "content": text}));
            continue;
        }
        match m.get("content") {
            Some(Value::String(s)) => out.push(json!({"role": role, "content": s})),
            Some(Value::Array(blocks)) if blocks.is_empty() => {
                return Err(invalid(
                    &format!("{param}.content"),
                    format!("{param}.content is an empty list; give at least one content block"),
                ));
            }
            Some(Value::Array(blocks)) => {
                let (mut text, mut thinking) = (String::new(), String::new());
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
                        // Thinking goes back to the template as `reasoning_content` (Qwen3's
                        // keeps it within a tool loop); redacted thinking is opaque.
                        Some("thinking") if role == "assistant" => {
                            thinking.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or_default())
                        }
                        Some("redacted_thinking") if role == "assistant" => {}
                        Some(other) => return Err(unreadable(&bparam, other)),
                        None => return Err(invalid(&bparam, "a content block needs a `type`")),
                    }
                }
                if !text.is_empty() || !calls.is_empty() {
                    let mut msg = json!({"role": role, "content": text});
                    if !calls.is_empty() {
                        msg["tool_calls"] = Value::Array(calls);
                    }
                    if !thinking.is_empty() {
                        msg["reasoning_content"] = json!(thinking);
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

/// Anthropic tool definitions as OpenAI-style function tools. Server tools (a `type` such as
/// `web_search_20250305`: run by Anthropic's servers, which this one is not) and tools with
/// `defer_loading` (kept out of the model's context until a tool search loads them) are left
/// out of the prompt: the model could not call them here.
pub fn tools(tools: Option<&Vec<Value>>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(tools) = tools else { return Ok(None) };
    let (mut out, mut at) = (Vec::new(), Vec::new());
    for (i, t) in tools.iter().enumerate() {
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(&format!("tools[{i}]"), "a tool needs a string `name`"))?;
        let server_tool = t.get("type").and_then(Value::as_str).is_some_and(|k| k != "custom");
        if server_tool || t.get("defer_loading") == Some(&Value::Bool(true)) {
            tracing::debug!(name, "tool left out of the prompt (a server tool or deferred)");
            continue;
        }
        // `strict: true` (Anthropic's strict tool use) holds the calls the model starts on its
        // own to the schema, as an OpenAI function's does (`Turns::lazy_tool`).
        let mut function = json!({
            "name": name,
            "description": t.get("description").cloned().unwrap_or(json!("")),
            "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
        });
        if let Some(strict) = t.get("strict").filter(|s| s.is_boolean()) {
            function["strict"] = strict.clone();
        }
        out.push(json!({"type": "function", "function": function}));
        at.push(i);
    }
    // Checked here, before any plugin sees them: an error names the tool's field as the
    // request wrote it (`tools[i].input_schema`, not OpenAI's `parameters`).
    let fields = [
        (".function.name", ".name"),
        (".function.parameters", ".input_schema"),
        (".function.description", ".description"),
        (".function", ""),
    ];
    super::openai::check_converted_tools(&out, &at, &fields)?;
    Ok(Some(out))
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
