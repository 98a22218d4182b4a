//! `POST /v1/chat/completions`: the OpenAI chat request (`openai::ChatRequest`) made into the
//! one request (`Turn`), and the engine's events rendered as a chat completion or its
//! chunks (`chat.completion.chunk`, with `reasoning_content`/`reasoning` and `tool_calls`
//! deltas; usage last when `stream_options.include_usage`).

use super::error::{parse_body, ApiError, Flavor};
use super::openai::{self, ChatRequest};
use super::reply::{collect, data, now, request_id, stream, stream_error, Completion};
use super::state::Shared;
use super::turn::{Api, Input, Turn};
use crate::engine::job::{Event, Usage};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

pub(super) async fn chat_completions(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    let (streamed, include_usage) = (req.stream, req.stream_options.as_ref().is_some_and(|o| o.include_usage));
    let turn = turn(req)?;
    let wire = Wire {
        id: request_id("chatcmpl-"),
        created: now(),
        model: state.model_id.clone(),
        top_logprobs: turn.top_logprobs,
        include_usage,
    };
    let rx = state.begin(turn, streamed).await?.events;
    if !streamed {
        let c = collect(&state, rx).await?;
        return Ok(Json(wire.whole(&c)).into_response());
    }
    stream(state.clone(), rx, vec![], move |event| wire.chunks(event), true).await
}

/// `top_logprobs` when `logprobs` is on (0 to 20 alternatives a token).
fn top_logprobs(req: &ChatRequest) -> Result<Option<usize>, ApiError> {
    if let Some(k) = req.top_logprobs.filter(|k| !(0..=20).contains(k)) {
        return Err(ApiError::invalid("top_logprobs", format!("`top_logprobs` must be between 0 and 20, got {k}")));
    }
    Ok(req.logprobs.then(|| req.top_logprobs.unwrap_or(0) as usize))
}

/// The chat request as the one request every API makes.
fn turn(req: ChatRequest) -> Result<Turn, ApiError> {
    openai::check_n(req.n)?;
    req.check_unsupported()?;
    let structure = openai::structure(&req.structured)?;
    let sampling = req.sampling.to_params(1.0)?;
    let max = match req.max_completion_tokens {
        Some(_) => Some(openai::max_tokens(req.max_completion_tokens, "max_completion_tokens", 1)?),
        None => req.max_tokens.map(|_| openai::max_tokens(req.max_tokens, "max_tokens", 1)).transpose()?,
    };
    let top_logprobs = top_logprobs(&req)?;
    let messages = openai::template_messages(&req.messages)?;
    openai::check_tools(req.tools.as_ref())?;
    let tool_choice = openai::tool_choice(req.tool_choice.as_ref(), req.tools.as_ref())?;
    Ok(Turn {
        input: Input::Messages(messages),
        tools: req.tools,
        tool_choice,
        one_tool_call: req.parallel_tool_calls == Some(false),
        sampling,
        max_tokens: max,
        stop: openai::stops(req.stop)?,
        top_logprobs,
        plugins: req.plugins,
        speculative: req.speculative,
        structure,
        priority: openai::priority(req.priority)?,
        client: req.user,
        template_kwargs: req.chat_template_kwargs,
        api: Api::Chat,
        max_tokens_is_ceiling: false,
        max_tokens_param: if req.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" },
        prompt_param: "messages",
        model: req.model,
    })
}

/// How one chat completion is written: its id, time, model, and what the client asked to see.
struct Wire {
    id: String,
    created: u64,
    model: String,
    top_logprobs: Option<usize>,
    include_usage: bool,
}

impl Wire {
    /// The whole `chat.completion`.
    fn whole(&self, c: &Completion) -> Value {
        let logprobs = if self.top_logprobs.is_some() {
            json!({"content": openai::chat_logprobs(&c.logprobs)})
        } else {
            Value::Null
        };
        let mut message = json!({"role": "assistant", "content": c.text});
        if !c.reasoning.is_empty() {
            // `reasoning_content` as vLLM and DeepSeek name it, `reasoning` as mlx-lm does.
            message["reasoning_content"] = json!(c.reasoning);
            message["reasoning"] = json!(c.reasoning);
        }
        if !c.tool_calls.is_empty() {
            if c.text.is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = openai::tool_calls_json(&c.tool_calls);
        }
        json!({
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": c.finish.reason()}],
            "usage": openai::usage_json(&c.usage),
        })
    }

    fn chunk(&self, delta: Value, logprobs: Value, finish: Value) -> SseEvent {
        data(json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}))
    }

    fn usage_chunk(&self, u: &Usage) -> SseEvent {
        data(json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [], "usage": openai::usage_json(u)}))
    }

    /// The stream's chunks for one engine event.
    fn chunks(&self, event: &Event) -> Vec<SseEvent> {
        let none = || Value::Null;
        match event {
            Event::Started { .. } => vec![self.chunk(json!({"role": "assistant", "content": ""}), none(), none())],
            Event::Delta { text, logprobs } => {
                let lp = match self.top_logprobs {
                    Some(_) => json!({"content": openai::chat_logprobs(logprobs)}),
                    None => none(),
                };
                vec![self.chunk(json!({"content": text}), lp, none())]
            }
            Event::Reasoning { text } => {
                vec![self.chunk(json!({"reasoning_content": text, "reasoning": text}), none(), none())]
            }
            Event::ToolCall { index, id, name } => vec![self.chunk(
                json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                none(),
                none(),
            )],
            Event::ToolArgs { index, delta } => vec![self.chunk(
                json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}),
                none(),
                none(),
            )],
            Event::Done { finish, usage } => {
                let mut out = vec![self.chunk(json!({}), none(), json!(finish.reason()))];
                if self.include_usage {
                    out.push(self.usage_chunk(usage));
                }
                out
            }
            e @ (Event::Error(_) | Event::Refused(_) | Event::PluginFault(_) | Event::Constraint { .. } | Event::Cancelled(_)) => {
                vec![stream_error(e, Flavor::OpenAi)]
            }
        }
    }
}
