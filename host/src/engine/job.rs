//! What the server and the engine say to each other about one request: the request
//! (`JobRequest`), the events that come back (`Event`: text, tool calls, reasoning, the
//! finish and its usage, or why it failed), and why a request was not taken (`SubmitError`).

use super::constraint::ConstraintSpec;
use super::hooks::RequestHooks;
use super::{SamplingParams, SpecConfig, SpecMethod};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// One generation request, as the server hands it to the engine.
#[derive(Debug, Clone)]
pub struct JobRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Return this many alternatives with each token's log-probability (`None`: no logprobs).
    pub top_logprobs: Option<usize>,
    /// What the request brings along (its plugins: sampler, stop rules, tool adapter,
    /// reasoning parser), started with it on the engine thread.
    pub hooks: Option<Arc<dyn RequestHooks>>,
    /// Text that opens the reply: a call the request forces (`tool_choice`), already at the
    /// end of the prompt; fed to the tool parser ahead of the output.
    pub reply_prefix: Option<String>,
    /// At most one tool call: the reply ends when the tool parser reports a second.
    pub one_tool_call: bool,
    /// Speculative decoding for this request (`SpecMethod::Off` for none).
    pub speculative: SpecConfig,
    /// What the output is held to (structured output), if anything.
    pub constraint: Option<ConstraintSpec>,
    /// For the scheduling policy: higher is more urgent (default 0).
    pub priority: i64,
    /// For the scheduling policy: who sent it (OpenAI `user`, Anthropic `metadata.user_id`).
    pub client: Option<String>,
}

/// A token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// Why a job finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token.
    Eos,
    /// A stop string matched (it is not part of the text).
    StopString(String),
    /// A stop-rule plugin ended generation.
    StopRule(String),
    Length,
    /// The model called tools (the tool adapter reported calls).
    ToolCalls,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            Finish::Eos | Finish::StopString(_) | Finish::StopRule(_) => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prompt cache.
    pub cached_tokens: usize,
    /// Set when the request decoded speculatively.
    pub speculative: Option<SpecUsage>,
}

/// How speculation went for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecUsage {
    pub method: SpecMethod,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    /// Target-model forwards while decoding (plain steps and verifications).
    pub target_steps: usize,
}

/// What a job reports, in order: `Started`, any number of `Delta`s, then `Done` or `Error`.
#[derive(Debug, Clone)]
pub enum Event {
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// New text (possibly empty while a stop string or a character is unresolved) and the
    /// log-probabilities of the tokens that produced it, when asked for.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// The tool adapter found a call: its index in this response, id and function name.
    ToolCall {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s JSON arguments.
    ToolArgs {
        index: usize,
        delta: String,
    },
    /// More of the model's thinking (the reasoning parser's), apart from the answer.
    Reasoning {
        text: String,
    },
    Done {
        finish: Finish,
        usage: Usage,
    },
    /// An internal failure; details are in the log.
    Error(String),
    /// The request's plugin config or params were refused (a client error).
    Refused(String),
    /// A plugin failed while serving this request; the message names it.
    PluginFault(String),
    /// The request's output constraint could not go on (a client error about `param`).
    Constraint {
        param: &'static str,
        message: String,
    },
    /// The request was stopped before it finished: by the scheduling policy or because the
    /// server is shutting down.
    Cancelled(Cancel),
}

/// Why a request was stopped, in words for the client.
#[derive(Debug, Clone)]
pub struct Cancel {
    pub message: String,
    /// Stopped by the server's shutdown (after its grace period), not by the policy.
    pub shutdown: bool,
}

pub(super) struct Job {
    pub(super) request: JobRequest,
    pub(super) events: UnboundedSender<Event>,
    /// Engine-wide sequence number (the policy's id: `r<seq>`).
    pub(super) seq: u64,
    pub(super) arrived: Instant,
}

impl Job {
    pub(super) fn key(&self) -> String {
        format!("r{}", self.seq)
    }
}

/// Why a job was not accepted.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    QueueFull(usize),
    Stopped,
}
