//! The writer's SQL: loading what a batch needs, writing its effects and the new position
//! in one transaction (the position moves by compare-and-set, because an advisory lock is
//! not a fence), and reading back what was committed but not yet published.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use sqlx::{Connection as _, PgConnection, PgPool};
use turnlog_core::events::UnknownKind;
use turnlog_core::ids::{EventId, Owner, SessionId};
use turnlog_runtime::bus::{CommittedEvent, Outcome, OutcomeStatus, Refusal};
use uuid::Uuid;

use turnlog_runtime::read::SESSION_COLUMNS;

use crate::apply::{BatchEffects, EventRow, FileWrite, LoadedState, SessionRow};

#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// Another writer moved this partition's position: this one must step down.
    #[error("position of partition {partition} is no longer {expected}: another writer took over")]
    Fenced { partition: i32, expected: i64 },
}

/// Binds the sixteen `sessions` columns of `$rows` (`&SessionRow`s) as arrays, in the order
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
            .bind(rows.iter().map(|s| s.active_at).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.forked_from).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.forked_through).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| crate::store::uuid_array(&s.lineage)).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| crate::store::int8_array(&s.lineage_through)).collect::<Vec<_>>())
            .bind(rows.iter().map(|s| s.hidden_seq).collect::<Vec<_>>())
    }};
}
pub(crate) use bind_sessions;

/// The `metadata` column of `rows`, bound apart from [`bind_sessions!`] (as the parameter
/// [`upsert_sessions_sql`] is told).
pub(crate) fn session_metadata<'a>(rows: &[&'a SessionRow]) -> Vec<&'a serde_json::Value> {
    rows.iter().map(|s| &s.metadata).collect()
}

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

/// `INSERT INTO sessions … ON CONFLICT (id) DO UPDATE …` of the rows [`bind_sessions!`]
/// binds from parameter `$first` on, with `filter` after the `SELECT` (e.g. a `WHERE`).
/// A lineage travels as the text of a Postgres array (an array of arrays would have to be
/// rectangular); it is set at create and never changes.
pub(crate) fn upsert_sessions_sql(first: usize, metadata: usize, filter: &str) -> String {
    let types = [
        "uuid",
        "text",
        "text",
        "bool",
        "text",
        "int8",
        "int8",
        "int8",
        "timestamptz",
        "timestamptz",
        "timestamptz",
        "uuid",
        "int8",
        "text",
        "text",
        "int8",
    ];
    let mut params: Vec<String> =
        types.iter().enumerate().map(|(i, t)| format!("${}::{t}[]", first + i)).collect();
    params.push(format!("${metadata}::jsonb[]"));
    format!(
        "INSERT INTO sessions ({SESSION_COLUMNS})
         SELECT id, owner, title, archived, last_category, last_seq, compacted_through, compaction_seq,
                created_at, updated_at, active_at, forked_from, forked_through, lineage::uuid[],
                lineage_through::int8[], hidden_seq, metadata
           FROM UNNEST({}) AS u({SESSION_COLUMNS})
         {filter}
         ON CONFLICT (id) DO UPDATE SET
            title = EXCLUDED.title, archived = EXCLUDED.archived, last_category = EXCLUDED.last_category,
            last_seq = EXCLUDED.last_seq, compacted_through = EXCLUDED.compacted_through,
            compaction_seq = EXCLUDED.compaction_seq, updated_at = EXCLUDED.updated_at,
            active_at = EXCLUDED.active_at, hidden_seq = EXCLUDED.hidden_seq, metadata = EXCLUDED.metadata",
        params.join(", ")
    )
}

/// A Postgres array literal of uuids (`{…}`), for [`upsert_sessions_sql`].
pub(crate) fn uuid_array(ids: &[Uuid]) -> String {
    format!("{{{}}}", ids.iter().map(Uuid::to_string).collect::<Vec<_>>().join(","))
}

/// A Postgres array literal of integers, for [`upsert_sessions_sql`].
pub(crate) fn int8_array(values: &[i64]) -> String {
    format!("{{{}}}", values.iter().map(i64::to_string).collect::<Vec<_>>().join(","))
}

/// (applied, published) stream sequences of a partition, creating its row at 0.
pub(crate) async fn positions(pool: &PgPool, partition: i32) -> Result<(i64, i64), sqlx::Error> {
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
type OutcomeRow = (Uuid, Option<Uuid>, String, Option<i64>, Option<Refusal>);

/// The sessions (those not cached) and prior outcomes a batch refers to. Usually no round
/// trip: the writer caches the sessions it has seen, and most requests cannot have an
/// earlier outcome ([`crate::apply::first_copy`]).
pub(crate) async fn load_state(
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
        partitions: 0,
        inheritors: HashMap::new(),
        compactions: HashMap::new(),
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

/// What a batch's forks and its delete need beyond the sessions it names (DESIGN §10):
/// for each fork, its parent's row and the compactions of every session its branch log
/// reads (its inherited compaction point is found among them); for a delete, the deleted
/// session's ancestors and every session that inherits from it or from any of them.
pub(crate) async fn load_family(
    pool: &PgPool,
    state: &mut LoadedState,
    parents: &[Uuid],
    deleted: Option<SessionId>,
) -> Result<(), sqlx::Error> {
    let rows = |sql: String, ids: Vec<Uuid>| async move {
        sqlx::query_as::<_, SessionRow>(&sql).bind(ids).fetch_all(pool).await
    };
    if !parents.is_empty() {
        for row in
            rows(format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ANY($1)"), parents.to_vec())
                .await?
        {
            state.sessions.insert(row.id, row);
        }
        let mut read: Vec<Uuid> = parents.to_vec();
        for p in parents {
            if let Some(row) = state.sessions.get(&SessionId(*p)) {
                read.extend(&row.lineage);
            }
        }
        let compactions: Vec<(Uuid, i64, i64)> = sqlx::query_as(
            "SELECT session_id, seq, (payload ->> 'replaces_through_seq')::int8 FROM session_events
              WHERE session_id = ANY($1) AND kind = 'compaction_applied' ORDER BY session_id, seq",
        )
        .bind(&read)
        .fetch_all(pool)
        .await?;
        for (session, seq, through) in compactions {
            state.compactions.entry(SessionId(session)).or_default().push((seq, through));
        }
    }
    if let Some(deleted) = deleted.and_then(|d| state.sessions.get(&d)) {
        let family: Vec<Uuid> =
            std::iter::once(deleted.id.0).chain(deleted.lineage.iter().copied()).collect();
        let sql = format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ANY($1) OR lineage && $1");
        for row in rows(sql, family).await? {
            state.add_inheritor(&row);
            state.sessions.insert(row.id, row);
        }
    }
    Ok(())
}

/// Writes a batch (a delete through [`write_delete`], anything else through
/// [`write_effects`]) with the partition's new position.
pub(crate) async fn commit(
    conn: &mut PgConnection,
    partition: i32,
    expected: i64,
    fx: &BatchEffects,
) -> Result<(), StoreError> {
    if let Some(file) = &fx.file {
        return write_file(conn, partition, expected, fx, file).await;
    }
    match fx.deleted {
        Some(_) => write_delete(conn, partition, expected, fx).await,
        None => write_effects(conn, partition, expected, fx).await,
    }
}

/// A file op's batch (it is alone in it): the file's row, its outcome and the position, in
/// one statement conditional on the position's compare-and-set.
async fn write_file(
    conn: &mut PgConnection,
    partition: i32,
    expected: i64,
    fx: &BatchEffects,
    file: &FileWrite,
) -> Result<(), StoreError> {
    let outcome = fx.outcomes.first().map(|(o, _)| o);
    let write = file_write_sql(file);
    let statement = format!(
        "WITH pos AS (
             UPDATE writer_positions SET stream_seq = $3 WHERE partition = $1 AND stream_seq = $2 RETURNING 1
         ), o AS (
             INSERT INTO request_outcomes (request_id, session_id, status, seq, reason)
             SELECT $4, $5, $6, NULL, NULL WHERE EXISTS (SELECT 1 FROM pos) AND $4::uuid IS NOT NULL
             ON CONFLICT (request_id) DO UPDATE SET status = EXCLUDED.status, seq = NULL, reason = NULL
         ), f AS (
             {write}
         )
         SELECT count(*) FROM pos"
    );
    let query = sqlx::query_scalar(&statement)
        .bind(partition)
        .bind(expected)
        .bind(i64::try_from(fx.last_stream_seq).unwrap_or(i64::MAX))
        .bind(outcome.map(|o| o.request_id))
        .bind(fx.outcomes.first().and_then(|(_, s)| s.map(|s| s.0)))
        .bind(outcome.map(|o| o.status.as_str()));
    let moved: i64 = bind_file(query, file).fetch_one(&mut *conn).await?;
    if moved != 1 {
        return Err(StoreError::Fenced { partition, expected });
    }
    Ok(())
}

/// The file op's write, parameters from `$7` (see [`bind_file`]); in the live writer's
/// statement it runs only when the position moved.
const PUT_FILE: &str = "INSERT INTO files (id, owner, name, mime, kind, bytes, sha256, width, height,
                                           markdown_chars, note, sent_mime, created_at)
             SELECT $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19
              WHERE EXISTS (SELECT 1 FROM pos)
             ON CONFLICT (id) DO NOTHING";
const DELETE_FILE: &str = "UPDATE files SET deleted_at = $9
              WHERE id = $7 AND owner = $8 AND deleted_at IS NULL AND EXISTS (SELECT 1 FROM pos)";
const SWEPT_FILE: &str = "UPDATE files SET swept_at = $9
              WHERE id = $7 AND owner = $8 AND swept_at IS NULL AND EXISTS (SELECT 1 FROM pos)";

fn file_write_sql(file: &FileWrite) -> &'static str {
    match file {
        FileWrite::Put(_) => PUT_FILE,
        FileWrite::Delete { .. } => DELETE_FILE,
        FileWrite::Swept { .. } => SWEPT_FILE,
    }
}

pub(crate) fn bind_file<'q, O>(
    query: sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    file: &'q FileWrite,
) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    match file {
        FileWrite::Put(f) => query
            .bind(f.id)
            .bind(f.owner.as_str())
            .bind(&f.name)
            .bind(&f.mime)
            .bind(&f.kind)
            .bind(f.bytes)
            .bind(&f.sha256)
            .bind(f.width)
            .bind(f.height)
            .bind(f.markdown_chars)
            .bind(&f.note)
            .bind(&f.sent_mime)
            .bind(f.created_at),
        FileWrite::Delete { id, owner, at } | FileWrite::Swept { id, owner, at } => {
            query.bind(*id).bind(owner).bind(*at)
        }
    }
}

/// The same write for a rebuild, which moves no position and writes outcomes at the end:
/// `$1`–`$6` are bound but unused.
pub(crate) async fn rebuild_file(conn: &mut PgConnection, file: &FileWrite) -> Result<(), sqlx::Error> {
    let write = file_write_sql(file);
    let statement = format!("WITH pos AS (SELECT 1), f AS ({write}) SELECT 1::int8");
    let mut query = sqlx::query_scalar::<_, i64>(&statement);
    for _ in 0..6 {
        query = query.bind(None::<i32>);
    }
    bind_file(query, file).fetch_one(&mut *conn).await?;
    Ok(())
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
    static STATEMENT: LazyLock<String> = LazyLock::new(|| {
        // The sessions' metadata is the statement's last parameter.
        let upsert = upsert_sessions_sql(4, 40, "WHERE EXISTS (SELECT 1 FROM pos)");
        format!(
            "WITH pos AS (
             UPDATE writer_positions SET stream_seq = $3 WHERE partition = $1 AND stream_seq = $2 RETURNING 1
         ), s AS (
             {upsert}
         ), e AS (
             INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
             SELECT * FROM UNNEST($20::uuid[], $21::int8[], $22::uuid[], $23::text[], $24::jsonb[], $25::int4[],
                                  $26::int8[], $27::timestamptz[])
              WHERE EXISTS (SELECT 1 FROM pos)
         ), oi AS (
             SELECT * FROM UNNEST($28::uuid[], $29::uuid[], $30::text[], $31::int8[], $32::text[])
                 AS u(request_id, session_id, status, seq, reason)
              WHERE EXISTS (SELECT 1 FROM pos)
         ), o AS (
             INSERT INTO request_outcomes (request_id, session_id, status, seq, reason)
             SELECT * FROM oi WHERE NOT (request_id = ANY($39::uuid[]))
         ), r AS (
             INSERT INTO request_outcomes (request_id, session_id, status, seq, reason)
             SELECT * FROM oi WHERE request_id = ANY($39::uuid[])
             ON CONFLICT (request_id) DO UPDATE SET
                session_id = EXCLUDED.session_id, status = EXCLUDED.status, seq = EXCLUDED.seq,
                reason = EXCLUDED.reason
         ), m AS (
             INSERT INTO memories (id, owner, session_id, turn_seq, text, created_at)
             SELECT * FROM UNNEST($33::uuid[], $34::text[], $35::uuid[], $36::int8[], $37::text[],
                                  $38::timestamptz[])
              WHERE EXISTS (SELECT 1 FROM pos)
             ON CONFLICT (id) DO NOTHING
         )
         SELECT count(*) FROM pos"
        )
    });
    let query = sqlx::query_scalar(STATEMENT.as_str())
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
    let moved: i64 = bind_memories!(query, m)
        .bind(&fx.redriven)
        .bind(session_metadata(&sessions))
        .fetch_one(&mut *conn)
        .await?;
    if moved != 1 {
        return Err(StoreError::Fenced { partition, expected });
    }
    Ok(())
}

/// A delete batch (DESIGN §10): each removal's rows go — wholly, or above what forks still
/// inherit, with the memories and search rows of the events that go, the session kept
/// hidden — a pending
/// purge up to the delete's own APPEND sequence is recorded for each, and the delete's own
/// outcome is kept so a resent delete is answered.
async fn write_delete(
    conn: &mut PgConnection,
    partition: i32,
    expected: i64,
    fx: &BatchEffects,
) -> Result<(), StoreError> {
    static STATEMENT: LazyLock<String> = LazyLock::new(|| {
        delete_statement(
            "UPDATE writer_positions SET stream_seq = $3, deleted_through = $3
              WHERE partition = $1 AND stream_seq = $2 RETURNING 1",
        )
    });
    let mut tx = conn.begin().await?;
    // The writer's connection keeps generic plans; this one is planned for its sessions.
    sqlx::query("SET LOCAL plan_cache_mode = force_custom_plan").execute(&mut *tx).await?;
    // After any index write of the partition under way, so none leaves rows behind.
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(crate::search::LOCK_CLASS)
        .bind(partition)
        .execute(&mut *tx)
        .await?;
    let moved = run_delete(&mut tx, &STATEMENT, (partition, expected), fx, &fx.outcomes).await?;
    if moved != 1 {
        return Err(StoreError::Fenced { partition, expected });
    }
    tx.commit().await?;
    Ok(())
}

/// The one statement of a delete batch, its position step given as `pos` (a CTE body
/// returning one row when the batch may be written; it may use `$1`, `$2`, `$3`). Every
/// other append of the partition waits for it, so it is one round trip. The removed
/// sessions' outcomes go, except this batch's own (a statement must not both delete and
/// upsert one row) and, for a hidden session, those of the events it keeps.
pub(crate) fn delete_statement(pos: &str) -> String {
    let upsert = upsert_sessions_sql(11, 27, "WHERE EXISTS (SELECT 1 FROM pos)");
    format!(
        "WITH pos AS ({pos}),
         r AS (SELECT * FROM UNNEST($4::uuid[], $5::int8[]) AS r(id, kept)),
         mem AS (
             DELETE FROM memories m USING r, session_events ev
              WHERE r.kept IS NOT NULL AND ev.session_id = r.id AND ev.seq > r.kept
                AND ev.kind = 'memory_extracted' AND m.session_id = r.id
                AND m.id IN (SELECT (x ->> 'id')::uuid FROM jsonb_array_elements(ev.payload -> 'memories') x)
                AND EXISTS (SELECT 1 FROM pos)
         ), e AS (
             DELETE FROM session_events ev USING r
              WHERE ev.session_id = r.id AND ev.seq > coalesce(r.kept, 0) AND EXISTS (SELECT 1 FROM pos)
         ), sx AS (
             DELETE FROM search_entries se USING r
              WHERE se.session_id = r.id AND se.seq > coalesce(r.kept, 0) AND EXISTS (SELECT 1 FROM pos)
         ), s AS (
             DELETE FROM sessions WHERE id IN (SELECT id FROM r WHERE kept IS NULL) AND EXISTS (SELECT 1 FROM pos)
         ), h AS (
             {upsert}
         ), gone AS (
             DELETE FROM request_outcomes o USING r
              WHERE o.session_id = r.id AND o.request_id <> ALL($6)
                AND NOT (r.kept IS NOT NULL AND o.status = 'committed' AND o.seq <= r.kept)
                AND EXISTS (SELECT 1 FROM pos)
         ), purge AS (
             INSERT INTO pending_purges (session_id, stream_seq) SELECT id, $3 FROM r WHERE EXISTS (SELECT 1 FROM pos)
             ON CONFLICT (session_id) DO UPDATE SET stream_seq = GREATEST(pending_purges.stream_seq, $3)
         ), o AS (
             INSERT INTO request_outcomes (request_id, session_id, status, seq, reason)
             SELECT * FROM UNNEST($6::uuid[], $7::uuid[], $8::text[], $9::int8[], $10::text[])
              WHERE EXISTS (SELECT 1 FROM pos)
             ON CONFLICT (request_id) DO UPDATE SET
                session_id = EXCLUDED.session_id, status = EXCLUDED.status, seq = EXCLUDED.seq,
                reason = EXCLUDED.reason
         )
         SELECT count(*) FROM pos"
    )
}

/// Runs a [`delete_statement`] for the batch `fx`, writing `outcomes`; returns how many
/// rows `pos` gave.
pub(crate) async fn run_delete(
    conn: &mut PgConnection,
    statement: &str,
    (partition, expected): (i32, i64),
    fx: &BatchEffects,
    outcomes: &[(Outcome, Option<SessionId>)],
) -> Result<i64, sqlx::Error> {
    let kept: Vec<&SessionRow> = fx.removals.iter().filter_map(|r| r.kept.as_ref()).collect();
    let query = sqlx::query_scalar(statement)
        .bind(partition)
        .bind(expected)
        .bind(i64::try_from(fx.last_stream_seq).unwrap_or(i64::MAX))
        .bind(fx.removals.iter().map(|r| r.session.0).collect::<Vec<_>>())
        .bind(fx.removals.iter().map(|r| r.kept.as_ref().map(|row| row.last_seq)).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.request_id).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(_, s)| s.map(|s| s.0)).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.status.as_str()).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.seq).collect::<Vec<_>>())
        .bind(outcomes.iter().map(|(o, _)| o.reason.as_deref()).collect::<Vec<_>>());
    bind_sessions!(query, &kept).bind(session_metadata(&kept)).fetch_one(conn).await
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
pub(crate) async fn committed_between(
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
                    traceparent: None,
                })
            },
        )
        .collect()
}

/// Moves `published_seq`. Committed without waiting for the WAL flush: it is a hint, and
/// losing the latest value in a crash only makes the next writer republish events the feed
/// then drops as duplicates. Waiting would cost a second fsync per batch at low load.
pub(crate) async fn mark_published(pool: &PgPool, partition: i32, through: i64) -> Result<(), sqlx::Error> {
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
pub(crate) async fn pending_purges(pool: &PgPool) -> Result<Vec<(SessionId, Option<i64>)>, sqlx::Error> {
    let rows: Vec<(Uuid, Option<i64>)> =
        sqlx::query_as("SELECT session_id, stream_seq FROM pending_purges").fetch_all(pool).await?;
    Ok(rows.into_iter().map(|(id, through)| (SessionId(id), through)).collect())
}

/// The APPEND sequences of a session's messages a purge keeps: those of the events still
/// stored (a hidden session's inherited prefix) and of the delete that hid it. Empty for a
/// session that is gone.
pub(crate) async fn kept_messages(pool: &PgPool, session: SessionId) -> Result<HashSet<u64>, sqlx::Error> {
    let seqs: Vec<i64> = sqlx::query_scalar(
        "SELECT stream_seq FROM session_events WHERE session_id = $1
         UNION SELECT hidden_seq FROM sessions WHERE id = $1 AND hidden_seq IS NOT NULL",
    )
    .bind(session.0)
    .fetch_all(pool)
    .await?;
    Ok(seqs.into_iter().filter_map(|s| u64::try_from(s).ok()).collect())
}

/// Clears a purge record once its messages through `through` are removed (not one a later
/// delete of the same id has moved further meanwhile).
pub(crate) async fn purge_done(pool: &PgPool, session: SessionId, through: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "DELETE FROM pending_purges WHERE session_id = $1 AND (stream_seq IS NULL OR stream_seq <= $2)",
    )
    .bind(session.0)
    .bind(through)
    .execute(pool)
    .await?;
    Ok(())
}
