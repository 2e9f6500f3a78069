//! The servers `turnlog dev` runs on: DATABASE_URL and NATS_URL when set, each on its own;
//! otherwise a private Postgres and nats-server whose ports are recorded in the data
//! directory's `servers.json` and reused, whose data stays between runs, and which are
//! stopped when `turnlog dev` stops. A lock keeps two `turnlog dev` off one directory.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use turnlog_local_servers::{self as local, NatsServer};

use crate::postgres::{self, Cluster};

/// Ports and pids as the last `turnlog dev` on this directory left them.
#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    postgres: Option<PgRecord>,
    nats: Option<NatsRecord>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PgRecord {
    port: u16,
    /// Where the cluster lives (outside the data directory when run as root).
    data_dir: PathBuf,
}

#[derive(Debug, Serialize, Deserialize)]
struct NatsRecord {
    port: u16,
    pid: u32,
}

/// How the services reach the log and the bus, and what the banner says about each.
pub(crate) struct Endpoints {
    pub(crate) database_url: String,
    pub(crate) nats_url: String,
    pub(crate) postgres_note: String,
    pub(crate) nats_note: String,
}

/// What `turnlog dev` started (or adopted) and must stop.
pub(crate) struct PrivateServers {
    postgres: Option<Cluster>,
    nats: Option<NatsServer>,
    /// Held while the servers run; the OS releases it if the process dies.
    _lock: Option<File>,
}

impl PrivateServers {
    /// Stops the private servers: Postgres with a fast shutdown, nats-server with SIGTERM.
    pub(crate) fn stop(self) {
        if let Some(nats) = self.nats {
            tracing::info!(pid = nats.pid(), "stopping the private nats-server");
            nats.stop();
        }
        if let Some(cluster) = self.postgres {
            tracing::info!("stopping the private Postgres");
            if let Err(e) = cluster.stop() {
                tracing::error!(error = format!("{e:#}"), "the private Postgres did not stop");
            }
        }
    }
}

/// Resolves both servers, starting private ones where no URL is given. Blocking: run it
/// off the async runtime. On error, whatever was started is stopped again.
pub(crate) fn start(
    data_dir: &Path,
    database_url: Option<String>,
    nats_url: Option<String>,
) -> anyhow::Result<(PrivateServers, Endpoints)> {
    let mut servers = PrivateServers { postgres: None, nats: None, _lock: None };
    if database_url.is_none() || nats_url.is_none() {
        servers._lock = Some(lock(data_dir)?);
    }
    match start_each(&mut servers, data_dir, database_url, nats_url) {
        Ok(endpoints) => Ok((servers, endpoints)),
        Err(e) => {
            servers.stop();
            Err(e)
        }
    }
}

fn start_each(
    servers: &mut PrivateServers,
    data_dir: &Path,
    database_url: Option<String>,
    nats_url: Option<String>,
) -> anyhow::Result<Endpoints> {
    let mut state: State = local::read_record(&data_dir.join("servers.json"));
    let store = data_dir.join("nats");
    // Looked at before nats-server starts, which creates it.
    let stream_store_existed = store.join("jetstream").exists();

    let (nats_url, nats_note) = match nats_url {
        Some(url) => (url.clone(), format!("{} (NATS_URL)", turnlog_runtime::upstream::redacted_url(&url))),
        None => {
            let bin = local::nats_server_bin()?;
            let adopted = state.nats.as_ref().and_then(|n| Some((NatsServer::adopt(n.pid, n.port)?, n.port)));
            let (server, port) = match adopted {
                Some((server, port)) => {
                    tracing::info!(
                        port,
                        pid = server.pid(),
                        "adopting the private nats-server a previous run left"
                    );
                    (server, port)
                }
                None => {
                    let port = reuse_or_free_port(state.nats.as_ref().map(|n| n.port), "nats-server")?;
                    let server = NatsServer::start(&bin, port, &store, &data_dir.join("nats.log"))?;
                    (server, port)
                }
            };
            state.nats = Some(NatsRecord { port, pid: server.pid() });
            servers.nats = Some(server);
            local::write_record(&data_dir.join("servers.json"), &state)?;
            let url = format!("nats://127.0.0.1:{port}");
            (url.clone(), format!("{url} (private; JetStream store in {})", store.display()))
        }
    };

    let (database_url, postgres_note) = match database_url {
        Some(url) => (url, "the server DATABASE_URL names".to_owned()),
        None => {
            let cluster = Cluster::of(data_dir)?;
            // The database mirrors the APPEND stream (the writer resumes from its recorded
            // stream position); with the stream's store gone, the old database would make
            // the writer skip every new request, so it goes too.
            if cluster.exists() && servers.nats.is_some() && !stream_store_existed {
                if cluster.running_port().is_some() {
                    cluster.stop()?;
                }
                tracing::warn!(
                    dir = %cluster.data_dir().display(),
                    "the JetStream store is gone, so the Postgres data that mirrored it is removed too"
                );
                cluster.remove()?;
            }
            cluster.ensure_created(data_dir)?;
            let port = match cluster.running_port() {
                Some(port) => {
                    tracing::info!(port, "adopting the private Postgres a previous run left");
                    port
                }
                None => {
                    let port = reuse_or_free_port(state.postgres.as_ref().map(|p| p.port), "Postgres")?;
                    cluster.start(port)?;
                    port
                }
            };
            let data = cluster.data_dir();
            servers.postgres = Some(cluster);
            state.postgres = Some(PgRecord { port, data_dir: data.clone() });
            local::write_record(&data_dir.join("servers.json"), &state)?;
            let url = postgres_url_blocking(port)?;
            let note = format!("{url} (private; data in {})", data.display());
            (url, note)
        }
    };
    Ok(Endpoints { database_url, nats_url, postgres_note, nats_note })
}

/// The database URL, creating the database on first use; this module runs on a blocking
/// thread, so it enters the runtime for the connection.
fn postgres_url_blocking(port: u16) -> anyhow::Result<String> {
    tokio::runtime::Handle::current().block_on(postgres::ensure_database(port))
}

/// The port recorded last time when it is still free, else a new one (said in the log, as
/// a client configured with the old port must change).
fn reuse_or_free_port(recorded: Option<u16>, what: &str) -> anyhow::Result<u16> {
    match recorded {
        Some(port) if local::port_is_free(port) => Ok(port),
        Some(port) => {
            let new = local::free_port()?;
            tracing::warn!(old = port, new, "the recorded {what} port is taken; using another");
            Ok(new)
        }
        None => local::free_port(),
    }
}

fn lock(data_dir: &Path) -> anyhow::Result<File> {
    let file = local::open_lock_file(data_dir)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "another `turnlog dev` is running on {} (TURNLOG_DATA_DIR); stop it, or choose another directory",
            data_dir.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("cannot lock {}", data_dir.join("lock").display()))
        }
    }
}
