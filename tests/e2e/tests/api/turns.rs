//! Running turns through HTTP against the mock model (DESIGN.md §5): the event stream's
//! shape, persistence of every ending, stop, retry, re-attach, idempotent resends, and the
//! prompt prefix staying byte-stable across turns.

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use reqwest::Method;
use serde_json::{json, Value};
use turnlog_core::llm_context::{INTERRUPTED_NOTE, STOPPED_NOTE};
use turnlog_core::request::EXTRAS_MARKER;
use turnlog_e2e::api::{Api, Options, ALICE, WAIT};
use turnlog_mock_llm::{MockConfig, MockHandle};
use turnlog_testkit::eventually;

async fn with_mock() -> (Api, MockHandle) {
    with_mock_opts(Options::default()).await
}

async fn with_mock_opts(mut opts: Options) -> (Api, MockHandle) {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    opts.llm_url = Some(mock.base_url());
    (Api::with(opts).await, mock)
}

fn send_path(id: impl std::fmt::Display) -> String {
    format!("/v1/sessions/{id}/messages")
}

async fn transcript(api: &Api, id: impl std::fmt::Display) -> Vec<Value> {
    api.get(&format!("/v1/sessions/{id}"), ALICE).await.json["items"].as_array().unwrap().clone()
}

async fn count_kind(api: &Api, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM session_events WHERE kind = $1")
        .bind(kind)
        .fetch_one(&api.env.pool)
        .await
        .unwrap()
}

/// Chat requests the mock received, each as its messages without the trailing extras.
fn histories(mock: &MockHandle) -> Vec<Vec<Value>> {
    mock.log()
        .entries()
        .into_iter()
        .filter(|r| r.path.ends_with("/chat/completions"))
        .map(|r| {
            let mut msgs = r.body["messages"].as_array().unwrap().clone();
            if msgs.last().and_then(|m| m["content"].as_str()).is_some_and(|c| c.starts_with(EXTRAS_MARKER)) {
                msgs.pop();
            }
            msgs
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_streams_meta_deltas_and_one_end_and_is_stored() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let r = api.message(id, ALICE, "hello there [mock words=30]").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-session-id"], id.to_string().as_str());
    assert_eq!(r.headers["x-accel-buffering"], "no");
    assert_eq!(r.events[0].event, "meta");
    assert_eq!(r.events[0].data["user_seq"], 2);
    let ids: Vec<u64> = r.events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=r.events.len() as u64).collect::<Vec<_>>(), "ids count 1, 2, 3…");
    let end = r.end();
    assert_eq!(end["status"], "completed");
    assert_eq!(end["assistant_seq"], 3);
    assert!(end["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(r.text().split_whitespace().count(), 30);

    let items = transcript(&api, id).await;
    assert_eq!(items.len(), 2);
    assert_eq!(
        (items[0]["kind"].as_str(), items[0]["text"].as_str()),
        (Some("user"), Some("hello there [mock words=30]"))
    );
    assert_eq!(
        (items[1]["kind"].as_str(), items[1]["text"].as_str()),
        (Some("assistant"), Some(r.text().as_str()))
    );
    assert_eq!(items[1]["model"], "mock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_turns_agree_everywhere_and_extend_the_prompt_byte_for_byte() {
    let (api, mock) =
        with_mock_opts(Options { system_prompt: "You are terse.".into(), ..Options::default() }).await;
    let id = api.create(ALICE, None).await;
    let mut answers = Vec::new();
    for i in 0..20 {
        let r = api
            .turn(
                Method::POST,
                &send_path(id),
                ALICE,
                Some(json!({"text": format!("question {i} [mock words=12]")})),
                &[],
            )
            .await;
        assert_eq!(r.end()["status"], "completed", "turn {i}");
        answers.push(r.text());
    }
    let hist = histories(&mock);
    assert_eq!(hist.len(), 20);
    for (i, pair) in hist.windows(2).enumerate() {
        assert!(
            pair[1].len() > pair[0].len() && pair[1][..pair[0].len()] == pair[0][..],
            "request {} does not extend request {i}",
            i + 1
        );
    }
    assert_eq!(hist[0][0]["role"], "system");

    let items = transcript(&api, id).await;
    assert_eq!(items.len(), 40);
    let context = api.get(&format!("/v1/sessions/{id}/context"), ALICE).await.json;
    let messages = context["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 40);
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(items[2 * i + 1]["text"].as_str(), Some(answer.as_str()));
        assert_eq!(messages[2 * i + 1]["content"].as_str(), Some(answer.as_str()));
    }
    let events = api.get(&format!("/v1/sessions/{id}/events?limit=1000"), ALICE).await.json;
    assert_eq!(events["events"].as_array().unwrap().len(), 41);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_client_does_not_cancel_the_turn() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let resp = api.message_request(id, ALICE, "long one [mock words=40 delay_ms=25]").await;
    let mut body = resp.bytes_stream();
    body.next().await.unwrap().unwrap();
    drop(body);
    let items = eventually(WAIT, || async {
        let items = transcript(&api, id).await;
        items.iter().any(|i| i["kind"] == "assistant").then_some(items)
    })
    .await;
    let answer = items.iter().find(|i| i["kind"] == "assistant").unwrap();
    assert_eq!(
        answer["text"].as_str().unwrap().split_whitespace().count(),
        40,
        "the whole answer was stored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_keep_the_partial_or_record_the_failure() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;

    let r = api.message(id, ALICE, "break [mock words=50 fail_after=10]").await;
    let kinds: Vec<&str> = r.events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(kinds[kinds.len() - 2..], ["error", "end"]);
    assert_eq!(r.end()["status"], "interrupted");
    let partial = r.text();
    assert!(!partial.is_empty());
    let items = transcript(&api, id).await;
    let cut = items.iter().find(|i| i["kind"] == "interrupted").unwrap();
    assert_eq!(cut["text"].as_str(), Some(partial.as_str()));
    assert_eq!(r.end()["pending_seq"], cut["seq"]);

    let r = api.message(id, ALICE, "boom [mock status=500]").await;
    assert_eq!(r.events.iter().filter(|e| e.event == "error").count(), 1);
    assert_eq!(r.end()["status"], "failed");
    assert_eq!(r.events.iter().find(|e| e.event == "error").unwrap().data["code"], "upstream_error");
    let items = transcript(&api, id).await;
    assert_eq!(items.last().unwrap()["kind"], "error");
    assert_eq!(items.last().unwrap()["seq"], r.end()["failed_seq"]);

    // The next request carries the partial with the interruption note.
    let r = api.message(id, ALICE, "again").await;
    assert_eq!(r.end()["status"], "completed");
    let context = api.get(&format!("/v1/sessions/{id}/context"), ALICE).await.json;
    let texts: Vec<&str> =
        context["messages"].as_array().unwrap().iter().filter_map(|m| m["content"].as_str()).collect();
    assert!(texts.iter().any(|t| t.contains("[previous turn failed: upstream_error")), "{texts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_model_times_out_into_a_failed_turn() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let r = api.message(id, ALICE, "wait [mock hang]").await;
    assert_eq!(r.end()["status"], "failed");
    assert_eq!(r.events.iter().find(|e| e.event == "error").unwrap().data["code"], "upstream_timeout");
    assert_eq!(count_kind(&api, "turn_failed").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_send_is_a_conflict_and_appends_nothing() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let first = api.message_request(id, ALICE, "slow [mock words=30 delay_ms=30]").await;
    assert_eq!(first.status(), 200);
    let second = api.message(id, ALICE, "me too").await;
    assert_eq!(second.status, 409);
    assert_eq!(second.json["error"]["code"], "conflict");
    let retry = api.turn(Method::POST, &format!("/v1/sessions/{id}/retry"), ALICE, None, &[]).await;
    assert_eq!(retry.status, 409);
    drop(first);
    assert_eq!(count_kind(&api, "user_message").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_keeps_the_partial_as_stopped_and_the_model_is_told() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let resp = api.message_request(id, ALICE, "story [mock words=200 delay_ms=20]").await;
    let mut events = resp.bytes_stream().eventsource();
    let mut text = String::new();
    let mut end = Value::Null;
    let mut stopped = false;
    while let Some(e) = events.next().await {
        let e = e.unwrap();
        let data: Value = serde_json::from_str(&e.data).unwrap();
        match e.event.as_str() {
            "delta" => {
                text.push_str(data["text"].as_str().unwrap());
                if !stopped && text.split_whitespace().count() >= 5 {
                    let r = api
                        .call(
                            Method::POST,
                            &format!("/v1/sessions/{id}/stop"),
                            Some(ALICE),
                            turnlog_e2e::api::Body::None,
                        )
                        .await;
                    assert_eq!(r.status, 202, "{}", r.text);
                    stopped = true;
                }
            }
            "end" => end = data,
            _ => {}
        }
    }
    assert_eq!(end["status"], "stopped");
    let items = transcript(&api, id).await;
    let cut = items.iter().find(|i| i["kind"] == "interrupted").unwrap();
    assert_eq!((cut["reason"].as_str(), cut["text"].as_str()), (Some("stopped"), Some(text.as_str())));
    let context = api.get(&format!("/v1/sessions/{id}/context"), ALICE).await.json;
    assert_eq!(
        context["messages"][1]["content"].as_str(),
        Some(format!("{text}\n\n{STOPPED_NOTE}").as_str())
    );
    let again = api
        .call(Method::POST, &format!("/v1/sessions/{id}/stop"), Some(ALICE), turnlog_e2e::api::Body::None)
        .await;
    assert_eq!(again.status, 409, "no turn in flight");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_runs_the_question_again_and_the_transcript_shows_both_attempts_once() {
    let (api, mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let r = api.message(id, ALICE, "flaky [mock words=40 fail_after=8]").await;
    assert_eq!(r.end()["status"], "interrupted");
    let partial = r.text();
    let retry = api.turn(Method::POST, &format!("/v1/sessions/{id}/retry"), ALICE, None, &[]).await;
    assert_eq!(retry.events[0].data["user_seq"], r.events[0].data["user_seq"]);
    // The retried question carries its directive again, so it fails again the same way;
    // the retry's request must carry the first attempt's partial with the note.
    let last = histories(&mock).pop().unwrap();
    let last_text = last.last().unwrap()["content"].as_str().unwrap().to_owned();
    assert_eq!(last_text, format!("{partial}\n\n{INTERRUPTED_NOTE}"));
    assert_eq!(count_kind(&api, "user_message").await, 1, "a retry appends no user message");

    let items = transcript(&api, id).await;
    let interrupted = items.iter().filter(|i| i["kind"] == "interrupted").count();
    assert_eq!(interrupted, 2, "each attempt's partial shows once: {items:?}");

    // A completed turn has nothing to retry.
    let ok = api.message(id, ALICE, "fine").await;
    assert_eq!(ok.end()["status"], "completed");
    let nothing = api.turn(Method::POST, &format!("/v1/sessions/{id}/retry"), ALICE, None, &[]).await;
    assert_eq!(nothing.status, 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_attempt_then_a_completed_retry_each_show_once() {
    let (api, mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    // The mock breaks its next answer off, then answers the same request.
    mock.faults().break_next_chats(1);
    let r = api.message(id, ALICE, "tell me [mock words=30]").await;
    assert_ne!(r.end()["status"], "completed");
    let retry = api.turn(Method::POST, &format!("/v1/sessions/{id}/retry"), ALICE, None, &[]).await;
    assert_eq!(retry.end()["status"], "completed");
    let items = transcript(&api, id).await;
    let kinds: Vec<&str> = items.iter().filter_map(|i| i["kind"].as_str()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "assistant").count(), 1);
    assert_eq!(kinds.iter().filter(|k| **k == "interrupted" || **k == "error").count(), 1, "{kinds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_post_with_the_same_idempotency_key_answers_the_same_turn() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let key = [("Idempotency-Key", "k-123")];
    let path = send_path(id);
    let once = || api.turn(Method::POST, &path, ALICE, Some(json!({"text": "once"})), &key);
    let (first, again) = (once().await, once().await);
    assert_eq!(first.end()["assistant_seq"], again.end()["assistant_seq"]);
    assert_eq!(again.end()["status"], "completed");
    assert_eq!(count_kind(&api, "user_message").await, 1);
    assert_eq!(count_kind(&api, "assistant_turn").await, 1);

    let chat = || {
        let body = json!({"text": "new chat"});
        api.turn(Method::POST, "/v1/chat", ALICE, Some(body), &[("Idempotency-Key", "c-1")])
    };
    let (chat1, chat2) = (chat().await, chat().await);
    assert_eq!(chat1.headers["x-session-id"], chat2.headers["x-session-id"]);
    assert_eq!(count_kind(&api, "user_message").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_creates_a_session_and_names_it_before_any_body_byte() {
    let (api, _mock) = with_mock().await;
    let chat = api.request(Method::POST, "/v1/chat").bearer_auth(ALICE);
    let resp = chat.json(&json!({"text": "hi [mock words=5 delay_ms=50]"})).send().await.unwrap();
    let sid = resp.headers()["x-session-id"].to_str().unwrap().to_owned();
    let r = api
        .turn(Method::POST, "/v1/chat", ALICE, Some(json!({"session_id": sid, "text": "and again"})), &[])
        .await;
    assert_eq!(r.status, 409, "the first turn is still running");
    drop(resp);
    let unknown = api
        .turn(
            Method::POST,
            "/v1/chat",
            ALICE,
            Some(json!({"session_id": uuid::Uuid::now_v7(), "text": "x"})),
            &[],
        )
        .await;
    assert_eq!(unknown.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reattach_replays_after_last_event_id_then_follows_live() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let none = api.turn(Method::GET, &format!("/v1/sessions/{id}/stream"), ALICE, None, &[]).await;
    assert_eq!(none.status, 204);
    let first = api.message_request(id, ALICE, "go [mock words=30 delay_ms=20]").await;
    // The turn is live once its stream has begun: the client has events 1–3.
    let mut first = first.bytes_stream().eventsource();
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(first.next().await.unwrap().unwrap());
    }
    let attached = api
        .turn(Method::GET, &format!("/v1/sessions/{id}/stream"), ALICE, None, &[("Last-Event-ID", "3")])
        .await;
    assert_eq!(attached.events[0].id, 4);
    assert_eq!(attached.end()["status"], "completed");
    let full = seen.len() + first.collect::<Vec<_>>().await.len();
    assert_eq!(full as u64, attached.events.last().unwrap().id, "the same turn, to its end");
    let bad = api
        .turn(Method::GET, &format!("/v1/sessions/{id}/stream"), ALICE, None, &[("Last-Event-ID", "x")])
        .await;
    assert_eq!(bad.status, 400);
}

/// A turn no other copy follows sends nothing on its live subject (DESIGN §6); once a copy
/// asks for its events, the events after them go out there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_goes_out_on_its_live_subject_only_once_another_copy_asks() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let client = &api.bus.client;
    let mut live = client.subscribe(api.bus.names.live_subject(id)).await.unwrap();
    let first = api.message_request(id, ALICE, "go [mock words=60 delay_ms=20]").await;
    let mut first = first.bytes_stream().eventsource();
    for _ in 0..3 {
        first.next().await.unwrap().unwrap();
    }
    let quiet = tokio::time::timeout(std::time::Duration::from_millis(200), live.next()).await;
    assert!(quiet.is_err(), "an unfollowed turn published on its live subject");

    // Another copy's follower: it asks for the events so far, then hears the rest live.
    let asked = client.request(api.bus.names.turn_subject(id), json!({"after": 0}).to_string().into());
    let snapshot: Value = serde_json::from_slice(&asked.await.unwrap().payload).unwrap();
    let last = snapshot["events"].as_array().unwrap().last().unwrap()["id"].as_u64().unwrap();
    let heard = tokio::time::timeout(WAIT, live.next()).await.unwrap().unwrap();
    let heard: Value = serde_json::from_slice(&heard.payload).unwrap();
    assert!(heard["id"].as_u64().unwrap() <= last + 1, "an event fell between the snapshot and {heard}");
    while first.next().await.is_some() {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reattach_past_the_turns_last_event_ends_with_the_turn() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let stream_path = format!("/v1/sessions/{id}/stream");
    let running = api.message_request(id, ALICE, "go [mock words=30 delay_ms=100]").await;
    // The turn is live once its stream has begun.
    let mut running = running.bytes_stream().eventsource();
    let meta = running.next().await.unwrap().unwrap();
    assert_eq!(meta.event, "meta");
    // An id this turn (3 s long) has not reached (a client's id from an earlier, longer turn).
    let beyond = [("Last-Event-ID", "1000")];
    let attached = tokio::time::timeout(WAIT, api.turn(Method::GET, &stream_path, ALICE, None, &beyond))
        .await
        .expect("the re-attach ends when the turn does");
    assert_eq!(attached.status, 200);
    assert!(attached.events.is_empty(), "nothing past event 1000: {:?}", attached.events);
    let full = running.collect::<Vec<_>>().await;
    assert_eq!(full.last().unwrap().as_ref().unwrap().event, "end");

    // The turn is over: no stream to hold open.
    let after = api.turn(Method::GET, &stream_path, ALICE, None, &beyond).await;
    assert_eq!(after.status, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_whole_window_fails_as_context_overflow_without_a_compactor() {
    let (api, mock) =
        with_mock_opts(Options { model_windows: vec![("tiny", 40)], ..Options::default() }).await;
    let id = api.create(ALICE, None).await;
    let long = "word ".repeat(200);
    let r = api
        .turn(Method::POST, &send_path(id), ALICE, Some(json!({"text": long, "model": "tiny"})), &[])
        .await;
    assert_eq!(r.end()["status"], "failed");
    assert_eq!(r.events.iter().find(|e| e.event == "error").unwrap().data["code"], "context_overflow");
    assert!(histories(&mock).is_empty(), "nothing was sent to the model");
}
