//! Owner isolation: another owner's session is 404 on every route and absent from every
//! list and search; requests without a valid token are 401.

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use reqwest::Method;
use serde_json::json;
use turnlog_core::log_builder::permission_request;
use uuid::Uuid;

use turnlog_e2e::api::{Api, Body, Options, ALICE, BOB, WAIT};
use turnlog_testkit::eventually;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_cannot_see_or_touch_each_others_sessions() {
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let api = Api::with(Options { llm_url: Some(mock.base_url()), ..Options::default() }).await;
    let alice_session = api.create(ALICE, Some("alpha secret plans")).await;
    let bob_session = api.create(BOB, Some("bob's own")).await;
    let turn = api.message(alice_session, ALICE, "the zebra password is hunter2 [mock words=5]").await;
    assert_eq!(turn.end()["status"], "completed", "{:?}", turn.end());
    let answer_seq = turn.end()["assistant_seq"].as_i64().unwrap();
    let perm = permission_request("perm-1", "high");
    api.append(alice_session, "alice", &perm).await;
    // A memory of Alice's (the memory worker's output; the test writes it directly).
    sqlx::query(
        "INSERT INTO memories (id, owner, session_id, turn_seq, text, created_at)
         VALUES ($1, 'alice', $2, 2, 'alice likes zebras', now())",
    )
    .bind(Uuid::now_v7())
    .bind(alice_session.0)
    .execute(&api.env.pool)
    .await
    .unwrap();
    let file = api.upload(ALICE, "notes.txt", b"alice's private notes").await;
    assert_eq!(file.status, 201, "{}", file.text);
    let file = format!("/v1/files/{}", file.json["id"].as_str().unwrap());
    // Alice's conversation, response and items by their OpenAI ids.
    let (attempt, message): (String, Uuid) = sqlx::query_as(
        "SELECT a.payload->>'attempt_id', u.event_id FROM session_events a, session_events u
          WHERE a.session_id = $1 AND a.kind = 'assistant_turn' AND u.session_id = $1 AND u.kind = 'user_message'",
    )
    .bind(alice_session.0)
    .fetch_one(&api.env.pool)
    .await
    .unwrap();
    let conv = format!("/v1/conversations/conv_{}", alice_session.0.simple());
    let resp = format!("resp_{}", Uuid::parse_str(&attempt).unwrap().simple());
    let item = format!("{conv}/items/msg_{}", message.simple());

    let s = format!("/v1/sessions/{alice_session}");
    let reads = [
        format!("{s}/requests/{answer_seq}"),
        format!("{s}/export"),
        file.clone(),
        format!("{file}/content"),
        conv.clone(),
        format!("{conv}/items"),
        item.clone(),
        format!("/v1/responses/{resp}"),
        format!("/v1/responses/{resp}/input_items"),
    ];
    // Each is Alice's to read: Bob's 404 below is the owner check, not a wrong path.
    for path in &reads {
        let r = api.get(path, ALICE).await;
        assert_eq!(r.status, 200, "Alice's own {path}: {:.300}", r.text);
    }
    let before = api.written().await;
    let calls = chat_requests(&mock);

    let mut attempts: Vec<(Method, String, Body)> =
        reads.iter().map(|p| (Method::GET, p.clone(), Body::None)).collect();
    attempts.extend([
        (Method::GET, s.clone(), Body::None),
        (Method::PATCH, s.clone(), Body::Json(json!({"title": "pwned"}))),
        (Method::PATCH, s.clone(), Body::Json(json!({"archived": true}))),
        (Method::DELETE, s.clone(), Body::None),
        (Method::GET, format!("{s}/events"), Body::None),
        (Method::GET, format!("{s}/context"), Body::None),
        (Method::POST, format!("{s}/permissions/perm-1"), Body::Json(json!({"decision": "allow"}))),
        (Method::POST, format!("{s}/fork"), Body::Json(json!({}))),
        (Method::POST, format!("{s}/messages"), Body::Json(json!({"text": "edited", "edit_of": 2}))),
        (Method::POST, format!("{s}/retry"), Body::Json(json!({"of": answer_seq}))),
        (Method::DELETE, file.clone(), Body::None),
        (Method::POST, conv.clone(), Body::Json(json!({"metadata": {"k": "pwned"}}))),
        (Method::DELETE, conv.clone(), Body::None),
        (
            Method::POST,
            format!("{conv}/items"),
            Body::Json(json!({"items": [{"type": "message", "role": "user", "content": "bob was here"}]})),
        ),
        (Method::GET, format!("/v1/responses/{resp}?stream=true"), Body::None),
        (Method::POST, format!("/v1/responses/{resp}/cancel"), Body::None),
        (
            Method::POST,
            "/v1/responses".into(),
            Body::Json(json!({"input": "more", "previous_response_id": resp})),
        ),
        (
            Method::POST,
            "/v1/responses".into(),
            Body::Json(
                json!({"input": "more", "conversation": format!("conv_{}", alice_session.0.simple())}),
            ),
        ),
    ]);
    for (method, path, body) in attempts {
        let r = api.call(method.clone(), &path, Some(BOB), body).await;
        assert_eq!((r.status, r.error_code()), (404, "not_found"), "{method} {path}: {:.300}", r.text);
    }
    assert_eq!(api.written().await, before, "Bob's attempts wrote something");
    assert_eq!(chat_requests(&mock), calls, "Bob's attempts reached the model");
    let files = api.get("/v1/files", BOB).await;
    assert_eq!(files.json["files"].as_array().map(Vec::len), Some(0), "{}", files.text);

    // Lists and searches (once the search index has caught up with the log).
    api.env.search_caught_up().await;
    for path in ["/v1/sessions", "/v1/sessions?q=alpha", "/v1/sessions?q=zebra", "/v1/sessions?archived=true"]
    {
        let r = api.get(path, BOB).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
        let ids: Vec<&str> =
            r.json["sessions"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap()).collect();
        assert!(!ids.contains(&alice_session.to_string().as_str()), "{path} shows Alice's session to Bob");
    }
    let r = api.get("/v1/sessions", BOB).await;
    assert_eq!(r.json["sessions"][0]["id"], bob_session.to_string());
    for path in ["/v1/memories", "/v1/memories?q=zebras"] {
        let r = api.get(path, BOB).await;
        assert_eq!(
            (r.status, r.json["memories"].as_array().map(Vec::len)),
            (200, Some(0)),
            "{path}: {}",
            r.text
        );
    }

    // Alice still sees all of it, untouched.
    let r = api.get(&s, ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["session"]["title"], "alpha secret plans");
    assert_eq!(r.json["session"]["archived"], false);
    let r = api.get("/v1/sessions?q=zebra", ALICE).await;
    assert_eq!(r.json["sessions"][0]["id"], alice_session.to_string());
    let r = api.get("/v1/memories?q=zebras", ALICE).await;
    assert_eq!(r.json["memories"][0]["text"], "alice likes zebras", "{}", r.text);
    assert_eq!(r.json["memories"][0]["session_id"], alice_session.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_wrong_tokens_are_401_on_every_data_route() {
    let api = Api::start().await;
    let id = api.create(ALICE, None).await;
    let before = api.written().await;
    let s = format!("/v1/sessions/{id}");
    let conv = format!("/v1/conversations/conv_{}", id.0.simple());
    let routes: Vec<(Method, String)> = vec![
        (Method::POST, "/v1/sessions".into()),
        (Method::GET, "/v1/sessions".into()),
        (Method::GET, s.clone()),
        (Method::PATCH, s.clone()),
        (Method::DELETE, s.clone()),
        (Method::GET, format!("{s}/events")),
        (Method::GET, format!("{s}/context")),
        (Method::POST, format!("{s}/permissions/p1")),
        (Method::GET, "/v1/memories".into()),
        (Method::POST, format!("{s}/fork")),
        (Method::GET, format!("{s}/export")),
        (Method::GET, format!("{s}/requests/1")),
        (Method::POST, format!("{s}/messages")),
        (Method::POST, format!("{s}/retry")),
        (Method::POST, format!("{s}/stop")),
        (Method::GET, format!("{s}/stream")),
        (Method::POST, "/v1/chat".into()),
        (Method::POST, "/v1/import".into()),
        (Method::POST, "/v1/files".into()),
        (Method::GET, "/v1/files".into()),
        (Method::GET, format!("/v1/files/{}", id.0)),
        (Method::GET, format!("/v1/files/{}/content", id.0)),
        (Method::DELETE, format!("/v1/files/{}", id.0)),
        (Method::POST, "/v1/conversations".into()),
        (Method::GET, conv.clone()),
        (Method::POST, conv.clone()),
        (Method::DELETE, conv.clone()),
        (Method::GET, format!("{conv}/items")),
        (Method::POST, format!("{conv}/items")),
        (Method::GET, format!("{conv}/items/msg_{}", id.0.simple())),
        (Method::POST, "/v1/responses".into()),
        (Method::GET, format!("/v1/responses/resp_{}", id.0.simple())),
        (Method::POST, format!("/v1/responses/resp_{}/cancel", id.0.simple())),
        (Method::GET, format!("/v1/responses/resp_{}/input_items", id.0.simple())),
        (Method::POST, "/v1/chat/completions".into()),
        (Method::GET, "/v1/models".into()),
        // Auth comes before path validation: a malformed id is still 401.
        (Method::GET, "/v1/sessions/not-a-uuid".into()),
    ];
    let wrong = ["", "alice-token-000", "alice-token-00011", "ALICE-TOKEN-0001", "bob-token-000002x"];
    for (method, path) in &routes {
        let r = api.call(method.clone(), path, None, Body::Json(json!({"title": "x"}))).await;
        assert_eq!((r.status, r.error_code()), (401, "unauthorized"), "{method} {path} without a token");
        assert_eq!(r.headers.get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));
        for token in wrong {
            let r = api.call(method.clone(), path, Some(token), Body::Json(json!({"title": "x"}))).await;
            assert_eq!((r.status, r.error_code()), (401, "unauthorized"), "{method} {path} with {token:?}");
        }
    }
    assert_eq!(api.written().await, before);
    // The operations routes need no token.
    for path in ["/healthz", "/readyz", "/metrics", "/v1/openapi.json"] {
        let r = api.call(Method::GET, path, None, Body::None).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
    }
}

/// The turn routes with another owner's *live* turn: Bob's re-attach, stop, retry, send,
/// `/v1/chat {session_id}`, and the live response's retrieve, stream, cancel, input items and
/// `previous_response_id` are 404, append nothing, reach no model, and Alice's turn runs to
/// its end untouched (Bob's cancel did not stop it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_owners_live_turn_is_not_found_on_every_turn_route() {
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let api = Api::with(Options { llm_url: Some(mock.base_url()), ..Options::default() }).await;
    let id = api.create(ALICE, None).await;
    let running = api.message_request(id, ALICE, "slow one [mock words=40 delay_ms=50]").await;
    assert_eq!(running.status(), 200);
    let mut events = running.bytes_stream().eventsource().map(|e| e.unwrap());
    let meta = events.next().await.unwrap();
    assert_eq!(meta.event, "meta");
    let attempt: serde_json::Value = serde_json::from_str(&meta.data).unwrap();
    let resp = format!("resp_{}", Uuid::parse_str(attempt["attempt_id"].as_str().unwrap()).unwrap().simple());
    let live = eventually(WAIT, || async {
        let s = api.get(&format!("/v1/sessions/{id}"), ALICE).await;
        (s.json["turn_active"] == true && chat_requests(&mock) == 1).then_some(())
    });
    live.await;
    let requests_before = chat_requests(&mock);
    let written_before = api.written().await;

    let send = json!({"text": "bob was here"});
    let chat = json!({"session_id": id.to_string(), "text": "bob was here"});
    for (method, path, body) in [
        (Method::GET, format!("/v1/sessions/{id}/stream"), None),
        (Method::POST, format!("/v1/sessions/{id}/stop"), None),
        (Method::POST, format!("/v1/sessions/{id}/retry"), None),
        (Method::POST, format!("/v1/sessions/{id}/messages"), Some(send.clone())),
        (Method::POST, "/v1/chat".to_owned(), Some(chat.clone())),
        (Method::GET, format!("/v1/responses/{resp}"), None),
        (Method::GET, format!("/v1/responses/{resp}?stream=true"), None),
        (Method::POST, format!("/v1/responses/{resp}/cancel"), None),
        (Method::GET, format!("/v1/responses/{resp}/input_items"), None),
        (
            Method::POST,
            "/v1/responses".to_owned(),
            Some(json!({"input": "bob", "previous_response_id": resp})),
        ),
        (Method::GET, format!("/v1/conversations/conv_{}/items", id.0.simple()), None),
    ] {
        let r = api.turn(method.clone(), &path, BOB, body, &[]).await;
        assert_eq!((r.status, r.error_code()), (404, "not_found"), "{method} {path}: {:?}", r.json);
    }
    assert_eq!(api.written().await, written_before, "Bob's requests wrote something");
    assert_eq!(chat_requests(&mock), requests_before, "Bob's requests reached the model");

    // Alice's turn was neither stopped nor joined: it completes with the whole answer.
    let events: Vec<_> = std::iter::once(meta).chain(events.collect::<Vec<_>>().await).collect();
    let ends: Vec<_> = events.iter().filter(|e| e.event == "end").collect();
    assert_eq!(ends.len(), 1, "{events:?}");
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("end"));
    let end: serde_json::Value = serde_json::from_str(&ends[0].data).unwrap();
    assert_eq!(end["status"], "completed", "{end}");
    assert!(end["assistant_seq"].is_i64(), "{end}");
}

/// Chat requests the mock model has received.
fn chat_requests(mock: &turnlog_mock_llm::MockHandle) -> usize {
    mock.log().entries().iter().filter(|r| r.path.ends_with("/chat/completions")).count()
}
