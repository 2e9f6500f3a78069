//! `turnlog rebuild`: the database rebuilt from TURNLOG_APPEND by the writer's apply-only
//! mode, with a progress bar. The target is migrated first, so an empty database made with
//! `createdb` is enough; a target holding anything (rows, or tables not turnlog's) is refused.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use turnlog_runtime::bus::Bus;
use turnlog_writer::{RebuildProgress, RebuildSummary};

use crate::progress;

/// Rebuilds into `database_url` from the APPEND stream of `bus`; prints a summary.
pub async fn rebuild(database_url: &str, bus: &Bus, show_progress: bool) -> anyhow::Result<RebuildSummary> {
    let pool =
        turnlog_runtime::db::connect(database_url, 1).await.context("connecting to the target database")?;
    // Migrating creates turnlog's tables: only in a database that has none of its own, so a
    // mistyped URL cannot turn another application's database into a rebuild target.
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema()")
            .fetch_all(&pool)
            .await
            .context("reading the target database")?;
    let turnlog =
        ["_sqlx_migrations", "sessions", "session_events"].iter().all(|t| tables.iter().any(|n| n == t));
    anyhow::ensure!(
        tables.is_empty() || turnlog,
        "the target database holds tables that are not turnlog's ({}): rebuild into a new, empty database",
        tables.join(", ")
    );
    turnlog_runtime::db::migrate(&pool).await.context("migrating the target database")?;
    pool.close().await;

    let shown = Arc::new(RebuildProgress::default());
    let bar = progress::bar(show_progress, "rebuild", "requests");
    let work = turnlog_writer::rebuild(database_url, bus, shown.clone());
    tokio::pin!(work);
    let summary = loop {
        tokio::select! {
            done = &mut work => break done,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                bar.set_length(shown.total.load(Ordering::Relaxed));
                bar.set_position(shown.applied.load(Ordering::Relaxed));
                let events = shown.events.load(Ordering::Relaxed);
                bar.set_message(format!("{events} events, {:.0} events/s", progress::rate(events, bar.elapsed())));
            }
        }
    };
    bar.finish_and_clear();
    let summary = summary?;
    let positions: Vec<String> = summary.positions.iter().map(|(p, seq)| format!("{p}:{seq}")).collect();
    println!(
        "rebuilt {} events from {} requests in {:.1} s ({:.0} events/s); {} refused as when first applied \
         (not dead-lettered again), {} rejected outcomes recorded; partition positions {}",
        summary.events,
        summary.messages,
        summary.elapsed.as_secs_f64(),
        progress::rate(summary.events, summary.elapsed),
        summary.dead_lettered,
        summary.rejected,
        positions.join(" "),
    );
    if summary.unread > 0 {
        println!(
            "warning: {} requests in TURNLOG_APPEND were on no partition rebuilt (0..{}): is --partitions right?",
            summary.unread,
            bus.partitions
        );
    }
    Ok(summary)
}
