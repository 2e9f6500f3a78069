//! Resolving a tool's permission request (DESIGN §14). The resolution's event id is derived
//! from the request's seq, so concurrent or repeated resolutions collapse into one event in
//! the writer; the first one in the log decides, and a later different decision is a 409.
//! A live turn hears the answer itself; a paused one goes on, on this response's stream.

use axum::extract::State;
use axum::response::{IntoResponse as _, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use turnlog_core::ids::SessionId;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::{sse, turn, AppState};

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
    let resolved =
        turn::server::resolve_permission(&app, &caller, id, &perm_id, body.decision.as_str()).await?;
    if let Some(call_id) = resolved.call_id.as_deref() {
        if let Some(events) = turn::continue_after_permission(&app, &caller, id, call_id, None).await? {
            return Ok(sse::turn(&app, id, events));
        }
    }
    let answer = PermissionResolution { id: perm_id, decision: resolved.decision, seq: resolved.seq };
    Ok(Json(answer).into_response())
}
