//! `turnlog dev`: the whole system in one process, for development. Private Postgres and
//! nats-server unless DATABASE_URL / NATS_URL name servers, the mock model unless
//! TURNLOG_LLM_URL names a gateway, migrations, then every service as its own task with its
//! own shutdown, stopped in order: ingress, workers, writer, then the private servers. It
//! takes a plain [`DevConfig`]: the binary's `cli.rs` builds it from the flags.

mod postgres;
mod servers;
mod stack;
mod workers;

pub use stack::{ServiceConfigs, Stack};
pub use workers::Worker;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turnlog_runtime::settings::Secret;
use turnlog_runtime::upstream::redacted_url;

use servers::Endpoints;

const MOCK_GRACE: Duration = Duration::from_secs(5);
/// How often the mock model's request log (kept for tests) is emptied, so a long `turnlog
/// dev` session does not hold every request it ever made.
const MOCK_LOG_CLEAR_EVERY: Duration = Duration::from_secs(60);

/// `turnlog dev`'s settings, checked.
pub struct DevConfig {
    /// Where the private Postgres and nats-server keep their data and recorded ports.
    /// Absolute, so the cluster's location (a hash of it, as root) does not depend on the
    /// working directory's spelling.
    pub data_dir: PathBuf,
    /// A Postgres to use instead of the private one.
    pub database_url: Option<Secret>,
    /// A NATS server (JetStream on) to use instead of the private one.
    pub nats_url: Option<String>,
    /// A model gateway to use instead of the built-in mock.
    pub llm_url: Option<String>,
    /// Every service's config, built and checked on stand-in servers and gateway: [`run`]
    /// points them at the real ones.
    pub services: ServiceConfigs,
}

impl ServiceConfigs {
    /// The same configs on the servers of `endpoints` and the gateway at `llm_url`. Every
    /// service gets the ingress's backbone (bus prefix, partitions, timeouts): `turnlog dev`
    /// builds them all from one set of flags.
    fn on(mut self, endpoints: &Endpoints, llm_url: &str) -> Self {
        let mut backbone = self.ingress.backbone.clone();
        backbone.database_url = endpoints.database_url.as_str().into();
        backbone.nats_url = endpoints.nats_url.as_str().into();
        self.ingress.backbone = backbone.clone();
        if let Some(writer) = &mut self.writer {
            writer.backbone = backbone.clone();
        }
        if let Some(tools) = &mut self.tools {
            tools.backbone = backbone.clone();
        }
        for worker in &mut self.workers {
            let (worker_backbone, upstream) = worker.connections_mut();
            *worker_backbone = backbone.clone();
            upstream.base_url = llm_url.into();
        }
        if let Some(upstream) = &mut self.ingress.upstream {
            upstream.base_url = llm_url.into();
        }
        self
    }
}

/// Runs everything until `shutdown`, then stops it in order. Returns an error when a
/// service stops by itself (the others are stopped too) or cannot start.
pub async fn run(config: DevConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let DevConfig { data_dir, database_url, nats_url, llm_url, services } = config;
    // Bound first: a taken port is reported before any server starts.
    let listen = services.ingress.listen;
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} (TURNLOG_LISTEN)"))?;
    let mock = match &llm_url {
        Some(url) => {
            if services.ingress.model == "mock" {
                tracing::warn!(
                    url = %redacted_url(url),
                    "TURNLOG_LLM_URL names a gateway but TURNLOG_MODEL is still `mock`; \
                     set it to one of the gateway's models"
                );
            }
            None
        }
        None => Some(Mock::start().await?),
    };

    let database_url = database_url.map(|url| url.expose().to_owned());
    let started = tokio::task::spawn_blocking(move || servers::start(&data_dir, database_url, nats_url))
        .await
        .context("starting the servers panicked")
        .and_then(|started| started);
    let (servers, endpoints) = match started {
        Ok(started) => started,
        Err(e) => {
            if let Some(mock) = mock {
                mock.stop().await;
            }
            return Err(e);
        }
    };

    let result = if shutdown.is_cancelled() {
        Ok(())
    } else {
        let gateway = match &mock {
            Some(m) => m.base_url.clone(),
            None => llm_url.unwrap_or_default(),
        };
        let configs = services.on(&endpoints, &gateway);
        run_services(configs, &endpoints, &gateway, mock.is_some(), listener, &shutdown).await
    };
    if let Some(mock) = mock {
        mock.stop().await;
    }
    tokio::task::spawn_blocking(move || servers.stop()).await.context("stopping the servers panicked")?;
    tracing::info!("turnlog dev stopped");
    result
}

async fn run_services(
    configs: ServiceConfigs,
    endpoints: &Endpoints,
    llm_url: &str,
    mock: bool,
    listener: TcpListener,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut stack = Stack::start(configs, listener).await?;
    let mut ended_early = None;
    tokio::select! {
        _ = shutdown.cancelled() => {}
        ready = stack.ready() => match ready {
            Err(name) => ended_early = Some(name),
            Ok(()) => {
                let llm_url = redacted_url(llm_url);
                let (base, tokens_required) = (stack.base_url(), stack.tokens_required());
                print_banner(base, endpoints, &llm_url, mock, tokens_required);
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    name = stack.ended() => ended_early = Some(name),
                }
            }
        },
    }
    if let Some(name) = ended_early {
        tracing::error!(service = name, "a service stopped by itself; stopping the others");
    }
    match (ended_early, stack.stop().await) {
        (_, Err(e)) => Err(e),
        (Some(name), Ok(())) => Err(anyhow::anyhow!("the {name} service stopped by itself")),
        (None, Ok(())) => Ok(()),
    }
}

/// Where everything is and how to talk to it, on stdout (the logs go to stderr).
fn print_banner(base: &str, endpoints: &Endpoints, llm_url: &str, mock: bool, tokens_required: bool) {
    let model = if mock {
        format!("the built-in mock model at {llm_url} (TURNLOG_LLM_URL is not set)")
    } else {
        format!("{llm_url} (TURNLOG_LLM_URL)")
    };
    let auth = if tokens_required { " -H 'Authorization: Bearer <token>'" } else { "" };
    // A body must be typed JSON: curl's `-d` alone sends a form type, which is refused.
    let json = " -H 'Content-Type: application/json'";
    let lines = [
        String::new(),
        format!("turnlog dev is ready at {base} (Ctrl-C stops everything)"),
        format!("  Postgres  {}", endpoints.postgres_note),
        format!("  NATS      {}", endpoints.nats_note),
        format!("  model     {model}"),
        "Try it:".to_owned(),
        format!("  curl -s{auth}{json} -X POST {base}/v1/sessions -d '{{\"title\":\"first chat\"}}'"),
        format!(
            "  curl -N{auth}{json} -X POST {base}/v1/sessions/<id>/messages -d '{{\"text\":\"Hello!\"}}'"
        ),
        String::new(),
    ];
    println!("{}", lines.join("\n"));
}

/// The built-in mock model on a free loopback port, for when no gateway is configured.
struct Mock {
    base_url: String,
    stop: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Mock {
    async fn start() -> anyhow::Result<Mock> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the mock model")?;
        let base_url = format!("http://{}/v1", listener.local_addr()?);
        tracing::warn!(
            url = %base_url,
            "TURNLOG_LLM_URL is not set: the built-in mock model answers every turn \
             (deterministic filler text, not a real model)"
        );
        let config = turnlog_mock_llm::MockConfig::default();
        let log = config.log.clone();
        let stop = CancellationToken::new();
        let clear = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = clear.cancelled() => return,
                    _ = tokio::time::sleep(MOCK_LOG_CLEAR_EVERY) => log.clear(),
                }
            }
        });
        let task = tokio::spawn(turnlog_mock_llm::run(listener, config, stop.clone()));
        Ok(Mock { base_url, stop, task })
    }

    async fn stop(self) {
        self.stop.cancel();
        match tokio::time::timeout(MOCK_GRACE, self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = format!("{e:#}"), "the mock model failed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the mock model panicked"),
            Err(_) => tracing::warn!("the mock model did not stop in time"),
        }
    }
}
