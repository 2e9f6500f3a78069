//! A table of client mistakes: each is a 4xx with the error shape — never a 5xx — and
//! nothing reaches the writer or the database.

use reqwest::Method;
use serde_json::json;
use turnlog_core::log_builder::permission_request;
use turnlog_e2e::api::{Api, Body, ALICE};
use uuid::Uuid;

fn raw(s: &str) -> Body {
    Body::Raw(s.as_bytes().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_are_4xx_with_the_error_shape_and_write_nothing() {
    let api = Api::start().await;
    let id = api.create(ALICE, Some("target")).await;
    let perm = permission_request("p1", "low");
    api.append(id, "alice", &perm).await;
    let s = format!("/v1/sessions/{id}");
    let unknown = format!("/v1/sessions/{}", Uuid::now_v7());
    let before = api.written().await;

    let mut invalid_utf8 = br#"{"title": ""#.to_vec();
    invalid_utf8.extend_from_slice(&[0xff, 0xfe, 0xc3]);
    invalid_utf8.extend_from_slice(br#""}"#);
    let two_mib = format!(r#"{{"title": "{}"}}"#, "x".repeat(2 * 1024 * 1024));
    // Exactly at the limit the body is read (and its title refused); one byte more is 413.
    let sized = |total: usize| format!(r#"{{"title": "{}"}}"#, "x".repeat(total - r#"{"title": ""}"#.len()));
    let at_limit = sized(1024 * 1024);
    let over_limit = sized(1024 * 1024 + 1);

    let cases: Vec<(&str, Method, String, Body, u16)> = vec![
        ("malformed JSON", Method::POST, "/v1/sessions".into(), raw(r#"{"title": "#), 400),
        ("not an object", Method::POST, "/v1/sessions".into(), raw("[1, 2]"), 400),
        (
            "title of the wrong type",
            Method::POST,
            "/v1/sessions".into(),
            Body::Json(json!({"title": 5})),
            400,
        ),
        ("empty title", Method::POST, "/v1/sessions".into(), Body::Json(json!({"title": ""})), 400),
        ("blank title", Method::POST, "/v1/sessions".into(), Body::Json(json!({"title": " \n "})), 400),
        (
            "title over 512 chars",
            Method::POST,
            "/v1/sessions".into(),
            Body::Json(json!({"title": "t".repeat(513)})),
            400,
        ),
        ("unknown field", Method::POST, "/v1/sessions".into(), Body::Json(json!({"titel": "typo"})), 400),
        ("NUL in title", Method::POST, "/v1/sessions".into(), Body::Json(json!({"title": "a\u{0}b"})), 400),
        ("escaped NUL", Method::POST, "/v1/sessions".into(), raw(r#"{"title": "a\u0000b"}"#), 400),
        ("lone surrogate", Method::POST, "/v1/sessions".into(), raw(r#"{"title": "\ud800"}"#), 400),
        ("lone low surrogate", Method::POST, "/v1/sessions".into(), raw(r#"{"title": "x\udc00y"}"#), 400),
        ("invalid UTF-8", Method::POST, "/v1/sessions".into(), Body::Raw(invalid_utf8), 400),
        ("2 MiB body", Method::POST, "/v1/sessions".into(), Body::Raw(two_mib.into_bytes()), 413),
        ("body at the limit", Method::POST, "/v1/sessions".into(), Body::Raw(at_limit.into_bytes()), 400),
        ("body one byte over", Method::POST, "/v1/sessions".into(), Body::Raw(over_limit.into_bytes()), 413),
        (
            "2 MiB patch",
            Method::PATCH,
            s.clone(),
            Body::Raw(format!(r#"{{"title": "{}"}}"#, "y".repeat(2 << 20)).into_bytes()),
            413,
        ),
        ("empty patch", Method::PATCH, s.clone(), Body::Json(json!({})), 400),
        (
            "patch with nulls only",
            Method::PATCH,
            s.clone(),
            Body::Json(json!({"title": null, "archived": null})),
            400,
        ),
        ("archived of the wrong type", Method::PATCH, s.clone(), Body::Json(json!({"archived": "yes"})), 400),
        ("NUL in patched title", Method::PATCH, s.clone(), Body::Json(json!({"title": "\u{0}"})), 400),
        ("lone surrogate in patch", Method::PATCH, s.clone(), raw(r#"{"title": "ok\ud83d"}"#), 400),
        ("invalid UUID (get)", Method::GET, "/v1/sessions/not-a-uuid".into(), Body::None, 400),
        (
            "invalid UUID (patch)",
            Method::PATCH,
            "/v1/sessions/123".into(),
            Body::Json(json!({"title": "x"})),
            400,
        ),
        ("invalid UUID (delete)", Method::DELETE, "/v1/sessions/zzzz".into(), Body::None, 400),
        ("invalid UUID (events)", Method::GET, "/v1/sessions/abc/events".into(), Body::None, 400),
        ("invalid UUID (context)", Method::GET, "/v1/sessions/abc/context".into(), Body::None, 400),
        ("limit 0", Method::GET, "/v1/sessions?limit=0".into(), Body::None, 400),
        ("limit -1", Method::GET, "/v1/sessions?limit=-1".into(), Body::None, 400),
        ("limit 1000", Method::GET, "/v1/sessions?limit=1000".into(), Body::None, 400),
        ("limit 201", Method::GET, "/v1/sessions?limit=201".into(), Body::None, 400),
        ("limit abc", Method::GET, "/v1/sessions?limit=abc".into(), Body::None, 400),
        ("limit empty", Method::GET, "/v1/sessions?limit=".into(), Body::None, 400),
        ("archived maybe", Method::GET, "/v1/sessions?archived=maybe".into(), Body::None, 400),
        (
            "unparseable before",
            Method::GET,
            format!("/v1/sessions?before=yesterday&before_id={id}"),
            Body::None,
            400,
        ),
        (
            "before without before_id",
            Method::GET,
            "/v1/sessions?before=2024-05-01T10:00:00.123456Z".into(),
            Body::None,
            400,
        ),
        ("before_id without before", Method::GET, format!("/v1/sessions?before_id={id}"), Body::None, 400),
        (
            "invalid before_id",
            Method::GET,
            "/v1/sessions?before=2024-05-01T10:00:00Z&before_id=nope".into(),
            Body::None,
            400,
        ),
        ("NUL in search", Method::GET, "/v1/sessions?q=a%00b".into(), Body::None, 400),
        ("events limit 0", Method::GET, format!("{s}/events?limit=0"), Body::None, 400),
        ("events after -1", Method::GET, format!("{s}/events?after=-1"), Body::None, 400),
        ("events after abc", Method::GET, format!("{s}/events?after=abc"), Body::None, 400),
        ("memories limit 1000", Method::GET, "/v1/memories?limit=1000".into(), Body::None, 400),
        ("NUL in memory search", Method::GET, "/v1/memories?q=%00".into(), Body::None, 400),
        ("missing decision", Method::POST, format!("{s}/permissions/p1"), Body::Json(json!({})), 400),
        (
            "unknown decision",
            Method::POST,
            format!("{s}/permissions/p1"),
            Body::Json(json!({"decision": "maybe"})),
            400,
        ),
        (
            "decision of the wrong type",
            Method::POST,
            format!("{s}/permissions/p1"),
            Body::Json(json!({"decision": true})),
            400,
        ),
        (
            "unknown permission",
            Method::POST,
            format!("{s}/permissions/nope"),
            Body::Json(json!({"decision": "allow"})),
            404,
        ),
        ("unknown session (get)", Method::GET, unknown.clone(), Body::None, 404),
        ("unknown session (patch)", Method::PATCH, unknown.clone(), Body::Json(json!({"title": "x"})), 404),
        ("unknown session (delete)", Method::DELETE, unknown.clone(), Body::None, 404),
        ("unknown session (events)", Method::GET, format!("{unknown}/events"), Body::None, 404),
        ("unknown session (context)", Method::GET, format!("{unknown}/context"), Body::None, 404),
        (
            "unknown session (permission)",
            Method::POST,
            format!("{unknown}/permissions/p1"),
            Body::Json(json!({"decision": "deny"})),
            404,
        ),
        ("unknown route", Method::GET, "/v1/nope".into(), Body::None, 404),
        ("unknown route under a session", Method::GET, format!("{s}/nope"), Body::None, 404),
        // `/` is the web client; other paths outside /v1 are still JSON 404s.
        ("unknown page", Method::GET, "/nope".into(), Body::None, 404),
        ("unknown web asset", Method::GET, "/assets/nope.js".into(), Body::None, 404),
        ("wrong method (collection)", Method::PUT, "/v1/sessions".into(), Body::Json(json!({})), 405),
        ("wrong method (session)", Method::POST, s.clone(), Body::Json(json!({})), 405),
        ("wrong method (context)", Method::DELETE, format!("{s}/context"), Body::None, 405),
    ];

    let mut failures = Vec::new();
    for (name, method, path, body, expected) in cases {
        let r = api.call(method.clone(), &path, Some(ALICE), body).await;
        let code = r.json["error"]["code"].as_str().unwrap_or("<none>").to_owned();
        let shaped = r.json["error"]["message"].as_str().is_some_and(|m| !m.is_empty());
        let expected_code = match expected {
            400 => "bad_request",
            404 => "not_found",
            405 => "method_not_allowed",
            413 => "payload_too_large",
            _ => "?",
        };
        if r.status != expected || code != expected_code || !shaped {
            failures.push(format!("{name}: {method} {path:.80} → {} {:.200}", r.status, r.text));
        }
        if expected == 405 {
            assert!(r.headers.contains_key("allow"), "{name}: 405 without Allow");
        }
    }
    assert!(failures.is_empty(), "{} cases failed:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(api.written().await, before, "a bad input wrote something");

    // The target session is as it was.
    let r = api.get(&s, ALICE).await;
    assert_eq!(r.json["session"]["title"], "target");
}

/// What the log cannot store, sent through the OpenAI-compatible routes: a 400 in OpenAI's
/// error shape before anything is appended or the model is called — never an answer that
/// streams and is then lost, a 502 blaming the gateway, or an empty conversation left over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstorable_text_on_the_openai_routes_is_a_400_before_anything_is_written() {
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let api =
        Api::with(turnlog_e2e::api::Options { llm_url: Some(mock.base_url()), ..Default::default() }).await;
    let conversation = api.call(Method::POST, "/v1/conversations", Some(ALICE), Body::Json(json!({}))).await;
    assert_eq!(conversation.status, 200, "{}", conversation.text);
    let items = format!("/v1/conversations/{}/items", conversation.json["id"].as_str().unwrap());
    let before = api.written().await;
    let user = |text: &str| json!([{"role": "user", "content": text}]);
    let long = "x".repeat(256 * 1024 + 1);
    let cases: Vec<(&str, &str, serde_json::Value)> = vec![
        ("NUL in instructions", "/v1/responses", json!({"input": "hi", "instructions": "a\u{0}b"})),
        ("NUL in input", "/v1/responses", json!({"input": "a\u{0}b"})),
        ("text over the limit", "/v1/responses", json!({"input": long})),
        (
            "NUL in a stop sequence",
            "/v1/chat/completions",
            json!({"messages": user("hi"), "stop": ["\u{0}"]}),
        ),
        (
            "NUL in reasoning_effort",
            "/v1/chat/completions",
            json!({"messages": user("hi"), "reasoning_effort": "lo\u{0}w"}),
        ),
        (
            "NUL in a system message",
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "a\u{0}b"}, {"role": "user", "content": "hi"}]}),
        ),
        (
            "NUL in an earlier message",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a\u{0}b"}, {"role": "assistant", "content": "x"},
                                {"role": "user", "content": "hi"}]}),
        ),
        (
            "NUL in a new conversation's item",
            "/v1/conversations",
            json!({"items": [{"type": "message", "role": "user", "content": "a\u{0}b"}]}),
        ),
        (
            "NUL in an item",
            &items,
            json!({"items": [{"type": "message", "role": "user", "content": "a\u{0}b"}]}),
        ),
        (
            "an item over the limit",
            &items,
            json!({"items": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": long}]}]}),
        ),
    ];
    let mut failures = Vec::new();
    for (name, path, body) in cases {
        // Chat completions store their turns in the session the header names.
        let request =
            api.request(Method::POST, path).bearer_auth(ALICE).header("x-session-id", "stored").json(&body);
        let r = api.send(request).await;
        let shaped = r.json["error"]["type"] == "invalid_request_error"
            && r.json["error"]["message"].as_str().is_some_and(|m| !m.is_empty());
        if r.status != 400 || !shaped {
            failures.push(format!("{name}: POST {path} → {} {:.200}", r.status, r.text));
        }
    }
    assert!(failures.is_empty(), "{} cases failed:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(api.written().await, before, "a refused request wrote something");
    assert_eq!(mock.log().count("/v1/chat/completions"), 0, "the model was called");
}
