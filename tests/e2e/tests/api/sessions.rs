//! The session routes end to end: create, read with the transcript and turn state, rename,
//! archive, the raw log page, permission resolution, delete; metrics; no-token local mode.

use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnlog_core::events::*;
use turnlog_core::log_builder::permission_request;
use turnlog_e2e::api::{Api, Body, Options, ALICE};
use turnlog_runtime::lease::TurnLeases;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_lifecycle() {
    let api = Api::start().await;
    // An empty body creates an untitled session.
    let r = api.call(Method::POST, "/v1/sessions", Some(ALICE), Body::None).await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert!(r.json["title"].is_null() && r.json["archived"] == false);
    let id = api.create(ALICE, Some("Trip to Lisbon")).await;
    let s = format!("/v1/sessions/{id}");

    api.append(
        id,
        "alice",
        &EventBody::UserMessage(UserMessage { text: "Plan 3 days".into(), ..Default::default() }),
    )
    .await;
    let r = api.get(&s, ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["session"]["title"], "Trip to Lisbon");
    assert_eq!(r.json["turn_active"], false);
    let items = r.json["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "session_started is not a transcript item: {items:?}");
    assert_eq!(
        (&items[0]["kind"], &items[0]["text"], &items[0]["seq"]),
        (&json!("user"), &json!("Plan 3 days"), &json!(2))
    );

    // A held turn lease shows as an active turn.
    let leases = TurnLeases::open(&api.bus).await.unwrap();
    let lease = leases.acquire(id, "test").await.unwrap().unwrap();
    assert_eq!(api.get(&s, ALICE).await.json["turn_active"], true);
    leases.release(lease).await.unwrap();
    assert_eq!(api.get(&s, ALICE).await.json["turn_active"], false);

    let r = api.call(Method::PATCH, &s, Some(ALICE), Body::Json(json!({"title": "Lisbon, 3 days"}))).await;
    assert_eq!((r.status, &r.json["title"]), (200, &json!("Lisbon, 3 days")), "{}", r.text);
    let r = api.call(Method::PATCH, &s, Some(ALICE), Body::Json(json!({"archived": true}))).await;
    assert_eq!((&r.json["archived"], &r.json["title"]), (&json!(true), &json!("Lisbon, 3 days")));

    // The raw log, a page at a time.
    let r = api.get(&format!("{s}/events?limit=1"), ALICE).await;
    assert_eq!(r.json["events"][0]["kind"], "session_started");
    assert_eq!(r.json["next_after"], 1);
    let r = api.get(&format!("{s}/events?after=1&limit=1"), ALICE).await;
    assert_eq!(
        (&r.json["events"][0]["seq"], &r.json["events"][0]["payload"]["text"]),
        (&json!(2), &json!("Plan 3 days"))
    );
    assert!(r.json["next_after"].is_null(), "the last page ends the log: {}", r.text);
    assert!(r.json["events"][0]["created_at"].is_string());

    let r = api.call(Method::DELETE, &s, Some(ALICE), Body::None).await;
    assert_eq!((r.status, r.text.as_str()), (204, ""));
    assert_eq!(api.get(&s, ALICE).await.status, 404);
    assert_eq!(api.call(Method::DELETE, &s, Some(ALICE), Body::None).await.status, 404);
    let listed = api.get("/v1/sessions?archived=true", ALICE).await;
    assert_eq!(listed.json["sessions"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissions_resolve_once() {
    let api = Api::start().await;
    let id = api.create(ALICE, None).await;
    api.append(id, "alice", &permission_request("p1", "high")).await;
    api.append(id, "alice", &permission_request("p2", "high")).await;
    let items = api.get(&format!("/v1/sessions/{id}"), ALICE).await.json["items"].clone();
    assert_eq!(items.as_array().unwrap().len(), 2, "both requests pending: {items}");

    let p1 = format!("/v1/sessions/{id}/permissions/p1");
    let r = api.call(Method::POST, &p1, Some(ALICE), Body::Json(json!({"decision": "allow"}))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        (&r.json["id"], &r.json["decision"], &r.json["seq"]),
        (&json!("p1"), &json!("allow"), &json!(4))
    );
    // The same decision again answers the recorded one and appends nothing.
    let again = api.call(Method::POST, &p1, Some(ALICE), Body::Json(json!({"decision": "allow"}))).await;
    assert_eq!((again.status, &again.json["seq"]), (200, &json!(4)));
    // The other decision is a conflict.
    let r = api.call(Method::POST, &p1, Some(ALICE), Body::Json(json!({"decision": "deny"}))).await;
    assert_eq!((r.status, r.error_code()), (409, "conflict"), "{}", r.text);

    let r = api.decide(id, "p2", "deny").await;
    assert_eq!((r.status, &r.json["seq"]), (200, &json!(5)), "{}", r.text);
    let events = api.get(&format!("/v1/sessions/{id}/events"), ALICE).await.json["events"].clone();
    let resolved: Vec<_> =
        events.as_array().unwrap().iter().filter(|e| e["kind"] == "permission_resolved").collect();
    assert_eq!(resolved.len(), 2, "{events}");
    // Answered requests leave the transcript.
    let items = api.get(&format!("/v1/sessions/{id}"), ALICE).await.json["items"].clone();
    assert_eq!(items, json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_by_route_and_status() {
    let api = Api::start().await;
    let id = api.create(ALICE, None).await;
    api.get(&format!("/v1/sessions/{id}"), ALICE).await;
    api.get("/v1/sessions/not-a-uuid", ALICE).await;
    api.get("/some/scanner/path", ALICE).await;
    let r = api.call(Method::GET, "/metrics", None, Body::None).await;
    assert_eq!(r.status, 200);
    let text = r.text;
    let has = |needle: &str| {
        text.lines().any(|l| l.starts_with("turnlog_http_requests_total") && l.contains(needle))
    };
    assert!(
        has(r#"route="/v1/sessions/{id}""#) && has(r#"status="200""#) && has(r#"status="400""#),
        "{text}"
    );
    assert!(has(r#"route="/v1/sessions""#) && has(r#"status="201""#), "{text}");
    assert!(has(r#"route="unmatched""#) && !text.contains("scanner"), "{text}");
    assert!(text.contains("turnlog_http_request_duration_seconds_bucket"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tokens_everyone_is_local_and_only_loopback_is_served() {
    let api = Api::with(Options { tokens: None, ..Options::default() }).await;
    let r = api.call(Method::POST, "/v1/sessions", None, Body::Json(json!({"title": "mine"}))).await;
    assert_eq!(r.status, 201, "{}", r.text);
    let owner: String =
        sqlx::query_scalar("SELECT owner FROM sessions").fetch_one(&api.env.pool).await.unwrap();
    assert_eq!(owner, "local");
    // Any Authorization header is ignored.
    assert_eq!(api.call(Method::GET, "/v1/sessions", Some("whatever"), Body::None).await.status, 200);

    let config = turnlog_e2e::config::ingress(&api.env);
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let run = turnlog_ingress::run(config, listener, CancellationToken::new());
    let err = tokio::time::timeout(Duration::from_secs(5), run).await.expect("refused at once").unwrap_err();
    assert!(err.to_string().contains("TURNLOG_API_TOKENS"), "{err:#}");
}
