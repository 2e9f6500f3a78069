//! turnlog's ingress: the only HTTP face (DESIGN.md §7). It reads Postgres and never
//! writes it — every change goes to the writer as an append request through
//! `append_and_wait`. `routes/` holds the handlers only (no route module imports another);
//! what they share is the application layer beside it: `turn` (starting, running and
//! following a turn), `sessions` (the caller's sessions, forks), `openai` (the
//! OpenAI-compatible translation), `passthrough`, `sse` (every event stream), `files`,
//! `writes`. [`Ingress`] is their shared state.

pub mod auth;
pub mod config;
pub mod error;
pub mod extract;
pub mod files;
pub mod guard;
pub mod idempotency;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod passthrough;
pub mod routes;
pub mod sessions;
pub mod sse;
pub mod turn;
pub mod validate;
pub mod web;
pub mod writes;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderName, Request};
use axum::serve::ListenerExt as _;
use axum::Router;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use turnlog_runtime::bus::Bus;
use turnlog_runtime::lease::TurnLeases;
use turnlog_runtime::upstream::{gateway_host, UpstreamClient};

pub use config::{ApiTokens, IngressConfig};
pub use error::ApiError;

/// Postgres connections of one ingress: reads only, a few per concurrent request.
const POOL_SIZE: u32 = 16;
/// Uploads converted at once by one copy.
const UPLOADS_AT_ONCE: usize = 4;
/// Bytes of upload bodies one copy holds at once (more wait for room).
const UPLOAD_BYTES_AT_ONCE: usize = 160 * 1024 * 1024;
const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// How long a turn-lease lookup may take before the route answers 503.
pub(crate) const BUS_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// What every handler shares: settings, the read pool, the bus (appends, and the turn
/// routes' live subjects), the turn leases and the model gateway.
pub struct Ingress {
    pub config: IngressConfig,
    pub pool: PgPool,
    pub bus: Bus,
    pub leases: TurnLeases,
    /// None when no model gateway is configured.
    pub upstream: Option<UpstreamClient>,
    pub metrics: Arc<metrics::HttpMetrics>,
    /// The turns this copy runs.
    pub turns: turn::TurnHub,
    /// Names this copy as a turn-lease holder.
    pub instance_id: String,
    /// The hash chains of the branches Chat Completions requests met (DESIGN §13).
    pub chains: openai::branches::Chains,
    /// The blob store of uploaded files; None when TURNLOG_FILES_URL is not set.
    pub files: Option<files::Blobs>,
    /// Uploads converted at once (decoding an image or a PDF takes memory and CPU).
    pub uploads: tokio::sync::Semaphore,
    /// Bytes of upload bodies held at once, in all and per owner.
    pub upload_bytes: files::UploadBudget,
    /// The appends imports keep in flight, per partition, all imports of this copy together.
    pub imports: Arc<turnlog_runtime::import::ImportLanes>,
    /// The tools worker's part of the bus: its catalogue, the calls sent to it (DESIGN §14).
    pub tools: turnlog_runtime::tools::ToolsBus,
    /// The servers' tools, as last read from the bus.
    pub catalog: turn::server::Catalog,
    /// The words recall does not match on (most memories have them).
    pub common_words: Arc<turnlog_runtime::read::CommonWords>,
}

pub type AppState = Arc<Ingress>;

impl Ingress {
    /// Connects to Postgres and NATS and makes sure the bus topology exists (so the ingress
    /// can take requests even before a writer has started).
    pub async fn connect(config: IngressConfig) -> anyhow::Result<AppState> {
        config.check_system_prompt()?;
        let b = &config.backbone;
        let pool = b.connect_reads(POOL_SIZE).await.context("connecting to Postgres")?;
        let bus = b.connect_bus().await?;
        bus.ensure_topology(b.append_max_age).await.context("creating the bus topology")?;
        let leases = TurnLeases::open(&bus).await?;
        let tools =
            turnlog_runtime::tools::ToolsBus::open(&bus).await.context("opening the tools' buckets")?;
        let upstream = match &config.upstream {
            Some(u) => Some(UpstreamClient::new(u.clone()).context("building the model gateway client")?),
            None => None,
        };
        let files =
            config.files_url.as_deref().map(files::Blobs::open).transpose().context("TURNLOG_FILES_URL")?;
        turnlog_core::tokens::warm_up();
        let metrics = Arc::new(metrics::HttpMetrics::new()?);
        let instance_id = format!("ingress-{}", uuid::Uuid::now_v7());
        // Always room for the largest upload, twice.
        let upload_room = UPLOAD_BYTES_AT_ONCE.max(config.file_max_bytes.saturating_mul(2));
        let upload_bytes = files::UploadBudget::new(upload_room, config.file_max_bytes);
        let imports = Arc::new(turnlog_runtime::import::ImportLanes::new(bus.partitions));
        Ok(Arc::new(Self {
            config,
            pool,
            bus,
            leases,
            upstream,
            metrics,
            turns: turn::TurnHub::default(),
            instance_id,
            chains: Default::default(),
            files,
            uploads: tokio::sync::Semaphore::new(UPLOADS_AT_ONCE),
            upload_bytes,
            imports,
            tools,
            catalog: Default::default(),
            common_words: Default::default(),
        }))
    }

    /// Who served a turn, as stored with it: the gateway's host, never its credentials.
    pub fn provider_name(&self) -> String {
        self.upstream.as_ref().map_or_else(|| "none".into(), |u| gateway_host(u.config().base_url.expose()))
    }

    /// The model's context window: `TURNLOG_MODEL_WINDOWS` first, then the gateway's
    /// `/models` listing; None when neither knows it.
    pub async fn context_window(&self, model: &str) -> Option<u32> {
        if let Some(w) = self.config.model_windows.get(model) {
            return Some(*w);
        }
        match &self.upstream {
            Some(u) => u.context_window(model).await,
            None => None,
        }
    }
}

/// The whole HTTP surface over `state`, with its error shape on unknown routes and wrong
/// methods, the checks every request passes (JSON bodies; local mode's Host and Origin),
/// the body limit, request ids, tracing, panic recovery and metrics.
pub fn router(state: AppState) -> Router {
    let (api, _) = routes::api().split_for_parts();
    let metrics = Arc::clone(&state.metrics);
    let local = guard::LocalMode(state.config.tokens.is_empty());
    // The web client at `/` and `/assets/…`; every other path keeps the JSON 404.
    api.merge(web::routes())
        .fallback(error::not_found)
        .method_not_allowed_fallback(error::method_not_allowed)
        .layer(DefaultBodyLimit::max(validate::MAX_BODY_BYTES))
        // Every route, the web client's and the fallbacks included.
        .layer(axum::middleware::from_fn_with_state(local, guard::check))
        // Inside the metrics layer, so a panic is counted as the 500 it becomes.
        .layer(CatchPanicLayer::custom(error::panic_response))
        .layer(axum::middleware::from_fn_with_state(metrics, metrics::track))
        .layer(PropagateRequestIdLayer::new(REQUEST_ID))
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request<_>| {
            // The path only: queries carry search text, headers carry tokens.
            let request_id = req.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("");
            let span =
                tracing::info_span!("http", method = %req.method(), path = %req.uri().path(), request_id);
            // A client's own trace, when it sends one, is the parent.
            let parent = req.headers().get(turnlog_runtime::trace::TRACEPARENT).and_then(|v| v.to_str().ok());
            turnlog_runtime::trace::follow(&span, parent);
            span
        }))
        .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
        .with_state(state)
}

/// Serves the ingress on `listener` until `shutdown`, then lets open requests finish for
/// up to the configured grace period.
pub async fn run(
    config: IngressConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let addr = listener.local_addr().context("reading the listen address")?;
    config.check_listen(addr)?;
    let grace = config.shutdown_grace;
    let state = Ingress::connect(config).await?;
    state.metrics.spawn_upkeep(shutdown.clone());
    if let Some(blobs) = &state.files {
        tracing::info!(location = %blobs.location, "files stored");
        let delay = state.config.file_sweep_delay;
        files::spawn_sweep(Arc::clone(&state), delay, state.config.file_sweep_every, shutdown.clone());
    }
    let auth = if state.config.tokens.is_empty() { "none (owner local)" } else { "bearer tokens" };
    tracing::info!(%addr, auth, "ingress listening");

    // On shutdown: refuse new turns and checkpoint those in flight (their streams then end),
    // stop accepting, and give open connections the grace period.
    let turns = Arc::clone(&state);
    let stopping = shutdown.clone();
    // Deltas are small writes: without TCP_NODELAY, Nagle and delayed ACKs hold each one back
    // for up to 40 ms.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let serve = axum::serve(listener, router(state)).with_graceful_shutdown(async move {
        stopping.cancelled().await;
        tracing::info!(turns = turns.turns.active(), "ingress stopping; checkpointing turns in flight");
        tokio::time::timeout(grace, turns.turns.close()).await.ok();
    });
    let deadline = async {
        shutdown.cancelled().await;
        tokio::time::sleep(grace * 2).await;
    };
    tokio::select! {
        res = serve => res.context("serving HTTP")?,
        _ = deadline => {
            tracing::warn!(grace = ?grace, "connections still open after the grace period; closing them");
        }
    }
    Ok(())
}
