//! The read side: owner-scoped queries every service uses (the ingress for its API, the
//! workers for a session's live tail). Another owner's session is simply not found.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use sqlx::{FromRow as _, PgPool, Row as _};
use uuid::Uuid;

use turnlog_core::budget::CountedEvent;
use turnlog_core::events::{DecodeError, Event, EventKind};
use turnlog_core::ids::{EventId, Owner, SessionId};

use crate::bus::{Outcome, OutcomeStatus};

/// A `sessions` row: the one declaration every service reads it through (the ingress's
/// session views, the writer's batch state, `verify`'s comparison).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct SessionRow {
    #[sqlx(try_from = "Uuid")]
    pub id: SessionId,
    #[sqlx(try_from = "String")]
    pub owner: Owner,
    pub title: Option<String>,
    pub archived: bool,
    /// Category of the newest user message that named one.
    pub last_category: Option<String>,
    pub last_seq: i64,
    pub compacted_through: Option<i64>,
    pub compaction_seq: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// [`SessionRow`]'s columns, in a `SELECT` of `sessions`.
pub const SESSION_COLUMNS: &str =
    "id, owner, title, archived, last_category, last_seq, compacted_through, compaction_seq, created_at, updated_at";

/// An event row as stored: kind and payload raw (the `/events` page), decodable.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct StoredEvent {
    pub seq: i64,
    #[serde(skip)]
    pub event_id: Uuid,
    pub kind: String,
    pub payload: serde_json::Value,
    #[serde(skip)]
    pub tokens: i32,
    pub created_at: DateTime<Utc>,
}

impl StoredEvent {
    pub fn decode(&self) -> Result<Event, DecodeError> {
        Event::decode(self.seq, EventId(self.event_id), &self.kind, &self.payload, self.created_at)
    }

    /// The budget's view, from the stored count (no re-encoding).
    pub fn counted(&self) -> Result<CountedEvent, DecodeError> {
        let kind: EventKind = self.kind.parse()?;
        let replaces_through = match kind {
            EventKind::CompactionApplied => self.payload.get("replaces_through_seq").and_then(|v| v.as_i64()),
            _ => None,
        };
        Ok(CountedEvent {
            seq: self.seq,
            kind,
            tokens: u32::try_from(self.tokens).unwrap_or(0),
            replaces_through,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// The owner's session `id`; None when it does not exist or is another owner's.
pub async fn get_session(
    pool: &PgPool,
    owner: &str,
    id: SessionId,
) -> Result<Option<SessionRow>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1 AND owner = $2"))
        .bind(id.0)
        .bind(owner)
        .fetch_optional(pool)
        .await
}

/// A session's live tail: its newest compaction and every event after that compaction's
/// boundary — all that the model's context and the next request's size depend on.
#[derive(Debug, Clone)]
pub struct LiveTail {
    pub state: SessionRow,
    pub events: Vec<Event>,
    pub counted: Vec<CountedEvent>,
}

pub async fn live_tail(pool: &PgPool, owner: &str, id: SessionId) -> Result<Option<LiveTail>, ReadError> {
    let Some(state) = get_session(pool, owner, id).await? else { return Ok(None) };
    let rows: Vec<StoredEvent> = sqlx::query_as(
        "SELECT seq, event_id, kind, payload, tokens, created_at FROM session_events
          WHERE session_id = $1 AND (seq > $2 OR seq = $3) ORDER BY seq",
    )
    .bind(id.0)
    .bind(state.compacted_through.unwrap_or(0))
    .bind(state.compaction_seq.unwrap_or(0))
    .fetch_all(pool)
    .await?;
    let counted = rows.iter().map(StoredEvent::counted).collect::<Result<Vec<_>, _>>()?;
    let events = rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?;
    Ok(Some(LiveTail { state, events, counted }))
}

/// Every event of a session, decoded. Services read pages or a live tail instead; this is
/// for tools and tests that look at a whole log.
pub async fn all_events(pool: &PgPool, owner: &str, id: SessionId) -> Result<Option<Vec<Event>>, ReadError> {
    match events_page(pool, owner, id, 0, i64::MAX).await? {
        None => Ok(None),
        Some(rows) => Ok(Some(rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?)),
    }
}

/// Up to `limit` raw events after `after`, or None when the session is not the owner's.
pub async fn events_page(
    pool: &PgPool,
    owner: &str,
    id: SessionId,
    after: i64,
    limit: i64,
) -> Result<Option<Vec<StoredEvent>>, sqlx::Error> {
    let rows: Vec<StoredEvent> = sqlx::query_as(
        "SELECT e.seq, e.event_id, e.kind, e.payload, e.tokens, e.created_at
           FROM session_events e JOIN sessions s ON s.id = e.session_id
          WHERE e.session_id = $1 AND s.owner = $2 AND e.seq > $3
          ORDER BY e.seq LIMIT $4",
    )
    .bind(id.0)
    .bind(owner)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    if rows.is_empty() && get_session(pool, owner, id).await?.is_none() {
        return Ok(None);
    }
    Ok(Some(rows))
}

/// One page of a session's transcript: the newest visible events before a seq.
#[derive(Debug, Clone)]
pub struct TranscriptPage {
    /// Visible events in seq order; each is one transcript item (`ui_transcript::transcript_item`).
    pub events: Vec<Event>,
    /// `before` of the page of older items; None when this page starts the transcript.
    pub earlier: Option<i64>,
}

/// The newest `limit` events the transcript shows with seq < `before`, scanning back from
/// `before` and never reading the rest of the log. Visibility is `ui_transcript`'s rule,
/// asked of the events after each candidate through indexed lookups
/// (`session_events_attempt`, `session_events_permission`, the primary key):
/// - a permission request is hidden once any event resolves it;
/// - a checkpoint with an attempt id is hidden when a later checkpoint or any answer of
///   that attempt exists;
/// - a checkpoint without one belongs to the run of events up to the next turn boundary
///   (user message, failure, answer, or a final checkpoint without an id, which closes
///   its own run): it is hidden when the next such event is an answer or another
///   checkpoint without an id, and a final one is always shown.
const TRANSCRIPT_PAGE: &str = "SELECT e.seq, e.event_id, e.kind, e.payload, e.tokens, e.created_at
   FROM session_events e JOIN sessions s ON s.id = e.session_id
  WHERE e.session_id = $1 AND s.owner = $2 AND e.seq < $3
    AND (e.kind IN ('user_message', 'assistant_turn', 'tool_execution', 'compaction_applied', 'turn_failed')
         OR (e.kind = 'permission_request'
             AND NOT EXISTS (SELECT 1 FROM session_events r
                              WHERE r.session_id = e.session_id AND r.kind = 'permission_resolved'
                                AND r.payload ->> 'id' = e.payload ->> 'id'))
         OR (e.kind = 'pending_state' AND e.payload ->> 'attempt_id' IS NOT NULL
             AND NOT EXISTS (SELECT 1 FROM session_events a
                              WHERE a.session_id = e.session_id
                                AND a.kind IN ('pending_state', 'assistant_turn')
                                AND a.payload ->> 'attempt_id' = e.payload ->> 'attempt_id'
                                AND (a.kind = 'assistant_turn' OR a.seq > e.seq)))
         OR (e.kind = 'pending_state' AND e.payload ->> 'attempt_id' IS NULL
             AND (e.payload ->> 'reason' IS NOT NULL
                  OR coalesce((SELECT n.kind FROM session_events n
                                WHERE n.session_id = e.session_id AND n.seq > e.seq
                                  AND (n.kind IN ('user_message', 'turn_failed', 'assistant_turn')
                                       OR (n.kind = 'pending_state' AND n.payload ->> 'attempt_id' IS NULL))
                                ORDER BY n.seq LIMIT 1), 'user_message')
                     IN ('user_message', 'turn_failed'))))
  ORDER BY e.seq DESC
  LIMIT $4";

/// The newest `limit` visible events before `before` (seq order) and the cursor of the
/// older ones, or None when the session is not the owner's.
pub async fn transcript_page(
    pool: &PgPool,
    owner: &str,
    id: SessionId,
    before: i64,
    limit: i64,
) -> Result<Option<TranscriptPage>, ReadError> {
    let limit = limit.max(1);
    // One row more than asked tells whether older items exist.
    let mut rows: Vec<StoredEvent> = sqlx::query_as(TRANSCRIPT_PAGE)
        .bind(id.0)
        .bind(owner)
        .bind(before)
        .bind(limit + 1)
        .fetch_all(pool)
        .await?;
    if rows.is_empty() && get_session(pool, owner, id).await?.is_none() {
        return Ok(None);
    }
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    rows.reverse();
    let earlier = more.then(|| rows.first().map(|e| e.seq)).flatten();
    let events = rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?;
    Ok(Some(TranscriptPage { events, earlier }))
}

/// Where a permission request stands, found by its id alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermissionStatus {
    /// Seq of the first `permission_request` with this id; None when there is none.
    pub request_seq: Option<i64>,
    /// Seq and decision of the first `permission_resolved` for it: the one that decided.
    pub resolution: Option<(i64, String)>,
}

/// Permission request `perm_id` of the session, or None when the session is not the owner's.
pub async fn permission_status(
    pool: &PgPool,
    owner: &str,
    id: SessionId,
    perm_id: &str,
) -> Result<Option<PermissionStatus>, sqlx::Error> {
    let row: Option<(Option<i64>, Option<i64>, Option<String>)> = sqlx::query_as(
        "SELECT (SELECT q.seq FROM session_events q
                  WHERE q.session_id = s.id AND q.kind = 'permission_request' AND q.payload ->> 'id' = $3
                  ORDER BY q.seq LIMIT 1),
                r.seq, r.payload ->> 'decision'
           FROM sessions s
           LEFT JOIN LATERAL (SELECT seq, payload FROM session_events
                               WHERE session_id = s.id AND kind = 'permission_resolved' AND payload ->> 'id' = $3
                               ORDER BY seq LIMIT 1) r ON true
          WHERE s.id = $1 AND s.owner = $2",
    )
    .bind(id.0)
    .bind(owner)
    .bind(perm_id)
    .fetch_optional(pool)
    .await?;
    Ok(row
        .map(|(request_seq, seq, decision)| PermissionStatus { request_seq, resolution: seq.zip(decision) }))
}

/// The composite paging cursor: the `(updated_at, id)` of the last row of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub before: DateTime<Utc>,
    pub before_id: Uuid,
}

impl Cursor {
    /// `before` as clients echo it: RFC 3339 with microseconds, the database's precision.
    pub fn before_text(&self) -> String {
        self.before.to_rfc3339_opts(SecondsFormat::Micros, true)
    }
}

#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub limit: i64,
    /// Full-text match on the title or any user message; archived sessions included.
    pub q: Option<String>,
    pub archived: bool,
    pub before: Option<Cursor>,
}

/// The owner's sessions of one archive view, newest first from the cursor (`$2`, the
/// search text, is unused).
const LIST_SESSIONS: &str = "SELECT id, owner, title, archived, last_category, last_seq, compacted_through, compaction_seq, created_at,
        updated_at FROM sessions
  WHERE owner = $1 AND archived = $3
    AND ($4::timestamptz IS NULL OR (updated_at, id) < ($4, $5))
  ORDER BY updated_at DESC, id DESC
  LIMIT $6";

/// The owner's sessions whose title or any user message matches `$2`, archived or not.
/// Each text is matched by the very expression its GIN index is built on
/// (`sessions_title_fts`, `session_events_user_text_fts`), so Postgres looks the words
/// up instead of computing a tsvector per row; `$3` is unused here.
const SEARCH_SESSIONS: &str =
    "SELECT id, owner, title, archived, last_category, last_seq, compacted_through, compaction_seq, created_at,
        updated_at FROM sessions
  WHERE owner = $1
    AND ($4::timestamptz IS NULL OR (updated_at, id) < ($4, $5))
    AND id IN (SELECT t.id FROM sessions t
                WHERE t.owner = $1
                  AND to_tsvector('simple', coalesce(t.title, '')) @@ plainto_tsquery('simple', $2)
               UNION
               SELECT e.session_id FROM session_events e
                WHERE e.kind = 'user_message'
                  AND to_tsvector('simple', e.payload ->> 'text') @@ plainto_tsquery('simple', $2))
  ORDER BY updated_at DESC, id DESC
  LIMIT $6";

/// [`list_sessions`]'s statement for `query`, its parameters bound.
fn list_statement<'q>(
    sql: &'q str,
    owner: &'q str,
    query: &'q ListQuery,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(owner)
        .bind(query.q.as_deref())
        .bind(query.archived)
        .bind(query.before.map(|c| c.before))
        .bind(query.before.map_or(Uuid::max(), |c| c.before_id))
        .bind(query.limit.clamp(1, 1000))
}

fn list_sql(query: &ListQuery) -> &'static str {
    if query.q.is_some() {
        SEARCH_SESSIONS
    } else {
        LIST_SESSIONS
    }
}

/// Newest first by `(updated_at, id)`; returns the page and the cursor of the next one.
pub async fn list_sessions(
    pool: &PgPool,
    owner: &str,
    query: &ListQuery,
) -> Result<(Vec<SessionRow>, Option<Cursor>), sqlx::Error> {
    let limit = query.limit.clamp(1, 1000);
    let rows: Vec<SessionRow> = list_statement(list_sql(query), owner, query)
        .try_map(|row| SessionRow::from_row(&row))
        .fetch_all(pool)
        .await?;
    let next = (rows.len() as i64 == limit)
        .then(|| rows.last().map(|s| Cursor { before: s.updated_at, before_id: s.id.0 }))
        .flatten();
    Ok((rows, next))
}

/// The plan Postgres chooses for [`list_sessions`] with `query` (`EXPLAIN`, as text): how
/// an operator, or a test, sees whether a search is served by the full-text indexes.
pub async fn explain_list_sessions(
    pool: &PgPool,
    owner: &str,
    query: &ListQuery,
) -> Result<String, sqlx::Error> {
    let sql = format!("EXPLAIN {}", list_sql(query));
    let lines: Vec<String> = list_statement(&sql, owner, query)
        .try_map(|row: sqlx::postgres::PgRow| row.try_get::<String, _>(0))
        .fetch_all(pool)
        .await?;
    Ok(lines.join("\n"))
}

/// A long-term memory as recall returns it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct Memory {
    pub id: Uuid,
    pub session_id: Uuid,
    pub turn_seq: i64,
    pub text: String,
    pub created_at: DateTime<Utc>,
}

/// The owner's memories matching `q` (Postgres full text, `simple` configuration, as the
/// `memories_fts` index is built), newest first; without `q`, the newest.
pub async fn recall_memories(
    pool: &PgPool,
    owner: &str,
    q: Option<&str>,
    limit: i64,
) -> Result<Vec<Memory>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, session_id, turn_seq, text, created_at FROM memories
          WHERE owner = $1
            AND ($2::text IS NULL OR to_tsvector('simple', text) @@ plainto_tsquery('simple', $2))
          ORDER BY created_at DESC, id DESC
          LIMIT $3",
    )
    .bind(owner)
    .bind(q)
    .bind(limit.max(1))
    .fetch_all(pool)
    .await
}

/// The owner's memories most relevant to `text` (any of its words, best matches first):
/// what a turn recalls into its extras.
pub async fn recall_relevant(
    pool: &PgPool,
    owner: &str,
    text: &str,
    limit: i64,
) -> Result<Vec<Memory>, sqlx::Error> {
    sqlx::query_as(
        "WITH q AS (
             SELECT to_tsquery('simple', string_agg(quote_literal(w), ' | ')) AS q
               FROM unnest(tsvector_to_array(to_tsvector('simple', $2))) AS w
         )
         SELECT m.id, m.session_id, m.turn_seq, m.text, m.created_at FROM memories m, q
          WHERE m.owner = $1 AND q.q IS NOT NULL AND to_tsvector('simple', m.text) @@ q.q
          ORDER BY ts_rank(to_tsvector('simple', m.text), q.q) DESC, m.created_at DESC, m.id DESC
          LIMIT $3",
    )
    .bind(owner)
    .bind(text)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// The session's last user message (seq and payload) and whether an answer follows it:
/// what a retry runs again.
pub async fn last_user_message(
    pool: &PgPool,
    owner: &str,
    id: SessionId,
) -> Result<Option<(i64, turnlog_core::events::UserMessage, bool)>, ReadError> {
    let row: Option<(i64, serde_json::Value, bool)> = sqlx::query_as(
        "SELECT e.seq, e.payload,
                EXISTS (SELECT 1 FROM session_events a
                         WHERE a.session_id = e.session_id AND a.kind = 'assistant_turn' AND a.seq > e.seq)
           FROM session_events e JOIN sessions s ON s.id = e.session_id
          WHERE e.session_id = $1 AND s.owner = $2 AND e.kind = 'user_message'
          ORDER BY e.seq DESC LIMIT 1",
    )
    .bind(id.0)
    .bind(owner)
    .fetch_optional(pool)
    .await?;
    let Some((seq, payload, answered)) = row else { return Ok(None) };
    match turnlog_core::events::EventBody::decode(EventKind::UserMessage, &payload, seq)? {
        turnlog_core::events::EventBody::UserMessage(m) => Ok(Some((seq, m, answered))),
        _ => Ok(None),
    }
}

/// The events of the turn a committed `assistant_turn` at `turn_seq` closes: from the
/// user message it answers (the newest one before it) through the answer, with any tool
/// executions, checkpoints and failed attempts in between. What distillation and memory
/// extraction read; at most `limit` events.
pub async fn turn_events(
    pool: &PgPool,
    session: SessionId,
    turn_seq: i64,
    limit: i64,
) -> Result<Vec<Event>, ReadError> {
    let rows: Vec<StoredEvent> = sqlx::query_as(
        "SELECT seq, event_id, kind, payload, tokens, created_at FROM session_events
          WHERE session_id = $1 AND seq <= $2
            AND seq >= coalesce((SELECT max(seq) FROM session_events
                                  WHERE session_id = $1 AND kind = 'user_message' AND seq < $2), $2)
          ORDER BY seq LIMIT $3",
    )
    .bind(session.0)
    .bind(turn_seq)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?)
}

/// Whether a deleted session's messages are still being removed from the streams.
pub async fn purge_pending(pool: &PgPool, session: SessionId) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pending_purges WHERE session_id = $1)")
        .bind(session.0)
        .fetch_one(pool)
        .await
}

/// The outcome the writer recorded for a request, if it has applied it.
pub async fn recorded_outcome(pool: &PgPool, request_id: Uuid) -> Result<Option<Outcome>, sqlx::Error> {
    let row: Option<(String, Option<i64>, Option<String>)> =
        sqlx::query_as("SELECT status, seq, reason FROM request_outcomes WHERE request_id = $1")
            .bind(request_id)
            .fetch_optional(pool)
            .await?;
    Ok(row.map(|(status, seq, reason)| Outcome {
        request_id,
        status: if status == "committed" { OutcomeStatus::Committed } else { OutcomeStatus::Rejected },
        seq,
        reason,
    }))
}

/// The events a request sent right after `through_seq` was built from, as the live tail
/// read them then: the newest compaction at or before `through_seq` and every event after
/// its boundary up to `through_seq` (what `GET /requests/{seq}` rebuilds a body from). None
/// when the session is not the owner's.
pub async fn tail_through(
    pool: &PgPool,
    owner: &str,
    id: SessionId,
    through_seq: i64,
) -> Result<Option<Vec<Event>>, ReadError> {
    let rows: Vec<StoredEvent> = sqlx::query_as(
        "WITH c AS (SELECT seq, coalesce((payload ->> 'replaces_through_seq')::bigint, 0) AS boundary
                      FROM session_events
                     WHERE session_id = $1 AND kind = 'compaction_applied' AND seq <= $3
                     ORDER BY seq DESC LIMIT 1)
         SELECT e.seq, e.event_id, e.kind, e.payload, e.tokens, e.created_at
           FROM session_events e JOIN sessions s ON s.id = e.session_id
          WHERE e.session_id = $1 AND s.owner = $2 AND e.seq <= $3
            AND (e.seq > coalesce((SELECT boundary FROM c), 0) OR e.seq = (SELECT seq FROM c))
          ORDER BY e.seq",
    )
    .bind(id.0)
    .bind(owner)
    .bind(through_seq)
    .fetch_all(pool)
    .await?;
    if rows.is_empty() && get_session(pool, owner, id).await?.is_none() {
        return Ok(None);
    }
    Ok(Some(rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?))
}
