//! `/context`: exactly what the next send would use — system prompt, the projected history
//! of the live tail, this turn's extras — and its size against the model's budget, summed
//! from the per-event token counts (never re-encoding the history).

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use turnlog_core::budget::{budget_for, history_tokens_with, request_size};
use turnlog_core::ids::SessionId;
use turnlog_core::llm_context::llm_messages_with;
use turnlog_core::message::ChatMessage;
use turnlog_core::request::{reserve_tokens, Extras};
use turnlog_runtime::read;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiPath;
use crate::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct ContextView {
    /// The model the next turn goes to by default.
    pub model: String,
    pub system: String,
    /// The history as the model reads it: the newest compaction's summary first, then
    /// every message after its boundary (`[{role, content}]`).
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<ChatMessage>,
    /// Per-turn material sent after the history (recalled memories, the date).
    #[schema(value_type = Object)]
    pub extras: Extras,
    /// Size of the whole request: system prompt, history, extras (o200k_base).
    pub tokens: u32,
    /// What the request may hold: 60% of the model's window, or `TURNLOG_CONTEXT_BUDGET`.
    pub budget: u32,
    /// The model's context window, when known.
    pub window: Option<u32>,
    /// The last seq the model sees only through the summary; null before any compaction.
    pub compacted_through: Option<i64>,
}

/// What the next send would use, and its size.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/context", tag = "context", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id")),
    responses(
        (status = 200, body = ContextView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn context(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
) -> Result<Json<ContextView>, ApiError> {
    let tail =
        read::live_tail(&app.pool, caller.owner(), id).await?.ok_or_else(ApiError::session_not_found)?;
    let system = app.config.system_prompt.clone();
    // Memory recall and the date join the extras with the turn routes.
    let extras = Extras::default();
    let history = app.config.tool_history;
    let tokens = request_size(history_tokens_with(&tail.counted, history), reserve_tokens(&system, &extras));
    let model = app.config.model.clone();
    let window = app.context_window(&model).await;
    Ok(Json(ContextView {
        budget: budget_for(window, app.config.context_budget),
        messages: llm_messages_with(&tail.events, history),
        compacted_through: tail.state.compacted_through,
        model,
        system,
        extras,
        tokens,
        window,
    }))
}
