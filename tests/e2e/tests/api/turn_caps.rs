//! The caps on concurrent turns (DESIGN.md §7, Limits): over the per-owner or the overall
//! cap a new turn is 429 with `Retry-After` and appends nothing, other owners are still
//! served, and every way a turn ends — or fails to start — gives its slot back.

use std::time::Duration;

use futures::StreamExt as _;
use reqwest::Method;
use serde_json::json;
use turnlog_e2e::api::{Api, Body, Options, TurnReply, ALICE, BOB, WAIT};
use turnlog_ingress::turn::TurnLimits;
use turnlog_mock_llm::{MockConfig, MockHandle};
use turnlog_testkit::eventually;

async fn capped(limits: TurnLimits, opts: Options) -> (Api, MockHandle) {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let opts = Options { llm_url: Some(mock.base_url()), turn_limits: limits, ..opts };
    (Api::with(opts).await, mock)
}

/// A turn whose stream has started (headers in), left unread.
async fn started(api: &Api, token: &str, id: impl std::fmt::Display, text: &str) -> reqwest::Response {
    let resp = api.message_request(id, token, text).await;
    assert_eq!(resp.status().as_u16(), 200);
    resp
}

/// Asserts a 429 `too_many_requests` with `Retry-After`; returns its message.
#[track_caller]
fn refused(r: &TurnReply) -> String {
    assert_eq!(r.status, 429, "{:?}", r.json);
    assert_eq!(r.json["error"]["code"], "too_many_requests", "{:?}", r.json);
    let wait: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(wait >= 1, "Retry-After: {wait}");
    r.json["error"]["message"].as_str().unwrap().to_owned()
}

async fn user_messages(api: &Api) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM session_events WHERE kind = 'user_message'")
        .fetch_one(&api.env.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_cap_a_turn_is_429_appends_nothing_and_other_owners_are_served() {
    let (api, _mock) = capped(TurnLimits { per_owner: 2, total: 3 }, Options::default()).await;
    let [s1, s2, s3] =
        [api.create(ALICE, None).await, api.create(ALICE, None).await, api.create(ALICE, None).await];
    let b1 = api.create(BOB, None).await;
    // Alice's two turns wait on a model that never answers (until the 5 s upstream
    // timeout): they write nothing more while they hold her slots.
    let (h1, h2) =
        (started(&api, ALICE, s1, "[mock hang]").await, started(&api, ALICE, s2, "[mock hang]").await);

    // Bob is served while Alice is at her cap; then his own hanging turn fills the copy.
    let chat = api.turn(Method::POST, "/v1/chat", BOB, Some(json!({"text": "hi [mock words=5]"})), &[]).await;
    assert_eq!(chat.end()["status"], "completed");
    let b = started(&api, BOB, b1, "[mock hang]").await;

    let before = (api.written().await, user_messages(&api).await);
    let message = refused(&api.message(s3, ALICE, "one more").await);
    assert!(message.contains("this owner's limit is 2"), "{message}");
    refused(&api.turn(Method::POST, "/v1/chat", ALICE, Some(json!({"text": "a new one"})), &[]).await);
    refused(&api.turn(Method::POST, &format!("/v1/sessions/{s1}/retry"), ALICE, None, &[]).await);
    let message =
        refused(&api.turn(Method::POST, "/v1/chat", BOB, Some(json!({"text": "and another"})), &[]).await);
    assert!(message.contains("this server's limit is 3"), "{message}");
    assert_eq!((api.written().await, user_messages(&api).await), before, "nothing was appended");

    // Alice's turns end (failed: the model timed out); both her slots come back at once.
    for h in [h1, h2] {
        let body = String::from_utf8(h.bytes().await.unwrap().to_vec()).unwrap();
        assert!(body.contains("event: end"), "{body}");
    }
    let next = [s1, s2].map(|id| api.message(id, ALICE, "again [mock words=20 delay_ms=20]"));
    for r in futures::future::join_all(next).await {
        assert_eq!(r.end()["status"], "completed");
    }
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ending_gives_the_slot_back() {
    // One slot: any turn that kept it would make the next step 429.
    let (api, _mock) = capped(TurnLimits { per_owner: 1, total: 256 }, Options::default()).await;
    let id = api.create(ALICE, None).await;
    let other = api.create(ALICE, None).await;

    assert_eq!(api.message(id, ALICE, "boom [mock status=500]").await.end()["status"], "failed");
    assert_eq!(
        api.message(id, ALICE, "cut [mock words=40 fail_after=5]").await.end()["status"],
        "interrupted"
    );

    // Stopped by the user.
    let resp = started(&api, ALICE, id, "[mock words=300 delay_ms=20]").await;
    let mut body = resp.bytes_stream();
    body.next().await.unwrap().unwrap();
    let stop = api.call(Method::POST, &format!("/v1/sessions/{id}/stop"), Some(ALICE), Body::None).await;
    assert_eq!(stop.status, 202);
    while body.next().await.is_some() {}

    // Refused before it starts: nothing to retry in a session without messages.
    let empty = api.create(ALICE, None).await;
    for _ in 0..2 {
        let r = api.turn(Method::POST, &format!("/v1/sessions/{empty}/retry"), ALICE, None, &[]).await;
        assert_eq!(r.status, 409, "{:?}", r.json);
    }

    // A client that leaves: its turn goes on and holds the slot until it ends.
    let resp = started(&api, ALICE, id, "[mock words=60 delay_ms=60]").await;
    let mut body = resp.bytes_stream();
    body.next().await.unwrap().unwrap();
    drop(body);
    refused(&api.message(other, ALICE, "while it runs").await);
    let after = eventually(WAIT, || async {
        let r = api.message(other, ALICE, "after it ended [mock words=5]").await;
        (r.status != 429).then_some(r)
    })
    .await;
    assert_eq!(after.end()["status"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_cannot_start_gives_the_slot_back() {
    // No writer: the session's create cannot be stored and the chat is 503, every time.
    let opts = Options { writer: false, append_timeout: Duration::from_millis(300), ..Options::default() };
    let (api, _mock) = capped(TurnLimits { per_owner: 1, total: 1 }, opts).await;
    for _ in 0..3 {
        let r = api.turn(Method::POST, "/v1/chat", ALICE, Some(json!({"text": "hello"})), &[]).await;
        assert_eq!(r.status, 503, "{:?}", r.json);
    }
}

/// `store: false` responses (stateless, nothing stored) take a slot like any turn while
/// their answer is relayed, and give it back when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stateless_response_holds_a_turn_slot_while_it_is_relayed() {
    let (api, mock) = capped(TurnLimits { per_owner: 1, total: 4 }, Options::default()).await;
    let body = |text: &str| json!({"input": text, "store": false, "stream": true});
    // The model never answers: the request waits for it, holding Alice's slot.
    let hanging = tokio::spawn(
        api.request(Method::POST, "/v1/responses").bearer_auth(ALICE).json(&body("hi [mock hang]")).send(),
    );
    // Once the model has the request, Alice's slot is held until the relay ends.
    eventually(WAIT, || async {
        mock.log().entries().iter().any(|r| r.body.to_string().contains("mock hang")).then_some(())
    })
    .await;
    let refused = api.call(Method::POST, "/v1/responses", Some(ALICE), Body::Json(body("and more"))).await;
    assert_eq!(refused.status, 429, "{}", refused.text);
    assert_eq!(refused.json["error"]["type"], "rate_limit_error", "{}", refused.text);
    let r = api.call(Method::POST, "/v1/responses", Some(BOB), Body::Json(body("bob [mock words=3]"))).await;
    assert_eq!(r.status, 200, "other owners are served: {}", r.text);
    // The client leaves: the relay ends and the slot comes back.
    hanging.abort();
    eventually(WAIT, || async {
        let r = api
            .call(Method::POST, "/v1/responses", Some(ALICE), Body::Json(body("again [mock words=3]")))
            .await;
        (r.status == 200).then_some(())
    })
    .await;
}
