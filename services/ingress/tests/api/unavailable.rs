//! Without a writer, a write cannot complete: the client gets 503 `unavailable` with
//! `Retry-After` within the append deadline, and nothing is stored.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;

use crate::harness::{Api, Body, Options, ALICE};

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
