//! A request's outcome (DESIGN §6): the message the writer records in `request_outcomes`
//! and replies with, the reasons it refuses a request for, and the lookups that find a
//! recorded outcome again. Both the bus (`append_and_wait`) and the read side use it, so it
//! depends on neither.

use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgTypeInfo, PgValueRef};
use sqlx::{PgPool, Postgres};
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
    pub reason: Option<Refusal>,
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

/// The name of [`Refusal::SessionDeleted`].
pub const SESSION_DELETED: &str = "session_deleted";

/// Why a request was not applied: the outcome's `reason`, the `request_outcomes.reason`
/// column and the writer's dead-letter reason, each as its name (`as_str`). Every reason but
/// `expect_failed` and `session_deleted` is a dead letter's too.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The request does not decode (an append without kind or payload among them), or names
    /// an owner that is not one, or metadata over the limits.
    BadRequest,
    /// An append of a kind this writer does not know, or a `session_started`.
    UnknownKind,
    /// An append's payload does not decode as its kind (or breaks its rules); a `file_put`
    /// without a file's valid metadata.
    BadPayload,
    /// An event over `MAX_EVENT_BYTES`.
    TooLarge,
    /// A text with a NUL character, which Postgres cannot store.
    UnstorableText,
    /// The database refused the request's writes (the writer found it by splitting its batch).
    Unstorable,
    /// The request's `session_id` is not the one its subject names.
    WrongSubject,
    /// A create of a session that exists.
    SessionExists,
    /// No such live session (or fork parent).
    UnknownSession,
    /// The session (or fork parent) belongs to another owner.
    OwnerMismatch,
    /// A fork that does not hash to its parent's partition.
    WrongPartition,
    /// A fork point outside the parent's branch log.
    BadForkPoint,
    /// Forks nested deeper than `MAX_FORK_DEPTH`.
    TooDeep,
    /// A conditional append whose `expect` did not hold: rejected, not dead-lettered.
    ExpectFailed,
    /// What `append_and_wait` reports for a request applied once and then deleted with its
    /// session, when the same request id is sent again within the duplicate window.
    /// JetStream drops the copy as a duplicate, so the writer never sees it, and the first
    /// copy's outcome went with the session: without this the producer could only wait for
    /// an outcome that never comes (a 503 forever). It is an answer, not a write — the
    /// database stays a function of the APPEND stream. After the window the same request is
    /// applied anew (a create makes the session again), as a rebuild would apply it.
    SessionDeleted,
    /// A reason this build does not know (a newer writer's), kept as it came.
    Other(String),
}

impl Refusal {
    /// Every reason this build knows.
    pub const KNOWN: [Refusal; 15] = [
        Self::BadRequest,
        Self::UnknownKind,
        Self::BadPayload,
        Self::TooLarge,
        Self::UnstorableText,
        Self::Unstorable,
        Self::WrongSubject,
        Self::SessionExists,
        Self::UnknownSession,
        Self::OwnerMismatch,
        Self::WrongPartition,
        Self::BadForkPoint,
        Self::TooDeep,
        Self::ExpectFailed,
        Self::SessionDeleted,
    ];

    /// The reason's name, as stored, sent and used in dead-letter subjects and metrics.
    pub fn as_str(&self) -> &str {
        match self {
            Self::BadRequest => "bad_request",
            Self::UnknownKind => "unknown_kind",
            Self::BadPayload => "bad_payload",
            Self::TooLarge => "too_large",
            Self::UnstorableText => "unstorable_text",
            Self::Unstorable => "unstorable",
            Self::WrongSubject => "wrong_subject",
            Self::SessionExists => "session_exists",
            Self::UnknownSession => "unknown_session",
            Self::OwnerMismatch => "owner_mismatch",
            Self::WrongPartition => "wrong_partition",
            Self::BadForkPoint => "bad_fork_point",
            Self::TooDeep => "too_deep",
            Self::ExpectFailed => "expect_failed",
            Self::SessionDeleted => SESSION_DELETED,
            Self::Other(name) => name,
        }
    }

    fn known(name: &str) -> Option<Self> {
        Self::KNOWN.into_iter().find(|r| r.as_str() == name)
    }
}

impl From<&str> for Refusal {
    fn from(name: &str) -> Self {
        Self::known(name).unwrap_or_else(|| Self::Other(name.to_owned()))
    }
}

impl From<String> for Refusal {
    fn from(name: String) -> Self {
        Self::known(&name).unwrap_or(Self::Other(name))
    }
}

/// Read as its name, so that `reason.as_deref()` is the string it is on the wire.
impl std::ops::Deref for Refusal {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Refusal {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Refusal {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Self::from)
    }
}

/// `request_outcomes.reason` reads as a `Refusal` (written as its name, `as_str`).
impl sqlx::Type<Postgres> for Refusal {
    fn type_info() -> PgTypeInfo {
        <String as sqlx::Type<Postgres>>::type_info()
    }
    fn compatible(ty: &PgTypeInfo) -> bool {
        <String as sqlx::Type<Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for Refusal {
    fn decode(value: PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        <&str as sqlx::Decode<'r, Postgres>>::decode(value).map(Self::from)
    }
}

/// The outcome the writer recorded for a request, if it has applied it.
pub async fn recorded_outcome(pool: &PgPool, request_id: Uuid) -> Result<Option<Outcome>, sqlx::Error> {
    let row: Option<(String, Option<i64>, Option<Refusal>)> =
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_read_and_write_as_their_names() {
        for reason in Refusal::KNOWN {
            let json = serde_json::to_string(&reason).unwrap();
            assert_eq!(json, format!("\"{}\"", reason.as_str()));
            assert_eq!(serde_json::from_str::<Refusal>(&json).unwrap(), reason);
            assert_eq!(Refusal::from(reason.as_str()), reason);
        }
        // A newer writer's reason still decodes, and goes on as it came.
        let newer: Refusal = serde_json::from_str("\"rate_limited\"").unwrap();
        assert_eq!(newer, Refusal::Other("rate_limited".into()));
        assert_eq!(serde_json::to_string(&newer).unwrap(), "\"rate_limited\"");
        let outcome: Outcome = serde_json::from_str(
            r#"{"request_id":"00000000-0000-0000-0000-000000000000","status":"rejected","reason":"expect_failed"}"#,
        )
        .unwrap();
        assert_eq!(outcome.reason.as_deref(), Some("expect_failed"));
        assert_eq!(outcome.reason, Some(Refusal::ExpectFailed));
    }
}
