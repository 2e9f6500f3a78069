//! The testkit's PostgreSQL policy: where its clusters live, the settings that make a
//! server fast for tests, and [`PrivatePostgres`], a per-test server on a fixed port. The
//! mechanics (binaries, the `postgres` user when root, initdb) are turnlog-local-servers'.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::Connection;
use turnlog_local_servers::{
    current_uid, is_root, local_url, make_owned_dir, postgres_user, Cluster, PgBins,
};

use crate::netns::TestHost;
use crate::process::ExternalProcess;
use crate::util::random_alnum;

/// Where our clusters live: a directory the server's user owns and can reach (a path
/// under /root would not be reachable by `postgres`).
pub(crate) fn base_dir() -> PathBuf {
    if is_root() {
        PathBuf::from("/var/tmp/turnlog-testkit-pg")
    } else {
        PathBuf::from(format!("/var/tmp/turnlog-testkit-{}/pg", current_uid()))
    }
}

/// Set (to anything) to load `pg_stat_statements` into the testkit's Postgres servers.
pub const STATEMENTS_VAR: &str = "TURNLOG_TESTKIT_PG_STATEMENTS";

/// Server settings: loopback only on `port`, the socket in the data directory, and no
/// work against machine crashes (a test database is disposable; speed matters on small
/// machines). `crash_safe_commits` keeps `synchronous_commit` on, so a commit survives a
/// crash of the server *process* (the OS still has the written WAL without fsync): fault
/// tests kill the server and must find every acknowledged commit.
pub(crate) fn server_args(port: u16, data_dir: &Path, crash_safe_commits: bool) -> Vec<String> {
    let mut args = vec!["-p".to_owned(), port.to_string()];
    for setting in [
        "listen_addresses=127.0.0.1".to_owned(),
        format!("unix_socket_directories={}", data_dir.display()),
        "fsync=off".to_owned(),
        format!("synchronous_commit={}", if crash_safe_commits { "on" } else { "off" }),
        "full_page_writes=off".to_owned(),
        "max_connections=300".to_owned(),
    ] {
        args.push("-c".to_owned());
        args.push(setting);
    }
    // For a benchmark that lists where the server's time goes (`crate::statements`).
    if std::env::var_os(STATEMENTS_VAR).is_some() {
        for setting in ["shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track_planning=on"]
        {
            args.extend(["-c".to_owned(), setting.to_owned()]);
        }
    }
    args
}

/// A Postgres server of one test's own, on a fixed port, for fault tests (restart it under
/// a running service, crash it). Distinct from the shared once-per-run server; stopped and
/// its data deleted when dropped. Unlike the shared server, commits are crash-safe (a
/// commit is acknowledged after its WAL is written), so a killed server loses nothing it
/// acknowledged.
///
/// ```ignore
/// let mut pg = private_postgres(free_port()).await;
/// let env = test_env_on(Some(&pg.url()), None).await;
/// pg.restart().await;   // same port, same data
/// ```
#[derive(Debug)]
pub struct PrivatePostgres {
    port: u16,
    data_dir: PathBuf,
    process: ExternalProcess,
}

/// Creates a cluster (initdb, about a second) and starts it on `port`, waiting until it
/// accepts queries. Panics with a clear message when it cannot.
pub async fn private_postgres(port: u16) -> PrivatePostgres {
    start_private(port, None).await
}

/// [`private_postgres`] that a [`TestHost`] reaches too: it also listens on this machine's
/// address on the host's link, and trusts logins from the host.
pub async fn private_postgres_for(port: u16, host: &TestHost) -> PrivatePostgres {
    start_private(port, Some(host)).await
}

async fn start_private(port: u16, host: Option<&TestHost>) -> PrivatePostgres {
    let cluster = match tokio::task::spawn_blocking(move || new_cluster(port)).await {
        Ok(Ok(cluster)) => cluster,
        Ok(Err(e)) => panic!("turnlog-testkit: cannot create a private Postgres: {e:#}"),
        Err(e) => panic!("turnlog-testkit: cannot create a private Postgres: {e}"),
    };
    let data_dir = cluster.data_dir().to_path_buf();
    let mut args = server_args(port, &data_dir, true);
    if let Some(host) = host {
        let hba = data_dir.join("pg_hba.conf");
        let trust = format!("host all all {}/32 trust\n", host.addr());
        if let Err(e) = std::fs::OpenOptions::new().append(true).open(&hba).and_then(|mut f| {
            use std::io::Write as _;
            f.write_all(trust.as_bytes())
        }) {
            panic!("turnlog-testkit: cannot write {}: {e}", hba.display());
        }
        // A later setting wins over the loopback-only one.
        args.extend(["-c".to_owned(), format!("listen_addresses=127.0.0.1,{}", host.local_addr())]);
    }
    let process = ExternalProcess::new(&format!("postgres-{port}"), cluster.bins().bin("postgres"))
        .arg("-D")
        .arg(&data_dir)
        .args(args)
        .current_dir(cluster.base())
        .run_as(cluster.user());
    let mut pg = PrivatePostgres { port, data_dir, process };
    pg.start().await;
    pg
}

/// A new cluster in a directory of its own under [`base_dir`].
fn new_cluster(port: u16) -> anyhow::Result<Cluster> {
    let user = postgres_user()?;
    let base = base_dir();
    make_owned_dir(&base, user)?;
    let data_dir = base.join(format!("private-{port}-{}", random_alnum(8)));
    let cluster = Cluster::new(PgBins::find()?, user, data_dir);
    let log = std::env::temp_dir().join(format!("turnlog-testkit-initdb-{}.log", random_alnum(8)));
    cluster.initdb(&log, false)?;
    let _ = std::fs::remove_file(&log);
    Ok(cluster)
}

impl PrivatePostgres {
    /// `postgres://postgres@127.0.0.1:<port>/postgres` — the admin database, to pass to
    /// [`test_env_on`](crate::test_env_on).
    pub fn url(&self) -> String {
        local_url(self.port, "postgres")
    }

    /// The URL of `database` as a [`TestHost`] reaches it (see [`private_postgres_for`]).
    pub fn url_from(&self, host: &TestHost, database: &str) -> String {
        format!("postgres://postgres@{}:{}/{database}", host.local_addr(), self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn log_path(&self) -> &Path {
        self.process.log_path()
    }

    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// Starts the server if it is not running and waits (up to 30 s) until it answers a
    /// query; after [`kill`](Self::kill) this runs crash recovery first.
    pub async fn start(&mut self) {
        let url = self.url();
        let what = format!("private Postgres on port {}", self.port);
        self.process
            .start_until_ready(&what, Duration::from_secs(30), || async {
                // Postgres accepts TCP before it can serve ("the database system is
                // starting up"), so readiness is a completed login.
                let attempt =
                    tokio::time::timeout(Duration::from_secs(2), sqlx::PgConnection::connect(&url)).await;
                match attempt {
                    Ok(Ok(conn)) => {
                        let _ = conn.close().await;
                        true
                    }
                    _ => false,
                }
            })
            .await;
    }

    /// Fast shutdown (SIGINT: sessions are disconnected, a checkpoint is written), then a
    /// start on the same port with the same data.
    pub async fn restart(&mut self) {
        if self.process.is_running() {
            self.process.cont();
            self.process.signal("INT");
            if self.process.wait_exit(Duration::from_secs(30)).await.is_none() {
                self.process.kill();
            }
        }
        self.start().await;
    }

    /// A crash as clients see it: immediate shutdown (SIGQUIT: every connection drops, no
    /// checkpoint; the next start runs crash recovery). Not SIGKILL of the postmaster, whose
    /// orphaned backends could keep a restart from starting. Waits until it has exited.
    pub fn kill(&mut self) {
        immediate_shutdown(&mut self.process);
    }
}

fn immediate_shutdown(process: &mut ExternalProcess) {
    if !process.is_running() {
        return;
    }
    process.cont();
    process.signal("QUIT");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while process.is_running() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    process.kill();
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        immediate_shutdown(&mut self.process);
        // Only our own random directory is removed; a panic here would hide the test's.
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}
