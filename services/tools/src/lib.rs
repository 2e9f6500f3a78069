//! turnlog's tools worker (`turnlog tools`, DESIGN §14): an MCP client on the official Rust
//! SDK (`rmcp`). It connects to the servers `TURNLOG_MCP_SERVERS` configures (stdio
//! processes it spawns and restarts, or streamable-HTTP endpoints), publishes their tools
//! as the catalogue the ingress offers to the model, and runs the calls the turns send it
//! on the bus — each at most once, within `TURNLOG_TOOL_TIMEOUT`, cancelled when the turn
//! stops — appending each result through the writer. Copies share the calls.

mod calls;
pub mod config;
mod metrics;
mod servers;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use turnlog_runtime::settings::Backbone;
use turnlog_runtime::tools::ToolsBus;

pub use calls::INTERRUPTED;
pub use config::ServerConfig;

/// Default `TURNLOG_TOOL_TIMEOUT`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default `TURNLOG_TOOL_OUTPUT_MAX` (bytes of a result's output).
pub const DEFAULT_OUTPUT_MAX: usize = 32 * 1024;
/// A delivered call not acknowledged (nor reported in progress) within this is delivered
/// again — to a copy that finds its claim and records it as cut off.
const ACK_WAIT: Duration = Duration::from_secs(15);
/// Deliveries of one call before JetStream gives up on it (its turn records a timeout).
const MAX_DELIVER: i64 = 5;
/// How long running calls get to finish when the worker stops.
const STOP_GRACE: Duration = Duration::from_secs(20);

/// The worker's settings.
#[derive(Debug, Clone)]
pub struct ToolsConfig {
    pub backbone: Backbone,
    /// Where the servers came from (for logs).
    pub servers_file: PathBuf,
    pub servers: Vec<ServerConfig>,
    /// Longest a call may run.
    pub timeout: Duration,
    /// Calls one copy runs at once.
    pub concurrency: usize,
    pub output_max: usize,
}

impl ToolsConfig {
    /// Reads the servers file: a bad one is an error naming its line.
    pub fn load(backbone: Backbone, servers_file: PathBuf) -> anyhow::Result<Self> {
        let servers = config::load(&servers_file, |v| std::env::var(v).ok())?;
        Ok(Self { servers_file, ..Self::with_servers(backbone, servers) })
    }

    /// The servers file's `text` (headers from this process's environment).
    pub fn parse(backbone: Backbone, text: &str) -> anyhow::Result<Self> {
        Ok(Self::with_servers(backbone, config::parse(text, |v| std::env::var(v).ok())?))
    }

    fn with_servers(backbone: Backbone, servers: Vec<ServerConfig>) -> Self {
        Self {
            backbone,
            servers_file: PathBuf::from("(inline)"),
            servers,
            timeout: DEFAULT_TIMEOUT,
            concurrency: 16,
            output_max: DEFAULT_OUTPUT_MAX,
        }
    }
}

/// What every call handler shares.
pub(crate) struct Shared {
    pool: sqlx::PgPool,
    tools: ToolsBus,
    servers: Vec<Arc<servers::Server>>,
    metrics: Arc<metrics::Metrics>,
    running: calls::Running,
    /// Names this copy in the claims.
    holder: String,
    timeout: Duration,
    output_max: usize,
}

/// Runs the worker until `shutdown`.
pub async fn run(config: ToolsConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    // HTTPS to MCP servers with the crypto the rest of turnlog uses (another copy in this
    // process may have installed it already).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let b = &config.backbone;
    let pool = b.connect_reads(4).await.context("connecting to Postgres")?;
    let bus = b.connect_bus().await?;
    bus.ensure_topology(b.append_max_age).await.context("creating the bus topology")?;
    let tools = ToolsBus::open(&bus).await.context("opening the tools' buckets")?;
    let metrics = metrics::Metrics::register();
    let registry = turnlog_runtime::telemetry::registry();
    registry.ready_while_postgres_answers("tools", pool.clone());
    registry.ready_when("tools", || true);
    tracing::info!(
        file = %config.servers_file.display(),
        servers = ?config.servers.iter().map(|s| s.label.as_str()).collect::<Vec<_>>(),
        "tools worker starting"
    );
    let servers: Vec<_> = config.servers.iter().cloned().map(servers::Server::new).collect();
    let mut supervisors = JoinSet::new();
    for s in &servers {
        supervisors.spawn(servers::supervise(
            Arc::clone(s),
            tools.clone(),
            Arc::clone(&metrics),
            shutdown.clone(),
        ));
    }
    let shared = Arc::new(Shared {
        pool,
        tools: tools.clone(),
        servers,
        metrics,
        running: calls::Running::default(),
        holder: format!("tools-{}", uuid::Uuid::now_v7()),
        timeout: config.timeout,
        output_max: config.output_max,
    });

    let mut cancels = bus
        .client
        .subscribe(format!("{}.tools.cancel.*", bus.names.prefix()))
        .await
        .context("subscribing to cancellations")?;
    let permits = Arc::new(tokio::sync::Semaphore::new(config.concurrency.max(1)));
    let mut handlers = JoinSet::new();
    'consume: while !shutdown.is_cancelled() {
        let consumer = match tools.calls_consumer(ACK_WAIT, MAX_DELIVER).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "tool calls consumer unavailable; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = shutdown.cancelled() => break,
                }
            }
        };
        let mut messages =
            match consumer.stream().max_messages_per_batch(config.concurrency.max(1)).messages().await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot pull tool calls; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
        loop {
            // A permit first, so no call waits in this copy while another copy is idle.
            let permit = loop {
                tokio::select! {
                    p = Arc::clone(&permits).acquire_owned() => break p.expect("never closed"),
                    Some(c) = cancels.next() => cancel(&shared, &c.subject),
                    _ = shutdown.cancelled() => break 'consume,
                }
            };
            let msg = loop {
                tokio::select! {
                    m = messages.next() => break m,
                    Some(c) = cancels.next() => cancel(&shared, &c.subject),
                    _ = shutdown.cancelled() => break 'consume,
                }
            };
            match msg {
                Some(Ok(msg)) => {
                    let shared = Arc::clone(&shared);
                    handlers.spawn(async move {
                        calls::handle(shared, msg).await;
                        drop(permit);
                    });
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "pulling tool calls failed; starting over");
                    break;
                }
                None => break,
            }
            while handlers.try_join_next().is_some() {}
        }
    }
    // Calls in hand get the grace to finish; cut off after it, they come back to another
    // copy, which records them as cut off.
    if !handlers.is_empty() {
        tracing::info!(running = handlers.len(), "tools worker stopping; letting calls finish");
        let _ =
            tokio::time::timeout(STOP_GRACE, async { while handlers.join_next().await.is_some() {} }).await;
    }
    handlers.abort_all();
    supervisors.abort_all();
    Ok(())
}

/// A cancellation (`<p>.tools.cancel.<event id>`) for a call this copy may be running.
fn cancel(shared: &Shared, subject: &str) {
    if let Some(id) = subject.rsplit('.').next().and_then(|s| s.parse().ok()) {
        shared.running.cancel(id);
    }
}
