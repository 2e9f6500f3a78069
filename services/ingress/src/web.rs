//! The web chat client: a few static files (`services/ingress/web/`) compiled into the
//! binary and served at `/` and `/assets/…`, so the one binary is the whole product and
//! nothing is fetched from elsewhere at run time. Every answer carries a strict
//! Content-Security-Policy: only this origin's scripts run, and no inline script at all.

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::error::ApiError;

/// Same-origin everything. The app builds its DOM from text (never HTML from a message),
/// and images in messages are references, not URLs, so nothing else needs allowing.
/// `frame-ancestors` keeps the app out of other sites' frames (clickjacking).
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; \
                   frame-ancestors 'none'";

/// One embedded file. The ETag is computed at compile time, so a new binary with changed
/// assets is picked up by a browser's revalidation, and an unchanged one costs a 304.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
    etag: u64,
}

const fn asset(name: &'static str, content_type: &'static str, body: &'static [u8]) -> Asset {
    Asset { name, content_type, body, etag: fnv1a(body) }
}

/// FNV-1a: a content fingerprint for the ETag (not a security measure), cheap enough for
/// a `const` context.
const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

const JS: &str = "text/javascript; charset=utf-8";

const INDEX: Asset = asset("index.html", "text/html; charset=utf-8", include_bytes!("../web/index.html"));

/// What `/assets/{name}` serves; `index.html` links each of them.
const ASSETS: &[Asset] = &[
    asset("app.js", JS, include_bytes!("../web/app.js")),
    asset("api.js", JS, include_bytes!("../web/api.js")),
    asset("attachments.js", JS, include_bytes!("../web/attachments.js")),
    asset("branches.js", JS, include_bytes!("../web/branches.js")),
    asset("dom.js", JS, include_bytes!("../web/dom.js")),
    asset("import-export.js", JS, include_bytes!("../web/import-export.js")),
    asset("inspector.js", JS, include_bytes!("../web/inspector.js")),
    asset("markdown.js", JS, include_bytes!("../web/markdown.js")),
    asset("search.js", JS, include_bytes!("../web/search.js")),
    asset("session.js", JS, include_bytes!("../web/session.js")),
    asset("session-actions.js", JS, include_bytes!("../web/session-actions.js")),
    asset("session-list.js", JS, include_bytes!("../web/session-list.js")),
    asset("snapshot.js", JS, include_bytes!("../web/snapshot.js")),
    asset("sse.js", JS, include_bytes!("../web/sse.js")),
    asset("state.js", JS, include_bytes!("../web/state.js")),
    asset("transcript.js", JS, include_bytes!("../web/transcript.js")),
    asset("turn.js", JS, include_bytes!("../web/turn.js")),
    asset("app.css", "text/css; charset=utf-8", include_bytes!("../web/app.css")),
    asset("icon.svg", "image/svg+xml", include_bytes!("../web/icon.svg")),
];

/// The client's routes, to merge into the API router (which keeps its JSON 404 for every
/// other path).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new().route("/", get(index)).route("/assets/{name}", get(named_asset))
}

async fn index(headers: HeaderMap) -> Response {
    serve(&INDEX, &headers)
}

async fn named_asset(Path(name): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().find(|a| a.name == name) {
        Some(a) => serve(a, &headers),
        None => ApiError::NotFound("no such asset".into()).into_response(),
    }
}

fn serve(asset: &Asset, request: &HeaderMap) -> Response {
    let etag = format!("\"{:016x}\"", asset.etag);
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let mut response =
        if fresh { StatusCode::NOT_MODIFIED.into_response() } else { asset.body.into_response() };
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(asset.content_type));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // Revalidate every time: the files change with the binary, not with a versioned URL.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(&etag) {
        headers.insert(header::ETAG, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(asset: &Asset) -> &str {
        std::str::from_utf8(asset.body).unwrap()
    }

    #[tokio::test]
    async fn index_is_html_under_the_policy() {
        let r = index(HeaderMap::new()).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "text/html; charset=utf-8");
        let csp = r.headers()[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(csp.starts_with("default-src 'self'"));
        assert!(!csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"));
    }

    #[tokio::test]
    async fn assets_have_their_types_and_unknown_ones_are_json_404() {
        let r = named_asset(Path("app.js".into()), HeaderMap::new()).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "text/javascript; charset=utf-8");
        let r = named_asset(Path("app.css".into()), HeaderMap::new()).await;
        assert_eq!(r.headers()[header::CONTENT_TYPE], "text/css; charset=utf-8");
        let r = named_asset(Path("../Cargo.toml".into()), HeaderMap::new()).await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
    }

    /// The client is a set of modules: each is served as JavaScript under the same headers.
    #[tokio::test]
    async fn every_module_is_javascript_under_the_policy() {
        let page = index(HeaderMap::new()).await;
        let kept = [
            header::CONTENT_SECURITY_POLICY,
            header::X_CONTENT_TYPE_OPTIONS,
            header::REFERRER_POLICY,
            header::CACHE_CONTROL,
        ];
        for js in ASSETS.iter().filter(|a| a.name.ends_with(".js")) {
            let r = named_asset(Path(js.name.into()), HeaderMap::new()).await;
            assert_eq!(r.status(), StatusCode::OK, "{}", js.name);
            assert_eq!(r.headers()[header::CONTENT_TYPE], JS, "{}", js.name);
            for h in &kept {
                assert_eq!(r.headers()[h], page.headers()[h], "{} {h}", js.name);
            }
        }
    }

    #[tokio::test]
    async fn a_matching_etag_is_not_modified() {
        let first = named_asset(Path("app.css".into()), HeaderMap::new()).await;
        let mut again = HeaderMap::new();
        again.insert(header::IF_NONE_MATCH, first.headers()[header::ETAG].clone());
        let r = named_asset(Path("app.css".into()), again).await;
        assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
    }

    /// The policy forbids inline script: every script must be a file that is served.
    #[test]
    fn the_page_links_only_served_files_and_has_no_inline_script() {
        let html = text(&INDEX);
        for tag in html.split("<script").skip(1) {
            let open = &tag[..tag.find('>').unwrap()];
            assert!(open.contains("src=\"/assets/"), "inline or foreign script: <script{open}>");
            assert!(tag[open.len() + 1..].trim_start().starts_with("</script>"), "script with a body");
        }
        let inline_handler = html.match_indices(" on").any(|(i, _)| {
            let rest = &html[i + 3..];
            let name = rest.chars().take_while(char::is_ascii_lowercase).count();
            name > 0 && rest[name..].starts_with('=')
        });
        assert!(!inline_handler, "an inline event handler (on…=) in index.html");
        let mut linked = 0;
        for part in html.split("/assets/").skip(1) {
            let name = &part[..part.find('"').unwrap()];
            assert!(ASSETS.iter().any(|a| a.name == name), "index.html links a missing asset {name}");
            linked += 1;
        }
        assert!(linked >= 3);
        // Modules import each other by relative path; those must be served too.
        for js in ASSETS.iter().filter(|a| a.name.ends_with(".js")) {
            for part in text(js).split("from './").skip(1) {
                let name = &part[..part.find('\'').unwrap()];
                assert!(ASSETS.iter().any(|a| a.name == name), "{} imports a missing {name}", js.name);
            }
        }
    }
}
