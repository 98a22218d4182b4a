//! The HTTP API: `app(state) -> Router`, its middleware (body limits, request logs, the API
//! key) and the small routes (root, health, metrics, plugins, models). Each API's handlers
//! live with it: `chat.rs`, `completions.rs`, `messages.rs` (and count_tokens),
//! `responses.rs`, `tokens.rs`. Handlers parse and validate, build the prompt, check
//! admission, and hand a job to the engine thread; they never touch MLX.

use super::error::ApiError;
use super::state::Shared;
use super::tokens::{detokenize, tokenize};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::time::Instant;
use tokio_stream::StreamExt;

pub fn app(state: Shared) -> Router {
    Router::new()
        .route("/", get(root))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(super::chat::chat_completions))
        .route("/v1/completions", post(super::completions::completions))
        .route("/v1/responses", post(super::responses::create_response))
        .route("/v1/responses/{id}", get(super::responses::get_response).delete(super::responses::delete_response))
        .route("/v1/responses/{id}/input_items", get(super::responses::response_input_items))
        .route("/v1/messages", post(super::messages::messages))
        .route("/v1/messages/count_tokens", post(super::messages::count_tokens))
        .route("/v1/plugins", get(list_plugins))
        .route("/v1/plugins/events", get(plugin_events))
        .route("/ui/{file}", get(super::ui::asset))
        .route("/favicon.ico", get(super::ui::favicon))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn(super::guard::json_body))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), bounded_body))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(state.guard.clone(), super::guard::guard))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        // `bounded_body` enforces the limit (and reads what is over it); the extractors'
        // own limit (2 MB by default) would cut below it.
        .layer(axum::extract::DefaultBodyLimit::disable())
        // Outermost: every error response in its API's shape.
        .layer(middleware::from_fn(super::error::shape))
        .with_state(state)
}

/// How much of a body over the limit is still read (and dropped) before the 413 goes out.
/// A server that answers while the client is still sending, then closes, makes the client's
/// kernel receive a reset, which can discard the answer before the client reads it: the
/// client sees "server disconnected without sending a response" instead of the 413 (the e2e
/// hostile-request test did once; its only bodies over the 4 MB limit are two of 10 MB). Read
/// to the end, the 413 arrives and the connection stays usable. Bodies declared larger than
/// the limit plus this are refused at once.
const DRAIN_OVER_LIMIT: u64 = 64 << 20;

/// Reads the request body, at most `max_body_bytes` of it kept: a larger one gets a 413 in
/// its API's error shape once it has been read (up to [`DRAIN_OVER_LIMIT`] more).
async fn bounded_body(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let limit = state.max_body_bytes;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is larger than the server's limit of {limit} bytes"),
        )
        .into_response()
    };
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let drain_to = limit.saturating_add(DRAIN_OVER_LIMIT);
    if declared.is_some_and(|n| n > drain_to) {
        return too_large();
    }
    let (parts, body) = req.into_parts();
    let mut stream = body.into_data_stream();
    let (mut kept, mut total) = (Vec::new(), 0u64);
    // The whole body must arrive within the timeout: a client that declares more than it
    // sends, or trickles it, does not hold the connection.
    let deadline = tokio::time::Instant::now() + state.body_timeout;
    loop {
        let chunk = match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(_) => {
                let secs = state.body_timeout.as_secs();
                let e = ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("the request body did not arrive within {secs} s ({total} bytes came)"),
                );
                let mut response = e.into_response();
                response
                    .headers_mut()
                    .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
                return response;
            }
        };
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => {
                let e = ApiError::bad_request(format!("could not read the request body: {e}"));
                return e.into_response();
            }
        };
        total += chunk.len() as u64;
        if total <= limit {
            kept.extend_from_slice(&chunk);
        } else if total > drain_to {
            break;
        }
    }
    if total > limit {
        return too_large();
    }
    if tracing::enabled!(tracing::Level::DEBUG) {
        // The request's top-level fields, to see what a client sends (`HOST_LOG=debug`).
        if let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(&kept) {
            let fields: Vec<&String> = o.keys().collect();
            tracing::debug!(path = parts.uri.path(), bytes = kept.len(), ?fields, model = ?o.get("model"), "request body");
        }
    }
    next.run(Request::from_parts(parts, axum::body::Body::from(kept))).await
}

/// Counts every request by route and status, and logs it with its path; a request the
/// client abandons before the response starts (the handler is dropped) gets its own line.
async fn observe(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let route =
        req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_else(|| "unmatched".into());
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    /// Logs on drop unless disarmed: the handler's future was dropped before it answered.
    struct Abandoned<'a>(Option<(&'a str, &'a str, Instant)>);
    impl Drop for Abandoned<'_> {
        fn drop(&mut self) {
            if let Some((method, path, start)) = self.0 {
                let ms = start.elapsed().as_millis() as u64;
                tracing::info!(method, path, ms, "request abandoned by the client before the response started");
            }
        }
    }
    let start = Instant::now();
    let method_str = method.as_str().to_string();
    let mut guard = Abandoned(Some((&method_str, &path, start)));
    let response = next.run(req).await;
    guard.0 = None;
    let status = response.status().as_u16();
    state.metrics.request(&route, status);
    tracing::info!(%method, path, route, status, ms = start.elapsed().as_millis() as u64, "request");
    response
}

/// With an API key configured, every route needs it but `/health` and the web page's own
/// files (`/` to a browser, `/ui/*`, `/favicon.ico`), which hold no data.
async fn auth(State(state): State<Shared>, headers: HeaderMap, req: Request, next: Next) -> Response {
    let Some(key) = state.api_key.as_deref() else { return next.run(req).await };
    // The page and its files carry no secret: they load without the key and ask for it.
    let path = req.uri().path();
    if path == "/health"
        || super::ui::is_page_file(&state, path)
        || (path == "/" && super::ui::wants_page(&state, &headers))
    {
        return next.run(req).await;
    }
    // The scheme is case-insensitive (RFC 7235): `Bearer`, `bearer`.
    let bearer = headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim_start())
    });
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    if bearer == Some(key) || x_api_key == Some(key) {
        return next.run(req).await;
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "missing or wrong API key; send `Authorization: Bearer <key>` or `x-api-key: <key>`",
    )
    .with_code("invalid_api_key")
    .into_response()
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no route {} {}", req.method(), req.uri().path()))
}

async fn method_not_allowed(req: Request) -> ApiError {
    let (method, path) = (req.method(), req.uri().path());
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, format!("{path} does not take {method}"))
        .with_code("method_not_allowed")
}

/// `GET /` (and `HEAD /`, which clients such as Claude Code probe on start): the web page to
/// a browser (`server::ui`), else what this is.
async fn root(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if super::ui::wants_page(&state, &headers) {
        return super::ui::index();
    }
    Json(
        json!({"service": "host", "model": state.model_id, "apis": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]}),
    )
    .into_response()
}

async fn health(State(state): State<Shared>) -> Json<Value> {
    Json(json!({"status": "ok", "model": state.model_id}))
}

async fn metrics(State(state): State<Shared>) -> impl IntoResponse {
    ([("content-type", "text/plain; version=0.0.4")], state.metrics.render(&state.engine.stats))
}

async fn list_plugins(State(state): State<Shared>) -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], state.plugin_list()).into_response()
}

/// `GET /v1/plugins/events`: server-sent events of the plugin list. A `plugins` event (the
/// data is `GET /v1/plugins`'s body) comes at once and again whenever anything in the list
/// changes, at most every 250 ms (`AppState::plugin_feed`).
async fn plugin_events(State(state): State<Shared>) -> impl IntoResponse {
    use axum::response::sse::{Event, KeepAlive, Sse};
    let mut feed = state.plugin_feed();
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Event, std::convert::Infallible>>(4);
    tokio::spawn(async move {
        loop {
            let text = feed.borrow_and_update().clone();
            if tx.send(Ok(Event::default().event("plugins").data(&*text))).await.is_err() {
                return;
            }
            tokio::select! {
                changed = feed.changed() => if changed.is_err() { return },
                _ = tx.closed() => return,
            }
        }
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out)).keep_alive(KeepAlive::default())
}

/// `GET /v1/models`: the one model, with what the page's console shows of it.
async fn models(State(state): State<Shared>) -> Json<Value> {
    let info = &state.engine.info;
    Json(json!({"object": "list", "data": [{
        "id": state.model_id, "object": "model", "created": state.created, "owned_by": "host",
        "max_model_len": state.max_sequence_tokens,
        "model_type": info.model_type,
        "context_length": state.context_tokens,
        "device": state.engine.device.to_string(),
        "quantization": state.quantization,
        "weight_bytes": info.weight_bytes,
        "memory_budget_bytes": state.memory_budget,
    }]}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServeConfig;
    use crate::engine::handle::Engine;
    use crate::engine::handle::EngineConfig;
    use crate::engine::job::{Cancel, Event};
    use crate::server::reply::*;
    use crate::server::{anthropic, openai};
    use axum::body::Body;
    use axum::body::Bytes;
    use http_body_util::BodyExt;
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::OnceLock;
    use tower::ServiceExt;

    #[test]
    fn a_constraint_that_cannot_go_on_is_a_400_naming_its_field_before_and_after_the_stream_starts() {
        let event = Event::Constraint { param: "regex", message: "the regex constraint cannot go on".into() };
        let e = failure(&event).unwrap();
        assert_eq!((e.status.as_u16(), e.param.as_deref(), e.code), (400, Some("regex"), Some("constraint_failed")));
        assert_eq!(stream_error_code(&event), ("invalid_request_error", Some("constraint_failed")));
        assert_eq!(stream_error_message(&event), "the regex constraint cannot go on");
        assert_eq!(stream_error_type(&event), "invalid_request_error");
    }

    /// A built-in's refusal of a request's config speaks the API's words (its serde error named
    /// Rust types: `expected f32`), before the stream and inside it.
    #[test]
    fn a_plugin_refusal_names_no_rust_types() {
        let event = Event::Refused(
            "plugin top-n-sigma refused its config (host_init returned 1): invalid type: string \"x\", expected f32"
                .into(),
        );
        let e = failure(&event).unwrap();
        for message in [e.message, stream_error_message(&event)] {
            assert!(message.contains("expected a number") && !message.contains("f32"), "{message}");
        }
    }

    #[test]
    fn anthropic_streams_type_their_failures_as_the_same_failure_before_the_stream() {
        let cancel = |shutdown| Event::Cancelled(Cancel { message: "stopped".into(), shutdown });
        let cases = [
            (cancel(true), "overloaded_error"),
            (cancel(false), "invalid_request_error"),
            (Event::Refused("bad config".into()), "invalid_request_error"),
            (Event::PluginFault("plugin x trapped".into()), "api_error"),
            (Event::Error("boom".into()), "api_error"),
        ];
        for (event, kind) in cases {
            assert_eq!(stream_error_type(&event), kind, "{event:?}");
        }
    }

    /// One engine on a tiny random model for all tests of this module.
    fn engine() -> Arc<Engine> {
        static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();
        ENGINE
            .get_or_init(|| {
                let dir = std::env::temp_dir().join(format!("host-routes-test-{}", std::process::id()));
                models::testing::write_model(&dir, "llama", 3).unwrap();
                let config = EngineConfig::cpu(dir);
                Arc::new(Engine::start(config).unwrap())
            })
            .clone()
    }

    fn router(api_key: Option<&str>) -> Router {
        let config =
            ServeConfig { api_key: api_key.map(str::to_string), max_body_bytes: 1 << 16, ..Default::default() };
        app(crate::server::state(&config, engine(), None))
    }

    /// Sends a request; returns the status and the body as JSON.
    async fn check(router: Router, method: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
        let mut req = Request::builder().method(method).uri(path).header("content-type", "application/json");
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
            req = req.header("host", "127.0.0.1");
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let response = router.oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    #[tokio::test]
    async fn a_chat_completion_runs_on_the_engine() {
        let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}"#;
        let (status, v) = check(router(None), "POST", "/v1/chat/completions", body, &[]).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            v["usage"]["completion_tokens"].as_u64().unwrap() + v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["total_tokens"].as_u64().unwrap()
        );
        assert_eq!(v["object"], "chat.completion");
    }

    /// A browser gets the page at `/` (with its CSP) and its files, without the API key, which
    /// every API route still needs; other clients keep the JSON root; `--no-ui` turns it off.
    #[tokio::test]
    async fn a_browser_gets_the_page_and_its_files_without_the_key_and_nothing_else() {
        async fn get(router: Router, path: &str, accept: &str) -> (u16, String, Option<String>) {
            let req = Request::builder().uri(path).header("host", "127.0.0.1").header("accept", accept);
            let response = router.oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
            let csp = response.headers().get("content-security-policy").map(|v| v.to_str().unwrap().to_string());
            let status = response.status().as_u16();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&bytes).into_owned(), csp)
        }
        let html = "text/html,application/xhtml+xml;q=0.9,*/*;q=0.8";
        let (status, body, csp) = get(router(Some("k")), "/", html).await;
        assert_eq!(status, 200);
        assert!(body.starts_with("<!doctype html>") && csp.unwrap().contains("script-src 'self'"));
        let (status, body, _) = get(router(Some("k")), "/ui/app.js", "*/*").await;
        assert!(status == 200 && body.contains("import"), "{status}");
        assert_eq!(get(router(Some("k")), "/", "application/json").await.0, 401);
        assert_eq!(get(router(Some("k")), "/v1/models", html).await.0, 401);
        assert_eq!(get(router(Some("k")), "/ui/../v1/models", "*/*").await.0, 401);
        assert_eq!(get(router(None), "/ui/nothing.js", "*/*").await.0, 404);
        let (status, body, _) = get(router(None), "/", "application/json").await;
        assert!(status == 200 && body.contains("\"service\":\"host\""), "{body}");
        let config = ServeConfig { ui: false, ..Default::default() };
        let no_ui = app(crate::server::state(&config, engine(), None));
        let (_, body, csp) = get(no_ui.clone(), "/", html).await;
        assert!(body.contains("\"service\":\"host\"") && csp.is_none());
        assert_eq!(get(no_ui, "/ui/app.js", "*/*").await.0, 404);
    }

    /// The plugin feed sends the list at once, and again (only) when it changes; many
    /// subscribers share one look at the registry.
    #[tokio::test]
    async fn plugin_events_send_the_list_at_once_and_on_change() {
        let registry = crate::plugins::PluginRegistry::new().unwrap();
        let config = ServeConfig::default();
        let state = crate::server::state(&config, engine(), Some(registry.clone()));
        let req =
            || Request::builder().uri("/v1/plugins/events").header("host", "127.0.0.1").body(Body::empty()).unwrap();
        let response = app(state.clone()).oneshot(req()).await.unwrap();
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let mut body = response.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        let text = String::from_utf8_lossy(&first).into_owned();
        assert!(text.starts_with("event: plugins\ndata: ") && text.contains("\"data\":[]"), "{text}");
        // A file refused by the registry is a change: the next event lists it.
        let dir = std::env::temp_dir().join(format!("host-feed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("broken.wasm"), b"not wasm").unwrap();
        let _ = registry.load_file(&dir.join("broken.wasm"));
        let next = tokio::time::timeout(std::time::Duration::from_secs(5), body.frame()).await.unwrap();
        let text = String::from_utf8_lossy(&next.unwrap().unwrap().into_data().unwrap()).into_owned();
        assert!(text.contains("\"state\":\"refused\"") && text.contains("broken"), "{text}");
        // A second subscriber shares the feed.
        let _second = app(state.clone()).oneshot(req()).await.unwrap();
        assert!(state.plugin_feed.get().is_some());
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Sends a request; returns the status and the raw body.
    async fn raw(router: Router, method: &str, path: &str, body: &str) -> (u16, String) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "127.0.0.1")
            .header("content-type", "application/json");
        let response = router.oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A request with exactly these headers; the status, the response headers and the body.
    async fn sent(
        router: Router,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, axum::http::HeaderMap, Value) {
        let mut req = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let response = router.oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let (status, headers) = (response.status().as_u16(), response.headers().clone());
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, headers, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    /// Anthropic tools are checked before any plugin sees them, and an error names the field
    /// as the request wrote it (issue 42: it named "plugin hermes's params", or OpenAI's
    /// `parameters` for an `input_schema`), with a long value cut short.
    #[tokio::test]
    async fn anthropic_tool_errors_name_the_anthropic_field() {
        let config = ServeConfig { max_body_bytes: 4 << 20, ..Default::default() };
        let r = || app(crate::server::state(&config, engine(), None));
        let props: serde_json::Map<String, Value> =
            (0..20_000).map(|i| (format!("p{i}"), serde_json::json!({"type": "string"}))).collect();
        for (tool, field) in [
            (serde_json::json!({"name": "f".repeat(1 << 20), "input_schema": {"type": "object"}}), "tools[1].name"),
            (
                serde_json::json!({"name": "f", "input_schema": {"type": "object", "properties": props}}),
                "tools[1].input_schema",
            ),
            (serde_json::json!({"name": "f", "input_schema": null}), "tools[1].input_schema"),
        ] {
            // A server tool first: left out of the prompt, still counted in the indices.
            let tools = serde_json::json!([{"type": "web_search_20250305", "name": "web_search"}, tool]);
            for path in ["/v1/messages", "/v1/messages/count_tokens"] {
                let body = serde_json::json!({"model": "m", "max_tokens": 1, "tools": tools,
                    "messages": [{"role": "user", "content": "hi"}]});
                let (status, v) = check(r(), "POST", path, &body.to_string(), &[]).await;
                let message = v["error"]["message"].as_str().unwrap_or_default();
                assert_eq!((status, v["type"].as_str()), (400, Some("error")), "{path}: {message:.300}");
                assert!(message.contains(field), "{path} {field}: {message:.300}");
                assert!(!message.contains("plugin") && !message.contains("parameters"), "{path}: {message:.300}");
                assert!(message.len() < 1000, "{path}: {message:.300}");
            }
        }
    }

    /// Input that used to pass or to be answered badly: each a 4xx naming its field.
    #[tokio::test]
    async fn odd_values_are_refused_with_the_field_named() {
        let chat =
            |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 1{extra}}}"#);
        for (extra, param) in [
            (r#", "priority": -9223372036854775808"#, "priority"),
            (r#", "top_logprobs": 99"#, "top_logprobs"),
            (r#", "top_logprobs": -1"#, "top_logprobs"),
            (r#", "stream_options": [true]"#, "stream_options"),
            (r#", "plugins": [null]"#, "plugins"),
        ] {
            let (status, v) = check(router(None), "POST", "/v1/chat/completions", &chat(extra), &[]).await;
            assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{extra}: {v}");
            assert!(!v["error"]["message"].as_str().unwrap().contains("PluginsField"), "{v}");
        }
        // A missing field is named (the parser gives only its parent's path).
        for (route, body, param) in [
            ("/v1/chat/completions", r#"{"max_tokens": 1}"#, "messages"),
            ("/v1/completions", r#"{"max_tokens": 1}"#, "prompt"),
            ("/detokenize", r#"{}"#, "tokens"),
        ] {
            let (status, v) = check(router(None), "POST", route, body, &[]).await;
            assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
        }
        for body in [
            r#"{"model": "m", "max_tokens": 1, "metadata": "x", "messages": [{"role": "user", "content": "hi"}]}"#,
            r#"{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": []}]}"#,
        ] {
            let (status, v) = check(router(None), "POST", "/v1/messages", body, &[]).await;
            assert_eq!((status, v["type"].as_str()), (400, Some("error")), "{body}: {v}");
        }
        let (status, v) = check(router(None), "DELETE", "/v1/models", "", &[]).await;
        assert_eq!((status, v["error"]["code"].as_str()), (405, Some("method_not_allowed")), "{v}");
        let lower = [("authorization", "bearer k")];
        assert_eq!(check(router(Some("k")), "POST", "/v1/chat/completions", &chat(""), &lower).await.0, 200);
        let busy = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "busy").into_response();
        assert_eq!(busy.headers()["retry-after"], "1");
    }

    /// The local-server policy: a foreign `Host` (DNS rebinding) and a cross-origin page's
    /// "simple" POST are refused before any handler runs; a listed origin gets CORS headers
    /// and its preflight answered; a POST must declare JSON.
    #[tokio::test]
    async fn web_pages_cannot_drive_the_server() {
        let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}"#;
        let json = ("content-type", "application/json");
        let r = || router(None);
        let (status, _, v) =
            sent(r(), "POST", "/v1/chat/completions", &[("host", "evil.example:8080"), json], body).await;
        assert_eq!((status, v["error"]["code"].as_str()), (403, Some("host_not_allowed")), "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("--allowed-host"), "{v}");
        let simple = [("host", "127.0.0.1:8080"), ("origin", "http://evil.example"), ("content-type", "text/plain")];
        let (status, _, v) = sent(r(), "POST", "/v1/chat/completions", &simple, body).await;
        assert_eq!((status, v["error"]["code"].as_str()), (403, Some("origin_not_allowed")), "{v}");
        let (status, _, v) =
            sent(r(), "POST", "/v1/messages", &[("host", "localhost:8080"), ("content-type", "text/plain")], body)
                .await;
        assert_eq!((status, v["type"].as_str()), (415, Some("error")), "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("application/json"), "{v}");
        let (status, _, _) = sent(r(), "POST", "/v1/chat/completions", &[("host", "localhost:8080"), json], body).await;
        assert_eq!(status, 200);
        // Exactly one valid Host (issue 42): a second one, none, or a malformed one is a 400.
        for headers in
            [&[("host", "127.0.0.1"), ("host", "evil.example"), json][..], &[json][..], &[("host", "[::1"), json][..]]
        {
            let (status, _, v) = sent(r(), "POST", "/v1/chat/completions", headers, body).await;
            assert_eq!((status, v["error"]["code"].as_str()), (400, Some("invalid_host")), "{headers:?}: {v}");
        }
        // One Content-Type: two (the first JSON) are refused, not read as the first.
        let two = [("host", "127.0.0.1"), json, ("content-type", "text/plain")];
        let (status, _, v) = sent(r(), "POST", "/v1/chat/completions", &two, body).await;
        assert_eq!((status, v["error"]["code"].as_str()), (415, Some("unsupported_media_type")), "{v}");
        // A POST to a path that takes none is a 405 whatever its type (it was a 415).
        let (status, _, v) = sent(r(), "POST", "/health", &[("host", "127.0.0.1")], "").await;
        assert_eq!((status, v["error"]["code"].as_str()), (405, Some("method_not_allowed")), "{v}");
        // Allowed by configuration: a LAN name and a local web app's origin.
        let config = ServeConfig {
            allowed_hosts: vec!["box.lan".into()],
            cors_origins: vec!["http://localhost:3000".into()],
            ..Default::default()
        };
        let open = || app(crate::server::state(&config, engine(), None));
        let app_origin = [("host", "box.lan:8080"), ("origin", "http://localhost:3000")];
        let (status, headers, _) =
            sent(open(), "POST", "/v1/chat/completions", &[app_origin[0], app_origin[1], json], body).await;
        assert_eq!(status, 200);
        assert_eq!(headers["access-control-allow-origin"], "http://localhost:3000");
        let preflight = [
            app_origin[0],
            app_origin[1],
            ("access-control-request-method", "POST"),
            ("access-control-request-headers", "content-type, authorization"),
        ];
        let (status, headers, _) = sent(open(), "OPTIONS", "/v1/chat/completions", &preflight, "").await;
        assert_eq!(status, 204);
        assert_eq!(headers["access-control-allow-headers"], "content-type, authorization");
        assert!(headers["access-control-allow-methods"].to_str().unwrap().contains("POST"));
        let (status, _, _) = sent(
            open(),
            "OPTIONS",
            "/v1/chat/completions",
            &[("host", "box.lan"), ("origin", "http://evil.example")],
            "",
        )
        .await;
        assert_eq!(status, 403);
    }

    /// The `data` of each SSE event of a stream body.
    fn sse_data(body: &str) -> Vec<Value> {
        body.lines().filter_map(|l| l.strip_prefix("data: ")).filter_map(|d| serde_json::from_str(d).ok()).collect()
    }

    #[tokio::test]
    async fn a_response_is_stored_continued_read_and_deleted() {
        let state = crate::server::state(&ServeConfig::default(), engine(), None);
        let r = || app(state.clone());
        let body = r#"{"input": "hi", "instructions": "be brief", "max_output_tokens": 3, "temperature": 0}"#;
        let (status, v) = check(r(), "POST", "/v1/responses", body, &[]).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["object"], "response");
        assert_eq!(v["status"], "incomplete", "three tokens of a random model: cut by max_output_tokens");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(v["usage"]["output_tokens"], 3);
        let first_prompt = v["usage"]["input_tokens"].as_u64().unwrap();
        let id = v["id"].as_str().unwrap().to_string();
        let (status, got) = check(r(), "GET", &format!("/v1/responses/{id}"), "", &[]).await;
        assert_eq!((status, &got), (200, &v));
        let (status, items) = check(r(), "GET", &format!("/v1/responses/{id}/input_items"), "", &[]).await;
        assert_eq!((status, items["data"][0]["content"][0]["text"].as_str()), (200, Some("hi")), "{items}");
        // The next turn sees the stored conversation: a longer prompt than its own input,
        // most of it from the prompt cache.
        let next =
            format!(r#"{{"input": "more", "previous_response_id": "{id}", "max_output_tokens": 2, "store": false}}"#);
        let (status, n) = check(r(), "POST", "/v1/responses", &next, &[]).await;
        assert_eq!(status, 200, "{n}");
        assert!(n["usage"]["input_tokens"].as_u64().unwrap() > first_prompt, "{n}");
        let (status, _) = check(r(), "GET", &format!("/v1/responses/{}", n["id"].as_str().unwrap()), "", &[]).await;
        assert_eq!(status, 404, "store: false keeps nothing");
        let (status, d) = check(r(), "DELETE", &format!("/v1/responses/{id}"), "", &[]).await;
        assert_eq!((status, d["deleted"].as_bool()), (200, Some(true)));
        let (status, e) = check(r(), "POST", "/v1/responses", &next, &[]).await;
        assert_eq!((status, e["error"]["param"].as_str()), (400, Some("previous_response_id")), "{e}");
        for (bad, param) in [
            (r#"{"input": "x", "background": true}"#, "background"),
            (r#"{"input": "x", "text": {"format": {"type": "json_schema"}}}"#, "text.format.schema"),
            (r#"{"input": "x", "truncation": "auto"}"#, "truncation"),
            (
                r#"{"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]}"#,
                "input[0].content[0]",
            ),
            (r#"{"input": "x", "tools": [{"type": "function", "name": ""}]}"#, "tools[0].name"),
            (r#"{"input": "x", "tool_choice": {"type": "function", "name": "nope"}}"#, "tool_choice"),
            (r#"{"max_output_tokens": 3}"#, "input"),
        ] {
            let (status, e) = check(r(), "POST", "/v1/responses", bad, &[]).await;
            assert_eq!((status, e["error"]["param"].as_str()), (400, Some(param)), "{bad}: {e}");
        }
    }

    #[tokio::test]
    async fn a_streamed_response_follows_the_grammar_and_ends_completed() {
        let body = r#"{"input": [{"role": "user", "content": "hi"}], "stream": true, "max_output_tokens": 4, "temperature": 0}"#;
        let (status, text) = raw(router(None), "POST", "/v1/responses", body).await;
        assert_eq!(status, 200, "{text}");
        let events = sse_data(&text);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(kinds[..2], ["response.created", "response.in_progress"], "{kinds:?}");
        let terminal = *kinds.last().unwrap();
        assert!(matches!(terminal, "response.incomplete" | "response.completed"), "{kinds:?}");
        let numbers: Vec<u64> = events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
        let last = &events.last().unwrap()["response"];
        let deltas: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(last["output"][0]["content"][0]["text"].as_str(), Some(deltas.as_str()));
        // Cut at max_output_tokens exactly when it says so.
        let cut = last["usage"]["output_tokens"] == 4;
        assert_eq!(terminal == "response.incomplete", cut, "{last}");
        assert_eq!(last["status"] == "incomplete", cut, "{last}");
    }

    /// Requests recorded from the real harnesses (tests/fixtures/harness, recorded against a
    /// stub server that answers the first turn with a tool call: Claude Code's turns with its
    /// system message among `messages`, thinking, context management, effort, cache_control,
    /// then a `tool_use`/`tool_result` pair; Codex's Responses turns with developer messages,
    /// a namespace and a web_search tool, then `function_call`/`function_call_output` items)
    /// are served: every field and block as recorded, but for a small output
    /// limit and long texts cut to 200 characters (the tiny model's tokens are bytes; the
    /// full prompts run in the harness e2e tests).
    #[tokio::test]
    async fn recorded_harness_requests_are_served() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/harness");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let recorded: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let mut body = recorded["body"].clone();
            let route = recorded["path"].as_str().unwrap();
            // The end of a stream: cut at the token limit, or ended sooner by the sampled model.
            let (limit, last): (_, &[&str]) = match route.starts_with("/v1/messages") {
                true => ("max_tokens", &["message_stop"]),
                false => ("max_output_tokens", &["response.incomplete", "response.completed"]),
            };
            body[limit] = json!(2);
            fn shorten(v: &mut Value) {
                match v {
                    Value::String(s) if s.len() > 200 => *s = s.chars().take(200).collect(),
                    Value::Array(a) => a.iter_mut().for_each(shorten),
                    Value::Object(o) => o.values_mut().for_each(shorten),
                    _ => {}
                }
            }
            shorten(&mut body);
            let (status, text) = raw(router(None), "POST", route, &body.to_string()).await;
            assert_eq!(status, 200, "{}: {text}", path.display());
            let events = sse_data(&text);
            let kind = events.last().unwrap()["type"].as_str().unwrap_or_default().to_string();
            assert!(last.contains(&kind.as_str()), "{}: {text}", path.display());
            seen += 1;
        }
        assert!(seen >= 2);
    }

    #[tokio::test]
    async fn claude_codes_fields_are_taken_and_images_refused() {
        let body = |extra: &str| {
            format!(
                r#"{{"model": "claude-opus-4-8", "max_tokens": 1000000, "system": [{{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3; cch=abc;"}}, {{"type": "text", "text": "You help.", "cache_control": {{"type": "ephemeral"}}}}], "messages": [{{"role": "user", "content": "hi"}}, {{"role": "system", "content": [{{"type": "text", "text": "env"}}]}}, {{"role": "assistant", "content": [{{"type": "thinking", "thinking": "hm", "signature": "s"}}, {{"type": "text", "text": "ok"}}]}}, {{"role": "user", "content": "go"}}], "thinking": {{"type": "enabled", "budget_tokens": 2000}}, "context_management": {{"edits": []}}, "output_config": {{"effort": "high"}}, "metadata": {{"user_id": "u"}}{extra}}}"#
            )
        };
        let (status, v) = check(
            router(None),
            "POST",
            "/v1/messages?beta=true",
            &body(""),
            &[("anthropic-beta", "interleaved-thinking-2025-05-14")],
        )
        .await;
        assert_eq!(status, 200, "a max_tokens past the budget is a ceiling here: {v}");
        // The billing header is not in the prompt: the same request without it counts the same.
        let count = |b: String| async move { check(router(None), "POST", "/v1/messages/count_tokens", &b, &[]).await };
        let (_, with) = count(body("")).await;
        let (_, without) = count(body("").replace("x-anthropic-billing-header: cc_version=1.2.3; cch=abc;", "")).await;
        assert_eq!(with["input_tokens"], without["input_tokens"], "{with} {without}");
        for (extra, want) in [
            (r#", "thinking": {"type": "sometimes"}"#, "thinking.type"),
            (r#", "output_config": {"format": {"type": "json_schema"}}"#, "output_config.format.schema` is missing"),
        ] {
            let b = body("").replacen(r#""thinking": {"type": "enabled", "budget_tokens": 2000}, "#, "", 1);
            let b = if extra.contains("output_config") {
                b.replacen(r#", "output_config": {"effort": "high"}"#, "", 1)
            } else {
                b
            };
            let b = format!("{}{extra}}}", &b[..b.len() - 1]);
            let (status, e) = check(router(None), "POST", "/v1/messages", &b, &[]).await;
            assert_eq!(status, 400, "{extra}: {e}");
            assert!(e["error"]["message"].as_str().unwrap().contains(want), "{e}");
        }
        let image = r#"{"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}"#;
        let (status, e) = check(router(None), "POST", "/v1/messages", image, &[]).await;
        assert_eq!(status, 400);
        assert!(e["error"]["message"].as_str().unwrap().contains("reads text only"), "{e}");
    }

    /// Anthropic's required `max_tokens` is a ceiling: past what fits in the memory budget it
    /// is lowered (Claude Code asks for 128,000 whatever the model); OpenAI's is refused.
    #[tokio::test]
    async fn an_anthropic_max_tokens_past_the_budget_is_lowered_and_an_openai_one_refused() {
        let e = engine();
        let fit = 400;
        let budget = e.baseline_memory as u64 + fit * e.info.kv_bytes_per_token as u64;
        let config = ServeConfig { memory_budget: Some(budget), ..Default::default() };
        let r = || app(crate::server::state(&config, e.clone(), None));
        let messages = r#""messages": [{"role": "user", "content": "hi"}], "temperature": 0"#;
        let (status, v) =
            check(r(), "POST", "/v1/messages", &format!(r#"{{"max_tokens": 128000, {messages}}}"#), &[]).await;
        assert_eq!(status, 200, "{v}");
        let used = v["usage"]["input_tokens"].as_u64().unwrap() + v["usage"]["output_tokens"].as_u64().unwrap();
        assert!(used <= fit, "{v}");
        let (status, v) =
            check(r(), "POST", "/v1/chat/completions", &format!(r#"{{"max_tokens": 128000, {messages}}}"#), &[]).await;
        assert_eq!((status, v["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{v}");
        assert_eq!(v["error"]["param"], "max_tokens", "{v}");
        // The error names the field the client sent, in its API's name.
        let (status, v) = check(
            r(),
            "POST",
            "/v1/chat/completions",
            &format!(r#"{{"max_completion_tokens": 128000, {messages}}}"#),
            &[],
        )
        .await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some("max_completion_tokens")), "{v}");
        // OpenAI's own wording (clients read the context length from it), then why it is 400.
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message
                .starts_with(&format!("This model's maximum context length is {fit} tokens. However, you requested ")),
            "{v}"
        );
        assert!(
            message.contains(
                " in the messages, 128000 in the completion). Please reduce the length of the messages or completion."
            ),
            "{v}"
        );
        // A prompt too long by itself is named by its own field.
        let long =
            format!(r#"{{"messages": [{{"role": "user", "content": "{}"}}], "max_tokens": 1}}"#, "hi ".repeat(2000));
        let (status, v) = check(r(), "POST", "/v1/chat/completions", &long, &[]).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(" in the messages, 1 in the completion)"), "{v}");
        // On /v1/messages, byte for byte the body Anthropic's service sends (Claude Code
        // compacts on it).
        let body =
            format!(r#"{{"max_tokens": 100, "messages": [{{"role": "user", "content": "{}"}}]}}"#, "hi ".repeat(2000));
        let response = r()
            .oneshot(
                axum::http::Request::builder()
                    .method("POST")
                    .uri("/v1/messages")
                    .header("host", "127.0.0.1")
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes);
        let prompt: usize = text
            .split("prompt is too long: ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{text}"));
        assert!(prompt > fit as usize, "{text}");
        assert_eq!(
            text,
            format!(
                r#"{{"type":"error","error":{{"type":"invalid_request_error","message":"prompt is too long: {prompt} tokens > {} maximum"}}}}"#,
                fit - 1
            )
        );
    }

    /// For a template that ignores tools, an assistant turn's earlier calls are written into
    /// it in the Hermes form the tools are described in (the template would drop them).
    #[tokio::test]
    async fn earlier_tool_calls_are_written_into_the_prompt_for_templates_that_ignore_tools() {
        let body = r#"{"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "cold"}]}"#;
        let (status, v) = check(router(None), "POST", "/tokenize", body, &[]).await;
        assert_eq!(status, 200, "{v}");
        let (_, text) =
            check(router(None), "POST", "/detokenize", &json!({"tokens": v["tokens"]}).to_string(), &[]).await;
        let text = text["prompt"].as_str().unwrap();
        assert!(
            text.contains(r#"<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>"#),
            "{text}"
        );
        assert!(text.find("<tool_call>").unwrap() < text.find("cold").unwrap(), "{text}");
    }

    #[tokio::test]
    async fn head_root_is_answered() {
        let (status, v) = check(router(None), "GET", "/", "", &[]).await;
        assert_eq!((status, v["service"].as_str()), (200, Some("host")));
        let head = Request::head("/").header("host", "127.0.0.1").body(Body::empty()).unwrap();
        let response = router(None).oneshot(head).await.unwrap();
        assert_eq!(response.status().as_u16(), 200);
    }

    #[tokio::test]
    async fn malformed_bodies_get_400_in_the_shape_of_their_api() {
        let (status, v) = check(router(None), "POST", "/v1/chat/completions", "{\"messages\": [", &[]).await;
        assert_eq!(status, 400);
        assert!(v["error"]["message"].as_str().unwrap().starts_with("malformed JSON"), "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let (status, v) = check(router(None), "POST", "/v1/messages", "{\"max_tokens\": \"x\"}", &[]).await;
        assert_eq!(status, 400);
        assert_eq!(v["type"], "error");
        assert!(v["error"]["message"].as_str().unwrap().contains("invalid type"), "{v}");
        let big = format!("{{\"messages\": \"{}\"}}", "a".repeat(1 << 17));
        let (status, v) = check(router(None), "POST", "/v1/chat/completions", &big, &[]).await;
        assert_eq!(status, 413, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("limit of 65536 bytes"), "{v}");
        let (status, v) = check(router(None), "POST", "/v1/messages", &big, &[]).await;
        assert_eq!((status, v["error"]["type"].as_str()), (413, Some("request_too_large")), "{v}");
    }

    /// A body over the limit is read to its end before the 413 (so the answer reaches a client
    /// still sending; `bounded_body`), streamed without a length or declared by one; a body
    /// at the limit passes whole.
    #[tokio::test]
    async fn an_oversized_body_is_read_to_its_end_before_the_413() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let read = Arc::new(AtomicUsize::new(0));
        let chunks = |n: usize, read: Arc<AtomicUsize>| {
            tokio_stream::iter((0..n).map(move |_| {
                read.fetch_add(1 << 14, Ordering::SeqCst);
                Ok::<_, Infallible>(Bytes::from(vec![b' '; 1 << 14]))
            }))
        };
        // 40 chunks of 16 KiB: 640 KiB against the 64 KiB limit.
        for declared in [None, Some(40 << 14)] {
            read.store(0, Ordering::SeqCst);
            let mut req = Request::builder()
                .method("POST")
                .uri("/v1/chat/completions")
                .header("host", "127.0.0.1")
                .header("content-type", "application/json");
            if let Some(n) = declared {
                req = req.header("content-length", n.to_string());
            }
            let body = Body::from_stream(chunks(40, read.clone()));
            let response = router(None).oneshot(req.body(body).unwrap()).await.unwrap();
            assert_eq!(response.status().as_u16(), 413);
            assert_eq!(read.load(Ordering::SeqCst), 40 << 14, "declared {declared:?}: the whole body was read");
        }
        // Declared beyond what is worth reading: refused before reading.
        read.store(0, Ordering::SeqCst);
        let req = Request::builder()
            .method("POST")
            .uri("/v1/chat/completions")
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .header("content-length", "1000000000");
        let response =
            router(None).oneshot(req.body(Body::from_stream(chunks(4, read.clone()))).unwrap()).await.unwrap();
        assert_eq!(response.status().as_u16(), 413);
        assert_eq!(read.load(Ordering::SeqCst), 0);
        // Exactly at the limit (4 chunks = 64 KiB of spaces): read whole and parsed (as JSON,
        // which spaces alone are not: a 400, not a 413).
        let body = Body::from_stream(chunks(4, read.clone()));
        let req = Request::post("/v1/chat/completions")
            .header("host", "127.0.0.1")
            .header("content-type", "application/json");
        let response = router(None).oneshot(req.body(body).unwrap()).await.unwrap();
        assert_eq!(response.status().as_u16(), 400);
    }

    #[tokio::test]
    async fn the_api_key_is_checked_everywhere_but_health() {
        let r = || router(Some("k"));
        let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}"#;
        assert_eq!(check(r(), "POST", "/v1/chat/completions", body, &[]).await.0, 401);
        assert_eq!(check(r(), "POST", "/v1/chat/completions", body, &[("authorization", "Bearer nope")]).await.0, 401);
        assert_eq!(check(r(), "POST", "/v1/chat/completions", body, &[("authorization", "Bearer k")]).await.0, 200);
        assert_eq!(check(r(), "GET", "/v1/models", "", &[("x-api-key", "k")]).await.0, 200);
        assert_eq!(check(r(), "GET", "/health", "", &[]).await.0, 200);
    }

    #[tokio::test]
    async fn unknown_routes_are_404_json_and_count_tokens_counts() {
        let (status, v) = check(router(None), "GET", "/v2/whatever", "", &[]).await;
        assert_eq!(status, 404);
        assert!(v["error"]["message"].as_str().unwrap().contains("/v2/whatever"));
        let body = r#"{"model": "m", "messages": [{"role": "user", "content": "hello"}]}"#;
        let (status, v) = check(router(None), "POST", "/v1/messages/count_tokens", body, &[]).await;
        assert_eq!(status, 200);
        // ChatML: "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n" in byte tokens.
        assert_eq!(v["input_tokens"], 1 + 5 + 5 + 1 + 1 + 1 + 10);
    }

    #[tokio::test]
    async fn tokenize_and_detokenize_round_trip_and_refuse_bad_input() {
        let (status, v) = check(router(None), "POST", "/tokenize", r#"{"prompt": "hello"}"#, &[]).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["count"], 5); // byte-level tokens
        let ids = v["tokens"].to_string();
        let (status, d) = check(router(None), "POST", "/detokenize", &format!(r#"{{"tokens": {ids}}}"#), &[]).await;
        assert_eq!((status, d["prompt"].as_str()), (200, Some("hello")), "{d}");
        let chat = r#"{"messages": [{"role": "user", "content": "hello"}]}"#;
        let (status, c) = check(router(None), "POST", "/tokenize", chat, &[]).await;
        assert_eq!(status, 200);
        assert_eq!(c["count"], 1 + 5 + 5 + 1 + 1 + 1 + 10, "{c}");
        let bad = [
            ("/tokenize", r#"{"prompt": "a", "messages": []}"#, "exactly one of"),
            ("/tokenize", r#"{}"#, "exactly one of"),
            ("/tokenize", r#"{"prompt": 3}"#, "invalid type"),
            ("/tokenize", r#"{"prompt": "a", "extra": 1}"#, "unknown field"),
            ("/detokenize", r#"{"tokens": [99999999]}"#, "outside the vocabulary"),
            ("/detokenize", r#"{"tokens": [-1]}"#, "invalid value"),
        ];
        for (path, body, want) in bad {
            let (status, v) = check(router(None), "POST", path, body, &[]).await;
            assert_eq!(status, 400, "{path} {body}: {v}");
            assert!(v["error"]["message"].as_str().unwrap().contains(want), "{path} {body}: {v}");
        }
    }

    #[test]
    fn the_tool_adapter_follows_the_chat_templates_markers() {
        use crate::server::detect_tool_adapter as detect;
        assert_eq!(detect(Some("{% if tools %}<tool_call>{{ t }}</tool_call>{% endif %}")), "hermes");
        assert_eq!(detect(Some("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>")), "qwen3-coder");
        assert_eq!(detect(Some("<function name=\"{{ name }}\"><param name=\"{{ k }}\">")), "minicpm5");
        assert_eq!(detect(Some("<|turn>model\n<|tool_call>call:{{ name }}{<tool_call|>")), "gemma4");
        assert_eq!(detect(Some("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]")), "mistral");
        assert_eq!(detect(Some("<|start_header_id|>ipython<|end_header_id|>")), "llama3-json");
        assert_eq!(detect(Some("<start_of_turn>user\n{{ m }}<end_of_turn>")), "gemma");
        assert_eq!(detect(Some("<|im_start|>{{ m }}<|im_end|>")), "hermes");
        assert_eq!(detect(Some("<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>")), "harmony");
        assert_eq!(detect(None), "hermes");
    }

    #[test]
    fn the_reasoning_parser_follows_the_chat_templates_markers() {
        use crate::server::detect_reasoning_parser as detect;
        let qwen3 = detect(Some("{%- if enable_thinking is false %}<think>\n\n</think>{% endif %}")).unwrap();
        assert_eq!((qwen3.name.as_str(), qwen3.config, qwen3.fallback), ("think", None, true));
        let magistral = detect(Some("[SYSTEM_PROMPT]{{ s }}[/SYSTEM_PROMPT][THINK]")).unwrap();
        assert_eq!(magistral.config, Some(json!({"open": "[THINK]", "close": "[/THINK]"})));
        let gpt_oss = detect(Some("<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>")).unwrap();
        assert_eq!((gpt_oss.name.as_str(), gpt_oss.config, gpt_oss.fallback), ("harmony-channels", None, true));
        let gemma4 =
            detect(Some("<|turn>model\n{%- if not enable_thinking %}<|channel>thought\n<channel|>{% endif %}"))
                .unwrap();
        assert_eq!(gemma4.config, Some(json!({"open": "<|channel>thought", "close": "<channel|>"})));
        assert!(detect(Some("<|im_start|>{{ m }}<|im_end|>")).is_none());
        assert!(detect(None).is_none());
    }

    #[test]
    fn earlier_thinking_goes_back_to_the_template_as_reasoning_content() {
        let chat = json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r1"},
            {"role": "user", "content": "q2", "reasoning_content": "not an assistant's"}]);
        let m = openai::template_messages(chat.as_array().unwrap()).unwrap();
        assert_eq!((m[1]["reasoning_content"].as_str(), m[2].get("reasoning_content")), (Some("r1"), None));
        let body = json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "r2", "signature": "s"}, {"type": "text", "text": "a"}]}]});
        let req: anthropic::MessagesRequest = serde_json::from_value(body).unwrap();
        let turn = anthropic::turn(&req, false).unwrap();
        let crate::server::turn::Input::Messages(messages) = turn.input else { panic!("a conversation") };
        assert_eq!(messages[1]["reasoning_content"], "r2");
    }

    #[tokio::test]
    async fn tools_and_tool_choice_are_checked_in_both_apis() {
        let tool = |name: &str| {
            format!(r#"{{"type": "function", "function": {{"name": "{name}", "parameters": {{"type": "object"}}}}}}"#)
        };
        let chat = |tools: &str, choice: &str| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 1, "tools": {tools}, "tool_choice": {choice}}}"#
            )
        };
        let one = format!("[{}]", tool("get_weather"));
        for choice in [
            "\"auto\"",
            "\"none\"",
            "\"required\"",
            r#"{"type": "function", "function": {"name": "get_weather"}}"#,
            "null",
        ] {
            let (status, v) = check(router(None), "POST", "/v1/chat/completions", &chat(&one, choice), &[]).await;
            assert_eq!(status, 200, "{choice}: {v}");
        }
        let bad = [
            (
                one.clone(),
                r#"{"type": "function", "function": {"name": "get_time"}}"#,
                "tool_choice",
                "\"get_time\", which is not among the request's tools (get_weather)",
            ),
            ("null".into(), "\"required\"", "tool_choice", "the request has no `tools`"),
            (one.clone(), "\"always\"", "tool_choice", "unknown `tool_choice` \"always\""),
            (one.clone(), r#"{"type": "function"}"#, "tool_choice", "must be {\"type\": \"function\""),
            (r#"[{"type": "function"}]"#.into(), "\"auto\"", "tools[0]", "needs a `function` object"),
            (
                r#"[{"type": "function", "function": {"name": ""}}]"#.into(),
                "\"auto\"",
                "tools[0].function.name",
                "non-empty string `name`",
            ),
            (r#"[{"type": "code_interpreter"}]"#.into(), "\"auto\"", "tools[0]", "tools of type \"function\""),
            (format!("[{}, {}]", tool("a"), tool("a")), "\"auto\"", "tools[1]", "two tools are named \"a\""),
            (
                r#"[{"type": "function", "function": {"name": "f", "parameters": "x"}}]"#.into(),
                "\"auto\"",
                "tools[0].function.parameters",
                "JSON Schema object",
            ),
            (
                r#"[{"type": "function", "function": {"name": "f", "description": 3}}]"#.into(),
                "\"auto\"",
                "tools[0].function.description",
                "`description` must be a string",
            ),
        ];
        for (tools, choice, param, want) in bad {
            let (status, v) = check(router(None), "POST", "/v1/chat/completions", &chat(&tools, choice), &[]).await;
            assert_eq!(status, 400, "{tools} {choice}: {v}");
            assert_eq!(v["error"]["param"], param, "{v}");
            assert!(v["error"]["message"].as_str().unwrap().contains(want), "{v}");
        }
        let no_content = r#"{"messages": [{"role": "user"}], "max_tokens": 1}"#;
        let (status, v) = check(router(None), "POST", "/v1/chat/completions", no_content, &[]).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[0].content")), "{v}");

        let messages = |choice: &str| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 1, "tools": [{{"name": "get_weather", "input_schema": {{"type": "object"}}}}], "tool_choice": {choice}}}"#
            )
        };
        for choice in [
            r#"{"type": "auto"}"#,
            r#"{"type": "any"}"#,
            r#"{"type": "none"}"#,
            r#"{"type": "tool", "name": "get_weather"}"#,
        ] {
            let (status, v) = check(router(None), "POST", "/v1/messages", &messages(choice), &[]).await;
            assert_eq!(status, 200, "{choice}: {v}");
        }
        for (choice, want) in [
            (r#"{"type": "tool", "name": "get_time"}"#, "\"get_time\", which is not among"),
            (r#"{"type": "tool"}"#, "needs the tool's `name`"),
            (r#"{"name": "get_weather"}"#, "needs a `type`"),
            (r#"{"type": "auto", "disable_parallel_tool_use": "yes"}"#, "must be a boolean"),
        ] {
            let (status, v) = check(router(None), "POST", "/v1/messages", &messages(choice), &[]).await;
            assert_eq!(status, 400, "{choice}: {v}");
            assert_eq!(v["type"], "error", "Anthropic's error shape: {v}");
            assert!(v["error"]["message"].as_str().unwrap().contains(want), "{v}");
        }
    }

    /// A model with recurrent layers (Qwen3.5) serves plain requests and speculative ones
    /// (its states roll back to their snapshots), on both APIs, the same text either way.
    #[tokio::test]
    async fn a_hybrid_model_serves_plain_and_speculative_requests_alike() {
        let dir = std::env::temp_dir().join(format!("host-routes-hybrid-{}", std::process::id()));
        models::testing::write_model(&dir, "qwen3_5", 3).unwrap();
        let engine = Arc::new(Engine::start(EngineConfig::cpu(dir.clone())).unwrap());
        let router = || app(crate::server::state(&ServeConfig::default(), engine.clone(), None));
        let chat = r#"{"messages": [{"role": "user", "content": "hi hi hi hi"}], "max_tokens": 6, "temperature": 0}"#;
        let (status, plain) = check(router(), "POST", "/v1/chat/completions", chat, &[]).await;
        assert_eq!((status, plain["usage"]["completion_tokens"].as_u64()), (200, Some(6)), "{plain}");
        let spec = chat.replace("\"temperature\": 0", "\"temperature\": 0, \"speculative\": \"prompt-lookup\"");
        let (status, v) = check(router(), "POST", "/v1/chat/completions", &spec, &[]).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], plain["choices"][0]["message"]["content"]);
        let messages = r#"{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "speculative": "prompt-lookup"}"#;
        let (status, v) = check(router(), "POST", "/v1/messages", messages, &[]).await;
        assert_eq!((status, v["type"].as_str()), (200, Some("message")), "{v}");
        drop(engine);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn the_speculative_field_is_validated_and_reported_in_usage() {
        let chat = |spec: &str| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": "abcabcabcabc"}}], "max_tokens": 12, "temperature": 0, "speculative": {spec}}}"#
            )
        };
        let (status, v) = check(router(None), "POST", "/v1/chat/completions", &chat("\"prompt-lookup\""), &[]).await;
        assert_eq!(status, 200, "{v}");
        let spec = &v["usage"]["speculative"];
        assert_eq!(spec["method"], "prompt-lookup", "{v}");
        assert!(spec["target_steps"].as_u64().unwrap() >= 1, "{v}");
        let (drafted, accepted) = (spec["drafted_tokens"].as_f64().unwrap(), spec["accepted_tokens"].as_f64().unwrap());
        let rate = if drafted > 0.0 { (accepted / drafted * 1000.0).round() / 1000.0 } else { 0.0 };
        assert_eq!(spec["acceptance_rate"].as_f64().unwrap(), rate, "{v}");
        let per_step = v["usage"]["completion_tokens"].as_f64().unwrap() / spec["target_steps"].as_f64().unwrap();
        assert_eq!(spec["tokens_per_step"].as_f64().unwrap(), (per_step * 1000.0).round() / 1000.0, "{v}");
        let (_, plain) = check(router(None), "POST", "/v1/chat/completions", &chat("\"off\""), &[]).await;
        assert_eq!(plain["choices"][0]["message"]["content"], v["choices"][0]["message"]["content"]);
        let several = chat(r#"{"method": "prompt-lookup", "candidates": 4}"#);
        let (status, c) = check(router(None), "POST", "/v1/chat/completions", &several, &[]).await;
        assert_eq!(status, 200, "{c}");
        assert_eq!(plain["choices"][0]["message"]["content"], c["choices"][0]["message"]["content"]);
        assert!(plain["usage"].get("speculative").is_none(), "{plain}");
        let bad = [
            ("\"draft\"", "needs a draft model"),
            ("\"fast\"", r#"must be "off", "prompt-lookup" or "draft""#),
            (r#"{"num_draft_tokens": 0}"#, "between 1 and 64"),
            (r#"{"num_draft_tokens": "many"}"#, "positive integer"),
            (r#"{"verify": "maybe"}"#, r#""exact" or "lossless""#),
            (r#"{"ngram_min": 5, "ngram_max": 2}"#, "n-gram sizes"),
            (r#"{"candidates": 0}"#, "`candidates` must be between 1 and 32"),
            (r#"{"k": 4}"#, "unknown key `speculative.k`"),
            ("[1]", "method name or an object"),
        ];
        for (field, want) in bad {
            let (status, v) = check(router(None), "POST", "/v1/chat/completions", &chat(field), &[]).await;
            assert_eq!(status, 400, "{field}: {v}");
            let message = v["error"]["message"].as_str().unwrap();
            assert!(message.contains(want), "{field}: {message}");
            assert_eq!(v["error"]["param"], "speculative");
        }
        let body = r#"{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "xyxyxyxy"}], "speculative": {"method": "prompt-lookup", "num_draft_tokens": 3}}"#;
        let (status, v) = check(router(None), "POST", "/v1/messages", body, &[]).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["speculative"]["method"], "prompt-lookup", "{v}");
    }
}
