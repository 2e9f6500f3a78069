//! Sessions: create, list (newest first, composite cursor), read with a page of the
//! transcript, rename or archive, delete, and the raw log page. Reads are owner-scoped
//! queries; writes go to the writer and are answered after it committed.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use chrono::{DateTime, Timelike as _, Utc};
use serde::{Deserialize, Serialize};
use turnlog_core::ids::SessionId;
use turnlog_core::stream::Required;
use turnlog_core::ui_transcript::{transcript_item, TranscriptItem};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read::{self, Cursor, ForkSummary, ListQuery, StoredEvent};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath, ApiQuery};
use crate::sessions::{owned_session, SessionView};
use crate::writes::submit;
use crate::{validate, AppState, BUS_READ_TIMEOUT};

const LIST_DEFAULT: i64 = 50;
const LIST_MAX: i64 = 200;
const EVENTS_DEFAULT: i64 = 100;
const EVENTS_MAX: i64 = 1000;
const TRANSCRIPT_DEFAULT: i64 = 200;
const TRANSCRIPT_MAX: i64 = 1000;

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// 1–512 characters, not blank; may be set later.
    #[serde(default)]
    #[schema(schema_with = crate::openapi::title)]
    pub title: Option<String>,
}

/// Create a session (an empty body is fine).
#[utoipa::path(
    post, path = "/v1/sessions", tag = "sessions", security(("bearer" = [])),
    request_body(content = ref("#/components/schemas/CreateSession"), content_type = "application/json", description = "`{}` or `{\"title\": …}`; may be empty"),
    responses(
        (status = 201, description = "Created, after the writer committed it", body = SessionView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(owner = %caller.owner(), session_id), err(Display, level = "debug"))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateSession>,
) -> Result<(StatusCode, Json<SessionView>), ApiError> {
    let title = body.title.map(validate::title).transpose()?;
    let id = SessionId::new();
    tracing::Span::current().record("session_id", tracing::field::display(id));
    submit(&app, &AppendRequest::create(id, caller.owner(), title)).await?;
    let session = read::get_session(&app.pool, caller.owner(), id)
        .await?
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("session {id} committed but not readable")))?;
    Ok((StatusCode::CREATED, Json(session.into())))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// 1–200, default 50.
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<i64>,
    /// Full-text search over titles and user messages; includes archived sessions. At
    /// most 512 characters; blank is none.
    #[param(max_length = 512, pattern = r"^[^\u0000]*$")]
    pub q: Option<String>,
    /// `true` lists archived sessions instead of active ones.
    pub archived: Option<bool>,
    /// `next.before` of the previous page, exactly as received (RFC 3339). Needs `before_id`.
    #[param(format = DateTime)]
    pub before: Option<String>,
    /// `next.before_id` of the previous page. Needs `before`.
    pub before_id: Option<Uuid>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SessionPage {
    pub sessions: Vec<SessionView>,
    /// The cursor of the next page; null on the last one.
    pub next: Option<NextCursor>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct NextCursor {
    /// RFC 3339 with microseconds; send it back as `before`.
    pub before: String,
    pub before_id: Uuid,
}

/// List sessions, most recently active first by `(active_at, id)`.
#[utoipa::path(
    get, path = "/v1/sessions", tag = "sessions", security(("bearer" = [])), params(ListParams),
    responses(
        (status = 200, body = SessionPage),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(owner = %caller.owner()), err(Display, level = "debug"))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(params): ApiQuery<ListParams>,
) -> Result<Json<SessionPage>, ApiError> {
    let query = ListQuery {
        limit: validate::limit(params.limit, LIST_DEFAULT, LIST_MAX)?,
        q: validate::search_query(params.q)?,
        archived: params.archived.unwrap_or(false),
        before: cursor(params.before.as_deref(), params.before_id)?,
    };
    let (sessions, next) = read::list_sessions(&app.pool, caller.owner(), &query).await?;
    Ok(Json(SessionPage {
        sessions: sessions.into_iter().map(SessionView::from).collect(),
        next: next.map(|c| NextCursor { before: c.before_text(), before_id: c.before_id }),
    }))
}

/// The paging cursor: both halves or neither.
fn cursor(before: Option<&str>, before_id: Option<Uuid>) -> Result<Option<Cursor>, ApiError> {
    match (before, before_id) {
        (None, None) => Ok(None),
        (Some(before), Some(before_id)) => Ok(Some(Cursor { before: parse_before(before)?, before_id })),
        _ => Err(ApiError::bad_request("before and before_id go together: give both or neither")),
    }
}

/// `before` as RFC 3339. Postgres keeps microseconds, so finer digits are cut off here
/// rather than rounded by the database (which could step past the cursor's row).
fn parse_before(before: &str) -> Result<DateTime<Utc>, ApiError> {
    let t = DateTime::parse_from_rfc3339(before.trim())
        .map_err(|e| ApiError::bad_request(format!("before is not an RFC 3339 timestamp: {e}")))?
        .with_timezone(&Utc);
    let micros = t.nanosecond() / 1_000 * 1_000;
    t.with_nanosecond(micros).ok_or_else(|| ApiError::bad_request("before is out of range"))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TranscriptParams {
    /// Items with a seq below this: `earlier.before` of the page after it. Default: the
    /// newest items.
    #[param(minimum = 1)]
    pub before: Option<i64>,
    /// 1–1000, default 200.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SessionDetail {
    pub session: SessionView,
    /// A page of the transcript: the newest items (before `before`, when given), one per
    /// visible event, in seq order (DESIGN.md §3).
    #[schema(value_type = Vec<Object>)]
    pub items: Vec<TranscriptItem>,
    /// The cursor of the older items; null when `items` starts the transcript.
    pub earlier: Option<EarlierCursor>,
    /// Whether a turn is running on the session right now.
    pub turn_active: bool,
    /// What a paused turn waits for (DESIGN §14): `[{call_id, name, arguments, kind}]`;
    /// null when no turn waits.
    #[schema(value_type = Option<Vec<Object>>)]
    pub requires_action: Option<Vec<Required>>,
    /// The session's forks (live ones), oldest first: `{id, title, through_seq, created_at}`.
    #[schema(value_type = Vec<Object>)]
    pub forks: Vec<ForkSummary>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EarlierCursor {
    /// Send it back as `before` for the page of older items.
    pub before: i64,
}

/// A session with a page of its transcript: the newest items, or those before a seq.
#[utoipa::path(
    get, path = "/v1/sessions/{id}", tag = "sessions", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"), TranscriptParams),
    responses(
        (status = 200, body = SessionDetail),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    ApiQuery(params): ApiQuery<TranscriptParams>,
) -> Result<Json<SessionDetail>, ApiError> {
    let limit = validate::limit(params.limit, TRANSCRIPT_DEFAULT, TRANSCRIPT_MAX)?;
    let before = match params.before {
        None => i64::MAX,
        Some(seq) if seq >= 1 => seq,
        Some(seq) => {
            return Err(ApiError::bad_request(format!("before must be a seq of 1 or more, not {seq}")))
        }
    };
    let session = owned_session(&app, &caller, id).await?;
    let page = read::transcript_page(&app.pool, caller.owner(), id, before, limit)
        .await?
        .ok_or_else(ApiError::session_not_found)?;
    let turn_active = tokio::time::timeout(BUS_READ_TIMEOUT, app.leases.is_held(id))
        .await
        .map_err(|_| ApiError::Unavailable("turn lease lookup timed out".into()))??;
    let forks = read::forks_of(&app.pool, caller.owner(), id).await?;
    let waiting = crate::turn::waiting(&app, &caller, id).await?;
    Ok(Json(SessionDetail {
        requires_action: (!waiting.is_empty()).then_some(waiting),
        session: session.into(),
        items: page.events.iter().filter_map(transcript_item).collect(),
        earlier: page.earlier.map(|before| EarlierCursor { before }),
        turn_active,
        forks,
    }))
}

/// `title`, `archived` or both; its schema says so ([`crate::openapi::session_patch`]).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatchSession {
    /// 1–512 characters, not blank.
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub archived: Option<bool>,
}

impl utoipa::PartialSchema for PatchSession {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        crate::openapi::session_patch().into()
    }
}

impl ToSchema for PatchSession {}

/// Rename and/or archive a session.
#[utoipa::path(
    patch, path = "/v1/sessions/{id}", tag = "sessions", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id")),
    request_body = PatchSession,
    responses(
        (status = 200, description = "The session after the writer committed the change", body = SessionView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn patch(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    ApiJson(body): ApiJson<PatchSession>,
) -> Result<Json<SessionView>, ApiError> {
    if body.title.is_none() && body.archived.is_none() {
        return Err(ApiError::bad_request("nothing to change: give title and/or archived"));
    }
    let title = body.title.map(validate::title).transpose()?;
    owned_session(&app, &caller, id).await?;
    let req = AppendRequest::update(id, caller.owner()).with_title(title).with_archived(body.archived);
    submit(&app, &req).await?;
    Ok(Json(owned_session(&app, &caller, id).await?.into()))
}

/// Delete a session: its log, its memories and its bus messages (DESIGN.md §2). What a
/// surviving fork inherits stays, hidden (DESIGN.md §10).
#[utoipa::path(
    delete, path = "/v1/sessions/{id}", tag = "sessions", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id")),
    responses(
        (status = 204, description = "Deleted, after the writer committed it"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
) -> Result<StatusCode, ApiError> {
    owned_session(&app, &caller, id).await?;
    submit(&app, &AppendRequest::delete(id, caller.owner())).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsParams {
    /// Events with a seq above this (default 0: from the start).
    #[param(minimum = 0)]
    pub after: Option<i64>,
    /// 1–1000, default 100.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EventView {
    /// The session the event belongs to: a fork's inherited events are its ancestors'.
    pub session_id: Uuid,
    pub seq: i64,
    pub kind: String,
    /// The payload as stored (DESIGN.md §2).
    #[schema(value_type = Object)]
    pub payload: serde_json::Value,
    pub created_at: DateTime<Utc>,
}

impl From<StoredEvent> for EventView {
    fn from(e: StoredEvent) -> Self {
        Self {
            session_id: e.session_id,
            seq: e.seq,
            kind: e.kind.into(),
            payload: e.payload,
            created_at: e.created_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EventPage {
    pub events: Vec<EventView>,
    /// `after` of the next page; null when this page reaches the end of the log.
    pub next_after: Option<i64>,
}

/// A page of the raw log.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/events", tag = "sessions", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"), EventsParams),
    responses(
        (status = 200, body = EventPage),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn events(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    ApiQuery(params): ApiQuery<EventsParams>,
) -> Result<Json<EventPage>, ApiError> {
    let limit = validate::limit(params.limit, EVENTS_DEFAULT, EVENTS_MAX)?;
    let after = params.after.unwrap_or(0);
    if after < 0 {
        return Err(ApiError::bad_request("after must be 0 or more"));
    }
    // One row more than asked tells whether this page is the last.
    let mut rows = read::events_page(&app.pool, caller.owner(), id, after, limit + 1)
        .await?
        .ok_or_else(ApiError::session_not_found)?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next_after = if more { rows.last().map(|e| e.seq) } else { None };
    Ok(Json(EventPage { events: rows.into_iter().map(EventView::from).collect(), next_after }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format_before(t: DateTime<Utc>) -> String {
        Cursor { before: t, before_id: Uuid::nil() }.before_text()
    }

    #[test]
    fn cursor_needs_both_halves() {
        let id = Uuid::now_v7();
        assert!(cursor(None, None).unwrap().is_none());
        assert!(matches!(cursor(Some("2024-05-01T10:00:00.123456Z"), None), Err(ApiError::BadRequest(_))));
        assert!(matches!(cursor(None, Some(id)), Err(ApiError::BadRequest(_))));
        assert!(matches!(cursor(Some("yesterday"), Some(id)), Err(ApiError::BadRequest(_))));
    }

    #[test]
    fn before_round_trips_and_drops_sub_microseconds() {
        let t = parse_before("2024-05-01T10:00:00.123456Z").unwrap();
        assert_eq!(format_before(t), "2024-05-01T10:00:00.123456Z");
        let t = parse_before("2024-05-01T12:00:00.123456789+02:00").unwrap();
        assert_eq!(format_before(t), "2024-05-01T10:00:00.123456Z");
    }
}
