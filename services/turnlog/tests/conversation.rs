//! A long conversation through HTTP with every service running (in-process here): with a
//! model whose window gives a ~4,000-token budget, every request the model receives stays
//! within budget, the compactor compacts several times, and a name and a number from the
//! first turn still reach the model at the last.

use std::time::Duration;

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use turnlog_core::budget::budget_for;
use turnlog_ingress::IngressConfig;
use turnlog_mock_llm::MockConfig;
use turnlog_runtime::upstream::UpstreamConfig;
use turnlog_runtime::worker::ConsumerSettings;
use turnlog_testkit::{eventually, test_env};

const TURNS: usize = 120;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_conversation_stays_within_budget_and_keeps_turn_one_facts() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let stop = CancellationToken::new();
    let upstream = UpstreamConfig {
        base_url: mock.base_url().into(),
        api_key: None,
        timeout: Duration::from_secs(10),
        windows_override: Default::default(),
    };
    let consumer = ConsumerSettings {
        ack_wait: Duration::from_secs(5),
        retry_backoff: vec![Duration::from_millis(200)],
        ..Default::default()
    };
    let writer = turnlog_writer::WriterConfig { backbone: env.backbone() };
    tokio::spawn(turnlog_writer::run(writer, stop.clone()));
    let compactor = turnlog_compactor::CompactorConfig {
        backbone: env.backbone(),
        upstream: upstream.clone(),
        model: "mock-small".into(),
        summary_model: "mock".into(),
        context_budget: 60_000,
        consumer: consumer.clone(),
        facts_wait: Duration::from_secs(2),
        summary_deadline: Duration::from_secs(10),
        append_timeout: Duration::from_secs(10),
    };
    tokio::spawn(turnlog_compactor::run(compactor, stop.clone()));
    let memory = turnlog_memory::MemoryConfig {
        backbone: env.backbone(),
        upstream: upstream.clone(),
        mini_model: "mock".into(),
        consumer,
        call_deadline: Duration::from_secs(10),
        append_timeout: Duration::from_secs(10),
    };
    tokio::spawn(turnlog_memory::run(memory, stop.clone()));

    let mut config = IngressConfig::new(env.backbone());
    config.upstream = Some(upstream);
    config.model = "mock-small".into();
    config.system_prompt = "You are a helpful assistant.".into();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(turnlog_ingress::run(config, listener, stop.clone()));
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(30), || async {
        http.get(format!("{base}/readyz")).send().await.ok()?.status().is_success().then_some(())
    })
    .await;

    let budget = budget_for(Some(6_700), 60_000);
    let session: Value =
        http.post(format!("{base}/v1/sessions")).json(&json!({})).send().await.unwrap().json().await.unwrap();
    let id = session["id"].as_str().unwrap().to_owned();
    for turn in 1..=TURNS {
        let text = if turn == 1 {
            "My name is Zanzibar Quill and my locker code is 48213. [mock words=60]".to_owned()
        } else {
            format!("we talked about the weather and other small things again, turn {turn} [mock words=60]")
        };
        let resp = http
            .post(format!("{base}/v1/sessions/{id}/messages"))
            .json(&json!({ "text": text }))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "turn {turn}");
        let events: Vec<_> = resp.bytes_stream().eventsource().collect().await;
        let end = events.last().unwrap().as_ref().unwrap();
        assert_eq!(end.event, "end");
        let end: Value = serde_json::from_str(&end.data).unwrap();
        assert_eq!(end["status"], "completed", "turn {turn}: {end}");
    }

    let chats: Vec<_> = mock
        .log()
        .entries()
        .into_iter()
        .filter(|r| r.path.ends_with("/chat/completions") && r.body["model"] == "mock-small")
        .collect();
    assert_eq!(chats.len(), TURNS);
    for (i, r) in chats.iter().enumerate() {
        assert!(
            r.prompt_tokens <= budget,
            "request {} is {} tokens; budget {budget}",
            i + 1,
            r.prompt_tokens
        );
    }
    let compactions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM session_events WHERE kind = 'compaction_applied'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert!(compactions >= 3, "several compactions, got {compactions}");
    let last = chats.last().unwrap().body.to_string();
    assert!(
        last.contains("Zanzibar Quill") && last.contains("48213"),
        "turn-1 facts did not reach the model at turn {TURNS}"
    );
    stop.cancel();
}
