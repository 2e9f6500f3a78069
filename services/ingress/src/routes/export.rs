//! `GET /v1/sessions/{id}/export`: a session in a format people use (issue 25, the export
//! half; the formats are `turnlog_runtime::export`'s).

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use turnlog_core::ids::SessionId;
use turnlog_runtime::export::{self, ExportFormat};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiPath, ApiQuery};
use crate::AppState;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportParams {
    /// `turnlog` (default), `markdown`, `openai` or `sharegpt`.
    #[param(inline, value_type = Option<ExportFormatName>)]
    pub format: Option<String>,
}

/// The formats a session is exported in (`turnlog_runtime::export::ExportFormat`).
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
pub enum ExportFormatName {
    Turnlog,
    Markdown,
    Openai,
    Sharegpt,
}

/// A session in a format people use: `turnlog` is its whole fork family as JSON lines, each
/// session a header line and its own events (lossless: `POST /v1/import` reads it back);
/// `markdown` the transcript to read; `openai` the conversation as a chat messages array;
/// `sharegpt` the ShareGPT shape.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/export", tag = "sessions", security(("bearer" = [])),
    params(("id" = uuid::Uuid, Path, description = "Session id"), ExportParams),
    responses(
        (status = 200, description = "The export, as an attachment"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn export(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    ApiQuery(params): ApiQuery<ExportParams>,
) -> Result<Response, ApiError> {
    let format: ExportFormat = params
        .format
        .as_deref()
        .unwrap_or("turnlog")
        .parse::<ExportFormat>()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let body = export::session(&app.pool, caller.owner(), id, format)
        .await?
        .ok_or_else(ApiError::session_not_found)?;
    let (content_type, extension) = format.media();
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let disposition = format!("attachment; filename=\"session-{id}.{extension}\"");
    if let Ok(v) = HeaderValue::from_str(&disposition) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_formats_are_the_ones_written() {
        let names = crate::openapi::enum_values::<ExportFormatName>();
        assert_eq!(names.len(), 4);
        assert!(names.iter().all(|name| name.parse::<ExportFormat>().is_ok()), "{names:?}");
    }
}
