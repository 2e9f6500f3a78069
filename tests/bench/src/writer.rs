//! The writer's throughput and latency, side by side with the seeds' one-transaction-per-
//! event pattern and the raw ceiling of array inserts. Needs a durable Postgres (set
//! DATABASE_URL to one with fsync and synchronous_commit on) and a nats-server.

use std::future::IntoFuture as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use turnlog_core::events::{EventBody, UserMessage};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{append_and_wait, append_headers, AppendRequest, Bus};
use turnlog_testkit::{
    free_port, private_nats, private_postgres, test_env, test_env_on, TestEnv, TurnlogProcess,
};
use uuid::Uuid;

use crate::cpu::{Meter, Part, Spent};

pub(crate) const OWNER: &str = "bench";

/// [`OWNER`], as the requests name it.
pub(crate) fn owner() -> Owner {
    Owner::parse(OWNER).expect("OWNER is a valid owner")
}

pub(crate) fn message(i: usize) -> EventBody {
    EventBody::UserMessage(UserMessage {
        text: format!("message {i}: please summarize the quarterly numbers for the Lisbon office"),
        ..Default::default()
    })
}

pub(crate) struct Rig {
    pub(crate) env: TestEnv,
    pub(crate) bus: Bus,
    writer: Option<(CancellationToken, tokio::task::JoinHandle<anyhow::Result<()>>)>,
}

impl Rig {
    pub(crate) async fn new() -> anyhow::Result<Self> {
        let env = test_env().await;
        let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await?;
        bus.ensure_topology(None).await?;
        Ok(Self { env, bus, writer: None })
    }

    pub(crate) fn start_writer(&mut self) {
        let config = turnlog_e2e::config::writer(&self.env);
        let token = CancellationToken::new();
        self.writer = Some((token.clone(), tokio::spawn(turnlog_writer::run(config, token))));
    }

    pub(crate) async fn stop_writer(&mut self) -> anyhow::Result<()> {
        if let Some((token, handle)) = self.writer.take() {
            token.cancel();
            handle.await??;
        }
        Ok(())
    }

    pub(crate) async fn sessions(&self, n: usize) -> anyhow::Result<Vec<SessionId>> {
        sessions_on(&self.bus, &self.env, n).await
    }
}

/// Creates `n` sessions through the writer.
pub(crate) async fn sessions_on(bus: &Bus, env: &TestEnv, n: usize) -> anyhow::Result<Vec<SessionId>> {
    let ids: Vec<SessionId> = (0..n).map(|_| SessionId::new()).collect();
    let reqs: Vec<AppendRequest> = ids.iter().map(|id| AppendRequest::create(*id, &owner(), None)).collect();
    let futs = reqs.iter().map(|r| append_and_wait(bus, &env.pool, r, Duration::from_secs(30)));
    for o in futures::future::join_all(futs).await {
        anyhow::ensure!(o?.is_applied(), "session create failed");
    }
    Ok(ids)
}

/// Requests a producer of the end-to-end load keeps in flight.
const WINDOW: usize = 256;

/// End to end: pipelined producers publish as `append_and_wait` does (a plain NATS message
/// with the reply header, no PubAck; at most [`WINDOW`] in flight each, not one at a time),
/// the writer commits and publishes, and the producers count the replies on their inbox.
pub(crate) async fn end_to_end(bus: &Bus, sessions: &[SessionId], total: usize) -> anyhow::Result<f64> {
    end_to_end_traced(bus, sessions, total, false).await
}

/// [`end_to_end`], each request sent (when `traced`) with its trace context, as the
/// ingress sends a turn's ([`traced_as_the_ingress`]).
pub(crate) async fn end_to_end_traced(
    bus: &Bus,
    sessions: &[SessionId],
    total: usize,
    traced: bool,
) -> anyhow::Result<f64> {
    let producers = sessions.len().clamp(1, 16);
    let per_producer = total / producers;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..producers {
        let bus = bus.clone();
        let mine: Vec<SessionId> = sessions.iter().skip(p).step_by(producers).copied().collect();
        tasks.push(tokio::spawn(async move {
            let inbox = bus.client.new_inbox();
            let mut replies = bus.client.subscribe(inbox.clone()).await?;
            let (mut sent, mut answered) = (0usize, 0usize);
            let mut turn = tracing::Span::none();
            while answered < per_producer {
                while sent < per_producer && sent - answered < WINDOW {
                    let session = mine[sent % mine.len()];
                    let req = AppendRequest::append(session, &owner(), Uuid::now_v7(), &message(sent));
                    let subject = bus.names.append_subject(bus.partition_of(session), session);
                    let traceparent = traced.then(|| traced_as_the_ingress(&mut turn, sent)).flatten();
                    let headers =
                        append_headers(&req.request_id.to_string(), Some(&inbox), traceparent.as_deref());
                    bus.client
                        .publish_with_headers(subject, headers, Bytes::from(serde_json::to_vec(&req)?))
                        .await?;
                    sent += 1;
                }
                tokio::time::timeout(Duration::from_secs(10), replies.next())
                    .await
                    .context("no outcome within 10 s")?
                    .context("reply subscription ended")?;
                answered += 1;
            }
            anyhow::Ok(answered)
        }));
    }
    let mut done = 0;
    for t in tasks {
        done += t.await??;
    }
    Ok(done as f64 / start.elapsed().as_secs_f64())
}

/// Appends the ingress makes in a plain turn: the user message and the answer.
const TURN_APPENDS: usize = 2;

/// The `traceparent` of append number `sent`, as the ingress makes a turn's: a span for the
/// turn every [`TURN_APPENDS`] appends (its `http` span), and a span per append of its own
/// only where spans are recorded (its `submit`).
fn traced_as_the_ingress(turn: &mut tracing::Span, sent: usize) -> Option<String> {
    if sent.is_multiple_of(TURN_APPENDS) {
        *turn = tracing::info_span!("bench.turn");
    }
    if turnlog_runtime::trace::recording() {
        turnlog_runtime::trace::traceparent(&tracing::info_span!(parent: &*turn, "bench.append"))
    } else {
        turnlog_runtime::trace::traceparent(turn)
    }
}

/// `append_and_wait`'s latency at a steady offered rate (open loop), after a pause that lets
/// the machine settle from the runs before (the writer's index merges, the servers' flushes)
/// and a first second at the rate that is not recorded.
pub(crate) async fn latency_at(
    rig: &Rig,
    sessions: &[SessionId],
    per_s: u64,
    seconds: u64,
) -> anyhow::Result<Latency> {
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / per_s));
    let warm_up = per_s as usize;
    let mut tasks = Vec::new();
    for i in 0..warm_up + (per_s * seconds) as usize {
        ticker.tick().await;
        let (bus, pool) = (rig.bus.clone(), rig.env.pool.clone());
        let session = sessions[i % sessions.len()];
        tasks.push(tokio::spawn(async move {
            let req = AppendRequest::append(session, &owner(), Uuid::now_v7(), &message(i));
            let t = Instant::now();
            let outcome = append_and_wait(&bus, &pool, &req, Duration::from_secs(10)).await?;
            anyhow::ensure!(outcome.is_applied(), "append rejected: {outcome:?}");
            anyhow::Ok((i >= warm_up).then(|| t.elapsed().as_micros() as u64))
        }));
    }
    let mut latency = Latency(hdrhistogram::Histogram::<u64>::new(3)?);
    for t in tasks {
        if let Some(us) = t.await?? {
            latency.0.record(us.max(1))?;
        }
    }
    Ok(latency)
}

/// `append_and_wait`'s latencies, in µs.
pub(crate) struct Latency(hdrhistogram::Histogram<u64>);

impl Latency {
    pub(crate) fn p50(&self) -> f64 {
        self.0.value_at_quantile(0.5) as f64 / 1000.0
    }
    pub(crate) fn p99(&self) -> f64 {
        self.0.value_at_quantile(0.99) as f64 / 1000.0
    }
    pub(crate) fn max(&self) -> f64 {
        self.0.max() as f64 / 1000.0
    }

    /// p50, p90, p99 and max, in ms.
    pub(crate) fn summary(&self) -> String {
        let p90 = self.0.value_at_quantile(0.9) as f64 / 1000.0;
        format!("p50 {:.2} ms, p90 {p90:.2}, p99 {:.2}, max {:.1}", self.p50(), self.p99(), self.max())
    }
}

/// The writer alone: the stream pre-filled while it is stopped, then drained.
async fn drain(rig: &mut Rig, sessions: &[SessionId], total: usize) -> anyhow::Result<f64> {
    rig.stop_writer().await?;
    let mut acks = futures::stream::FuturesUnordered::new();
    let mut last = 0u64;
    for i in 0..total {
        let session = sessions[i % sessions.len()];
        let req = AppendRequest::append(session, &owner(), Uuid::now_v7(), &message(i));
        let subject = rig.bus.names.append_subject(0, session);
        let msg = async_nats::jetstream::message::PublishMessage::build()
            .payload(Bytes::from(serde_json::to_vec(&req)?))
            .message_id(req.request_id.to_string());
        let ack = rig.bus.js.send_publish(subject, msg).await?.into_future();
        acks.push(ack);
        if acks.len() >= 1024 {
            last = last.max(acks.next().await.context("ack")??.sequence);
        }
    }
    while let Some(a) = acks.next().await {
        last = last.max(a?.sequence);
    }
    let start = Instant::now();
    rig.start_writer();
    loop {
        let (applied,): (i64,) = sqlx::query_as("SELECT coalesce(max(stream_seq), 0) FROM writer_positions")
            .fetch_one(&rig.env.pool)
            .await?;
        if applied as u64 >= last {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// The seeds' pattern: per append, its own transaction locking the session row; 16
/// connections.
async fn baseline(env: &TestEnv, sessions: &[SessionId], total: usize) -> anyhow::Result<f64> {
    let pool = turnlog_runtime::db::connect(&env.database_url, 16).await?;
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (pool, next, sessions) = (pool.clone(), next.clone(), sessions.to_vec());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return anyhow::Ok(());
                }
                let session = sessions[i % sessions.len()];
                let body = message(i);
                let mut tx = pool.begin().await?;
                let (last,): (i64,) = sqlx::query_as("SELECT last_seq FROM sessions WHERE id = $1 FOR UPDATE")
                    .bind(session.0)
                    .fetch_one(&mut *tx)
                    .await?;
                sqlx::query(
                    "INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
                     VALUES ($1, $2, $3, 'user_message', $4, $5, 0, now())",
                )
                .bind(session.0)
                .bind(last + 1)
                .bind(Uuid::now_v7())
                .bind(body.to_payload())
                .bind(turnlog_core::tokens::event_tokens(&body) as i32)
                .execute(&mut *tx)
                .await?;
                sqlx::query(
                    "UPDATE sessions SET last_seq = $2, updated_at = now(), active_at = now() WHERE id = $1",
                )
                .bind(session.0)
                .bind(last + 1)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// The ceiling: the same rows as array inserts of 500, one connection, no bus. The rows
/// (tokens counted, payloads built) are made before the clock starts: only the database's
/// share is timed.
async fn raw_ceiling(env: &TestEnv, sessions: &[SessionId], total: usize) -> anyhow::Result<f64> {
    insert_rate(env, sessions, total, "session_events").await
}

/// The same rows into a table with only its primary key (no secondary index, no unique
/// constraint, not our schema): a reference for the machine's own speed that does not
/// depend on turnlog's indexes.
async fn plain_ceiling(env: &TestEnv, sessions: &[SessionId], total: usize) -> anyhow::Result<f64> {
    sqlx::query(
        "CREATE TABLE plain_events (session_id uuid, seq bigint, event_id uuid, kind text, payload jsonb,
                                    tokens int, stream_seq bigint, created_at timestamptz,
                                    PRIMARY KEY (session_id, seq))",
    )
    .execute(&env.pool)
    .await?;
    let rate = insert_rate(env, sessions, total, "plain_events").await;
    sqlx::query("DROP TABLE plain_events").execute(&env.pool).await?;
    rate
}

/// Events per second inserting `total` user messages into `table` (shaped like
/// `session_events`) in arrays of 500 on one connection, built before the clock starts.
async fn insert_rate(
    env: &TestEnv,
    sessions: &[SessionId],
    total: usize,
    table: &str,
) -> anyhow::Result<f64> {
    let pool = turnlog_runtime::db::connect(&env.database_url, 1).await?;
    let mut seq = vec![1_000_000i64; sessions.len()];
    let mut chunks = Vec::new();
    for chunk in (0..total).collect::<Vec<_>>().chunks(500) {
        let (mut ids, mut seqs, mut payloads, mut tokens) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &i in chunk {
            let s = i % sessions.len();
            seq[s] += 1;
            let body = message(i);
            ids.push(sessions[s].0);
            seqs.push(seq[s]);
            tokens.push(turnlog_core::tokens::event_tokens(&body) as i32);
            payloads.push(body.to_payload());
        }
        chunks.push((ids, seqs, payloads, tokens));
    }
    let start = Instant::now();
    for (ids, seqs, payloads, tokens) in &chunks {
        sqlx::query(&format!(
            "INSERT INTO {table} (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
             SELECT s, q, gen_random_uuid(), 'user_message', p, t, 0, now()
               FROM UNNEST($1::uuid[], $2::int8[], $3::jsonb[], $4::int4[]) AS u(s, q, p, t)"
        ))
        .bind(ids)
        .bind(seqs)
        .bind(payloads)
        .bind(tokens)
        .execute(&pool)
        .await?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// Every 20 ms until `stop`, a probe: a message appended to `probe` (acknowledged as
/// committed), then the time until the search index has it, polled every 5 ms. Probes
/// overlap, so their number does not depend on the lag they measure.
async fn search_lags(
    bus: Bus,
    pool: sqlx::PgPool,
    probe: SessionId,
    stop: CancellationToken,
) -> anyhow::Result<Vec<Duration>> {
    let mut probes = Vec::new();
    let mut ticker = tokio::time::interval(Duration::from_millis(20));
    let mut i = 0;
    while !stop.is_cancelled() {
        ticker.tick().await;
        i += 1;
        let (bus, pool) = (bus.clone(), pool.clone());
        probes.push(tokio::spawn(async move {
            let req = AppendRequest::append(probe, &owner(), Uuid::now_v7(), &message(i));
            let outcome = append_and_wait(&bus, &pool, &req, Duration::from_secs(30)).await?;
            let seq = outcome.seq.context("probe not committed")?;
            let committed = Instant::now();
            loop {
                let found: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM search_entries WHERE session_id = $1 AND seq = $2)",
                )
                .bind(probe.0)
                .bind(seq)
                .fetch_one(&pool)
                .await?;
                if found {
                    return anyhow::Ok(committed.elapsed());
                }
                anyhow::ensure!(committed.elapsed() < Duration::from_secs(60), "probe {seq} never indexed");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    let mut lags = Vec::with_capacity(probes.len());
    for p in probes {
        lags.push(p.await??);
    }
    Ok(lags)
}

/// The `q` quantile of `samples`, in milliseconds (0 when there are none).
fn percentile_ms(samples: &[Duration], q: f64) -> f64 {
    let mut sorted: Vec<Duration> = samples.to_vec();
    sorted.sort_unstable();
    let Some(last) = sorted.len().checked_sub(1) else { return 0.0 };
    sorted[((last as f64) * q).round() as usize].as_secs_f64() * 1e3
}

/// Appends of the CPU run, after [`CPU_WARM_UP`] of warm-up.
const CPU_APPENDS: usize = 40_000;
const CPU_WARM_UP: usize = 4_000;

/// The CPU an append costs end to end (the load of [`end_to_end`], 16 sessions), on private
/// servers so that nothing else is counted: a `turnlog writer` process, a nats-server and
/// a Postgres (its postmaster and every backend) of this run's own, measured from the first
/// publish until the search index has every append. The bench's producers are not counted.
pub(crate) async fn cpu_per_append() -> anyhow::Result<(f64, Spent)> {
    let bin = crate::soak::turnlog_binary()?;
    let (pg, nats) = (private_postgres(free_port()).await, private_nats(free_port()).await);
    let env = test_env_on(Some(&pg.url()), Some(&nats.url())).await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await?;
    bus.ensure_topology(None).await?;
    let mut writer = TurnlogProcess::start(&bin, &env, &["writer"], &[]);
    let sessions = sessions_on(&bus, &env, 16).await?;
    end_to_end(&bus, &sessions, CPU_WARM_UP).await?;
    env.search_caught_up().await;
    let meter = Meter::new(vec![
        ("writer", Part::turnlog(&[&writer])),
        ("postgres", Part::postgres(&pg)),
        ("nats", Part::nats(&nats)),
    ]);
    crate::cpu::statements_reset(&env.pool).await;
    let (rate, spent) = meter
        .measure(async {
            let rate = end_to_end(&bus, &sessions, CPU_APPENDS).await;
            env.search_caught_up().await;
            rate
        })
        .await;
    crate::cpu::statements_top(&env.pool, 15, CPU_APPENDS as f64, "/append").await;
    writer.terminate();
    writer.wait_exit(Duration::from_secs(20)).await;
    drop(bus);
    env.cleanup().await;
    Ok((rate?, spent))
}

/// Prints the CPU run's figures and returns the RESULT line's part of them.
pub(crate) async fn cpu_figures() -> anyhow::Result<String> {
    let (rate, spent) = cpu_per_append().await?;
    let per = CPU_APPENDS as f64;
    println!(
        "CPU per append end to end ({CPU_APPENDS} appends at {rate:.0}/s, 16 sessions, search indexing on; private servers): \
         {:.1} µs ({})",
        spent.total() * 1e6 / per,
        spent.describe(1e6, per, "µs")
    );
    Ok(format!(
        "cpu_us_per_append={:.1} {}",
        spent.total() * 1e6 / per,
        spent.split("cpu_us_per_append", 1e6, per)
    ))
}

/// The writer's commit-time histogram so far, from its metrics (this process's writer):
/// (bound in seconds, commits that took at most that long), the last bound infinite.
fn commits() -> Vec<(f64, f64)> {
    let text = turnlog_runtime::telemetry::registry().render();
    text.lines()
        .filter_map(|l| l.strip_prefix("turnlog_writer_commit_seconds_bucket{le=\""))
        .filter_map(|l| {
            let (bound, count) = l.split_once("\"} ")?;
            let bound = if bound == "+Inf" { f64::INFINITY } else { bound.parse().ok()? };
            Some((bound, count.trim().parse().ok()?))
        })
        .collect()
}

/// `writer latency`: `append_and_wait` at 1,000/s on the shared servers after a load that
/// warms them, with its stages and the writer's commits over the same seconds.
async fn latency_figures() -> anyhow::Result<()> {
    let mut rig = Rig::new().await?;
    let durable = u8::from(rig.env.durable().await?);
    rig.start_writer();
    let sessions = rig.sessions(16).await?;
    end_to_end(&rig.bus, &sessions, 20_000).await?;
    let before = commits();
    let latency = latency_at(&rig, &sessions, 1000, 10).await?;
    let after = commits();
    // Commits in the window at most each bound took: how many, how many over 5 ms, and
    // the bound the slowest stayed under.
    let within: Vec<(f64, f64)> =
        after.iter().enumerate().map(|(i, a)| (a.0, a.1 - before.get(i).map_or(0.0, |b| b.1))).collect();
    let count = within.last().map_or(0.0, |b| b.1);
    let quick = within.iter().find(|b| b.0 >= 0.005).map_or(0.0, |b| b.1);
    let slow_pct = 100.0 * (count - quick) / count.max(1.0);
    let slowest_ms = within.iter().find(|b| b.1 >= count).map_or(f64::INFINITY, |b| b.0 * 1e3);
    println!(
        "append_and_wait at 1,000/s offered: p50 {:.2} ms, p99 {:.2} ms, max {:.1} ms; the writer's commits \
         meanwhile: {count:.0}, {slow_pct:.1}% over 5 ms, the slowest under {slowest_ms} ms",
        latency.p50(),
        latency.p99(),
        latency.max(),
    );
    println!(
        "RESULT writer_latency p50_ms={:.2} p99_ms={:.2} max_ms={:.1} commits={count:.0} \
         commits_over_5ms_pct={slow_pct:.1} slowest_commit_under_ms={slowest_ms} durable={durable}",
        latency.p50(),
        latency.p99(),
        latency.max(),
    );
    rig.stop_writer().await?;
    rig.env.cleanup().await;
    Ok(())
}

pub(crate) async fn run(args: &[String]) -> anyhow::Result<()> {
    turnlog_core::tokens::warm_up();
    match args.first().map(String::as_str) {
        Some("cpu") => {
            let cpu = cpu_figures().await?;
            println!("RESULT writer_cpu {cpu}");
            return Ok(());
        }
        Some("bus") => return crate::bus_cost::run().await,
        Some("latency") => return latency_figures().await,
        _ => {}
    }
    let cpu = cpu_figures().await?;
    let mut rig = Rig::new().await?;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'wal_sync_method')",
    )
    .fetch_all(&rig.env.pool)
    .await?;
    println!("postgres: {settings:?}  nats: {}", rig.env.nats_url);
    let durable = u8::from(rig.env.durable().await?);
    if durable == 0 {
        println!("WARNING: commits are not durable on this server (RESULT says durable=0); set DATABASE_URL to a durable one");
    }
    rig.start_writer();

    let s1 = rig.sessions(1).await?;
    let s16 = rig.sessions(16).await?;
    let s256 = rig.sessions(256).await?;
    let total = 40_000;
    let e1 = end_to_end(&rig.bus, &s1, total / 2).await?;
    // Under the full load, how long a committed message takes to become searchable.
    let probe = rig.sessions(1).await?[0];
    let loaded = CancellationToken::new();
    let lags = tokio::spawn(search_lags(rig.bus.clone(), rig.env.pool.clone(), probe, loaded.clone()));
    let e16 = end_to_end(&rig.bus, &s16, total).await?;
    loaded.cancel();
    let lags = lags.await??;
    let lag_p99 = percentile_ms(&lags, 0.99);
    println!(
        "search lag under that load (commit acknowledged → row in search_entries), {} probes: p50 {:.0} ms, p99 {lag_p99:.0} ms",
        lags.len(),
        percentile_ms(&lags, 0.5)
    );
    let e256 = end_to_end(&rig.bus, &s256, total).await?;
    println!(
        "end to end (pipelined producers: up to 16, {WINDOW} requests in flight each, replies counted on one \
         inbox each), appends/s: 1 session {e1:.0}, 16 sessions {e16:.0}, 256 sessions {e256:.0}"
    );
    let latency = latency_at(&rig, &s16, 1000, 10).await?;
    let (p50, p99) = (latency.p50(), latency.p99());
    println!(
        "append_and_wait (one request, one inbox, the outcome awaited) at 1,000/s offered: p50 {p50:.2} ms, \
         p99 {p99:.2} ms, max {:.1} ms",
        latency.max(),
    );
    let drained = drain(&mut rig, &s256, total).await?;
    println!("writer alone draining {total} pre-filled requests: {drained:.0}/s");
    rig.stop_writer().await?;
    let base = baseline(&rig.env, &s16, 10_000).await?;
    println!("baseline (transaction per event, 16 connections): {base:.0}/s");
    let raw = raw_ceiling(&rig.env, &s16, total).await?;
    println!("raw ceiling (array inserts of 500, one connection): {raw:.0}/s");
    let plain = plain_ceiling(&rig.env, &s16, total).await?;
    println!("plain ceiling (the same rows into a table with only its primary key): {plain:.0}/s");
    println!("end to end vs plain ceiling: {:.2}", e16 / plain);
    println!("end to end vs baseline: {:.1}x", e16 / base);
    println!(
        "RESULT writer events_per_s={:.0} events_per_s_1={:.0} events_per_s_256={:.0} drain_per_s={:.0} baseline_per_s={:.0} raw_ceiling_per_s={:.0} p50_ms={:.2} p99_ms={:.2} durable={durable} search_lag_p99_ms={lag_p99:.0} plain_ceiling_per_s={plain:.0} {cpu}",
        e16, e1, e256, drained, base, raw, p50, p99
    );
    rig.env.cleanup().await;
    Ok(())
}
