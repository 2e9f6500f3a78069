//! Files (DESIGN §12): upload (multipart, sniffed, converted once), list, metadata, bytes
//! and delete. Another owner's file is 404 here; sending one is a 400 (`files::attachments`).

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::{Bytes, BytesMut};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use turnlog_core::ids::Owner;
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::files::{self as meta, FileKind, FileRow, MAX_FILE_NAME_CHARS};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiPath, ApiQuery, LimitedBody, UploadPace};
use crate::files::{not_configured, Blobs, Part, MULTIPART_OVERHEAD};
use crate::writes::submit;
use crate::{AppState, Ingress};

const DEFAULT_LIMIT: i64 = 100;
const MAX_LIMIT: i64 = 1000;

/// A file's metadata.
#[derive(Debug, Serialize, ToSchema)]
pub struct FileView {
    pub id: Uuid,
    pub name: String,
    /// Sniffed from the bytes.
    pub mime: String,
    /// `image` or `document`.
    pub kind: String,
    pub bytes: i64,
    /// Of the uploaded bytes, lowercase hex.
    pub sha256: String,
    /// An image's size as uploaded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub height: Option<i32>,
    /// A document's markdown length, in characters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub markdown_chars: Option<i64>,
    /// What the conversion could not do (a PDF without a text layer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    pub created_at: DateTime<Utc>,
    /// Set once deleted: a message that attached it still shows it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deleted_at: Option<DateTime<Utc>>,
}

impl From<FileRow> for FileView {
    fn from(f: FileRow) -> Self {
        Self {
            id: f.id,
            name: f.name,
            mime: f.mime,
            kind: f.kind,
            bytes: f.bytes,
            sha256: f.sha256,
            width: f.width,
            height: f.height,
            markdown_chars: f.markdown_chars,
            note: f.note,
            created_at: f.created_at,
            deleted_at: f.deleted_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FileList {
    /// Newest first; deleted files are not listed.
    pub files: Vec<FileView>,
    /// Pass as `before` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_before: Option<Uuid>,
}

/// `POST /v1/files`' multipart body, for the document (the handler reads the parts).
#[derive(ToSchema)]
pub struct FileUpload {
    /// The file; its name is kept (a base name, at most 255 characters).
    #[schema(value_type = String, format = Binary)]
    pub file: Vec<u8>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// 1–1000, default 100.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// A file id of the caller's (404 otherwise): list the files older than it.
    pub before: Option<Uuid>,
}

fn blobs(app: &Ingress) -> Result<&Blobs, ApiError> {
    app.files.as_ref().ok_or_else(not_configured)
}

/// Upload a file: an image (PNG, JPEG, GIF, WebP) or a document (PDF, HTML, markdown, plain
/// text), as the multipart field `file`.
#[utoipa::path(
    post, path = "/v1/files", tag = "files", security(("bearer" = [])),
    request_body(content = FileUpload, content_type = "multipart/form-data", description = "One field, `file` (TURNLOG_FILE_MAX_BYTES, default 20 MiB)"),
    responses(
        (status = 201, body = FileView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 408, description = "The body sent nothing for TURNLOG_UPLOAD_READ_TIMEOUT, or came slower than TURNLOG_UPLOAD_MIN_RATE", body = ErrorBody),
        (status = 413, description = "Over TURNLOG_FILE_MAX_BYTES, or a document whose markdown is over 512 KiB", body = ErrorBody),
        (status = 415, description = "Not a supported type (sniffed from the bytes)", body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(file_id), err(Display, level = "debug"))]
pub async fn upload(State(app): State<AppState>, caller: Caller, req: Request) -> Result<Response, ApiError> {
    // Refused before the body is read when there is nowhere to keep it.
    blobs(&app)?;
    let limit = app.config.file_max_bytes;
    let boundary = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|ct| multer::parse_boundary(ct).ok())
        .ok_or_else(|| {
            ApiError::UnsupportedMediaType(
                "send the file as multipart/form-data, in a field named `file`".into(),
            )
        })?;
    // Room for the body in the copy's upload budget first: a body is held whole until it is
    // stored, so many at once must not add up past it, nor one owner's past their share.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let room = declared.unwrap_or(usize::MAX).min(limit + MULTIPART_OVERHEAD);
    let _room = app.upload_bytes.reserve(caller.owner(), room).await?;
    let (read_timeout, min_rate) = (app.config.upload_read_timeout, app.config.upload_min_rate);
    let body = read_upload(req, limit + MULTIPART_OVERHEAD, read_timeout, min_rate).await?;
    let (name, bytes) = file_field(body, boundary, limit).await?;
    let row = crate::files::store(&app, caller.owner(), name, bytes, false).await?;
    tracing::Span::current().record("file_id", tracing::field::display(row.id));
    Ok((StatusCode::CREATED, Json(FileView::from(row))).into_response())
}

/// An upload's body, up to `limit` bytes, read at the upload pace ([`UploadPace`]): one
/// that stalls or crawls is a 408 and gives its room in the upload budget back.
async fn read_upload(
    req: Request,
    limit: usize,
    read_timeout: Duration,
    min_rate: u64,
) -> Result<Bytes, ApiError> {
    let mut chunks = LimitedBody::new(req, limit)?;
    let mut body = BytesMut::new();
    let mut pace = UploadPace::new(read_timeout, min_rate);
    while let Some(chunk) = pace.of(chunks.next()).await?? {
        pace.count(chunk.len());
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// The multipart body's `file` field: its name (cut to 255 characters) and bytes.
async fn file_field(body: Bytes, boundary: String, limit: usize) -> Result<(String, Bytes), ApiError> {
    let stream = futures::stream::once(async move { Ok::<_, std::convert::Infallible>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let bad = |e: multer::Error| ApiError::bad_request(format!("the multipart body cannot be read: {e}"));
    while let Some(field) = multipart.next_field().await.map_err(bad)? {
        if field.name() != Some("file") {
            continue;
        }
        let name: String = field
            .file_name()
            // A base name without control characters: it is shown, and sent to the model
            // beside the document's text.
            .map(|n| {
                n.rsplit(['/', '\\'])
                    .next()
                    .unwrap_or(n)
                    .chars()
                    .filter(|c| !c.is_control())
                    .collect::<String>()
            })
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| "upload".into())
            .chars()
            .take(MAX_FILE_NAME_CHARS)
            .collect();
        let bytes = field.bytes().await.map_err(bad)?;
        if bytes.len() > limit {
            return Err(ApiError::PayloadTooLarge(format!(
                "the file takes {} bytes, over the limit of {limit} (TURNLOG_FILE_MAX_BYTES)",
                bytes.len()
            )));
        }
        return Ok((name, bytes));
    }
    Err(ApiError::bad_request("the multipart body has no field named `file`"))
}

/// The caller's files, newest first.
#[utoipa::path(
    get, path = "/v1/files", tag = "files", security(("bearer" = [])), params(ListParams),
    responses(
        (status = 200, body = FileList), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, description = "`before` names no file of the caller's", body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(owner = %caller.owner()), err(Display, level = "debug"))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(p): ApiQuery<ListParams>,
) -> Result<Json<FileList>, ApiError> {
    let limit = p.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::bad_request(format!("limit is 1-{MAX_LIMIT}")));
    }
    let before = match p.before {
        Some(id) => {
            let f = owned(&app, caller.owner(), id).await?;
            Some((f.created_at, f.id))
        }
        None => None,
    };
    let mut files = meta::list_files(&app.pool, caller.owner(), before, limit + 1).await?;
    let more = files.len() as i64 > limit;
    files.truncate(limit as usize);
    let next_before = if more { files.last().map(|f| f.id) } else { None };
    Ok(Json(FileList { files: files.into_iter().map(FileView::from).collect(), next_before }))
}

/// The owner's file `id` (deleted or not); another owner's, or none, is a 404.
async fn owned(app: &Ingress, owner: &Owner, id: Uuid) -> Result<FileRow, ApiError> {
    meta::owned_file(&app.pool, owner, id).await?.ok_or_else(file_not_found)
}

fn file_not_found() -> ApiError {
    ApiError::NotFound("no such file".into())
}

/// A file's metadata (a deleted one's too, with `deleted_at`).
#[utoipa::path(
    get, path = "/v1/files/{id}", tag = "files", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "File id")),
    responses(
        (status = 200, body = FileView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(file_id = %id), err(Display, level = "debug"))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<Json<FileView>, ApiError> {
    let f = owned(&app, caller.owner(), id).await?;
    Ok(Json(f.into()))
}

/// A file's bytes, with its stored (sniffed) type. Anything but an image comes as an
/// attachment. A deleted file's bytes are served while they are kept (a stored message
/// still refers to them).
#[utoipa::path(
    get, path = "/v1/files/{id}/content", tag = "files", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "File id")),
    responses(
        (status = 200, description = "The file's bytes"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(file_id = %id), err(Display, level = "debug"))]
pub async fn content(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<Response, ApiError> {
    let owner = caller.owner();
    let f = owned(&app, owner, id).await?;
    let bytes = blobs(&app)?.get(owner, id, Part::Original).await?.ok_or_else(file_not_found)?;
    let mut response = Response::new(Body::from(bytes));
    let headers = response.headers_mut();
    let mime = HeaderValue::from_str(&f.mime).unwrap_or(HeaderValue::from_static("application/octet-stream"));
    headers.insert(header::CONTENT_TYPE, mime);
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("private, max-age=86400, immutable"));
    // Served from this origin, so scripts in an HTML upload must never run here.
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static("sandbox; default-src 'none'"));
    if f.kind != FileKind::Image.as_str() {
        let disposition = format!("attachment; filename*=UTF-8''{}", percent_encode(&f.name));
        if let Ok(v) = HeaderValue::from_str(&disposition) {
            headers.insert(header::CONTENT_DISPOSITION, v);
        }
    }
    Ok(response)
}

/// RFC 5987 encoding of a file name for `filename*`.
fn percent_encode(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'-' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Delete a file: it can no longer be sent; its bytes go once no stored message refers to
/// them (a message that attached it keeps showing it).
#[utoipa::path(
    delete, path = "/v1/files/{id}", tag = "files", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "File id")),
    responses(
        (status = 204),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(file_id = %id), err(Display, level = "debug"))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<StatusCode, ApiError> {
    let owner = caller.owner();
    let f = owned(&app, owner, id).await?;
    if f.deleted_at.is_none() {
        submit(&app, &AppendRequest::file_delete(id, owner)).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::convert::Sniffed;

    #[tokio::test]
    async fn the_file_field_is_read_and_its_name_cut_to_a_base_name() {
        let body = "--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nx\r\n--b\r\n\
                    Content-Disposition: form-data; name=\"file\"; filename=\"../../etc/no\ttes.md\"\r\n\
                    Content-Type: text/plain\r\n\r\n# hi\r\n--b--\r\n";
        let (name, bytes) = file_field(Bytes::from(body), "b".into(), 100).await.unwrap();
        assert_eq!((name.as_str(), &bytes[..]), ("notes.md", &b"# hi"[..]));
        let err = file_field(Bytes::from(body), "b".into(), 2).await.unwrap_err();
        assert!(matches!(err, ApiError::PayloadTooLarge(_)), "{err}");
        let none = file_field(Bytes::from("--b--\r\n"), "b".into(), 100).await.unwrap_err();
        assert!(matches!(none, ApiError::BadRequest(_)), "{none}");
    }

    #[test]
    fn names_are_percent_encoded_for_the_disposition() {
        assert_eq!(percent_encode("a b\"ü.pdf"), "a%20b%22%C3%BC.pdf");
    }

    #[test]
    fn sniffed_kinds() {
        assert_eq!(Sniffed::Webp.kind(), FileKind::Image);
        assert_eq!(Sniffed::Html.kind(), FileKind::Document);
    }
}
