//! Sizes that add up past the writer's 768 KiB event limit (DESIGN.md §6, §7 Limits): a
//! message inside every documented limit can still be too large as stored JSON, and an
//! answer holds its text twice. Neither may become a dead letter or a 503.

use reqwest::Method;
use serde_json::{json, Value};
use turnlog_e2e::api::{Api, Body, Options, ALICE};
use turnlog_mock_llm::{MockConfig, MockHandle};

async fn with_mock() -> (Api, MockHandle) {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let api = Api::with(Options { llm_url: Some(mock.base_url()), ..Options::default() }).await;
    (api, mock)
}

/// Uploads `markdown` as a document; its file id.
async fn document(api: &Api, markdown: String) -> Value {
    let r = api.upload(ALICE, "doc.md", markdown.as_bytes()).await;
    assert_eq!(r.status, 201, "{}", r.text);
    r.json["id"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_too_large_as_stored_are_413_and_nothing_is_appended_or_dead_lettered() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let (plain, breaks) =
        (document(&api, "d".repeat(400_000)).await, document(&api, "\n".repeat(270_000)).await);
    let before = api.written().await;

    // Each within the limits (text ≤ 256 KiB, documents ≤ 512 KiB, body ≤ 1 MiB), and each
    // over 768 KiB as the log stores it.
    let control = "\u{1}".repeat(140_000); // 6 bytes each as JSON
    let quotes = "\"".repeat(200_000); // 2 bytes each
    let cases = [
        ("escape-heavy text", json!({"text": control})),
        ("text and documents", json!({"text": quotes, "documents": [plain]})),
        ("a body near 1 MiB", json!({"text": "\"".repeat(250_000), "documents": [breaks]})),
    ];
    for (name, body) in &cases {
        let size = body.to_string().len();
        assert!(size < 1024 * 1024, "{name}: the body is within the 1 MiB limit ({size})");
        let path = format!("/v1/sessions/{id}/messages");
        let r = api.call(Method::POST, &path, Some(ALICE), Body::Json(body.clone())).await;
        assert_eq!(r.status, 413, "{name}: {}", r.text);
        assert_eq!(r.error_code(), "payload_too_large", "{name}");
        let message = r.json["error"]["message"].as_str().unwrap();
        assert!(message.contains("user_message") && message.contains("text: "), "{name}: {message}");
    }
    // A chat that would create its session refuses before creating it.
    let r = api.call(Method::POST, "/v1/chat", Some(ALICE), Body::Json(cases[0].1.clone())).await;
    assert_eq!(r.status, 413, "{}", r.text);

    assert_eq!(api.written().await, before, "nothing reached the writer");
    assert_eq!(api.dead_letters().await, 0, "nothing was dead-lettered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_too_large_to_store_is_kept_as_its_pending_state() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    // About 215 KB of text, but over 400 KiB as JSON (a line break takes two bytes), and the
    // answer's event holds it twice.
    let r = api.message(id, ALICE, "a long poem [mock words=3200 breaks=64]").await;
    assert_eq!(r.status, 200);
    let text = r.text();
    assert!(text.len() > 200_000 && text.len() < 300 * 1024, "{}", text.len());
    let end = r.end();
    assert_eq!(end["status"], "interrupted", "{end}");
    assert!(end.get("assistant_seq").is_none(), "{end}");
    let error = r.events.iter().find(|e| e.event == "error").expect("an error event says why");
    assert_eq!(error.data["code"], "answer_too_large", "{}", error.data);

    let items = api.get(&format!("/v1/sessions/{id}"), ALICE).await.json["items"].clone();
    let last = items.as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["kind"], "interrupted");
    assert_eq!(last["seq"], end["pending_seq"]);
    assert_eq!(last["text"].as_str(), Some(text.as_str()), "the whole answer is kept");
    assert_eq!(api.dead_letters().await, 0, "nothing was dead-lettered");
}
