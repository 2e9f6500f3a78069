//! turnlog-core's upstream client against the mock model over real HTTP: every knob, the
//! worker answers, the prompt cache and the context windows.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use turnlog_core::message::{ChatMessage, Content, ContentPart, Role};
use turnlog_core::tokens;
use turnlog_mock_llm::{spawn, MockConfig, MockHandle};
use turnlog_runtime::upstream::{
    parse_model_windows, ChatRequest, ImageResolver, StreamItem, TimeoutPhase, ToolCalls, UpstreamClient,
    UpstreamConfig, UpstreamError, Usage,
};

const TIMEOUT: Duration = Duration::from_secs(5);

fn client_with(mock: &MockHandle, timeout: Duration, windows: HashMap<String, u32>) -> UpstreamClient {
    UpstreamClient::new(UpstreamConfig {
        base_url: mock.base_url().into(),
        api_key: Some("sk-test".into()),
        timeout,
        windows_override: windows,
    })
    .unwrap()
}

async fn setup() -> (MockHandle, UpstreamClient) {
    let mock = spawn(MockConfig::default()).await.unwrap();
    let client = client_with(&mock, TIMEOUT, HashMap::new());
    (mock, client)
}

fn chat(text: &str) -> ChatRequest {
    ChatRequest {
        model: "mock".into(),
        messages: vec![ChatMessage::text(Role::System, "Be brief."), ChatMessage::text(Role::User, text)],
        ..ChatRequest::default()
    }
}

fn worker(marker: &str, conversation: &[(Role, &str)]) -> ChatRequest {
    let mut messages = vec![ChatMessage::text(Role::System, format!("You help turnlog. {marker}"))];
    messages.extend(conversation.iter().map(|(role, text)| ChatMessage::text(*role, *text)));
    ChatRequest { model: "mock".into(), messages, ..ChatRequest::default() }
}

/// Everything a stream yielded, and how it ended.
#[derive(Debug, Default)]
struct Collected {
    text: String,
    reasoning: Vec<String>,
    text_deltas: usize,
    usage: Option<Usage>,
    finish: Option<String>,
    end: Option<UpstreamError>,
    tool_calls: ToolCalls,
}

async fn collect(client: &UpstreamClient, request: &ChatRequest) -> Result<Collected, UpstreamError> {
    let mut stream = client.stream(request).await?;
    let mut out = Collected::default();
    loop {
        match stream.next().await {
            Ok(Some(StreamItem::Text(t))) => {
                out.text.push_str(&t);
                out.text_deltas += 1;
            }
            Ok(Some(StreamItem::Reasoning(r))) => out.reasoning.push(r),
            Ok(Some(StreamItem::Usage(u))) => out.usage = Some(u),
            Ok(Some(StreamItem::Finish(f))) => out.finish = Some(f),
            Ok(Some(StreamItem::ToolCall(c))) => out.tool_calls.add(c).unwrap(),
            Ok(None) => break,
            Err(e) => {
                // A finished stream keeps answering with its error.
                assert_eq!(stream.next().await, Err(e.clone()));
                out.end = Some(e);
                break;
            }
        }
    }
    Ok(out)
}

#[tokio::test]
async fn streams_a_deterministic_reply_ending_with_done() {
    let (mock, client) = setup().await;
    let first = collect(&client, &chat("Tell me about rivers [mock words=7]")).await.unwrap();
    assert_eq!(first.end, None, "a clean stream ends with Ok(None)");
    assert_eq!(first.text.split_whitespace().count(), 7);
    assert!(!first.text.contains("mock"), "directives stay out of the reply: {}", first.text);
    assert_eq!(first.finish.as_deref(), Some("stop"));
    let usage = first.usage.unwrap();
    assert!(usage.prompt_tokens > 0);
    assert_eq!(usage.completion_tokens, tokens::count(&first.text));
    assert_eq!(usage.cached_tokens, Some(0));

    let again = collect(&client, &chat("Tell me about rivers [mock words=7]")).await.unwrap();
    assert_eq!(again.text, first.text);
    let other = collect(&client, &chat("Tell me about lakes [mock words=7]")).await.unwrap();
    assert_ne!(other.text, first.text);

    let log = mock.log().entries();
    assert_eq!(log.len(), 3);
    assert_eq!(log[0].authorization.as_deref(), Some("Bearer sk-test"));
    assert_eq!(log[0].body["stream"], true);
    assert_eq!(log[0].body["stream_options"]["include_usage"], true);
}

#[tokio::test]
async fn server_defaults_apply_without_directives() {
    let mut config = MockConfig::default();
    config.defaults.words = 3;
    let mock = spawn(config).await.unwrap();
    let client = client_with(&mock, TIMEOUT, HashMap::new());
    let reply = collect(&client, &chat("hello")).await.unwrap();
    assert_eq!(reply.text.split_whitespace().count(), 3);
    let reply = collect(&client, &chat("hello [mock words=5]")).await.unwrap();
    assert_eq!(reply.text.split_whitespace().count(), 5);
}

#[tokio::test]
async fn delay_paces_the_deltas() {
    let (_mock, client) = setup().await;
    let started = Instant::now();
    let reply = collect(&client, &chat("slowly [mock words=5 delay_ms=60]")).await.unwrap();
    assert_eq!(reply.end, None);
    assert_eq!(reply.text_deltas, 5);
    assert!(started.elapsed() >= Duration::from_millis(300), "took {:?}", started.elapsed());
}

/// DESIGN §14's steps against the mock: `[mock tool=NAME:ARGS steps=N]` asks for the tools
/// (streamed in pieces, put back together by `ToolCalls`) until N steps' results follow
/// the question, then answers; the whole-body answer carries the same calls.
#[tokio::test]
async fn a_tool_directive_asks_for_tools_step_by_step_then_answers() {
    let (_mock, client) = setup().await;
    let question = r#"Read both [mock tool=read:{"path":"a.txt"} tool=ls:{} steps=2 words=3]"#;
    let mut request = chat(question);
    let mut ids = Vec::new();
    for step in 0..2 {
        let got = collect(&client, &request).await.unwrap();
        assert_eq!((got.finish.as_deref(), got.text.as_str()), (Some("tool_calls"), ""), "step {step}");
        let calls = got.tool_calls.finish().unwrap();
        assert_eq!(
            calls.iter().map(|c| (c.name.as_str(), c.arguments.as_str())).collect::<Vec<_>>(),
            [("read", r#"{"path":"a.txt"}"#), ("ls", "{}")]
        );
        let whole = client.complete(&request, TIMEOUT).await.unwrap();
        assert_eq!(whole.finish_reason.as_deref(), Some("tool_calls"));
        ids.extend(calls.iter().map(|c| c.id.clone()));
        request
            .messages
            .push(ChatMessage { tool_calls: calls.clone(), ..ChatMessage::text(Role::Assistant, "") });
        for c in &calls {
            request.messages.push(ChatMessage {
                tool_call_id: Some(c.id.clone()),
                ..ChatMessage::text(Role::Tool, "ok")
            });
        }
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 4, "each step's calls have their own ids");
    let answer = collect(&client, &request).await.unwrap();
    assert_eq!((answer.finish.as_deref(), answer.text.split_whitespace().count()), (Some("stop"), 3));
    assert!(answer.tool_calls.is_empty());
    // A malformed directive is a 400, as every other.
    assert!(collect(&client, &chat("x [mock tool=read:notjson]")).await.is_err());
}

#[tokio::test]
async fn reasoning_deltas_come_before_the_text() {
    let (_mock, client) = setup().await;
    let mut stream = client.stream(&chat("think [mock reasoning=3 words=2]")).await.unwrap();
    let mut kinds = Vec::new();
    while let Some(item) = stream.next().await.unwrap() {
        kinds.push(match item {
            StreamItem::Reasoning(_) => 'r',
            StreamItem::Text(_) => 't',
            StreamItem::Finish(_) => 'f',
            StreamItem::Usage(_) => 'u',
            StreamItem::ToolCall(_) => 'c',
        });
    }
    assert_eq!(kinds.into_iter().collect::<String>(), "rrrttfu");
}

#[tokio::test]
async fn a_dropped_connection_is_incomplete_after_the_deltas_sent() {
    let (_mock, client) = setup().await;
    let reply = collect(&client, &chat("drop it [mock words=10 fail_after=4]")).await.unwrap();
    assert_eq!(reply.text_deltas, 4);
    assert!(matches!(reply.end, Some(UpstreamError::Incomplete(_))), "{:?}", reply.end);
    assert_eq!(reply.finish, None);
}

#[tokio::test]
async fn a_stream_without_done_is_incomplete() {
    let (_mock, client) = setup().await;
    let reply = collect(&client, &chat("no end [mock words=4 no_done]")).await.unwrap();
    assert_eq!(reply.text_deltas, 4);
    assert_eq!(reply.finish.as_deref(), Some("stop"));
    assert!(reply.usage.is_some());
    assert!(matches!(reply.end, Some(UpstreamError::Incomplete(_))), "{:?}", reply.end);
}

#[tokio::test]
async fn error_statuses_carry_the_providers_body() {
    let (_mock, client) = setup().await;
    for status in [429, 503] {
        let error = collect(&client, &chat(&format!("x [mock status={status}]"))).await.unwrap_err();
        let UpstreamError::Status { status: got, body } = error else { panic!("{error:?}") };
        assert_eq!(got, status);
        let body: Value = serde_json::from_str(&body).unwrap();
        assert!(body["error"]["message"].as_str().unwrap().contains(&status.to_string()));
    }
    let error = client.complete(&chat("x [mock status=500]"), TIMEOUT).await.unwrap_err();
    assert!(matches!(error, UpstreamError::Status { status: 500, .. }), "{error:?}");
    // A typo in a directive is the mock's 400, not a silently ignored knob.
    let error = collect(&client, &chat("x [mock wrods=3]")).await.unwrap_err();
    assert!(matches!(error, UpstreamError::Status { status: 400, .. }), "{error:?}");
}

#[tokio::test]
async fn a_hung_upstream_times_out_on_the_first_byte() {
    let mock = spawn(MockConfig::default()).await.unwrap();
    let client = client_with(&mock, Duration::from_millis(300), HashMap::new());
    let started = Instant::now();
    let error = collect(&client, &chat("wait [mock hang]")).await.unwrap_err();
    assert_eq!(
        error,
        UpstreamError::Timeout { phase: TimeoutPhase::FirstByte, after: Duration::from_millis(300) }
    );
    assert!(started.elapsed() < Duration::from_secs(3));

    let error = client.complete(&chat("wait [mock hang]"), Duration::from_millis(200)).await.unwrap_err();
    assert!(matches!(error, UpstreamError::Timeout { phase: TimeoutPhase::Total, .. }), "{error:?}");
    // The hung handlers end with the server.
    mock.stop().await.unwrap();
}

#[tokio::test]
async fn a_stall_mid_stream_times_out_as_idle() {
    let mock = spawn(MockConfig::default()).await.unwrap();
    // Generous against a loaded machine's first byte; the stall is what must trip it.
    let client = client_with(&mock, Duration::from_millis(3000), HashMap::new());
    let reply = collect(&client, &chat("stall [mock words=6 stall_after=2]")).await.unwrap();
    assert_eq!(reply.text_deltas, 2);
    assert!(
        matches!(reply.end, Some(UpstreamError::Timeout { phase: TimeoutPhase::Idle, .. })),
        "{:?}",
        reply.end
    );
    // Deltas slower than the timeout in total but not between chunks are fine.
    let reply = collect(&client, &chat("paced [mock words=3 delay_ms=1200]")).await.unwrap();
    assert_eq!(reply.end, None);
}

#[tokio::test]
async fn complete_returns_the_same_answer_as_the_stream() {
    let (_mock, client) = setup().await;
    let request = chat("one shot [mock words=9 reasoning=2]");
    let streamed = collect(&client, &request).await.unwrap();
    let whole = client.complete(&request, TIMEOUT).await.unwrap();
    assert_eq!(whole.text, streamed.text);
    assert_eq!(whole.reasoning, streamed.reasoning.concat());
    assert_eq!(whole.finish_reason.as_deref(), Some("stop"));
    assert_eq!(whole.usage.map(|u| u.completion_tokens), streamed.usage.map(|u| u.completion_tokens));

    let error = client.complete(&chat("x [mock fail_after=1]"), TIMEOUT).await.unwrap_err();
    assert!(matches!(error, UpstreamError::Incomplete(_)), "{error:?}");
}

#[tokio::test]
async fn max_tokens_cuts_the_answer_with_length() {
    let (_mock, client) = setup().await;
    let request = ChatRequest { max_tokens: Some(5), ..chat("long [mock words=50]") };
    let reply = collect(&client, &request).await.unwrap();
    assert_eq!(reply.finish.as_deref(), Some("length"));
    assert!(reply.usage.unwrap().completion_tokens <= 5);
    assert_eq!(reply.end, None);
}

#[tokio::test]
async fn huge_answers_are_refused_and_max_tokens_bounds_what_is_built() {
    let (_mock, client) = setup().await;
    // Past the hard caps: 400 before anything is built (a token holder cannot make the
    // mock in `turnlog dev` allocate without bound).
    for huge in ["x [mock words=50001]", "x [mock reasoning=10001]", "x [mock words=99999999999 stamp]"] {
        let error = collect(&client, &chat(huge)).await.unwrap_err();
        let UpstreamError::Status { status: 400, body } = &error else { panic!("{huge}: {error:?}") };
        assert!(body.contains("at most"), "{body}");
    }
    // At the caps with a small max_tokens: the same cut as a short answer.
    for (most, few, max_tokens) in [("words=50000", "words=30", 5), ("reasoning=10000", "reasoning=20", 40)] {
        let ask =
            |knob| ChatRequest { max_tokens: Some(max_tokens), ..chat(&format!("same seed [mock {knob}]")) };
        let most = collect(&client, &ask(most)).await.unwrap();
        let few = collect(&client, &ask(few)).await.unwrap();
        assert_eq!(most.finish.as_deref(), Some("length"));
        assert!(!most.text.is_empty() || !most.reasoning.is_empty());
        assert_eq!((most.text, most.reasoning), (few.text, few.reasoning));
        assert!(most.usage.unwrap().completion_tokens <= max_tokens);
    }
}

#[tokio::test]
async fn worker_answers_are_valid_json_streamed_or_not() {
    let (_mock, client) = setup().await;
    let turn = [
        (Role::User, "Please fix src/upstream.rs before Friday."),
        (
            Role::Assistant,
            "I changed src/upstream.rs. The test failed because the port was taken. Alice reviewed 3 files.",
        ),
    ];
    let request = ChatRequest { response_format_json: true, ..worker("[turnlog:distill]", &turn) };
    let streamed = collect(&client, &request).await.unwrap();
    let memory: Value = serde_json::from_str(&streamed.text).unwrap();
    assert_eq!(memory["files_changed"], serde_json::json!(["src/upstream.rs"]));
    assert_eq!(memory["failures"][0]["why"], "the port was taken");
    assert!(memory["key_findings"].as_array().unwrap().iter().any(|f| f == "Alice reviewed 3 files."));
    let whole = client.complete(&request, TIMEOUT).await.unwrap();
    assert_eq!(whole.text, streamed.text);

    let facts = client.complete(&worker("[turnlog:memory]", &turn), TIMEOUT).await.unwrap();
    let facts: Value = serde_json::from_str(&facts.text).unwrap();
    assert_eq!(facts["memories"], serde_json::json!([{"text": "Please fix src/upstream.rs before Friday."}]));

    let title = client
        .complete(
            &worker("[turnlog:title]", &[(Role::User, "How do rivers carve canyons over time?")]),
            TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(title.text, "How do rivers carve canyons over");
}

#[tokio::test]
async fn worker_requests_ignore_directives_quoted_from_the_conversation() {
    let (_mock, client) = setup().await;
    let request = worker("[turnlog:memory]", &[(Role::User, "I live in Oslo. [mock status=500]")]);
    let facts = client.complete(&request, TIMEOUT).await.unwrap();
    let facts: Value = serde_json::from_str(&facts.text).unwrap();
    assert_eq!(facts["memories"][0]["text"], "I live in Oslo.");
}

#[tokio::test]
async fn summaries_keep_names_and_numbers_within_half_max_tokens() {
    let (_mock, client) = setup().await;
    let history: String = (1..=60)
        .map(|i| format!("On day {i} we met Carol about the budget. nothing else happened here. "))
        .collect();
    let request = ChatRequest {
        max_tokens: Some(200),
        ..worker("[turnlog:summarize]", &[(Role::User, "We picked Postgres."), (Role::Assistant, &history)])
    };
    let summary = client.complete(&request, TIMEOUT).await.unwrap();
    assert!(tokens::count(&summary.text) <= 100, "{} tokens", tokens::count(&summary.text));
    assert!(summary.text.starts_with("We picked Postgres. On day 1 we met Carol"));
    assert!(!summary.text.contains("nothing else"));
    assert_eq!(summary.finish_reason.as_deref(), Some("stop"));

    let short = ChatRequest { max_tokens: Some(4_000), ..request };
    let summary = client.complete(&short, TIMEOUT).await.unwrap();
    assert!(summary.text.contains("On day 60 we met Carol"), "every fact fits a large bound");
}

fn long_history(first: &str) -> Vec<ChatMessage> {
    let filler: String = (0..400).map(|i| format!("fact {i} stays put. ")).collect();
    vec![
        ChatMessage::text(Role::System, first),
        ChatMessage::text(Role::User, filler.clone()),
        ChatMessage::text(Role::Assistant, "Noted."),
    ]
}

#[tokio::test]
async fn the_prompt_cache_reports_shared_prefixes_in_steps() {
    let (mock, client) = setup().await;
    let mut request = ChatRequest {
        model: "mock".into(),
        messages: long_history("System prompt A."),
        ..Default::default()
    };
    let first = collect(&client, &request).await.unwrap().usage.unwrap();
    assert!(first.prompt_tokens > 2_000, "{first:?}");
    assert_eq!(first.cached_tokens, Some(0));

    request.messages.push(ChatMessage::text(Role::User, "And one more question."));
    let second = collect(&client, &request).await.unwrap().usage.unwrap();
    let cached = second.cached_tokens.unwrap();
    assert!(cached >= 1_024 && (cached - 1_024) % 128 == 0, "cached {cached}");
    assert!(
        cached <= first.prompt_tokens && first.prompt_tokens - cached < 128,
        "cached {cached} of {first:?}"
    );

    let changed = ChatRequest { messages: long_history("System prompt B."), ..request.clone() };
    assert_eq!(collect(&client, &changed).await.unwrap().usage.unwrap().cached_tokens, Some(0));

    let log = mock.log().entries();
    assert_eq!(log.iter().map(|r| r.cached_tokens).collect::<Vec<_>>(), [0, cached, 0]);
    assert_eq!(log[1].prompt_tokens, second.prompt_tokens);
}

#[tokio::test]
async fn context_windows_come_from_models_cached_and_overridable() {
    let mock = spawn(MockConfig::default()).await.unwrap();
    let windows = parse_model_windows("mock-small=9000").unwrap();
    let client = client_with(&mock, TIMEOUT, windows);
    assert_eq!(client.context_window("mock").await, Some(128_000));
    assert_eq!(client.context_window("mock-small").await, Some(9_000));
    assert_eq!(client.context_window("unknown").await, None);
    assert_eq!(client.context_window("mock").await, Some(128_000));
    assert_eq!(mock.log().count("/v1/models"), 1, "one listing serves every lookup for 30 s");
    assert_eq!(mock.log().entries()[0].authorization.as_deref(), Some("Bearer sk-test"));

    let plain = client_with(&mock, TIMEOUT, HashMap::new());
    assert_eq!(plain.context_window("mock-small").await, Some(6_700));
    let clone = plain.clone();
    assert_eq!(clone.context_window("mock-small").await, Some(6_700));
    assert_eq!(mock.log().count("/v1/models"), 2, "clones share the cache");
}

#[tokio::test]
async fn an_unreachable_models_listing_is_unknown_not_an_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let client = UpstreamClient::new(UpstreamConfig {
        base_url: format!("http://{addr}/v1").into(),
        api_key: None,
        timeout: Duration::from_secs(2),
        windows_override: parse_model_windows("pinned=5000").unwrap(),
    })
    .unwrap();
    assert_eq!(client.context_window("mock").await, None);
    assert_eq!(client.context_window("pinned").await, Some(5_000));
    let error = client.stream(&chat("hi")).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, UpstreamError::Connect(_)), "{error:?}");
}

#[tokio::test]
async fn images_are_resolved_when_the_request_is_built() {
    let mock = spawn(MockConfig::default()).await.unwrap();
    let resolver: ImageResolver =
        Arc::new(|id: &str, mime: &str| (id == "img-1").then(|| format!("data:{mime};base64,iVBORw0KGgo=")));
    let client = client_with(&mock, TIMEOUT, HashMap::new()).with_image_resolver(resolver);
    let message = ChatMessage::new(
        Role::User,
        Content::Parts(vec![
            ContentPart::Text { text: "What is in these?".into() },
            ContentPart::ImageRef { id: "img-1".into(), mime: "image/png".into(), width: None, height: None },
            ContentPart::ImageRef { id: "img-2".into(), mime: "image/png".into(), width: None, height: None },
        ]),
    );
    let request = ChatRequest { model: "mock".into(), messages: vec![message], ..Default::default() };
    assert_eq!(collect(&client, &request).await.unwrap().end, None);
    let body = &mock.log().entries()[0].body;
    let parts = &body["messages"][0]["content"];
    assert_eq!(parts[1]["image_url"]["url"], "data:image/png;base64,iVBORw0KGgo=");
    assert_eq!(parts[2]["type"], "text");
}

#[tokio::test]
async fn the_request_log_is_served_over_http() {
    let (mock, client) = setup().await;
    collect(&client, &chat("logged")).await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("http://{}/mock/requests", mock.addr());
    let log: Vec<Value> = http.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0]["path"], "/v1/chat/completions");
    assert_eq!(log[0]["body"]["messages"][1]["content"], "logged");
    assert!(log[0]["prompt_tokens"].as_u64().unwrap() > 0);
    assert_eq!(http.delete(&url).send().await.unwrap().status(), 204);
    assert!(mock.log().entries().is_empty());
}
