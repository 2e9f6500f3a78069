//! The search index (DESIGN §2), kept by the writer off its commit path: each partition's
//! indexer takes the committed user messages and answers the publisher hands it, and
//! writes them to `search_entries` in its own batches and transactions with its own
//! position (`search_positions`), from which it catches up after a restart. Search trails
//! the log by about [`INDEX_EVERY`].

use std::time::Duration;

use anyhow::Context as _;
use sqlx::PgPool;
use turnlog_core::events::EventKind;
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::partition_of;
use uuid::Uuid;

use crate::apply::EventRow;
use crate::commit::data_error;

/// How long committed events wait to be indexed together.
pub(crate) const INDEX_EVERY: Duration = Duration::from_millis(200);
/// Events indexed in one transaction at most.
const INDEX_BATCH: usize = 5_000;
/// Class of the transaction-level advisory lock an index write and a delete of the same
/// partition take, so that a delete never leaves behind rows indexed meanwhile ("TLSX").
pub(crate) const LOCK_CLASS: i32 = 0x544C_5358;

/// What a batch of commits leaves to index: the events that are found by search, and the
/// APPEND sequence the index is then complete through.
pub(crate) struct Committed {
    pub events: Vec<(SessionId, i64)>,
    pub through: i64,
}

impl Committed {
    pub(crate) fn of<'a>(events: impl IntoIterator<Item = &'a EventRow>, through: i64) -> Self {
        let events = events
            .into_iter()
            .filter(|e| searchable(e.event.kind))
            .map(|e| (e.event.session_id, e.event.seq))
            .collect();
        Self { events, through }
    }
}

fn searchable(kind: EventKind) -> bool {
    matches!(kind, EventKind::UserMessage | EventKind::AssistantTurn)
}

/// Indexes partition `partition`'s committed events: first those committed before its
/// position (a previous writer's, up to `applied`), then whatever `commits` brings, until
/// it closes. An error ends it; the next writer catches up from the position.
pub(crate) async fn indexer(
    pool: PgPool,
    partition: i32,
    partitions: u32,
    applied: i64,
    mut commits: tokio::sync::mpsc::Receiver<Committed>,
    merge: std::sync::Arc<crate::gin::PendingRows>,
) -> anyhow::Result<()> {
    merge.add(catch_up(&pool, partition, partitions, applied).await?);
    let mut pending: Vec<(SessionId, i64)> = Vec::new();
    let mut through = None;
    loop {
        let first = match commits.recv().await {
            Some(c) => c,
            None => break,
        };
        pending.extend(first.events);
        through = Some(first.through);
        // Gather what commits meanwhile, for at most INDEX_EVERY.
        let deadline = tokio::time::Instant::now() + INDEX_EVERY;
        while pending.len() < INDEX_BATCH {
            match tokio::time::timeout_at(deadline, commits.recv()).await {
                Ok(Some(c)) => {
                    pending.extend(c.events);
                    through = Some(c.through);
                }
                Ok(None) | Err(_) => break,
            }
        }
        if let Some(t) = through.take() {
            let started = std::time::Instant::now();
            index(&pool, partition, &pending, t).await?;
            let elapsed_us = started.elapsed().as_micros() as u64;
            tracing::debug!(partition, events = pending.len(), elapsed_us, "search index written");
            crate::metrics::metrics().indexed(partition.unsigned_abs(), t);
            // The rows just written wait in the full-text index's pending list.
            merge.add(pending.len());
            pending.clear();
        }
    }
    if let Some(t) = through {
        index(&pool, partition, &pending, t).await?;
        merge.add(pending.len());
    }
    Ok(())
}

/// Indexes the events of the partition committed after its search position and through
/// `applied`: those a previous writer committed but did not index. Returns how many.
async fn catch_up(pool: &PgPool, partition: i32, partitions: u32, applied: i64) -> anyhow::Result<usize> {
    sqlx::query("INSERT INTO search_positions (partition) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(partition)
        .execute(pool)
        .await?;
    let indexed: i64 = sqlx::query_scalar("SELECT stream_seq FROM search_positions WHERE partition = $1")
        .bind(partition)
        .fetch_one(pool)
        .await?;
    if indexed >= applied {
        return Ok(0);
    }
    let rows: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT session_id, seq FROM session_events
          WHERE stream_seq > $1 AND stream_seq <= $2 AND kind IN ('user_message', 'assistant_turn')",
    )
    .bind(indexed)
    .bind(applied)
    .fetch_all(pool)
    .await?;
    let own: Vec<(SessionId, i64)> = rows
        .into_iter()
        .map(|(s, seq)| (SessionId(s), seq))
        .filter(|(s, _)| i64::from(partition_of(*s, partitions)) == i64::from(partition))
        .collect();
    tracing::info!(partition, indexed, applied, events = own.len(), "search index catching up");
    for chunk in own.chunks(INDEX_BATCH) {
        index(pool, partition, chunk, indexed).await?;
    }
    index(pool, partition, &[], applied).await?;
    Ok(own.len())
}

/// Indexes `events` and moves the partition's position to `through`. When the database
/// refuses the batch for its data, each event is indexed alone and one it still refuses is
/// left out, with its reason logged and counted (`turnlog_writer_search_skipped_total`):
/// search never stops a partition. Other errors (a lost connection) end the indexer.
async fn index(
    pool: &PgPool,
    partition: i32,
    events: &[(SessionId, i64)],
    through: i64,
) -> anyhow::Result<()> {
    let refused = match index_once(pool, partition, events, through).await {
        Ok(()) => return Ok(()),
        Err(e) => match data_error(&e) {
            Some(why) if !events.is_empty() => why,
            _ => return Err(e).context("writing the search index"),
        },
    };
    tracing::warn!(
        partition,
        events = events.len(),
        error = refused,
        "search index batch refused; indexing its events one by one"
    );
    for &(session, seq) in events {
        if let Err(e) = index_once(pool, partition, &[(session, seq)], 0).await {
            let Some(why) = data_error(&e) else {
                return Err(e).context("writing the search index");
            };
            tracing::warn!(partition, %session, seq, error = why, "event left out of the search index");
            crate::metrics::metrics().search_skipped();
        }
    }
    index_once(pool, partition, &[], through).await.context("moving the search position")
}

/// One index write: the events' rows (those still stored: a delete may have come first)
/// and the partition's position, in one transaction under the partition's index lock.
async fn index_once(
    pool: &PgPool,
    partition: i32,
    events: &[(SessionId, i64)],
    through: i64,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(LOCK_CLASS)
        .bind(partition)
        .execute(&mut *tx)
        .await?;
    if !events.is_empty() {
        sqlx::query(INDEX_EVENTS)
            .bind(events.iter().map(|(s, _)| s.0).collect::<Vec<_>>())
            .bind(events.iter().map(|(_, seq)| *seq).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query("UPDATE search_positions SET stream_seq = GREATEST(stream_seq, $2) WHERE partition = $1")
        .bind(partition)
        .bind(through)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// The search rows of the events `$1`/`$2` (session ids, seqs) name, from the stored events
/// (`turnlog_search_text`, the one definition of an event's searchable text, which keeps
/// the first 65,536 characters: a tsvector holds at most 1 MB).
const INDEX_EVENTS: &str = "INSERT INTO search_entries (session_id, seq, owner, kind, body, created_at)
     SELECT e.session_id, e.seq, s.owner,
            CASE e.kind WHEN 'user_message' THEN 'user' ELSE 'assistant' END, t.body, e.created_at
       FROM UNNEST($1::uuid[], $2::int8[]) AS k(session_id, seq)
       JOIN session_events e ON e.session_id = k.session_id AND e.seq = k.seq
       JOIN sessions s ON s.id = e.session_id
      CROSS JOIN LATERAL (SELECT turnlog_search_text(e.kind, e.payload) AS body) t
      WHERE t.body IS NOT NULL
     ON CONFLICT (session_id, seq) DO NOTHING";

/// The whole index recomputed from the stored events, and every partition's position set
/// to the writer's: the end of `turnlog rebuild`.
pub(crate) async fn reindex_all(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM search_entries").execute(&mut *conn).await?;
    sqlx::query(
        "INSERT INTO search_entries (session_id, seq, owner, kind, body, created_at)
         SELECT e.session_id, e.seq, s.owner,
                CASE e.kind WHEN 'user_message' THEN 'user' ELSE 'assistant' END, t.body, e.created_at
           FROM session_events e
           JOIN sessions s ON s.id = e.session_id
          CROSS JOIN LATERAL (SELECT turnlog_search_text(e.kind, e.payload) AS body) t
          WHERE e.kind IN ('user_message', 'assistant_turn') AND t.body IS NOT NULL",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO search_positions (partition, stream_seq) SELECT partition, stream_seq FROM writer_positions
         ON CONFLICT (partition) DO UPDATE SET stream_seq = EXCLUDED.stream_seq",
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}
