//! A server tool's call through turnlog (DESIGN §14) against the same MCP server called
//! directly. Through turnlog: a turn whose model asks for the everything server's `echo`
//! (policy `allow`); the figure is the time from the stream's `tool_call` to its
//! `tool_result` — the ingress's permission chain and dispatch, the bus, the tools worker
//! (its claim, the MCP call, the append through the writer) and the turn hearing the
//! committed result. Directly: the same `echo` on an `rmcp` client of one server process,
//! as the worker holds one. Both at 1 and 20 calls at once (20 concurrent turns).

use std::time::Instant;

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use rmcp::model::CallToolRequestParams;
use rmcp::ServiceExt as _;
use serde_json::json;

use turnlog_ingress::turn::TurnLimits;

use crate::ingress::p50;
use crate::system::{Settings, System};

/// Calls (and turns) measured per caller, after the warm-up.
const PER_CALLER: usize = 30;
const WARM_UP: usize = 3;
const CONCURRENCY: [usize; 2] = [1, 20];

fn p99(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() * 99 / 100).copied().unwrap_or(f64::NAN)
}

/// Per-call latency (ms) of `echo` on one directly connected server, `callers` at once.
async fn direct(command: &str, callers: usize) -> anyhow::Result<Vec<f64>> {
    let process = rmcp::transport::TokioChildProcess::new(tokio::process::Command::new(command))?;
    let client = ().serve(process).await?;
    let peer = client.peer().clone();
    let runs = (0..callers).map(|c| {
        let peer = peer.clone();
        async move {
            let mut took = Vec::new();
            for i in 0..WARM_UP + PER_CALLER {
                let args = json!({"message": format!("caller {c} call {i}")});
                let request = CallToolRequestParams::new("echo")
                    .with_arguments(args.as_object().cloned().unwrap_or_default());
                let t0 = Instant::now();
                let result = peer.call_tool(request).await?;
                anyhow::ensure!(result.is_error != Some(true), "echo failed: {result:?}");
                if i >= WARM_UP {
                    took.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            anyhow::Ok(took)
        }
    });
    let all = futures::future::try_join_all(runs).await?;
    let _ = client.cancel().await;
    Ok(all.into_iter().flatten().collect())
}

/// Per-call tool phase (ms, `tool_call` to `tool_result`) of turns asking for `echo`,
/// `callers` turns at once, each caller in its own session.
async fn through(sys: &System, callers: usize) -> anyhow::Result<Vec<f64>> {
    let runs = (0..callers).map(|c| async move {
        let session = sys.create_session().await?;
        let mut took = Vec::new();
        for i in 0..WARM_UP + PER_CALLER {
            let text =
                format!("call {c}-{i} [mock tool=everything__echo:{{\"message\":\"x{c}y{i}\"}} words=2]");
            let resp = sys
                .http
                .post(format!("{}/v1/sessions/{session}/messages", sys.base))
                .json(&json!({"text": text}))
                .send()
                .await?;
            anyhow::ensure!(resp.status().is_success(), "the message was refused: {}", resp.status());
            let (mut called, mut answered, mut status) = (None, None, String::new());
            let mut events = resp.bytes_stream().eventsource();
            while let Some(e) = events.next().await {
                let e = e?;
                match e.event.as_str() {
                    "tool_call" => called = Some(Instant::now()),
                    "tool_result" => answered = Some(Instant::now()),
                    "end" => {
                        status = serde_json::from_str::<serde_json::Value>(&e.data)?["status"].to_string()
                    }
                    _ => {}
                }
            }
            anyhow::ensure!(status == "\"completed\"", "the turn ended {status}");
            let (Some(a), Some(b)) = (called, answered) else { anyhow::bail!("no tool call in the turn") };
            if i >= WARM_UP {
                took.push(b.duration_since(a).as_secs_f64() * 1e3);
            }
        }
        anyhow::Ok(took)
    });
    Ok(futures::future::try_join_all(runs).await?.into_iter().flatten().collect())
}

pub(crate) async fn run() -> anyhow::Result<()> {
    let everything = turnlog_e2e::mcp::bin("mcp-server-everything");
    let servers = format!(
        "[[servers]]\nlabel = \"everything\"\ncommand = \"{everything}\"\n[servers.tools.echo]\npolicy = \"allow\"\n"
    );
    let sys = System::start_with_tools(
        Settings {
            model: "mock",
            windows: vec![],
            system_prompt: "You are a terse assistant with tools.",
            turn_limits: TurnLimits { per_owner: 64, total: 64 },
        },
        Some(&servers),
    )
    .await?;
    let bus = turnlog_runtime::bus::Bus::connect(&sys.env.nats_url, &sys.env.bus_prefix, 1).await?;
    turnlog_e2e::mcp::catalog_ready(&bus, &["everything"]).await;
    println!("server tool call: `echo` of @modelcontextprotocol/server-everything over stdio, {PER_CALLER} calls per caller after {WARM_UP} to warm up");
    println!(
        "{:>8} {:>14} {:>14} {:>16} {:>16} {:>14}",
        "at once", "direct p50 ms", "direct p99 ms", "turnlog p50 ms", "turnlog p99 ms", "overhead p50"
    );
    let mut result = Vec::new();
    for callers in CONCURRENCY {
        let d = direct(&everything, callers).await?;
        let t = through(&sys, callers).await?;
        let (dp50, dp99, tp50, tp99) = (p50(d.clone()), p99(d), p50(t.clone()), p99(t));
        println!("{callers:>8} {dp50:>14.2} {dp99:>14.2} {tp50:>16.2} {tp99:>16.2} {:>14.2}", tp50 - dp50);
        result.push(format!(
            "direct_p50_ms_c{callers}={dp50:.2} turnlog_p50_ms_c{callers}={tp50:.2} turnlog_p99_ms_c{callers}={tp99:.2} overhead_p50_ms_c{callers}={:.2}",
            tp50 - dp50
        ));
    }
    println!("RESULT mcp {}", result.join(" "));
    sys.stop().await
}
