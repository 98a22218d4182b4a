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
    /// Seconds for a `Retry-After` header (a 429 always has one).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: None, code: None, flavor: Flavor::OpenAi, retry_after: None }
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
    pub fn with_retry_after(mut self, seconds: u64) -> ApiError {
        self.retry_after = Some(seconds.max(1));
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

    pub(super) fn anthropic_type(&self) -> &'static str {
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
        let mut response = (self.status, Json(body)).into_response();
        let retry_after = self.retry_after.or((self.status == StatusCode::TOO_MANY_REQUESTS).then_some(1));
        if let Some(seconds) = retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(seconds));
        }
        response
    }
}

/// Parses a JSON body, turning every failure into a 4xx that says what was wrong. (The size
/// limit is enforced before, by the `bounded_body` middleware in routes.rs.)
pub fn parse_body<T: DeserializeOwned>(body: Result<axum::body::Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), format!("could not read the request body: {e}")))?;
    if body.is_empty() {
        return Err(ApiError::bad_request("the request body is empty; send a JSON object"));
    }
    let mut json = serde_json::Deserializer::from_slice(&body);
    serde_path_to_error::deserialize(&mut json).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::bad_request(format!("malformed JSON: {}", readable(&inner.to_string())));
        }
        let message = inner.to_string();
        // A missing field is named by its own path (the parser gives its parent's).
        let missing = message.strip_prefix("missing field `").and_then(|m| m.split('`').next());
        let param = match (path.as_str(), missing) {
            (".", Some(field)) => Some(field.to_string()),
            (_, Some(field)) => Some(format!("{path}.{field}")),
            (".", None) => None,
            _ => Some(path),
        };
        let at = param.as_ref().filter(|_| missing.is_none()).map(|p| format!("`{p}`: ")).unwrap_or_default();
        ApiError { param, ..ApiError::bad_request(format!("invalid request: {at}{}", readable(&message))) }
    })
}

/// Longest message text taken from a parser error (which may quote a client's value whole).
const MAX_ERROR_CHARS: usize = 300;

/// A serde error message in the API's words: no Rust type names, and a value the client sent
/// cut short rather than echoed whole.
fn readable(message: &str) -> String {
    let mut text = message.to_string();
    if let Some(at) = text.find("data did not match any variant of untagged enum") {
        text.replace_range(at.., "the value has the wrong type or shape for this field");
    }
    for t in ["f32", "f64"] {
        text = text.replace(&format!("expected {t}"), "expected a number");
    }
    for t in ["u8", "u16", "u32", "u64", "usize", "i8", "i16", "i32", "i64", "isize"] {
        text = text.replace(&format!("expected {t}"), "expected an integer");
    }
    // `expected struct PluginsField` -> `expected an object`.
    while let Some(at) = text.find("expected struct ") {
        let name = at + "expected struct ".len();
        let end = text[name..].find(|c: char| !c.is_alphanumeric() && c != '_').map_or(text.len(), |e| name + e);
        text.replace_range(at..end, "expected an object");
    }
    text = text.replace("a sequence", "a list").replace("a map", "an object");
    // A quoted value comes before ", expected ...": cut the value, keep what was expected.
    let at = text.rfind(", expected ").unwrap_or(text.len());
    let (head, tail) = text.split_at(at);
    shorten(head) + &shorten(tail)
}

/// `text`, cut to [`MAX_ERROR_CHARS`] characters.
fn shorten(text: &str) -> String {
    match text.chars().count() > MAX_ERROR_CHARS {
        true => text.chars().take(MAX_ERROR_CHARS).collect::<String>() + "…",
        false => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Inner {
        n: u32,
    }

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Req {
        items: Vec<Inner>,
        inner: Option<Inner>,
    }

    #[test]
    fn parse_errors_name_the_field_and_no_rust_types() {
        let parse = |body: String| parse_body::<Req>(Ok(body.into_bytes().into())).unwrap_err();
        let e = parse(r#"{"items": [{"n": 1}, {"n": "x"}]}"#.into());
        assert_eq!(e.param.as_deref(), Some("items[1].n"), "{e:?}");
        assert!(e.message.starts_with("invalid request: `items[1].n`: invalid type: string"), "{}", e.message);
        let e = parse(r#"{"items": [{"n": 1.5}], "inner": "x"}"#.into());
        assert!(e.message.contains("expected an integer") && !e.message.contains("u32"), "{}", e.message);
        let e = parse(r#"{"items": [], "inner": "x"}"#.into());
        assert!(!e.message.contains("Inner") && e.message.contains("expected an object"), "{}", e.message);
        let e = parse(format!(r#"{{"items": "{}"}}"#, "x".repeat(1 << 20)));
        assert!(e.message.len() < 1000 && e.message.contains("expected a list"), "{}", e.message);
        assert!(parse("{".into()).message.starts_with("malformed JSON"));
    }
}
