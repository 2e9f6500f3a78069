//! The rebuild's SQL: bulk loading into an empty database that only the rebuild writes.
//! Rows go in once — events and their search rows (binary COPY) and memories as batches
//! are applied, sessions as they are created — and the state that changes all along (each
//! session's row, every request's outcome, the positions) is written at the end, from
//! memory, in its final form. The events' unique constraint and the secondary indexes of
//! the events, the search rows, the outcomes and the memories are set aside during the
//! load and made again after it, as PostgreSQL advises for populating a database.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Connection as _, PgConnection, PgPool};
use uuid::Uuid;

use crate::apply::{BatchEffects, EventRow, LoadedState, SessionRow};
use crate::store::{
    bind_memories, bind_sessions, delete_statement, rebuild_file, run_delete, session_metadata,
    upsert_sessions_sql,
};

/// Sessions per statement of the final update.
const SESSIONS_PER_UPDATE: usize = 5_000;

/// Whether a database holds nothing the writer writes (a rebuild's target must not).
pub(crate) async fn is_empty(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT NOT (EXISTS (SELECT 1 FROM sessions) OR EXISTS (SELECT 1 FROM session_events)
                  OR EXISTS (SELECT 1 FROM request_outcomes) OR EXISTS (SELECT 1 FROM memories)
                  OR EXISTS (SELECT 1 FROM pending_purges) OR EXISTS (SELECT 1 FROM files)
                  OR EXISTS (SELECT 1 FROM writer_positions WHERE stream_seq > 0))",
    )
    .fetch_one(pool)
    .await
}

/// The events table's constraints and the secondary indexes of the events, the search
/// index and the outcomes, as statements that make them again: indexes first (each may be
/// built beside the others), then the constraints (a unique one adopts its index).
#[derive(Debug)]
pub(crate) struct SetAside {
    indexes: Vec<String>,
    constraints: Vec<String>,
}

/// Drops the events table's unique constraint and secondary indexes (and any foreign key),
/// the search index's full-text index, the outcomes' session index and the memories'
/// indexes but their session one (a delete during the load finds memories by it), and
/// returns how to make them again: an index built once costs a fraction of maintaining it
/// row by row. A rebuild that stops before [`restore`] leaves a database without them — one
/// to drop, as any unfinished rebuild's; a target found without them is refused.
pub(crate) async fn set_aside(conn: &mut PgConnection) -> anyhow::Result<SetAside> {
    let mut tx = conn.begin().await?;
    // (name, definition, the index of a unique constraint)
    let constraints: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT conname::text, pg_get_constraintdef(oid),
                CASE WHEN contype = 'u' THEN pg_get_indexdef(conindid) END
           FROM pg_constraint
          WHERE conrelid = 'session_events'::regclass AND contype IN ('f', 'u') ORDER BY conname",
    )
    .fetch_all(&mut *tx)
    .await?;
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i
          WHERE i.indrelid IN ('session_events'::regclass, 'search_entries'::regclass, 'request_outcomes'::regclass,
                               'memories'::regclass)
            AND NOT i.indisprimary
            -- a delete during the load finds a session's memories by it
            AND NOT (i.indrelid = 'memories'::regclass AND i.indkey[0] =
                     (SELECT attnum FROM pg_attribute WHERE attrelid = 'memories'::regclass AND attname = 'session_id'))
            AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)
          ORDER BY 1",
    )
    .fetch_all(&mut *tx)
    .await?;
    anyhow::ensure!(
        constraints.iter().any(|(_, _, unique)| unique.is_some()) && !indexes.is_empty(),
        "the target's events table lacks its unique constraint or indexes (left by an unfinished rebuild?): \
         drop the database and make a new one"
    );
    let mut remake = SetAside { indexes: Vec::new(), constraints: Vec::new() };
    for (name, definition, index) in &constraints {
        let name = quoted(name);
        sqlx::raw_sql(&format!("ALTER TABLE session_events DROP CONSTRAINT {name}"))
            .execute(&mut *tx)
            .await?;
        match index {
            // The same constraint, its index (of the same name) built beside the others.
            Some(index) => {
                remake.indexes.push(index.clone());
                remake.constraints.push(format!(
                    "ALTER TABLE session_events ADD CONSTRAINT {name} UNIQUE USING INDEX {name}"
                ));
            }
            None => remake
                .constraints
                .push(format!("ALTER TABLE session_events ADD CONSTRAINT {name} {definition}")),
        }
    }
    for (name, definition) in &indexes {
        // regclass text is already quoted where it needs to be.
        sqlx::raw_sql(&format!("DROP INDEX {name}")).execute(&mut *tx).await?;
        remake.indexes.push(definition.clone());
    }
    tx.commit().await?;
    Ok(remake)
}

/// What a partition's rebuild leaves to write once every partition is loaded: its final
/// state at its position ([`write_final`]).
pub(crate) struct PartitionEnd {
    pub(crate) partition: i32,
    pub(crate) position: i64,
    pub(crate) state: LoadedState,
}

/// Writes every partition's final state and makes again what [`set_aside`] dropped, on two
/// connections, since a build uses one core: one starts with the full-text index (the
/// longest build), the other with the final states (they write other tables); then each
/// takes the next index until none is left. Then the constraints, and the planner's
/// statistics of the loaded tables (the events' on one connection, the rest on the other).
pub(crate) async fn restore(
    pool: &PgPool,
    set_aside: SetAside,
    ends: Vec<PartitionEnd>,
) -> anyhow::Result<()> {
    let (gin, btrees): (Vec<String>, Vec<String>) =
        set_aside.indexes.into_iter().partition(|i| i.contains(" USING gin "));
    let queue = std::sync::Mutex::new(btrees);
    let next = || queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
    let lane = |first: Vec<String>| async move {
        let mut conn = pool.acquire().await?;
        for statement in first {
            build_index(&mut conn, &statement).await?;
        }
        while let Some(statement) = next() {
            build_index(&mut conn, &statement).await?;
        }
        anyhow::Ok(())
    };
    let finals = async {
        let mut conn = pool.acquire().await?;
        for end in &ends {
            let t0 = std::time::Instant::now();
            write_final(&mut conn, end.partition, end.position, &end.state).await?;
            tracing::debug!(
                partition = end.partition,
                us = t0.elapsed().as_micros() as u64,
                "final state written"
            );
        }
        drop(conn);
        lane(Vec::new()).await
    };
    tokio::try_join!(lane(gin), finals)?;
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    for statement in &set_aside.constraints {
        sqlx::raw_sql(statement).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    drop(conn);
    let t0 = std::time::Instant::now();
    let analyze = |tables: &'static str| async move {
        sqlx::raw_sql(&format!("ANALYZE {tables}")).execute(&mut *pool.acquire().await?).await
    };
    tokio::try_join!(analyze("session_events"), analyze("sessions, request_outcomes, memories, files"))?;
    tracing::debug!(us = t0.elapsed().as_micros() as u64, "statistics gathered");
    Ok(())
}

async fn build_index(conn: &mut PgConnection, statement: &str) -> Result<(), sqlx::Error> {
    let t0 = std::time::Instant::now();
    sqlx::raw_sql(statement).execute(conn).await?;
    tracing::debug!(statement, us = t0.elapsed().as_micros() as u64, "index built");
    Ok(())
}

/// Sends `rows` to a binary COPY `statement`.
async fn copy_rows(conn: &mut PgConnection, statement: &str, rows: CopyBinary) -> Result<(), sqlx::Error> {
    let mut copy = conn.copy_in_raw(statement).await?;
    copy.send(rows.finish()).await?;
    copy.finish().await?;
    Ok(())
}

fn quoted(identifier: &str) -> String {
    format!("\"{}\"", identifier.replace('"', "\"\""))
}

/// What of an applied batch is written in batch order, on one connection, in one
/// transaction: a file op, or a delete (the live writer's statement, with no position to
/// move: the rebuild writes it at the end, and the outcomes then, from memory), or the
/// batch's new sessions and its memories (a memory's session is in an earlier head or
/// this one). A batch's events are written beside it ([`write_events`]).
pub(crate) async fn write_head(conn: &mut PgConnection, fx: &BatchEffects) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    if let Some(file) = &fx.file {
        rebuild_file(&mut tx, file).await?;
    } else if fx.deleted.is_some() {
        static STATEMENT: LazyLock<String> = LazyLock::new(|| {
            delete_statement("SELECT 1 WHERE $1::int4 IS NOT NULL AND $2::int8 IS NOT NULL")
        });
        run_delete(&mut tx, &STATEMENT, (0, 0), fx, &[]).await?;
    } else {
        if !fx.created.is_empty() {
            upsert_sessions(&mut tx, &fx.created.iter().collect::<Vec<_>>()).await?;
        }
        if !fx.memories.is_empty() {
            let m = &fx.memories;
            // A memory id seen before keeps its first row, as in the live writer.
            bind_memories!(
                sqlx::query(
                    "INSERT INTO memories (id, owner, session_id, turn_seq, text, created_at)
                     SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::uuid[], $4::int8[], $5::text[], $6::timestamptz[])
                     ON CONFLICT (id) DO NOTHING",
                ),
                m
            )
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await
}

/// Whether a batch has anything for [`write_head`].
pub(crate) fn has_head(fx: &BatchEffects) -> bool {
    fx.file.is_some() || fx.deleted.is_some() || !fx.created.is_empty() || !fx.memories.is_empty()
}

/// Some of a batch's events and their search rows, in a transaction of their own: during
/// the load nothing relates them to the rows of other transactions but the primary keys.
pub(crate) async fn write_events(conn: &mut PgConnection, events: &[EventRow]) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    copy_events(&mut tx, events).await?;
    tx.commit().await
}

/// Events and their search rows (binary COPY).
async fn copy_events(conn: &mut PgConnection, events: &[EventRow]) -> Result<(), sqlx::Error> {
    if events.is_empty() {
        return Ok(());
    }
    let mut rows = CopyBinary::new();
    for e in events {
        let event = &e.event;
        rows.tuple(8);
        rows.uuid(event.session_id.0);
        rows.int8(event.seq);
        rows.uuid(event.event_id.0);
        rows.text(event.kind.as_str());
        rows.jsonb(&event.payload);
        rows.int4(e.tokens);
        rows.int8(e.stream_seq());
        rows.timestamptz(event.created_at);
    }
    copy_rows(
        conn,
        "COPY session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
             FROM STDIN (FORMAT binary)",
        rows,
    )
    .await?;
    copy_search_entries(conn, events).await
}

/// The search rows of a batch's events, made from the payloads in hand as the live
/// indexer makes them (a later delete in the rebuild removes them as it does live).
async fn copy_search_entries(conn: &mut PgConnection, events: &[EventRow]) -> Result<(), sqlx::Error> {
    let entries = crate::search::Committed::of(events, 0).events;
    if entries.is_empty() {
        return Ok(());
    }
    let mut rows = CopyBinary::new();
    for e in &entries {
        rows.tuple(6);
        rows.uuid(e.session.0);
        rows.int8(e.seq);
        rows.text(&e.owner);
        rows.text(e.kind);
        rows.text(&e.body);
        rows.timestamptz(e.created_at);
    }
    copy_rows(
        conn,
        "COPY search_entries (session_id, seq, owner, kind, body, created_at) FROM STDIN (FORMAT binary)",
        rows,
    )
    .await?;
    Ok(())
}

/// The end of a partition's rebuild: every session's final row, every outcome, and the
/// position (applied and published: those events reached the feed when first applied).
async fn write_final(
    conn: &mut PgConnection,
    partition: i32,
    position: i64,
    state: &LoadedState,
) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    let sessions: Vec<&SessionRow> = state.sessions.values().collect();
    for chunk in sessions.chunks(SESSIONS_PER_UPDATE) {
        upsert_sessions(&mut tx, chunk).await?;
    }
    if !state.outcomes.is_empty() {
        let mut rows = CopyBinary::new();
        for (outcome, session) in state.outcomes.values() {
            rows.tuple(5);
            rows.uuid(outcome.request_id);
            match session {
                Some(s) => rows.uuid(s.0),
                None => rows.null(),
            }
            rows.text(outcome.status.as_str());
            match outcome.seq {
                Some(seq) => rows.int8(seq),
                None => rows.null(),
            }
            match &outcome.reason {
                Some(reason) => rows.text(reason),
                None => rows.null(),
            }
        }
        copy_rows(
            &mut tx,
            "COPY request_outcomes (request_id, session_id, status, seq, reason) FROM STDIN (FORMAT binary)",
            rows,
        )
        .await?;
    }
    sqlx::query(
        "INSERT INTO writer_positions (partition, stream_seq, published_seq) VALUES ($1, $2, $2)
         ON CONFLICT (partition) DO UPDATE SET stream_seq = $2, published_seq = $2",
    )
    .bind(partition)
    .bind(position)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

async fn upsert_sessions(conn: &mut PgConnection, sessions: &[&SessionRow]) -> Result<(), sqlx::Error> {
    static STATEMENT: LazyLock<String> = LazyLock::new(|| upsert_sessions_sql(1, 17, ""));
    bind_sessions!(sqlx::query(STATEMENT.as_str()), sessions)
        .bind(session_metadata(sessions))
        .execute(conn)
        .await?;
    Ok(())
}

/// Rows in PostgreSQL's binary COPY format, each value encoded as sqlx encodes it for the
/// live writer's statements (so both store the same bits).
struct CopyBinary {
    buf: Vec<u8>,
}

impl CopyBinary {
    fn new() -> Self {
        let mut buf = Vec::with_capacity(1 << 20);
        buf.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
        buf.extend_from_slice(&0i32.to_be_bytes()); // flags
        buf.extend_from_slice(&0i32.to_be_bytes()); // header extension length
        Self { buf }
    }

    fn tuple(&mut self, fields: i16) {
        self.buf.extend_from_slice(&fields.to_be_bytes());
    }

    fn field(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(&i32::try_from(bytes.len()).unwrap_or(i32::MAX).to_be_bytes());
        self.buf.extend_from_slice(bytes);
    }

    fn null(&mut self) {
        self.buf.extend_from_slice(&(-1i32).to_be_bytes());
    }

    fn uuid(&mut self, id: Uuid) {
        self.field(id.as_bytes());
    }

    fn int8(&mut self, v: i64) {
        self.field(&v.to_be_bytes());
    }

    fn int4(&mut self, v: i32) {
        self.field(&v.to_be_bytes());
    }

    fn text(&mut self, s: &str) {
        self.field(s.as_bytes());
    }

    /// jsonb's binary form: a version byte, then the JSON text.
    fn jsonb(&mut self, v: &Value) {
        let at = self.buf.len();
        self.buf.extend_from_slice(&0i32.to_be_bytes());
        self.buf.push(1);
        // Writing into a Vec cannot fail; a Value always serializes.
        let _ = serde_json::to_writer(&mut self.buf, v);
        let len = i32::try_from(self.buf.len() - at - 4).unwrap_or(i32::MAX);
        self.buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
    }

    /// Microseconds since 2000-01-01 UTC, truncated as sqlx truncates.
    fn timestamptz(&mut self, t: DateTime<Utc>) {
        let epoch = DateTime::<Utc>::from_timestamp(946_684_800, 0).unwrap_or_default();
        self.int8((t - epoch).num_microseconds().unwrap_or(i64::MAX));
    }

    fn finish(mut self) -> Vec<u8> {
        self.buf.extend_from_slice(&(-1i16).to_be_bytes());
        self.buf
    }
}
