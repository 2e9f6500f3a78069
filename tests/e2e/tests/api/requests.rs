//! Audited requests (DESIGN.md §11) over HTTP with every turn-side service running: each
//! attempt's request, rebuilt from the log by `GET /requests/{seq}`, is byte for byte the
//! body the model received — across compactions, extras with recalled memories, a
//! checkpoint, an interrupted attempt and its retry under a changed system prompt, and a
//! fork (its turns, and a regenerated answer) that inherits all of that (on 4 partitions).

use std::collections::HashMap;
use std::time::Duration;

use reqwest::Method;
use serde_json::Value;
use turnlog_core::events::{EventBody, PendingState};
use turnlog_core::ids::SessionId;
use turnlog_core::request_body::sha256_hex;
use turnlog_dev::{ServiceConfigs, Worker};
use turnlog_e2e::api::{Api, Body, ALICE, BOB, TOKENS};
use turnlog_e2e::config;
use turnlog_ingress::ApiTokens;
use turnlog_mock_llm::{LoggedRequest, MockConfig, MockHandle};
use turnlog_runtime::worker::ConsumerSettings;
use turnlog_testkit::TestEnv;

/// A model whose small window (60% of it is the budget) makes a few turns overflow.
const MODEL: &str = "mock-tiny";
const WINDOW: u32 = 2_000;
const TURNS: usize = 30;
const PROMPT: &str = "You are turnlog's auditor. Keep every name and number the user gives you.";
const CHANGED_PROMPT: &str = "You are turnlog's auditor, now terse. Keep every name and number.";

/// The writer, the ingress (Alice and Bob), the compactor and memory extraction, all on
/// the mock, with `system_prompt`.
fn configs(env: &TestEnv, mock: &MockHandle, system_prompt: &str) -> ServiceConfigs {
    let mut upstream = config::upstream_at(&mock.base_url());
    upstream.windows_override = HashMap::from([(MODEL.to_owned(), WINDOW)]);
    let mut configs = config::chat_stack(env, upstream, MODEL);
    configs.ingress.tokens = ApiTokens::parse(TOKENS).unwrap();
    configs.ingress.system_prompt = system_prompt.into();
    let consumer = ConsumerSettings {
        ack_wait: Duration::from_secs(5),
        retry_backoff: vec![Duration::from_millis(200)],
        ..Default::default()
    };
    if let Some(compactor) = configs.compactor_mut() {
        compactor.summary_model = "mock".into();
        compactor.facts_wait = Duration::from_millis(500);
        compactor.consumer = consumer.clone();
    }
    let memory = config::memory(env, &mock.base_url());
    configs.workers.push(Worker::Memory(turnlog_memory::MemoryConfig {
        mini_model: "mock".into(),
        consumer,
        ..memory
    }));
    configs
}

/// Every event of the session that records a request: (seq, kind, request).
async fn recorded(api: &Api, id: impl std::fmt::Display) -> Vec<(i64, String, Value)> {
    let r = api.get(&format!("/v1/sessions/{id}/events?limit=1000"), ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["payload"].get("request").is_some())
        .map(|e| {
            (
                e["seq"].as_i64().unwrap(),
                e["kind"].as_str().unwrap().to_owned(),
                e["payload"]["request"].clone(),
            )
        })
        .collect()
}

/// The turn requests the mock received (not the workers').
fn turn_requests(mock: &MockHandle) -> Vec<LoggedRequest> {
    mock.log()
        .entries()
        .into_iter()
        .filter(|r| r.path.ends_with("/chat/completions") && r.body["model"] == MODEL)
        .collect()
}

/// Rebuilds every recorded request of the sessions' branch logs through the API (a fork's
/// includes those it inherits) and checks it against what the mock received; returns how
/// many were checked.
async fn assert_all_rebuild_exactly(api: &Api, mock: &MockHandle, ids: &[SessionId]) -> usize {
    let received = turn_requests(mock);
    let mut records = Vec::new();
    for id in ids {
        records.extend(recorded(api, id).await.into_iter().map(|r| (*id, r)));
    }
    for (id, (seq, kind, request)) in &records {
        let r = api.get(&format!("/v1/sessions/{id}/requests/{seq}"), ALICE).await;
        assert_eq!(r.status, 200, "{kind} {seq}: {}", r.text);
        assert_eq!(r.json["verified"], true, "{kind} {seq} does not rebuild: {}", r.text);
        assert_eq!(r.json["body_sha256"], request["body_sha256"], "{kind} {seq}");
        assert_eq!(r.json["tokens"], request["tokens"], "{kind} {seq}");
        assert_eq!(r.json["model"], MODEL);
        let sha = request["body_sha256"].as_str().unwrap();
        let sent = received.iter().find(|m| sha256_hex(m.raw.as_bytes()) == sha);
        let sent = sent.unwrap_or_else(|| panic!("{kind} {seq}: the mock never received body {sha}"));
        // The same hash over the bytes received and the bytes rebuilt: the same bytes.
        assert_eq!(r.json["body"], serde_json::from_str::<Value>(&sent.raw).unwrap(), "{kind} {seq}");
    }
    // And every request the model received was recorded.
    let shas: Vec<&str> = records.iter().map(|(_, (_, _, r))| r["body_sha256"].as_str().unwrap()).collect();
    for m in &received {
        assert!(shas.contains(&sha256_hex(m.raw.as_bytes()).as_str()), "unrecorded request {}", m.raw);
    }
    records.len()
}

/// The question of turn `turn`: facts with names and numbers now and then (for memories
/// to recall into the extras), one slow answer (so a checkpoint records the request too),
/// and one the gateway refuses (a `turn_failed` that was sent).
fn question(turn: usize) -> String {
    match turn {
        1 => "My name is Zanzibar Quill and my locker code is 48213. [mock words=60]".into(),
        10 => "Tell me slowly about Oslo in May. [mock words=40 delay_ms=80]".into(),
        20 => "Are you there? [mock status=502]".into(),
        t if t % 4 == 0 => format!("Remember that Bruno needs {t} chairs on Friday. [mock words=60]"),
        t => format!("we talked about the weather and other small things again, turn {t} [mock words=60]"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attempt_rebuilds_to_the_exact_bytes_the_model_received() {
    let mut env = turnlog_testkit::test_env().await;
    env.partitions = 4;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let services = configs(&env, &mock, PROMPT);
    let api = Api::on(env, services).await;
    let id = api.create(ALICE, None).await;
    for turn in 1..=TURNS {
        let r = api.message(id, ALICE, &question(turn)).await;
        let expected = if turn == 20 { "failed" } else { "completed" };
        assert_eq!(r.end()["status"], expected, "turn {turn}: {:?}", r.end());
    }

    let compactions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM session_events WHERE kind = 'compaction_applied'")
            .fetch_one(&api.env.pool)
            .await
            .unwrap();
    assert!(compactions >= 2, "compactions were to be forced; got {compactions}");
    let records = recorded(&api, id).await;
    let kinds = |kind: &str| records.iter().filter(|(_, k, _)| k == kind).count();
    assert_eq!(kinds("assistant_turn"), TURNS - 1);
    assert_eq!(kinds("turn_failed"), 1, "the refused request was sent, so it is recorded");
    assert!(kinds("pending_state") >= 1, "the slow answer's first checkpoint records its request");
    assert!(
        records.iter().any(|(_, _, r)| r["extras"]["memories"].as_array().is_some_and(|m| !m.is_empty())),
        "some request carried recalled memories"
    );
    assert_eq!(records[0].2["system"]["text"], PROMPT, "the session's first request carries the prompt");
    assert!(records[1..].iter().any(|(_, _, r)| r["system"].get("text").is_none()), "and not every one");
    let checked = assert_all_rebuild_exactly(&api, &mock, &[id]).await;
    assert!(checked > TURNS);
    println!("{checked} requests rebuilt exactly across {compactions} compactions");

    // A later checkpoint of an attempt (what the transcript shows of an attempt that ended
    // without a final one) answers with the request its first checkpoint recorded.
    let (first, _, first_request) = records.iter().find(|(_, k, _)| k == "pending_state").unwrap();
    let attempt: String = sqlx::query_scalar(
        "SELECT payload ->> 'attempt_id' FROM session_events WHERE session_id = $1 AND seq = $2",
    )
    .bind(id.0)
    .bind(first)
    .fetch_one(&api.env.pool)
    .await
    .unwrap();
    let later = EventBody::PendingState(PendingState {
        partial: "a later checkpoint".into(),
        attempt_id: Some(attempt.into()),
        ..PendingState::default()
    });
    let later = api.append(id, "alice", &later).await;
    let r = api.get(&format!("/v1/sessions/{id}/requests/{later}"), ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        (&r.json["body_sha256"], &r.json["verified"]),
        (&first_request["body_sha256"], &Value::Bool(true))
    );

    // An attempt broken off mid-answer keeps its partial with its request.
    mock.faults().break_next_chats(1);
    let broken = api.message(id, ALICE, "Now list every number I gave you. [mock words=30]").await;
    assert_eq!(broken.end()["status"], "interrupted", "{:?}", broken.end());
    let pending_seq = broken.end()["pending_seq"].as_i64().unwrap();

    // The retry runs under a changed system prompt: it records the new text, and every
    // earlier request still rebuilds with the prompt it was sent with.
    let env = api.stop().await;
    let services = configs(&env, &mock, CHANGED_PROMPT);
    let api = Api::on(env, services).await;
    let retry = api.turn(Method::POST, &format!("/v1/sessions/{id}/retry"), ALICE, None, &[]).await;
    assert_eq!(retry.end()["status"], "completed", "{:?}", retry.end());
    let retry_seq = retry.end()["assistant_seq"].as_i64().unwrap();
    let records = recorded(&api, id).await;
    let request_at =
        |seq: i64| records.iter().find(|(s, _, _)| *s == seq).map(|(_, _, r)| r.clone()).unwrap();
    let (interrupted, retried) = (request_at(pending_seq), request_at(retry_seq));
    assert_eq!(interrupted["system"]["sha256"], sha256_hex(PROMPT.as_bytes()));
    assert_eq!(retried["system"]["text"], CHANGED_PROMPT);
    assert!(retried["through_seq"].as_i64() >= Some(pending_seq), "the retry read the interrupted partial");
    assert!(assert_all_rebuild_exactly(&api, &mock, &[id]).await > TURNS + 1);

    // A fork through an answer of the middle, below the newest compaction: its own turns and
    // a regenerated answer rebuild from its branch log (the parent's through the fork point).
    let fork_point = records.iter().filter(|(_, k, _)| k == "assistant_turn").nth(TURNS / 2).unwrap().0;
    let r = api
        .call(
            Method::POST,
            &format!("/v1/sessions/{id}/fork"),
            Some(ALICE),
            Body::Json(serde_json::json!({"through_seq": fork_point})),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let fork: SessionId = r.json["id"].as_str().unwrap().parse().unwrap();
    for turn in 0..3 {
        let r = api.message(fork, ALICE, &format!("On the branch, turn {turn}. [mock words=40]")).await;
        assert_eq!(r.end()["status"], "completed", "{:?}", r.end());
    }
    let last = recorded(&api, fork).await.last().unwrap().0;
    let regen = api
        .turn(
            Method::POST,
            &format!("/v1/sessions/{fork}/retry"),
            ALICE,
            Some(serde_json::json!({"of": last})),
            &[],
        )
        .await;
    assert_eq!(regen.end()["status"], "completed", "{:?}", regen.end());
    let regenerated: SessionId = regen.events[0].data["session_id"].as_str().unwrap().parse().unwrap();
    let fork_records = recorded(&api, fork).await;
    assert!(fork_records.iter().any(|(seq, _, _)| *seq > fork_point), "the fork's own requests are recorded");
    assert!(assert_all_rebuild_exactly(&api, &mock, &[id, fork, regenerated]).await > TURNS + 5);

    // Only an attempt's events record a request; another owner sees no session at all.
    let path = |seq: &str| format!("/v1/sessions/{id}/requests/{seq}");
    for seq in ["2", "1", "100000"] {
        let r = api.get(&path(seq), ALICE).await;
        assert_eq!((r.status, r.error_code()), (404, "not_found"), "{seq}: {}", r.text);
    }
    assert!(api.get(&path("2"), ALICE).await.json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("user_message"));
    for seq in ["abc", "0", "-3", "1.5"] {
        let r = api.get(&path(seq), ALICE).await;
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "{seq}: {}", r.text);
    }
    let r = api.call(Method::GET, &path(&retry_seq.to_string()), Some(BOB), Body::None).await;
    assert_eq!((r.status, r.error_code()), (404, "not_found"), "{}", r.text);
    assert_eq!(r.json["error"]["message"], "session not found");
    api.stop().await;
}
