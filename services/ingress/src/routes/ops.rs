//! Operations routes, without auth: liveness, readiness (Postgres and NATS), Prometheus
//! metrics and the OpenAPI document.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::{openapi, AppState};

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    pub status: &'static str,
}

/// Liveness: the process serves HTTP.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// `ok` or `down`.
    pub postgres: &'static str,
    /// `ok` or `down`.
    pub nats: &'static str,
}

/// Readiness: Postgres answers `SELECT 1` and the NATS connection is up.
#[utoipa::path(
    get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, body = Readiness),
        (status = 503, description = "A dependency is down", body = Readiness),
    )
)]
pub async fn readyz(State(app): State<AppState>) -> (StatusCode, Json<Readiness>) {
    let postgres = matches!(
        tokio::time::timeout(
            turnlog_runtime::telemetry::PROBE_TIMEOUT,
            sqlx::query("SELECT 1").execute(&app.pool)
        )
        .await,
        Ok(Ok(_))
    );
    let nats = app.bus.client.connection_state() == async_nats::connection::State::Connected;
    let status = if postgres && nats { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let word = |ok: bool| if ok { "ok" } else { "down" };
    (status, Json(Readiness { postgres: word(postgres), nats: word(nats) }))
}

/// Prometheus text exposition.
#[utoipa::path(
    get, path = "/metrics", tag = "operations",
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain", body = String),
    )
)]
pub async fn metrics(State(app): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.metrics.render())
}

/// This document.
#[utoipa::path(
    get, path = "/v1/openapi.json", tag = "operations",
    responses(
        (status = 200, description = "This OpenAPI 3.1 document", content_type = "application/json",
         body = Object),
    )
)]
pub async fn openapi_json() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], openapi::document_json())
}
