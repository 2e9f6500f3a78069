//! A page of a session's transcript: the events the user sees, newest first from a seq,
//! with `ui_transcript`'s visibility rule asked of the database.

use sqlx::PgPool;

use turnlog_core::events::Event;
use turnlog_core::ids::{Owner, SessionId};

use super::{get_session, ReadError, StoredEvent};

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
    owner: &Owner,
    id: SessionId,
    before: i64,
    limit: i64,
) -> Result<Option<TranscriptPage>, ReadError> {
    let limit = limit.max(1);
    // One row more than asked tells whether older items exist.
    let mut rows: Vec<StoredEvent> = sqlx::query_as(TRANSCRIPT_PAGE)
        .bind(id.0)
        .bind(owner.as_str())
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
