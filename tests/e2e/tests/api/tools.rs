//! Client tools inside a turn (DESIGN §14): a step that asks for the tools a request offers
//! pauses the turn (`requires_action`), the results continue it with its next step, each
//! step's request extends the previous one's byte for byte and rebuilds from the log, and
//! a later turn no longer carries the finished turn's tool traffic.

use reqwest::Method;
use serde_json::{json, Value};
use turnlog_e2e::api::{Api, Options, ALICE};
use turnlog_mock_llm::{MockConfig, MockHandle};

async fn with_mock() -> (Api, MockHandle) {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    (Api::with(Options { llm_url: Some(mock.base_url()), ..Options::default() }).await, mock)
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "read", "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}},
    ])
}

/// The messages of every chat request the mock received.
fn requests(mock: &MockHandle) -> Vec<Vec<Value>> {
    mock.log()
        .entries()
        .into_iter()
        .filter(|r| r.path.ends_with("/chat/completions"))
        .map(|r| r.body["messages"].as_array().unwrap().clone())
        .collect()
}

async fn kinds(api: &Api, id: impl std::fmt::Display) -> Vec<String> {
    let events = api.get(&format!("/v1/sessions/{id}/events?limit=1000"), ALICE).await.json;
    events["events"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap().to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_tool_turn_pauses_and_continues_with_its_results() {
    let (api, mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let text = r#"Read it [mock tool=read:{"path":"a.txt"} tool=ls:{} steps=2 words=4]"#;
    let body = json!({"text": text, "tools": tools(), "tool_choice": "auto", "parallel_tool_calls": true});
    let path = format!("/v1/sessions/{id}/messages");
    let first = api.turn(Method::POST, &path, ALICE, Some(body), &[]).await;
    let end = first.end().clone();
    assert_eq!(end["status"], "requires_action", "{:?}", first.events);
    let required = end["required"].as_array().unwrap().clone();
    assert_eq!(required.iter().map(|r| r["name"].as_str().unwrap()).collect::<Vec<_>>(), ["read", "ls"]);
    assert_eq!(required[0]["arguments"], r#"{"path":"a.txt"}"#);
    assert!(required.iter().all(|r| r["kind"] == "tool"));
    let calls: Vec<&Value> =
        first.events.iter().filter(|e| e.event == "tool_call").map(|e| &e.data).collect();
    assert_eq!(calls.len(), 2);
    assert!(calls.iter().all(|c| c["source"] == "client"));
    let ids: Vec<String> = required.iter().map(|r| r["call_id"].as_str().unwrap().to_owned()).collect();

    // Refused, appending nothing: a missing result, a call the turn never made.
    let results_path = format!("/v1/sessions/{id}/tool_results");
    let one = json!({"results": [{"call_id": ids[0], "output": "hello"}]});
    let missing = api.turn(Method::POST, &results_path, ALICE, Some(one), &[]).await;
    assert_eq!(missing.status, 400);
    assert!(missing.json["error"]["message"].as_str().unwrap().contains(&ids[1]), "{}", missing.json);
    let unknown = json!({"results": [{"call_id": "call_nope", "output": "x"}, {"call_id": ids[0], "output": "x"}, {"call_id": ids[1], "output": "x"}]});
    assert_eq!(api.turn(Method::POST, &results_path, ALICE, Some(unknown), &[]).await.status, 404);
    assert!(!kinds(&api, id).await.contains(&"tool_execution".to_owned()));

    // The results continue the turn: meta, a tool_result each, then the next step.
    let both = json!({"results": [{"call_id": ids[0], "output": "hello"}, {"call_id": ids[1], "output": "a.txt", "is_error": false}]});
    let second = api.turn(Method::POST, &results_path, ALICE, Some(both.clone()), &[]).await;
    let names: Vec<&str> = second.events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(&names[..3], ["meta", "tool_result", "tool_result"], "{names:?}");
    assert_eq!(second.events[0].data["user_seq"], 2);
    assert_eq!(second.end()["status"], "requires_action");
    let ids2: Vec<String> = second.end()["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["call_id"].as_str().unwrap().to_owned())
        .collect();
    assert!(ids2.iter().all(|i| !ids.contains(i)), "each step's calls are its own");
    // The same results again: already answered.
    assert_eq!(api.turn(Method::POST, &results_path, ALICE, Some(both), &[]).await.status, 409);
    // A retry while the turn waits is refused too.
    let retry =
        api.turn(Method::POST, &format!("/v1/sessions/{id}/retry"), ALICE, Some(json!({})), &[]).await;
    assert_eq!(retry.status, 409);

    let last = json!({"results": [{"call_id": ids2[0], "output": "hello again"}, {"call_id": ids2[1], "output": "b.txt", "is_error": true}]});
    let third = api.turn(Method::POST, &results_path, ALICE, Some(last), &[]).await;
    assert_eq!(third.end()["status"], "completed");
    assert_eq!(third.text().split_whitespace().count(), 4);
    let tool_steps = ["assistant_turn", "tool_execution", "tool_execution"];
    let expected: Vec<&str> = ["session_started", "user_message"]
        .into_iter()
        .chain(tool_steps)
        .chain(tool_steps)
        .chain(["assistant_turn"])
        .collect();
    let got = kinds(&api, id).await;
    let got: Vec<&str> = got.iter().map(String::as_str).filter(|k| *k != "pending_state").collect();
    assert_eq!(&got[..expected.len()], expected);

    // Each step's request extends the previous one's byte for byte (the extras stay where
    // the first step put them), and offers the tools.
    let sent = requests(&mock);
    assert_eq!(sent.len(), 3);
    for pair in sent.windows(2) {
        assert_eq!(pair[1][..pair[0].len()], pair[0][..], "a step's request extends the previous one's");
    }
    let roles: Vec<&str> = sent[2].iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(&roles[roles.len() - 6..], ["assistant", "tool", "tool", "assistant", "tool", "tool"]);
    assert_eq!(sent[2][roles.len() - 1]["tool_call_id"], ids2[1].as_str());
    let logged = mock.log().entries().into_iter().rfind(|r| r.path.ends_with("/chat/completions")).unwrap();
    assert_eq!(logged.body["tools"], tools());
    assert_eq!(logged.body["parallel_tool_calls"], true);

    // Every step's request rebuilds from the log (§11).
    let events = api.get(&format!("/v1/sessions/{id}/events?limit=1000"), ALICE).await.json;
    for e in events["events"].as_array().unwrap().iter().filter(|e| e["kind"] == "assistant_turn") {
        let audit = api.get(&format!("/v1/sessions/{id}/requests/{}", e["seq"]), ALICE).await.json;
        assert_eq!(audit["verified"], true, "{audit}");
    }

    // The next turn's request no longer carries the finished turn's tool traffic.
    let next = api.message(id, ALICE, "thanks [mock words=3]").await;
    assert_eq!(next.end()["status"], "completed");
    let sent = requests(&mock);
    let last = sent.last().unwrap();
    assert!(last.iter().all(|m| m["role"] != "tool" && m.get("tool_calls").is_none()), "{last:?}");
    assert!(last.iter().any(|m| m["role"] == "assistant" && m["content"] == third.text().as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tool_offers_are_refused_before_anything_is_written() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let path = format!("/v1/sessions/{id}/messages");
    for body in [
        json!({"text": "x", "tools": {"type": "function"}}),
        json!({"text": "x", "tools": [{"type": "function", "function": {"name": "bad name"}}]}),
        json!({"text": "x", "tools": [{"type": "code_interpreter"}]}),
        json!({"text": "x", "tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]}),
        json!({"text": "x", "tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        json!({"text": "x", "tool_choice": "auto"}),
    ] {
        let r = api.turn(Method::POST, &path, ALICE, Some(body.clone()), &[]).await;
        assert_eq!(r.status, 400, "{body}: {}", r.json);
    }
    assert_eq!(kinds(&api, id).await, ["session_started"]);
    // Results for a session that waits for none.
    let r = api
        .turn(
            Method::POST,
            &format!("/v1/sessions/{id}/tool_results"),
            ALICE,
            Some(json!({"results": [{"call_id": "c", "output": "x"}]})),
            &[],
        )
        .await;
    assert_eq!(r.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_turn_shows_in_the_session_and_a_new_message_cancels_what_it_waits_for() {
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    async fn view(api: &Api, id: impl std::fmt::Display) -> Value {
        api.get(&format!("/v1/sessions/{id}"), ALICE).await.json
    }
    assert_eq!(view(&api, id).await["requires_action"], Value::Null);
    let body = json!({"text": r#"Look [mock tool=ls:{} steps=1 words=3]"#, "tools": tools()});
    let paused = api.turn(Method::POST, &format!("/v1/sessions/{id}/messages"), ALICE, Some(body), &[]).await;
    assert_eq!(paused.end()["status"], "requires_action");
    // The pause is the log's: the session says what it waits for (another owner sees nothing).
    let shown = view(&api, id).await;
    assert_eq!(shown["requires_action"], paused.end()["required"], "{shown}");
    assert_eq!(shown["turn_active"], false);
    let call = paused.end()["required"][0]["call_id"].as_str().unwrap().to_owned();

    // A new message goes on without the result: the call is recorded cancelled first.
    let next = api.message(id, ALICE, "never mind [mock words=2]").await;
    assert_eq!(next.end()["status"], "completed");
    assert_eq!(view(&api, id).await["requires_action"], Value::Null);
    let events = api.get(&format!("/v1/sessions/{id}/events?limit=1000"), ALICE).await.json;
    let events = events["events"].as_array().unwrap();
    let order: Vec<&str> = events
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .filter(|k| ["user_message", "assistant_turn", "tool_execution"].contains(k))
        .collect();
    assert_eq!(order, ["user_message", "assistant_turn", "tool_execution", "user_message", "assistant_turn"]);
    let cancelled = events.iter().find(|e| e["kind"] == "tool_execution").unwrap();
    assert_eq!(
        (cancelled["payload"]["call_id"].as_str(), cancelled["payload"]["status"].as_str()),
        (Some(call.as_str()), Some("cancelled"))
    );
    // Its result, sent late, is refused: already answered.
    let late = json!({"results": [{"call_id": call, "output": "x"}]});
    let r = api.turn(Method::POST, &format!("/v1/sessions/{id}/tool_results"), ALICE, Some(late), &[]).await;
    assert_eq!(r.status, 409, "{}", r.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_cap_fails_a_turn_and_long_outputs_reach_the_model_cut_with_a_note() {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let api = Api::with(Options {
        llm_url: Some(mock.base_url()),
        ingress: Some(|c| {
            c.max_tool_steps = 2;
            c.tool_output_max = 1_000;
        }),
        ..Options::default()
    })
    .await;
    let id = api.create(ALICE, None).await;
    // The mock would ask three times; the second model call is the turn's last allowed.
    let body = json!({"text": r#"Loop [mock tool=ls:{} steps=3 words=2]"#, "tools": tools()});
    let first = api.turn(Method::POST, &format!("/v1/sessions/{id}/messages"), ALICE, Some(body), &[]).await;
    let call = first.end()["required"][0]["call_id"].as_str().unwrap().to_owned();
    let long = "x".repeat(5_000);
    let results = json!({"results": [{"call_id": call, "output": long}]});
    let second =
        api.turn(Method::POST, &format!("/v1/sessions/{id}/tool_results"), ALICE, Some(results), &[]).await;
    assert_eq!(second.end()["status"], "failed", "{:?}", second.events);
    let error = second.events.iter().find(|e| e.event == "error").expect("an error event");
    assert_eq!(error.data["code"], "too_many_steps", "{}", error.data);
    // The output the model got is the stored one: 1,000 bytes and the note.
    let sent = requests(&mock);
    let tool = sent.last().unwrap().iter().rfind(|m| m["role"] == "tool").unwrap();
    let text = tool["content"].as_str().unwrap();
    assert_eq!(text, format!("{}\n[output cut: 4000 of 5000 bytes left out]", "x".repeat(1_000)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_keep_the_next_turn_still_carries_the_finished_turns_tool_traffic() {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let api = Api::with(Options {
        llm_url: Some(mock.base_url()),
        ingress: Some(|c| c.tool_history = turnlog_core::llm_context::ToolHistory::Keep),
        ..Options::default()
    })
    .await;
    let id = api.create(ALICE, None).await;
    let body = json!({"text": r#"Look [mock tool=ls:{} steps=1 words=3]"#, "tools": tools()});
    let paused = api.turn(Method::POST, &format!("/v1/sessions/{id}/messages"), ALICE, Some(body), &[]).await;
    let call = paused.end()["required"][0]["call_id"].as_str().unwrap().to_owned();
    let results = json!({"results": [{"call_id": call, "output": "a.txt"}]});
    let done =
        api.turn(Method::POST, &format!("/v1/sessions/{id}/tool_results"), ALICE, Some(results), &[]).await;
    assert_eq!(done.end()["status"], "completed");
    let answered = requests(&mock).last().unwrap().clone();
    let next = api.message(id, ALICE, "and then? [mock words=2]").await;
    assert_eq!(next.end()["status"], "completed");
    // The finished turn's call and result are still there, the earlier request a prefix of
    // the next one up to where the turn's extras stood (right after its user message).
    let last = requests(&mock).last().unwrap().clone();
    assert!(last.iter().any(|m| m["role"] == "tool" && m["content"] == "a.txt"), "{last:?}");
    assert!(last.iter().any(|m| m["tool_calls"][0]["id"] == call.as_str()));
    let extras = answered
        .iter()
        .position(|m| m["content"].as_str().is_some_and(|c| c.starts_with("[context for this turn")))
        .unwrap();
    assert_eq!(last[..extras], answered[..extras]);
    assert_eq!(last[extras..extras + 2], answered[extras + 1..extras + 3], "the step and its result follow");
    // Every request rebuilds, with the policy it was built under.
    let events = api.get(&format!("/v1/sessions/{id}/events?limit=1000"), ALICE).await.json;
    for e in events["events"].as_array().unwrap().iter().filter(|e| e["kind"] == "assistant_turn") {
        assert_eq!(e["payload"]["request"]["tool_history"], "keep");
        let audit = api.get(&format!("/v1/sessions/{id}/requests/{}", e["seq"]), ALICE).await.json;
        assert_eq!(audit["verified"], true, "{audit}");
    }
    // The context view shows what the model sees.
    let context = api.get(&format!("/v1/sessions/{id}/context"), ALICE).await.json;
    assert!(context["messages"].as_array().unwrap().iter().any(|m| m["role"] == "tool"), "{context}");
}

/// A `tool_results` request whose write failed part way (one result recorded, the other
/// not) sent again records the rest: the recorded result is not sent twice, the turn
/// goes on, and each call has one result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_sent_again_after_a_partial_write_record_the_rest() {
    use turnlog_core::events::{EventBody, ToolExecution};
    let (api, _mock) = with_mock().await;
    let id = api.create(ALICE, None).await;
    let body = json!({"text": r#"Both [mock tool=read:{"path":"a.txt"} tool=ls:{} steps=1 words=2]"#, "tools": tools()});
    let paused = api.turn(Method::POST, &format!("/v1/sessions/{id}/messages"), ALICE, Some(body), &[]).await;
    let ids: Vec<String> = paused.end()["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["call_id"].as_str().unwrap().to_owned())
        .collect();
    // What the first try left: the first result only.
    let first = ToolExecution {
        call_id: ids[0].clone(),
        name: "read".into(),
        source: Some("client".into()),
        output: Some("hello".into()),
        status: "ok".into(),
        ..Default::default()
    };
    api.append(id, "alice", &EventBody::ToolExecution(first)).await;
    let both =
        json!({"results": [{"call_id": ids[0], "output": "hello"}, {"call_id": ids[1], "output": "a.txt"}]});
    let again =
        api.turn(Method::POST, &format!("/v1/sessions/{id}/tool_results"), ALICE, Some(both), &[]).await;
    assert_eq!(again.end()["status"], "completed", "{:?}", again.events);
    let results: Vec<&str> = again
        .events
        .iter()
        .filter(|e| e.event == "tool_result")
        .map(|e| e.data["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(results, [ids[1].as_str()]);
    let executions = kinds(&api, id).await.iter().filter(|k| *k == "tool_execution").count();
    assert_eq!(executions, 2);
    // A call id no client would send is refused before anything is read.
    let long = json!({"results": [{"call_id": "c".repeat(300), "output": "x"}]});
    let r = api.turn(Method::POST, &format!("/v1/sessions/{id}/tool_results"), ALICE, Some(long), &[]).await;
    assert_eq!(r.status, 400);
}
