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
use turnlog_e2e::rig::settle;
use turnlog_mock_llm::MockConfig;
use turnlog_runtime::bus::Bus;
use turnlog_testkit::test_env;

/// Two ingress copies (each with the whole stack) on one database and bus, chatting with
/// the mock model.
async fn two_copies() -> (turnlog_mock_llm::MockHandle, turnlog_dev::Stack, turnlog_dev::Stack) {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let copy = || async {
        let upstream = config::upstream_at(&mock.base_url());
        turnlog_e2e::serve(config::chat_stack(&env, upstream, "mock"), Duration::from_secs(30)).await.unwrap()
    };
    let (a, b) = (copy().await, copy().await);
    (mock, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_running_on_one_copy_is_retrieved_and_cancelled_through_another() {
    let (_mock, a, b) = two_copies().await;
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

/// A response re-attached from another copy reads to its end exactly as its own stream:
/// the same events with the same `sequence_number`s and deltas, then its terminal event
/// and `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_reattached_on_another_copy_streams_the_same_events_to_its_end() {
    let (_mock, a, b) = two_copies().await;
    let http = reqwest::Client::new();
    /// (event, sequence_number, delta) of every event before `[DONE]`, and whether
    /// `[DONE]` ended them.
    fn shown(events: Vec<eventsource_stream::Event>) -> (Vec<(String, u64, String)>, bool) {
        let mut out = Vec::new();
        for e in events {
            if e.data == "[DONE]" {
                return (out, true);
            }
            let data: Value = serde_json::from_str(&e.data).unwrap();
            let delta = data["delta"].as_str().unwrap_or_default().to_owned();
            out.push((e.event, data["sequence_number"].as_u64().unwrap(), delta));
        }
        (out, false)
    }
    async fn all(resp: reqwest::Response) -> Vec<eventsource_stream::Event> {
        resp.bytes_stream().eventsource().map(|e| e.unwrap()).collect().await
    }

    let body = json!({"model": "mock", "input": "A story. [mock words=150 delay_ms=10]", "stream": true});
    let resp = http.post(format!("{}/v1/responses", a.base_url())).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut events = resp.bytes_stream().eventsource().map(|e| e.unwrap());
    let first = events.next().await.unwrap();
    assert_eq!(first.event, "response.created");
    let created: Value = serde_json::from_str(&first.data).unwrap();
    let id = created["response"]["id"].as_str().unwrap().to_owned();
    // Copy B re-attaches from the start while A's stream goes on; both read to the end.
    let replay = async {
        all(http.get(format!("{}/v1/responses/{id}?stream=true", b.base_url())).send().await.unwrap()).await
    };
    let (replayed, rest) = tokio::join!(replay, events.collect::<Vec<_>>());
    let (original, done) = shown(std::iter::once(first).chain(rest).collect());
    let (replayed, replay_done) = shown(replayed);
    assert!(done && replay_done, "both streams end with [DONE]");
    assert_eq!(original.last().map(|e| e.0.as_str()), Some("response.completed"));
    let deltas = original.iter().filter(|e| e.0 == "response.output_text.delta").count();
    assert!(deltas >= 100, "{deltas} deltas");
    assert_eq!(replayed, original, "the re-attached stream differs from the original");

    b.stop().await.unwrap();
    a.stop().await.unwrap();
}

/// One `POST /v1/chat/completions`: the branch the response names (None when passed
/// through) and the answer's text, streamed or not.
async fn chat_completion(
    http: &reqwest::Client,
    base: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> (Option<String>, String) {
    let mut req = http.post(format!("{base}/v1/chat/completions")).json(body);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let resp = req.send().await.unwrap();
    if resp.status() != 200 {
        panic!("{}: {}", resp.status(), resp.text().await.unwrap_or_default());
    }
    let branch = resp.headers().get("x-session-id").map(|v| v.to_str().unwrap().to_owned());
    if body["stream"] != true {
        let done: Value = resp.json().await.unwrap();
        return (branch, done["choices"][0]["message"]["content"].as_str().unwrap().to_owned());
    }
    let mut text = String::new();
    let mut events = resp.bytes_stream().eventsource();
    let mut finished = false;
    while let Some(e) = events.next().await {
        let e = e.unwrap();
        if e.data == "[DONE]" {
            finished = true;
            break;
        }
        let chunk: Value = serde_json::from_str(&e.data).unwrap();
        assert!(chunk.get("error").is_none(), "{chunk}");
        text.push_str(chunk["choices"][0]["delta"]["content"].as_str().unwrap_or_default());
    }
    assert!(finished, "the stream ended without [DONE]");
    (branch, text)
}

/// The user and assistant events of a branch log, as (session the event belongs to, kind, text).
async fn conversation_of(http: &reqwest::Client, base: &str, branch: &str) -> Vec<(String, String, String)> {
    let page: Value = http
        .get(format!("{base}/v1/sessions/{branch}/events?limit=1000"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    page["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "user_message" || e["kind"] == "assistant_turn")
        .map(|e| {
            let text = e["payload"]["text"].as_str().or(e["payload"]["ui"]["blocks"][0]["text"].as_str());
            let kind = e["kind"].as_str().unwrap().to_owned();
            (e["session_id"].as_str().unwrap().to_owned(), kind, text.unwrap_or_default().to_owned())
        })
        .collect()
}

/// Open WebUI 0.6.43's title task prompt (`DEFAULT_TITLE_GENERATION_PROMPT_TEMPLATE`, its
/// `{{MESSAGES:END:2}}` filled in as `utils/task.py` does), abridged in the middle.
fn title_task(history: &str) -> String {
    format!(
        "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n### Guidelines:\n\
         - The title should clearly represent the main theme or subject of the conversation.\n### Output:\n\
         JSON format: {{ \"title\": \"your concise title here\" }}\n### Chat History:\n<chat_history>\n{history}\n</chat_history>"
    )
}

/// Open WebUI 0.6.43's tags task prompt (`DEFAULT_TAGS_GENERATION_PROMPT_TEMPLATE`), abridged.
fn tags_task(history: &str) -> String {
    format!(
        "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history, along with 1-3 more \
         specific subtopic tags.\n\n### Output:\nJSON format: {{ \"tags\": [\"tag1\", \"tag2\", \"tag3\"] }}\n\n\
         ### Chat History:\n<chat_history>\n{history}\n</chat_history>"
    )
}

/// Open WebUI's wire behaviour (0.6.43, read from its code: `routers/openai.py`,
/// `routers/tasks.py`, `Chat.svelte`) replayed against turnlog: with
/// `ENABLE_FORWARD_USER_INFO_HEADERS=true` every request carries its user headers and
/// `X-OpenWebUI-Chat-Id`; a send resends the chat's active branch (system message first,
/// answers with their reasoning `<details>` stripped, so they start with a newline); the
/// title, tags and follow-up tasks are one-message prompts, not streamed, with the same chat
/// id; regenerate sends the history through the question; an edit sends the history
/// before the edited message and its new text. Expected: one session family whose
/// branches are exactly the chat's branches, and task calls that store nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_webui_sends_regenerates_edits_and_task_calls_map_onto_one_family() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let stack = turnlog_e2e::serve(
        config::chat_stack(&env, config::upstream_at(&mock.base_url()), "mock"),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let base = stack.base_url().to_owned();
    let http = reqwest::Client::new();
    let chat_id = uuid::Uuid::new_v4().to_string();
    let headers = [
        ("X-OpenWebUI-User-Name", "Ada Lovelace"),
        ("X-OpenWebUI-User-Id", "8e3c1a52-0d7b-4c4e-9a55-1f0f0b4c2d11"),
        ("X-OpenWebUI-User-Email", "ada@example.com"),
        ("X-OpenWebUI-User-Role", "user"),
        ("X-OpenWebUI-Chat-Id", chat_id.as_str()),
    ];
    let system = json!({"role": "system", "content": "You are a helpful assistant. Today is 2026-12-01."});
    let send = |messages: Vec<Value>| json!({"stream": true, "model": "mock", "messages": messages});
    let task = |prompt: String, max_tokens: Option<u32>| {
        let mut body =
            json!({"model": "mock", "messages": [{"role": "user", "content": prompt}], "stream": false});
        if let Some(m) = max_tokens {
            body["max_tokens"] = json!(m);
        }
        body
    };
    let user = |text: &str| json!({"role": "user", "content": text});
    // What Open WebUI resends of an answer that streamed reasoning: the text after the
    // stripped `<details type="reasoning">` block, starting with a newline.
    let answer = |text: &str| json!({"role": "assistant", "content": format!("\n{text}")});

    // (a) The first message of a new chat, then its background tasks.
    let q1 = "Plan a weekend in Lisbon. [mock words=12 reasoning=2]";
    let (root, a1) = chat_completion(&http, &base, &headers, &send(vec![system.clone(), user(q1)])).await;
    let root = root.unwrap();
    let history = format!("USER: {q1}\nASSISTANT: {a1}");
    for body in [task(title_task(&history), Some(1000)), task(tags_task(&history), None)] {
        let (passed, text) = chat_completion(&http, &base, &headers, &body).await;
        assert_eq!(passed, None, "a task call is passed through");
        assert!(!text.is_empty());
    }

    // (b) A follow-up resends the whole branch.
    let q2 = "And where should we eat? [mock words=12]";
    let turn2 = vec![system.clone(), user(q1), answer(&a1), user(q2)];
    let (same, a2) = chat_completion(&http, &base, &headers, &send(turn2.clone())).await;
    assert_eq!(same.as_deref(), Some(root.as_str()));
    let follow_ups = format!("### Task:\nSuggest 3-5 relevant follow-up questions...\n<chat_history>\n{history}\nUSER: {q2}\nASSISTANT: {a2}\n</chat_history>");
    assert_eq!(chat_completion(&http, &base, &headers, &task(follow_ups, None)).await.0, None);
    let stored = conversation_of(&http, &base, &root).await;
    assert_eq!(stored.len(), 4, "{stored:?}");
    assert_eq!(stored[3].2, a2);

    // (c) Regenerate the last answer: the history through its question.
    let (regenerated, _) = chat_completion(&http, &base, &headers, &send(turn2.clone())).await;
    let regenerated = regenerated.unwrap();
    assert_ne!(regenerated, root);
    let fork = conversation_of(&http, &base, &regenerated).await;
    assert_eq!(fork.len(), 4);
    assert_eq!(
        fork.iter().filter(|e| e.0 == regenerated).map(|e| e.1.as_str()).collect::<Vec<_>>(),
        ["assistant_turn"]
    );

    // (d) Edit the first message and send: the history before it and the new text.
    let edited = "Plan a weekend in Porto instead. [mock words=12]";
    let (edit, e1) = chat_completion(&http, &base, &headers, &send(vec![system.clone(), user(edited)])).await;
    let edit = edit.unwrap();
    assert!(edit != root && edit != regenerated);
    let (on_edit, _) = chat_completion(
        &http,
        &base,
        &headers,
        &send(vec![system.clone(), user(edited), answer(&e1), user("Thanks! [mock words=5]")]),
    )
    .await;
    assert_eq!(on_edit.as_deref(), Some(edit.as_str()));

    // Back on the first branch in the UI: going on there continues the first session.
    let mut back = turn2.clone();
    back.extend([answer(&a2), user("One more tip? [mock words=5]")]);
    let (again, a3) = chat_completion(&http, &base, &headers, &send(back.clone())).await;
    assert_eq!(again.as_deref(), Some(root.as_str()));
    assert_eq!(conversation_of(&http, &base, &root).await.len(), 6);

    // A question with an attached file: Open WebUI sends it with the retrieved context
    // before it (`RAG_TEMPLATE`, a line break, the question), and keeps the bare question in
    // its history — so the next request resends that, and still goes on in the same branch.
    let question = "What does the guide say about trams? [mock words=5]";
    let with_context = format!(
        "### Task:\nRespond to the user query using the provided context, incorporating inline citations \
         in the format [id] **only when the <source> tag includes an explicit id attribute**.\n\n\
         <context>\n<source id=\"1\" name=\"lisbon.pdf\">Tram 28 runs from Martim Moniz.</source>\n</context>\n\
         \n{question}"
    );
    back.extend([answer(&a3), user(&with_context)]);
    let (rag, a4) = chat_completion(&http, &base, &headers, &send(back.clone())).await;
    assert_eq!(rag.as_deref(), Some(root.as_str()));
    let last = back.len() - 1;
    back[last] = user(question);
    back.extend([answer(&a4), user("And the castle? [mock words=5]")]);
    let (after, _) = chat_completion(&http, &base, &headers, &send(back)).await;
    assert_eq!(after.as_deref(), Some(root.as_str()));
    assert_eq!(conversation_of(&http, &base, &root).await.len(), 10);

    // The family is exactly the chat's three branches, each message stored once.
    let detail: Value =
        http.get(format!("{base}/v1/sessions/{root}")).send().await.unwrap().json().await.unwrap();
    let mut forks: Vec<&str> =
        detail["forks"].as_array().unwrap().iter().map(|f| f["id"].as_str().unwrap()).collect();
    forks.sort_unstable();
    let mut expected = vec![regenerated.as_str(), edit.as_str()];
    expected.sort_unstable();
    assert_eq!(forks, expected);
    let listed: Value = http.get(format!("{base}/v1/sessions")).send().await.unwrap().json().await.unwrap();
    assert_eq!(listed["sessions"].as_array().unwrap().len(), 3, "{listed}");

    stack.stop().await.unwrap();
}

/// Prefix stability through the facade (DESIGN §13): the same 30-turn conversation, with
/// compactions, sent natively and as Chat Completions that resend their whole history. The
/// compactor settles after every turn, so both conversations compact after the same turns
/// (asserted); then each Chat Completions request is as long as the native request of the
/// same turn and gets as much of it from the mock's prompt cache (the two system prompts
/// are as long; nothing else differs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_keep_the_prompt_cache_hitting_like_the_native_api() {
    const TURNS: usize = 30;
    let env = test_env().await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, env.partitions).await.unwrap();
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let mut configs = config::chat_stack(&env, config::upstream_at(&mock.base_url()), "mock-small");
    // The two conversations differ only in their system prompts, so neither's prefixes
    // are cached by the other's requests.
    let native_system = "Conversation one. You are a helpful assistant.";
    let compat_system = "Conversation two. You are a helpful assistant.";
    configs.ingress.system_prompt = native_system.into();
    if let Some(compactor) = configs.compactor_mut() {
        compactor.summary_model = "mock".into();
    }
    let stack = turnlog_e2e::serve(configs, Duration::from_secs(30)).await.unwrap();
    let base = stack.base_url().to_owned();
    let http = reqwest::Client::new();
    let question = |turn: usize| {
        format!("Turn {turn}: we went over the plan again and agreed on the next steps. What now? [mock words=150]")
    };

    let session: Value =
        http.post(format!("{base}/v1/sessions")).json(&json!({})).send().await.unwrap().json().await.unwrap();
    let native = session["id"].as_str().unwrap().to_owned();
    for turn in 1..=TURNS {
        let resp = http
            .post(format!("{base}/v1/sessions/{native}/messages"))
            .json(&json!({"text": question(turn)}))
            .send()
            .await
            .unwrap();
        let mut events = resp.bytes_stream().eventsource();
        while let Some(e) = events.next().await {
            let e = e.unwrap();
            if e.event == "end" {
                assert_eq!(serde_json::from_str::<Value>(&e.data).unwrap()["status"], "completed");
            }
        }
        settle(&env, &bus, &["compactor"]).await;
    }

    let sid = [("X-Session-Id", "prefix-stability")];
    let mut messages = vec![json!({"role": "system", "content": compat_system})];
    let mut compat = String::new();
    for turn in 1..=TURNS {
        messages.push(json!({"role": "user", "content": question(turn)}));
        let body = json!({"model": "mock-small", "messages": messages, "stream": turn % 2 == 0});
        let (branch, text) = chat_completion(&http, &base, &sid, &body).await;
        compat = branch.unwrap();
        messages.push(json!({"role": "assistant", "content": text}));
        settle(&env, &bus, &["compactor"]).await;
    }

    // The turns each conversation's compactions followed (its user messages before each).
    let compacted_after = |session: String| {
        let pool = env.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT (SELECT count(*) FROM session_events u
                          WHERE u.session_id = c.session_id AND u.kind = 'user_message' AND u.seq < c.seq)
                   FROM session_events c
                  WHERE c.session_id = $1::uuid AND c.kind = 'compaction_applied' ORDER BY c.seq",
            )
            .bind(session)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    let native_compactions = compacted_after(native).await;
    assert!(native_compactions.len() >= 2, "compacted after turns {native_compactions:?}");
    assert_eq!(compacted_after(compat).await, native_compactions, "both compact after the same turns");
    let requests = |system: &str| -> Vec<(u32, u32)> {
        let turns: Vec<(u32, u32)> = mock
            .log()
            .entries()
            .into_iter()
            .filter(|r| r.body["model"] == "mock-small" && r.body["messages"][0]["content"] == system)
            .map(|r| (r.prompt_tokens, r.cached_tokens))
            .collect();
        assert_eq!(turns.len(), TURNS, "one upstream request per turn");
        turns
    };
    let (a, b) = (requests(native_system), requests(compat_system));
    let share = |turns: &[(u32, u32)]| {
        let (prompt, cached) =
            turns.iter().fold((0u64, 0u64), |(p, c), t| (p + u64::from(t.0), c + u64::from(t.1)));
        cached as f64 / prompt.max(1) as f64
    };
    println!(
        "cached share: native {:.3}, chat completions {:.3} (compacted after turns {native_compactions:?})",
        share(&a),
        share(&b)
    );
    assert!(share(&a) > 0.3, "the native conversation's prefix is cached ({:.3})", share(&a));
    for (turn, (native, compat)) in a.iter().zip(&b).enumerate() {
        assert_eq!(native, compat, "turn {}: (prompt, cached) tokens, native vs chat completions", turn + 1);
    }

    stack.stop().await.unwrap();
}

/// Body limits on the OpenAI-compatible routes: 1 MiB, except Chat Completions (a front end
/// resends its whole conversation: 16 MiB); a larger body is OpenAI's error shape (413).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_conversation_fits_and_an_oversized_body_is_an_openai_413() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    // A window the long history fits in whole (no compaction to wait for).
    let mut upstream = config::upstream_at(&mock.base_url());
    upstream.windows_override.insert("mock".into(), 2_000_000);
    let stack = turnlog_e2e::serve(config::chat_stack(&env, upstream, "mock"), Duration::from_secs(30))
        .await
        .unwrap();
    let base = stack.base_url().to_owned();
    let http = reqwest::Client::new();
    let error_of = |resp: reqwest::Response| async move {
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap();
        (status, body["error"]["type"].as_str().map(str::to_owned))
    };

    // Over two MiB of history: twelve long messages and a question.
    let long = "internationalization ".repeat(9_000);
    let mut messages: Vec<Value> = (0..12)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("{i} {long}")}))
        .collect();
    messages.push(json!({"role": "user", "content": "So? [mock words=3]"}));
    let body = json!({"model": "mock", "messages": messages});
    let (branch, text) = chat_completion(&http, &base, &[("X-Session-Id", "long")], &body).await;
    assert!(branch.is_some() && !text.is_empty());

    let huge = json!({"model": "mock", "messages": [{"role": "user", "content": "x".repeat(17 << 20)}]});
    let resp = http.post(format!("{base}/v1/chat/completions")).json(&huge).send().await.unwrap();
    assert_eq!(error_of(resp).await, (413, Some("invalid_request_error".to_owned())));
    let big = json!({"model": "mock", "input": "x".repeat(2 << 20)});
    let resp = http.post(format!("{base}/v1/responses")).json(&big).send().await.unwrap();
    assert_eq!(error_of(resp).await, (413, Some("invalid_request_error".to_owned())));

    stack.stop().await.unwrap();
}
