//! OpenAI's error shape and the extractors of the OpenAI-compatible routes, which refuse in
//! it (DESIGN §13): a body, a query or a path that does not decode is OpenAI's error too.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use utoipa::ToSchema;

use crate::error::ApiError;

/// OpenAI's error shape, as [`OaiError`] answers it (for the document: the body is built as
/// JSON below).
#[derive(ToSchema)]
pub struct OaiErrorBody {
    pub error: OaiErrorDetail,
}

#[derive(ToSchema)]
pub struct OaiErrorDetail {
    pub message: String,
    /// invalid_request_error, authentication_error, permission_error, not_found_error,
    /// rate_limit_error or server_error.
    #[schema(rename = "type")]
    pub kind: String,
    /// Always null.
    #[schema(required = true)]
    pub param: Option<String>,
    /// turnlog's code, as in its own error shape (`bad_request`, `not_found`, ...); a
    /// gateway's error passed through as it came may have none.
    #[schema(required = true)]
    pub code: Option<String>,
}

/// An error on these routes: OpenAI's shape (`{"error": {message, type, param, code}}`),
/// and `x-should-retry: false` on a 409 or a 5xx — the SDKs retry those without an
/// idempotency key, which could append a message twice (DESIGN §13).
#[derive(Debug)]
pub struct OaiError(pub ApiError);

impl<E: Into<ApiError>> From<E> for OaiError {
    fn from(e: E) -> Self {
        Self(e.into())
    }
}

impl std::fmt::Display for OaiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl OaiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self(ApiError::bad_request(message))
    }
    pub fn not_found(what: &str) -> Self {
        Self(ApiError::NotFound(format!("{what} not found")))
    }
}

impl IntoResponse for OaiError {
    fn into_response(self) -> Response {
        let e = self.0;
        if let ApiError::Internal(inner) = &e {
            tracing::error!(error = format!("{inner:#}"), "request failed");
        }
        let status = e.status();
        let kind = match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        };
        let body =
            json!({"error": {"message": e.public_message(), "type": kind, "param": null, "code": e.code()}});
        let mut response = (status, Json(body)).into_response();
        if status == StatusCode::CONFLICT || status.is_server_error() {
            response.headers_mut().insert("x-should-retry", HeaderValue::from_static("false"));
        }
        response
    }
}

/// The body of a route here, at most `LIMIT` bytes: a larger one is OpenAI's error shape
/// (413), as every other refusal on these routes.
pub struct OaiBody<const LIMIT: usize = { crate::validate::MAX_BODY_BYTES }>(pub axum::body::Bytes);

impl<S: Send + Sync, const LIMIT: usize> axum::extract::FromRequest<S> for OaiBody<LIMIT> {
    type Rejection = OaiError;

    async fn from_request(req: axum::extract::Request, _: &S) -> Result<Self, OaiError> {
        Ok(Self(crate::extract::read_body(req, LIMIT).await?))
    }
}

/// Query parameters of a route here: a wrong type (`?stream=maybe`, `?limit=-1`) is a 400
/// in OpenAI's error shape.
pub struct OaiQuery<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequestParts<S> for OaiQuery<T> {
    type Rejection = OaiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, OaiError> {
        let crate::extract::ApiQuery(v) = crate::extract::ApiQuery::from_request_parts(parts, state).await?;
        Ok(Self(v))
    }
}

/// Path parameters of a route here: one that does not decode is OpenAI's error shape.
pub struct OaiPath<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> axum::extract::FromRequestParts<S>
    for OaiPath<T>
{
    type Rejection = OaiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, OaiError> {
        let crate::extract::ApiPath(v) = crate::extract::ApiPath::from_request_parts(parts, state).await?;
        Ok(Self(v))
    }
}
