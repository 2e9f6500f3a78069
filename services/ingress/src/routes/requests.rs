//! `GET /v1/sessions/{id}/requests/{seq}` (DESIGN.md §11): the exact model request of the
//! attempt whose outcome event is `seq`, rebuilt from the log by the same pure functions
//! that built it for sending, and checked against the hash recorded when it was sent.

use anyhow::Context as _;
use axum::extract::State;
use axum::Json;
use serde::Serialize;
use turnlog_core::audit::rebuild_from_log;
use turnlog_core::events::{EventBody, PendingState};
use turnlog_core::ids::SessionId;
use turnlog_core::request_body::ResolveImage;
use turnlog_runtime::read;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiPath;
use crate::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct RequestView {
    /// The chat-completions body rebuilt from the log, written as its bytes are (its keys
    /// in their order); when `verified`, it is byte for byte the body that was sent.
    #[schema(value_type = Object)]
    pub body: Box<serde_json::value::RawValue>,
    /// SHA-256 (hex) of the body bytes sent, as recorded with the attempt.
    pub body_sha256: String,
    /// Whether the rebuilt body hashes to `body_sha256`; false only if the code that builds
    /// requests has changed meaning since.
    pub verified: bool,
    /// The request's size as the budget counted it when it was sent.
    pub tokens: u32,
    pub model: String,
}

/// The model request of one attempt, rebuilt from the log. `seq` names the attempt's
/// outcome event (`assistant_turn`, `pending_state` or `turn_failed`) or its first
/// checkpoint; an attempt that failed before anything was sent recorded no request (404),
/// and one whose system prompt an imported log does not hold cannot be rebuilt (404).
#[utoipa::path(
    get, path = "/v1/sessions/{id}/requests/{seq}", tag = "requests", security(("bearer" = [])),
    params(
        ("id" = Uuid, Path, description = "Session id"),
        ("seq" = i64, Path, minimum = 1, description = "Seq of an event that records its attempt's request"),
    ),
    responses(
        (status = 200, body = RequestView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id, seq), err(Display, level = "debug"))]
pub async fn request(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath((id, seq)): ApiPath<(SessionId, i64)>,
) -> Result<Json<RequestView>, ApiError> {
    if seq < 1 {
        return Err(ApiError::bad_request(format!("seq must be a positive integer, not {seq}")));
    }
    let owner = caller.owner();
    let mut event = match read::event_at(&app.pool, owner, id, seq).await? {
        Some(stored) => stored.decode().map_err(ApiError::internal)?,
        None if read::get_session(&app.pool, owner, id).await?.is_none() => {
            return Err(ApiError::session_not_found())
        }
        None => return Err(ApiError::NotFound(format!("the session has no event {seq}"))),
    };
    // A later checkpoint of an attempt (the one the transcript shows when the attempt
    // ended without a final one) stands for the attempt's request, which its first
    // checkpoint recorded.
    if let EventBody::PendingState(PendingState { request: None, attempt_id: Some(attempt), .. }) =
        &event.body
    {
        if let Some(first) = read::attempt_request(&app.pool, owner, id, attempt, seq).await? {
            event = first.decode().map_err(ApiError::internal)?;
        }
    }
    let Some(recorded) = event.body.recorded_request() else {
        return Err(ApiError::NotFound(format!(
            "event {seq} ({}) records no request: only an attempt's outcome (assistant_turn, \
             pending_state, turn_failed) and its first checkpoint do, and not when the attempt \
             failed before sending",
            event.kind()
        )));
    };
    let events = read::tail_through(&app.pool, owner, id, recorded.through_seq)
        .await?
        .ok_or_else(ApiError::session_not_found)?;
    // Rebuilt with the images' bytes as they were sent: a file a stored message refers to
    // keeps them (DESIGN §11, §12).
    let urls = match &app.files {
        Some(blobs) if recorded.params.images => Some(crate::files::data_urls(blobs, owner, &events).await?),
        _ => None,
    };
    let resolve = urls.as_ref().map(|urls| move |id: &str, _: &str| urls.get(id).cloned());
    let images = resolve.as_ref().map(|r| r as ResolveImage<'_>);
    // The sender records the system prompt's text whenever the log would not give it back,
    // so only an imported log (an export cut or crafted) can lack it: that request cannot be
    // rebuilt, which is no fault of this server (logged, should it be one).
    let rebuilt = rebuild_from_log(&events, recorded, images).map_err(|e| {
        tracing::warn!(session_id = %id, seq, error = %e, "a recorded request cannot be rebuilt");
        ApiError::NotFound(format!("the request of event {seq} cannot be rebuilt: {e}"))
    })?;
    let body = String::from_utf8(rebuilt.bytes)
        .context("a rebuilt body is not UTF-8")
        .and_then(|text| serde_json::value::RawValue::from_string(text).context("a rebuilt body is not JSON"))
        .map_err(ApiError::internal)?;
    Ok(Json(RequestView {
        verified: rebuilt.sha256 == recorded.body_sha256,
        body,
        body_sha256: recorded.body_sha256.clone(),
        tokens: recorded.tokens,
        model: recorded.model.clone(),
    }))
}
