//! Long-term memories: what the memory worker extracted from all of the caller's sessions,
//! searched with Postgres full text (the same recall the turn routes use for extras).

use axum::extract::State;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use turnlog_runtime::read::{self, Memory};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiQuery;
use crate::{validate, AppState};

const DEFAULT_LIMIT: i64 = 50;
const MAX_LIMIT: i64 = 200;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MemoryParams {
    /// Full-text query, at most 512 characters; without it (or blank), the newest memories.
    #[param(max_length = 512, pattern = r"^[^\u0000]*$")]
    pub q: Option<String>,
    /// 1–200, default 50.
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MemoryView {
    pub id: Uuid,
    /// The session it was learned in.
    pub session_id: Uuid,
    /// Seq of the turn it came from.
    pub turn_seq: i64,
    pub text: String,
    pub created_at: DateTime<Utc>,
}

impl From<Memory> for MemoryView {
    fn from(m: Memory) -> Self {
        Self {
            id: m.id,
            session_id: m.session_id,
            turn_seq: m.turn_seq,
            text: m.text,
            created_at: m.created_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MemoryList {
    /// Newest first.
    pub memories: Vec<MemoryView>,
}

/// The caller's memories, across all of their sessions.
#[utoipa::path(
    get, path = "/v1/memories", tag = "memories", security(("bearer" = [])), params(MemoryParams),
    responses(
        (status = 200, body = MemoryList),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(owner = %caller.owner()), err(Display, level = "debug"))]
pub async fn recall(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(params): ApiQuery<MemoryParams>,
) -> Result<Json<MemoryList>, ApiError> {
    let limit = validate::limit(params.limit, DEFAULT_LIMIT, MAX_LIMIT)?;
    let q = validate::search_query(params.q)?;
    let memories = read::recall_memories(&app.pool, caller.owner(), q.as_deref(), limit).await?;
    Ok(Json(MemoryList { memories: memories.into_iter().map(MemoryView::from).collect() }))
}
