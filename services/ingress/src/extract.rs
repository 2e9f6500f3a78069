//! Request extractors that turn axum's own rejections (bad JSON, bad UTF-8, lone
//! surrogates, oversized bodies, unparseable paths and queries) into the API's error
//! shape, so a client's mistake is always a 4xx with `{"error": …}`.

use std::time::Duration;

use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::header;
use axum::http::request::Parts;
use bytes::{Bytes, BytesMut};
use futures::StreamExt as _;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::error::ApiError;
use crate::validate::MAX_BODY_BYTES;

/// A JSON object body of at most [`MAX_BODY_BYTES`]. An empty body reads as `{}` (so
/// `POST /v1/sessions` needs none); that a body is typed JSON is checked before routing
/// ([`crate::guard`]).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _: &S) -> Result<Self, ApiError> {
        let bytes = read_body(req, MAX_BODY_BYTES).await?;
        let json: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &bytes };
        // serde_json refuses invalid UTF-8 and escaped lone surrogates ("\ud800") itself.
        let value = serde_json::from_slice(json)
            .map(ApiJson)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
        json_object(json)?;
        Ok(value)
    }
}

/// A JSON body must be an object: `{` first after any whitespace. Serde reads a JSON array
/// as a struct's fields in order (and a struct whose fields are all optional from `[]`), so
/// a body that parsed does not tell.
pub(crate) fn json_object(body: &[u8]) -> Result<(), ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{') {
        return Ok(());
    }
    Err(ApiError::bad_request("the request body must be a JSON object"))
}

/// Most of an oversized body read (and dropped) beyond the limit before answering 413: a server that
/// answers while the client is still sending and then closes makes the client's kernel
/// see a reset, and many clients then report that instead of the 413.
const DRAIN_MAX_BYTES: usize = 8 * 1024 * 1024;
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The body, up to `limit` bytes; a larger one is drained (within bounds) and is a 413
/// that closes the connection.
pub(crate) async fn read_body(req: Request, limit: usize) -> Result<Bytes, ApiError> {
    let mut chunks = LimitedBody::new(req, limit)?;
    let mut body = BytesMut::new();
    while let Some(chunk) = chunks.next().await? {
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// A body read chunk by chunk, up to `limit` bytes in all; a larger one is drained (within
/// bounds) and is a 413 that closes the connection.
pub(crate) struct LimitedBody {
    chunks: axum::body::BodyDataStream,
    read: usize,
    limit: usize,
    drain_max: usize,
}

impl LimitedBody {
    pub(crate) fn new(req: Request, limit: usize) -> Result<Self, ApiError> {
        Self::draining(req, limit, DRAIN_MAX_BYTES)
    }

    /// Like [`LimitedBody::new`], draining up to `drain_max` bytes past the limit (a
    /// declared length past that is refused before anything is read).
    pub(crate) fn draining(req: Request, limit: usize, drain_max: usize) -> Result<Self, ApiError> {
        if declared_length(&req).is_some_and(|n| n > limit + drain_max) {
            return Err(too_large(limit));
        }
        Ok(Self { chunks: req.into_body().into_data_stream(), read: 0, limit, drain_max })
    }

    pub(crate) async fn next(&mut self) -> Result<Option<Bytes>, ApiError> {
        let Some(chunk) = self.chunks.next().await else { return Ok(None) };
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
        self.read += chunk.len();
        if self.read > self.limit {
            let drain = async {
                while let Some(Ok(c)) = self.chunks.next().await {
                    self.read += c.len();
                    if self.read > self.limit + self.drain_max {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(DRAIN_TIMEOUT, drain).await;
            return Err(too_large(self.limit));
        }
        Ok(Some(chunk))
    }

    /// Reads (and drops) the rest of a body already known to be too large, within the
    /// drain's bounds, so the client hears the 413 the caller answers instead of a reset.
    pub(crate) async fn refuse(mut self) {
        self.read = self.limit;
        while let Ok(Some(_)) = self.next().await {}
    }
}

/// The body's declared `Content-Length`, if any.
pub(crate) fn declared_length(req: &Request) -> Option<usize> {
    req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok())
}

fn too_large(limit: usize) -> ApiError {
    ApiError::PayloadTooLarge(format!("the request body is limited to {limit} bytes"))
}

/// Path parameters; one that does not parse (e.g. a malformed session id) is a 400.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| ApiPath(v))
            .map_err(|e| ApiError::bad_request(e.body_text()))
    }
}

/// Query parameters; a wrong type (e.g. `limit=abc`) is a 400.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(v)| ApiQuery(v))
            .map_err(|e| ApiError::bad_request(e.body_text()))
    }
}

/// The pace an upload's body must keep while it holds something others wait for (room in
/// the upload budget, an import turn): its next bytes within `TURNLOG_UPLOAD_READ_TIMEOUT`,
/// and, after that long to start, `TURNLOG_UPLOAD_MIN_RATE` bytes a second on average. A
/// body that stalls or crawls is a 408, and gives what it held back.
pub(crate) struct UploadPace {
    read_timeout: Duration,
    min_rate: u64,
    started: Instant,
    last: Instant,
    bytes: usize,
}

impl UploadPace {
    pub(crate) fn new(read_timeout: Duration, min_rate: u64) -> Self {
        let now = Instant::now();
        Self { read_timeout, min_rate, started: now, last: now, bytes: 0 }
    }

    /// What `next` (a read of the body) gives, if it comes in time.
    pub(crate) async fn of<T>(&mut self, next: impl std::future::Future<Output = T>) -> Result<T, ApiError> {
        let owed = Duration::from_secs_f64(self.bytes as f64 / self.min_rate.max(1) as f64);
        let (idle_due, rate_due) = (self.last + self.read_timeout, self.started + self.read_timeout + owed);
        match tokio::time::timeout_at(idle_due.min(rate_due), next).await {
            Ok(got) => {
                self.last = Instant::now();
                Ok(got)
            }
            // Which deadline passed is decided from the deadlines, not from the clock after
            // the wake-up (which a busy machine delays); nothing sent at all is a stall.
            Err(_) if idle_due <= rate_due || self.bytes == 0 => Err(ApiError::RequestTimeout(format!(
                "the upload sent nothing for {} s (TURNLOG_UPLOAD_READ_TIMEOUT): send it without pauses",
                self.read_timeout.as_secs_f64()
            ))),
            Err(_) => Err(ApiError::RequestTimeout(format!(
                "the upload came slower than {} bytes a second (TURNLOG_UPLOAD_MIN_RATE): {} bytes in {:.0} s",
                self.min_rate,
                self.bytes,
                self.started.elapsed().as_secs_f64()
            ))),
        }
    }

    /// Counts bytes of the body read.
    pub(crate) fn count(&mut self, n: usize) {
        self.bytes += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_upload_that_stalls_or_crawls_is_a_408() {
        let mut pace = UploadPace::new(Duration::from_millis(50), 1024);
        assert_eq!(pace.of(async { 1 }).await.ok(), Some(1));
        let stalled = pace.of(std::future::pending::<()>()).await;
        assert!(
            matches!(&stalled, Err(ApiError::RequestTimeout(m)) if m.contains("sent nothing")),
            "{stalled:?}"
        );
        // 10 KB is owed 10 s at 1 KiB/s: the 50 ms start and no more are given for the rest.
        let mut pace = UploadPace::new(Duration::from_millis(50), 1024);
        pace.count(10_000);
        pace.started -= Duration::from_secs(20);
        let crawled = pace.of(std::future::pending::<()>()).await;
        assert!(
            matches!(&crawled, Err(ApiError::RequestTimeout(m)) if m.contains("slower than")),
            "{crawled:?}"
        );
    }
}
