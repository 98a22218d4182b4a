//! `ApiError`: every failure a client can see, rendered in the OpenAI error shape
//! (`{"error": {"message", "type", "param", "code"}}`) or, on `/v1/messages`, Anthropic's
//! (`{"type": "error", "error": {"type", "message"}}`). Bad input is a 4xx whose message says
//! what was wrong; internal failures are a 500 with a generic message (details go to the log).
//!
//! The shape is chosen once, at the edge: an error response carries its `ApiError`, and the
//! outermost middleware ([`shape`]) writes it in the shape of the API its path belongs to
//! ([`Flavor::of_path`]), whichever layer or handler failed.

use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde_json::json;

/// Which API's error shape (and, where the services word a failure differently, wording)
/// to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    #[default]
    OpenAi,
    Anthropic,
}

impl Flavor {
    /// The API a path belongs to: Anthropic's `/v1/messages` (and `count_tokens`), else
    /// OpenAI's.
    pub fn of_path(path: &str) -> Flavor {
        match path.strip_prefix("/v1/messages") {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => Flavor::Anthropic,
            _ => Flavor::OpenAi,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (a 429 always has one).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: None, code: None, retry_after: None }
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

/// The longest error message sent: past it, the middle goes (a value the client sent,
/// quoted whole, is the usual cause; the start says what was wrong, the end what to do).
const MAX_MESSAGE_CHARS: usize = 1200;

/// `message` within [`MAX_MESSAGE_CHARS`]: its first 800 and last 300 characters.
fn bounded(message: String) -> String {
    let count = message.chars().count();
    if count <= MAX_MESSAGE_CHARS {
        return message;
    }
    let head: String = message.chars().take(800).collect();
    let tail: String = message.chars().skip(count - 300).collect();
    format!("{head} … ({} characters left out) … {tail}", count - 1100)
}

/// An error response in OpenAI's shape until [`shape`] writes it in its API's.
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = self.render(Flavor::OpenAi);
        response.extensions_mut().insert(self);
        response
    }
}

/// The outermost middleware: an error response on an Anthropic path is written in
/// Anthropic's shape, its headers (`Retry-After`, `Connection`) kept.
pub async fn shape(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let flavor = Flavor::of_path(req.uri().path());
    let mut response = next.run(req).await;
    if flavor == Flavor::OpenAi {
        return response;
    }
    let Some(error) = response.extensions_mut().remove::<ApiError>() else { return response };
    let mut shaped = error.render(flavor);
    for (name, value) in response.headers() {
        if !shaped.headers().contains_key(name) {
            shaped.headers_mut().insert(name.clone(), value.clone());
        }
    }
    shaped
}

impl ApiError {
    /// The error's response in `flavor`'s shape.
    pub fn render(&self, flavor: Flavor) -> Response {
        let mut this = self.clone();
        this.message = bounded(std::mem::take(&mut this.message));
        this.param =
            this.param.map(|p| if p.chars().count() > 300 { p.chars().take(300).collect::<String>() + "…" } else { p });
        let body = match flavor {
            Flavor::OpenAi => json!({"error": {
                "message": this.message, "type": this.openai_type(), "param": this.param, "code": this.code,
            }}),
            Flavor::Anthropic => {
                json!({"type": "error", "error": {"type": this.anthropic_type(), "message": this.message}})
            }
        };
        let mut response = (this.status, Json(body)).into_response();
        let retry_after = this.retry_after.or((this.status == StatusCode::TOO_MANY_REQUESTS).then_some(1));
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
    let value = serde_path_to_error::deserialize(&mut json).map_err(|e| {
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
    })?;
    // One JSON value and nothing after it (`{…}garbage` and `{…}{…}` were taken).
    json.end().map_err(|e| {
        ApiError::bad_request(format!(
            "malformed JSON: {}; the body must be one JSON value with nothing after it",
            readable(&e.to_string())
        ))
    })?;
    Ok(value)
}

/// Longest message text taken from a parser error (which may quote a client's value whole).
const MAX_ERROR_CHARS: usize = 300;

/// A serde error message in the API's words: no Rust type names, and a value the client sent
/// cut short rather than echoed whole. Also for a plugin's refusal of a request's config or
/// params (the built-ins parse them with serde too).
pub(crate) fn readable(message: &str) -> String {
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

/// A value the client sent as an error message quotes it: in quotes, escaped, and at most
/// 100 characters of it (a 1 MB `type` is not echoed whole).
pub fn quoted(text: &str) -> String {
    match text.char_indices().nth(100) {
        Some((at, _)) => format!("{:?}…", &text[..at]),
        None => format!("{text:?}"),
    }
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

    /// One error, raised wherever: its shape is the path's API's, its headers kept.
    #[tokio::test]
    async fn the_edge_writes_an_error_in_its_paths_shape() {
        use http_body_util::BodyExt;
        use tower::ServiceExt;
        assert_eq!(Flavor::of_path("/v1/messages"), Flavor::Anthropic);
        assert_eq!(Flavor::of_path("/v1/messages/count_tokens"), Flavor::Anthropic);
        assert_eq!(Flavor::of_path("/v1/messagesx"), Flavor::OpenAi);
        assert_eq!(Flavor::of_path("/v1/chat/completions"), Flavor::OpenAi);
        let busy = || async { ApiError::new(StatusCode::TOO_MANY_REQUESTS, "busy").with_retry_after(7) };
        let app = axum::Router::new()
            .route("/v1/messages", axum::routing::post(busy))
            .route("/v1/chat/completions", axum::routing::post(busy))
            .layer(axum::middleware::from_fn(shape));
        for (path, body) in [
            ("/v1/messages", json!({"type": "error", "error": {"type": "rate_limit_error", "message": "busy"}})),
            (
                "/v1/chat/completions",
                json!({"error": {"message": "busy", "type": "rate_limit_error", "param": null, "code": null}}),
            ),
        ] {
            let req = axum::http::Request::post(path).body(axum::body::Body::empty()).unwrap();
            let response = app.clone().oneshot(req).await.unwrap();
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(response.headers()["retry-after"], "7");
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(serde_json::from_slice::<serde_json::Value>(&bytes).unwrap(), body, "{path}");
        }
    }

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

    /// A message quoting a long value is cut in the middle when it goes out; a value quoted
    /// by `quoted` is cut to its first 100 characters.
    #[test]
    fn long_messages_keep_their_start_and_end() {
        let long = format!("`x` is {}; use y", quoted(&"v".repeat(5000)));
        assert!(long.len() < 200 && long.ends_with("…; use y"), "{long}");
        let message = bounded(format!("start {} end", "m".repeat(1 << 20)));
        assert!(
            message.starts_with("start ") && message.ends_with(" end") && message.len() < 1300,
            "{}",
            message.len()
        );
        assert_eq!(bounded("short".into()), "short");
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
        // Nothing may follow the value but white space.
        for trailing in [r#"{"items": []}garbage"#, r#"{"items": []}{"x": 1}"#] {
            let e = parse(trailing.into());
            assert!(e.message.starts_with("malformed JSON") && e.message.contains("trailing"), "{}", e.message);
        }
        assert!(parse_body::<Req>(Ok(b"{\"items\": []} \n".to_vec().into())).is_ok());
    }
}
