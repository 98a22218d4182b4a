//! `ApiError`: every failure a client can see, rendered in the OpenAI error shape
//! (`{"error": {"message", "type", "param", "code"}}`) or, on `/v1/messages`, Anthropic's
//! (`{"type": "error", "error": {"type", "message"}}`). Bad input is a 4xx whose message says
//! what was wrong; internal failures are a 500 with a generic message (details go to the log).

use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde_json::json;

/// Which API's error shape to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    #[default]
    OpenAi,
    Anthropic,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub flavor: Flavor,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: None, code: None, flavor: Flavor::OpenAi }
    }
    /// 400 about one request field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { param: Some(param.to_string()), ..ApiError::new(StatusCode::BAD_REQUEST, message) }
    }
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
    /// 500; `detail` is logged, not sent.
    pub fn internal(detail: impl std::fmt::Display) -> ApiError {
        tracing::error!("internal error: {detail}");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error; see the server log")
    }
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }
    pub fn flavor(mut self, flavor: Flavor) -> ApiError {
        self.flavor = flavor;
        self
    }

    fn openai_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            413 => "invalid_request_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = match self.flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.message, "type": self.openai_type(), "param": self.param, "code": self.code,
            }}),
            Flavor::Anthropic => {
                json!({"type": "error", "error": {"type": self.anthropic_type(), "message": self.message}})
            }
        };
        (self.status, Json(body)).into_response()
    }
}

/// Parses a JSON body, turning every failure into a 4xx that says what was wrong. (The size
/// limit is enforced before, by the `bounded_body` middleware in routes.rs.)
pub fn parse_body<T: DeserializeOwned>(body: Result<axum::body::Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), format!("could not read the request body: {e}")))?;
    if body.is_empty() {
        return Err(ApiError::bad_request("the request body is empty; send a JSON object"));
    }
    serde_json::from_slice(&body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() { "malformed JSON" } else { "invalid request" };
        ApiError::bad_request(format!("{what}: {e}"))
    })
}
