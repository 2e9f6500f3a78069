//! The writer's SQL: loading what a batch needs, writing its effects and the new position
//! in one transaction (the position moves by compare-and-set, because an advisory lock is
//! not a fence), and reading back what was committed but not yet published.

use std::collections::HashMap;

use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use turnlog_core::bus::{CommittedEvent, Outcome, OutcomeStatus};
use turnlog_core::ids::SessionId;
use uuid::Uuid;

use crate::apply::{BatchEffects, LoadedState, SessionRow};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// Another writer moved this partition's position: this one must step down.
    #[error("position of partition {partition} is no longer {expected}: another writer took over")]
    Fenced { partition: i32, expected: i64 },
}

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

#[derive(sqlx::FromRow)]
struct SessionDb {
    id: Uuid,
    owner: String,
    title: Option<String>,
    archived: bool,
    last_category: Option<String>,
    last_seq: i64,
    compacted_through: Option<i64>,
    compaction_seq: Option<i64>,
    created_at: chrono::DateTime<chrono::Utc>,
    updated_at: chrono::DateTime<chrono::Utc>,
}

/// The sessions and prior outcomes a batch refers to.
pub async fn load_state(
    tx: &mut PgConnection,
    sessions: &[Uuid],
    requests: &[Uuid],
) -> Result<LoadedState, sqlx::Error> {
    let rows: Vec<SessionDb> = sqlx::query_as(
        "SELECT id, owner, title, archived, last_category, last_seq, compacted_through, compaction_seq,
                created_at, updated_at
           FROM sessions WHERE id = ANY($1)",
    )
    .bind(sessions)
    .fetch_all(&mut *tx)
    .await?;
    let outcomes: Vec<(Uuid, String, Option<i64>, Option<String>)> = sqlx::query_as(
        "SELECT request_id, status, seq, reason FROM request_outcomes WHERE request_id = ANY($1)",
    )
    .bind(requests)
    .fetch_all(&mut *tx)
    .await?;
    Ok(LoadedState {
        sessions: rows
            .into_iter()
            .map(|r| {
                let id = SessionId(r.id);
                let row = SessionRow {
                    id,
                    owner: r.owner,
                    title: r.title,
                    archived: r.archived,
                    last_category: r.last_category,
                    last_seq: r.last_seq,
                    compacted_through: r.compacted_through,
                    compaction_seq: r.compaction_seq,
                    created_at: r.created_at,
                    updated_at: r.updated_at,
                };
                (id, row)
            })
            .collect(),
        outcomes: outcomes
            .into_iter()
            .map(|(id, status, seq, reason)| {
                let status =
                    if status == "committed" { OutcomeStatus::Committed } else { OutcomeStatus::Rejected };
                (id, Outcome { request_id: id, status, seq, reason })
            })
            .collect::<HashMap<_, _>>(),
    })
}

/// Writes a batch's effects and moves the partition's position from `expected` to the
/// batch's last stream sequence, all in `tx`.
pub async fn write_effects(
    tx: &mut Transaction<'_, Postgres>,
    partition: i32,
    expected: i64,
    fx: &BatchEffects,
) -> Result<(), StoreError> {
    let moved =
        sqlx::query("UPDATE writer_positions SET stream_seq = $3 WHERE partition = $1 AND stream_seq = $2")
            .bind(partition)
            .bind(expected)
            .bind(i64::try_from(fx.last_stream_seq).unwrap_or(i64::MAX))
            .execute(&mut **tx)
            .await?;
    if moved.rows_affected() != 1 {
        return Err(StoreError::Fenced { partition, expected });
    }

    if let Some(id) = fx.deleted {
        // Cascades to events and memories; the stream purge is recorded to finish later.
        sqlx::query("DELETE FROM sessions WHERE id = $1").bind(id.0).execute(&mut **tx).await?;
        sqlx::query("DELETE FROM request_outcomes WHERE session_id = $1")
            .bind(id.0)
            .execute(&mut **tx)
            .await?;
        sqlx::query("INSERT INTO pending_purges (session_id) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(id.0)
            .execute(&mut **tx)
            .await?;
    }

    let sessions: Vec<&SessionRow> = fx.created.iter().chain(&fx.updated).collect();
    if !sessions.is_empty() {
        let col = |f: fn(&SessionRow) -> Option<i64>| sessions.iter().map(|s| f(s)).collect::<Vec<_>>();
        sqlx::query(
            "INSERT INTO sessions (id, owner, title, archived, last_category, last_seq, compacted_through,
                                   compaction_seq, created_at, updated_at)
             SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::bool[], $5::text[], $6::int8[],
                                  $7::int8[], $8::int8[], $9::timestamptz[], $10::timestamptz[])
             ON CONFLICT (id) DO UPDATE SET
                title = EXCLUDED.title, archived = EXCLUDED.archived, last_category = EXCLUDED.last_category,
                last_seq = EXCLUDED.last_seq, compacted_through = EXCLUDED.compacted_through,
                compaction_seq = EXCLUDED.compaction_seq, updated_at = EXCLUDED.updated_at",
        )
        .bind(sessions.iter().map(|s| s.id.0).collect::<Vec<_>>())
        .bind(sessions.iter().map(|s| s.owner.clone()).collect::<Vec<_>>())
        .bind(sessions.iter().map(|s| s.title.clone()).collect::<Vec<_>>())
        .bind(sessions.iter().map(|s| s.archived).collect::<Vec<_>>())
        .bind(sessions.iter().map(|s| s.last_category.clone()).collect::<Vec<_>>())
        .bind(sessions.iter().map(|s| s.last_seq).collect::<Vec<_>>())
        .bind(col(|s| s.compacted_through))
        .bind(col(|s| s.compaction_seq))
        .bind(sessions.iter().map(|s| s.created_at).collect::<Vec<_>>())
        .bind(sessions.iter().map(|s| s.updated_at).collect::<Vec<_>>())
        .execute(&mut **tx)
        .await?;
    }

    if !fx.events.is_empty() {
        let ev = &fx.events;
        sqlx::query(
            "INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
             SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::text[], $5::jsonb[], $6::int4[],
                                  $7::int8[], $8::timestamptz[])",
        )
        .bind(ev.iter().map(|e| e.event.session_id.0).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.seq).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.event_id).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.kind.clone()).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.payload.clone()).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.tokens).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.stream_seq).collect::<Vec<_>>())
        .bind(ev.iter().map(|e| e.event.created_at).collect::<Vec<_>>())
        .execute(&mut **tx)
        .await?;
    }

    // Recorded after a delete's cleanup, so the delete's own outcome stays answerable.
    let outcomes = &fx.outcomes;
    if !outcomes.is_empty() {
        sqlx::query(
            "INSERT INTO request_outcomes (request_id, session_id, status, seq, reason)
             SELECT * FROM UNNEST($1::uuid[], $2::uuid[], $3::text[], $4::int8[], $5::text[])",
        )
        .bind(outcomes.iter().map(|(o, _)| o.request_id).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(_, s)| s.map(|s| s.0)).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.status.as_str()).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.seq).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.reason.clone()).collect::<Vec<_>>())
        .execute(&mut **tx)
        .await?;
    }

    if !fx.memories.is_empty() {
        let m = &fx.memories;
        sqlx::query(
            "INSERT INTO memories (id, owner, session_id, turn_seq, text, created_at)
             SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::uuid[], $4::int8[], $5::text[], $6::timestamptz[])
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(m.iter().map(|r| r.id).collect::<Vec<_>>())
        .bind(m.iter().map(|r| r.owner.clone()).collect::<Vec<_>>())
        .bind(m.iter().map(|r| r.session_id.0).collect::<Vec<_>>())
        .bind(m.iter().map(|r| r.turn_seq).collect::<Vec<_>>())
        .bind(m.iter().map(|r| r.text.clone()).collect::<Vec<_>>())
        .bind(m.iter().map(|r| r.created_at).collect::<Vec<_>>())
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// Events committed from APPEND messages in `(after, through]`, in commit order.
pub async fn committed_between(
    pool: &PgPool,
    after: i64,
    through: i64,
) -> Result<Vec<CommittedEvent>, sqlx::Error> {
    let rows: Vec<(Uuid, String, i64, Uuid, String, serde_json::Value, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as(
            "SELECT e.session_id, s.owner, e.seq, e.event_id, e.kind, e.payload, e.created_at
               FROM session_events e JOIN sessions s ON s.id = e.session_id
              WHERE e.stream_seq > $1 AND e.stream_seq <= $2
              ORDER BY e.stream_seq, e.seq",
        )
        .bind(after)
        .bind(through)
        .fetch_all(pool)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(session_id, owner, seq, event_id, kind, payload, created_at)| CommittedEvent {
            session_id: SessionId(session_id),
            owner,
            seq,
            event_id,
            kind,
            payload,
            created_at,
        })
        .collect())
}

pub async fn mark_published(pool: &PgPool, partition: i32, through: i64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE writer_positions SET published_seq = $2 WHERE partition = $1 AND published_seq < $2")
        .bind(partition)
        .bind(through)
        .execute(pool)
        .await?;
    Ok(())
}

pub async fn pending_purges(pool: &PgPool) -> Result<Vec<SessionId>, sqlx::Error> {
    let rows: Vec<(Uuid,)> = sqlx::query_as("SELECT session_id FROM pending_purges").fetch_all(pool).await?;
    Ok(rows.into_iter().map(|(id,)| SessionId(id)).collect())
}

pub async fn purge_done(pool: &PgPool, session: SessionId) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM pending_purges WHERE session_id = $1").bind(session.0).execute(pool).await?;
    Ok(())
}
