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

use crate::error::ApiError;
use crate::validate::MAX_BODY_BYTES;

/// A JSON body of at most [`MAX_BODY_BYTES`]. An empty body reads as `{}` (so
/// `POST /v1/sessions` needs none); that a body is typed JSON is checked before routing
/// ([`crate::guard`]).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _: &S) -> Result<Self, ApiError> {
        let bytes = read_body(req, MAX_BODY_BYTES).await?;
        let json: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &bytes };
        // serde_json refuses invalid UTF-8 and escaped lone surrogates ("\ud800") itself.
        serde_json::from_slice(json)
            .map(ApiJson)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
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
