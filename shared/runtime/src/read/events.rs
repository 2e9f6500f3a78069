//! A session's events as stored, read over its branch log: the live tail the model's
//! context is built from, pages of raw events, one event, and the tail a past request saw.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use turnlog_core::budget::CountedEvent;
use turnlog_core::events::{DecodeError, Event, EventBody, EventKind, KindName};
use turnlog_core::ids::{EventId, Owner, SessionId};

use super::{get_session, ReadError, SessionRow};

/// An event row as stored: its kind as named (a newer writer's too) and its payload raw
/// (the `/events` page), decodable.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct StoredEvent {
    /// The session the event belongs to: on a fork's branch log, an ancestor for the
    /// inherited events (DESIGN §10).
    pub session_id: Uuid,
    pub seq: i64,
    #[serde(skip)]
    pub event_id: Uuid,
    #[sqlx(try_from = "String")]
    pub kind: KindName,
    pub payload: serde_json::Value,
    #[serde(skip)]
    pub tokens: i32,
    pub created_at: DateTime<Utc>,
}

impl StoredEvent {
    pub fn decode(&self) -> Result<Event, DecodeError> {
        let body = EventBody::decode(EventKind::try_from(&self.kind)?, &self.payload, self.seq)?;
        Ok(Event { seq: self.seq, event_id: EventId(self.event_id), created_at: self.created_at, body })
    }

    /// The budget's view, from the stored count (no re-encoding).
    pub fn counted(&self) -> Result<CountedEvent, DecodeError> {
        let kind = EventKind::try_from(&self.kind)?;
        let replaces_through = match kind {
            EventKind::CompactionApplied => self.payload.get("replaces_through_seq").and_then(|v| v.as_i64()),
            _ => None,
        };
        let asks_for_tools =
            kind == EventKind::AssistantTurn && turnlog_core::events::payload_asks_for_tools(&self.payload);
        Ok(counted(self.seq, kind, self.tokens, replaces_through, asks_for_tools))
    }
}

/// A [`CountedEvent`] of a stored event's kind and count and the two facts of its payload
/// the budget needs, each given only for its kind: a compaction's boundary and whether an
/// answer asks for tools.
fn counted(
    seq: i64,
    kind: EventKind,
    tokens: i32,
    replaces_through: Option<i64>,
    asks_for_tools: bool,
) -> CountedEvent {
    CountedEvent {
        seq,
        kind,
        tokens: u32::try_from(tokens).unwrap_or(0),
        replaces_through,
        tool: match kind {
            EventKind::AssistantTurn => asks_for_tools,
            other => other.projection() == turnlog_core::events::Projection::Tool,
        },
    }
}

/// A [`StoredEvent`]'s counted view as Postgres reads it from the payload in place: the
/// payload itself is neither sent nor parsed.
#[derive(sqlx::FromRow)]
struct CountedRow {
    seq: i64,
    #[sqlx(try_from = "String")]
    kind: KindName,
    tokens: i32,
    replaces_through: Option<i64>,
    asks_for_tools: bool,
}

/// [`CountedRow`]'s columns, from `session_events e`: `payload_asks_for_tools` and the
/// compaction's `replaces_through_seq`, in SQL (a test compares the two reads); a CASE
/// evaluates in order, so only an array is measured.
macro_rules! counted_columns {
    () => {
        "SELECT e.seq, e.kind, e.tokens,
                CASE WHEN e.kind = 'compaction_applied' THEN (e.payload ->> 'replaces_through_seq')::int8
                END AS replaces_through,
                CASE WHEN e.kind = 'assistant_turn'
                      AND jsonb_typeof(e.payload #> '{llm,message,tool_calls}') = 'array'
                     THEN jsonb_array_length(e.payload #> '{llm,message,tool_calls}') > 0
                     ELSE false END AS asks_for_tools"
    };
}

fn counted_row(r: &CountedRow) -> Result<CountedEvent, DecodeError> {
    Ok(counted(r.seq, EventKind::try_from(&r.kind)?, r.tokens, r.replaces_through, r.asks_for_tools))
}

/// A session's live tail: its newest compaction and every event after that compaction's
/// boundary — all that the model's context and the next request's size depend on.
#[derive(Debug, Clone)]
pub struct LiveTail {
    pub state: SessionRow,
    pub events: Vec<Event>,
    pub counted: Vec<CountedEvent>,
}

pub async fn live_tail(pool: &PgPool, owner: &Owner, id: SessionId) -> Result<Option<LiveTail>, ReadError> {
    tail_from(pool, owner, id, Vec::new(), Vec::new()).await
}

/// The live tail again, from `tail` (read earlier, by [`live_tail`] or this) and the events
/// committed since: the same as a new [`live_tail`], without reading or decoding again what
/// `tail` holds. Events are only ever appended, in seq order, and a newer compaction moves
/// the start past what it replaces; both hold over a fork's branch log.
pub async fn live_tail_after(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    tail: LiveTail,
) -> Result<Option<LiveTail>, ReadError> {
    tail_from(pool, owner, id, tail.events, tail.counted).await
}

/// The live tail from the start of one read earlier (`events`, `counted`: none for a new one).
async fn tail_from(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    mut events: Vec<Event>,
    mut counted: Vec<CountedEvent>,
) -> Result<Option<LiveTail>, ReadError> {
    let Some(state) = get_session(pool, owner, id).await? else { return Ok(None) };
    // The compaction itself comes after the boundary it replaces (the writer checks it),
    // so one range per segment holds the whole tail.
    let start = state.compacted_through.unwrap_or(0);
    let after = events.last().map_or(start, |e| e.seq.max(start));
    let rows: Vec<StoredEvent> = sqlx::query_as(branch_sql!(
        "SELECT ",
        event_columns!(),
        branch_events!("AND e.seq > $3"),
        " ORDER BY e.seq"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .bind(after)
    .fetch_all(pool)
    .await?;
    let kept = events.partition_point(|e| e.seq <= start);
    events.drain(..kept);
    counted.drain(..kept);
    for row in &rows {
        counted.push(row.counted()?);
        events.push(row.decode()?);
    }
    Ok(Some(LiveTail { state, events, counted }))
}

/// The live tail's counts again ([`live_counts`]), from `counted` (read earlier, by
/// [`live_counts`] or this) and the events committed since, read as counts. None when the
/// session is not the owner's.
pub async fn live_counts_after(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    mut counted: Vec<CountedEvent>,
) -> Result<Option<Vec<CountedEvent>>, ReadError> {
    let rows = counted_after(pool, owner, id, counted.last().map_or(0, |e| e.seq)).await?;
    // Nothing new, or no such session: the whole read tells which.
    if rows.is_empty() {
        return live_counts(pool, owner, id).await;
    }
    for r in &rows {
        counted.push(counted_row(r)?);
    }
    // A newer compaction starts the tail after what it replaces (the session row's
    // `compacted_through`, which the writer sets from it).
    let compaction = counted.iter().rev().find(|e| e.kind == EventKind::CompactionApplied);
    if let Some(boundary) = compaction.and_then(|c| c.replaces_through) {
        let kept = counted.partition_point(|e| e.seq <= boundary);
        counted.drain(..kept);
    }
    Ok(Some(counted))
}

/// The live tail as the budget counts it ([`LiveTail::counted`]) without its events: what
/// a check that the next request fits needs. None when the session is not the owner's.
pub async fn live_counts(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
) -> Result<Option<Vec<CountedEvent>>, ReadError> {
    let rows = counted_after(pool, owner, id, 0).await?;
    // Never empty for a session: the tail holds its start or its newest compaction.
    if rows.is_empty() {
        return Ok(None);
    }
    Ok(Some(rows.iter().map(counted_row).collect::<Result<Vec<_>, DecodeError>>()?))
}

/// The live tail's events after seq `after`, as counted rows (none when the session is not
/// the owner's).
async fn counted_after(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    after: i64,
) -> Result<Vec<CountedRow>, sqlx::Error> {
    sqlx::query_as(branch_sql!(
        counted_columns!(),
        branch_events!(
            "AND e.seq > greatest($3, (SELECT coalesce(s.compacted_through, 0) FROM sessions s WHERE s.id = $1))"
        ),
        " ORDER BY e.seq"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .bind(after)
    .fetch_all(pool)
    .await
}

/// Every event of a session, decoded. Services read pages or a live tail instead; this is
/// for tools and tests that look at a whole log.
pub async fn all_events(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
) -> Result<Option<Vec<Event>>, ReadError> {
    match events_page(pool, owner, id, 0, i64::MAX).await? {
        None => Ok(None),
        Some(rows) => Ok(Some(rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?)),
    }
}

/// Up to `limit` raw events after `after`, or None when the session is not the owner's.
pub async fn events_page(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    after: i64,
    limit: i64,
) -> Result<Option<Vec<StoredEvent>>, sqlx::Error> {
    // Each segment gives at most `limit` rows, read in seq order by index.
    let rows: Vec<StoredEvent> = sqlx::query_as(branch_sql!(
        "SELECT x.* FROM branch b, LATERAL (
             SELECT ",
        event_columns!(),
        " FROM session_events e
              WHERE e.session_id = b.sid AND e.seq <= b.upto AND e.seq > $3
              ORDER BY e.seq LIMIT $4) x
          ORDER BY x.seq LIMIT $4"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    if rows.is_empty() && get_session(pool, owner, id).await?.is_none() {
        return Ok(None);
    }
    Ok(Some(rows))
}

/// The event at `seq` of the owner's session's branch log, or None (no such seq, or not
/// the owner's session).
pub async fn event_at(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    seq: i64,
) -> Result<Option<StoredEvent>, sqlx::Error> {
    // A client's seq: the branch log starts at 1 (and `seq - 1` must not overflow).
    if seq < 1 {
        return Ok(None);
    }
    let rows = events_page(pool, owner, id, seq - 1, 1).await?.unwrap_or_default();
    Ok(rows.into_iter().find(|e| e.seq == seq))
}

/// The events a request sent right after `through_seq` was built from, as the live tail
/// read them then: the newest compaction at or before `through_seq` in the branch log and
/// every event after its boundary up to `through_seq` (what `GET /requests/{seq}` rebuilds
/// a body from). None when the session is not the owner's.
pub async fn tail_through(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    through_seq: i64,
) -> Result<Option<Vec<Event>>, ReadError> {
    // The compaction itself is after its boundary, so the one range holds it.
    let rows: Vec<StoredEvent> = sqlx::query_as(branch_sql!(
        ", c AS (
             SELECT x.boundary FROM branch b, LATERAL (
                 SELECT e.seq, coalesce((e.payload ->> 'replaces_through_seq')::bigint, 0) AS boundary
                   FROM session_events e
                  WHERE e.session_id = b.sid AND e.seq <= b.upto AND e.seq <= $3 AND e.kind = 'compaction_applied'
                  ORDER BY e.seq DESC LIMIT 1) x
              ORDER BY x.seq DESC LIMIT 1)
         SELECT ",
        event_columns!(),
        branch_events!("AND e.seq <= $3 AND e.seq > coalesce((SELECT boundary FROM c), 0)"),
        " ORDER BY e.seq"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .bind(through_seq)
    .fetch_all(pool)
    .await?;
    if rows.is_empty() && get_session(pool, owner, id).await?.is_none() {
        return Ok(None);
    }
    Ok(Some(rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?))
}
