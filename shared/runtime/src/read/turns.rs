//! A turn's events: the last user message a retry runs again, the events a committed turn
//! closes, an attempt's outcome and recorded request, and where a permission request stands.

use sqlx::PgPool;

use turnlog_core::events::{Event, EventKind};
use turnlog_core::ids::{AttemptId, Owner, SessionId};

use super::{get_session, ReadError, StoredEvent};

/// Where a permission request stands, found by its id alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermissionStatus {
    /// Seq of the first `permission_request` with this id; None when there is none.
    pub request_seq: Option<i64>,
    /// Seq and decision of the first `permission_resolved` for it: the one that decided.
    pub resolution: Option<(i64, String)>,
    /// The call the request is for.
    pub call_id: Option<String>,
}

/// Permission request `perm_id` of the session, or None when the session is not the owner's.
pub async fn permission_status(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    perm_id: &str,
) -> Result<Option<PermissionStatus>, sqlx::Error> {
    /// The request's seq and call, and its first resolution's seq and decision.
    type Row = (Option<i64>, Option<String>, Option<i64>, Option<String>);
    let row: Option<Row> = sqlx::query_as(branch_sql!(
        "SELECT q.seq, q.payload ->> 'call_id', r.seq, r.payload ->> 'decision'
           FROM (SELECT 1) one
           LEFT JOIN LATERAL (SELECT e.seq, e.payload
                                FROM branch qb JOIN session_events e ON e.session_id = qb.sid AND e.seq <= qb.upto
                               WHERE e.kind = 'permission_request' AND e.payload ->> 'id' = $3
                               ORDER BY e.seq LIMIT 1) q ON true
           LEFT JOIN LATERAL (SELECT e.seq, e.payload
                                FROM branch rb JOIN session_events e ON e.session_id = rb.sid AND e.seq <= rb.upto
                               WHERE e.kind = 'permission_resolved' AND e.payload ->> 'id' = $3
                               ORDER BY e.seq LIMIT 1) r ON true
          WHERE EXISTS (SELECT 1 FROM branch)"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .bind(perm_id)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(request_seq, call_id, seq, decision)| PermissionStatus {
        request_seq,
        resolution: seq.zip(decision),
        call_id,
    }))
}

/// The tools the user allowed for the rest of the session (`allow_always`, DESIGN §14).
pub async fn always_allowed(pool: &PgPool, owner: &Owner, id: SessionId) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(branch_sql!(
        "SELECT DISTINCT q.payload ->> 'tool'
           FROM branch rb JOIN session_events r ON r.session_id = rb.sid AND r.seq <= rb.upto
           JOIN branch qb ON true
           JOIN session_events q ON q.session_id = qb.sid AND q.seq <= qb.upto
          WHERE r.kind = 'permission_resolved' AND r.payload ->> 'decision' = 'allow_always'
            AND q.kind = 'permission_request' AND q.payload ->> 'id' = r.payload ->> 'id'"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .fetch_all(pool)
    .await
}

/// The session's last user message (seq and payload) and whether an answer follows it
/// (a turn's final answer: a step that asks for tools is not one, DESIGN §14): what a retry
/// runs again.
pub async fn last_user_message(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
) -> Result<Option<(i64, turnlog_core::events::UserMessage, bool)>, ReadError> {
    let row: Option<(i64, serde_json::Value, bool)> = sqlx::query_as(branch_sql!(
        "SELECT u.seq, u.payload,
                EXISTS (SELECT 1 FROM branch ab JOIN session_events a ON a.session_id = ab.sid AND a.seq <= ab.upto
                         WHERE a.kind = 'assistant_turn' AND a.seq > u.seq
                           AND (a.payload #> '{llm,message,tool_calls}') IS NULL)
           FROM (SELECT x.* FROM branch b, LATERAL (
                     SELECT e.seq, e.payload FROM session_events e
                      WHERE e.session_id = b.sid AND e.seq <= b.upto AND e.kind = 'user_message'
                      ORDER BY e.seq DESC LIMIT 1) x
                  ORDER BY x.seq DESC LIMIT 1) u"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .fetch_optional(pool)
    .await?;
    let Some((seq, payload, answered)) = row else { return Ok(None) };
    match turnlog_core::events::EventBody::decode(EventKind::UserMessage, &payload, seq)? {
        turnlog_core::events::EventBody::UserMessage(m) => Ok(Some((seq, m, answered))),
        _ => Ok(None),
    }
}

/// The current turn's messages, steps and tool results — its user message and the
/// `assistant_turn`s, `tool_execution`s and permission requests and answers after it (at
/// most `limit`; not its checkpoints, which can be large) — or None when the session is not
/// the owner's. What a paused turn waits for is read from them
/// ([`turnlog_core::stream::waiting_calls`]).
pub async fn current_turn(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    limit: i64,
) -> Result<Option<Vec<Event>>, ReadError> {
    let rows: Vec<StoredEvent> = sqlx::query_as(branch_sql!(
        "SELECT ",
        event_columns!(),
        branch_events!(
            "AND e.kind IN ('user_message', 'assistant_turn', 'tool_execution', 'permission_request',
                            'permission_resolved')
             AND e.seq >= COALESCE((SELECT max(x.seq) FROM branch ub, LATERAL (
                     SELECT u.seq FROM session_events u
                      WHERE u.session_id = ub.sid AND u.seq <= ub.upto AND u.kind = 'user_message'
                      ORDER BY u.seq DESC LIMIT 1) x), 0)"
        ),
        " ORDER BY e.seq LIMIT $3"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .bind(limit)
    .fetch_all(pool)
    .await?;
    if rows.is_empty() && get_session(pool, owner, id).await?.is_none() {
        return Ok(None);
    }
    Ok(Some(rows.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>()?))
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
        branch_events!(
            "AND e.seq <= $3
             AND e.seq >= coalesce((SELECT max(x.seq) FROM branch xb, LATERAL (
                                        SELECT u.seq FROM session_events u
                                         WHERE u.session_id = xb.sid AND u.seq <= xb.upto AND u.seq < $3
                                           AND u.kind = 'user_message'
                                         ORDER BY u.seq DESC LIMIT 1) x), $3)"
        ),
        " ORDER BY e.seq LIMIT $4"
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
        "SELECT EXISTS (SELECT 1",
        branch_events!("AND e.kind = 'assistant_turn' AND e.seq < $3"),
        ")"
    ))
    .bind(session.0)
    .bind(None::<&str>)
    .bind(before)
    .fetch_one(pool)
    .await
}

/// The events that OpenAI items `ids` (`msg_` and a UUID) name in the owner's visible
/// sessions: user messages and answers by event id, answers and final checkpoints by
/// attempt id (the newest event of each attempt). At most one row per id found; the caller
/// matches them to its ids.
pub async fn message_events(
    pool: &PgPool,
    owner: &Owner,
    ids: &[uuid::Uuid],
) -> Result<Vec<StoredEvent>, ReadError> {
    let attempts: Vec<String> = ids.iter().map(|id| id.hyphenated().to_string()).collect();
    let rows: Vec<StoredEvent> = sqlx::query_as(concat!(
        "SELECT DISTINCT ON (key) ",
        event_columns!(),
        " FROM (SELECT e.*, CASE WHEN e.event_id = ANY($2) THEN e.event_id::text
                                ELSE e.payload ->> 'attempt_id' END AS key
                  FROM session_events e JOIN sessions s ON s.id = e.session_id
                 WHERE s.owner = $1 AND s.hidden_seq IS NULL
                   AND ((e.event_id = ANY($2) AND e.kind IN ('user_message', 'assistant_turn'))
                        OR ((e.payload ->> 'attempt_id') = ANY($3)
                            AND e.kind IN ('assistant_turn', 'pending_state', 'turn_failed')))) e
          ORDER BY key, e.seq DESC"
    ))
    .bind(owner.as_str())
    .bind(ids)
    .bind(&attempts)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// The newest event of attempt `attempt_id` (its outcome once it ended: `assistant_turn`,
/// a final `pending_state` or `turn_failed`; before that, its latest checkpoint), in the
/// owner's visible session that ran it.
pub async fn attempt_event(
    pool: &PgPool,
    owner: &Owner,
    attempt_id: &AttemptId,
) -> Result<Option<StoredEvent>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT ",
        event_columns!(),
        " FROM session_events e JOIN sessions s ON s.id = e.session_id
          WHERE (e.payload ->> 'attempt_id') = $1 AND e.kind IN ('assistant_turn', 'pending_state', 'turn_failed')
            AND s.owner = $2 AND s.hidden_seq IS NULL
          ORDER BY e.seq DESC LIMIT 1"
    ))
    .bind(attempt_id.as_str())
    .bind(owner.as_str())
    .fetch_optional(pool)
    .await
}

/// The first checkpoint before `before` of attempt `attempt` in the owner's session's
/// branch log that records the attempt's request (§11), if any.
pub async fn attempt_request(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    attempt: &AttemptId,
    before: i64,
) -> Result<Option<StoredEvent>, sqlx::Error> {
    sqlx::query_as(branch_sql!(
        "SELECT ",
        event_columns!(),
        branch_events!(
            "AND e.seq < $4 AND e.kind = 'pending_state' AND e.payload ->> 'attempt_id' = $3
             AND e.payload ? 'request'"
        ),
        " ORDER BY e.seq LIMIT 1"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .bind(attempt.as_str())
    .bind(before)
    .fetch_optional(pool)
    .await
}
