//! The once-per-run Postgres and nats-server every test process shares when DATABASE_URL /
//! NATS_URL are unset: started by whichever test gets there first, found again by the
//! others through a JSON file guarded by a file lock, restarted if dead, left running.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::nats;
use crate::postgres::{self, PgBins};
use crate::process::spawn_detached;
use crate::util::{
    current_uid, free_port, port_is_free, process_alive, send_signal, tail_lines, wait_accepting,
};

/// Everything the testkit keeps between test processes: the lock, `servers.json`, the
/// shared nats-server's store and log, and the sweep's records.
pub(crate) fn state_dir() -> PathBuf {
    PathBuf::from(format!("/var/tmp/turnlog-testkit-{}", current_uid()))
}

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
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    file.lock().with_context(|| format!("cannot lock {}", path.display()))?;
    Ok(StateLock { _file: file, dir })
}

fn read_state(dir: &Path) -> State {
    // A missing or unreadable file means "nothing running yet"; whatever it described is
    // found dead by the checks below and replaced.
    std::fs::read(dir.join("servers.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn write_state(dir: &Path, state: &State) -> anyhow::Result<()> {
    let tmp = dir.join("servers.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(state)?)?;
    std::fs::rename(&tmp, dir.join("servers.json"))?;
    Ok(())
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
        Some(postgres::local_url(port, "postgres"))
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
    let bins = PgBins::find()?;
    let user = postgres::server_user()?;
    let base = postgres::base_dir();
    let data_dir = base.join("shared");
    if let Some(pg) = &state.postgres {
        if process_alive(pg.pid, "postgres") {
            if wait_accepting(pg.port, Duration::from_secs(10)) {
                return Ok(pg.port);
            }
            // Alive but not accepting for 10 s: wedged. Stop it and start afresh.
            let _ = send_signal(pg.pid, "QUIT");
            wait_gone(pg.pid, "postgres", Duration::from_secs(10));
            let _ = send_signal(pg.pid, "KILL");
        }
    }
    let preferred = state.postgres.as_ref().map(|pg| pg.port).filter(|p| port_is_free(*p));
    let port = preferred.unwrap_or_else(free_port);
    postgres::prepare_owned_dir(&base, user)?;
    // The server's log is opened by pg_ctl as the server's user, so that user must own it.
    let log = base.join("shared.log");
    std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(&log, Some(uid), Some(gid))?;
    }
    let initdb_log = base.join("initdb.log");
    let reuse_data = cluster_usable(&bins, &data_dir);
    if !reuse_data {
        fresh_cluster(&bins, user, &data_dir, &initdb_log)?;
    }
    let started = pg_ctl_start(&bins, user, &base, &data_dir, &log, port);
    if let Err(e) = started {
        if !reuse_data {
            return Err(e);
        }
        // A cluster that will not start (corrupt after a host crash, say) holds only
        // disposable test databases: start over once.
        eprintln!("turnlog-testkit: shared Postgres would not start on its old data ({e:#}); recreating it");
        fresh_cluster(&bins, user, &data_dir, &initdb_log)?;
        pg_ctl_start(&bins, user, &base, &data_dir, &log, port)?;
    }
    let pid = postmaster_pid(&data_dir).context("postmaster.pid unreadable after start")?;
    state.postgres = Some(PgState { port, pid, data_dir });
    Ok(port)
}

/// Whether `data_dir` holds a cluster we finished creating, for this server version.
fn cluster_usable(bins: &PgBins, data_dir: &Path) -> bool {
    let complete = data_dir.with_extension("initialized").exists();
    let version = std::fs::read_to_string(data_dir.join("PG_VERSION")).unwrap_or_default();
    complete && version.trim() == bins.major
}

fn fresh_cluster(bins: &PgBins, user: Option<(u32, u32)>, data_dir: &Path, log: &Path) -> anyhow::Result<()> {
    let marker = data_dir.with_extension("initialized");
    let _ = std::fs::remove_file(&marker);
    if data_dir.exists() {
        std::fs::remove_dir_all(data_dir).with_context(|| format!("cannot remove {}", data_dir.display()))?;
    }
    postgres::initdb(bins, user, data_dir, log)?;
    // Written only after initdb succeeded, so an interrupted initdb is redone.
    std::fs::write(&marker, b"")?;
    Ok(())
}

fn pg_ctl_start(
    bins: &PgBins,
    user: Option<(u32, u32)>,
    base: &Path,
    data_dir: &Path,
    log: &Path,
    port: u16,
) -> anyhow::Result<()> {
    // A postmaster.pid left by a server killed without cleanup names a pid that may since
    // belong to another process, which would make Postgres refuse to start.
    if let Some(pid) = postmaster_pid(data_dir) {
        if !process_alive(pid, "postgres") {
            let _ = std::fs::remove_file(data_dir.join("postmaster.pid"));
        }
    }
    let ctl_log = base.join("pg_ctl.log");
    let ctl_log_file = std::fs::OpenOptions::new().create(true).append(true).open(&ctl_log)?;
    // pg_ctl's own output goes to a file, not a pipe: the server it forks must hold
    // nothing of the test process's, or the test runner would wait for it.
    let status = postgres::pg_command(bins, "pg_ctl", user, base)
        .arg("-D")
        .arg(data_dir)
        .arg("-l")
        .arg(log)
        .args(["-w", "-t", "60", "-o"])
        .arg(postgres::server_args(port, data_dir, false).join(" "))
        .arg("start")
        .stdin(std::process::Stdio::null())
        .stdout(ctl_log_file.try_clone()?)
        .stderr(ctl_log_file)
        .status()
        .context("cannot run pg_ctl")?;
    anyhow::ensure!(
        status.success(),
        "pg_ctl start failed ({status}); {}:\n{}\n{}:\n{}",
        ctl_log.display(),
        tail_lines(&ctl_log, 10),
        log.display(),
        tail_lines(log, 20)
    );
    Ok(())
}

fn postmaster_pid(data_dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
    text.lines().next()?.trim().parse().ok()
}

fn ensure_nats(dir: &Path, state: &mut State) -> anyhow::Result<u16> {
    if let Some(n) = &state.nats {
        if process_alive(n.pid, "nats-server") {
            if wait_accepting(n.port, Duration::from_secs(10)) {
                return Ok(n.port);
            }
            let _ = send_signal(n.pid, "KILL");
            wait_gone(n.pid, "nats-server", Duration::from_secs(5));
        }
    }
    let bin = nats::nats_server_bin()?;
    let preferred = state.nats.as_ref().map(|n| n.port).filter(|p| port_is_free(*p));
    let port = preferred.unwrap_or_else(free_port);
    let store = dir.join("nats");
    let log = dir.join("nats.log");
    let start = |store: &Path| -> anyhow::Result<u32> {
        std::fs::create_dir_all(store)?;
        let mut command = Command::new(&bin);
        command.args(nats::server_args(port, store));
        let pid = spawn_detached(command, &log)?;
        if !wait_accepting(port, Duration::from_secs(15)) {
            let _ = send_signal(pid, "KILL");
            anyhow::bail!(
                "nats-server not accepting on port {port}; {}:\n{}",
                log.display(),
                tail_lines(&log, 20)
            );
        }
        Ok(pid)
    };
    let pid = match start(&store) {
        Ok(pid) => pid,
        Err(e) => {
            // As with Postgres: a store that will not load holds only test streams.
            eprintln!(
                "turnlog-testkit: shared nats-server would not start ({e:#}); retrying with a new store"
            );
            let _ = std::fs::remove_dir_all(&store);
            start(&store)?
        }
    };
    state.nats = Some(NatsState { port, pid });
    Ok(port)
}

fn wait_gone(pid: u32, comm: &str, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while process_alive(pid, comm) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
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
                let user = postgres::server_user()?;
                let status = postgres::pg_command(&bins, "pg_ctl", user, &postgres::base_dir())
                    .arg("-D")
                    .arg(&pg.data_dir)
                    .args(["-m", "fast", "-w", "-t", "30", "stop"])
                    .stdout(std::process::Stdio::null())
                    .status()?;
                anyhow::ensure!(status.success(), "pg_ctl stop failed: {status}");
                Ok(())
            });
            if let Err(e) = stopped {
                eprintln!("turnlog-testkit: {e:#}; killing Postgres (pid {})", pg.pid);
                let _ = send_signal(pg.pid, "QUIT");
                wait_gone(pg.pid, "postgres", Duration::from_secs(10));
            }
            println!("stopped the shared private Postgres on port {}", pg.port);
        }
    }
    if let Some(n) = &state.nats {
        if process_alive(n.pid, "nats-server") {
            let _ = send_signal(n.pid, "TERM");
            wait_gone(n.pid, "nats-server", Duration::from_secs(10));
            if process_alive(n.pid, "nats-server") {
                let _ = send_signal(n.pid, "KILL");
            }
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
