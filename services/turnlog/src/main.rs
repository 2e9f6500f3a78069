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
    #[arg(long, env = "TURNLOG_APPEND_MAX_AGE", value_parser = parse_duration)]
    append_max_age: Option<Duration>,
}

#[derive(Subcommand)]
enum Command {
    /// Apply append requests to Postgres: the only process that writes it.
    Writer {
        #[command(flatten)]
        backbone: Backbone,
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

/// `90s`, `15m`, `12h`, `30d`, or plain seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| format!("{s:?} is not a duration like 30d, 12h, 15m or 90s"))?;
    let secs = match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use s, m, h or d)")),
    };
    Ok(Duration::from_secs(secs))
}
