//! The ingress's one error type and its one `IntoResponse`: every failure, including what
//! axum rejects by itself (routing, methods, panics), reaches the client as
//! `{"error": {"code", "message"}}`. Details of server faults are logged, never shown.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use turnlog_runtime::bus::{AppendError, BusError};
use turnlog_runtime::read::ReadError;
use utoipa::ToSchema;

/// What a client is told to wait before retrying a 503 or a 429.
pub const RETRY_AFTER: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// A local server's request from elsewhere than this machine's own pages and tools.
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    /// A request body that stopped arriving, or arrived too slowly.
    #[error("{0}")]
    RequestTimeout(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// A cap on concurrent turns is reached; retrying after one ends is safe.
    #[error("{0}")]
    TooManyRequests(String),
    /// The bus, the writer or the database could not serve in time; retrying is safe. The
    /// text is logged, not shown.
    #[error("temporarily unavailable: {0}")]
    Unavailable(String),
    /// The model gateway failed a turn (or could not be reached); the text says how and is
    /// shown (it never holds the gateway's address or credentials).
    #[error("{0}")]
    BadGateway(String),
    /// A fault of this server; the chain is logged, not shown.
    #[error("internal error: {0:#}")]
    Internal(anyhow::Error),
}

impl ApiError {
    pub fn bad_request(msg: impl Into<String>) -> Self {
        Self::BadRequest(msg.into())
    }
    pub fn session_not_found() -> Self {
        Self::NotFound("session not found".into())
    }
    pub fn internal(e: impl Into<anyhow::Error>) -> Self {
        Self::Internal(e.into())
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::BadGateway(_) => StatusCode::BAD_GATEWAY,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::BadRequest(_) => "bad_request",
            Self::Unauthorized => "unauthorized",
            Self::Forbidden(_) => "forbidden",
            Self::NotFound(_) => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::Conflict(_) => "conflict",
            Self::PayloadTooLarge(_) => "payload_too_large",
            Self::RequestTimeout(_) => "request_timeout",
            Self::UnsupportedMediaType(_) => "unsupported_media_type",
            Self::TooManyRequests(_) => "too_many_requests",
            Self::Unavailable(_) => "unavailable",
            Self::BadGateway(_) => "upstream_error",
            Self::Internal(_) => "internal",
        }
    }

    /// What the client reads: the message for its own mistakes, a fixed text for ours.
    pub(crate) fn public_message(&self) -> String {
        match self {
            Self::Unavailable(_) => "the service cannot take this request right now; retry shortly".into(),
            Self::Internal(_) => "internal error".into(),
            other => other.to_string(),
        }
    }
}

/// The body of every error response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// bad_request, unauthorized, forbidden, not_found, method_not_allowed, conflict,
    /// payload_too_large, request_timeout, unsupported_media_type, too_many_requests,
    /// unavailable, upstream_error or internal.
    pub code: String,
    pub message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match &self {
            Self::Internal(e) => tracing::error!(error = format!("{e:#}"), "request failed"),
            Self::Unavailable(detail) => tracing::warn!(detail = %detail, "dependency unavailable"),
            _ => {}
        }
        let body =
            ErrorBody { error: ErrorDetail { code: self.code().into(), message: self.public_message() } };
        let mut response = (self.status(), Json(body)).into_response();
        let headers = response.headers_mut();
        match self {
            Self::Unavailable(_) | Self::TooManyRequests(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER.as_secs()));
            }
            Self::Unauthorized => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // The rest of the body may still be unread: the connection cannot be reused.
            Self::PayloadTooLarge(_) | Self::RequestTimeout(_) => {
                headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        response
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            // The database is down or saturated: the client may retry.
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_) => Self::Unavailable(format!("Postgres: {e}")),
            // A read ran past TURNLOG_STATEMENT_TIMEOUT (a lock or a load that will pass).
            e if turnlog_runtime::db::is_query_canceled(&e) => Self::Unavailable(format!("Postgres: {e}")),
            other => Self::Internal(anyhow::Error::new(other).context("reading Postgres")),
        }
    }
}

impl From<ReadError> for ApiError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Sql(e) => e.into(),
            // A stored event that no longer decodes is our bug, not the client's.
            ReadError::Decode(e) => Self::Internal(anyhow::Error::new(e).context("decoding the log")),
        }
    }
}

impl From<AppendError> for ApiError {
    fn from(e: AppendError) -> Self {
        Self::Unavailable(e.to_string())
    }
}

impl From<BusError> for ApiError {
    fn from(e: BusError) -> Self {
        Self::Unavailable(e.to_string())
    }
}

/// Unknown routes.
pub async fn not_found() -> ApiError {
    ApiError::NotFound("no such route".into())
}

/// Known routes with another method (axum adds the `Allow` header).
pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// A handler that panicked: the connection survives and the client gets the usual shape.
pub fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    ApiError::Internal(anyhow::anyhow!("handler panicked")).into_response()
}
