//! A long conversation through HTTP with every service running (in-process here): with a
//! model whose window gives a ~4,000-token budget, every request the model receives stays
//! within budget, the compactor compacts several times, and a name and a number from the
//! first turn still reach the model at the last.

use std::time::Duration;

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use serde_json::{json, Value};
use turnlog_core::budget::budget_for;
use turnlog_dev::Worker;
use turnlog_e2e::config;
use turnlog_mock_llm::MockConfig;
use turnlog_runtime::worker::ConsumerSettings;
use turnlog_testkit::test_env;

const TURNS: usize = 120;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_conversation_stays_within_budget_and_keeps_turn_one_facts() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let consumer = ConsumerSettings {
        ack_wait: Duration::from_secs(5),
        retry_backoff: vec![Duration::from_millis(200)],
        ..Default::default()
    };
    let mut configs = config::chat_stack(&env, config::upstream_at(&mock.base_url()), "mock-small");
    configs.ingress.system_prompt = "You are a helpful assistant.".into();
    if let Some(compactor) = configs.compactor_mut() {
        compactor.summary_model = "mock".into();
        compactor.context_budget = 60_000;
        compactor.consumer = consumer.clone();
    }
    let memory = config::memory(&env, &mock.base_url());
    configs.workers.push(Worker::Memory(turnlog_memory::MemoryConfig {
        mini_model: "mock".into(),
        consumer,
        ..memory
    }));
    let stack = turnlog_e2e::serve(configs, Duration::from_secs(30)).await.unwrap();
    let base = stack.base_url().to_owned();
    let http = reqwest::Client::new();

    // Every pre-send check the ingress asks (a plain subscriber sees each request beside
    // the compactors' queue group).
    let nats = async_nats::connect(&env.nats_url).await.unwrap();
    let mut checks = nats.subscribe(format!("{}.compact.*", env.bus_prefix)).await.unwrap();
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = asked.clone();
    tokio::spawn(async move {
        while checks.next().await.is_some() {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });

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
    // A request the ingress counts within the budget does not wait for the compactor: it is
    // asked only for the turns whose request would be over (DESIGN §4's check, skipped
    // when its answer is known to be `not_needed`).
    let asked = asked.load(std::sync::atomic::Ordering::Relaxed);
    println!("{TURNS} turns, {compactions} compactions, {asked} pre-send checks");
    assert!(asked < TURNS / 4, "{asked} pre-send checks for {TURNS} turns");
    let last = chats.last().unwrap().body.to_string();
    assert!(
        last.contains("Zanzibar Quill") && last.contains("48213"),
        "turn-1 facts did not reach the model at turn {TURNS}"
    );
    stack.stop().await.unwrap();
}
