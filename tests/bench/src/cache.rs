//! How much of the input the provider's prompt cache serves: a scripted 120-turn
//! conversation (each user message ~100 tokens, each answer 250 words) under a
//! 20,000-token budget, through turnlog (stable prefix, compaction when over budget) and
//! the same conversation sent by a sliding window (drop the oldest messages to fit).

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use serde_json::{json, Value};
use turnlog_core::message::{ChatMessage, Role};
use turnlog_core::tokens::request_tokens;
use turnlog_ingress::turn::TurnLimits;

use crate::system::{Settings, System};

const TURNS: usize = 120;
const ANSWER_WORDS: usize = 250;
const BUDGET: u32 = 20_000;
/// A window whose 60% is the budget.
const WINDOW: u32 = BUDGET * 100 / 60 + 1;
const SYSTEM: &str = "You are a careful assistant. Keep names, dates and numbers straight.";

fn user_text(turn: usize) -> String {
    let filler = "we went through the plan once more and agreed on the next small steps for the team";
    format!("Turn {turn}: {filler}, {filler}, {filler}, {filler}. What should we do next? [mock words={ANSWER_WORDS}]")
}

/// Cached share of the input tokens of the chat requests to `model`.
fn cached_share(sys: &System, model: &str) -> (f64, usize) {
    let (mut prompt, mut cached, mut n) = (0u64, 0u64, 0);
    for r in sys.mock.log().entries() {
        if r.path.ends_with("/chat/completions") && r.body["model"] == model {
            prompt += u64::from(r.prompt_tokens);
            cached += u64::from(r.cached_tokens);
            n += 1;
        }
    }
    (cached as f64 / prompt.max(1) as f64, n)
}

async fn answer_of(resp: reqwest::Response) -> anyhow::Result<String> {
    let mut text = String::new();
    let mut events = resp.bytes_stream().eventsource();
    while let Some(e) = events.next().await {
        let e = e?;
        let data: Value = serde_json::from_str(&e.data)?;
        match e.event.as_str() {
            "delta" => text.push_str(data["text"].as_str().unwrap_or_default()),
            "end" => anyhow::ensure!(data["status"] == "completed", "turn did not complete: {data}"),
            _ => {}
        }
    }
    Ok(text)
}

pub(crate) async fn run() -> anyhow::Result<()> {
    // Through turnlog.
    let sys = System::start(Settings {
        model: "mock",
        windows: vec![("mock", WINDOW)],
        system_prompt: SYSTEM,
        turn_limits: TurnLimits::default(),
    })
    .await?;
    let session = sys.create_session().await?;
    for turn in 1..=TURNS {
        let resp = sys
            .http
            .post(format!("{}/v1/sessions/{session}/messages", sys.base))
            .json(&json!({ "text": user_text(turn) }))
            .send()
            .await?;
        answer_of(resp).await?;
    }
    let (turnlog_cached, requests) = cached_share(&sys, "mock");
    let compactions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM session_events WHERE kind = 'compaction_applied'")
            .fetch_one(&sys.env.pool)
            .await?;
    let max_prompt =
        sys.mock.log().entries().iter().filter(|r| r.body["model"] == "mock").map(|r| r.prompt_tokens).max();
    sys.stop().await?;

    // The same conversation by a sliding window, straight to a fresh mock.
    let sys = System::start(Settings {
        model: "mock",
        windows: vec![],
        system_prompt: SYSTEM,
        turn_limits: TurnLimits::default(),
    })
    .await?;
    let mut history: Vec<ChatMessage> = Vec::new();
    for turn in 1..=TURNS {
        history.push(ChatMessage::text(Role::User, user_text(turn)));
        let system = ChatMessage::text(Role::System, SYSTEM);
        while request_tokens(std::iter::once(&system).chain(&history)) > BUDGET && history.len() > 1 {
            history.remove(0);
        }
        let messages: Vec<Value> = std::iter::once(&system)
            .chain(&history)
            .map(|m| json!({"role": m.role, "content": m.texts().collect::<String>()}))
            .collect();
        let body = json!({"model": "mock", "messages": messages, "stream": false});
        let r: Value = sys
            .http
            .post(format!("{}/chat/completions", sys.mock.base_url()))
            .json(&body)
            .send()
            .await?
            .json()
            .await?;
        let answer = r["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned();
        history.push(ChatMessage::text(Role::Assistant, answer));
    }
    let (sliding_cached, _) = cached_share(&sys, "mock");
    sys.stop().await?;

    println!("{TURNS} turns, budget {BUDGET} tokens, {ANSWER_WORDS}-word answers; {requests} model requests through turnlog, largest {max_prompt:?} tokens");
    println!("cached share of input tokens: turnlog {turnlog_cached:.3} ({compactions} compactions), sliding window {sliding_cached:.3}");
    println!("RESULT cache turnlog_cached={turnlog_cached:.3} sliding_cached={sliding_cached:.3} compactions={compactions}");
    Ok(())
}
