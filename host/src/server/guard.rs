//! The local-server security policy, on by default: web pages the user visits must not be
//! able to drive a server on their machine.
//!
//! - `Host` must be an IP address, `localhost` (or a `*.localhost` name) or a name on the
//!   `allowed_hosts` list: a DNS-rebinding page reaches the server under its own domain name,
//!   which is refused, so it cannot read responses.
//! - A request with an `Origin` (a browser's cross-origin request) is refused unless the
//!   origin is the server's own or on the `cors_origins` list; those get CORS headers and
//!   their preflight (`OPTIONS`) answered. A "simple" cross-site POST (`text/plain`, sent
//!   without preflight) is refused before it reaches a handler.
//! - `Host` is one valid authority (several, none on HTTP/1.1, or a malformed one: 400).
//! - `POST` bodies must be declared JSON, once (`Content-Type: application/json` or
//!   `+json`), on the routes that take one ([`json_body`]).

use super::error::{quoted, ApiError};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Who may talk to the server, from `allowed_hosts` and `cors_origins` (`"*"`: anyone).
#[derive(Debug, Clone, Default)]
pub struct Policy {
    hosts: Vec<String>,
    origins: Vec<String>,
}

impl Policy {
    pub fn new(hosts: &[String], origins: &[String]) -> Policy {
        let norm = |v: &[String]| v.iter().map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase()).collect();
        Policy { hosts: norm(hosts), origins: norm(origins) }
    }

    /// Whether a `Host` header value (a name or address, maybe with a port) is one this
    /// server answers to.
    pub fn host_ok(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        name.parse::<std::net::IpAddr>().is_ok()
            || name == "localhost"
            || name.ends_with(".localhost")
            || self.hosts.iter().any(|h| h == "*" || *h == name)
    }

    /// Whether a browser page at `origin` may make requests: the server's own origin (the
    /// request's `host`), or one on the list.
    pub fn origin_ok(&self, origin: &str, host: Option<&str>) -> bool {
        let origin = origin.trim_end_matches('/').to_ascii_lowercase();
        let own = host.is_some_and(|h| {
            let h = h.to_ascii_lowercase();
            origin == format!("http://{h}") || origin == format!("https://{h}")
        });
        own || self.origins.iter().any(|o| o == "*" || *o == origin)
    }
}

/// The name or address in a `Host` value, without its port (`[::1]:8080` -> `::1`).
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

fn refuse(status: StatusCode, code: &'static str, message: String) -> Response {
    ApiError::new(status, message).with_code(code).into_response()
}

/// The middleware: refuses what the policy does not allow, answers preflights, and adds the
/// CORS headers to an allowed cross-origin request's response.
pub async fn guard(State(policy): State<Policy>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    let text = |h: &HeaderMap, name: header::HeaderName| {
        h.get(name).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    // RFC 9110 §7.2 / RFC 9112 §3.2: exactly one valid Host on HTTP/1.1 (HTTP/2 carries the
    // authority in the URI). Several Host headers used to pass on the first one's word.
    let hosts = headers.get_all(header::HOST).iter().count();
    let host = text(headers, header::HOST).or_else(|| req.uri().authority().map(|a| a.to_string()));
    let bad_host = match (&host, hosts) {
        (_, 2..) => Some(format!("{hosts} Host headers; send exactly one")),
        (None, _) if req.version() == axum::http::Version::HTTP_11 => {
            Some("no Host header; an HTTP/1.1 request must name the host it is for".to_string())
        }
        (Some(h), _) if h.parse::<axum::http::uri::Authority>().is_err() => {
            Some(format!("the Host {} is not a valid host name or address (with an optional port)", quoted(h)))
        }
        _ => None,
    };
    if let Some(message) = bad_host {
        return refuse(StatusCode::BAD_REQUEST, "invalid_host", message);
    }
    if let Some(host) = host.as_deref().filter(|h| !policy.host_ok(h)) {
        let message = format!(
            "the Host {host:?} is not one this server answers to (IP addresses, localhost and --allowed-host names are): \
             a guard against DNS rebinding; add the name with --allowed-host (allowed_hosts in host.toml)"
        );
        return refuse(StatusCode::FORBIDDEN, "host_not_allowed", message);
    }
    let origin = text(headers, header::ORIGIN);
    if let Some(origin) = origin.as_deref().filter(|o| !policy.origin_ok(o, host.as_deref())) {
        let message = format!(
            "cross-origin requests from {origin:?} are refused (a web page must not drive a local server); \
             allow the origin with --cors-origin (cors_origins in host.toml)"
        );
        return refuse(StatusCode::FORBIDDEN, "origin_not_allowed", message);
    }
    if req.method() == Method::OPTIONS {
        let mut response = StatusCode::NO_CONTENT.into_response();
        let h = response.headers_mut();
        h.insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST, DELETE, OPTIONS"));
        if let Some(origin) = &origin {
            cors(h, origin);
            h.insert(
                header::ACCESS_CONTROL_ALLOW_METHODS,
                HeaderValue::from_static("GET, HEAD, POST, DELETE, OPTIONS"),
            );
            let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
            let allowed = asked.unwrap_or_else(|| HeaderValue::from_static("authorization, content-type, x-api-key"));
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, allowed);
            h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        }
        return response;
    }
    let mut response = next.run(req).await;
    if let Some(origin) = &origin {
        cors(response.headers_mut(), origin);
    }
    response
}

/// A route's `POST` body must be declared JSON, once (`Content-Type: application/json` or
/// `+json`). Applied to the routes only (`Router::route_layer`): a `POST` to a path that takes
/// none is a 405, whatever its type.
pub async fn json_body(req: Request, next: Next) -> Response {
    if req.method() == Method::POST {
        let kinds: Vec<String> = req
            .headers()
            .get_all(header::CONTENT_TYPE)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect();
        if kinds.len() > 1 {
            let message =
                format!("{} Content-Type headers; send exactly one: `Content-Type: application/json`", kinds.len());
            return refuse(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", message);
        }
        let kind = kinds.into_iter().next().unwrap_or_default();
        let essence = kind.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        if essence != "application/json" && !essence.ends_with("+json") {
            let got = if kind.is_empty() { "none".to_string() } else { quoted(&kind) };
            let message = format!("send the request body as JSON with `Content-Type: application/json` (got {got})");
            return refuse(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", message);
        }
    }
    next.run(req).await
}

fn cors(h: &mut HeaderMap, origin: &str) {
    if let Ok(v) = HeaderValue::from_str(origin) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_origins() {
        let p = Policy::new(&["my-box.lan".into()], &["http://localhost:3000/".into()]);
        for ok in [
            "127.0.0.1:8080",
            "localhost",
            "LOCALHOST:80",
            "app.localhost:9",
            "[::1]:8080",
            "10.0.0.5",
            "my-box.lan:8080",
        ] {
            assert!(p.host_ok(ok), "{ok}");
        }
        for bad in ["evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.1.nip.io"] {
            assert!(!p.host_ok(bad), "{bad}");
        }
        assert!(p.origin_ok("http://localhost:3000", Some("127.0.0.1:8080")));
        assert!(p.origin_ok("http://127.0.0.1:8080", Some("127.0.0.1:8080")), "its own origin");
        assert!(!p.origin_ok("http://evil.example", Some("127.0.0.1:8080")));
        assert!(!p.origin_ok("null", Some("127.0.0.1:8080")));
        let open = Policy::new(&["*".into()], &["*".into()]);
        assert!(open.host_ok("anything.example") && open.origin_ok("http://evil.example", None));
    }
}
