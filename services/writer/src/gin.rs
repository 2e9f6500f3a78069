//! Keeps the GIN indexes' pending lists short, off the commit path. A GIN index takes new
//! rows into a pending list and merges the list into its tree once it outgrows
//! `gin_pending_list_limit` (4 MB), inside whichever insert overflowed it: on this machine
//! a commit that did so took 80–130 ms instead of 25, once every ~19,000 user messages —
//! the writer's latency tail. Merging the lists from a separate connection every second
//! (or sooner under load) keeps them far below the limit; an insert that finds a merge
//! under way does not wait for it. Autovacuum merges them too, but only after a share of
//! the table has changed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Longest time between merges while rows come in.
const MERGE_EVERY: Duration = Duration::from_secs(1);
/// Rows written since the last merge that call for one sooner (a few hundred kB of
/// pending entries).
const MERGE_AFTER_ROWS: usize = 4_000;

/// Rows the writer committed since the last merge.
#[derive(Default)]
pub(crate) struct PendingRows {
    rows: AtomicUsize,
    wake: Notify,
}

impl PendingRows {
    pub(crate) fn add(&self, rows: usize) {
        if rows > 0 && self.rows.fetch_add(rows, Ordering::Relaxed) + rows >= MERGE_AFTER_ROWS {
            self.wake.notify_one();
        }
    }
}

/// Merges the pending lists of every GIN index in the writer's schema whenever rows were
/// written, until `shutdown`. Stops (leaving merges to the inserts and autovacuum) if the
/// database user may not: merging needs the index's owner, as VACUUM does.
pub(crate) async fn merge_pending_lists(
    pool: PgPool,
    pending: std::sync::Arc<PendingRows>,
    shutdown: CancellationToken,
) {
    let mut indexes: Vec<String> = Vec::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(MERGE_EVERY) => {}
            _ = pending.wake.notified() => {}
        }
        if pending.rows.swap(0, Ordering::Relaxed) == 0 {
            continue;
        }
        if indexes.is_empty() {
            match gin_indexes(&pool).await {
                Ok(found) => indexes = found,
                Err(e) => {
                    tracing::warn!(error = %e, "listing GIN indexes failed; will retry");
                    continue;
                }
            }
        }
        for index in &indexes {
            let started = std::time::Instant::now();
            let merged = sqlx::query_scalar::<_, i64>("SELECT gin_clean_pending_list($1::regclass)")
                .bind(index)
                .fetch_one(&pool)
                .await;
            match merged {
                Ok(pages) => {
                    let elapsed_us = started.elapsed().as_micros() as u64;
                    tracing::debug!(index, pages, elapsed_us, "GIN pending list merged")
                }
                Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42501") => {
                    tracing::warn!(index, error = %d,
                        "may not merge GIN pending lists (not the indexes' owner); inserts will");
                    return;
                }
                Err(e) => {
                    tracing::warn!(index, error = %e, "merging a GIN pending list failed; will retry");
                    indexes.clear();
                    break;
                }
            }
        }
    }
}

async fn gin_indexes(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT c.oid::regclass::text FROM pg_class c
           JOIN pg_am a ON a.oid = c.relam
          WHERE a.amname = 'gin' AND c.relkind = 'i' AND c.relnamespace = current_schema()::regnamespace
          ORDER BY 1",
    )
    .fetch_all(pool)
    .await
}
