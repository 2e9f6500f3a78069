//! The writer's SQL: loading what a batch needs, writing its effects and the new position
//! in one transaction (the position moves by compare-and-set, because an advisory lock is
//! not a fence), and reading back what was committed but not yet published.

use std::collections::HashMap;

use sqlx::{Connection as _, PgConnection, PgPool};
use turnlog_core::events::UnknownKind;
use turnlog_core::ids::{EventId, Owner, SessionId};
use turnlog_runtime::bus::{CommittedEvent, Outcome, OutcomeStatus};
use uuid::Uuid;

use turnlog_runtime::read::SESSION_COLUMNS;

use crate::apply::{BatchEffects, EventRow, LoadedState, SessionRow};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// Another writer moved this partition's position: this one must step down.
    #[error("position of partition {partition} is no longer {expected}: another writer took over")]
    Fenced { partition: i32, expected: i64 },
}

/// Binds the ten `sessions` columns of `$rows` (`&SessionRow`s) as arrays, in the order
/// of every `INSERT INTO sessions … SELECT * FROM UNNEST(…)` here and in the bulk load.
macro_rules! bind_sessions {
    ($query:expr, $rows:expr) => {{
        let rows: &[&crate::apply::SessionRow] = $rows;
        $query
            .bind(rows.iter().map(|s| s.id.0).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.owner.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.title.as_deref()).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.archived).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.last_category.as_deref()).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.last_seq).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.compacted_through).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.compaction_seq).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.created_at).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.updated_at).collect::<Vec<_>>())
    }};
}
pub(crate) use bind_sessions;

/// Binds the six `memories` columns of `$rows` (`MemoryRow`s) as arrays, in the order of
/// every `INSERT INTO memories … SELECT * FROM UNNEST(…)` here and in the bulk load.
macro_rules! bind_memories {
    ($query:expr, $rows:expr) => {{
        let rows: &[crate::apply::MemoryRow] = $rows;
        $query
            .bind(rows.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.owner.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.session_id.0).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.turn_seq).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.text.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.created_at).collect::<Vec<_>>())
    }};
}
pub(crate) use bind_memories;

/// (applied, published) stream sequences of a partition, creating its row at 0.
pub async fn positions(pool: &PgPool, partition: i32) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query("INSERT INTO writer_positions (partition) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(partition)
        .execute(pool)
        .await?;
    sqlx::query_as("SELECT stream_seq, published_seq FROM writer_positions WHERE partition = $1")
        .bind(partition)
        .fetch_one(pool)
        .await
}

/// request_id, session_id, status, seq, reason.
type OutcomeRow = (Uuid, Option<Uuid>, String, Option<i64>, Option<String>);

/// The sessions (those not cached) and prior outcomes a batch refers to. Usually no round
/// trip: the writer caches the sessions it has seen, and most requests cannot have an
/// earlier outcome ([`crate::apply::first_copy`]).
pub async fn load_state(
    pool: &PgPool,
    sessions: &[Uuid],
    requests: &[Uuid],
) -> Result<LoadedState, sqlx::Error> {
    let rows: Vec<SessionRow> = if sessions.is_empty() {
        Vec::new()
    } else {
        sqlx::query_as(&format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ANY($1)"))
            .bind(sessions)
            .fetch_all(pool)
            .await?
    };
    let outcomes: Vec<OutcomeRow> = if requests.is_empty() {
        Vec::new()
    } else {
        sqlx::query_as(
            "SELECT request_id, session_id, status, seq, reason FROM request_outcomes WHERE request_id = ANY($1)",
        )
        .bind(requests)
        .fetch_all(pool)
        .await?
    };
    Ok(LoadedState {
        sessions: rows.into_iter().map(|row| (row.id, row)).collect(),
        outcomes: outcomes
            .into_iter()
            .map(|(id, session, status, seq, reason)| {
                let status =
                    if status == "committed" { OutcomeStatus::Committed } else { OutcomeStatus::Rejected };
                (id, (Outcome { request_id: id, status, seq, reason }, session.map(SessionId)))
            })
            .collect::<HashMap<_, _>>(),
    })
}

/// Writes a batch (a delete through [`write_delete`], anything else through
/// [`write_effects`]) with the partition's new position.
pub async fn commit(
    conn: &mut PgConnection,
    partition: i32,
    expected: i64,
    fx: &BatchEffects,
) -> Result<(), StoreError> {
    match fx.deleted {
        Some(session) => write_delete(conn, partition, expected, fx, session).await,
        None => write_effects(conn, partition, expected, fx).await,
    }
}

/// Writes a batch's effects and moves the partition's position from `expected` to the
/// batch's last stream sequence: one statement, so one round trip and one commit. Every
/// insert is conditional on the position's compare-and-set, so a fenced writer changes
/// nothing. A redriven request's new outcome replaces its dead-lettered one; any other
/// outcome is a plain insert, so a repeat that skipped the outcome look-up (see
/// [`crate::apply::first_copy`]) collides with the first outcome instead of overwriting it,
/// and the batch is applied again with every outcome looked up.
async fn write_effects(
    conn: &mut PgConnection,
    partition: i32,
    expected: i64,
    fx: &BatchEffects,
) -> Result<(), StoreError> {
    let sessions: Vec<&SessionRow> = fx.created.iter().chain(&fx.updated).collect();
    let ev = &fx.events;
    let outcomes = &fx.outcomes;
    let m = &fx.memories;
    let query = sqlx::query_scalar(
        "WITH pos AS (
             UPDATE writer_positions SET stream_seq = $3 WHERE partition = $1 AND stream_seq = $2 RETURNING 1
         ), s AS (
             INSERT INTO sessions (id, owner, title, archived, last_category, last_seq, compacted_through,
                                   compaction_seq, created_at, updated_at)
             SELECT * FROM UNNEST($4::uuid[], $5::text[], $6::text[], $7::bool[], $8::text[], $9::int8[],
                                  $10::int8[], $11::int8[], $12::timestamptz[], $13::timestamptz[])
              WHERE EXISTS (SELECT 1 FROM pos)
             ON CONFLICT (id) DO UPDATE SET
                title = EXCLUDED.title, archived = EXCLUDED.archived, last_category = EXCLUDED.last_category,
                last_seq = EXCLUDED.last_seq, compacted_through = EXCLUDED.compacted_through,
                compaction_seq = EXCLUDED.compaction_seq, updated_at = EXCLUDED.updated_at
         ), e AS (
             INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
             SELECT * FROM UNNEST($14::uuid[], $15::int8[], $16::uuid[], $17::text[], $18::jsonb[], $19::int4[],
                                  $20::int8[], $21::timestamptz[])
              WHERE EXISTS (SELECT 1 FROM pos)
         ), oi AS (
             SELECT * FROM UNNEST($22::uuid[], $23::uuid[], $24::text[], $25::int8[], $26::text[])
                 AS u(request_id, session_id, status, seq, reason)
              WHERE EXISTS (SELECT 1 FROM pos)
         ), o AS (
             INSERT INTO request_outcomes (request_id, session_id, status, seq, reason)
             SELECT * FROM oi WHERE NOT (request_id = ANY($33::uuid[]))
         ), r AS (
             INSERT INTO request_outcomes (request_id, session_id, status, seq, reason)
             SELECT * FROM oi WHERE request_id = ANY($33::uuid[])
             ON CONFLICT (request_id) DO UPDATE SET
                session_id = EXCLUDED.session_id, status = EXCLUDED.status, seq = EXCLUDED.seq,
                reason = EXCLUDED.reason
         ), m AS (
             INSERT INTO memories (id, owner, session_id, turn_seq, text, created_at)
             SELECT * FROM UNNEST($27::uuid[], $28::text[], $29::uuid[], $30::int8[], $31::text[],
                                  $32::timestamptz[])
              WHERE EXISTS (SELECT 1 FROM pos)
             ON CONFLICT (id) DO NOTHING
         )
         SELECT count(*) FROM pos",
    )
    .bind(partition)
    .bind(expected)
    .bind(i64::try_from(fx.last_stream_seq).unwrap_or(i64::MAX));
    let query = bind_sessions!(query, &sessions)
        .bind(ev.iter().map(|e| e.event.session_id.0).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.seq).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.event_id.0).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.kind.as_str()).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| &e.event.payload).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.tokens).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.stream_seq()).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.created_at).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.request_id).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(_, s)| s.map(|s| s.0)).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.status.as_str()).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.seq).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.reason.as_deref()).collect::<Vec<_>>());
    let moved: i64 = bind_memories!(query, m).bind(&fx.redriven).fetch_one(&mut *conn).await?;
    if moved != 1 {
        return Err(StoreError::Fenced { partition, expected });
    }
    Ok(())
}

/// A delete batch: the session's rows go (its events, its memories by cascade, its
/// outcomes; both found by index), a pending purge up to the delete's own APPEND sequence
/// is recorded, and the delete's own outcome is kept so a resent delete is answered.
async fn write_delete(
    conn: &mut PgConnection,
    partition: i32,
    expected: i64,
    fx: &BatchEffects,
    session: SessionId,
) -> Result<(), StoreError> {
    let mut tx = conn.begin().await?;
    // The writer's connection keeps generic plans; this one is planned for its session.
    sqlx::query("SET LOCAL plan_cache_mode = force_custom_plan").execute(&mut *tx).await?;
    // One statement, as for any batch: every other append of the partition waits for it.
    // The session's outcomes go, except this batch's own, which are written (a statement
    // must not both delete and upsert one row).
    let outcomes = &fx.outcomes;
    let moved: i64 = sqlx::query_scalar(
        "WITH pos AS (
             UPDATE writer_positions SET stream_seq = $3 WHERE partition = $1 AND stream_seq = $2 RETURNING 1
         ), e AS (
             DELETE FROM session_events WHERE session_id = $4 AND EXISTS (SELECT 1 FROM pos)
         ), s AS (
             DELETE FROM sessions WHERE id = $4 AND EXISTS (SELECT 1 FROM pos)
         ), gone AS (
             DELETE FROM request_outcomes
              WHERE session_id = $4 AND request_id <> ALL($5) AND EXISTS (SELECT 1 FROM pos)
         ), purge AS (
             INSERT INTO pending_purges (session_id, stream_seq) SELECT $4, $3 WHERE EXISTS (SELECT 1 FROM pos)
             ON CONFLICT (session_id) DO UPDATE SET stream_seq = GREATEST(pending_purges.stream_seq, $3)
         ), o AS (
             INSERT INTO request_outcomes (request_id, session_id, status, seq, reason)
             SELECT * FROM UNNEST($5::uuid[], $6::uuid[], $7::text[], $8::int8[], $9::text[])
              WHERE EXISTS (SELECT 1 FROM pos)
             ON CONFLICT (request_id) DO UPDATE SET
                session_id = EXCLUDED.session_id, status = EXCLUDED.status, seq = EXCLUDED.seq,
                reason = EXCLUDED.reason
         )
         SELECT count(*) FROM pos",
    )
    .bind(partition)
    .bind(expected)
    .bind(i64::try_from(fx.last_stream_seq).unwrap_or(i64::MAX))
    .bind(session.0)
    .bind(outcomes.iter().map(|(o, _)| o.request_id).collect::<Vec<_>>())
    .bind(outcomes.iter().map(|(_, s)| s.map(|s| s.0)).collect::<Vec<_>>())
    .bind(outcomes.iter().map(|(o, _)| o.status.as_str()).collect::<Vec<_>>())
    .bind(outcomes.iter().map(|(o, _)| o.seq).collect::<Vec<_>>())
    .bind(outcomes.iter().map(|(o, _)| o.reason.as_deref()).collect::<Vec<_>>())
    .fetch_one(&mut *tx)
    .await?;
    if moved != 1 {
        return Err(StoreError::Fenced { partition, expected });
    }
    tx.commit().await?;
    Ok(())
}

/// Records that a deleted session's stream messages up to APPEND sequence `through` are
/// to be removed. A session deleted again (created anew meanwhile) before the first
/// removal is done keeps one record, of the later delete, which covers both.
pub async fn record_purge(
    conn: &mut PgConnection,
    session: SessionId,
    through: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO pending_purges (session_id, stream_seq) VALUES ($1, $2)
         ON CONFLICT (session_id) DO UPDATE SET stream_seq = GREATEST(pending_purges.stream_seq, $2)",
    )
    .bind(session.0)
    .bind(through)
    .execute(conn)
    .await?;
    Ok(())
}

/// session_id, owner, seq, event_id, kind, payload, tokens, stream_seq, created_at, and
/// the session's created_at.
type CommittedRow = (
    Uuid,
    String,
    i64,
    Uuid,
    String,
    serde_json::Value,
    i32,
    i64,
    chrono::DateTime<chrono::Utc>,
    chrono::DateTime<chrono::Utc>,
);

/// Events committed from APPEND messages in `(after, through]`, in commit order.
pub async fn committed_between(
    pool: &PgPool,
    after: i64,
    through: i64,
) -> Result<Vec<EventRow>, sqlx::Error> {
    let rows: Vec<CommittedRow> = sqlx::query_as(
        "SELECT e.session_id, s.owner, e.seq, e.event_id, e.kind, e.payload, e.tokens, e.stream_seq,
                e.created_at, s.created_at
               FROM session_events e JOIN sessions s ON s.id = e.session_id
              WHERE e.stream_seq > $1 AND e.stream_seq <= $2
              ORDER BY e.stream_seq, e.seq",
    )
    .bind(after)
    .bind(through)
    .fetch_all(pool)
    .await?;
    rows.into_iter()
        .map(
            |(
                session_id,
                owner,
                seq,
                event_id,
                kind,
                payload,
                tokens,
                stream_seq,
                created_at,
                session_created_at,
            )| {
                let decode = |e: Box<dyn std::error::Error + Send + Sync>| sqlx::Error::Decode(e);
                Ok(EventRow {
                    event: CommittedEvent {
                        session_id: SessionId(session_id),
                        owner: Owner::parse(&owner).map_err(|e| decode(e.into()))?,
                        seq,
                        event_id: EventId(event_id),
                        kind: kind.parse().map_err(|e: UnknownKind| decode(e.into()))?,
                        payload,
                        created_at,
                        stream_seq: u64::try_from(stream_seq).ok(),
                    },
                    tokens,
                    session_created_at,
                })
            },
        )
        .collect()
}

/// Moves `published_seq`. Committed without waiting for the WAL flush: it is a hint, and
/// losing the latest value in a crash only makes the next writer republish events the feed
/// then drops as duplicates. Waiting would cost a second fsync per batch at low load.
pub async fn mark_published(pool: &PgPool, partition: i32, through: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE writer_positions SET published_seq = $2
           FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
          WHERE partition = $1 AND published_seq < $2",
    )
    .bind(partition)
    .bind(through)
    .execute(pool)
    .await?;
    Ok(())
}

/// Deleted sessions whose stream messages are still to be removed, each with the APPEND
/// sequence of its delete (None when recorded before deletes named it).
pub async fn pending_purges(pool: &PgPool) -> Result<Vec<(SessionId, Option<i64>)>, sqlx::Error> {
    let rows: Vec<(Uuid, Option<i64>)> =
        sqlx::query_as("SELECT session_id, stream_seq FROM pending_purges").fetch_all(pool).await?;
    Ok(rows.into_iter().map(|(id, through)| (SessionId(id), through)).collect())
}

/// Clears a purge record once its messages through `through` are removed (not one a later
/// delete of the same id has moved further meanwhile).
pub async fn purge_done(pool: &PgPool, session: SessionId, through: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "DELETE FROM pending_purges WHERE session_id = $1 AND (stream_seq IS NULL OR stream_seq <= $2)",
    )
    .bind(session.0)
    .bind(through)
    .execute(pool)
    .await?;
    Ok(())
}
