//! `GET /v1/sessions/{id}/export`: every format holds the whole conversation (compacted
//! turns, an interrupted answer and unicode included), as an attachment, for its owner only.

use reqwest::Method;
use serde_json::{json, Value};
use turnlog_core::events::*;
use turnlog_core::log_builder::assistant_turn;
use turnlog_e2e::api::{Api, Body, ALICE, BOB};

fn user(text: &str) -> EventBody {
    EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_holds_the_whole_conversation_for_its_owner_only() {
    let api = Api::start().await;
    let id = api.create(ALICE, Some("Zürich — plans ✈")).await;
    api.append(id, "alice", &user("Wir fliegen am 3. März nach Zürich.")).await;
    api.append(id, "alice", &EventBody::AssistantTurn(assistant_turn("Gute Reise! 🧳", None))).await;
    let compaction = EventBody::CompactionApplied(CompactionApplied {
        summary: "A trip to Zürich on 3 March.".into(),
        replaces_through_seq: 3,
        facts_extracted: vec![],
    });
    api.append(id, "alice", &compaction).await;
    api.append(id, "alice", &user("What should we pack?")).await;
    let pending = PendingState { partial: "Warm layers and".into(), ..Default::default() };
    api.append(id, "alice", &EventBody::PendingState(pending)).await;
    let path = |format: &str| format!("/v1/sessions/{id}/export?format={format}");

    // turnlog: a header line, then every event as stored.
    let r = api.get(&format!("/v1/sessions/{id}/export"), ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.headers["content-type"], "application/x-ndjson");
    assert_eq!(
        r.headers["content-disposition"],
        format!("attachment; filename=\"session-{id}.jsonl\"").as_str()
    );
    let lines: Vec<Value> = r.text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["format"], "turnlog");
    assert_eq!(lines[0]["session"]["title"], "Zürich — plans ✈");
    let kinds: Vec<&str> = lines[1..].iter().map(|l| l["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "session_started",
            "user_message",
            "assistant_turn",
            "compaction_applied",
            "user_message",
            "pending_state"
        ]
    );
    let stored: Vec<Value> =
        sqlx::query_scalar("SELECT payload FROM session_events WHERE session_id = $1 ORDER BY seq")
            .bind(id.0)
            .fetch_all(&api.env.pool)
            .await
            .unwrap();
    let exported: Vec<Value> = lines[1..].iter().map(|l| l["payload"].clone()).collect();
    assert_eq!(exported, stored, "payloads exactly as stored");
    assert_eq!(lines[2]["seq"], 2);

    // openai and sharegpt: the conversation, compacted turns and the partial answer included.
    let expected = json!([
        {"role": "user", "content": "Wir fliegen am 3. März nach Zürich."},
        {"role": "assistant", "content": "Gute Reise! 🧳"},
        {"role": "user", "content": "What should we pack?"},
        {"role": "assistant", "content": "Warm layers and"},
    ]);
    let r = api.get(&path("openai"), ALICE).await;
    assert_eq!(r.json, expected, "{}", r.text);
    let r = api.get(&path("sharegpt"), ALICE).await;
    let turns = &r.json["conversations"];
    assert_eq!(turns[0], json!({"from": "human", "value": "Wir fliegen am 3. März nach Zürich."}));
    assert_eq!(turns[3], json!({"from": "gpt", "value": "Warm layers and"}));

    // markdown: to read, the compaction divider and the interruption marked.
    let r = api.get(&path("markdown"), ALICE).await;
    assert!(r.headers["content-type"].to_str().unwrap().starts_with("text/markdown"));
    let md = r.text;
    assert!(md.starts_with("# Zürich — plans ✈\n"), "{md}");
    for part in ["Gute Reise! 🧳", "as a summary", "## Assistant (interrupted)", "Warm layers and"] {
        assert!(md.contains(part), "{part} in {md}");
    }

    // Another owner's session is not found; a wrong format is a clear 400.
    assert_eq!(api.get(&path("markdown"), BOB).await.status, 404);
    let r = api.call(Method::GET, &path("pdf"), Some(ALICE), Body::None).await;
    assert_eq!((r.status, r.error_code()), (400, "bad_request"));
    api.stop().await;
}
