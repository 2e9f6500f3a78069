//! Resolving a tool's permission request. The resolution's event id is derived from the
//! request's seq, so concurrent or repeated resolutions collapse into one event in the
//! writer; the first one in the log decides, and a later different decision is a 409.

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use turnlog_core::bus::AppendRequest;
use turnlog_core::events::{Event, EventBody, PermissionResolved};
use turnlog_core::ids::{EventId, SessionId};
use turnlog_core::read;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::writes::submit;
use crate::{AppState, Ingress};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Allow,
    Deny,
}

impl Decision {
    fn as_str(self) -> &'static str {
        match self {
            Decision::Allow => "allow",
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
#[utoipa::path(
    post, path = "/v1/sessions/{id}/permissions/{perm_id}", tag = "sessions", security(("bearer" = [])),
    params(
        ("id" = Uuid, Path, description = "Session id"),
        ("perm_id" = String, Path, description = "`id` of the `permission_request` event"),
    ),
    request_body = ResolvePermission,
    responses(
        (status = 200, description = "Resolved (after the writer committed it)", body = PermissionResolution),
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
) -> Result<Json<PermissionResolution>, ApiError> {
    let events = log(&app, &caller, id).await?;
    let request_seq = events
        .iter()
        .find_map(|e| match &e.body {
            EventBody::PermissionRequest(p) if p.id == perm_id => Some(e.seq),
            _ => None,
        })
        .ok_or_else(|| ApiError::NotFound("permission request not found".into()))?;
    if resolution(&events, &perm_id).is_none() {
        let event = EventBody::PermissionResolved(PermissionResolved {
            id: perm_id.clone(),
            decision: body.decision.as_str().into(),
        });
        let event_id = EventId::derived(id, request_seq, "permission_resolved");
        submit(&app, &AppendRequest::append(id, caller.as_str(), event_id.0, &event)).await?;
    }
    // Whoever resolved first (this request, a retry of it, or a racing one) decided.
    let events = log(&app, &caller, id).await?;
    let (seq, decided) = resolution(&events, &perm_id)
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("resolution committed but not in the log")))?;
    if decided != body.decision.as_str() {
        return Err(ApiError::Conflict(format!("permission request already resolved: {decided}")));
    }
    Ok(Json(PermissionResolution { id: perm_id, decision: decided.to_owned(), seq }))
}

async fn log(app: &Ingress, caller: &Caller, id: SessionId) -> Result<Vec<Event>, ApiError> {
    read::all_events(&app.pool, caller.as_str(), id).await?.ok_or_else(ApiError::session_not_found)
}

/// The first resolution of permission request `perm_id`: its seq and decision.
fn resolution<'a>(events: &'a [Event], perm_id: &str) -> Option<(i64, &'a str)> {
    events.iter().find_map(|e| match &e.body {
        EventBody::PermissionResolved(r) if r.id == perm_id => Some((e.seq, r.decision.as_str())),
        _ => None,
    })
}
