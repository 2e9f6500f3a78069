//! Each worker as a real `turnlog` process, SIGKILLed while it has events in hand and
//! restarted: afterwards every turn has its output exactly once. The writer runs in-process,
//! the mock model answers slowly so the kill lands mid-batch.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use turnlog_core::ids::SessionId;
use turnlog_e2e::rig::{filler, Rig};
use turnlog_testkit::{eventually, TurnlogProcess};

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");
const SESSIONS: usize = 3;
const TURNS_PER_SESSION: usize = 10;

/// A worker process on the rig's environment and model, with quick redeliveries.
fn start_worker(rig: &Rig, worker: &str, model_url: &str) -> TurnlogProcess {
    TurnlogProcess::start(
        BIN,
        &rig.env,
        &[worker],
        &[
            ("TURNLOG_LLM_URL", model_url),
            ("TURNLOG_MODEL", "mock-unknown"),
            ("TURNLOG_CONTEXT_BUDGET", "1000"),
            ("TURNLOG_WORKER_CONCURRENCY", "4"),
            ("TURNLOG_WORKER_ACK_WAIT", "2s"),
            ("TURNLOG_WORKER_RETRY_BACKOFF", "100ms"),
            ("TURNLOG_FACTS_WAIT", "500ms"),
            ("RUST_LOG", "info"),
        ],
    )
}

/// A model slow enough (a pause before each of its many deltas) that a worker always has
/// calls in flight.
async fn slow_model() -> turnlog_mock_llm::MockHandle {
    let mut config = turnlog_mock_llm::MockConfig::default();
    config.defaults.delay_ms = 8;
    turnlog_mock_llm::spawn(config).await.unwrap()
}

/// Turns with a fact each, spread over sessions; returns the sessions and their turns.
async fn converse(rig: &Rig) -> Vec<(SessionId, Vec<i64>)> {
    let mut sessions = Vec::new();
    for _ in 0..SESSIONS {
        sessions.push((rig.create_session().await, Vec::new()));
    }
    for i in 0..TURNS_PER_SESSION {
        for (n, (s, turns)) in sessions.iter_mut().enumerate() {
            let question =
                format!("Remind Petra that room {} opens at {} tomorrow. {}", 100 + i, 8 + n, filler(60, i));
            turns.push(rig.turn(*s, &question, &filler(90, i + n)).await);
        }
    }
    sessions
}

/// Waits until the worker has appended a few `kind` events and still has others in hand,
/// then SIGKILLs it. Returns how many it had appended and how many it held.
async fn kill_mid_batch(rig: &Rig, process: &mut TurnlogProcess, worker: &str, kind: &str) -> (usize, usize) {
    let stream = rig.bus.js.get_stream(rig.bus.names.events_stream()).await.unwrap();
    let name = rig.consumer(worker);
    let at_kill = eventually(Duration::from_secs(60), || {
        let (stream, name) = (stream.clone(), name.clone());
        async move {
            let in_hand = stream.consumer_info(name).await.ok()?.num_ack_pending;
            let done = count(rig, kind).await;
            (in_hand > 0 && done >= 3).then_some((done, in_hand))
        }
    })
    .await;
    process.kill();
    let (done, in_hand) = at_kill;
    println!("{worker} killed with {done} {kind} appended and {in_hand} events in hand");
    at_kill
}

async fn count(rig: &Rig, kind: &str) -> usize {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM session_events WHERE kind = $1")
        .bind(kind)
        .fetch_one(&rig.env.pool)
        .await
        .unwrap();
    n as usize
}

/// A conversation with `worker` running as a process on a slow model, SIGKILLed mid-batch
/// while the conversation is still being appended, then restarted until it has handled
/// everything. Returns the sessions with their turns, and how many `kind` events the worker
/// had appended at the kill.
async fn killed_mid_conversation(rig: &Rig, worker: &str, kind: &str) -> (Vec<(SessionId, Vec<i64>)>, usize) {
    let model = slow_model().await;
    let mut process = start_worker(rig, worker, &model.base_url());
    let (sessions, (done, _)) = tokio::join!(converse(rig), kill_mid_batch(rig, &mut process, worker, kind));
    finish(rig, &mut process, worker).await;
    (sessions, done)
}

/// After the restart the worker finishes everything, and stops cleanly on SIGTERM.
async fn finish(rig: &Rig, process: &mut TurnlogProcess, worker: &str) {
    process.restart().await;
    rig.settle(&[worker]).await;
    process.terminate();
    let status =
        process.wait_exit(Duration::from_secs(20)).await.expect("the worker stops within 20 s of SIGTERM");
    assert!(status.success(), "{worker} exited with {status}; log:\n{}", process.log_tail(40));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distiller_killed_mid_batch_distills_every_turn_exactly_once() {
    let rig = Rig::start().await;
    let (sessions, done) = killed_mid_conversation(&rig, "distiller", "turn_memory").await;
    assert!(done < SESSIONS * TURNS_PER_SESSION, "the kill came too late to prove anything");

    for (s, turns) in &sessions {
        let memories = rig.events_of(*s, "turn_memory").await;
        let distilled: Vec<i64> = memories.iter().map(|(_, _, p)| p["turn_seq"].as_i64().unwrap()).collect();
        assert_eq!(distilled.len(), turns.len(), "session {s}: {distilled:?}");
        assert_eq!(distilled.iter().collect::<BTreeSet<_>>(), turns.iter().collect::<BTreeSet<_>>());
        assert!(rig.title(*s).await.is_some_and(|t| t.starts_with("Remind Petra")));
    }
    assert!(rig.dead_letters().await.is_empty());
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_killed_mid_batch_extracts_every_turn_exactly_once() {
    let rig = Rig::start().await;
    let (sessions, done) = killed_mid_conversation(&rig, "memory", "memory_extracted").await;
    assert!(done < SESSIONS * TURNS_PER_SESSION, "the kill came too late to prove anything");

    let mut total = 0;
    for (s, turns) in &sessions {
        let extracted = rig.events_of(*s, "memory_extracted").await;
        let seqs: Vec<i64> = extracted.iter().map(|(_, _, p)| p["turn_seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs.len(), turns.len(), "one extraction per turn in {s}: {seqs:?}");
        assert_eq!(seqs.iter().collect::<BTreeSet<_>>(), turns.iter().collect::<BTreeSet<_>>());
        for (_, _, p) in &extracted {
            assert!(p.get("error").is_none(), "{p}");
            total += p["memories"].as_array().unwrap().len();
        }
    }
    let ids: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT id FROM memories").fetch_all(&rig.env.pool).await.unwrap();
    assert_eq!(ids.len(), total, "every extracted memory stored once");
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len());
    assert!(total >= SESSIONS * TURNS_PER_SESSION);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compactor_killed_mid_batch_leaves_every_session_within_budget() {
    let rig = Rig::start().await;
    let (sessions, _) = killed_mid_conversation(&rig, "compactor", "compaction_applied").await;

    for (s, _) in &sessions {
        assert!(rig.next_request_tokens(*s).await <= 1_000, "session {s} over budget after the restart");
        let compactions = rig.events_of(*s, "compaction_applied").await;
        assert!(!compactions.is_empty());
        // Each compaction moved the boundary forward from the one before it: none was
        // applied twice, none on a stale view.
        let mut boundary = 0;
        for (seq, _, p) in &compactions {
            let through = p["replaces_through_seq"].as_i64().unwrap();
            assert!(through > boundary && through < *seq, "{compactions:?}");
            assert!(!p["summary"].as_str().unwrap().trim().is_empty());
            boundary = through;
        }
    }
    rig.stop().await;
}
