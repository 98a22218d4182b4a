//! `POST /v1/completions`: a raw prompt (text, or token ids) continued, with no chat
//! template, tools or reasoning parser: the request made into the one request (`Turn`, its
//! input the prompt's tokens), and the events written as a `text_completion` or its chunks
//! (the prompt first when `echo`).

use super::error::{parse_body, ApiError, Flavor};
use super::openai::{self, CompletionRequest, Prompt, ToolChoice};
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

pub(super) async fn completions(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    let (streamed, echo) = (req.stream, req.echo);
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let (turn, prompt_text) = turn(&state, req).await?;
    let mut wire = Wire {
        id: request_id("cmpl-"),
        created: now(),
        model: state.model_id.clone(),
        echo: if echo { prompt_text } else { String::new() },
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

/// The completion request as the one request every API makes, and the prompt's text (for
/// `echo`).
async fn turn(state: &Shared, req: CompletionRequest) -> Result<(Turn, String), ApiError> {
    openai::check_n(req.n)?;
    let sampling = req.sampling.to_params(1.0)?;
    let max = openai::max_tokens(req.max_tokens, "max_tokens", 16)?;
    let (prompt, prompt_text) = match req.prompt {
        Prompt::Text(t) => (state.encode(t.clone(), true).await?, t),
        Prompt::Texts(mut v) if v.len() == 1 => {
            let t = v.remove(0);
            (state.encode(t.clone(), true).await?, t)
        }
        Prompt::Texts(v) => {
            return Err(ApiError::invalid("prompt", format!("`prompt` must hold exactly one string, got {}", v.len())))
        }
        Prompt::Tokens(ids) => {
            let vocab = state.engine.info.vocab_size;
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::invalid("prompt", format!("token {bad} is outside the vocabulary of {vocab}")));
            }
            let text = state.engine.tokenizer.decode(&ids).map_err(ApiError::internal)?;
            (ids, text)
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` is empty"));
    }
    let top_logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=5).contains(&k) => Some(k as usize),
        Some(k) => return Err(ApiError::invalid("logprobs", format!("`logprobs` must be between 0 and 5, got {k}"))),
    };
    let turn = Turn {
        input: Input::Tokens(prompt),
        tools: None,
        tool_choice: ToolChoice::None,
        one_tool_call: false,
        sampling,
        max_tokens: Some(max),
        max_tokens_is_ceiling: false,
        max_tokens_param: "max_tokens",
        prompt_param: "prompt",
        stop: openai::stops(req.stop)?,
        top_logprobs,
        plugins: req.plugins,
        speculative: req.speculative,
        structure: openai::structure(&req.structured)?,
        priority: openai::priority(req.priority)?,
        client: req.user,
        template_kwargs: None,
        api: Api::Completions,
        model: req.model,
    };
    Ok((turn, prompt_text))
}

/// How one completion is written: its id, time and model, the prompt when echoed (sent
/// once, first), and what the client asked to see.
struct Wire {
    id: String,
    created: u64,
    model: String,
    echo: String,
    top_logprobs: Option<usize>,
    include_usage: bool,
}

impl Wire {
    /// The whole `text_completion`.
    fn whole(&self, c: &Completion) -> Value {
        let logprobs = match self.top_logprobs {
            Some(_) => openai::completion_logprobs(&c.logprobs, self.echo.len()),
            None => Value::Null,
        };
        json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": format!("{}{}", self.echo, c.text), "logprobs": logprobs, "finish_reason": c.finish.reason()}],
            "usage": openai::usage_json(&c.usage),
        })
    }

    fn chunk(&self, text: &str, logprobs: Value, finish: Value, usage: Option<&Usage>) -> SseEvent {
        let mut v = json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]});
        if let Some(u) = usage {
            v["choices"] = json!([]);
            v["usage"] = openai::usage_json(u);
        }
        data(v)
    }

    /// The stream's chunks for one engine event.
    fn chunks(&mut self, event: &Event) -> Vec<SseEvent> {
        match event {
            Event::Started { .. } if self.echo.is_empty() => vec![],
            Event::Started { .. } => {
                let echo = std::mem::take(&mut self.echo);
                vec![self.chunk(&echo, Value::Null, Value::Null, None)]
            }
            Event::Delta { text, logprobs } => {
                let lp = match self.top_logprobs {
                    Some(_) => openai::completion_logprobs(logprobs, 0),
                    None => Value::Null,
                };
                vec![self.chunk(text, lp, Value::Null, None)]
            }
            Event::Done { finish, usage } => {
                let mut out = vec![self.chunk("", Value::Null, json!(finish.reason()), None)];
                if self.include_usage {
                    out.push(self.chunk("", Value::Null, Value::Null, Some(usage)));
                }
                out
            }
            // A completion has no tools and no reasoning parser (`plugins` refuses one).
            Event::ToolCall { .. } | Event::ToolArgs { .. } | Event::Reasoning { .. } => vec![],
            e @ (Event::Error(_)
            | Event::Refused(_)
            | Event::PluginFault(_)
            | Event::Constraint { .. }
            | Event::Cancelled(_)) => {
                vec![stream_error(e, Flavor::OpenAi)]
            }
        }
    }
}
