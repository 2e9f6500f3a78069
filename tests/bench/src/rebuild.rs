//! Reprocessing history: `turnlog rebuild` (TURNLOG_APPEND applied into an empty database
//! by the writer's apply-only mode) and `turnlog replay` (the distiller's handler over the
//! whole committed-event feed) on a ~200,000-event history. The history is published
//! straight to TURNLOG_APPEND and applied by the live writer first, which also gives the
//! live drain rate to compare with. Needs a durable Postgres (DATABASE_URL) and a nats-server.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use sqlx::Connection as _;
use tokio_util::sync::CancellationToken;
use turnlog_e2e::{config, history};
use turnlog_ops::{Replay, ReplayFrom};
use turnlog_runtime::bus::Bus;
use turnlog_runtime::worker::ConsumerSettings;
use turnlog_testkit::test_env;

use crate::cpu::{self, Meter, Part};

/// 2,000 sessions of 19 turns: about 206,000 events, 38,000 of them answers.
const SHAPE: history::Shape = history::Shape { sessions: 2_000, turns: 19, awkward: false };
const TARGET_REBUILD_PER_S: f64 = 40_000.0;

pub(crate) async fn run() -> anyhow::Result<()> {
    turnlog_core::tokens::warm_up();
    let env = test_env().await;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'wal_sync_method')",
    )
    .fetch_all(&env.pool)
    .await?;
    println!("postgres: {settings:?}  nats: {}", env.nats_url);
    let durable = u8::from(env.durable().await?);
    if durable == 0 {
        println!("WARNING: commits are not durable on this server (RESULT says durable=0); set DATABASE_URL to a durable one");
    }
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await?;
    bus.ensure_topology(None).await?;

    let started = Instant::now();
    let history = history::history(SHAPE);
    println!(
        "history: {} requests, {} events, made in {:.1} s",
        history.messages.len(),
        history.events(),
        started.elapsed().as_secs_f64()
    );

    // The live writer applies it as it arrives (publishing and applying overlap).
    let stop_writer = CancellationToken::new();
    let writer = tokio::spawn(turnlog_writer::run(config::writer(&env), stop_writer.clone()));
    let started = Instant::now();
    let last = history::publish(&bus, &history.messages).await;
    let published = started.elapsed();
    history::applied_through(&env.pool, last, Duration::from_secs(600)).await;
    let live = started.elapsed();
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM session_events").fetch_one(&env.pool).await?;
    anyhow::ensure!(
        events == history.events(),
        "the live writer applied {events} events, not {}",
        history.events()
    );
    let live_per_s = events as f64 / live.as_secs_f64();
    println!(
        "live writer: {events} events published in {:.1} s and applied in {:.1} s: {live_per_s:.0} events/s",
        published.as_secs_f64(),
        live.as_secs_f64()
    );

    let target = env.extra_database().await;
    // The rebuild runs in this process; its Postgres is the test server (nats-server is
    // not counted: it may be the machine's shared one).
    let meter = Meter::new(vec![
        ("turnlog", Part::Processes(vec![std::process::id()])),
        ("postgres", Part::Postgres(cpu::postmaster(&env.pool).await?)),
    ]);
    let (summary, spent) = meter.measure(turnlog_ops::rebuild(&target, &bus, false)).await;
    let summary = summary?;
    let rebuild_per_s = summary.events as f64 / summary.elapsed.as_secs_f64();
    // The machine's speed moves between runs more than most changes move the rebuild; the
    // live writer applied the same history a minute before, so their ratio moves a little less.
    let rebuild_per_live = rebuild_per_s / live_per_s;
    let cpu_per_event = spent.total() * 1e6 / summary.events as f64;
    let started = Instant::now();
    let verdict = turnlog_ops::verify(&env.database_url, &target).await?;
    anyhow::ensure!(verdict.is_identical(), "the rebuilt database differs: {verdict}");
    println!("verify: {:.1} s", started.elapsed().as_secs_f64());

    // Every answer was distilled already (the history holds each turn_memory under the id
    // the distiller derives), so the replay measures reprocessing: the feed read, each
    // answer's handler finding its work done, no model call.
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await?;
    let concurrency = 32;
    let replay = Replay::new(ReplayFrom::Sequence(1), None);
    let config = turnlog_distiller::DistillerConfig {
        consumer: ConsumerSettings { concurrency, replay: Some(replay.clone()), ..Default::default() },
        ..config::distiller(&env, &mock.base_url())
    };
    let run = |stop| turnlog_distiller::run(config, stop);
    let replay = turnlog_ops::replay("distiller", &replay, false, CancellationToken::new(), run);
    let replayed = replay.await?;
    let handled = replayed.handled + replayed.dead_lettered;
    let replay_per_s = handled as f64 / replayed.elapsed.as_secs_f64();
    let feed_per_s = replayed.through_seq as f64 / replayed.elapsed.as_secs_f64();
    let events_after: i64 =
        sqlx::query_scalar("SELECT count(*) FROM session_events").fetch_one(&env.pool).await?;
    anyhow::ensure!(events_after == events, "the replay appended {} events", events_after - events);
    anyhow::ensure!(mock.log().entries().is_empty(), "the replay called the model");

    println!(
        "rebuild: {} events in {:.1} s: {rebuild_per_s:.0} events/s (target {TARGET_REBUILD_PER_S:.0}; the live \
         writer {live_per_s:.0}, so {rebuild_per_live:.2}x its rate); CPU {cpu_per_event:.1} µs an event ({})",
        summary.events,
        summary.elapsed.as_secs_f64(),
        spent.describe(1e6, summary.events as f64, "µs")
    );
    println!(
        "replay (distiller, concurrency {concurrency}): {handled} answers handled in {:.1} s: {replay_per_s:.0} \
         events/s ({feed_per_s:.0} feed events/s spanned); nothing appended, no model call",
        replayed.elapsed.as_secs_f64()
    );

    stop_writer.cancel();
    writer.await.context("writer panicked")??;
    drop_database(&env.admin_url, &target).await?;
    env.cleanup().await;
    println!(
        "RESULT rebuild rebuild_per_s={rebuild_per_s:.0} rebuild_per_live={rebuild_per_live:.2} cpu_us_per_event={cpu_per_event:.1} {} replay_per_s={replay_per_s:.0} live_writer_per_s={live_per_s:.0} events={} durable={durable}",
        spent.split("cpu_us_per_event", 1e6, summary.events as f64),
        summary.events
    );
    Ok(())
}

async fn drop_database(admin_url: &str, url: &str) -> anyhow::Result<()> {
    let name = url.rsplit('/').next().and_then(|n| n.split('?').next()).context("database name")?;
    let mut admin = sqlx::PgConnection::connect(admin_url).await?;
    sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut admin).await?;
    Ok(())
}
