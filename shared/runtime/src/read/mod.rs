//! The read side: owner-scoped queries every service uses (the ingress for its API, the
//! workers for a session's live tail). Another owner's session is simply not found. Here:
//! the SQL pieces the queries share and the re-exports that keep `read::x` their one path.

use turnlog_core::events::DecodeError;

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// [`SessionRow`]'s columns, in a `SELECT` of `sessions`.
macro_rules! session_columns {
    () => {
        "id, owner, title, archived, last_category, last_seq, compacted_through, compaction_seq, created_at, \
         updated_at, active_at, forked_from, forked_through, lineage, lineage_through, hidden_seq, metadata"
    };
}

/// A statement over a session's *branch log* (DESIGN §10): `WITH branch(sid, upto)` lists
/// its segments — each ancestor of its lineage with the last seq read from it, then the
/// session itself — for session `$1`; with an owner in `$2`, only when the session is that
/// owner's and not hidden (none otherwise), with `$2` NULL, any session's (the workers'
/// reads of a committed turn). Events are read per segment
/// (`e.session_id = b.sid AND e.seq <= b.upto`, [`branch_events!`] where the planner must
/// not choose otherwise), each segment a range of the primary key, so no read loads an
/// ancestor whole; seqs are disjoint across segments.
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

/// The branch's events as `e`, for each segment those that also meet `$cond` (`AND …` on
/// `e`): each segment's read as a range of its index, whatever the table's size. (A plain
/// join lets the planner scan the whole table while it is small, as a new store's is, on
/// every read; `OFFSET 0` keeps the subquery apart, so its conditions stay in its scan.)
macro_rules! branch_events {
    ($cond:expr) => {
        concat!(
            " FROM branch b, LATERAL (
                 SELECT * FROM session_events e
                  WHERE e.session_id = b.sid AND e.seq <= b.upto ",
            $cond,
            " OFFSET 0) e"
        )
    };
}

/// [`StoredEvent`]'s columns, from `session_events e`.
macro_rules! event_columns {
    () => {
        "e.session_id, e.seq, e.event_id, e.kind, e.payload, e.tokens, e.created_at"
    };
}

// The queries come after the macros they use: a `macro_rules!` is in scope only below it.
mod events;
mod listing;
mod memories;
mod search;
mod sessions;
mod transcript;
mod turns;

pub use crate::outcome::recorded_outcome;
pub use events::{
    all_events, event_at, events_page, live_counts, live_counts_after, live_tail, live_tail_after,
    tail_through, LiveTail, StoredEvent,
};
pub use listing::{explain_list_sessions, list_sessions, Cursor, ListQuery};
pub use memories::{recall_memories, recall_relevant, CommonWords, Memory};
pub use search::{search, SearchHit};
pub use sessions::{family, forks_of, get_session, latest_active, ForkSummary, SessionRow, SESSION_COLUMNS};
pub use transcript::{transcript_page, TranscriptPage};
pub use turns::{
    always_allowed, answered_before, attempt_event, attempt_request, current_turn, last_user_message,
    message_events, permission_status, turn_events, PermissionStatus,
};
