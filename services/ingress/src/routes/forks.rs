//! Forks (DESIGN §10): branch a session at any seq of its log without copying it. Edits
//! and regenerates (in `turns`) are forks followed by a turn.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::Deserialize;
use turnlog_core::events::ForkPoint;
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{partition_of, AppendRequest};
use turnlog_runtime::read::{self, SessionRow};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::routes::sessions::{owned_session, SessionView};
use crate::routes::turns::{derived, idempotency_key};
use crate::writes::submit;
use crate::{AppState, Ingress, BUS_READ_TIMEOUT};

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// The last seq of the parent's log the fork inherits (default: its last). Not past
    /// the user message of a turn still running.
    #[serde(default)]
    pub through_seq: Option<i64>,
}

/// Fork a session: a new session whose log is this one's through `through_seq`, then its own.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/fork", tag = "sessions", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"),
           ("Idempotency-Key" = Option<String>, Header, description = "A resent POST with the same key answers the same fork")),
    request_body(content = ForkRequest, description = "`{}` or `{\"through_seq\": …}`; may be empty"),
    responses(
        (status = 201, description = "The fork, after the writer committed it", body = SessionView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The fork point is past the user message of a running turn", body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id, fork_id), err(Display, level = "debug"))]
pub async fn fork(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<SessionView>), ApiError> {
    let key = idempotency_key(&headers)?;
    let parent = owned_session(&app, &caller, id).await?;
    let through = body.through_seq.unwrap_or(parent.last_seq);
    let create = fork_request(&app, &caller, &parent, through, key.as_deref(), "fork").await?;
    tracing::Span::current().record("fork_id", tracing::field::display(create.session_id));
    let fork = create_fork(&app, &caller, &create).await?;
    Ok((StatusCode::CREATED, Json(fork.into())))
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
        let owner = caller.as_str();
        if let Some((user_seq, _, false)) = read::last_user_message(&app.pool, owner, parent.id).await? {
            if through > user_seq {
                return Err(ApiError::Conflict(format!(
                    "a turn is running: fork through its user message (seq {user_seq}) or earlier"
                )));
            }
        }
    }
    let owner = caller.as_str();
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
    read::get_session(&app.pool, caller.as_str(), id)
        .await?
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("fork {id} committed but not readable")))
}

/// A fork's id: one that hashes to its parent's partition, so the writer that applies the
/// parent applies the fork (DESIGN §10). Drawn at random, or derived from an idempotency
/// key with a counter; with P partitions about P draws.
fn fork_id(app: &Ingress, owner: &str, parent: SessionId, key: Option<(&str, &str)>) -> SessionId {
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
