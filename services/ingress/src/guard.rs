//! What every request must meet before any route sees it (DESIGN.md §7, Limits): a body is
//! JSON, and a server without API tokens answers only this machine's own pages and tools.
//! A web page the user visits can send a simple cross-site POST (`text/plain`, no
//! preflight) to a local server, and a rebinding DNS name can make it same-site; neither
//! gets through here.

use axum::extract::{Request, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, ORIGIN, TRANSFER_ENCODING};
use axum::http::{HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};

use crate::error::ApiError;

/// Host names a local server answers to, any port.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// Whether the server runs without API tokens (as owner `local`).
#[derive(Debug, Clone, Copy)]
pub struct LocalMode(pub bool);

/// The middleware: refuses what `admit` refuses, before a handler reads anything.
pub async fn check(State(LocalMode(local)): State<LocalMode>, req: Request, next: Next) -> Response {
    match admit(local, takes_uploads(req.method(), req.uri().path()), req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// The upload routes take other types than JSON (DESIGN §12, imports) and check their own.
/// A method no route of their paths takes is the router's 405 whatever its body, as on
/// every other path; only the file list's GET is a JSON route there.
fn takes_uploads(method: &Method, path: &str) -> bool {
    match path {
        "/v1/files" => method != Method::GET && method != Method::HEAD,
        "/v1/import" => true,
        _ => false,
    }
}

/// In local mode the caller must be this machine's (403); then a body must be JSON (415).
fn admit(local: bool, multipart: bool, headers: &HeaderMap) -> Result<(), ApiError> {
    if local {
        same_machine(headers)?;
    }
    if multipart {
        return Ok(());
    }
    json_body(headers)
}

/// A request with a body (`Content-Length` > 0, or chunked) must say `application/json`
/// (parameters such as `charset` allowed). Bodyless requests pass with any type or none:
/// SDKs send a cancel or delete with a JSON type and no body, curl a `stop` with none.
fn json_body(headers: &HeaderMap) -> Result<(), ApiError> {
    let sized = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 0);
    let has_body = sized || headers.contains_key(TRANSFER_ENCODING);
    let is_json = |v: &HeaderValue| {
        v.to_str()
            .ok()
            .and_then(|t| t.split(';').next())
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
    };
    if !has_body || headers.get(CONTENT_TYPE).is_some_and(is_json) {
        return Ok(());
    }
    Err(ApiError::UnsupportedMediaType(
        "a request body must be JSON: send it with `Content-Type: application/json`".into(),
    ))
}

/// Without tokens, anyone who reaches the server acts as the `local` owner, so it takes
/// requests only for a loopback name (a rebinding DNS name is refused) and, when a browser
/// says where a request comes from, only from a page of this same server (`Origin: null`,
/// a sandboxed or file page, included in what is refused).
fn same_machine(headers: &HeaderMap) -> Result<(), ApiError> {
    let mut hosts = headers.get_all(HOST).iter();
    let host = match (hosts.next().and_then(|v| v.to_str().ok()), hosts.next()) {
        (Some(host), None) if is_loopback_host(host) => host,
        _ => {
            return Err(ApiError::Forbidden(
                "this server runs without API tokens and answers only requests addressed to \
                 localhost, 127.0.0.1 or [::1]"
                    .into(),
            ))
        }
    };
    let own_origin = format!("http://{host}");
    let foreign = headers
        .get_all(ORIGIN)
        .iter()
        .any(|o| !o.to_str().is_ok_and(|o| o.eq_ignore_ascii_case(&own_origin)));
    if foreign {
        return Err(ApiError::Forbidden(
            "this server runs without API tokens and answers only its own pages, not another \
             site's"
                .into(),
        ));
    }
    Ok(())
}

/// `localhost`, `127.0.0.1` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.rsplit_once(':') {
        // `[::1]` alone has colons but no port after its bracket.
        Some((name, port))
            if !name.is_empty() && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) =>
        {
            name
        }
        _ => host,
    };
    LOOPBACK_NAMES.iter().any(|n| n.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).expect("a header value"));
        }
        h
    }

    fn code(local: bool, pairs: &[(&'static str, &str)]) -> Option<&'static str> {
        admit(local, false, &headers(pairs)).err().map(|e| e.code())
    }

    #[test]
    fn loopback_names_with_any_port() {
        for ok in
            ["localhost", "localhost:8080", "127.0.0.1", "127.0.0.1:1", "[::1]", "[::1]:8080", "LocalHost:80"]
        {
            assert!(is_loopback_host(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "localhost.",
            "127.0.0.2",
            "0.0.0.0:8080",
            "[::2]:80",
            "::1",
            "localhost:",
            "localhost:80x",
            "user@localhost",
            "",
        ] {
            assert!(!is_loopback_host(bad), "{bad}");
        }
    }

    #[test]
    fn local_mode_refuses_other_hosts_and_origins() {
        let forbidden = Some("forbidden");
        assert_eq!(code(true, &[("host", "127.0.0.1:8080")]), None);
        assert_eq!(code(true, &[("host", "localhost:8080"), ("origin", "http://localhost:8080")]), None);
        assert_eq!(code(true, &[("host", "[::1]:9"), ("origin", "http://[::1]:9")]), None);
        assert_eq!(code(true, &[("host", "rebound.example:8080")]), forbidden);
        assert_eq!(code(true, &[]), forbidden, "no Host");
        assert_eq!(code(true, &[("host", "localhost"), ("host", "evil.example")]), forbidden);
        for origin in [
            "null",
            "http://evil.example",
            "http://localhost:8081",
            "http://127.0.0.1:8080",
            "https://localhost:8080",
            "",
        ] {
            assert_eq!(code(true, &[("host", "localhost:8080"), ("origin", origin)]), forbidden, "{origin}");
        }
        // With tokens, the bearer token decides instead.
        assert_eq!(code(false, &[("host", "turnlog.example"), ("origin", "null")]), None);
    }

    #[test]
    fn only_the_upload_routes_take_other_types() {
        for method in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE, Method::TRACE] {
            assert!(takes_uploads(&method, "/v1/files"), "{method}");
            assert!(takes_uploads(&method, "/v1/import"), "{method}");
            assert!(!takes_uploads(&method, "/v1/sessions"), "{method}");
        }
        assert!(takes_uploads(&Method::GET, "/v1/import"));
        assert!(!takes_uploads(&Method::GET, "/v1/files"));
        assert!(!takes_uploads(&Method::POST, "/v1/files/x"));
    }

    #[test]
    fn a_body_must_be_json_and_no_body_may_have_any_type() {
        let host = ("host", "localhost");
        let unsupported = Some("unsupported_media_type");
        for (local, len) in [(true, "12"), (false, "12")] {
            let with = |t: &str| code(local, &[host, ("content-length", len), ("content-type", t)]);
            assert_eq!(with("application/json"), None);
            assert_eq!(with("application/json; charset=utf-8"), None);
            assert_eq!(with("Application/JSON"), None);
            assert_eq!(with("text/plain"), unsupported);
            assert_eq!(with("application/x-www-form-urlencoded"), unsupported);
            assert_eq!(with("multipart/form-data; boundary=x"), unsupported);
            assert_eq!(with("application/jsonx"), unsupported);
            assert_eq!(code(local, &[host, ("content-length", len)]), unsupported, "no type");
        }
        assert_eq!(
            code(true, &[host, ("transfer-encoding", "chunked"), ("content-type", "text/plain")]),
            unsupported
        );
        assert_eq!(
            code(true, &[host, ("transfer-encoding", "chunked"), ("content-type", "application/json")]),
            None
        );
        assert_eq!(code(true, &[host, ("content-length", "0"), ("content-type", "text/plain")]), None);
        assert_eq!(code(true, &[host, ("content-length", "0")]), None);
        assert_eq!(code(true, &[host]), None);
    }
}
