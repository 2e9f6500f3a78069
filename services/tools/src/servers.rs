//! One configured MCP server, supervised: connect (spawn the process, or open the HTTP
//! session), list its tools and publish them, list again on `tools/list_changed`, and when
//! the connection ends, publish it as down and start again with back-off. Calls meanwhile
//! fail at once with a message saying so.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rmcp::model::{ClientCapabilities, Implementation, InitializeRequestParams};
use rmcp::service::{NotificationContext, Peer, RoleClient, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ClientHandler, ServiceExt as _};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use turnlog_runtime::tools::{namespaced, CatalogTool, ServerCatalog, ToolsBus};

use crate::config::{ServerConfig, Transport};
use crate::metrics::Metrics;

/// Back-off between restarts: doubling from the first, up to the last.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A connection that lived this long restarts from the shortest back-off.
const HEALTHY: Duration = Duration::from_secs(60);
/// How long connecting (and the first listing) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// A server as the calls see it: the live connection, if any.
pub(crate) struct Server {
    pub(crate) config: ServerConfig,
    peer: RwLock<Option<Peer<RoleClient>>>,
}

impl Server {
    pub(crate) fn new(config: ServerConfig) -> Arc<Self> {
        Arc::new(Self { config, peer: RwLock::new(None) })
    }

    /// The connection, when up.
    pub(crate) fn peer(&self) -> Option<Peer<RoleClient>> {
        self.peer.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn set_peer(&self, peer: Option<Peer<RoleClient>>) {
        *self.peer.write().unwrap_or_else(std::sync::PoisonError::into_inner) = peer;
    }
}

/// What the client tells the server about itself, and hears back.
#[derive(Clone)]
struct Handler {
    changed: Arc<Notify>,
}

impl ClientHandler for Handler {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.changed.notify_one();
    }

    fn get_info(&self) -> InitializeRequestParams {
        InitializeRequestParams::new(
            ClientCapabilities::default(),
            Implementation::new("turnlog", env!("CARGO_PKG_VERSION")),
        )
    }
}

async fn connect(
    config: &ServerConfig,
    handler: Handler,
) -> anyhow::Result<RunningService<RoleClient, Handler>> {
    match &config.transport {
        Transport::Stdio { command, args, env } => {
            let mut cmd = tokio::process::Command::new(command);
            cmd.args(args).envs(env).kill_on_drop(true);
            // Its stderr goes to ours (a server's own diagnostics), never into the protocol.
            let (process, _) =
                TokioChildProcess::builder(cmd).stderr(std::process::Stdio::inherit()).spawn()?;
            Ok(handler.serve(process).await?)
        }
        Transport::Http { url, headers } => {
            let mut custom = std::collections::HashMap::new();
            for (name, value) in headers {
                custom.insert(
                    http::HeaderName::try_from(name.as_str())?,
                    http::HeaderValue::try_from(value.as_str())?,
                );
            }
            let config =
                rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                    url.as_str(),
                )
                .custom_headers(custom);
            Ok(handler.serve(StreamableHttpClientTransport::from_config(config)).await?)
        }
    }
}

/// Most bytes one server's tools may take in the catalogue (each turn sends them to the
/// model, and each step records them), and most tools.
const MAX_SERVER_TOOLS_BYTES: usize = 64 * 1024;
const MAX_SERVER_TOOLS: usize = 128;

/// The server's tools, filtered and with their rules, as the catalogue holds them. Left
/// out, and said so: a tool whose namespaced name a model would refuse (over 64
/// characters, or other than letters, digits, `_` and `-`), one the log cannot store (NUL
/// in its description or schema), and those past the server's share of a request.
async fn list(config: &ServerConfig, peer: &Peer<RoleClient>) -> anyhow::Result<Vec<CatalogTool>> {
    let mut tools = Vec::new();
    let mut bytes = 0;
    for tool in peer.list_all_tools().await? {
        let name = tool.name.to_string();
        if !config.offers(&name) {
            continue;
        }
        let full = namespaced(&config.label, &name);
        if full.len() > 64 || !full.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            tracing::warn!(server = %config.label, tool = %name, "tool left out: its name cannot be offered to a model");
            continue;
        }
        let rule = config.rule(&name);
        let entry = CatalogTool {
            name,
            description: tool.description.map(|d| d.to_string()),
            input_schema: serde_json::Value::Object((*tool.input_schema).clone()),
            policy: rule.policy,
            danger_level: rule.danger_level,
        };
        let json = serde_json::to_value(&entry)?;
        if turnlog_core::storable::has_nul(&json) {
            tracing::warn!(server = %config.label, tool = %entry.name, "tool left out: its description or schema holds NUL");
            continue;
        }
        bytes += turnlog_core::limits::json_len(&json);
        if bytes > MAX_SERVER_TOOLS_BYTES || tools.len() >= MAX_SERVER_TOOLS {
            tracing::warn!(server = %config.label, tool = %entry.name, "tool left out: the server's tools are over {MAX_SERVER_TOOLS} or {MAX_SERVER_TOOLS_BYTES} bytes");
            continue;
        }
        tools.push(entry);
    }
    Ok(tools)
}

/// Keeps the server connected until `shutdown`, publishing its catalogue entry.
pub(crate) async fn supervise(
    server: Arc<Server>,
    bus: ToolsBus,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let config = &server.config;
    let label = config.label.clone();
    let mut tools: Vec<CatalogTool> = Vec::new();
    let publish = |tools: &[CatalogTool], up: bool| {
        let entry = ServerCatalog {
            label: label.clone(),
            owners: config.owners.clone(),
            tools: tools.to_vec(),
            up,
            updated_at: chrono::Utc::now(),
        };
        let bus = bus.clone();
        async move {
            if let Err(e) = bus.publish_catalog(&entry).await {
                tracing::warn!(server = %entry.label, error = %e, "tool catalogue not published");
            }
        }
    };
    let mut backoff = FIRST_BACKOFF;
    loop {
        let changed = Arc::new(Notify::new());
        let started = Instant::now();
        let connected = tokio::select! {
            c = tokio::time::timeout(CONNECT_TIMEOUT, connect(config, Handler { changed: Arc::clone(&changed) })) => c,
            _ = shutdown.cancelled() => return,
        };
        match connected {
            Ok(Ok(mut running)) => {
                let peer = running.peer().clone();
                match tokio::time::timeout(CONNECT_TIMEOUT, list(config, &peer)).await {
                    Ok(Ok(listed)) => {
                        tracing::info!(server = %label, tools = listed.len(), "MCP server connected");
                        tools = listed;
                        server.set_peer(Some(peer.clone()));
                        publish(&tools, true).await;
                        loop {
                            tokio::select! {
                                _ = changed.notified() => match list(config, &peer).await {
                                    Ok(listed) => {
                                        tracing::info!(server = %label, tools = listed.len(), "MCP server's tools changed");
                                        tools = listed;
                                        publish(&tools, true).await;
                                    }
                                    Err(e) => tracing::warn!(server = %label, error = %e, "listing tools failed"),
                                },
                                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                                    if running.is_closed() || peer.is_transport_closed() {
                                        break;
                                    }
                                }
                                _ = shutdown.cancelled() => {
                                    server.set_peer(None);
                                    let _ = running.close_with_timeout(Duration::from_secs(3)).await;
                                    return;
                                }
                            }
                        }
                        tracing::warn!(server = %label, "MCP server connection ended; restarting it");
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(server = %label, error = %e, "listing tools failed; restarting")
                    }
                    Err(_) => tracing::warn!(server = %label, "listing tools timed out; restarting"),
                }
                server.set_peer(None);
                let _ = running.close_with_timeout(Duration::from_secs(3)).await;
            }
            Ok(Err(e)) => tracing::warn!(server = %label, error = %e, "cannot connect to the MCP server"),
            Err(_) => tracing::warn!(server = %label, "connecting to the MCP server timed out"),
        }
        publish(&tools, false).await;
        metrics.restarted(&label);
        if started.elapsed() >= HEALTHY {
            backoff = FIRST_BACKOFF;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.cancelled() => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
