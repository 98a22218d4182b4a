//! `/tokenize` and `/detokenize` (llama.cpp's and vLLM's extension routes).

use super::state::Shared;

use super::error::{parse_body, ApiError};

use super::openai;

use super::turn::{Input, Turn};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;

use axum::Json;
use serde_json::{json, Value};

/// `POST /tokenize` (as vLLM's): `{"prompt": "text", "add_special_tokens": false}` or
/// `{"messages": [...], "tools": [...], "chat_template_kwargs": {...}}` (the prompt a chat
/// request would get: the template, the tools described, earlier calls written) -> token ids.
pub(super) async fn tokenize(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Req {
        model: Option<String>,
        prompt: Option<String>,
        messages: Option<Vec<Value>>,
        tools: Option<Vec<Value>>,
        chat_template_kwargs: Option<serde_json::Map<String, Value>>,
        #[serde(default)]
        add_special_tokens: bool,
    }
    let req: Req = parse_body(body)?;
    let _ = req.model;
    let tokens = match (req.prompt, req.messages) {
        (Some(text), None) if req.tools.is_none() && req.chat_template_kwargs.is_none() => {
            state.encode(text, req.add_special_tokens).await?
        }
        (Some(_), None) => {
            return Err(ApiError::invalid("prompt", "`tools` and `chat_template_kwargs` go with `messages`"))
        }
        (None, Some(messages)) => {
            openai::check_tools(req.tools.as_ref())?;
            let turn = Turn {
                input: Input::Messages(openai::template_messages(&messages)?),
                tools: req.tools,
                template_kwargs: req.chat_template_kwargs,
                ..Turn::default()
            };
            state.prompt(turn).await?
        }
        _ => return Err(ApiError::invalid("prompt", "give exactly one of `prompt` (text) or `messages`")),
    };
    Ok(Json(json!({"count": tokens.len(), "max_model_len": state.max_sequence_tokens, "tokens": tokens})))
}

/// `POST /detokenize`: `{"tokens": [ids]}` -> `{"prompt": "text"}`.
pub(super) async fn detokenize(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Req {
        model: Option<String>,
        tokens: Vec<u32>,
    }
    let req: Req = parse_body(body)?;
    let _ = req.model;
    let vocab = state.engine.info.vocab_size;
    if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid("tokens", format!("token {bad} is outside the vocabulary of {vocab}")));
    }
    let text = state.engine.tokenizer.decode(&req.tokens).map_err(ApiError::internal)?;
    Ok(Json(json!({ "prompt": text })))
}
