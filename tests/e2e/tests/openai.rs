//! The OpenAI-compatible routes across ingress copies (DESIGN §13): a response running on
//! one copy is found by its id alone on another — retrieved, re-attached and cancelled
//! there. (The official SDK's tests are in `tests/openai`.)

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use serde_json::{json, Value};
use turnlog_e2e::config;
use turnlog_mock_llm::MockConfig;
use turnlog_testkit::test_env;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_running_on_one_copy_is_retrieved_and_cancelled_through_another() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let upstream = || config::upstream_at(&mock.base_url());
    let a = turnlog_e2e::serve(config::chat_stack(&env, upstream(), "mock"), Duration::from_secs(30))
        .await
        .unwrap();
    let b = turnlog_e2e::serve(config::chat_stack(&env, upstream(), "mock"), Duration::from_secs(30))
        .await
        .unwrap();
    let http = reqwest::Client::new();

    // A long answer streams through copy A.
    let body =
        json!({"model": "mock", "input": "A long story. [mock words=2000 delay_ms=10]", "stream": true});
    let resp = http.post(format!("{}/v1/responses", a.base_url())).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut events = resp.bytes_stream().eventsource();
    let mut id = None;
    let mut deltas = 0;
    while let Some(e) = events.next().await {
        let e = e.unwrap();
        let data: Value = serde_json::from_str(&e.data).unwrap();
        if e.event == "response.created" {
            id = data["response"]["id"].as_str().map(str::to_owned);
        }
        if e.event == "response.output_text.delta" {
            deltas += 1;
            if deltas == 20 {
                break;
            }
        }
    }
    let id = id.unwrap();

    // Copy B finds it running: its object, then its events from `response.created`.
    let got: Value =
        http.get(format!("{}/v1/responses/{id}", b.base_url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(
        (got["id"].as_str(), got["status"].as_str()),
        (Some(id.as_str()), Some("in_progress")),
        "{got}"
    );
    let replay = http.get(format!("{}/v1/responses/{id}?stream=true", b.base_url())).send().await.unwrap();
    let mut replay = replay.bytes_stream().eventsource();
    let first = replay.next().await.unwrap().unwrap();
    assert_eq!(first.event, "response.created");
    drop(replay);

    // Cancelled through B, stopped on A; the partial answer is kept.
    let cancelled: Value = http
        .post(format!("{}/v1/responses/{id}/cancel", b.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    let text = cancelled["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty());
    let stored: Value =
        http.get(format!("{}/v1/responses/{id}", a.base_url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(stored["status"], "cancelled");
    assert_eq!(stored["output"][0]["content"][0]["text"].as_str(), Some(text));
    // An id that no copy runs and the log does not hold is a 404 at once.
    let missing =
        http.get(format!("{}/v1/responses/resp_{}", b.base_url(), "0".repeat(32))).send().await.unwrap();
    assert_eq!(missing.status(), 404);

    b.stop().await.unwrap();
    a.stop().await.unwrap();
}
