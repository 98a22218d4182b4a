//! `POST /v1/messages`: the Anthropic Messages request made into the one request (`Turn`,
//! by `anthropic::turn`), and the engine's events written as a message or as its stream of
//! named events (content blocks opened as they are needed: thinking, text, one per tool
//! call).

use super::anthropic::{self, MessagesRequest};
use super::error::{parse_body, ApiError, Flavor};
use super::openai;
use super::reply::{collect, named, request_id, stream, stream_error, Completion};
use super::state::Shared;
use crate::engine::job::{Event, Finish, Usage};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

pub(super) async fn messages(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: MessagesRequest = parse_body(body)?;
    let turn = anthropic::turn(&req, false)?;
    let rx = state.begin(turn, req.stream).await?.events;
    let mut wire = Wire { id: request_id("msg_"), model: state.model_id.clone(), open: None };
    if !req.stream {
        let c = collect(&state, rx).await?;
        return Ok(Json(wire.whole(&c)).into_response());
    }
    stream(state.clone(), rx, vec![], move |event| wire.events(event), false).await
}

/// The kind of an Anthropic stream's content block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
    Tool,
}

/// How one message is written: its id and model and, streaming, the open content block.
struct Wire {
    id: String,
    model: String,
    /// The open block: (index, kind). Content blocks come in order, each opened by what
    /// first needs it: a thinking block for reasoning, a text block for text, a block per
    /// tool call, a new text block if text follows a call (as in the whole message, a call
    /// at the very start is block 0).
    open: Option<(usize, Block)>,
}

impl Wire {
    /// The whole message.
    fn whole(&self, c: &Completion) -> Value {
        let (reason, sequence) = anthropic::stop_reason(&c.finish);
        let mut content = Vec::new();
        if !c.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": c.reasoning, "signature": ""}));
        }
        if !c.text.is_empty() || c.tool_calls.is_empty() {
            content.push(json!({"type": "text", "text": c.text}));
        }
        content.extend(c.tool_calls.iter().map(anthropic::tool_use_block));
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": anthropic::usage_json(&c.usage),
        })
    }

    /// The stream's events for one engine event.
    fn events(&mut self, event: &Event) -> Vec<SseEvent> {
        match event {
            Event::Started { prompt_tokens, cached_tokens } => vec![
                named(
                    "message_start",
                    json!({"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                    "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens, "output_tokens": 0}}}),
                ),
                named("ping", json!({"type": "ping"})),
            ],
            Event::Delta { text, .. } if text.is_empty() => vec![],
            Event::Delta { text, .. } => self.delta(
                Block::Text,
                json!({"type": "text", "text": ""}),
                json!({"type": "text_delta", "text": text}),
            ),
            Event::Reasoning { text } => self.delta(
                Block::Thinking,
                json!({"type": "thinking", "thinking": "", "signature": ""}),
                json!({"type": "thinking_delta", "thinking": text}),
            ),
            Event::ToolCall { id, name, .. } => {
                let call = openai::ToolCall { id: id.clone(), name: name.clone(), arguments: String::new() };
                let mut start = anthropic::tool_use_block(&call);
                start["input"] = json!({});
                self.open_block(Block::Tool, start)
            }
            Event::ToolArgs { delta, .. } => vec![named(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.index(), "delta": {"type": "input_json_delta", "partial_json": delta}}),
            )],
            Event::Done { finish, usage } => self.done(finish, usage),
            e @ (Event::Error(_)
            | Event::Refused(_)
            | Event::PluginFault(_)
            | Event::Constraint { .. }
            | Event::Cancelled(_)) => {
                vec![stream_error(e, Flavor::Anthropic)]
            }
        }
    }

    fn index(&self) -> usize {
        self.open.map_or(0, |(i, _)| i)
    }

    /// A delta of a block of `kind`, opening one (with `start`) unless one is open.
    fn delta(&mut self, kind: Block, start: Value, delta: Value) -> Vec<SseEvent> {
        let mut out = vec![];
        if !matches!(self.open, Some((_, k)) if k == kind) {
            out = self.open_block(kind, start);
        }
        out.push(named(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index(), "delta": delta}),
        ));
        out
    }

    /// The end: the last block closed (a reply with no text and no call ends with an empty
    /// text block, as the whole message), then the stop reason and usage.
    fn done(&mut self, finish: &Finish, usage: &Usage) -> Vec<SseEvent> {
        let (reason, sequence) = anthropic::stop_reason(finish);
        let mut out = match self.open {
            Some((_, Block::Text | Block::Tool)) => vec![],
            _ => self.open_block(Block::Text, json!({"type": "text", "text": ""})),
        };
        out.extend([
            named("content_block_stop", json!({"type": "content_block_stop", "index": self.index()})),
            named(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": anthropic::usage_json(usage)}),
            ),
            named("message_stop", json!({"type": "message_stop"})),
        ]);
        out
    }

    /// Closes the open content block, if any, and opens the next (of `kind`) with `start`.
    fn open_block(&mut self, kind: Block, start: Value) -> Vec<SseEvent> {
        let mut out = vec![];
        let index = match self.open {
            Some((i, _)) => {
                out.push(named("content_block_stop", json!({"type": "content_block_stop", "index": i})));
                i + 1
            }
            None => 0,
        };
        self.open = Some((index, kind));
        out.push(named(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        out
    }
}

/// `POST /v1/messages/count_tokens`: the tokens `messages` would prompt with.
pub(super) async fn count_tokens(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: anthropic::MessagesRequest = parse_body(body)?;
    // The same prompt `messages` would build: tool descriptions and a forced call's opener.
    let tokens = state.count(anthropic::turn(&req, true)?).await?;
    Ok(Json(json!({"input_tokens": tokens})))
}
