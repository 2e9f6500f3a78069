//! Resolving a tool's permission request (DESIGN §14). The resolution's event id is derived
//! from the request's seq, so concurrent or repeated resolutions collapse into one event in
//! the writer; the first one in the log decides, and a later different decision is a 409.
//! A live turn hears the answer itself; a paused one goes on, on this response's stream.

use axum::extract::State;
use axum::response::{IntoResponse as _, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use turnlog_core::events::{EventBody, EventKind, PermissionResolved};
use turnlog_core::ids::{EventId, SessionId};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::writes::submit;
use crate::{sse, turn, AppState, Ingress};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// This call.
    Allow,
    /// This tool, for the rest of the session.
    AllowAlways,
    Deny,
}

impl Decision {
    fn as_str(self) -> &'static str {
        match self {
            Decision::Allow => "allow",
            Decision::AllowAlways => "allow_always",
            Decision::Deny => "deny",
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolvePermission {
    pub decision: Decision,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PermissionResolution {
    /// The permission request's id.
    pub id: String,
    pub decision: String,
    /// Seq of the `permission_resolved` event.
    pub seq: i64,
}

/// Resolve a pending permission request. Repeating the same decision answers the recorded
/// resolution again (200); a different decision for an already resolved request is a 409.
/// While the turn runs, the answer is JSON and the turn goes on on its own stream; a turn
/// that paused for it goes on, and the response is its event stream (from `meta`).
#[utoipa::path(
    post, path = "/v1/sessions/{id}/permissions/{perm_id}", tag = "sessions", security(("bearer" = [])),
    params(
        ("id" = Uuid, Path, description = "Session id"),
        ("perm_id" = String, Path, description = "`id` of the `permission_request` event"),
    ),
    request_body = ResolvePermission,
    responses(
        (status = 200, description = "Resolved (after the writer committed it); the continued turn's events when the turn had paused for it", content(
            (PermissionResolution = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown session or permission request", body = ErrorBody),
        (status = 409, description = "Already resolved with the other decision", body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id, perm_id = %perm_id), err(Display, level = "debug"))]
pub async fn resolve(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath((id, perm_id)): ApiPath<(SessionId, String)>,
    ApiJson(body): ApiJson<ResolvePermission>,
) -> Result<Response, ApiError> {
    let found = status(&app, &caller, id, &perm_id).await?;
    let request_seq =
        found.request_seq.ok_or_else(|| ApiError::NotFound("permission request not found".into()))?;
    if found.resolution.is_none() {
        let event = EventBody::PermissionResolved(PermissionResolved {
            id: perm_id.clone(),
            decision: body.decision.as_str().into(),
        });
        let event_id = EventId::derived(id, request_seq, EventKind::PermissionResolved.as_str());
        submit(&app, &AppendRequest::append(id, caller.owner(), event_id.0, &event)).await?;
    }
    // Whoever resolved first (this request, a retry of it, or a racing one) decided.
    let (seq, decided) = status(&app, &caller, id, &perm_id)
        .await?
        .resolution
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("resolution committed but not in the log")))?;
    if decided != body.decision.as_str() {
        return Err(ApiError::Conflict(format!("permission request already resolved: {decided}")));
    }
    if let Some(call_id) = found.call_id.as_deref() {
        if let Some(events) = turn::continue_after_permission(&app, &caller, id, call_id).await? {
            return Ok(sse::turn(&app, id, events));
        }
    }
    Ok(Json(PermissionResolution { id: perm_id, decision: decided, seq }).into_response())
}

/// The request and its first resolution, looked up by id (never the whole log).
async fn status(
    app: &Ingress,
    caller: &Caller,
    id: SessionId,
    perm_id: &str,
) -> Result<read::PermissionStatus, ApiError> {
    read::permission_status(&app.pool, caller.owner(), id, perm_id)
        .await?
        .ok_or_else(ApiError::session_not_found)
}
