//! Forks and audits against real Postgres and NATS (DESIGN §10, §11): a fork costs the same
//! whatever its parent's length (nothing is copied; the inherited compaction point is an
//! index lookup), a branch's live tail is read per segment, and an answer's request is
//! rebuilt from the log as `GET /requests/{seq}` does it. Logs are written straight into the tables
//! (as the transcript tests do): a 100,000-event session through the writer would take
//! minutes and measure the writer, not the fork.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use turnlog_core::audit::{rebuild_from_log, system_prompt_record, turn_body, RecordedRequest};
use turnlog_core::events::{AssistantTurn, Event, EventBody, ForkPoint};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_core::request::Extras;
use turnlog_core::request_body::RequestParams;
use turnlog_runtime::bus::{append_and_wait, AppendRequest, Bus};
use turnlog_runtime::read;
use turnlog_testkit::{test_env, TestEnv};
use uuid::Uuid;

const OWNER: &str = "bench";

fn owner() -> Owner {
    Owner::parse(OWNER).expect("OWNER is a valid owner")
}
/// Forks timed per parent.
const FORKS: usize = 200;

/// Figures for the context bench's RESULT line.
pub(crate) struct Figures {
    pub fork_ns: u128,
    pub fork_small_ns: u128,
    pub branch_tail_ns: u128,
    pub flat_tail_ns: u128,
    pub rebuild_request_us: u128,
}

/// Stores session `id` with `own` events after `lineage` (ancestors root first, each with
/// the last seq read from it): user messages and answers, a compaction every 1,000 events.
async fn store(env: &TestEnv, id: SessionId, lineage: &[(SessionId, i64)], own: i64) -> anyhow::Result<i64> {
    let first = lineage.last().map_or(1, |(_, t)| t + 1);
    let last = first + own - 1;
    sqlx::query(
        "INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
         SELECT $1, s, gen_random_uuid(),
                CASE WHEN s = $2 THEN 'session_started'
                     WHEN s % 1000 = 0 THEN 'compaction_applied'
                     WHEN s % 2 = 0 THEN 'user_message' ELSE 'assistant_turn' END,
                CASE WHEN s = $2 THEN '{}'::jsonb
                     WHEN s % 1000 = 0 THEN jsonb_build_object('summary', 'Ada chose plan B.', 'replaces_through_seq', s - 40)
                     WHEN s % 2 = 0 THEN jsonb_build_object('text', 'question ' || s)
                     ELSE jsonb_build_object('ui', jsonb_build_object('blocks', jsonb_build_array(
                              jsonb_build_object('type', 'text', 'text', 'answer ' || s))),
                          'llm', jsonb_build_object('message', jsonb_build_object('content', 'answer ' || s))) END,
                12, 0, now()
           FROM generate_series($2::int8, $3::int8) AS s",
    )
    .bind(id.0)
    .bind(first)
    .bind(last)
    .execute(&env.pool)
    .await?;
    // The newest compaction: its own, or the one its parent had at the fork point.
    let own_compaction = (first..=last).rev().find(|s| s % 1000 == 0 && *s != first).map(|s| (s - 40, s));
    let inherited: Option<(Option<i64>, Option<i64>)> = match lineage.last() {
        Some((parent, _)) => {
            sqlx::query_as("SELECT compacted_through, compaction_seq FROM sessions WHERE id = $1")
                .bind(parent.0)
                .fetch_optional(&env.pool)
                .await?
        }
        None => None,
    };
    let (compacted_through, compaction_seq) = match own_compaction {
        Some((through, seq)) => (Some(through), Some(seq)),
        None => inherited.unwrap_or((None, None)),
    };
    sqlx::query(
        "INSERT INTO sessions (id, owner, archived, last_seq, compacted_through, compaction_seq, created_at,
                               updated_at, active_at, lineage, lineage_through)
         VALUES ($1, $2, false, $3, $4, $5, now(), now(), now(), $6, $7)",
    )
    .bind(id.0)
    .bind(OWNER)
    .bind(last)
    .bind(compacted_through)
    .bind(compaction_seq)
    .bind(lineage.iter().map(|(s, _)| s.0).collect::<Vec<_>>())
    .bind(lineage.iter().map(|(_, t)| *t).collect::<Vec<_>>())
    .execute(&env.pool)
    .await?;
    Ok(last)
}

/// Mean time of one fork of `parent` through `through`, over [`FORKS`] forks applied by
/// the writer one after another (append_and_wait: publish, apply, commit, reply).
async fn fork_time(env: &TestEnv, bus: &Bus, parent: SessionId, through: i64) -> anyhow::Result<Duration> {
    let from = ForkPoint { session_id: parent, through_seq: through };
    let started = Instant::now();
    for _ in 0..FORKS {
        let req = AppendRequest::fork(SessionId::new(), &owner(), None, from);
        let outcome = append_and_wait(bus, &env.pool, &req, Duration::from_secs(30)).await?;
        anyhow::ensure!(outcome.is_applied(), "fork refused: {outcome:?}");
    }
    Ok(started.elapsed() / FORKS as u32)
}

/// Appends to `session` (`last` events, its live tail `tail`) an answer that records the
/// request it was sent with, built as the ingress builds it; returns the answer's seq.
async fn answer_with_request(
    env: &TestEnv,
    session: SessionId,
    tail: &[Event],
    last: i64,
) -> anyhow::Result<i64> {
    let system = "You are a careful assistant. Keep every name, date and number.";
    let extras =
        Extras { date: Some("2026-12-01 (Tuesday)".into()), memories: vec!["Ada prefers plan B".into()] };
    let params = RequestParams { stream: true, max_tokens: Some(4096), ..RequestParams::default() };
    let body = turn_body(tail, system, "mock", &params, &extras, None);
    let request = RecordedRequest {
        through_seq: last,
        model: "mock".into(),
        params,
        system: system_prompt_record(tail, system),
        tools_sha256: None,
        tool_history: Default::default(),
        extras,
        tokens: 0,
        body_sha256: body.sha256,
    };
    let answer =
        EventBody::AssistantTurn(AssistantTurn { request: Some(request), ..AssistantTurn::default() });
    sqlx::query(
        "INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
         VALUES ($1, $2, gen_random_uuid(), 'assistant_turn', $3, 0, 0, now())",
    )
    .bind(session.0)
    .bind(last + 1)
    .bind(answer.to_payload())
    .execute(&env.pool)
    .await?;
    sqlx::query("UPDATE sessions SET last_seq = $2 WHERE id = $1")
        .bind(session.0)
        .bind(last + 1)
        .execute(&env.pool)
        .await?;
    Ok(last + 1)
}

/// Mean time of rebuilding the request of the answer at `seq`, as `GET /requests/{seq}`
/// does: its event, the log through its `through_seq`, the body and its hash.
async fn rebuild_time(env: &TestEnv, session: SessionId, seq: i64) -> anyhow::Result<Duration> {
    let mut rebuilds = 0u32;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(1) || rebuilds < 20 {
        let event =
            read::event_at(&env.pool, &owner(), session, seq).await?.context("no answer")?.decode()?;
        let recorded = event.body.recorded_request().context("no request")?;
        let events = read::tail_through(&env.pool, &owner(), session, recorded.through_seq)
            .await?
            .context("no session")?;
        let body = rebuild_from_log(&events, recorded, None)?;
        anyhow::ensure!(body.sha256 == recorded.body_sha256, "the request does not rebuild");
        rebuilds += 1;
    }
    Ok(started.elapsed() / rebuilds)
}

/// Mean time of one live-tail read of `session`, over at least a second of reads.
async fn tail_time(env: &TestEnv, session: SessionId) -> anyhow::Result<(Duration, usize)> {
    let mut reads = 0u32;
    let mut events = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(1) || reads < 20 {
        let tail =
            read::live_tail(&env.pool, &owner(), session).await?.ok_or_else(|| anyhow::anyhow!("no tail"))?;
        events = tail.events.len();
        reads += 1;
    }
    Ok((started.elapsed() / reads, events))
}

pub(crate) async fn run() -> anyhow::Result<Figures> {
    let env = test_env().await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await?;
    bus.ensure_topology(None).await?;
    let stop = CancellationToken::new();
    let writer = tokio::spawn(turnlog_writer::run(turnlog_e2e::config::writer(&env), stop.clone()));

    // Forks of a 10-event and a 100,000-event session, through a seq below the big one's
    // newest compaction, so the inherited compaction point is looked up.
    let (small, big) = (SessionId::new(), SessionId::new());
    store(&env, small, &[], 10).await?;
    let big_last = store(&env, big, &[], 100_000).await?;
    sqlx::query("ANALYZE session_events, sessions").execute(&env.pool).await?;
    fork_time(&env, &bus, small, 10).await?; // warm-up: connections, plans
    let fork_small = fork_time(&env, &bus, small, 10).await?;
    let fork_big = fork_time(&env, &bus, big, big_last - 1_500).await?;
    println!(
        "fork (writer round trip): {:>9} ns of a 10-event session, {:>9} ns of a 100,000-event one ({:.2}x)",
        fork_small.as_nanos(),
        fork_big.as_nanos(),
        fork_big.as_nanos() as f64 / fork_small.as_nanos().max(1) as f64
    );

    // A depth-8 branch: a 10,000-event root compacted at 10,000, then 8 forks of 120
    // events each; beside it, a flat session with the same live tail.
    let mut lineage: Vec<(SessionId, i64)> = Vec::new();
    let root = SessionId::new();
    let mut last = store(&env, root, &[], 10_001).await?;
    let mut tip = root;
    for _ in 0..8 {
        lineage.push((tip, last));
        tip = SessionId(Uuid::now_v7());
        last = store(&env, tip, &lineage, 120).await?;
    }
    let flat = SessionId::new();
    store(&env, flat, &[], 10_961).await?;
    sqlx::query("ANALYZE session_events, sessions").execute(&env.pool).await?;
    let (branch, branch_events) = tail_time(&env, tip).await?;
    let (flat_time, flat_events) = tail_time(&env, flat).await?;
    anyhow::ensure!(branch_events == flat_events, "tails differ: {branch_events} vs {flat_events}");
    println!(
        "live tail of {branch_events} events: {:>9} ns on a depth-8 branch, {:>9} ns on one session ({:.2}x)",
        branch.as_nanos(),
        flat_time.as_nanos(),
        branch.as_nanos() as f64 / flat_time.as_nanos().max(1) as f64
    );

    // An audited answer at the end of a 10,000-event session (compacted at 10,000).
    let audited = SessionId::new();
    let last = store(&env, audited, &[], 10_000).await?;
    let tail = read::live_tail(&env.pool, &owner(), audited).await?.context("no tail")?;
    let answer = answer_with_request(&env, audited, &tail.events, last).await?;
    let rebuild = rebuild_time(&env, audited, answer).await?;
    println!(
        "rebuild of an answer's request ({} events through its through_seq): {} µs",
        tail.events.len(),
        rebuild.as_micros()
    );

    stop.cancel();
    writer.await??;
    Ok(Figures {
        fork_ns: fork_big.as_nanos(),
        fork_small_ns: fork_small.as_nanos(),
        branch_tail_ns: branch.as_nanos(),
        flat_tail_ns: flat_time.as_nanos(),
        rebuild_request_us: rebuild.as_micros(),
    })
}
