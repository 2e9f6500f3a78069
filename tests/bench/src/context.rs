//! How fast the next request's size is decided. turnlog sums per-event token counts
//! (computed once, when each event is written) over the live tail after the newest
//! compaction; the naive way re-projects and re-encodes the whole history every turn.

use std::hint::black_box;
use std::time::{Duration, Instant};

use turnlog_core::budget::{history_tokens, request_size, CountedEvent};
use turnlog_core::events::{EventBody, ToolExecution, TurnMemory};
use turnlog_core::llm_context::llm_messages;
use turnlog_core::log_builder::LogBuilder;
use turnlog_core::request::{assemble, reserve_tokens, Extras};
use turnlog_core::tokens::{self, request_tokens};

const SYSTEM: &str = "You are a careful assistant. Keep every name, date and number.";

/// A session of `n` events: turns of a user message, an answer, a tool run and a turn
/// memory, with one compaction near the end covering all but the last ~40 events.
fn session(n: usize) -> LogBuilder {
    let mut log = LogBuilder::new();
    let mut turn = 0;
    while log.events.len() < n {
        turn += 1;
        if log.events.len() + 45 >= n
            && !log.events.iter().any(|e| e.kind() == turnlog_core::EventKind::CompactionApplied)
        {
            let through = log.next_seq() - 1;
            log.compaction(&format!("Summary through turn {turn}: Ada chose plan B on 2026-03-12."), through);
            continue;
        }
        log.user(&format!(
            "Turn {turn}: could you look at the failing build in module {turn} and explain it?"
        ));
        let answer = log.assistant(&format!(
            "The build in module {turn} fails because the migration runs before the pool is ready; \
             I moved it after startup and reran the tests, which now pass."
        ));
        log.push(EventBody::ToolExecution(ToolExecution {
            call_id: format!("c{turn}"),
            name: "cargo_test".into(),
            status: "ok".into(),
            result_digest: Some("42 passed".into()),
            ..Default::default()
        }));
        log.push(EventBody::TurnMemory(TurnMemory {
            turn_seq: answer,
            files_changed: vec![format!("src/module{turn}.rs")],
            key_findings: vec!["migrations must run after the pool is ready".into()],
            ..Default::default()
        }));
    }
    log.events.truncate(n);
    log
}

/// Mean time of one call, over repeated calls for at least `min` wall time.
pub(crate) fn time_per_call<T>(min: Duration, mut f: impl FnMut() -> T) -> Duration {
    let mut calls = 0u32;
    let start = Instant::now();
    while start.elapsed() < min || calls < 3 {
        black_box(f());
        calls += 1;
    }
    start.elapsed() / calls
}

pub(crate) fn run() -> anyhow::Result<()> {
    let t = Instant::now();
    tokens::warm_up();
    println!("tokenizer load: {:?}", t.elapsed());
    let extras =
        Extras { date: Some("2026-11-29 (Sunday)".into()), memories: vec!["Ada prefers plan B".into()] };
    let reserve = reserve_tokens(SYSTEM, &extras);

    println!(
        "{:>8} {:>10} {:>16} {:>16} {:>9}",
        "events", "live tail", "cached counts", "naive re-encode", "speedup"
    );
    let mut budget_ns = Vec::new();
    let mut naive_100k = 0u128;
    for n in [1_000usize, 10_000, 100_000] {
        let log = session(n);
        // What the writer stores beside each event, once.
        let counted: Vec<CountedEvent> = log.events.iter().map(CountedEvent::of).collect();
        let (compaction_seq, boundary) = counted
            .iter()
            .rev()
            .find_map(|c| c.replaces_through.map(|b| (c.seq, b)))
            .ok_or_else(|| anyhow::anyhow!("session has no compaction"))?;

        // turnlog: the session row knows its boundary; the index yields the live tail.
        let cached = time_per_call(Duration::from_millis(300), || {
            let start = counted.partition_point(|c| c.seq <= boundary);
            let tail = &counted[start..];
            debug_assert!(tail.iter().any(|c| c.seq == compaction_seq));
            request_size(history_tokens(tail), reserve)
        });
        // naive: project the whole history and encode every message again.
        let naive = time_per_call(Duration::from_millis(300), || {
            request_tokens(&assemble(SYSTEM, llm_messages(&log.events), &extras))
        });
        let expected = request_tokens(&assemble(SYSTEM, llm_messages(&log.events), &extras));
        let start = counted.partition_point(|c| c.seq <= boundary);
        anyhow::ensure!(
            request_size(history_tokens(&counted[start..]), reserve) == expected,
            "cached and naive sizes differ"
        );

        println!(
            "{n:>8} {:>10} {:>13} ns {:>13} ns {:>8.0}x",
            counted.len() - start,
            cached.as_nanos(),
            naive.as_nanos(),
            naive.as_nanos() as f64 / cached.as_nanos().max(1) as f64
        );
        budget_ns.push(cached.as_nanos());
        if n == 100_000 {
            naive_100k = naive.as_nanos();
        }
    }

    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("../../../shared/core/tests/fixtures/token_counts.json"))?;
    let text: String = fixture["cases"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["text"].as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let per_call = time_per_call(Duration::from_millis(1000), || tokens::count(&text));
    let mb_s = text.len() as f64 / per_call.as_secs_f64() / 1e6;
    println!("tokenizer: {:.1} MB/s over the {}-byte fixture", mb_s, text.len());

    let forks = crate::runtime()?.block_on(crate::branches::run())?;
    println!(
        "RESULT context budget_1k_ns={} budget_100k_ns={} naive_100k_ns={} tokenizer_mb_s={} fork_ns={} \
         fork_10_events_ns={} branch_tail_ns={} flat_tail_ns={} rebuild_request_us={}",
        budget_ns[0],
        budget_ns[2],
        naive_100k,
        mb_s.round() as u64,
        forks.fork_ns,
        forks.fork_small_ns,
        forks.branch_tail_ns,
        forks.flat_tail_ns,
        forks.rebuild_request_us,
    );
    Ok(())
}
