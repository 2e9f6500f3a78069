//! turnlog's one binary: each service and tool is a subcommand over its library crate's
//! `run`, so tests, containers and `turnlog dev` all run the same code.

mod cli;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use turnlog_core::ids::Owner;
use turnlog_runtime::worker::ConsumerSettings;

use cli::{Cli, Command, DeadCommand, LogFormat};

/// mimalloc, not glibc's malloc: a service allocates and frees many short-lived buffers
/// (requests, events, JSON, bus messages) across threads, and glibc's malloc was a quarter
/// of the writer's profile under load (docs/benchmarks.md, CPU per append and per turn).
/// mimalloc returns freed memory to the system by itself, which glibc did only with a
/// fixed mmap threshold (a mapping per large buffer). Built without transparent huge
/// pages (`no_thp`): with them each process kept 30–40% more resident memory.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Serves the process's metrics, health and readiness when TURNLOG_METRICS_LISTEN is set.
async fn serve_metrics(args: &cli::MetricsArgs, shutdown: &CancellationToken) -> anyhow::Result<()> {
    if let Some(listen) = args.metrics_listen {
        let listener = turnlog_runtime::telemetry::bind(listen).await?;
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            if let Err(e) = turnlog_runtime::telemetry::serve(listener, shutdown).await {
                tracing::error!(error = format!("{e:#}"), "metrics listener stopped");
            }
        });
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse_or_exit();
    // A conversion child: no runtime, no logging, only the conversion.
    if let Command::ConvertHtml = cli.command {
        std::process::exit(turnlog_ingress::files::convert::html_child());
    }
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let telemetry = init_logging(cli.log_format, cli.command.service_name())?;
    let result = serve(cli.command).await;
    telemetry.shutdown().await;
    result
}

async fn serve(command: Command) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    match command {
        Command::Writer { backbone: b, metrics } => {
            serve_metrics(&metrics, &shutdown).await?;
            let pool = b.backbone().connect_db(2).await.context("connecting to Postgres")?;
            turnlog_runtime::db::migrate(&pool).await.context("applying migrations")?;
            turnlog_writer::run(b.writer(), shutdown).await
        }
        Command::Distiller { .. } | Command::Memory { .. } | Command::Compactor { .. } => {
            let Some((worker, metrics)) = command.worker() else { anyhow::bail!("not a worker") };
            let worker = worker?;
            serve_metrics(metrics, &shutdown).await?;
            worker.run(shutdown).await
        }
        Command::Tools { backbone: b, tools, metrics } => {
            let Some(config) = tools.config(b.backbone())? else {
                anyhow::bail!("TURNLOG_MCP_SERVERS is not set: the tools worker needs a servers file");
            };
            serve_metrics(&metrics, &shutdown).await?;
            turnlog_tools::run(config, shutdown).await
        }
        Command::Ingress { backbone: b, args } => {
            let config = b.ingress(*args)?;
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("cannot listen on {}", config.listen))?;
            turnlog_ingress::run(config, listener, shutdown).await
        }
        Command::Migrate { bus: true, nats_url, layout, .. } => {
            let bus = layout.connect(&nats_url).await?;
            for change in bus.migrate_replicas(layout.append_max_age).await? {
                println!("{change}");
            }
            Ok(())
        }
        Command::Migrate { database_url, .. } => {
            let database_url = database_url.context("DATABASE_URL (or --database-url) is required")?;
            let pool = turnlog_runtime::db::connect(database_url.expose(), 2)
                .await
                .context("connecting to Postgres")?;
            turnlog_runtime::db::migrate(&pool).await.context("applying migrations")?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Dev { args } => turnlog_dev::run(args.config()?, shutdown).await,
        Command::MockLlm { listen } => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?;
            turnlog_mock_llm::run(listener, turnlog_mock_llm::MockConfig::default(), shutdown).await
        }
        Command::Replay { worker, from_seq, since, session, args: w, compactor: c } => {
            let from = match (from_seq, since) {
                (Some(seq), _) => turnlog_ops::ReplayFrom::Sequence(seq),
                (None, Some(time)) => turnlog_ops::ReplayFrom::Time(time),
                (None, None) => anyhow::bail!("--from-seq or --since is required"),
            };
            let replay = turnlog_ops::Replay::new(from, session);
            let consumer = ConsumerSettings { replay: Some(replay.clone()), ..w.tuning.settings() };
            let mut worker = w.worker(worker, &c)?;
            *worker.consumer_mut() = consumer;
            turnlog_ops::replay(worker.name(), &replay, true, shutdown, |s| worker.run(s)).await?;
            Ok(())
        }
        Command::Rebuild { database_url, nats_url, bus } => {
            let bus = bus.connect(&nats_url).await?;
            turnlog_ops::rebuild(database_url.expose(), &bus, true).await.map(drop)
        }
        Command::Import { owner, format, file, backbone } => {
            let owner = Owner::parse(&owner)?;
            let format = format.as_deref().map(str::parse).transpose()?;
            let summary =
                turnlog_ops::transfer::import(&backbone.backbone(), &owner, format, &file, true).await?;
            if !summary.failed.is_empty() {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Export { owner, format, backbone } => {
            let owner = Owner::parse(&owner)?;
            let format = format.parse()?;
            let n = turnlog_ops::transfer::export(&backbone.backbone(), &owner, format).await?;
            eprintln!("exported {n} sessions");
            Ok(())
        }
        Command::Verify { url_a, url_b } => {
            let code = match turnlog_ops::verify(&url_a, &url_b).await {
                Ok(verdict) if verdict.is_identical() => 0,
                Ok(_) => 1,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    2
                }
            };
            std::process::exit(code)
        }
        // Handled in `main`, before the runtime starts.
        Command::ConvertHtml => anyhow::bail!("convert-html runs on its own"),
        Command::Dead { command, nats_url, bus } => {
            let bus = bus.connect(&nats_url).await?;
            match command {
                DeadCommand::List => turnlog_ops::dead::list(&bus, |_| {}).await.map(drop),
                DeadCommand::Show { seq } => turnlog_ops::dead::show(&bus, seq).await.map(drop),
                DeadCommand::Redrive { seq, database_url, timeout } => {
                    let pool = match database_url {
                        Some(url) => Some(
                            turnlog_runtime::db::connect(url.expose(), 1)
                                .await
                                .context("connecting to Postgres")?,
                        ),
                        None => None,
                    };
                    let redriven = turnlog_ops::dead::redrive(&bus, pool.as_ref(), seq, timeout).await?;
                    let applied = redriven.outcome.is_some_and(|o| o.is_applied());
                    anyhow::ensure!(applied, "dead letter {seq} was not applied");
                    Ok(())
                }
            }
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

/// Logs go to stderr (stdout stays for what a command prints for its user, such as `turnlog
/// dev`'s banner), filtered by `RUST_LOG` (default info); spans are traced, and exported when
/// OTEL_EXPORTER_OTLP_ENDPOINT is set (`turnlog_runtime::trace`).
fn init_logging(format: LogFormat, service: &str) -> anyhow::Result<turnlog_runtime::trace::Telemetry> {
    use std::io::IsTerminal as _;
    use tracing_subscriber::EnvFilter;
    use turnlog_runtime::trace::LogStyle;
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::builder().parse(&spec).map_err(|e| {
            anyhow::anyhow!("RUST_LOG={spec:?} is not a log filter (e.g. info,turnlog_writer=debug): {e}")
        })?,
        // sqlx reports Postgres notices ("relation already exists, skipping") at info.
        _ => EnvFilter::new("info,sqlx::postgres::notice=warn"),
    };
    let style = match format {
        LogFormat::Pretty => LogStyle::Pretty { ansi: std::io::stderr().is_terminal() },
        LogFormat::Json => LogStyle::Json,
    };
    turnlog_runtime::trace::init(service, style, filter)
}
