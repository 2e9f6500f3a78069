//! Import (issue 25): a generated ChatGPT export of 1,000 conversations and 100,000
//! messages (every tenth conversation with a regenerated answer, so a fork) imported
//! through the writer as `POST /v1/import` and `turnlog import` do, and what it does to
//! live appends meanwhile: their p99 at 100/s before the import (the baseline) and during it,
//! with imports keeping 200 appends in flight a partition (as before issue 43), a fixed 8
//! (issue 43's first answer) and today's adaptive budget (at most
//! [`MAX_IN_FLIGHT_PER_PARTITION`]; its mean window is reported). Then the same file again,
//! which adds nothing.

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::{json, Value};
use turnlog_core::ids::Owner;
use turnlog_runtime::import::{ImportLanes, Importer, MAX_IN_FLIGHT_PER_PARTITION};

use crate::writer::{latency_at, Rig};

const CONVERSATIONS: usize = 1_000;
const MESSAGES: usize = 100;
/// Live appends per second while the import runs, and how long they are measured.
const LIVE_PER_S: u64 = 100;
const LIVE_SECONDS: u64 = 10;

/// One conversation of `MESSAGES` messages; every tenth has a second answer to its last
/// question (a branch, so a fork).
fn conversation(c: usize) -> Value {
    let t0 = 1_700_000_000.0 + c as f64 * 3_600.0;
    let mut mapping = serde_json::Map::new();
    mapping.insert("root".into(), json!({"id": "root", "message": null, "parent": null, "children": ["m0"]}));
    let branch = c.is_multiple_of(10);
    for i in 0..MESSAGES {
        let id = format!("m{i}");
        let role = if i.is_multiple_of(2) { "user" } else { "assistant" };
        let parent = if i == 0 { "root".to_owned() } else { format!("m{}", i - 1) };
        let mut children = if i + 1 < MESSAGES { vec![format!("m{}", i + 1)] } else { vec![] };
        if branch && i == MESSAGES - 2 {
            children.push("alt".into());
        }
        let text = format!(
            "Conversation {c}, message {i}: the Lisbon office's quarterly numbers, invoice {} and the shipment \
             of {} crates to Porto on the {}th.",
            1000 + i,
            i % 40,
            1 + i % 28
        );
        let message = json!({"id": id, "author": {"role": role}, "create_time": t0 + i as f64,
            "content": {"content_type": "text", "parts": [text]}, "metadata": {"model_slug": "gpt-4o"}});
        mapping.insert(
            id.clone(),
            json!({"id": id, "message": message, "parent": parent, "children": children}),
        );
    }
    if branch {
        let message = json!({"id": "alt", "author": {"role": "assistant"}, "create_time": t0 + 500.0,
            "content": {"content_type": "text", "parts": ["Another answer."]}});
        let parent = format!("m{}", MESSAGES - 2);
        mapping
            .insert("alt".into(), json!({"id": "alt", "message": message, "parent": parent, "children": []}));
    }
    json!({"conversation_id": format!("bench-{c}"), "title": format!("Bench conversation {c}"),
           "create_time": t0, "current_node": format!("m{}", MESSAGES - 1), "mapping": mapping})
}

pub(crate) async fn run() -> anyhow::Result<()> {
    turnlog_core::tokens::warm_up();
    let path = std::env::temp_dir().join(format!("turnlog-bench-import-{}.json", uuid::Uuid::now_v7()));
    {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
        out.write_all(b"[")?;
        for c in 0..CONVERSATIONS {
            if c > 0 {
                out.write_all(b",\n")?;
            }
            serde_json::to_writer(&mut out, &conversation(c))?;
        }
        out.write_all(b"]\n")?;
    }
    let file_mb = std::fs::metadata(&path)?.len() as f64 / 1e6;
    let mut rig = Rig::new().await?;
    rig.start_writer();
    let live = rig.sessions(16).await?;
    // A first round warms the new database and the writer; the second is the baseline.
    latency_at(&rig, &live, LIVE_PER_S, 3).await?;
    let alone = latency_at(&rig, &live, LIVE_PER_S, LIVE_SECONDS).await?;
    println!("live appends at {LIVE_PER_S}/s alone (the baseline): {}", alone.summary());
    let alone_p99 = alone.p99();

    // The same file imported once a budget, by an owner each (so none finds another's
    // sessions): by default with the appends in flight a partition that imports had before
    // issue 43 (200), a fixed 8, and today's adaptive budget; live appends measured meanwhile.
    let budgets = std::env::var("TURNLOG_BENCH_IMPORT_BUDGETS").unwrap_or_else(|_| "200,8,adaptive".into());
    let mut runs = Vec::new();
    let mut last = None;
    for budget in budgets.split(',') {
        let lanes = match (budget, budget.strip_prefix("adaptive:")) {
            ("adaptive", _) => ImportLanes::new(rig.bus.partitions),
            (_, Some(share)) => ImportLanes::adaptive_to(rig.bus.partitions, share.parse()?),
            (n, None) => ImportLanes::fixed(rig.bus.partitions, n.parse()?),
        };
        let importer = Importer {
            bus: rig.bus.clone(),
            pool: rig.env.pool.clone(),
            owner: Owner::parse(&format!("importer-{}", runs.len()))?,
            lanes: Arc::new(lanes),
            append_timeout: Duration::from_secs(60),
        };
        let started = Instant::now();
        let import = {
            let (importer, path) = (importer.clone(), path.clone());
            tokio::spawn(async move { importer.file(&path, None, |_, _| {}).await })
        };
        // The window, sampled every 10 ms while the import runs.
        let window = {
            let lanes = importer.lanes.clone();
            let import = import.abort_handle();
            tokio::spawn(async move {
                let (mut sum, mut samples) = (0.0, 0u32);
                while !import.is_finished() {
                    sum += lanes.lane(0).limit();
                    samples += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                sum / f64::from(samples.max(1))
            })
        };
        let during = latency_at(&rig, &live, LIVE_PER_S, LIVE_SECONDS).await?;
        let summary = import.await??;
        let elapsed = started.elapsed();
        let window = window.await?;
        anyhow::ensure!(summary.failed.is_empty(), "conversations failed: {:?}", summary.failed);
        let per_s = summary.messages as f64 / elapsed.as_secs_f64();
        println!(
            "import of {CONVERSATIONS} conversations ({file_mb:.1} MB, {} messages, {} sessions), {budget} in flight: \
             {:.1} s, {per_s:.0} messages/s, {window:.1} appends in flight on average; live appends at \
             {LIVE_PER_S}/s meanwhile: {}",
            summary.messages,
            summary.sessions,
            elapsed.as_secs_f64(),
            during.summary(),
        );
        runs.push((budget, per_s, during.p99(), window));
        last = Some(importer);
    }
    let importer = last.context("no budget to import with")?;
    let again = Instant::now();
    let repeat = importer.file(&path, None, |_, _| {}).await?;
    anyhow::ensure!(repeat.events == 0 && repeat.unchanged == CONVERSATIONS, "a repeat added {repeat:?}");
    let again = again.elapsed();
    let _ = std::fs::remove_file(&path);
    let after = latency_at(&rig, &live, LIVE_PER_S, LIVE_SECONDS).await?;
    println!("live appends at {LIVE_PER_S}/s alone after the imports: {}", after.summary());
    println!("the same file again: nothing added, {:.1} s", again.as_secs_f64());

    let (_, per_s, during_p99, window) = runs[runs.len() - 1];
    let others: String = runs[..runs.len() - 1]
        .iter()
        .map(|(budget, per_s, p99, _)| {
            format!(
                " messages_per_s_{budget}={per_s:.0} live_p99_ms_{budget}={p99:.2} live_p99_vs_alone_{budget}={:.2}",
                p99 / alone_p99
            )
        })
        .collect();
    println!(
        "RESULT import messages_per_s={per_s:.0} live_p99_ms={during_p99:.2} live_p99_alone_ms={alone_p99:.2} \
         live_p99_vs_alone={:.2} mean_in_flight={window:.1} max_in_flight={MAX_IN_FLIGHT_PER_PARTITION} \
         repeat_s={:.1} live_p99_alone_after_ms={:.2}{others}",
        during_p99 / alone_p99,
        again.as_secs_f64(),
        after.p99(),
    );
    rig.stop_writer().await?;
    rig.env.cleanup().await;
    Ok(())
}
