//! The once-per-run Postgres and nats-server every test process shares when DATABASE_URL /
//! NATS_URL are unset: started by whichever test gets there first, found again by the
//! others through a JSON file guarded by a file lock, restarted if dead, left running.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use turnlog_local_servers::{
    self as local, current_uid, free_port, kill_postmaster, local_url, make_owned_dir, nats_server_bin,
    port_is_free, postgres_user, process_alive, wait_accepting, Cluster, NatsServer, PgBins,
};

use crate::postgres;

/// Everything the testkit keeps between test processes: the lock, `servers.json`, the
/// shared nats-server's store and log, and the sweep's records. `TURNLOG_TESTKIT_STATE_DIR`
/// puts them elsewhere (the testkit's own sweep test gives a child process one of its own).
pub(crate) fn state_dir() -> PathBuf {
    match std::env::var_os(STATE_DIR_VAR) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(format!("/var/tmp/turnlog-testkit-{}", current_uid())),
    }
}

/// The environment variable naming another state directory.
pub const STATE_DIR_VAR: &str = "TURNLOG_TESTKIT_STATE_DIR";

/// Ports and pids of the shared servers, as recorded by the process that started them.
#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    postgres: Option<PgState>,
    nats: Option<NatsState>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PgState {
    port: u16,
    pid: u32,
    data_dir: PathBuf,
}

#[derive(Debug, Serialize, Deserialize)]
struct NatsState {
    port: u16,
    pid: u32,
}

/// Holds the state directory's exclusive lock until dropped (the OS also releases it if
/// the holder dies, so a killed test never wedges the others).
pub(crate) struct StateLock {
    _file: File,
    pub(crate) dir: PathBuf,
}

pub(crate) fn lock_state() -> anyhow::Result<StateLock> {
    use std::os::unix::fs::PermissionsExt;
    let dir = state_dir();
    let file = local::open_lock_file(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    file.lock().with_context(|| format!("cannot lock {}", dir.join("lock").display()))?;
    Ok(StateLock { _file: file, dir })
}

fn read_state(dir: &Path) -> State {
    local::read_record(&dir.join("servers.json"))
}

fn write_state(dir: &Path, state: &State) -> anyhow::Result<()> {
    local::write_record(&dir.join("servers.json"), state)
}

/// URLs of the shared servers this process was asked for (`None` where not asked),
/// starting or restarting them as needed. Blocking: call it off the async runtime.
pub(crate) fn ensure(
    need_postgres: bool,
    need_nats: bool,
) -> anyhow::Result<(Option<String>, Option<String>)> {
    if !need_postgres && !need_nats {
        return Ok((None, None));
    }
    let lock = lock_state()?;
    let mut state = read_state(&lock.dir);
    let postgres = if need_postgres {
        let port = ensure_postgres(&mut state).context("shared private Postgres")?;
        write_state(&lock.dir, &state)?;
        Some(local_url(port, "postgres"))
    } else {
        None
    };
    let nats = if need_nats {
        let port = ensure_nats(&lock.dir, &mut state).context("shared private nats-server")?;
        write_state(&lock.dir, &state)?;
        Some(format!("nats://127.0.0.1:{port}"))
    } else {
        None
    };
    Ok((postgres, nats))
}

fn ensure_postgres(state: &mut State) -> anyhow::Result<u16> {
    let base = postgres::base_dir();
    let cluster = Cluster::new(PgBins::find()?, postgres_user()?, base.join("shared"));
    if let Some(pg) = &state.postgres {
        if process_alive(pg.pid, "postgres") {
            let pid = pg.pid;
            if wait_accepting(pg.port, Duration::from_secs(10), || !process_alive(pid, "postgres")) {
                return Ok(pg.port);
            }
            // Alive but not accepting for 10 s: wedged. Stop it and start afresh.
            kill_postmaster(pid);
        }
    }
    let preferred = state.postgres.as_ref().map(|pg| pg.port).filter(|p| port_is_free(*p));
    let port = match preferred {
        Some(port) => port,
        None => free_port()?,
    };
    make_owned_dir(&base, cluster.user())?;
    // The server's log is opened by pg_ctl as the server's user, so that user must own it.
    let log = base.join("shared.log");
    local::append_log(&log)?;
    cluster.chown(&log)?;
    let initdb_log = base.join("initdb.log");
    let ctl_log = base.join("pg_ctl.log");
    let options = postgres::server_args(port, cluster.data_dir(), false);
    let start = || cluster.start(&log, &ctl_log, Duration::from_secs(60), &options);
    let reuse_data = cluster_usable(&cluster);
    if !reuse_data {
        fresh_cluster(&cluster, &initdb_log)?;
    }
    if let Err(e) = start() {
        if !reuse_data {
            return Err(e);
        }
        // A cluster that will not start (corrupt after a host crash, say) holds only
        // disposable test databases: start over once.
        eprintln!("turnlog-testkit: shared Postgres would not start on its old data ({e:#}); recreating it");
        fresh_cluster(&cluster, &initdb_log)?;
        start()?;
    }
    let pid = cluster.running().context("postmaster.pid unreadable after start")?.pid;
    state.postgres = Some(PgState { port, pid, data_dir: cluster.data_dir().to_path_buf() });
    Ok(port)
}

/// Whether the cluster is one we finished creating, for this server version.
fn cluster_usable(cluster: &Cluster) -> bool {
    let complete = cluster.data_dir().with_extension("initialized").exists();
    complete && cluster.data_version().as_ref() == Some(&cluster.bins().major)
}

fn fresh_cluster(cluster: &Cluster, log: &Path) -> anyhow::Result<()> {
    let data_dir = cluster.data_dir();
    let marker = data_dir.with_extension("initialized");
    let _ = std::fs::remove_file(&marker);
    if data_dir.exists() {
        std::fs::remove_dir_all(data_dir).with_context(|| format!("cannot remove {}", data_dir.display()))?;
    }
    cluster.initdb(log, false)?;
    // Written only after initdb succeeded, so an interrupted initdb is redone.
    std::fs::write(&marker, b"")?;
    Ok(())
}

fn ensure_nats(dir: &Path, state: &mut State) -> anyhow::Result<u16> {
    if let Some(n) = &state.nats {
        if NatsServer::adopt(n.pid, n.port).is_some() {
            return Ok(n.port);
        }
    }
    let bin = nats_server_bin()?;
    let preferred = state.nats.as_ref().map(|n| n.port).filter(|p| port_is_free(*p));
    let port = match preferred {
        Some(port) => port,
        None => free_port()?,
    };
    let store = dir.join("nats");
    let log = dir.join("nats.log");
    // Left running when dropped: later test processes and runs use it too.
    let server = match NatsServer::start(&bin, port, &store, &log) {
        Ok(server) => server,
        Err(e) => {
            // As with Postgres: a store that will not load holds only test streams.
            eprintln!(
                "turnlog-testkit: shared nats-server would not start ({e:#}); retrying with a new store"
            );
            let _ = std::fs::remove_dir_all(&store);
            NatsServer::start(&bin, port, &store, &log)?
        }
    };
    state.nats = Some(NatsState { port, pid: server.pid() });
    Ok(port)
}

/// Stops the shared private Postgres and nats-server of this user (if running) and deletes
/// their data, the private clusters of tests that died without cleaning up, and the
/// sweep's records; the next test run starts new ones. Tests running at the same time lose
/// their servers. Also available as `cargo run -p turnlog-testkit --bin turnlog-testkit-stop`.
pub fn stop_private_servers() -> anyhow::Result<()> {
    let lock = lock_state()?;
    let state = read_state(&lock.dir);
    if let Some(pg) = &state.postgres {
        if process_alive(pg.pid, "postgres") {
            let stopped = PgBins::find().and_then(|bins| {
                let cluster = Cluster::new(bins, postgres_user()?, pg.data_dir.clone());
                cluster.stop(&lock.dir.join("pg_ctl.log"), Duration::from_secs(30))
            });
            if let Err(e) = stopped {
                eprintln!("turnlog-testkit: {e:#}; killing Postgres (pid {})", pg.pid);
                kill_postmaster(pg.pid);
            }
            println!("stopped the shared private Postgres on port {}", pg.port);
        }
    }
    if let Some(n) = &state.nats {
        if let Some(server) = NatsServer::existing(n.pid) {
            server.stop();
            println!("stopped the shared private nats-server on port {}", n.port);
        }
    }
    let pg_base = postgres::base_dir();
    if pg_base.exists() {
        std::fs::remove_dir_all(&pg_base).with_context(|| format!("cannot remove {}", pg_base.display()))?;
    }
    // Everything but the lock file: removing a held lock's file would let a newcomer lock a
    // new file while a waiter holds the old one.
    for entry in std::fs::read_dir(&lock.dir)?.filter_map(Result::ok) {
        if entry.file_name() == "lock" {
            continue;
        }
        let path = entry.path();
        let removed =
            if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
        removed.with_context(|| format!("cannot remove {}", path.display()))?;
    }
    println!("removed {} and the contents of {}", pg_base.display(), lock.dir.display());
    Ok(())
}
