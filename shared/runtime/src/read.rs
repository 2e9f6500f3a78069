//! The read side: owner-scoped queries every service uses (the ingress for its API, the
//! workers for a session's live tail). Another owner's session is simply not found.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use sqlx::{FromRow as _, PgPool, Row as _};
use uuid::Uuid;

use turnlog_core::branch::Segment;
use turnlog_core::budget::CountedEvent;
use turnlog_core::events::{DecodeError, Event, EventKind, ForkPoint};
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
    /// When the session was last active, what the list sorts by: the stream time of its
    /// newest message (`user_message` or `assistant_turn`; of its creation before one), or,
    /// for a message brought in by an import, that message's original time (derived from the
    /// payload, so a rebuild reproduces it). Other events leave it.
    pub active_at: DateTime<Utc>,
    /// The parent and fork point a fork was created from (DESIGN §10).
    pub forked_from: Option<Uuid>,
    pub forked_through: Option<i64>,
    /// The ancestors the branch log reads, root first, and the last seq read from each
    /// (`turnlog_core::branch`); empty for a session that is not a fork.
    pub lineage: Vec<Uuid>,
    pub lineage_through: Vec<i64>,
    /// Set when the session was deleted while forks inherit its prefix: the APPEND
    /// sequence of that delete. A hidden session is not found by any route.
    pub hidden_seq: Option<i64>,
    /// String pairs a client keeps with the session (at most [`crate::bus::MAX_METADATA_PAIRS`]).
    pub metadata: serde_json::Value,
}

impl SessionRow {
    /// A new session's row (a fork's lineage and fork point set by the caller).
    pub fn new(id: SessionId, owner: Owner, title: Option<String>, now: DateTime<Utc>) -> Self {
        Self {
            id,
            owner,
            title,
            archived: false,
            last_category: None,
            last_seq: 0,
            compacted_through: None,
            compaction_seq: None,
            created_at: now,
            updated_at: now,
            active_at: now,
            forked_from: None,
            forked_through: None,
            lineage: Vec::new(),
            lineage_through: Vec::new(),
            hidden_seq: None,
            metadata: serde_json::Value::Object(Default::default()),
        }
    }

    /// The ancestor segments of the session's branch log, root first.
    pub fn lineage(&self) -> Vec<Segment> {
        self.lineage
            .iter()
            .zip(&self.lineage_through)
            .map(|(id, through)| Segment { session: SessionId(*id), through: *through })
            .collect()
    }

    pub fn set_lineage(&mut self, lineage: &[Segment]) {
        self.lineage = lineage.iter().map(|s| s.session.0).collect();
        self.lineage_through = lineage.iter().map(|s| s.through).collect();
    }

    /// Where this fork branched off, or None for a session that is not a fork.
    pub fn fork_point(&self) -> Option<ForkPoint> {
        Some(ForkPoint { session_id: SessionId(self.forked_from?), through_seq: self.forked_through? })
    }

    /// The first seq of the session's own events (1 unless it is a fork).
    pub fn first_own_seq(&self) -> i64 {
        self.lineage_through.last().map_or(1, |t| t + 1)
    }
}

/// [`SessionRow`]'s columns, in a `SELECT` of `sessions`.
macro_rules! session_columns {
    () => {
        "id, owner, title, archived, last_category, last_seq, compacted_through, compaction_seq, created_at, \
         updated_at, active_at, forked_from, forked_through, lineage, lineage_through, hidden_seq, metadata"
    };
}
pub const SESSION_COLUMNS: &str = session_columns!();

/// An event row as stored: kind and payload raw (the `/events` page), decodable.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct StoredEvent {
    /// The session the event belongs to: on a fork's branch log, an ancestor for the
    /// inherited events (DESIGN §10).
    pub session_id: Uuid,
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

/// A statement over a session's *branch log* (DESIGN §10): `WITH branch(sid, upto)` lists
/// its segments — each ancestor of its lineage with the last seq read from it, then the
/// session itself — for session `$1`; with an owner in `$2`, only when the session is that
/// owner's and not hidden (none otherwise), with `$2` NULL, any session's (the workers'
/// reads of a committed turn). Events are joined per segment
/// (`e.session_id = b.sid AND e.seq <= b.upto`), each segment a range of the primary key,
/// so no read loads an ancestor whole; seqs are disjoint across segments.
macro_rules! branch_sql {
    ($($rest:expr),+ $(,)?) => {
        concat!(
            "WITH branch AS (
                 SELECT b.sid, b.upto FROM sessions s,
                        unnest(s.lineage || s.id, s.lineage_through || 9223372036854775807::int8) AS b(sid, upto)
                  WHERE s.id = $1 AND ($2::text IS NULL OR (s.owner = $2 AND s.hidden_seq IS NULL))
             ) ",
            $($rest),+
        )
    };
}

/// [`StoredEvent`]'s columns, from `session_events e`.
macro_rules! event_columns {
    () => {
        "e.session_id, e.seq, e.event_id, e.kind, e.payload, e.tokens, e.created_at"
    };
}

/// The owner's session `id`; None when it does not exist, is another owner's or hidden.
pub async fn get_session(
    pool: &PgPool,
    owner: &str,
    id: SessionId,
) -> Result<Option<SessionRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1 AND owner = $2 AND hidden_seq IS NULL"
    ))
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
    // The compaction itself comes after the boundary it replaces (the writer checks it),
    // so one range per segment holds the whole tail.
    let rows: Vec<StoredEvent> = sqlx::query_as(branch_sql!(
        "SELECT ",
        event_columns!(),
        " FROM branch b JOIN session_events e ON e.session_id = b.sid AND e.seq <= b.upto AND e.seq > $3
          ORDER BY e.seq"
    ))
    .bind(id.0)
    .bind(owner)
    .bind(state.compacted_through.unwrap_or(0))
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
/// `before` in each segment of the branch log and never reading the rest of it; every
/// lookup below is over the branch log too. Visibility is `ui_transcript`'s rule,
/// asked of the events after each candidate through indexed lookups
/// (`session_events_attempt`, `session_events_permission`, the primary key):
/// - a permission request is hidden once any event resolves it;
/// - a checkpoint with an attempt id is hidden when a later checkpoint or any answer of
///   that attempt exists;
/// - a checkpoint without one belongs to the run of events up to the next turn boundary
///   (user message, failure, answer, or a final checkpoint without an id, which closes
///   its own run): it is hidden when the next such event is an answer or another
///   checkpoint without an id, and a final one is always shown.
const TRANSCRIPT_PAGE: &str = branch_sql!(
    "SELECT x.* FROM branch b, LATERAL (
     SELECT ",
    event_columns!(),
    " FROM session_events e
  WHERE e.session_id = b.sid AND e.seq <= b.upto AND e.seq < $3
    AND (e.kind IN ('user_message', 'assistant_turn', 'tool_execution', 'compaction_applied', 'turn_failed')
         OR (e.kind = 'permission_request'
             AND NOT EXISTS (SELECT 1 FROM branch rb JOIN session_events r ON r.session_id = rb.sid AND r.seq <= rb.upto
                              WHERE r.kind = 'permission_resolved'
                                AND r.payload ->> 'id' = e.payload ->> 'id'))
         OR (e.kind = 'pending_state' AND e.payload ->> 'attempt_id' IS NOT NULL
             AND NOT EXISTS (SELECT 1 FROM branch ab JOIN session_events a ON a.session_id = ab.sid AND a.seq <= ab.upto
                              WHERE a.kind IN ('pending_state', 'assistant_turn')
                                AND a.payload ->> 'attempt_id' = e.payload ->> 'attempt_id'
                                AND (a.kind = 'assistant_turn' OR a.seq > e.seq)))
         OR (e.kind = 'pending_state' AND e.payload ->> 'attempt_id' IS NULL
             AND (e.payload ->> 'reason' IS NOT NULL
                  OR coalesce((SELECT n.kind FROM branch nb JOIN session_events n ON n.session_id = nb.sid AND n.seq <= nb.upto
                                WHERE n.seq > e.seq
                                  AND (n.kind IN ('user_message', 'turn_failed', 'assistant_turn')
                                       OR (n.kind = 'pending_state' AND n.payload ->> 'attempt_id' IS NULL))
                                ORDER BY n.seq LIMIT 1), 'user_message')
                     IN ('user_message', 'turn_failed'))))
  ORDER BY e.seq DESC
  LIMIT $4) x
  ORDER BY x.seq DESC
  LIMIT $4"
);

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
    let row: Option<(Option<i64>, Option<i64>, Option<String>)> = sqlx::query_as(branch_sql!(
        "SELECT (SELECT q.seq FROM branch qb JOIN session_events q ON q.session_id = qb.sid AND q.seq <= qb.upto
                  WHERE q.kind = 'permission_request' AND q.payload ->> 'id' = $3
                  ORDER BY q.seq LIMIT 1),
                r.seq, r.payload ->> 'decision'
           FROM (SELECT 1) one
           LEFT JOIN LATERAL (SELECT e.seq, e.payload
                                FROM branch rb JOIN session_events e ON e.session_id = rb.sid AND e.seq <= rb.upto
                               WHERE e.kind = 'permission_resolved' AND e.payload ->> 'id' = $3
                               ORDER BY e.seq LIMIT 1) r ON true
          WHERE EXISTS (SELECT 1 FROM branch)"
    ))
    .bind(id.0)
    .bind(owner)
    .bind(perm_id)
    .fetch_optional(pool)
    .await?;
    Ok(row
        .map(|(request_seq, seq, decision)| PermissionStatus { request_seq, resolution: seq.zip(decision) }))
}

/// The composite paging cursor: the `(active_at, id)` of the last row of a page.
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
const LIST_SESSIONS: &str = concat!(
    "SELECT ",
    session_columns!(),
    " FROM sessions
  WHERE owner = $1 AND archived = $3 AND hidden_seq IS NULL
    AND ($4::timestamptz IS NULL OR (active_at, id) < ($4, $5))
  ORDER BY active_at DESC, id DESC
  LIMIT $6"
);

/// The owner's sessions whose title or any user message matches `$2`, archived or not.
/// Each text is matched by the very expression its GIN index is built on
/// (`sessions_title_fts`, `search_entries_fts`: the search index the writer keeps off its
/// commit path), so Postgres looks the words up instead of computing a tsvector per row;
/// `$3` is unused here.
const SEARCH_SESSIONS: &str = concat!(
    "SELECT ",
    session_columns!(),
    " FROM sessions
  WHERE owner = $1 AND hidden_seq IS NULL
    AND ($4::timestamptz IS NULL OR (active_at, id) < ($4, $5))
    AND id IN (SELECT t.id FROM sessions t
                WHERE t.owner = $1
                  AND to_tsvector('simple', coalesce(t.title, '')) @@ plainto_tsquery('simple', $2)
               UNION
               SELECT e.session_id FROM search_entries e
                WHERE e.owner = $1 AND e.kind = 'user'
                  AND to_tsvector('simple', e.body) @@ plainto_tsquery('simple', $2))
  ORDER BY active_at DESC, id DESC
  LIMIT $6"
);

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

/// Newest first by `(active_at, id)`; returns the page and the cursor of the next one.
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
        .then(|| rows.last().map(|s| Cursor { before: s.active_at, before_id: s.id.0 }))
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
    let row: Option<(i64, serde_json::Value, bool)> = sqlx::query_as(branch_sql!(
        "SELECT u.seq, u.payload,
                EXISTS (SELECT 1 FROM branch ab JOIN session_events a ON a.session_id = ab.sid AND a.seq <= ab.upto
                         WHERE a.kind = 'assistant_turn' AND a.seq > u.seq)
           FROM (SELECT x.* FROM branch b, LATERAL (
                     SELECT e.seq, e.payload FROM session_events e
                      WHERE e.session_id = b.sid AND e.seq <= b.upto AND e.kind = 'user_message'
                      ORDER BY e.seq DESC LIMIT 1) x
                  ORDER BY x.seq DESC LIMIT 1) u"
    ))
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
    let rows: Vec<StoredEvent> = sqlx::query_as(branch_sql!(
        "SELECT ",
        event_columns!(),
        " FROM branch b JOIN session_events e ON e.session_id = b.sid AND e.seq <= b.upto
          WHERE e.seq <= $3
            AND e.seq >= coalesce((SELECT max(x.seq) FROM branch xb, LATERAL (
                                       SELECT u.seq FROM session_events u
                                        WHERE u.session_id = xb.sid AND u.seq <= xb.upto AND u.seq < $3
                                          AND u.kind = 'user_message'
                                        ORDER BY u.seq DESC LIMIT 1) x), $3)
          ORDER BY e.seq LIMIT $4"
    ))
    .bind(session.0)
    .bind(None::<&str>)
    .bind(turn_seq)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?)
}

/// Whether the branch log of `session` has an answer before seq `before`: a turn at
/// `before` is its first when it has none (the distiller titles a session after it).
pub async fn answered_before(pool: &PgPool, session: SessionId, before: i64) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(branch_sql!(
        "SELECT EXISTS (SELECT 1 FROM branch b JOIN session_events e ON e.session_id = b.sid AND e.seq <= b.upto
                         WHERE e.kind = 'assistant_turn' AND e.seq < $3)"
    ))
    .bind(session.0)
    .bind(None::<&str>)
    .bind(before)
    .fetch_one(pool)
    .await
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

/// A session's forks as its detail lists them: the live sessions created from it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct ForkSummary {
    pub id: Uuid,
    pub title: Option<String>,
    pub through_seq: i64,
    pub created_at: DateTime<Utc>,
}

/// The owner's live forks of session `id`, oldest first.
pub async fn forks_of(pool: &PgPool, owner: &str, id: SessionId) -> Result<Vec<ForkSummary>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, title, forked_through AS through_seq, created_at FROM sessions
          WHERE forked_from = $1 AND owner = $2 AND hidden_seq IS NULL
          ORDER BY created_at, id LIMIT 1000",
    )
    .bind(id.0)
    .bind(owner)
    .fetch_all(pool)
    .await
}

/// The owner's visible sessions of the fork tree rooted at `root` (the root itself and every
/// session whose lineage names it): the 1,000 used last, oldest first (a parent before its
/// forks).
pub async fn family(pool: &PgPool, owner: &str, root: SessionId) -> Result<Vec<SessionRow>, sqlx::Error> {
    let mut rows: Vec<SessionRow> = sqlx::query_as(&format!(
        "SELECT {SESSION_COLUMNS} FROM sessions
          WHERE owner = $2 AND hidden_seq IS NULL AND (id = $1 OR lineage && ARRAY[$1]::uuid[])
          ORDER BY active_at DESC LIMIT 1000"
    ))
    .bind(root.0)
    .bind(owner)
    .fetch_all(pool)
    .await?;
    rows.sort_by_key(|r| (r.created_at, r.id.0));
    Ok(rows)
}

/// The newest event of attempt `attempt_id` (its outcome once it ended: `assistant_turn`,
/// a final `pending_state` or `turn_failed`; before that, its latest checkpoint), in the
/// owner's visible session that ran it.
pub async fn attempt_event(
    pool: &PgPool,
    owner: &str,
    attempt_id: &str,
) -> Result<Option<StoredEvent>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT ",
        event_columns!(),
        " FROM session_events e JOIN sessions s ON s.id = e.session_id
          WHERE (e.payload ->> 'attempt_id') = $1 AND e.kind IN ('assistant_turn', 'pending_state', 'turn_failed')
            AND s.owner = $2 AND s.hidden_seq IS NULL
          ORDER BY e.seq DESC LIMIT 1"
    ))
    .bind(attempt_id)
    .bind(owner)
    .fetch_optional(pool)
    .await
}

/// The event at `seq` of the owner's session's branch log, or None (no such seq, or not
/// the owner's session).
pub async fn event_at(
    pool: &PgPool,
    owner: &str,
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
    owner: &str,
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
        " FROM branch b JOIN session_events e ON e.session_id = b.sid AND e.seq <= b.upto AND e.seq <= $3
            AND e.seq > coalesce((SELECT boundary FROM c), 0)
          ORDER BY e.seq"
    ))
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

/// The first checkpoint before `before` of attempt `attempt` in the owner's session's
/// branch log that records the attempt's request (§11), if any.
pub async fn attempt_request(
    pool: &PgPool,
    owner: &str,
    id: SessionId,
    attempt: &str,
    before: i64,
) -> Result<Option<StoredEvent>, sqlx::Error> {
    sqlx::query_as(branch_sql!(
        "SELECT ",
        event_columns!(),
        " FROM branch b JOIN session_events e ON e.session_id = b.sid AND e.seq <= b.upto AND e.seq < $4
          WHERE e.kind = 'pending_state' AND e.payload ->> 'attempt_id' = $3 AND e.payload ? 'request'
          ORDER BY e.seq LIMIT 1"
    ))
    .bind(id.0)
    .bind(owner)
    .bind(attempt)
    .bind(before)
    .fetch_optional(pool)
    .await
}

/// One hit of `GET /v1/search`: a user message, an answer or a title that matches.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SearchHit {
    pub session_id: Uuid,
    pub session_title: Option<String>,
    /// The matching event's seq; null for a title.
    pub seq: Option<i64>,
    /// `user`, `assistant` or `title`.
    pub kind: String,
    /// The matching text around the matched words, HTML-escaped, each matched word in
    /// `<mark>…</mark>`.
    pub snippet: String,
    pub created_at: DateTime<Utc>,
}

/// The owner's hits for `q` (Postgres full text, `simple` configuration), best first
/// (`ts_rank`, a title weighing double, then newest), `limit` from `offset`. User messages
/// and answers come from the search index (each hit belongs to the session whose own event
/// it is: a fork shows only its own), titles from the sessions; archived sessions are
/// included, hidden ones are not.
pub async fn search(
    pool: &PgPool,
    owner: &str,
    q: &str,
    limit: i64,
    offset: i64,
) -> Result<Vec<SearchHit>, sqlx::Error> {
    sqlx::query_as(
        "WITH q AS (SELECT plainto_tsquery('simple', $2) AS q),
         hits AS (
             SELECT e.session_id, e.seq, e.kind, e.body, e.created_at,
                    ts_rank(to_tsvector('simple', e.body), q.q) AS rank
               FROM search_entries e, q
              WHERE e.owner = $1 AND to_tsvector('simple', e.body) @@ q.q
             UNION ALL
             SELECT t.id, NULL, 'title', t.title, t.updated_at,
                    2 * ts_rank(to_tsvector('simple', coalesce(t.title, '')), q.q)
               FROM sessions t, q
              WHERE t.owner = $1 AND to_tsvector('simple', coalesce(t.title, '')) @@ q.q
         )
         SELECT h.session_id, s.title AS session_title, h.seq, h.kind,
                ts_headline('simple',
                            replace(replace(replace(h.body, '&', '&amp;'), '<', '&lt;'), '>', '&gt;'),
                            q.q,
                            'StartSel=<mark>, StopSel=</mark>, MaxWords=30, MinWords=12, MaxFragments=2, FragmentDelimiter=\" … \"')
                    AS snippet,
                h.created_at
           FROM hits h
           JOIN sessions s ON s.id = h.session_id AND s.hidden_seq IS NULL
          CROSS JOIN q
          ORDER BY h.rank DESC, h.created_at DESC, h.session_id, h.seq NULLS FIRST
          LIMIT $3 OFFSET $4",
    )
    .bind(owner)
    .bind(q)
    .bind(limit)
    .bind(offset)
    .fetch_all(pool)
    .await
}
