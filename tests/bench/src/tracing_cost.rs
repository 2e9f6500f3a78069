//! Tracing's cost on the writer: the writer benchmark's end-to-end run (16 pipelined
//! producers, 16 sessions), every request sent with its trace context as the ingress sends
//! a turn's (a span for each two appends, and one per append where spans are recorded), in
//! three modes, each run in a process of its own (a process has one subscriber):
//! - `none`: `OTEL_SDK_DISABLED=true`: no tracing layer, no trace context (the baseline);
//! - `off`: trace context made and carried (trace ids on log lines), no trace sampled, so
//!   the writer makes no apply span (`OTEL_EXPORTER_OTLP_ENDPOINT` unset: the default);
//! - `on`: every trace sampled, the producers' and the writer's spans exported over
//!   OTLP/HTTP to a collector this process runs.
//!
//! Each run reports its rate and the CPU its process (the producers and the writer, where
//! tracing happens) spent per append; Postgres and nats-server are not counted. Rounds
//! interleave the modes (the machine's speed drifts); each figure is a median.

use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;

use crate::writer::{end_to_end_traced, Rig};

const MODES: [&str; 3] = ["none", "off", "on"];
const ROUNDS: usize = 3;
/// Appends measured in each run (after a warm-up of [`WARM_UP`]); `TURNLOG_BENCH_APPENDS`
/// sets another number (a quick check).
fn total() -> usize {
    std::env::var("TURNLOG_BENCH_APPENDS").ok().and_then(|n| n.parse().ok()).unwrap_or(48_000)
}
const WARM_UP: usize = 4_000;

pub(crate) async fn run() -> anyhow::Result<()> {
    let spans = Arc::new(AtomicU64::new(0));
    let collector = collector(spans.clone()).await?;
    let exe = std::env::current_exe()?;
    // Per mode: (appends/s, CPU µs per append) of each run.
    let mut figures: Vec<(&str, Vec<f64>, Vec<f64>)> =
        MODES.iter().map(|m| (*m, Vec::new(), Vec::new())).collect();
    let mut exported = Vec::new();
    for round in 1..=ROUNDS {
        for (mode, runs, cpu) in &mut figures {
            let before = spans.load(Ordering::Relaxed);
            let mut child = tokio::process::Command::new(&exe);
            child.args(["tracing-run", mode]).stdout(Stdio::piped()).stderr(Stdio::inherit());
            for var in
                ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"]
            {
                child.env_remove(var);
            }
            if *mode == "none" {
                child.env("OTEL_SDK_DISABLED", "true");
            }
            if *mode == "on" {
                // Room for every span at this rate (the SDK's default queue, 2,048 spans
                // sent every 5 s, drops most of them): the cost of exporting them all.
                child
                    .env("OTEL_EXPORTER_OTLP_ENDPOINT", &collector)
                    .env("OTEL_BSP_MAX_QUEUE_SIZE", "65536")
                    .env("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096")
                    .env("OTEL_BSP_SCHEDULE_DELAY", "1000");
            }
            let out = child.output().await?;
            anyhow::ensure!(out.status.success(), "the {mode} run failed");
            let stdout = String::from_utf8_lossy(&out.stdout);
            let figure = |name: &str| -> anyhow::Result<f64> {
                let line = stdout.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix('='));
                Ok(line.with_context(|| format!("the run printed no {name}"))?.trim().parse()?)
            };
            let (per_s, us) = (figure("events_per_s")?, figure("cpu_us_per_append")?);
            let sent = spans.load(Ordering::Relaxed) - before;
            println!("round {round} {mode:>4}: {per_s:>8.0} appends/s  {us:>5.1} µs CPU an append  ({sent} spans exported)");
            if *mode == "on" {
                exported.push(sent as f64 / (total() + WARM_UP) as f64);
            }
            runs.push(per_s);
            cpu.push(us);
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [none, off, on] = [0, 1, 2].map(|i| median(&figures[i].1));
    let [cpu_none, cpu_off, cpu_on] = [0, 1, 2].map(|i| median(&figures[i].2));
    let pct = |a: f64, b: f64| (a - b) / b * 100.0;
    println!();
    println!("| mode | appends/s (median of {ROUNDS}) | vs none | vs off | CPU µs an append (producers + writer) | vs none |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!("| none (baseline: no tracing) | {none:.0} | — | | {cpu_none:.1} | — |");
    println!(
        "| off (trace ids, not sampled) | {off:.0} | {:+.1}% (target ≥ −3%) | — | {cpu_off:.1} | {:+.1}% |",
        pct(off, none),
        pct(cpu_off, cpu_none)
    );
    println!(
        "| on (sampled, exported over OTLP/HTTP) | {on:.0} | {:+.1}% | {:+.1}% | {cpu_on:.1} | {:+.1}% |",
        pct(on, none),
        pct(on, off),
        pct(cpu_on, cpu_none)
    );
    println!(
        "RESULT tracing events_per_s_none={none:.0} events_per_s_off={off:.0} events_per_s_on={on:.0} off_vs_none_pct={:.1} on_vs_off_pct={:.1} cpu_us_per_append_none={cpu_none:.1} cpu_us_per_append_off={cpu_off:.1} cpu_us_per_append_on={cpu_on:.1} spans_per_append={:.2}",
        pct(off, none),
        pct(on, off),
        median(&exported)
    );
    Ok(())
}

/// One measured run in this process, in `mode`; prints `events_per_s=<n>` and
/// `cpu_us_per_append=<µs>` (this process's CPU over the measured appends).
pub(crate) async fn child(args: &[String]) -> anyhow::Result<()> {
    let mode = args.first().map(String::as_str).context("tracing-run needs a mode")?;
    anyhow::ensure!(MODES.contains(&mode), "unknown mode {mode}");
    // As the services start theirs (the parent sets the mode's environment).
    let telemetry = turnlog_runtime::trace::init(
        "turnlog-bench",
        turnlog_runtime::trace::LogStyle::Pretty { ansi: false },
        tracing_subscriber::EnvFilter::new("warn"),
    )?;
    let mut rig = Rig::new().await?;
    rig.start_writer();
    let sessions = rig.sessions(16).await?;
    end_to_end_traced(&rig.bus, &sessions, WARM_UP, true).await?;
    let cpu = || crate::cpu::of(&[std::process::id()]);
    let before = cpu();
    let per_s = end_to_end_traced(&rig.bus, &sessions, total(), true).await?;
    let us = (cpu() - before) * 1e6 / total() as f64;
    rig.stop_writer().await?;
    rig.env.cleanup().await;
    telemetry.shutdown().await;
    println!("events_per_s={per_s:.0}\ncpu_us_per_append={us:.1}");
    Ok(())
}

/// An OTLP/HTTP collector that counts the spans it is sent; its base URL.
async fn collector(spans: Arc<AtomicU64>) -> anyhow::Result<String> {
    let receive = move |body: axum::body::Bytes| async move {
        if let Ok(request) = ExportTraceServiceRequest::decode(body) {
            let n = request
                .resource_spans
                .iter()
                .flat_map(|r| &r.scope_spans)
                .map(|s| s.spans.len())
                .sum::<usize>();
            spans.fetch_add(n as u64, Ordering::Relaxed);
        }
        ([("content-type", "application/x-protobuf")], Vec::<u8>::new())
    };
    let app = axum::Router::new().route("/v1/traces", axum::routing::post(receive));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}
