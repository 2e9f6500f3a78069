//! `POST /v1/sessions/{id}/fork` (DESIGN §10): branch a session at any seq of its log
//! without copying it; the fork itself is [`crate::sessions`]'.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::Deserialize;
use turnlog_core::ids::SessionId;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::idempotency::{idempotency_key, IdempotencyHeader};
use crate::sessions::{create_fork, fork_request, owned_session, SessionView};
use crate::AppState;

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// The last seq of the parent's log the fork inherits (default: its last). Not past
    /// the user message of a turn still running.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub through_seq: Option<i64>,
}

/// Fork a session: a new session whose log is this one's through `through_seq`, then its own.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/fork", tag = "sessions", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"), IdempotencyHeader),
    request_body(content = ref("#/components/schemas/ForkRequest"), content_type = "application/json", description = "`{}` or `{\"through_seq\": …}`; may be empty"),
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
