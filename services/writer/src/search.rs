//! The search index (DESIGN §2), kept by the writer off its commit path: each partition's
//! indexer takes the committed user messages and answers the publisher hands it, and
//! writes them to `search_entries` in its own batches and transactions with its own
//! position (`search_positions`), from which it catches up after a restart. Search trails
//! the log by about [`INDEX_EVERY`].

use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde_json::Value;
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

/// What a batch of commits leaves to index: the rows of the events that are found by
/// search, and the APPEND sequence the index is then complete through.
pub(crate) struct Committed {
    pub events: Vec<Entry>,
    pub through: i64,
}

/// One `search_entries` row.
pub(crate) struct Entry {
    pub(crate) session: SessionId,
    pub(crate) seq: i64,
    pub(crate) owner: String,
    /// `user` or `assistant`.
    pub(crate) kind: &'static str,
    pub(crate) body: String,
    pub(crate) created_at: DateTime<Utc>,
}

impl Committed {
    /// The rows of the committed `events`, their text taken from the payloads in hand (no
    /// read of the stored events, no SQL function per row).
    pub(crate) fn of<'a>(events: impl IntoIterator<Item = &'a EventRow>, through: i64) -> Self {
        let events = events
            .into_iter()
            .filter_map(|e| {
                let e = &e.event;
                let body = search_text(e.kind, &e.payload)?;
                Some(Entry {
                    session: e.session_id,
                    seq: e.seq,
                    owner: e.owner.as_str().to_owned(),
                    kind: if e.kind == EventKind::UserMessage { "user" } else { "assistant" },
                    body,
                    created_at: e.created_at,
                })
            })
            .collect();
        Self { events, through }
    }
}

/// Characters of an event's text that are indexed: a tsvector holds at most 1 MB.
const MAX_SEARCH_CHARS: usize = 65_536;

/// An event's searchable text, as `turnlog_search_text` (migrations/0007 and 0012, used
/// for the bulk paths: catch-up, rebuild) computes it from the stored payload: a user
/// message's `text`; an answer's text blocks (`ui.blocks[*]` of type `text`) joined; none
/// when empty or for any other kind; the first [`MAX_SEARCH_CHARS`] characters. The
/// payloads are the writer's own (their text fields are strings); a test compares both.
pub(crate) fn search_text(kind: EventKind, payload: &Value) -> Option<String> {
    let mut text = match kind {
        EventKind::UserMessage => payload.get("text").and_then(Value::as_str)?.to_owned(),
        EventKind::AssistantTurn => {
            let blocks = payload.get("ui").and_then(|ui| ui.get("blocks")).and_then(Value::as_array);
            blocks
                .into_iter()
                .flatten()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect()
        }
        _ => return None,
    };
    if let Some((cut, _)) = text.char_indices().nth(MAX_SEARCH_CHARS) {
        text.truncate(cut);
    }
    (!text.is_empty()).then_some(text)
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
    let mut pending: Vec<Entry> = Vec::new();
    // Every pending entry was committed after this APPEND sequence.
    let mut after = applied;
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
            index(&pool, partition, &pending, after, t).await?;
            after = t;
            let elapsed_us = started.elapsed().as_micros() as u64;
            tracing::debug!(partition, events = pending.len(), elapsed_us, "search index written");
            crate::metrics::metrics().indexed(partition.unsigned_abs(), t);
            // The rows just written wait in the full-text index's pending list.
            merge.add(pending.len());
            pending.clear();
        }
    }
    if let Some(t) = through {
        index(&pool, partition, &pending, after, t).await?;
        merge.add(pending.len());
    }
    Ok(())
}

/// stream_seq, session_id, seq, owner, kind (`user` | `assistant`), body (none: no text),
/// created_at.
type CatchUpRow = (i64, Uuid, i64, String, String, Option<String>, DateTime<Utc>);

/// Indexes the events of the partition committed after its search position and through
/// `applied`: those a previous writer committed but did not index, read back in chunks of
/// [`INDEX_BATCH`] with their text by `turnlog_search_text`. Returns how many.
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
    tracing::info!(partition, indexed, applied, "search index catching up");
    // Pages by (stream_seq, session, seq): a stream sequence may have made several events.
    let (mut after, mut count) = ((indexed, Uuid::max(), i64::MAX), 0);
    loop {
        let rows: Vec<CatchUpRow> = sqlx::query_as(
            "SELECT e.stream_seq, e.session_id, e.seq, s.owner,
                    CASE e.kind WHEN 'user_message' THEN 'user' ELSE 'assistant' END,
                    turnlog_search_text(e.kind, e.payload), e.created_at
               FROM session_events e JOIN sessions s ON s.id = e.session_id
              WHERE e.stream_seq >= $1 AND e.stream_seq <= $4 AND (e.stream_seq, e.session_id, e.seq) > ($1, $2, $3)
                AND e.kind IN ('user_message', 'assistant_turn')
              ORDER BY e.stream_seq, e.session_id, e.seq LIMIT $5",
        )
        .bind(after.0)
        .bind(after.1)
        .bind(after.2)
        .bind(applied)
        .bind(INDEX_BATCH as i64)
        .fetch_all(pool)
        .await?;
        let Some(last) = rows.last().map(|r| (r.0, r.1, r.2)) else { break };
        after = last;
        let own: Vec<Entry> = rows
            .into_iter()
            .filter(|r| i64::from(partition_of(SessionId(r.1), partitions)) == i64::from(partition))
            .filter_map(|(_, session, seq, owner, kind, body, created_at)| {
                Some(Entry {
                    session: SessionId(session),
                    seq,
                    owner,
                    kind: if kind == "user" { "user" } else { "assistant" },
                    body: body?,
                    created_at,
                })
            })
            .collect();
        count += own.len();
        index(pool, partition, &own, indexed, indexed).await?;
    }
    index(pool, partition, &[], indexed, applied).await?;
    tracing::info!(partition, events = count, "search index caught up");
    Ok(count)
}

/// Indexes `events`, committed after APPEND sequence `after`, and moves the partition's
/// position to `through`. When the database refuses the batch for its data, each event is
/// indexed alone and one it still refuses is left out, with its reason logged and counted
/// (`turnlog_writer_search_skipped_total`): search never stops a partition. Other errors
/// (a lost connection) end the indexer.
async fn index(
    pool: &PgPool,
    partition: i32,
    events: &[Entry],
    after: i64,
    through: i64,
) -> anyhow::Result<()> {
    let refused = match index_once(pool, partition, events, after, through).await {
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
    for entry in events {
        if let Err(e) = index_once(pool, partition, std::slice::from_ref(entry), after, 0).await {
            let Some(why) = data_error(&e) else {
                return Err(e).context("writing the search index");
            };
            let (session, seq) = (entry.session, entry.seq);
            tracing::warn!(partition, %session, seq, error = why, "event left out of the search index");
            crate::metrics::metrics().search_skipped();
        }
    }
    index_once(pool, partition, &[], after, through).await.context("moving the search position")
}

/// One index write: the events' rows (those still stored: a delete may have come first)
/// and the partition's position, in one transaction under the partition's index lock.
async fn index_once(
    pool: &PgPool,
    partition: i32,
    events: &[Entry],
    after: i64,
    through: i64,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(LOCK_CLASS)
        .bind(partition)
        .execute(&mut *tx)
        .await?;
    insert_entries(&mut tx, partition, after, events).await?;
    sqlx::query("UPDATE search_positions SET stream_seq = GREATEST(stream_seq, $2) WHERE partition = $1")
        .bind(partition)
        .bind(through)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Writes `entries`, committed after APPEND sequence `after`: those of events still stored
/// (a delete may have come first, and holds the same lock).
async fn insert_entries(
    conn: &mut sqlx::PgConnection,
    partition: i32,
    after: i64,
    entries: &[Entry],
) -> Result<(), sqlx::Error> {
    if entries.is_empty() {
        return Ok(());
    }
    sqlx::query(INDEX_ENTRIES)
        .bind(entries.iter().map(|e| e.session.0).collect::<Vec<_>>())
        .bind(entries.iter().map(|e| e.seq).collect::<Vec<_>>())
        .bind(entries.iter().map(|e| e.owner.as_str()).collect::<Vec<_>>())
        .bind(entries.iter().map(|e| e.kind).collect::<Vec<_>>())
        .bind(entries.iter().map(|e| e.body.as_str()).collect::<Vec<_>>())
        .bind(entries.iter().map(|e| e.created_at).collect::<Vec<_>>())
        .bind(partition)
        .bind(after)
        .execute(conn)
        .await?;
    Ok(())
}

/// The rows given (session ids, seqs, owners, kinds, bodies, times), of the events still
/// stored. Only a delete removes events, and it records its APPEND sequence in its
/// partition's `deleted_through`: when none came after the rows' commits (`$8`), every
/// event is stored and none is looked up (the `OR` is evaluated in order, so the look-up
/// never runs; it is an index probe per row, never a scan of the events, when it does).
const INDEX_ENTRIES: &str = "INSERT INTO search_entries (session_id, seq, owner, kind, body, created_at)
     SELECT k.session_id, k.seq, k.owner, k.kind, k.body, k.created_at
       FROM UNNEST($1::uuid[], $2::int8[], $3::text[], $4::text[], $5::text[], $6::timestamptz[])
            AS k(session_id, seq, owner, kind, body, created_at)
      WHERE (SELECT w.deleted_through FROM writer_positions w WHERE w.partition = $7) <= $8
         OR EXISTS (SELECT 1 FROM session_events e WHERE e.session_id = k.session_id AND e.seq = k.seq)
     ON CONFLICT (session_id, seq) DO NOTHING";

/// Every partition's search position set to the writer's: the end of `turnlog rebuild`,
/// which writes each batch's search rows with its events (`bulk::write_events`).
pub(crate) async fn positions_at_writer(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO search_positions (partition, stream_seq) SELECT partition, stream_seq FROM writer_positions
         ON CONFLICT (partition) DO UPDATE SET stream_seq = EXCLUDED.stream_seq",
    )
    .execute(pool)
    .await?;
    Ok(())
}
