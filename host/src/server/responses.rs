//! OpenAI Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) wire
//! types: a request becomes a [`Turn`], the engine's events become output items (messages
//! and function calls) and the stream's events in the order the Responses grammar gives
//! them (`response.created`, `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`, ... `response.completed`),
//! every one carrying its `type` and `sequence_number`. Responses created with `store`
//! (the default, as OpenAI's) are kept in a bounded in-memory [`Store`] so that
//! `previous_response_id` continues their conversation.

use super::error::{parse_body, ApiError};
use super::openai::{self, SamplingFields, ToolChoice};
use super::reply::{failure, now, request_id, stream};
use super::state::Shared;
use super::store::Store;
use super::turn::{Api, Input, Turn};
use crate::engine::job::{Event, Finish, Usage};
use crate::plugins::request::PluginsField;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string (one user message) or a list of input items.
    pub input: Option<Value>,
    /// A system message ahead of the input (not carried to a later `previous_response_id`
    /// turn, as OpenAI documents).
    pub instructions: Option<String>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(default)]
    pub stream: bool,
    /// Keep the response for `previous_response_id` and `GET` (default true).
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity": ...}`.
    pub text: Option<Value>,
    /// `{"effort": ..., "summary": ...}`: effort `"none"` switches the template's thinking off.
    pub reasoning: Option<Value>,
    pub background: Option<bool>,
    pub conversation: Option<Value>,
    pub truncation: Option<String>,
    pub metadata: Option<Value>,
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(default, deserialize_with = "super::openai::object")]
    pub plugins: Option<PluginsField>,
    pub speculative: Option<Value>,
    pub priority: Option<i64>,
}

/// Refuses what this server cannot do rather than ignoring it.
fn check_unsupported(r: &ResponsesRequest) -> Result<(), ApiError> {
    if r.background == Some(true) {
        return Err(ApiError::invalid(
            "background",
            "background responses are not supported; send the request with `stream` instead",
        ));
    }
    if r.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(ApiError::invalid(
            "conversation",
            "conversations are not supported; continue a response with `previous_response_id`",
        ));
    }
    if let Some(t) = r.truncation.as_deref().filter(|t| *t != "disabled") {
        return Err(ApiError::invalid(
            "truncation",
            format!("`truncation` {t:?} is not supported; only \"disabled\" (a prompt too long is refused)"),
        ));
    }
    Ok(())
}

/// Text of an input message's `content`: a string or `input_text`/`output_text` parts.
fn content_text(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, p) in parts.iter().enumerate() {
                let param = format!("{param}[{i}]");
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text" | "summary_text" | "reasoning_text") => text.push_str(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| ApiError::invalid(&param, format!("{param} needs a string `text`")))?,
                    ),
                    Some("refusal") => text.push_str(p.get("refusal").and_then(Value::as_str).unwrap_or_default()),
                    Some(kind @ ("input_image" | "input_file" | "input_audio")) => {
                        return Err(ApiError::invalid(
                            &param,
                            format!(
                                "{param} is an {} part, and this server's model reads text only",
                                super::error::quoted(kind)
                            ),
                        ))
                    }
                    Some(kind) => {
                        return Err(ApiError::invalid(
                            &param,
                            format!(
                                "content parts of type {} are not supported; use input_text",
                                super::error::quoted(kind)
                            ),
                        ))
                    }
                    None => return Err(ApiError::invalid(&param, format!("{param} needs a `type`"))),
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(param, format!("{param} must be a string or a list of content parts"))),
    }
}

/// Input items as chat-template messages: messages (roles user, system, developer,
/// assistant), `function_call` items (joined into the assistant turn they follow),
/// `function_call_output` items (tool messages). A reasoning item's text goes to the
/// assistant turn it precedes as `reasoning_content` (for templates that keep thinking).
pub fn input_messages(input: &Value) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) if !items.is_empty() => items,
        Value::Array(_) => return Err(ApiError::invalid("input", "`input` holds no items")),
        _ => return Err(ApiError::invalid("input", "`input` must be a string or a list of input items")),
    };
    let mut out: Vec<Value> = Vec::new();
    // A reasoning item's text, for the assistant turn it precedes (as `reasoning_content`).
    let mut reasoning = String::new();
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let kind =
            item.get("type").and_then(Value::as_str).unwrap_or(if item.get("role").is_some() { "message" } else { "" });
        let field = |key: &str| {
            item.get(key).and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(&format!("{param}.{key}"), format!("a {kind} item needs a string `{key}`"))
            })
        };
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer" | "system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    other => {
                        return Err(ApiError::invalid(
                            &format!("{param}.role"),
                            format!(
                                "{param}.role must be user, assistant, system or developer, got {}",
                                other.map_or("none".into(), super::error::quoted)
                            ),
                        ))
                    }
                };
                let content = content_text(item.get("content").unwrap_or(&Value::Null), &format!("{param}.content"))?;
                out.push(json!({"role": role, "content": content}));
                if role == "assistant" && !reasoning.is_empty() {
                    out.last_mut().unwrap()["reasoning_content"] = json!(std::mem::take(&mut reasoning));
                }
            }
            "function_call" => {
                let arguments = field("arguments")?;
                let arguments = serde_json::from_str::<Value>(arguments).unwrap_or_else(|_| json!(arguments));
                let call = json!({"id": field("call_id")?, "type": "function", "function": {"name": field("name")?, "arguments": arguments}});
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" => last
                        .as_object_mut()
                        .unwrap()
                        .entry("tool_calls")
                        .or_insert_with(|| json!([]))
                        .as_array_mut()
                        .unwrap()
                        .push(call),
                    _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
                if !reasoning.is_empty() {
                    out.last_mut().unwrap()["reasoning_content"] = json!(std::mem::take(&mut reasoning));
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(o) => content_text(o, &format!("{param}.output"))?,
                    None => {
                        return Err(ApiError::invalid(
                            &format!("{param}.output"),
                            "a function_call_output item needs an `output`",
                        ))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": field("call_id")?, "content": output}));
            }
            "reasoning" => {
                // Raw reasoning text (`content`), else its summary.
                let parts = item.get("content").and_then(Value::as_array).filter(|c| !c.is_empty());
                let parts = parts.or_else(|| item.get("summary").and_then(Value::as_array));
                for p in parts.into_iter().flatten() {
                    reasoning.push_str(p.get("text").and_then(Value::as_str).unwrap_or_default());
                }
            }
            "" => {
                return Err(ApiError::invalid(
                    &param,
                    format!("{param} needs a `type` (message, function_call, function_call_output)"),
                ))
            }
            other => {
                return Err(ApiError::invalid(
                    &param,
                    format!(
                        "input items of type {} are not supported; use message, function_call or function_call_output",
                        super::error::quoted(other)
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// Function tools (`{"type": "function", "name", "description", "parameters", "strict"}`)
/// in the chat shape. Other kinds (`web_search`, `file_search`, `namespace`, `custom`, ...)
/// run on OpenAI's side or need a grammar: they are left out (the model does not see them),
/// and the response's `tools` lists what was used.
pub fn tools(tools: Option<&Vec<Value>>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(tools) = tools else { return Ok(None) };
    let (at, chat): (Vec<usize>, Vec<Value>) = tools
        .iter()
        .enumerate()
        .filter(|(_, t)| {
            let function = t.get("type").and_then(Value::as_str) == Some("function");
            if !function {
                tracing::debug!(tool = %t["type"], "non-function tool left out");
            }
            function
        })
        .map(|(i, t)| {
            let mut f = Map::new();
            for key in ["name", "description", "parameters", "strict"] {
                if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                    f.insert(key.into(), v.clone());
                }
            }
            (i, json!({"type": "function", "function": f}))
        })
        .unzip();
    // An error names the tool as the request wrote it (flat, and counting every tool).
    let flat = [
        (".function.name", ".name"),
        (".function.parameters", ".parameters"),
        (".function.description", ".description"),
        (".function", ""),
    ];
    openai::check_converted_tools(&chat, &at, &flat)?;
    Ok(Some(chat))
}

/// The Responses `tool_choice`: `"auto"`, `"none"`, `"required"` or `{"type": "function",
/// "name": ...}`.
pub fn tool_choice(choice: Option<&Value>, tools: Option<&Vec<Value>>) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        Some(v @ Value::Object(_)) => {
            match (v.get("type").and_then(Value::as_str), v.get("name").and_then(Value::as_str)) {
                (Some("function"), Some(name)) => ToolChoice::Named(name.to_string()),
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "an object `tool_choice` must be {\"type\": \"function\", \"name\": ...}",
                    ))
                }
            }
        }
        other => return openai::tool_choice(other, tools),
    };
    choice.check(tools).map_err(|m| ApiError::invalid("tool_choice", m))
}

/// The turn of a request, continuing `history` (the stored conversation of its
/// `previous_response_id`); also the conversation to store with its response.
pub fn turn(r: &ResponsesRequest, history: Vec<Value>) -> Result<(Turn, Vec<Value>), ApiError> {
    check_unsupported(r)?;
    let input = r.input.as_ref().ok_or_else(|| ApiError::invalid("input", "`input` is required"))?;
    let mut conversation = history;
    conversation.extend(input_messages(input)?);
    let mut messages = Vec::new();
    if let Some(i) = r.instructions.as_deref().filter(|i| !i.is_empty()) {
        messages.push(json!({"role": "system", "content": i}));
    }
    messages.extend(conversation.iter().cloned());
    let tools = tools(r.tools.as_ref())?;
    let tool_choice = tool_choice(r.tool_choice.as_ref(), tools.as_ref())?;
    let max_tokens =
        r.max_output_tokens.map(|_| openai::max_tokens(r.max_output_tokens, "max_output_tokens", 1)).transpose()?;
    let mut turn = Turn {
        input: Input::Messages(messages),
        tools,
        tool_choice,
        one_tool_call: r.parallel_tool_calls == Some(false),
        sampling: r.sampling.to_params(1.0)?,
        max_tokens,
        max_tokens_param: "max_output_tokens",
        prompt_param: "input",
        plugins: r.plugins.clone(),
        speculative: r.speculative.clone(),
        structure: match r.text.as_ref().and_then(|t| t.get("format")).filter(|f| !f.is_null()) {
            Some(format) => openai::response_format(format, "text.format")?,
            None => None,
        },
        priority: openai::priority(r.priority)?,
        client: r.user.clone().or_else(|| r.safety_identifier.clone()),
        template_kwargs: r.chat_template_kwargs.clone(),
        api: Api::Responses,
        model: r.model.clone(),
        ..Turn::default()
    };
    if r.reasoning.as_ref().and_then(|v| v.get("effort")).and_then(Value::as_str) == Some("none") {
        turn.template_default("enable_thinking", json!(false));
    }
    Ok((turn, conversation))
}

/// The `usage` of a response.
pub fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    });
    if let Some(s) = &u.speculative {
        v["speculative"] = openai::speculative_json(s, u.completion_tokens);
    }
    v
}

/// The item being written: a message's text or a function call's arguments.
enum Open {
    Text { id: String, text: String },
    Reasoning { id: String, text: String },
    Call { id: String, call_id: String, name: String, arguments: String },
}

/// Builds one response from the engine's events: its output items, the stream events in
/// grammar order (`(type, data)`; a non-streamed response ignores them) and, at the end,
/// the response object.
pub struct Output {
    /// The response object without `status`, `output`, `usage` (filled in as it goes).
    base: Value,
    items: Vec<Value>,
    open: Option<Open>,
    sequence: u64,
    counter: usize,
    /// The finished response object (after `Done` or a failure).
    pub done: Option<Value>,
}

pub type StreamEvent = (&'static str, Value);

impl Output {
    pub fn new(id: &str, model: &str, created_at: u64, r: &ResponsesRequest, tools: &Option<Vec<Value>>) -> Output {
        let tools: Vec<Value> = tools
            .iter()
            .flatten()
            .map(|t| {
                let mut f = t["function"].clone();
                f["type"] = json!("function");
                f
            })
            .collect();
        let base = json!({
            "id": id, "object": "response", "created_at": created_at, "model": model,
            "background": false, "error": null, "incomplete_details": null,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": r.parallel_tool_calls.unwrap_or(true),
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.as_ref().and_then(|v| v.get("effort")).cloned(), "summary": null},
            "store": r.store.unwrap_or(true),
            "temperature": r.sampling.temperature().unwrap_or(1.0), "top_p": r.sampling.top_p().unwrap_or(1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": r.tool_choice.clone().unwrap_or(json!("auto")),
            "tools": tools, "truncation": "disabled",
            "user": r.user, "metadata": r.metadata.clone().filter(|m| m.is_object()).unwrap_or(json!({})),
        });
        Output { base, items: Vec::new(), open: None, sequence: 0, counter: 0, done: None }
    }

    pub fn id(&self) -> &str {
        self.base["id"].as_str().unwrap_or_default()
    }

    fn response(&self, status: &str, usage: Value) -> Value {
        let mut r = self.base.clone();
        r["status"] = json!(status);
        r["output"] = Value::Array(self.items.clone());
        r["usage"] = usage;
        r
    }

    fn event(&mut self, kind: &'static str, mut data: Value) -> StreamEvent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        (kind, data)
    }

    fn item_id(&mut self, prefix: &str) -> String {
        self.counter += 1;
        let resp = self.id().trim_start_matches("resp_").to_string();
        format!("{prefix}_{resp}{:02x}", self.counter)
    }

    /// `response.created` and `response.in_progress`: sent as soon as the stream opens.
    pub fn opening(&mut self) -> Vec<StreamEvent> {
        let r = self.response("in_progress", Value::Null);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    /// Ends the open item, if any.
    fn close(&mut self) -> Vec<StreamEvent> {
        let index = self.items.len();
        match self.open.take() {
            None => vec![],
            Some(Open::Text { id, text }) => {
                let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let item =
                    json!({"id": id, "type": "message", "status": "completed", "role": "assistant", "content": [part]});
                self.items.push(item.clone());
                vec![
                    self.event(
                        "response.output_text.done",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                    ),
                    self.event(
                        "response.content_part.done",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                    ),
                    self.event("response.output_item.done", json!({"output_index": index, "item": item})),
                ]
            }
            Some(Open::Reasoning { id, text }) => {
                let part = json!({"type": "reasoning_text", "text": text});
                let item =
                    json!({"id": id, "type": "reasoning", "status": "completed", "summary": [], "content": [part]});
                self.items.push(item.clone());
                vec![
                    self.event(
                        "response.reasoning_text.done",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                    ),
                    self.event(
                        "response.content_part.done",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                    ),
                    self.event("response.output_item.done", json!({"output_index": index, "item": item})),
                ]
            }
            Some(Open::Call { id, call_id, name, arguments }) => {
                let item = json!({"id": id, "type": "function_call", "status": "completed", "call_id": call_id, "name": name, "arguments": arguments});
                self.items.push(item.clone());
                vec![
                    self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments}),
                    ),
                    self.event("response.output_item.done", json!({"output_index": index, "item": item})),
                ]
            }
        }
    }

    /// The stream events for one engine event.
    pub fn on(&mut self, event: &Event) -> Vec<StreamEvent> {
        let index = self.items.len();
        match event {
            Event::Started { .. } => vec![],
            Event::Delta { text, .. } if text.is_empty() => vec![],
            Event::Delta { text, .. } => {
                let mut out = vec![];
                if !matches!(self.open, Some(Open::Text { .. })) {
                    out = self.close();
                    let (id, index) = (self.item_id("msg"), self.items.len());
                    out.push(self.event("response.output_item.added", json!({"output_index": index, "item": {"id": id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}})));
                    out.push(self.event("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})));
                    self.open = Some(Open::Text { id, text: String::new() });
                }
                let Some(Open::Text { id, text: all }) = &mut self.open else { unreachable!() };
                all.push_str(text);
                let id = id.clone();
                let index = self.items.len();
                out.push(self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}),
                ));
                out
            }
            Event::Reasoning { text } => {
                let mut out = vec![];
                if !matches!(self.open, Some(Open::Reasoning { .. })) {
                    out = self.close();
                    let (id, index) = (self.item_id("rs"), self.items.len());
                    out.push(self.event("response.output_item.added", json!({"output_index": index, "item": {"id": id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}})));
                    out.push(self.event("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}})));
                    self.open = Some(Open::Reasoning { id, text: String::new() });
                }
                let Some(Open::Reasoning { id, text: all }) = &mut self.open else { unreachable!() };
                all.push_str(text);
                let id = id.clone();
                let index = self.items.len();
                out.push(self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}),
                ));
                out
            }
            Event::ToolCall { id: call_id, name, .. } => {
                let mut out = self.close();
                let (id, index) = (self.item_id("fc"), self.items.len());
                out.push(self.event("response.output_item.added", json!({"output_index": index, "item": {"id": id, "type": "function_call", "status": "in_progress", "call_id": call_id, "name": name, "arguments": ""}})));
                self.open =
                    Some(Open::Call { id, call_id: call_id.clone(), name: name.clone(), arguments: String::new() });
                out
            }
            Event::ToolArgs { delta, .. } => {
                let Some(Open::Call { id, arguments, .. }) = &mut self.open else { return vec![] };
                arguments.push_str(delta);
                let id = id.clone();
                vec![self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": delta}),
                )]
            }
            Event::Done { finish, usage } => {
                let mut out = self.close();
                let (status, kind) = match finish {
                    Finish::Length => ("incomplete", "response.incomplete"),
                    _ => ("completed", "response.completed"),
                };
                let mut r = self.response(status, usage_json(usage));
                if status == "incomplete" {
                    r["incomplete_details"] = json!({"reason": "max_output_tokens"});
                }
                out.push(self.event(kind, json!({"response": r})));
                self.done = Some(r);
                out
            }
            Event::Error(_)
            | Event::Refused(_)
            | Event::PluginFault(_)
            | Event::Constraint { .. }
            | Event::Cancelled(_) => {
                let message = super::reply::stream_error_message(event);
                let mut out = self.close();
                let mut r = self.response("failed", Value::Null);
                let code = super::reply::stream_error_code(event).1.unwrap_or("server_error");
                r["error"] = json!({"code": code, "message": message});
                out.push(self.event("response.failed", json!({"response": r})));
                self.done = Some(r);
                out
            }
        }
    }

    /// The assistant's turn as chat-template messages, for the stored conversation.
    pub fn as_messages(&self) -> Vec<Value> {
        let mut msg = json!({"role": "assistant", "content": ""});
        let mut calls = Vec::new();
        for item in &self.items {
            match item["type"].as_str() {
                Some("message") => {
                    let text = item.pointer("/content/0/text").and_then(Value::as_str).unwrap_or_default();
                    msg["content"] = json!(format!("{}{text}", msg["content"].as_str().unwrap_or_default()));
                }
                Some("reasoning") => {
                    let text = item.pointer("/content/0/text").and_then(Value::as_str).unwrap_or_default();
                    msg["reasoning_content"] = json!(text);
                }
                Some("function_call") => {
                    let args = item["arguments"].as_str().unwrap_or("{}");
                    let args = serde_json::from_str::<Value>(args).unwrap_or_else(|_| json!(args));
                    calls.push(json!({"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}));
                }
                _ => {}
            }
        }
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        vec![msg]
    }
}

/// A request's `input` as input items (a string is one user message).
pub fn input_items(input: &Value) -> Vec<Value> {
    match input {
        Value::String(s) => {
            vec![json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": s}]})]
        }
        Value::Array(items) => items.clone(),
        _ => vec![],
    }
}

/// `POST /v1/responses`: the request made into the one request (`turn`), the engine's events
/// written by `Output` as a response or its stream of events; stored unless `store: false`.
pub(super) async fn create_response(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_body(body)?;
    let history = match req.previous_response_id.as_deref() {
        None => vec![],
        Some(id) => state.responses.get(id).map(|s| s.conversation).ok_or_else(|| {
            ApiError::invalid("previous_response_id", format!("`previous_response_id` names no stored response {id:?}: it was never stored (`store: false`), was deleted, or is older than the newest {} this server keeps", Store::MAX_RESPONSES))
                .with_code("previous_response_not_found")
        })?,
    };
    let (turn, conversation) = turn(&req, history)?;
    let tools = turn.shown_tools().cloned();
    let rx = state.begin(turn, req.stream).await?.events;
    let mut output = Output::new(&request_id("resp_"), &state.model_id, now(), &req, &tools);
    let store = req.store.unwrap_or(true);
    let input_items = input_items(req.input.as_ref().unwrap_or(&Value::Null));
    let keep = {
        let state = state.clone();
        move |output: &Output| {
            if let (true, Some(done)) = (store, output.done.as_ref()) {
                let mut conversation = conversation.clone();
                conversation.extend(output.as_messages());
                state.responses.put(done.clone(), conversation, input_items.clone());
            }
        }
    };
    if !req.stream {
        let mut rx = rx;
        while let Some(event) = rx.recv().await {
            if let Some(error) = failure(&event) {
                return Err(error);
            }
            output.on(&event);
            if let Some(done) = output.done.clone() {
                keep(&output);
                return Ok(Json(done).into_response());
            }
        }
        return Err(ApiError::internal("the engine dropped the request"));
    }
    let sse = |(kind, data): StreamEvent| SseEvent::default().event(kind).data(data.to_string());
    let opening = output.opening().into_iter().map(sse).collect();
    stream(
        state.clone(),
        rx,
        opening,
        move |event| {
            let events = output.on(event).into_iter().map(sse).collect();
            if matches!(event, Event::Done { .. }) {
                keep(&output);
            }
            events
        },
        false,
    )
    .await
}

fn no_response(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no stored response {id:?} (responses are kept when created with `store`, up to the newest {})",
            Store::MAX_RESPONSES
        ),
    )
}

pub(super) async fn get_response(State(state): State<Shared>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    state.responses.get(&id).map(|s| Json(s.response)).ok_or_else(|| no_response(&id))
}

pub(super) async fn delete_response(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    match state.responses.delete(&id) {
        true => Ok(Json(json!({"id": id, "object": "response", "deleted": true}))),
        false => Err(no_response(&id)),
    }
}

pub(super) async fn response_input_items(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let items = state.responses.get(&id).ok_or_else(|| no_response(&id))?.input_items;
    let id_of = |i: Option<&Value>| i.and_then(|i| i.get("id")).cloned().unwrap_or(Value::Null);
    Ok(Json(
        json!({"object": "list", "data": items, "first_id": id_of(items.first()), "last_id": id_of(items.last()), "has_more": false}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::store::Store;

    #[test]
    fn input_items_become_template_messages_with_calls_joined_to_their_turn() {
        let input = json!([
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{\"city\": \"Rome\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "cold"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "warm"}]},
        ]);
        let m = input_messages(&input).unwrap();
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(m[2]["tool_calls"][1]["function"]["arguments"], json!({"city": "Rome"}));
        assert_eq!(m[2]["reasoning_content"], "look it up");
        assert_eq!(m[4], json!({"role": "tool", "tool_call_id": "c2", "content": "warm"}));
        for (bad, want) in [
            (
                json!([{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                "reads text only",
            ),
            (json!([{"type": "function_call", "name": "f", "arguments": "{}"}]), "`call_id`"),
            (json!([{"type": "web_search_call"}]), "not supported"),
            (json!([{"content": "x"}]), "needs a `type`"),
            (json!([]), "no items"),
            (json!(3), "string or a list"),
        ] {
            let e = input_messages(&bad).unwrap_err();
            assert!(e.message.contains(want), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn the_output_follows_the_event_grammar() {
        let r: ResponsesRequest = serde_json::from_value(json!({"input": "hi"})).unwrap();
        let mut o = Output::new("resp_1", "m", 0, &r, &None);
        let mut kinds: Vec<&str> = o.opening().iter().map(|e| e.0).collect();
        let events = [
            Event::Started { prompt_tokens: 3, cached_tokens: 0 },
            Event::Reasoning { text: "hm".into() },
            Event::Reasoning { text: "m".into() },
            Event::Delta { text: "a".into(), logprobs: vec![] },
            Event::Delta { text: "b".into(), logprobs: vec![] },
            Event::ToolCall { index: 0, id: "call_1".into(), name: "f".into() },
            Event::ToolArgs { index: 0, delta: "{}".into() },
            Event::Done {
                finish: Finish::ToolCalls,
                usage: Usage { prompt_tokens: 3, completion_tokens: 4, ..Default::default() },
            },
        ];
        let mut sequence = vec![];
        for e in &events {
            for (kind, data) in o.on(e) {
                assert_eq!(data["type"], kind);
                sequence.push(data["sequence_number"].as_u64().unwrap());
                kinds.push(kind);
            }
        }
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert!(sequence.windows(2).all(|w| w[1] == w[0] + 1), "{sequence:?}");
        let done = o.done.as_ref().unwrap();
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["type"], "reasoning");
        assert_eq!(done["output"][0]["content"][0], json!({"type": "reasoning_text", "text": "hmm"}));
        assert_eq!(done["output"][1]["content"][0]["text"], "ab");
        assert_eq!(done["output"][2]["call_id"], "call_1");
        assert_eq!(done["usage"]["total_tokens"], 7);
        let m = o.as_messages();
        assert_eq!((m[0]["content"].as_str(), m[0]["reasoning_content"].as_str()), (Some("ab"), Some("hmm")));
        assert_eq!(m[0]["tool_calls"][0]["function"]["arguments"], json!({}));
    }

    #[test]
    fn the_store_keeps_the_newest_within_its_bounds() {
        let store = Store::default();
        for i in 0..Store::MAX_RESPONSES + 5 {
            store.put(json!({"id": format!("resp_{i}")}), vec![], vec![]);
        }
        assert!(store.get("resp_0").is_none());
        assert!(store.get(&format!("resp_{}", Store::MAX_RESPONSES + 4)).is_some());
        assert!(store.delete("resp_10"));
        assert!(!store.delete("resp_10"));
        let big = json!({"id": "resp_big", "x": "a".repeat(Store::MAX_BYTES / 2)});
        store.put(big.clone(), vec![], vec![]);
        store.put(json!({"id": "resp_big2", "x": "a".repeat(Store::MAX_BYTES / 2)}), vec![], vec![]);
        assert!(store.get("resp_big").is_none(), "over the byte bound the oldest goes");
        assert!(store.get("resp_big2").is_some());
    }
}
