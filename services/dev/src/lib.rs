//! `turnlog dev`: the whole system in one process, for development. Private Postgres and
//! nats-server unless DATABASE_URL / NATS_URL name servers, the mock model unless
//! TURNLOG_LLM_URL names a gateway, migrations, then every service as its own task with its
//! own shutdown, stopped in order: ingress, workers, writer, then the private servers.
//!
//! [`settings`] is also where every other subcommand's flags become its service's config.

mod nats;
mod os;
mod postgres;
mod servers;
pub mod settings;
mod stack;

pub use os::find_executable;
pub use postgres::PgBins;
pub use stack::{ServiceConfigs, Stack};

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turnlog_ingress::IngressArgs;
use turnlog_runtime::upstream::redacted_url;

use servers::Endpoints;
use settings::{Backbone, BusArgs, CompactorArgs, ReadArgs, TaskModels, WorkerModels, WorkerTuning};

const MOCK_GRACE: Duration = Duration::from_secs(5);
/// How often the mock model's request log (kept for tests) is emptied, so a long `turnlog
/// dev` session does not hold every request it ever made.
const MOCK_LOG_CLEAR_EVERY: Duration = Duration::from_secs(60);

/// The flags of `turnlog dev`: where its private servers live, the servers to use instead,
/// and every service's settings.
#[derive(clap::Args, Clone)]
pub struct DevArgs {
    /// Where the private Postgres and nats-server keep their data and recorded ports.
    #[arg(long, env = "TURNLOG_DATA_DIR", default_value = ".turnlog")]
    pub data_dir: PathBuf,
    /// A Postgres to use instead of the private one.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// A NATS server (JetStream on) to use instead of the private one.
    #[arg(long, env = "NATS_URL")]
    pub nats_url: Option<String>,
    #[command(flatten)]
    pub bus: BusArgs,
    #[command(flatten)]
    pub reads: ReadArgs,
    #[command(flatten)]
    pub ingress: IngressArgs,
    #[command(flatten)]
    pub tasks: TaskModels,
    #[command(flatten)]
    pub tuning: WorkerTuning,
    #[command(flatten)]
    pub compactor: CompactorArgs,
}

/// `turnlog dev`'s settings, checked.
pub struct DevConfig {
    args: DevArgs,
    /// Absolute, so the cluster's location (a hash of it, as root) does not depend on the
    /// working directory's spelling.
    data_dir: PathBuf,
}

impl DevConfig {
    /// Checks every setting before anything starts: each service's config is built once,
    /// by the code that builds it for real later, against stand-in addresses.
    pub fn from_args(mut args: DevArgs) -> anyhow::Result<Self> {
        // An empty variable (`DATABASE_URL=`) means "not set", as a shell user expects.
        args.database_url = args.database_url.filter(|u| !u.trim().is_empty());
        args.nats_url = args.nats_url.filter(|u| !u.trim().is_empty());
        args.ingress.llm_url = args.ingress.llm_url.filter(|u| !u.trim().is_empty());
        let stand_in = Endpoints {
            database_url: "postgres://stand-in".into(),
            nats_url: "nats://stand-in".into(),
            postgres_note: String::new(),
            nats_note: String::new(),
        };
        service_configs(&args, &stand_in, "http://stand-in/v1")?;
        let data_dir = std::path::absolute(&args.data_dir).context("TURNLOG_DATA_DIR")?;
        Ok(Self { args, data_dir })
    }
}

fn service_configs(args: &DevArgs, endpoints: &Endpoints, llm_url: &str) -> anyhow::Result<ServiceConfigs> {
    let backbone = Backbone {
        database_url: endpoints.database_url.clone(),
        nats_url: endpoints.nats_url.clone(),
        bus: args.bus.clone(),
        reads: args.reads.clone(),
    };
    let mut ingress = args.ingress.clone();
    ingress.llm_url = Some(llm_url.to_owned());
    let models = WorkerModels::from_ingress(&ingress, llm_url.to_owned(), args.tasks.clone());
    Ok(ServiceConfigs {
        writer: Some(backbone.writer()),
        ingress: backbone.ingress(ingress)?,
        distiller: Some(backbone.distiller(&models, &args.tuning)?),
        memory: Some(backbone.memory(&models, &args.tuning)?),
        compactor: Some(backbone.compactor(&models, &args.tuning, &args.compactor)?),
    })
}

/// Runs everything until `shutdown`, then stops it in order. Returns an error when a
/// service stops by itself (the others are stopped too) or cannot start.
pub async fn run(config: DevConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let DevConfig { args, data_dir } = config;
    // Bound first: a taken port is reported before any server starts.
    let listen = args.ingress.listen;
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} (TURNLOG_LISTEN)"))?;
    let mock = match &args.ingress.llm_url {
        Some(url) => {
            if args.ingress.model == "mock" {
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

    let (database_url, nats_url) = (args.database_url.clone(), args.nats_url.clone());
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
        let llm_url = match &mock {
            Some(m) => m.base_url.clone(),
            None => args.ingress.llm_url.clone().unwrap_or_default(),
        };
        run_services(&args, &endpoints, &llm_url, listener, &shutdown).await
    };
    if let Some(mock) = mock {
        mock.stop().await;
    }
    tokio::task::spawn_blocking(move || servers.stop()).await.context("stopping the servers panicked")?;
    tracing::info!("turnlog dev stopped");
    result
}

async fn run_services(
    args: &DevArgs,
    endpoints: &Endpoints,
    llm_url: &str,
    listener: TcpListener,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let configs = service_configs(args, endpoints, llm_url)?;
    let mut stack = Stack::start(configs, listener).await?;
    let mut ended_early = None;
    tokio::select! {
        _ = shutdown.cancelled() => {}
        ready = stack.ready() => match ready {
            Err(name) => ended_early = Some(name),
            Ok(()) => {
                let llm_url = redacted_url(llm_url);
                let (base, tokens_required) = (stack.base_url(), stack.tokens_required());
                print_banner(base, endpoints, &llm_url, args.ingress.llm_url.is_none(), tokens_required);
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
