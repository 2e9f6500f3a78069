//! `turnlog replay`: a worker's own `run` in replay mode (`ConsumerSettings::replay`), so its handler goes over
//! past committed events on a temporary consumer — from a sequence or a time, optionally
//! one session — through the feed's last event at start, with a progress bar. Handlers are
//! idempotent, so a replay appends only what is missing.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;
use turnlog_runtime::worker::{Replay, ReplayFrom};

use crate::progress;

/// What a finished replay did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplaySummary {
    /// Events the replay was to handle.
    pub total: u64,
    /// Events handled (acknowledged), dead letters among them not counted.
    pub handled: u64,
    pub dead_lettered: u64,
    /// Failed deliveries (each retried or dead-lettered).
    pub failed: u64,
    /// The feed's last sequence at start: where the replay ended.
    pub through_seq: u64,
    pub elapsed: Duration,
}

/// Replays `worker` (its name, for messages) by running `run` — the worker's
/// `run(config, shutdown)`, `replay` set in its consumer settings — until through;
/// `shutdown` stops it early. Prints a summary; fails when the replay did.
pub async fn replay<F, Fut>(
    worker: &str,
    replay: &Replay,
    show_progress: bool,
    shutdown: CancellationToken,
    run: F,
) -> anyhow::Result<ReplaySummary>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let shown = replay.progress.clone();
    // Stops the worker's other duties (the compactor's pre-send checks) once through.
    let stop = shutdown.child_token();
    let mut work = tokio::spawn(run(stop.clone()));
    let bar = progress::bar(show_progress, worker, "events");
    let started = tokio::time::Instant::now();
    let ended = loop {
        tokio::select! {
            ended = &mut work => break ended,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                let stats = shown.stats.snapshot();
                bar.set_length(shown.total.load(Ordering::Relaxed));
                bar.set_position(stats.processed + stats.dead_lettered);
                bar.set_message(format!("{} dead-lettered", stats.dead_lettered));
                if shown.is_finished() {
                    stop.cancel();
                }
            }
        }
    };
    bar.finish_and_clear();
    ended.context("the worker panicked")?.with_context(|| format!("the {worker} worker failed"))?;
    anyhow::ensure!(shown.is_finished(), "the {worker} worker stopped before replaying");
    if let Some(e) = shown.error() {
        anyhow::bail!("replaying {worker}: {e}");
    }
    let stats = shown.stats.snapshot();
    let summary = ReplaySummary {
        total: shown.total.load(Ordering::Relaxed),
        handled: stats.processed,
        dead_lettered: stats.dead_lettered,
        failed: stats.failed,
        through_seq: shown.through_seq.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
    };
    let scope = replay.session.map(|s| format!(" of session {s}")).unwrap_or_default();
    let start = match replay.from {
        ReplayFrom::Sequence(seq) => format!("sequence {seq}"),
        ReplayFrom::Time(t) => t.to_rfc3339(),
    };
    let stopped = if shutdown.is_cancelled() { " (stopped early)" } else { "" };
    println!(
        "replayed {worker} over the feed{scope} from {start} through sequence {}{stopped}: {} events handled, \
         {} dead-lettered, {} failed deliveries, in {:.1} s ({:.0} events/s)",
        summary.through_seq,
        summary.handled,
        summary.dead_lettered,
        summary.failed,
        summary.elapsed.as_secs_f64(),
        progress::rate(summary.handled + summary.dead_lettered, summary.elapsed),
    );
    Ok(summary)
}

/// A `--since` that names no start, as the flag parser shows it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinceError {
    #[error("{0:?} is neither an RFC 3339 time nor a duration like 90m or 2d")]
    Neither(String),
    #[error("{given:?}: {source}")]
    TooLong { given: String, source: chrono::OutOfRangeError },
}

/// `--since`: an RFC 3339 time (`2026-05-01T12:00:00Z`) or a duration ago (`90m`, `2d`).
pub fn parse_since(s: &str) -> Result<DateTime<Utc>, SinceError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s.trim()) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = turnlog_runtime::settings::parse_duration(s).map_err(|_| SinceError::Neither(s.to_owned()))?;
    let ago = chrono::Duration::from_std(ago)
        .map_err(|source| SinceError::TooLong { given: s.to_owned(), source })?;
    Ok(Utc::now() - ago)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_takes_a_time_or_a_duration_ago() {
        let t = parse_since("2026-05-01T12:00:00+02:00").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-05-01T10:00:00+00:00");
        let ago = Utc::now() - parse_since("90m").unwrap();
        assert!((ago.num_seconds() - 5400).abs() < 5, "{ago:?}");
        assert!(parse_since("yesterday").is_err());
    }
}
