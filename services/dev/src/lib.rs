//! `turnlog dev`: the whole system in one process, for development. Private Postgres and
//! nats-server unless DATABASE_URL / NATS_URL name servers, the mock model unless
//! TURNLOG_LLM_URL names a gateway, migrations, then every service as its own task with its
//! own shutdown, stopped in order: ingress, workers, writer, then the private servers.
//!
//! [`settings`] is also where every other subcommand's flags become its service's config.

mod postgres;
mod servers;
pub mod settings;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turnlog_ingress::IngressArgs;
use turnlog_runtime::upstream::redacted_url;

use servers::Endpoints;
use settings::{Backbone, BusArgs, CompactorArgs, ReadArgs, TaskModels, WorkerModels, WorkerTuning};

/// Beyond the ingress's own grace period (open requests finishing), how long its task
/// gets to return.
const INGRESS_STOP_MARGIN: Duration = Duration::from_secs(5);
/// How long the workers get to finish the events in hand; an event cut off is redelivered
/// on the next start.
const WORKERS_GRACE: Duration = Duration::from_secs(20);
const WRITER_GRACE: Duration = Duration::from_secs(15);
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

/// Every service's config for one set of servers and one model gateway.
struct ServiceConfigs {
    writer: turnlog_writer::WriterConfig,
    ingress: turnlog_ingress::IngressConfig,
    distiller: turnlog_distiller::DistillerConfig,
    memory: turnlog_memory::MemoryConfig,
    compactor: turnlog_compactor::CompactorConfig,
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
        writer: backbone.writer(),
        ingress: backbone.ingress(ingress)?,
        distiller: backbone.distiller(&models, &args.tuning)?,
        memory: backbone.memory(&models, &args.tuning)?,
        compactor: backbone.compactor(&models, &args.tuning, &args.compactor)?,
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
    let pool =
        turnlog_runtime::db::connect(&endpoints.database_url, 2).await.context("connecting to Postgres")?;
    turnlog_runtime::db::migrate(&pool).await.context("applying migrations")?;
    pool.close().await;
    // The streams too, before any service looks for them (a worker that starts first
    // would otherwise retry until the writer has made them).
    let bus =
        turnlog_runtime::bus::Bus::connect(&endpoints.nats_url, &args.bus.bus_prefix, args.bus.partitions)
            .await
            .context("connecting to NATS")?;
    bus.ensure_topology(args.bus.append_max_age).await.context("creating the bus topology")?;
    drop(bus);
    let addr = listener.local_addr().context("reading the listen address")?;
    let tokens_required = !configs.ingress.tokens.is_empty();
    let ingress_grace = configs.ingress.shutdown_grace + INGRESS_STOP_MARGIN;
    let probe = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;

    // Each service on its own task and token; the tokens are not children of `shutdown`,
    // which would stop everything at once, but are cancelled below in order.
    let all = CancellationToken::new();
    let _backstop = all.clone().drop_guard();
    let (ended_tx, mut ended) = mpsc::unbounded_channel();
    let ServiceConfigs { writer, ingress, distiller, memory, compactor } = configs;
    let writer = Service::spawn("writer", &all, &ended_tx, |t| turnlog_writer::run(writer, t));
    let workers = vec![
        Service::spawn("distiller", &all, &ended_tx, |t| turnlog_distiller::run(distiller, t)),
        Service::spawn("memory", &all, &ended_tx, |t| turnlog_memory::run(memory, t)),
        Service::spawn("compactor", &all, &ended_tx, |t| turnlog_compactor::run(compactor, t)),
    ];
    let ingress = Service::spawn("ingress", &all, &ended_tx, |t| turnlog_ingress::run(ingress, listener, t));

    let base = base_url(addr);
    let mut ended_early = None;
    tokio::select! {
        _ = shutdown.cancelled() => {}
        name = ended.recv() => ended_early = name,
        () = wait_ready(&probe, &base) => {
            let llm_url = redacted_url(llm_url);
            print_banner(&base, endpoints, &llm_url, args.ingress.llm_url.is_none(), tokens_required);
            tokio::select! {
                _ = shutdown.cancelled() => {}
                name = ended.recv() => ended_early = name,
            }
        }
    }
    if let Some(name) = ended_early {
        tracing::error!(service = name, "a service stopped by itself; stopping the others");
    }

    // Ingress first, so its last checkpoints still reach the writer; the workers next (their
    // appends too); the writer last.
    let mut errors = Vec::new();
    tracing::info!("stopping the ingress");
    errors.extend(stop_group(vec![ingress], ingress_grace).await);
    tracing::info!("stopping the workers");
    errors.extend(stop_group(workers, WORKERS_GRACE).await);
    tracing::info!("stopping the writer");
    errors.extend(stop_group(vec![writer], WRITER_GRACE).await);
    for e in &errors {
        tracing::error!(error = format!("{e:#}"), "service failed");
    }
    match (ended_early, errors.into_iter().next()) {
        (_, Some(e)) => Err(e),
        (Some(name), None) => Err(anyhow::anyhow!("the {name} service stopped by itself")),
        (None, None) => Ok(()),
    }
}

/// One service on its own task, with the token that stops it.
struct Service {
    name: &'static str,
    stop: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Service {
    /// Spawns `run` with a child token of `all`; `ended` hears the name when it returns.
    fn spawn<F>(
        name: &'static str,
        all: &CancellationToken,
        ended: &mpsc::UnboundedSender<&'static str>,
        run: impl FnOnce(CancellationToken) -> F,
    ) -> Service
    where
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let stop = all.child_token();
        let service = run(stop.clone());
        let ended = ended.clone();
        let task = tokio::spawn(async move {
            let result = service.await;
            let _ = ended.send(name);
            result
        });
        Service { name, stop, task }
    }
}

/// Stops every service of `group` at once and waits up to `grace` for each; one still
/// running then is aborted.
async fn stop_group(group: Vec<Service>, grace: Duration) -> Vec<anyhow::Error> {
    for service in &group {
        service.stop.cancel();
    }
    let deadline = tokio::time::Instant::now() + grace;
    let mut errors = Vec::new();
    for Service { name, mut task, .. } in group {
        match tokio::time::timeout_at(deadline, &mut task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => errors.push(e.context(format!("the {name} service failed"))),
            Ok(Err(e)) => errors.push(anyhow::anyhow!("the {name} service panicked: {e}")),
            Err(_) => {
                tracing::warn!(service = name, ?grace, "did not stop in time; abandoning it");
                task.abort();
            }
        }
    }
    errors
}

/// Polls `/readyz` until it answers 200 (Postgres and NATS reachable), saying so now and
/// then when it takes long.
async fn wait_ready(probe: &reqwest::Client, base: &str) {
    let url = format!("{base}/readyz");
    let started = tokio::time::Instant::now();
    let mut next_note = Duration::from_secs(15);
    loop {
        match probe.get(&url).send().await {
            Ok(r) if r.status().is_success() => return,
            answer => {
                if started.elapsed() >= next_note {
                    let detail = match answer {
                        Ok(r) => format!("{} {}", r.status(), r.text().await.unwrap_or_default()),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(%url, detail, "the ingress is not ready yet");
                    next_note += Duration::from_secs(15);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `http://host:port` a client on this machine uses to reach `addr`.
fn base_url(addr: SocketAddr) -> String {
    let host = match addr {
        SocketAddr::V4(a) if a.ip().is_unspecified() => "127.0.0.1".to_owned(),
        SocketAddr::V4(a) => a.ip().to_string(),
        SocketAddr::V6(a) if a.ip().is_unspecified() => "[::1]".to_owned(),
        SocketAddr::V6(a) => format!("[{}]", a.ip()),
    };
    format!("http://{host}:{}", addr.port())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_reach_a_wildcard_listener_on_loopback() {
        assert_eq!(base_url("0.0.0.0:8080".parse().unwrap()), "http://127.0.0.1:8080");
        assert_eq!(base_url("127.0.0.1:9".parse().unwrap()), "http://127.0.0.1:9");
        assert_eq!(base_url("[::]:80".parse().unwrap()), "http://[::1]:80");
        assert_eq!(base_url("[::1]:80".parse().unwrap()), "http://[::1]:80");
    }
}
