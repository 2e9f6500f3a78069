//! Search (DESIGN §2): the owner's user messages, answers and titles, best first, from the
//! index the writer keeps off its commit path (it trails the log by about a second).

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use turnlog_runtime::read::{self, SearchHit};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiQuery;
use crate::{validate, AppState};

const SEARCH_DEFAULT: i64 = 20;
const SEARCH_MAX: i64 = 100;
/// How deep paging goes: every page ranks every match before it.
const MAX_OFFSET: i64 = 10_000;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SearchParams {
    /// The words to find (Postgres full text, every word must match); 1–512 characters,
    /// not blank.
    #[param(
        required = true,
        min_length = 1,
        max_length = 512,
        pattern = r"^[^\u0000]*[^\u0000\t-\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000][^\u0000]*$"
    )]
    pub q: Option<String>,
    /// 1–100, default 20.
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<i64>,
    /// `next` of the previous page, as received: the offset of the next hit, 1–10000.
    #[param(value_type = Option<i64>, minimum = 1, maximum = 10000)]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SearchPage {
    /// Best first: `{session_id, session_title, seq (null for a title), kind: user |
    /// assistant | title, snippet (HTML-escaped, matched words in <mark>…</mark>),
    /// created_at}`.
    #[schema(value_type = Vec<Object>)]
    pub hits: Vec<SearchHit>,
    /// The cursor of the next page; null on the last one.
    pub next: Option<String>,
}

/// Search the caller's messages, answers and titles, archived sessions included.
#[utoipa::path(
    get, path = "/v1/search", tag = "sessions", security(("bearer" = [])), params(SearchParams),
    responses(
        (status = 200, body = SearchPage),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(owner = %caller.owner()), err(Display, level = "debug"))]
pub async fn search(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(params): ApiQuery<SearchParams>,
) -> Result<Json<SearchPage>, ApiError> {
    let q = validate::search_query(params.q)?.ok_or_else(|| ApiError::bad_request("q is required"))?;
    let limit = validate::limit(params.limit, SEARCH_DEFAULT, SEARCH_MAX)?;
    let offset = match params.cursor.as_deref() {
        None => 0,
        Some(c) => c
            .parse::<i64>()
            .ok()
            .filter(|o| (1..=MAX_OFFSET).contains(o))
            .ok_or_else(|| ApiError::bad_request("cursor is not one this server gave"))?,
    };
    // One row more than asked tells whether another page follows.
    let mut hits = read::search(&app.pool, caller.owner(), &q, limit + 1, offset).await?;
    let more = hits.len() as i64 > limit && offset + limit <= MAX_OFFSET;
    hits.truncate(limit as usize);
    Ok(Json(SearchPage { hits, next: more.then(|| (offset + limit).to_string()) }))
}
