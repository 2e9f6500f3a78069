//! `POST /v1/import` (issue 25): conversations from ChatGPT's data export, ShareGPT files
//! or turnlog's own export become the caller's sessions, through the writer. Once one of the
//! process's import turns is free, the upload is streamed to a temporary file (at most
//! `TURNLOG_IMPORT_MAX_BYTES`), read once to check it whole, then imported conversation by
//! conversation (`turnlog_runtime::import`).

use axum::extract::{Request, State};
use axum::http::header;
use axum::Json;
use serde::Deserialize;
use tokio::io::AsyncWriteExt as _;
use turnlog_core::import::{FileError, Format};
use turnlog_runtime::import::{Importer, Summary};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{declared_length, ApiQuery, LimitedBody, UploadPace};
use crate::files::convert::TempFile;
use crate::AppState;

/// The types of a body that is the file itself.
const JSON_TYPES: [&str; 4] =
    ["application/json", "application/x-ndjson", "application/jsonl", "application/json-lines"];
/// Room for the multipart framing around the file.
const MULTIPART_OVERHEAD: usize = 64 * 1024;
/// The most a multipart field other than `file` (`format`) may hold.
const MAX_OTHER_FIELD_BYTES: u64 = 1024;
/// Most of an oversized upload read (and dropped) before the 413, so that a client still
/// sending hears it instead of a reset.
const DRAIN_MAX_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ImportParams {
    /// `chatgpt`, `sharegpt` or `turnlog`; told from the file when absent.
    #[param(inline, value_type = Option<ImportFormat>)]
    pub format: Option<String>,
}

/// The formats an import reads (`turnlog_core::import::Format`).
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
pub enum ImportFormat {
    Chatgpt,
    Sharegpt,
    Turnlog,
}

/// `POST /v1/import`'s multipart body, for the document (the handler reads the parts).
#[derive(ToSchema)]
pub struct ImportUpload {
    /// The export.
    #[schema(value_type = String, format = Binary)]
    pub file: Vec<u8>,
    /// As the query's `format`; told from the file when absent.
    #[schema(inline, nullable = false)]
    pub format: Option<ImportFormat>,
}

/// Import conversations: ChatGPT's `conversations.json`, ShareGPT JSON or JSON lines, or a
/// turnlog export, as the multipart field `file` (with an optional field `format`) or as
/// the body itself. Importing the same file again adds nothing; an import cut short is
/// completed by sending it again.
#[utoipa::path(
    post, path = "/v1/import", tag = "sessions", security(("bearer" = [])),
    params(ImportParams),
    request_body(content = ImportUpload, content_type = "multipart/form-data", description = "The field `file` (TURNLOG_IMPORT_MAX_BYTES, default 256 MiB) and optionally `format`; or the file as an application/json body"),
    responses(
        (status = 200, description = "What was imported, skipped and could not be"),
        (status = 400, description = "Not an export of the format, or cut short: nothing was imported", body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 408, description = "The upload stalled or crawled (TURNLOG_UPLOAD_READ_TIMEOUT, TURNLOG_UPLOAD_MIN_RATE)", body = ErrorBody),
        (status = 413, description = "Over TURNLOG_IMPORT_MAX_BYTES", body = ErrorBody),
        (status = 415, body = ErrorBody), (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(owner = %caller.as_str()), err(Display, level = "debug"))]
pub async fn import(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(params): ApiQuery<ImportParams>,
    req: Request,
) -> Result<Json<Summary>, ApiError> {
    let mut format = params.format.as_deref().map(parse_format).transpose()?;
    let limit = app.config.import_max_bytes;
    let content_type =
        req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let media = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let multipart = media == "multipart/form-data";
    if !multipart && !JSON_TYPES.contains(&media.as_str()) {
        return Err(ApiError::UnsupportedMediaType(
            "send the export as multipart/form-data (a field named `file`) or as an application/json body"
                .into(),
        ));
    }
    if multipart && declared_length(&req).is_some_and(|n| n > limit + MULTIPART_OVERHEAD) {
        if let Ok(body) = LimitedBody::draining(req, limit, DRAIN_MAX_BYTES) {
            body.refuse().await;
        }
        return Err(too_large(limit));
    }
    // Its turn first: an upload waiting for one is not read, nor spooled to disk, meanwhile
    // (the client's connection holds it).
    let slot = app.imports.file_slot().await.map_err(file_error)?;
    // The upload on disk while it is imported.
    let spool = TempFile::new("import", "json");
    let mut pace = UploadPace::new(app.config.upload_read_timeout, app.config.upload_min_rate);
    match media.as_str() {
        "multipart/form-data" => {
            let boundary = multer::parse_boundary(&content_type)
                .map_err(|e| ApiError::bad_request(format!("a malformed multipart body: {e}")))?;
            // The whole body is bounded (a chunked one declares no length), `format` to a
            // word, the file to the limit.
            let limits = multer::SizeLimit::new()
                .whole_stream((limit + MULTIPART_OVERHEAD) as u64)
                .per_field(MAX_OTHER_FIELD_BYTES)
                .for_field("file", limit as u64);
            let constraints = multer::Constraints::new().size_limit(limits);
            let stream = req.into_body().into_data_stream();
            let mut parts = multer::Multipart::with_constraints(stream, boundary, constraints);
            let multipart_error = |e: multer::Error| match e {
                multer::Error::FieldSizeExceeded { field_name, .. }
                    if field_name.as_deref() != Some("file") =>
                {
                    ApiError::bad_request(format!(
                        "multipart fields other than `file` hold at most {MAX_OTHER_FIELD_BYTES} bytes"
                    ))
                }
                multer::Error::StreamSizeExceeded { .. } | multer::Error::FieldSizeExceeded { .. } => {
                    too_large(limit)
                }
                other => ApiError::bad_request(format!("a malformed multipart body: {other}")),
            };
            let mut got_file = false;
            while let Some(mut field) = pace.of(parts.next_field()).await?.map_err(multipart_error)? {
                match field.name() {
                    Some("format") => {
                        let text = pace.of(field.text()).await?.map_err(multipart_error)?;
                        format = Some(parse_format(text.trim())?);
                    }
                    Some("file") if !got_file => {
                        got_file = true;
                        let mut out = SpoolWriter::create(&spool).await?;
                        while let Some(chunk) = pace.of(field.chunk()).await?.map_err(multipart_error)? {
                            pace.count(chunk.len());
                            out.write(&chunk).await?;
                        }
                        out.done().await?;
                    }
                    // Other fields are read past.
                    _ => while pace.of(field.chunk()).await?.map_err(multipart_error)?.is_some() {},
                }
            }
            if !got_file {
                return Err(ApiError::bad_request("send the export in a multipart field named `file`"));
            }
        }
        // One of JSON_TYPES: the file itself.
        _ => {
            let named = |e: ApiError| match e {
                ApiError::PayloadTooLarge(_) => too_large(limit),
                other => other,
            };
            let mut body = LimitedBody::draining(req, limit, DRAIN_MAX_BYTES).map_err(named)?;
            let mut out = SpoolWriter::create(&spool).await?;
            while let Some(chunk) = pace.of(body.next()).await?.map_err(named)? {
                pace.count(chunk.len());
                out.write(&chunk).await?;
            }
            out.done().await?;
        }
    }
    let importer = Importer {
        bus: app.bus.clone(),
        pool: app.pool.clone(),
        owner: caller.owner().clone(),
        lanes: app.imports.clone(),
        append_timeout: app.config.append_timeout,
    };
    // On a task of its own: a client that goes away does not stop a conversation halfway.
    let import = tokio::spawn(async move {
        let result = importer.file_in(slot, spool.path(), format, |_, _| {}).await;
        drop(spool);
        result
    });
    let summary = import
        .await
        .map_err(|e| ApiError::internal(anyhow::anyhow!("the import stopped: {e}")))?
        .map_err(file_error)?;
    tracing::info!(
        conversations = summary.conversations,
        sessions = summary.sessions,
        messages = summary.messages,
        failed = summary.failed.len(),
        "import done"
    );
    Ok(Json(summary))
}

fn parse_format(s: &str) -> Result<Format, ApiError> {
    s.parse::<Format>().map_err(|e| ApiError::bad_request(e.to_string()))
}

fn too_large(limit: usize) -> ApiError {
    ApiError::PayloadTooLarge(format!(
        "an import file is limited to {limit} bytes (TURNLOG_IMPORT_MAX_BYTES)"
    ))
}

fn file_error(e: FileError) -> ApiError {
    ApiError::bad_request(format!("nothing was imported: {e}"))
}

/// Writes the upload to its temporary file.
struct SpoolWriter(tokio::io::BufWriter<tokio::fs::File>);

impl SpoolWriter {
    async fn create(spool: &TempFile) -> Result<Self, ApiError> {
        let file = tokio::fs::File::create(spool.path()).await.map_err(spool_error)?;
        Ok(Self(tokio::io::BufWriter::with_capacity(1 << 16, file)))
    }

    async fn write(&mut self, chunk: &[u8]) -> Result<(), ApiError> {
        self.0.write_all(chunk).await.map_err(spool_error)
    }

    async fn done(mut self) -> Result<(), ApiError> {
        self.0.flush().await.map_err(spool_error)
    }
}

fn spool_error(e: std::io::Error) -> ApiError {
    ApiError::internal(anyhow::anyhow!("writing the import's temporary file: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_formats_are_the_ones_read() {
        let names = crate::openapi::enum_values::<ImportFormat>();
        assert_eq!(names.len(), 3);
        assert!(names.iter().all(|name| parse_format(name).is_ok_and(|f| f.as_str() == name)), "{names:?}");
    }
}
