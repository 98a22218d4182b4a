//! The one event stream of a request rendered to its client: collected into one reply or
//! streamed as server-sent events (headers once the job starts, keep-alive comments while it
//! waits), and a failure shaped for the request's API, before or inside the stream.

use super::error::{ApiError, Flavor};
use super::state::{AppState, Shared};

use super::openai;

use crate::engine::job::{Cancel, Event, Finish, TokenLogprob, Usage};

use axum::http::StatusCode;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};

use serde_json::{json, Value};
use std::convert::Infallible;

use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tokio_stream::wrappers::ReceiverStream;

pub(super) fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(super) fn request_id(prefix: &str) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}{:x}{n:04x}", nanos & 0xffff_ffff_ffff)
}

/// A finished non-streamed generation.
pub(super) struct Completion {
    pub(super) text: String,
    /// The model's thinking, as the reasoning parser split it off.
    pub(super) reasoning: String,
    pub(super) logprobs: Vec<TokenLogprob>,
    pub(super) tool_calls: Vec<openai::ToolCall>,
    pub(super) finish: Finish,
    pub(super) usage: Usage,
}

pub(super) async fn collect(state: &AppState, mut rx: UnboundedReceiver<Event>) -> Result<Completion, ApiError> {
    let start = Instant::now();
    let (mut text, mut reasoning, mut logprobs, mut first) = (String::new(), String::new(), Vec::new(), true);
    let mut tool_calls: Vec<openai::ToolCall> = Vec::new();
    while let Some(event) = rx.recv().await {
        match event {
            Event::Started { .. } => {}
            Event::ToolCall { id, name, .. } => {
                tool_calls.push(openai::ToolCall { id, name, arguments: String::new() })
            }
            Event::ToolArgs { index, delta } => {
                if let Some(c) = tool_calls.get_mut(index) {
                    c.arguments.push_str(&delta);
                }
            }
            Event::Delta { text: t, logprobs: l } => {
                if first {
                    state.metrics.time_to_first_token(start.elapsed().as_secs_f64());
                    first = false;
                }
                text.push_str(&t);
                logprobs.extend(l);
            }
            Event::Reasoning { text: t } => {
                if first {
                    state.metrics.time_to_first_token(start.elapsed().as_secs_f64());
                    first = false;
                }
                reasoning.push_str(&t);
            }
            Event::Done { finish, usage } => {
                tracing::info!(
                    prompt = usage.prompt_tokens,
                    cached = usage.cached_tokens,
                    completion = usage.completion_tokens,
                    finish = finish.reason(),
                    "generation"
                );
                return Ok(Completion { text, reasoning, logprobs, tool_calls, finish, usage });
            }
            e => return Err(failure(&e).expect("a failure event")),
        }
    }
    Err(ApiError::internal("the engine dropped the request"))
}

/// The request was stopped before it finished: a 409 when the scheduling policy cancelled
/// it, a 503 when the server's shutdown did.
pub(super) fn cancelled(cancel: Cancel) -> ApiError {
    if cancel.shutdown {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, cancel.message).with_code("server_shutting_down")
    } else {
        ApiError::new(StatusCode::CONFLICT, cancel.message).with_code("cancelled_by_scheduler")
    }
}

/// A plugin failed this request: a 500 whose message names the plugin (not an internal bug).
pub(super) fn plugin_fault(message: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).with_code("plugin_error")
}

/// The HTTP error of an engine event that ends a request before it produced anything.
pub(super) fn failure(event: &Event) -> Option<ApiError> {
    match event {
        Event::Refused(m) => Some(ApiError::invalid("plugins", super::error::readable(m))),
        Event::PluginFault(m) => Some(plugin_fault(m.clone())),
        Event::Constraint { param, message } => {
            Some(ApiError::invalid(param, message.clone()).with_code("constraint_failed"))
        }
        Event::Error(e) => Some(ApiError::internal(e)),
        Event::Cancelled(m) => Some(cancelled(m.clone())),
        _ => None,
    }
}

/// How long a stream waits for its job to start before it sends its headers: a failure
/// within it (a refused plugin config, a plugin failing at its start) is still a plain HTTP
/// error. Past it (a queue, a long prefill) the headers go out and SSE keep-alive comments
/// every [`KEEP_ALIVE`] hold the connection, so that clients with a first-byte or idle
/// timeout (Bun's fetch gives up at 300 s) wait; a failure then arrives in the stream.
pub(super) const START_GRACE: std::time::Duration = std::time::Duration::from_millis(1500);

pub(super) const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(5);

/// Streams engine events as SSE: `opening` as soon as the stream opens, then `render` turns
/// each event into SSE events (or nothing). The task ends, cancelling the job, as soon as
/// the client disconnects, also while the prompt is still being prefilled.
pub(super) async fn stream<F>(
    state: Shared,
    mut rx: UnboundedReceiver<Event>,
    opening: Vec<SseEvent>,
    mut render: F,
    done_marker: bool,
) -> Result<Response, ApiError>
where
    F: FnMut(&Event) -> Vec<SseEvent> + Send + 'static,
{
    let start = Instant::now();
    let first = match tokio::time::timeout(START_GRACE, rx.recv()).await {
        Ok(Some(e)) => match failure(&e) {
            Some(error) => return Err(error),
            None => Some(e),
        },
        Ok(None) => return Err(ApiError::internal("the engine dropped the request")),
        Err(_) => None,
    };
    let (tx, out) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        for e in opening {
            if tx.send(Ok(e)).await.is_err() {
                return;
            }
        }
        let mut last: Option<Instant> = None;
        let mut first = first;
        loop {
            let event = match first.take() {
                Some(e) => e,
                None => tokio::select! {
                    e = rx.recv() => match e {
                        Some(e) => e,
                        None => break,
                    },
                    // Client gone: dropping `rx` cancels the job.
                    _ = tx.closed() => return,
                },
            };
            if let Event::Delta { .. } = event {
                let now = Instant::now();
                match last {
                    None => state.metrics.time_to_first_token((now - start).as_secs_f64()),
                    Some(prev) => state.metrics.inter_token((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
            if let Event::Done { finish, usage } = &event {
                tracing::info!(
                    prompt = usage.prompt_tokens,
                    cached = usage.cached_tokens,
                    completion = usage.completion_tokens,
                    finish = finish.reason(),
                    "generation (streamed)"
                );
            }
            let end = matches!(
                event,
                Event::Done { .. }
                    | Event::Error(_)
                    | Event::Refused(_)
                    | Event::PluginFault(_)
                    | Event::Constraint { .. }
                    | Event::Cancelled(_)
            );
            for e in render(&event) {
                if tx.send(Ok(e)).await.is_err() {
                    return; // Client gone: dropping `rx` cancels the job.
                }
            }
            if end {
                break;
            }
        }
        if done_marker {
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        }
    });
    Ok(Sse::new(ReceiverStream::new(out)).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response())
}

pub(super) fn data(v: Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// What the client is told of a failure after its stream started: internal details go to
/// the log; plugin faults and refusals are shown as they are (they name the plugin).
pub(super) fn stream_error_message(event: &Event) -> String {
    match event {
        Event::Error(m) => {
            tracing::error!("generation failed mid-stream: {m}");
            "internal error; see the server log".to_string()
        }
        Event::Refused(m) => super::error::readable(m),
        Event::PluginFault(m) | Event::Constraint { message: m, .. } => m.clone(),
        Event::Cancelled(c) => c.message.clone(),
        _ => String::new(),
    }
}

/// The OpenAI `type` and `code` of a failure after the stream started (as the same failure
/// before it would have had).
pub(super) fn stream_error_code(event: &Event) -> (&'static str, Option<&'static str>) {
    match event {
        Event::PluginFault(_) => ("server_error", Some("plugin_error")),
        Event::Refused(_) => ("invalid_request_error", Some("plugin_refused")),
        Event::Constraint { .. } => ("invalid_request_error", Some("constraint_failed")),
        Event::Cancelled(c) if c.shutdown => ("server_error", Some("server_shutting_down")),
        Event::Cancelled(_) => ("invalid_request_error", Some("cancelled_by_scheduler")),
        _ => ("server_error", None),
    }
}

/// The Anthropic error `type` of a failure after the stream started, as the same failure
/// before it would have had: a refused plugin config, a constraint that cannot go on and a
/// scheduler's cancel are the client's (`invalid_request_error`), a shutdown is
/// `overloaded_error` (clients retry it), the rest `api_error`.
pub(super) fn stream_error_type(event: &Event) -> &'static str {
    match event {
        Event::Error(_) => "api_error",
        _ => failure(event).map_or("api_error", |e| e.anthropic_type()),
    }
}

/// An error after the stream started: internal details go to the log; plugin faults and
/// refusals are shown as they are (they name the plugin).
pub(super) fn stream_error(event: &Event, flavor: Flavor) -> SseEvent {
    let message = stream_error_message(event);
    match flavor {
        Flavor::OpenAi => {
            let (kind, code) = stream_error_code(event);
            data(json!({"error": {"message": message, "type": kind, "param": null, "code": code}}))
        }
        Flavor::Anthropic => {
            let kind = stream_error_type(event);
            SseEvent::default()
                .event("error")
                .data(json!({"type": "error", "error": {"type": kind, "message": message}}).to_string())
        }
    }
}

/// A named SSE event (the Anthropic stream's shape).
pub(super) fn named(name: &str, v: Value) -> SseEvent {
    SseEvent::default().event(name).data(v.to_string())
}
