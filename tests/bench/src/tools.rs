//! A client-tool turn of ten model calls (DESIGN §14): turnlog's own time before each
//! step's upstream call — the first step's after the user's message, the others' after the
//! client's results — measured as `ingress`'s `pre_upstream` is (from the POST to the mock
//! receiving the model request), and the mock's prefix cache across the steps: each
//! step's request must extend the previous one's byte for byte (the turn's extras stay
//! where its first step put them), so the mock reports the whole previous request cached
//! (at its 128-token granularity, from 1,024 tokens).

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use serde_json::{json, Value};

use turnlog_ingress::turn::TurnLimits;

use crate::ingress::{p50, unix_us};
use crate::system::{Settings, System};

/// Tool turns measured, each in its own session.
const TURNS: usize = 6;
/// Model calls per turn: nine that ask for the tool, then the answer.
const STEPS: usize = 10;

/// The mock's cache step and threshold (its docs: a prefix at a 128-token step from 1,024).
fn cacheable(tokens: u64) -> u64 {
    if tokens < 1_024 {
        0
    } else {
        tokens / 128 * 128
    }
}

/// POSTs `body` to `path`, reads the turn's stream to its end; returns the `end` event's
/// data and the time from the POST to the mock receiving the turn's model request (ms).
async fn step(sys: &System, path: &str, body: Value) -> anyhow::Result<(Value, f64)> {
    let sent_us = unix_us();
    let resp = sys.http.post(format!("{}{path}", sys.base)).json(&body).send().await?;
    anyhow::ensure!(resp.status().is_success(), "{path} refused: {}", resp.status());
    let mut events = resp.bytes_stream().eventsource();
    let mut end = Value::Null;
    while let Some(e) = events.next().await {
        let e = e?;
        if e.event == "end" {
            end = serde_json::from_str(&e.data)?;
        }
    }
    // The step's request: the first chat request offering tools the mock got after the POST
    // (the workers' requests offer none).
    let received = sys
        .mock
        .log()
        .entries()
        .into_iter()
        .filter(|r| r.path.ends_with("/chat/completions") && r.body.get("tools").is_some())
        .find(|r| r.received_at_us >= sent_us)
        .map(|r| r.received_at_us)
        .ok_or_else(|| anyhow::anyhow!("the mock did not log the step's request"))?;
    Ok((end, received.saturating_sub(sent_us) as f64 / 1e3))
}

pub(crate) async fn run() -> anyhow::Result<()> {
    let sys = System::start(Settings {
        model: "mock",
        windows: vec![],
        system_prompt: "You are a terse assistant with a file-listing tool.",
        turn_limits: TurnLimits::default(),
    })
    .await?;
    let tools = json!([{"type": "function", "function": {"name": "probe", "description": "Lists a directory",
        "parameters": {"type": "object", "properties": {"dir": {"type": "string"}}}}}]);
    let output = "a.txt b.txt c.txt notes/ src/main.rs src/lib.rs Cargo.toml README.md ".repeat(3);
    let (mut first_steps, mut later_steps) = (Vec::new(), Vec::new());
    let (mut extended, mut cached, mut cacheable_total, mut fully_cached, mut pairs) = (0, 0u64, 0u64, 0, 0);
    for t in 0..TURNS {
        let session = sys.create_session().await?;
        // An earlier turn, so that every step's request is past the mock's 1,024-token cache floor.
        let earlier = format!("earlier {t} [mock words=900]");
        step(&sys, &format!("/v1/sessions/{session}/messages"), json!({"text": earlier, "tools": tools}))
            .await?;
        let text = format!(r#"tool turn {t} [mock tool=probe:{{"dir":"."}} steps={} words=20]"#, STEPS - 1);
        let sent_from = sys.mock.log().entries().len();
        let (mut end, ms) =
            step(&sys, &format!("/v1/sessions/{session}/messages"), json!({"text": text, "tools": tools}))
                .await?;
        first_steps.push(ms);
        while end["status"] == "requires_action" {
            let results: Vec<Value> = end["required"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| json!({"call_id": r["call_id"], "output": output}))
                .collect();
            let (next, ms) =
                step(&sys, &format!("/v1/sessions/{session}/tool_results"), json!({"results": results}))
                    .await?;
            later_steps.push(ms);
            end = next;
        }
        anyhow::ensure!(end["status"] == "completed", "the tool turn ended {end}");
        // The turn's model requests, in order: each extends the previous byte for byte?
        let requests: Vec<Vec<Value>> = sys.mock.log().entries()[sent_from..]
            .iter()
            .filter(|r| r.path.ends_with("/chat/completions") && r.body.get("tools").is_some())
            .map(|r| r.body["messages"].as_array().cloned().unwrap_or_default())
            .collect();
        anyhow::ensure!(requests.len() == STEPS, "{} model requests, not {STEPS}", requests.len());
        extended += requests.windows(2).filter(|w| w[1].starts_with(&w[0])).count();
        // And the cache the mock reported for each step, from the stored steps' usage.
        let events: Value = sys
            .http
            .get(format!("{}/v1/sessions/{session}/events?limit=1000", sys.base))
            .send()
            .await?
            .json()
            .await?;
        let usage: Vec<(u64, u64)> = events["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["kind"] == "assistant_turn")
            .skip(1) // the earlier turn
            .map(|e| {
                let u = &e["payload"]["usage"];
                (u["input_tokens"].as_u64().unwrap_or(0), u["cached_input_tokens"].as_u64().unwrap_or(0))
            })
            .collect();
        anyhow::ensure!(usage.len() == STEPS, "{} steps stored, not {STEPS}", usage.len());
        for w in usage.windows(2) {
            let (previous, (_, got)) = (cacheable(w[0].0), w[1]);
            pairs += 1;
            cached += got.min(previous);
            cacheable_total += previous;
            fully_cached += usize::from(got >= previous);
        }
    }
    let share = cached as f64 / cacheable_total.max(1) as f64;
    let (first, later) = (p50(first_steps), p50(later_steps));
    println!(
        "{TURNS} turns of {STEPS} model calls each, one client tool asked for in each of the first {}",
        STEPS - 1
    );
    println!(
        "before the upstream call: the first step (after the user's message) p50 {first:.2} ms; \
         a later step (after the client's results) p50 {later:.2} ms ({:.2}x the first)",
        later / first
    );
    println!(
        "prefix: {extended} of {pairs} step requests extend the previous one byte for byte; \
         the mock reported {fully_cached} of {pairs} steps with the whole previous request cached \
         ({:.1}% of the cacheable tokens; target 100%)",
        share * 100.0
    );
    println!(
        "RESULT tools tool_first_step_pre_upstream_p50_ms={first:.2} tool_step_pre_upstream_p50_ms={later:.2} \
         tool_steps_extending={extended} tool_steps_fully_cached={fully_cached} tool_step_pairs={pairs} \
         tool_cached_share={share:.4}"
    );
    sys.stop().await?;
    Ok(())
}
