//! Sessions as the handlers use them: the caller's session (another owner's is 404, as
//! DESIGN §7 says), a session as the native API shows it, and forks (§10) — a fork's
//! `create` after the checks the ingress can make, its id on the parent's partition, and
//! the fork read back once committed. Edits, regenerates, Responses'
//! `previous_response_id` and Chat Completions' branches are forks followed by a turn.

use chrono::{DateTime, Utc};
use serde::Serialize;
use turnlog_core::events::ForkPoint;
use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{partition_of, AppendRequest};
use turnlog_runtime::read::{self, SessionRow};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::idempotency::derived;
use crate::writes::submit;
use crate::{Ingress, BUS_READ_TIMEOUT};

/// A session as clients see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct SessionView {
    pub id: Uuid,
    pub title: Option<String>,
    pub archived: bool,
    /// Category of the newest user message that named one.
    pub last_category: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// When the session was last active, what the list is ordered by: the time of its newest
    /// message (its creation before one), or, for a message brought in by an import, that
    /// message's original time.
    pub active_at: DateTime<Utc>,
    /// Set on a fork: the session and seq it branched from (DESIGN §10).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub forked_from: Option<ForkPoint>,
}

impl From<SessionRow> for SessionView {
    fn from(s: SessionRow) -> Self {
        Self {
            forked_from: s.fork_point(),
            id: s.id.0,
            title: s.title,
            archived: s.archived,
            last_category: s.last_category,
            created_at: s.created_at,
            updated_at: s.updated_at,
            active_at: s.active_at,
        }
    }
}

/// The caller's session, or 404 (also when it is another owner's).
pub async fn owned_session(app: &Ingress, caller: &Caller, id: SessionId) -> Result<SessionRow, ApiError> {
    read::get_session(&app.pool, caller.owner(), id).await?.ok_or_else(ApiError::session_not_found)
}

/// The `create` of a fork of `parent` through `through`, after the checks the route can
/// make (the writer makes them again): the fork point is in the parent's log and not
/// past the user message of a turn running on it. With an Idempotency-Key, the fork's id
/// and request id derive from it (and `purpose`), so a resend names the same fork.
pub async fn fork_request(
    app: &Ingress,
    caller: &Caller,
    parent: &SessionRow,
    through: i64,
    key: Option<&str>,
    purpose: &str,
) -> Result<AppendRequest, ApiError> {
    if through < 1 || through > parent.last_seq {
        return Err(ApiError::bad_request(format!(
            "through_seq must be a seq of the session's log, 1 to {}, not {through}",
            parent.last_seq
        )));
    }
    let running = tokio::time::timeout(BUS_READ_TIMEOUT, app.leases.is_held(parent.id))
        .await
        .map_err(|_| ApiError::Unavailable("turn lease lookup timed out".into()))??;
    if running {
        let owner = caller.owner();
        if let Some((user_seq, _, false)) = read::last_user_message(&app.pool, owner, parent.id).await? {
            if through > user_seq {
                return Err(ApiError::Conflict(format!(
                    "a turn is running: fork through its user message (seq {user_seq}) or earlier"
                )));
            }
        }
    }
    let owner = caller.owner();
    let id = fork_id(app, owner, parent.id, key.map(|k| (purpose, k)));
    let from = ForkPoint { session_id: parent.id, through_seq: through };
    let mut create = AppendRequest::fork(id, owner, parent.title.clone(), from);
    if let Some(k) = key {
        create.request_id = derived(owner, &format!("{purpose} create {}", parent.id), k);
    }
    Ok(create)
}

/// Submits a fork's `create` and reads the fork back (a resend of the same create, same
/// key, is answered as a duplicate and reads the same fork).
pub async fn create_fork(
    app: &Ingress,
    caller: &Caller,
    create: &AppendRequest,
) -> Result<SessionRow, ApiError> {
    submit(app, create).await?;
    let id = create.session_id;
    read::get_session(&app.pool, caller.owner(), id)
        .await?
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("fork {id} committed but not readable")))
}

/// A fork's id: one that hashes to its parent's partition, so the writer that applies the
/// parent applies the fork (DESIGN §10). Drawn at random, or derived from an idempotency
/// key with a counter; with P partitions about P draws.
fn fork_id(app: &Ingress, owner: &Owner, parent: SessionId, key: Option<(&str, &str)>) -> SessionId {
    let partitions = app.bus.partitions;
    let target = partition_of(parent, partitions);
    (0u64..)
        .map(|n| match key {
            Some((purpose, k)) => SessionId(derived(owner, &format!("{purpose} {parent} {n}"), k)),
            None => SessionId(Uuid::now_v7()),
        })
        .find(|id| partition_of(*id, partitions) == target)
        .unwrap_or_else(SessionId::new)
}
