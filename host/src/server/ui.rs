//! The built-in web page (issue 46): a chat with the served model and a console of its plugins,
//! served by `host serve` itself from files compiled into the binary (`host/ui/`: plain ES
//! modules, no build step). `GET /` gives the page to a browser (an `Accept` with `text/html`)
//! and the JSON description to every other client; `--no-ui` (`ui = false`) turns it off.
//!
//! The page is same-origin with the API, so the Host/Origin guard and the API key apply to its
//! requests as to any client's; the page and its files themselves carry no secret and load
//! without the key (the page asks for it). Every response of the page carries a strict
//! Content-Security-Policy: nothing loads from outside the server, no inline script or style.

use super::state::Shared;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// The page's files: name, content type, bytes.
const ASSETS: &[(&str, &str, &str)] = &[
    ("app.js", "text/javascript; charset=utf-8", include_str!("../../ui/app.js")),
    ("chat.js", "text/javascript; charset=utf-8", include_str!("../../ui/chat.js")),
    ("console.js", "text/javascript; charset=utf-8", include_str!("../../ui/console.js")),
    ("markdown.js", "text/javascript; charset=utf-8", include_str!("../../ui/markdown.js")),
    ("api.js", "text/javascript; charset=utf-8", include_str!("../../ui/api.js")),
    ("style.css", "text/css; charset=utf-8", include_str!("../../ui/style.css")),
    ("icon.svg", "image/svg+xml", include_str!("../../ui/icon.svg")),
];

const INDEX: &str = include_str!("../../ui/index.html");

/// Nothing from another origin, no inline script or style, no framing, no plugins.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// Whether a request asks for a page (a browser navigating) rather than data.
pub fn wants_page(state: &Shared, headers: &HeaderMap) -> bool {
    state.ui
        && headers.get_all(header::ACCEPT).iter().filter_map(|v| v.to_str().ok()).any(|v| {
            v.split(',').any(|t| t.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("text/html")))
        })
}

/// Whether `path` is one of the page's own files (served without the API key).
pub fn is_page_file(state: &Shared, path: &str) -> bool {
    state.ui && (path == "/favicon.ico" || path.strip_prefix("/ui/").is_some_and(|f| ASSETS.iter().any(|a| a.0 == f)))
}

fn page_headers(response: &mut Response, content_type: &'static str) {
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // The files change with the binary; a browser asks again (cheap on loopback).
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
}

/// The page itself.
pub fn index() -> Response {
    let mut response = INDEX.into_response();
    page_headers(&mut response, "text/html; charset=utf-8");
    response
}

/// `GET /ui/{file}`.
pub async fn asset(State(state): State<Shared>, Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|a| a.0 == file).filter(|_| state.ui) {
        Some((_, content_type, body)) => {
            let mut response = (*body).into_response();
            page_headers(&mut response, content_type);
            response
        }
        None => super::error::ApiError::new(StatusCode::NOT_FOUND, format!("no file /ui/{file}")).into_response(),
    }
}

/// `GET /favicon.ico`: the page's icon (browsers ask for it whatever the page says).
pub async fn favicon(State(state): State<Shared>) -> Response {
    if !state.ui {
        return StatusCode::NOT_FOUND.into_response();
    }
    let mut response = ASSETS.iter().find(|a| a.0 == "icon.svg").map(|a| a.2).unwrap_or_default().into_response();
    page_headers(&mut response, "image/svg+xml");
    response
}

/// The quantization of a model folder as its `config.json` records it (`"4-bit affine, group
/// 64"`), `"gguf"` for a GGUF file, `"none"` otherwise.
pub fn quantization(source: &std::path::Path) -> String {
    if source.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return "gguf".into();
    }
    let config = std::fs::read_to_string(source.join("config.json")).ok();
    let config: Option<serde_json::Value> = config.and_then(|c| serde_json::from_str(&c).ok());
    let q = config.as_ref().and_then(|c| c.get("quantization").or_else(|| c.get("quantization_config")));
    match q {
        Some(q) => {
            let bits = q.get("bits").and_then(|b| b.as_u64());
            let mode = q.get("mode").and_then(|m| m.as_str()).unwrap_or("affine");
            let group = q.get("group_size").and_then(|g| g.as_u64());
            match (bits, group) {
                (Some(b), Some(g)) => format!("{b}-bit {mode}, group {g}"),
                (Some(b), None) => format!("{b}-bit {mode}"),
                _ => mode.to_string(),
            }
        }
        None => "none".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_the_page_names_is_served_and_nothing_from_outside() {
        let page_and_modules: Vec<&str> = std::iter::once(INDEX).chain(ASSETS.iter().map(|a| a.2)).collect();
        for text in &page_and_modules {
            for (i, _) in text.match_indices("/ui/") {
                let name: String =
                    text[i + 4..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-').collect();
                assert!(ASSETS.iter().any(|a| a.0 == name), "a file names /ui/{name}, which is not served");
            }
            for (i, _) in text.match_indices("./") {
                let name: String =
                    text[i + 2..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-').collect();
                if name.ends_with(".js") {
                    assert!(ASSETS.iter().any(|a| a.0 == name), "a module imports ./{name}, which is not served");
                }
            }
            for scheme in ["http://", "https://", "//cdn"] {
                for (i, _) in text.match_indices(scheme) {
                    assert!(
                        text[i..].starts_with("http://www.w3.org/2000/svg"),
                        "an outside address: {}",
                        &text[i..i + 40]
                    );
                }
            }
        }
        assert!(!INDEX.contains("<script>") && !INDEX.contains("style="), "inline script or style breaks the CSP");
    }

    #[test]
    fn a_folders_quantization_is_read_from_its_config() {
        let dir = std::env::temp_dir().join(format!("host-ui-q-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"quantization": {"bits": 4, "group_size": 64}}"#).unwrap();
        assert_eq!(quantization(&dir), "4-bit affine, group 64");
        std::fs::write(dir.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
        assert_eq!(quantization(&dir), "none");
        assert_eq!(quantization(std::path::Path::new("/x/m.Q4_K_M.gguf")), "gguf");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
