//! What turnlog adds to a streamed answer, beside calling the mock model directly: its own
//! work before the upstream call (lease, durable user message, compaction check, context
//! build), and the relay of each delta (the mock stamps each delta with its send time; the
//! relay is how much later it arrives through turnlog than directly), at 1 and 50
//! concurrent streams, and 50 turns deep into one session.

use std::time::{SystemTime, UNIX_EPOCH};

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use serde_json::json;

use turnlog_ingress::turn::TurnLimits;

use crate::system::{Settings, System};

const WORDS: usize = 40;
const DELAY_MS: u64 = 5;
/// Turns started together, all of one owner.
const CONCURRENT: usize = 50;
/// Bursts after the first, whose median p50 is `pre_upstream_p50_ms_50_warm`.
const WARM_BURSTS: usize = 3;
/// Turns a session has before the deep figures are taken.
const DEEP_HISTORY: usize = 50;
/// `TURNLOG_MAX_TURNS_PER_OWNER` for this bench: above [`CONCURRENT`], or the default cap
/// (8) would refuse most of them with 429.
const TURN_CAP_PER_OWNER: u32 = 64;

pub(crate) fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

pub(crate) fn p50(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

fn p99(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() * 99 / 100).copied().unwrap_or(f64::NAN)
}

/// Relay latency (ms) of each delta, calling the mock directly: arrival minus the send
/// time the mock stamped into it.
async fn direct(sys: &System, text: &str) -> anyhow::Result<Vec<f64>> {
    let body = json!({"model": "mock", "stream": true, "messages": [{"role": "user", "content": text}]});
    let resp = sys.http.post(format!("{}/chat/completions", sys.mock.base_url())).json(&body).send().await?;
    let mut events = resp.bytes_stream().eventsource();
    let mut latencies = Vec::new();
    while let Some(e) = events.next().await {
        let e = e?;
        let arrived = unix_us();
        if e.data == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(&e.data)?;
        if let Some(stamp) =
            chunk["choices"][0]["delta"]["content"].as_str().and_then(|c| c.trim().parse::<u64>().ok())
        {
            latencies.push(arrived.saturating_sub(stamp) as f64 / 1e3);
        }
    }
    Ok(latencies)
}

struct Through {
    /// From the POST to the mock receiving the model request.
    pre_upstream_ms: f64,
    /// Each delta's arrival at the client minus the mock's stamped send time.
    latencies_ms: Vec<f64>,
    first_delta_ms: f64,
}

/// One turn through turnlog.
async fn through(sys: &System, session: &str, text: &str) -> anyhow::Result<Through> {
    let url = format!("{}/v1/sessions/{session}/messages", sys.base);
    streamed(sys, &url, json!({ "text": text }), ("delta", "text"), text).await
}

/// One response through the OpenAI-compatible surface (`POST /v1/responses`, streamed, in
/// conversation `session`): the same figures as [`through`].
async fn through_responses(sys: &System, session: &str, text: &str) -> anyhow::Result<Through> {
    let url = format!("{}/v1/responses", sys.base);
    let body = json!({ "model": "mock", "input": text, "stream": true, "conversation": session });
    streamed(sys, &url, body, ("response.output_text.delta", "delta"), text).await
}

/// POSTs `body` to `url` and reads the event stream to its end: each `delta_event`'s
/// `stamp_field` is the mock's send time; the mock's log says when the model request came.
async fn streamed(
    sys: &System,
    url: &str,
    body: serde_json::Value,
    (delta_event, stamp_field): (&str, &str),
    text: &str,
) -> anyhow::Result<Through> {
    let sent_us = unix_us();
    let resp = sys.http.post(url).json(&body).send().await?;
    anyhow::ensure!(resp.status().is_success(), "{url} refused: {}", resp.status());
    let mut events = resp.bytes_stream().eventsource();
    let mut latencies = Vec::new();
    let mut first = None;
    while let Some(e) = events.next().await {
        let e = e?;
        let arrived = unix_us();
        if e.event == delta_event {
            first.get_or_insert(arrived);
            let data: serde_json::Value = serde_json::from_str(&e.data)?;
            if let Some(stamp) = data[stamp_field].as_str().and_then(|t| t.trim().parse::<u64>().ok()) {
                latencies.push(arrived.saturating_sub(stamp) as f64 / 1e3);
            }
        }
    }
    let received_us = upstream_received(sys, text)?;
    Ok(Through {
        pre_upstream_ms: received_us.saturating_sub(sent_us) as f64 / 1e3,
        latencies_ms: latencies,
        first_delta_ms: first.unwrap_or(sent_us).saturating_sub(sent_us) as f64 / 1e3,
    })
}

/// Turns through Chat Completions (DESIGN §13) whose client resends a history of
/// `history` messages, in 20 session families: the first request brings most of the history
/// (appended, then answered); the second is the first this ingress copy compares with the
/// branch, so it reads the branch's log whole (`first_contact`); the third — the history
/// and a new question — is measured as a conversation that goes on (`going_on`): it hashes
/// the request and reads only what the branch gained since the second.
async fn chat_compat(sys: &System, history: usize, directive: &str) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let filler = "a message of the earlier conversation, long enough to be a real one, about plans and dates";
    let (mut first_contact, mut going_on) = (Vec::new(), Vec::new());
    for family in 0..20 {
        let sid = format!("compat-{history}-{family}-{}", unix_us());
        let mut messages: Vec<serde_json::Value> = (0..history - 4)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": format!("{i}: {filler}")})
            })
            .collect();
        for turn in 0..3 {
            let text = format!("compat {history} {family} {turn} {directive}");
            messages.push(json!({"role": "user", "content": text}));
            let (answer, ms) = chat_turn(sys, &sid, &messages, &text).await?;
            messages.push(json!({"role": "assistant", "content": answer}));
            match turn {
                1 => first_contact.push(ms),
                2 => going_on.push(ms),
                _ => {}
            }
        }
    }
    Ok((first_contact, going_on))
}

/// When the mock received the model request that carries `text`.
fn upstream_received(sys: &System, text: &str) -> anyhow::Result<u64> {
    sys.mock
        .log()
        .entries()
        .iter()
        .rev()
        .find(|r| r.body.to_string().contains(text))
        .map(|r| r.received_at_us)
        .ok_or_else(|| anyhow::anyhow!("the mock did not log the model request"))
}

/// One streamed chat completion in family `sid`: the answer's text, and the time from the
/// POST to the mock receiving the model request (ms).
async fn chat_turn(
    sys: &System,
    sid: &str,
    messages: &[serde_json::Value],
    text: &str,
) -> anyhow::Result<(String, f64)> {
    let body = json!({"model": "mock", "messages": messages, "stream": true});
    let sent_us = unix_us();
    let resp = sys
        .http
        .post(format!("{}/v1/chat/completions", sys.base))
        .header("X-Session-Id", sid)
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(resp.status().is_success(), "chat completion refused: {}", resp.status());
    let mut answer = String::new();
    let mut events = resp.bytes_stream().eventsource();
    while let Some(e) = events.next().await {
        let e = e?;
        if e.data == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(&e.data)?;
        answer.push_str(chunk["choices"][0]["delta"]["content"].as_str().unwrap_or_default());
    }
    let received_us = upstream_received(sys, text)?;
    Ok((answer, received_us.saturating_sub(sent_us) as f64 / 1e3))
}

fn pre_upstream(ts: &[Through]) -> Vec<f64> {
    ts.iter().map(|t| t.pre_upstream_ms).collect()
}

/// [`CONCURRENT`] turns started at once, each in a new session.
async fn burst(sys: &System, round: usize, directive: &str) -> anyhow::Result<Vec<Through>> {
    let mut sessions = Vec::new();
    for _ in 0..CONCURRENT {
        sessions.push(sys.create_session().await?);
    }
    let runs = sessions.iter().enumerate().map(|(i, s)| {
        let text = format!("fifty {round} {i} {directive}");
        async move { through(sys, s, &text).await }
    });
    futures::future::join_all(runs).await.into_iter().collect()
}

pub(crate) async fn run(args: &[String]) -> anyhow::Result<()> {
    let cpu = crate::turn_cpu::figures().await?;
    if args.first().map(String::as_str) == Some("cpu") {
        println!("RESULT ingress_cpu {cpu}");
        return Ok(());
    }
    let sys = System::start(Settings {
        model: "mock",
        windows: vec![],
        system_prompt: "You are terse.",
        turn_limits: TurnLimits { per_owner: TURN_CAP_PER_OWNER, ..TurnLimits::default() },
    })
    .await?;
    let directive = format!("[mock words={WORDS} delay_ms={DELAY_MS} stamp]");

    // Directly: how late each delta arrives when nothing sits between client and model.
    let mut direct_latency = Vec::new();
    for i in 0..30 {
        direct_latency.extend(direct(&sys, &format!("direct {i} {directive}")).await?);
    }
    let direct_relay = p50(direct_latency.clone());

    // One stream at a time, each a first turn (so its prompt is as small as the direct one).
    let mut single = Vec::new();
    for i in 0..40 {
        let session = sys.create_session().await?;
        single.push(through(&sys, &session, &format!("single {i} {directive}")).await?);
    }
    // The same through the OpenAI-compatible surface, each a conversation's first response.
    let mut responses = Vec::new();
    for i in 0..40 {
        let session = sys.create_session().await?;
        responses.push(through_responses(&sys, &session, &format!("responses {i} {directive}")).await?);
    }
    // Fifty at once, each in its own session: the first burst meets cold connection pools
    // (the client's, the ingress's to Postgres and to the model); then three more.
    let fifty = burst(&sys, 0, &directive).await?;
    let mut warm = Vec::new();
    for round in 1..=WARM_BURSTS {
        warm.push(p50(pre_upstream(&burst(&sys, round, &directive).await?)));
    }
    // Deep in a conversation: turns 51 to 70 of one session, whose history the context
    // build and the compaction check read every turn.
    let deep_session = sys.create_session().await?;
    for i in 0..DEEP_HISTORY {
        through(&sys, &deep_session, &format!("history {i} [mock words=40]")).await?;
    }
    let mut deep = Vec::new();
    for i in 0..20 {
        deep.push(through(&sys, &deep_session, &format!("deep {i} {directive}")).await?);
    }
    // Chat Completions resending a 20- and a 200-message history.
    let (compat_first, compat) = chat_compat(&sys, 20, &directive).await?;
    let (compat_first_200, compat_200) = chat_compat(&sys, 200, &directive).await?;
    let durable = u8::from(sys.env.durable().await?);

    // turnlog's relay: how much later a delta arrives through turnlog than directly.
    let relay = |ts: &[Through]| {
        ts.iter().flat_map(|t| t.latencies_ms.iter().map(|l| l - direct_relay)).collect::<Vec<_>>()
    };
    let first = |ts: &[Through]| ts.iter().map(|t| t.first_delta_ms).collect::<Vec<_>>();
    println!("mock directly: delta transit p50 {direct_relay:.3} ms ({WORDS} deltas {DELAY_MS} ms apart)");
    println!("{CONCURRENT} streams of one owner; per-owner turn cap (TURNLOG_MAX_TURNS_PER_OWNER) {TURN_CAP_PER_OWNER}");
    let warm = p50(warm);
    for (name, ts) in
        [("1 stream", &single), ("responses", &responses), ("50 streams", &fifty), ("turn 51+", &deep)]
    {
        println!(
            "{name:>10}: before the upstream call p50 {:.2} ms p99 {:.2} ms; relay added per delta p50 {:.3} ms p99 {:.3} ms; first delta p50 {:.2} ms",
            p50(pre_upstream(ts)), p99(pre_upstream(ts)), p50(relay(ts)), p99(relay(ts)), p50(first(ts))
        );
    }
    let (compat, compat_200) = (p50(compat), p50(compat_200));
    let (contact, contact_200) = (p50(compat_first), p50(compat_first_200));
    println!(
        "chat completions, the client resending 20 / 200 messages: before the upstream call p50 {compat:.2} / {compat_200:.2} ms ({:.2}x); \
         the first request a copy compares with the branch {contact:.2} / {contact_200:.2} ms",
        compat_200 / compat
    );
    println!("50 streams again ({WARM_BURSTS} bursts, warm pools): before the upstream call, median of their p50s {warm:.2} ms");
    if durable == 0 {
        println!("WARNING: commits are not durable on this server (RESULT says durable=0); set DATABASE_URL to a durable one");
    }
    println!(
        "RESULT ingress pre_upstream_p50_ms={:.2} pre_upstream_p99_ms={:.2} relay_p50_ms={:.3} relay_p99_ms={:.3} \
         relay_p50_ms_50={:.3} relay_p99_ms_50={:.3} pre_upstream_p50_ms_50={:.2} pre_upstream_p99_ms_50={:.2} \
         pre_upstream_p50_ms_deep={:.2} pre_upstream_p99_ms_deep={:.2} first_delta_p50_ms={:.2} \
         first_delta_p50_ms_50={:.2} pre_upstream_p50_ms_50_warm={warm:.2} responses_pre_upstream_p50_ms={:.2} \
         responses_relay_p50_ms={:.3} chat_compat_pre_upstream_p50_ms={compat:.2} \
         chat_compat_pre_upstream_p50_ms_200={compat_200:.2} chat_compat_first_contact_p50_ms={contact:.2} \
         chat_compat_first_contact_p50_ms_200={contact_200:.2} turn_cap_per_owner={TURN_CAP_PER_OWNER} durable={durable} {cpu}",
        p50(pre_upstream(&single)), p99(pre_upstream(&single)), p50(relay(&single)), p99(relay(&single)),
        p50(relay(&fifty)), p99(relay(&fifty)), p50(pre_upstream(&fifty)), p99(pre_upstream(&fifty)),
        p50(pre_upstream(&deep)), p99(pre_upstream(&deep)), p50(first(&single)), p50(first(&fifty)),
        p50(pre_upstream(&responses)), p50(relay(&responses)),
    );
    sys.stop().await?;
    Ok(())
}
