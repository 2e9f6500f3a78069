//! turnlog's one binary: each service and tool is a subcommand over its library crate's
//! `run`, so tests, containers and `turnlog dev` all run the same code.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "turnlog", version, about = "Append-only chat sessions over HTTP/SSE")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where the log and the bus are: shared by every subcommand that reaches them.
#[derive(clap::Args, Clone)]
struct Backbone {
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Prefix of every stream and subject name, so deployments can share a NATS server.
    #[arg(long, env = "TURNLOG_BUS_PREFIX", default_value = "turnlog")]
    bus_prefix: String,
    /// Writer partitions (a stable hash of the session id); fixed for a deployment.
    #[arg(long, env = "TURNLOG_PARTITIONS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    partitions: u32,
    /// How long TURNLOG_APPEND keeps requests (e.g. 30d); unlimited by default, so the
    /// database can be rebuilt from it.
    #[arg(long, env = "TURNLOG_APPEND_MAX_AGE", value_parser = turnlog_core::config::parse_duration)]
    append_max_age: Option<Duration>,
}

/// How long a worker waits for the writer to apply its append.
const WORKER_APPEND_TIMEOUT: Duration = Duration::from_secs(15);

/// The model gateway and the models the workers call.
#[derive(clap::Args, Clone)]
struct WorkerModels {
    /// Base URL of the OpenAI-compatible gateway, ending in /v1.
    #[arg(long, env = "TURNLOG_LLM_URL")]
    llm_url: String,
    #[arg(long, env = "TURNLOG_LLM_API_KEY", hide_env_values = true)]
    llm_api_key: Option<String>,
    /// The chat model: its window sizes the compaction budget when a turn names none.
    #[arg(long, env = "TURNLOG_MODEL")]
    model: String,
    /// Distillation, memory extraction and titles (default: TURNLOG_MODEL).
    #[arg(long, env = "TURNLOG_MINI_MODEL")]
    mini_model: Option<String>,
    /// Compaction summaries (default: TURNLOG_MODEL).
    #[arg(long, env = "TURNLOG_SUMMARY_MODEL")]
    summary_model: Option<String>,
    /// Context windows that win over the gateway's /models: `model=tokens,...`.
    #[arg(long, env = "TURNLOG_MODEL_WINDOWS", default_value = "")]
    model_windows: String,
    /// The compaction budget when the model's window is unknown.
    #[arg(long, env = "TURNLOG_CONTEXT_BUDGET", default_value_t = turnlog_core::budget::DEFAULT_BUDGET)]
    context_budget: u32,
    /// Deadline of one worker model call (e.g. 120s).
    #[arg(long, env = "TURNLOG_UPSTREAM_TIMEOUT", default_value = "120s", value_parser = turnlog_core::config::parse_duration)]
    upstream_timeout: Duration,
}

impl WorkerModels {
    fn upstream(&self) -> anyhow::Result<turnlog_core::upstream::UpstreamConfig> {
        let windows_override = turnlog_core::upstream::parse_model_windows(&self.model_windows)
            .map_err(|e| anyhow::anyhow!("TURNLOG_MODEL_WINDOWS: {e}"))?;
        Ok(turnlog_core::upstream::UpstreamConfig {
            base_url: self.llm_url.clone(),
            api_key: self.llm_api_key.clone().filter(|k| !k.is_empty()),
            timeout: self.upstream_timeout,
            windows_override,
        })
    }

    fn mini_model(&self) -> String {
        self.mini_model.clone().unwrap_or_else(|| self.model.clone())
    }
}

/// How a worker consumes the committed-event feed.
#[derive(clap::Args, Clone)]
struct WorkerTuning {
    /// Events one copy of the worker handles at once.
    #[arg(long, env = "TURNLOG_WORKER_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    worker_concurrency: u32,
    /// Deliveries of an event before it goes to the dead letters.
    #[arg(long, env = "TURNLOG_WORKER_MAX_DELIVER", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    worker_max_deliver: u32,
    /// How long an event may go unacknowledged before it is redelivered (workers report
    /// progress while they work, so this bounds only a dead copy's hold).
    #[arg(long, env = "TURNLOG_WORKER_ACK_WAIT", default_value = "60s", value_parser = turnlog_core::config::parse_duration)]
    worker_ack_wait: Duration,
    /// Delays before each redelivery after a failure, the last repeating: `2s,10s,30s,60s`.
    #[arg(long, env = "TURNLOG_WORKER_RETRY_BACKOFF", default_value = "2s,10s,30s,60s", value_delimiter = ',', value_parser = turnlog_core::config::parse_duration)]
    worker_retry_backoff: Vec<Duration>,
}

impl WorkerTuning {
    fn settings(&self) -> turnlog_core::worker::ConsumerSettings {
        turnlog_core::worker::ConsumerSettings {
            concurrency: usize::try_from(self.worker_concurrency).unwrap_or(1),
            max_deliver: self.worker_max_deliver,
            ack_wait: self.worker_ack_wait,
            retry_backoff: self.worker_retry_backoff.clone(),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Apply append requests to Postgres: the only process that writes it.
    Writer {
        #[command(flatten)]
        backbone: Backbone,
    },
    /// Distill each finished turn into its turn_memory residue; title new sessions.
    Distiller {
        #[command(flatten)]
        backbone: Backbone,
        #[command(flatten)]
        models: WorkerModels,
        #[command(flatten)]
        tuning: WorkerTuning,
    },
    /// Extract each finished turn's durable facts into memories.
    Memory {
        #[command(flatten)]
        backbone: Backbone,
        #[command(flatten)]
        models: WorkerModels,
        #[command(flatten)]
        tuning: WorkerTuning,
    },
    /// Keep every session's next request within its token budget (post-turn and pre-send).
    Compactor {
        #[command(flatten)]
        backbone: Backbone,
        #[command(flatten)]
        models: WorkerModels,
        #[command(flatten)]
        tuning: WorkerTuning,
        /// Longest wait for the extracted facts of the turns a summary replaces.
        #[arg(long, env = "TURNLOG_FACTS_WAIT", default_value = "5s", value_parser = turnlog_core::config::parse_duration)]
        facts_wait: Duration,
    },
    /// Serve the HTTP API: sessions, transcripts, context, memories.
    Ingress {
        #[command(flatten)]
        backbone: Backbone,
        #[command(flatten)]
        args: turnlog_ingress::IngressArgs,
    },
    /// Apply the database migrations and exit.
    Migrate {
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
    },
    /// Serve the deterministic OpenAI-compatible mock model.
    MockLlm {
        #[arg(long, env = "TURNLOG_MOCK_LISTEN", default_value = "127.0.0.1:8090")]
        listen: SocketAddr,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging();
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    match cli.command {
        Command::Writer { backbone: b } => {
            let pool =
                turnlog_core::db::connect(&b.database_url, 2).await.context("connecting to Postgres")?;
            turnlog_core::db::migrate(&pool).await.context("applying migrations")?;
            let config = turnlog_writer::WriterConfig {
                database_url: b.database_url,
                nats_url: b.nats_url,
                bus_prefix: b.bus_prefix,
                partitions: b.partitions,
                append_max_age: b.append_max_age,
            };
            turnlog_writer::run(config, shutdown).await
        }
        Command::Distiller { backbone: b, models: m, tuning: t } => {
            let config = turnlog_distiller::DistillerConfig {
                upstream: m.upstream()?,
                mini_model: m.mini_model(),
                consumer: t.settings(),
                call_deadline: m.upstream_timeout,
                append_timeout: WORKER_APPEND_TIMEOUT,
                database_url: b.database_url,
                nats_url: b.nats_url,
                bus_prefix: b.bus_prefix,
                partitions: b.partitions,
            };
            turnlog_distiller::run(config, shutdown).await
        }
        Command::Memory { backbone: b, models: m, tuning: t } => {
            let config = turnlog_memory::MemoryConfig {
                upstream: m.upstream()?,
                mini_model: m.mini_model(),
                consumer: t.settings(),
                call_deadline: m.upstream_timeout,
                append_timeout: WORKER_APPEND_TIMEOUT,
                database_url: b.database_url,
                nats_url: b.nats_url,
                bus_prefix: b.bus_prefix,
                partitions: b.partitions,
            };
            turnlog_memory::run(config, shutdown).await
        }
        Command::Compactor { backbone: b, models: m, tuning: t, facts_wait } => {
            let config = turnlog_compactor::CompactorConfig {
                upstream: m.upstream()?,
                summary_model: m.summary_model.clone().unwrap_or_else(|| m.model.clone()),
                model: m.model,
                context_budget: m.context_budget,
                consumer: t.settings(),
                facts_wait,
                summary_deadline: m.upstream_timeout,
                append_timeout: WORKER_APPEND_TIMEOUT,
                database_url: b.database_url,
                nats_url: b.nats_url,
                bus_prefix: b.bus_prefix,
                partitions: b.partitions,
            };
            turnlog_compactor::run(config, shutdown).await
        }
        Command::Ingress { backbone: b, args } => {
            let backbone = turnlog_ingress::Backbone {
                database_url: b.database_url,
                nats_url: b.nats_url,
                bus_prefix: b.bus_prefix,
                partitions: b.partitions,
                append_max_age: b.append_max_age,
            };
            let config = turnlog_ingress::IngressConfig::from_args(backbone, args)?;
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("cannot listen on {}", config.listen))?;
            turnlog_ingress::run(config, listener, shutdown).await
        }
        Command::Migrate { database_url } => {
            let pool = turnlog_core::db::connect(&database_url, 2).await.context("connecting to Postgres")?;
            turnlog_core::db::migrate(&pool).await.context("applying migrations")?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::MockLlm { listen } => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?;
            turnlog_mock_llm::run(listener, turnlog_mock_llm::MockConfig::default(), shutdown).await
        }
    }
}

/// Cancels `shutdown` on Ctrl-C or SIGTERM, so every service stops the same way.
async fn cancel_on_signal(shutdown: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops turnlog");
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutting down");
    shutdown.cancel();
}

/// `RUST_LOG` filters (default info); `TURNLOG_LOG_FORMAT=json` for one JSON object a line.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if std::env::var("TURNLOG_LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
