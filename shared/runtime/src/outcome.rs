//! A request's outcome (DESIGN §6): the message the writer records in `request_outcomes`
//! and replies with, and the lookups that find a recorded one again. Both the bus
//! (`append_and_wait`) and the read side use it, so it depends on neither.

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use turnlog_core::ids::SessionId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeStatus {
    Committed,
    Rejected,
    /// The request was applied before; `seq` and `reason` are the recorded ones.
    Duplicate,
}

impl OutcomeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeStatus::Committed => "committed",
            OutcomeStatus::Rejected => "rejected",
            OutcomeStatus::Duplicate => "duplicate",
        }
    }
}

/// What became of a request: recorded in `request_outcomes` with its effect, and sent to
/// the request's reply subject after the commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub request_id: Uuid,
    pub status: OutcomeStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Outcome {
    /// Committed now or before (a duplicate of a committed request carries its seq).
    pub fn is_applied(&self) -> bool {
        match self.status {
            OutcomeStatus::Committed => true,
            OutcomeStatus::Duplicate => self.reason.is_none(),
            OutcomeStatus::Rejected => false,
        }
    }
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

/// Whether a deleted session's messages are still being removed from the streams.
pub(crate) async fn purge_pending(pool: &PgPool, session: SessionId) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pending_purges WHERE session_id = $1)")
        .bind(session.0)
        .fetch_one(pool)
        .await
}
