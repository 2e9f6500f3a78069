//! What the ingress keeps and tells of the model gateway: its host but never the
//! credentials in its URL, a short message with the status code when it fails (the
//! provider's text and addresses stay in the operator's log), and only the models
//! `TURNLOG_ALLOWED_MODELS` names.

use reqwest::Method;
use serde_json::{json, Value};
use turnlog_core::events::{EventBody, UserMessage};
use turnlog_e2e::api::{Api, Body, Options, TurnReply, ALICE};
use turnlog_mock_llm::{MockConfig, MockHandle};

async fn mock() -> MockHandle {
    turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap()
}

fn send_path(id: impl std::fmt::Display) -> String {
    format!("/v1/sessions/{id}/messages")
}

async fn send(api: &Api, id: impl std::fmt::Display, body: Value) -> TurnReply {
    api.turn(Method::POST, &send_path(id), ALICE, Some(body), &[]).await
}

/// Everything a client can read of a session: its transcript, its raw events and the next
/// model request's context.
async fn readable(api: &Api, id: impl std::fmt::Display) -> String {
    let transcript = api.get(&format!("/v1/sessions/{id}"), ALICE).await.text;
    let events = api.get(&format!("/v1/sessions/{id}/events"), ALICE).await.text;
    let context = api.get(&format!("/v1/sessions/{id}/context"), ALICE).await.text;
    format!("{transcript}\n{events}\n{context}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_the_gateway_url_are_sent_but_never_stored_or_shown() {
    let mock = mock().await;
    let host = mock.addr().to_string();
    let llm_url = format!("http://turnlog:s3cret-pw@{host}/v1");
    let api = Api::with(Options { llm_url: Some(llm_url), ..Options::default() }).await;
    let id = api.create(ALICE, None).await;
    let r = send(&api, id, json!({"text": "hello [mock words=5]"})).await;
    assert_eq!(r.end()["status"], "completed");
    let streamed = serde_json::to_string(&r.events.iter().map(|e| &e.data).collect::<Vec<_>>()).unwrap();

    let events = api.get(&format!("/v1/sessions/{id}/events"), ALICE).await.json;
    let answer = events["events"].as_array().unwrap().iter().find(|e| e["kind"] == "assistant_turn").unwrap();
    assert_eq!(answer["payload"]["provider"], host.as_str(), "the host only");
    let items = api.get(&format!("/v1/sessions/{id}"), ALICE).await.json["items"].clone();
    assert_eq!(items[1]["provider"], host.as_str());
    for (what, text) in [("the event stream", streamed), ("the session", readable(&api, id).await)] {
        assert!(
            !text.contains("s3cret") && !text.contains("turnlog:"),
            "{what} shows the credentials: {text}"
        );
    }
    // The gateway still gets them, as Basic auth.
    let chat = mock.log().entries().into_iter().find(|e| e.path.ends_with("/chat/completions")).unwrap();
    assert!(chat.authorization.is_some_and(|a| a.starts_with("Basic ")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_are_told_with_the_status_code_only() {
    let mock = mock().await;
    let host = mock.addr().to_string();
    let api = Api::with(Options { llm_url: Some(mock.base_url()), ..Options::default() }).await;
    let id = api.create(ALICE, None).await;
    // The mock's error body reads "mock failure with HTTP 502", code "mock_502".
    let failed = send(&api, id, json!({"text": "boom [mock status=502]"})).await;
    assert_eq!(failed.end()["status"], "failed");
    let error = failed.events.iter().find(|e| e.event == "error").unwrap();
    assert_eq!(error.data, json!({"code": "upstream_error", "message": "the model gateway answered 502"}));
    // A connection that breaks mid-answer: the partial is kept, the error says only that.
    let broken = send(&api, id, json!({"text": "break [mock words=50 fail_after=10]"})).await;
    assert_eq!(broken.end()["status"], "interrupted");
    let error = broken.events.iter().find(|e| e.event == "error").unwrap();
    assert_eq!(error.data["message"], "the model gateway's answer broke off before it was complete");

    let events = api.get(&format!("/v1/sessions/{id}/events"), ALICE).await.json;
    let turn_failed =
        events["events"].as_array().unwrap().iter().find(|e| e["kind"] == "turn_failed").unwrap();
    assert_eq!(turn_failed["payload"]["message"], "the model gateway answered 502");
    let told = format!("{}\n{}\n{}", readable(&api, id).await, failed.end(), broken.end());
    for leak in ["mock failure", "mock_502", "server_error", host.as_str(), "127.0.0.1", "http://"] {
        assert!(!told.contains(leak), "{leak:?} reached a client, the log or the model: {told}");
    }

    // A gateway nobody answers at: no address in what the client is told.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nowhere = format!("http://{}/v1", closed.local_addr().unwrap());
    drop(closed);
    let api = Api::with(Options { llm_url: Some(nowhere), ..Options::default() }).await;
    let id = api.create(ALICE, None).await;
    let r = send(&api, id, json!({"text": "anyone there?"})).await;
    assert_eq!(r.end()["status"], "failed");
    let error = r.events.iter().find(|e| e.event == "error").unwrap();
    assert_eq!(error.data["message"], "the model gateway could not be reached");
    assert!(!readable(&api, id).await.contains("127.0.0.1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_outside_the_allowed_list_are_refused_and_nothing_is_appended() {
    let mock = mock().await;
    let allowed = Some(vec!["mock".to_owned(), "mock-large".to_owned()]);
    let api =
        Api::with(Options { llm_url: Some(mock.base_url()), allowed_models: allowed, ..Options::default() })
            .await;
    let id = api.create(ALICE, None).await;
    let before = api.written().await;

    let path = send_path(id);
    let asks = [
        (path.as_str(), json!({"text": "hi", "model": "gpt-expensive"})),
        ("/v1/chat", json!({"text": "hi", "model": "gpt-expensive"})),
        ("/v1/chat", json!({"session_id": id, "text": "hi", "model": "mock-larger"})),
    ];
    for (path, body) in asks {
        let r = api.call(Method::POST, path, Some(ALICE), Body::Json(body.clone())).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        assert_eq!(r.error_code(), "bad_request");
        let message = r.json["error"]["message"].as_str().unwrap();
        assert!(message.contains("mock, mock-large"), "names the allowed list: {message}");
    }
    assert_eq!(api.written().await, before, "nothing was appended");
    assert_eq!(mock.log().count("/v1/chat/completions"), 0, "the model was not called");

    let ok = send(&api, id, json!({"text": "hi [mock words=3]", "model": "mock-large"})).await;
    assert_eq!(ok.end()["status"], "completed");
    assert_eq!(ok.end()["model"], "mock-large");

    // A retry runs the stored message's model, which must still be allowed.
    let message =
        UserMessage { text: "again".into(), model_hint: Some("retired".into()), ..Default::default() };
    api.append(id, "alice", &EventBody::UserMessage(message)).await;
    let retry = api.call(Method::POST, &format!("/v1/sessions/{id}/retry"), Some(ALICE), Body::None).await;
    assert_eq!(retry.status, 400, "{}", retry.text);
    assert!(retry.text.contains("retired"), "{}", retry.text);
}

/// `TURNLOG_CATEGORY_MODELS`: a message's category picks its model unless it names one, and
/// a retry of it goes to the same model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_category_picks_the_model_unless_the_message_names_one() {
    let mock = mock().await;
    let api = Api::with(Options {
        llm_url: Some(mock.base_url()),
        category_models: vec![("code", "mock-large")],
        ..Options::default()
    })
    .await;
    let id = api.create(ALICE, None).await;
    let coded = send(&api, id, json!({"text": "a loop [mock words=3]", "category": "code"})).await;
    assert_eq!(coded.end()["model"], "mock-large");
    let named =
        send(&api, id, json!({"text": "hi [mock words=3]", "category": "code", "model": "mock"})).await;
    assert_eq!(named.end()["model"], "mock");
    let other = send(&api, id, json!({"text": "hi [mock words=3]", "category": "travel"})).await;
    assert_eq!(other.end()["model"], "mock");
    let message = UserMessage {
        text: "again [mock words=3]".into(),
        category: Some("code".into()),
        ..Default::default()
    };
    api.append(id, "alice", &EventBody::UserMessage(message)).await;
    let retry = api.turn(Method::POST, &format!("/v1/sessions/{id}/retry"), ALICE, None, &[]).await;
    assert_eq!(retry.end()["model"], "mock-large");
}

/// The Chat Completions pass-through (no `X-Session-Id`) forwards the client's own body: a
/// body that is not an object, a fallback to a model outside the allowed list, more than
/// one answer, a dearer service tier or `store` at the gateway is a 400 in OpenAI's shape,
/// and the model is not called. A bad query parameter on an OpenAI route is that shape too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chat_pass_through_checks_every_field_that_picks_a_model_or_multiplies_cost() {
    let mock = mock().await;
    let allowed = Some(vec!["mock".to_owned(), "mock-large".to_owned()]);
    let api =
        Api::with(Options { llm_url: Some(mock.base_url()), allowed_models: allowed, ..Options::default() })
            .await;
    let messages = json!([{"role": "user", "content": "hi [mock words=3]"}]);
    let with = |field: &str, value: serde_json::Value| {
        let mut body = json!({"model": "mock", "messages": messages});
        body[field] = value;
        Body::Json(body)
    };
    let conversation = api.call(Method::POST, "/v1/conversations", Some(ALICE), Body::Json(json!({}))).await;
    let items = format!("/v1/conversations/{}/items", conversation.json["id"].as_str().unwrap());
    let cases: Vec<(&str, Method, String, Body)> = vec![
        ("an array body", Method::POST, "/v1/chat/completions".into(), Body::Json(messages.clone())),
        ("a string body", Method::POST, "/v1/chat/completions".into(), Body::Json(json!("hi"))),
        // Read by serde as the fields in order (model, messages): it panicked the pass-through.
        (
            "a request as an array",
            Method::POST,
            "/v1/chat/completions".into(),
            Body::Json(json!([null, messages])),
        ),
        (
            "an unlisted fallback",
            Method::POST,
            "/v1/chat/completions".into(),
            with("fallbacks", json!(["gpt-5"])),
        ),
        (
            "an unlisted fallback in a map",
            Method::POST,
            "/v1/chat/completions".into(),
            with("fallbacks", json!([{"mock": ["gpt-5"]}])),
        ),
        (
            "an unlisted router model",
            Method::POST,
            "/v1/chat/completions".into(),
            with("models", json!(["gpt-5"])),
        ),
        ("three answers", Method::POST, "/v1/chat/completions".into(), with("n", json!(3))),
        (
            "a priority tier",
            Method::POST,
            "/v1/chat/completions".into(),
            with("service_tier", json!("priority")),
        ),
        ("stored at the gateway", Method::POST, "/v1/chat/completions".into(), with("store", json!(true))),
        (
            "stream=maybe",
            Method::GET,
            "/v1/responses/resp_0190a0a0a0a0a0a0a0a0a0a0a0a0a0a0?stream=maybe".into(),
            Body::None,
        ),
        ("limit=-1", Method::GET, format!("{items}?limit=-1"), Body::None),
    ];
    let mut failures = Vec::new();
    for (name, method, path, body) in cases {
        let r = api.call(method.clone(), &path, Some(ALICE), body).await;
        let shaped = r.json["error"]["type"] == "invalid_request_error"
            && r.json["error"]["message"].as_str().is_some_and(|m| !m.is_empty());
        if r.status != 400 || !shaped {
            failures.push(format!("{name}: {method} {path} → {} {:.200}", r.status, r.text));
        }
    }
    assert!(failures.is_empty(), "{} cases failed:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(mock.log().count("/v1/chat/completions"), 0, "the model was called");

    // What is allowed goes through, as it came.
    let fine = json!({"model": "mock", "messages": messages, "n": 1, "fallbacks": ["mock-large"],
                      "service_tier": "auto", "store": false});
    let r = api.call(Method::POST, "/v1/chat/completions", Some(ALICE), Body::Json(fine)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(mock.log().count("/v1/chat/completions"), 1);
}
