//! Without a writer, a write cannot complete: the client gets 503 `unavailable` with
//! `Retry-After` within the append deadline, and nothing is stored.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnlog_core::ids::SessionId;
use turnlog_e2e::api::{Api, Body, Options, ALICE, WAIT};
use turnlog_e2e::rig::owner;
use turnlog_runtime::bus::{append_and_wait, AppendRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_are_503_with_retry_after_when_no_writer_runs() {
    let api = Api::with(Options {
        writer: false,
        append_timeout: Duration::from_millis(400),
        ..Options::default()
    })
    .await;
    let started = Instant::now();
    let r = api.call(Method::POST, "/v1/sessions", Some(ALICE), Body::Json(json!({"title": "lost?"}))).await;
    assert_eq!((r.status, r.error_code()), (503, "unavailable"), "{}", r.text);
    let retry_after: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry_after >= 1);
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(!r.text.contains("outcome unknown"), "internal detail leaked: {}", r.text);
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sessions").fetch_one(&api.env.pool).await.unwrap();
    assert_eq!(stored, 0);
    // Reads still work, and the service still reports itself ready (NATS and Postgres are up).
    assert_eq!(api.get("/v1/sessions", ALICE).await.status, 200);
    assert_eq!(api.call(Method::GET, "/readyz", None, Body::None).await.status, 200);
}

/// §9.3: a user message is durable before the model is called. With the writer gone, a
/// send to an existing session answers 503 and the model never sees a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_model_call_when_the_message_cannot_be_stored() {
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let api = Api::with(Options {
        writer: false,
        append_timeout: Duration::from_millis(600),
        llm_url: Some(mock.base_url()),
        ..Options::default()
    })
    .await;
    // A writer of its own for the session's creation, then stopped. The create goes on the
    // bus with the suite's long wait: the ingress's 600 ms deadline is for the sends below,
    // and a writer just started may take longer than that to claim its partition.
    let stop_writer = CancellationToken::new();
    let config = turnlog_e2e::config::writer(&api.env);
    let writer = tokio::spawn(turnlog_writer::run(config, stop_writer.clone()));
    let id = SessionId::new();
    let create = AppendRequest::create(id, &owner("alice"), None);
    let outcome = append_and_wait(&api.bus, &api.env.pool, &create, WAIT).await.unwrap();
    assert!(outcome.is_applied(), "{outcome:?}");
    stop_writer.cancel();
    writer.await.unwrap().unwrap();

    for (path, body) in [
        (format!("/v1/sessions/{id}/messages"), json!({"text": "are you there?"})),
        ("/v1/chat".to_owned(), json!({"session_id": id.to_string(), "text": "are you there?"})),
    ] {
        let r = api.turn(Method::POST, &path, ALICE, Some(body), &[]).await;
        assert_eq!((r.status, r.error_code()), (503, "unavailable"), "{path}: {:?}", r.json);
        assert!(r.headers.contains_key("retry-after"));
    }
    assert_eq!(chat_requests(&mock), 0, "the model was called before the message was stored");
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM session_events WHERE kind = 'user_message'")
        .fetch_one(&api.env.pool)
        .await
        .unwrap();
    assert_eq!(events, 0);
}

/// Chat requests the mock model has received.
fn chat_requests(mock: &turnlog_mock_llm::MockHandle) -> usize {
    mock.log().entries().iter().filter(|r| r.path.ends_with("/chat/completions")).count()
}
