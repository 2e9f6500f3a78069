//! The private PostgreSQL of a `turnlog dev` data directory: a cluster created once and
//! kept (with a marker written when complete, and a check that the installed version made
//! it), its settings in a file of ours included from postgresql.conf, started with
//! `pg_ctl` and stopped with a fast shutdown. The mechanics are turnlog-local-servers'.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use turnlog_local_servers::{self as local, PgBins};

/// The database `turnlog dev` keeps its log in.
const DATABASE: &str = "turnlog";

/// One cluster of a data directory and where its files go.
pub(crate) struct Cluster {
    cluster: local::Cluster,
    /// Owned by the server's user: the data directory, the server log, the settings.
    base: PathBuf,
    /// Where pg_ctl's own output goes.
    ctl_log: PathBuf,
}

impl Cluster {
    /// The cluster of the data directory `data_dir` (absolute). As root the cluster cannot
    /// live there (a path under /root is closed to `postgres`), so it goes to
    /// /var/tmp/turnlog-pg-<hash of data_dir>, which survives reboots as the data must.
    pub(crate) fn of(data_dir: &Path) -> anyhow::Result<Cluster> {
        let bins = PgBins::find()?;
        let user = local::postgres_user()?;
        let base = if user.is_some() {
            let hash =
                uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, data_dir.as_os_str().as_encoded_bytes());
            let short = hash.simple().to_string();
            PathBuf::from(format!("/var/tmp/turnlog-pg-{}", &short[..16]))
        } else {
            data_dir.join("postgres")
        };
        let cluster = local::Cluster::new(bins, user, base.join("data"));
        Ok(Cluster { cluster, base, ctl_log: data_dir.join("pg_ctl.log") })
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.cluster.data_dir().to_path_buf()
    }

    pub(crate) fn log_path(&self) -> PathBuf {
        self.base.join("postgres.log")
    }

    /// Whether a complete cluster exists (an interrupted initdb leaves none).
    pub(crate) fn exists(&self) -> bool {
        self.initialized_marker().exists()
    }

    fn initialized_marker(&self) -> PathBuf {
        self.base.join("initialized")
    }

    /// Deletes the cluster and everything in its directory.
    pub(crate) fn remove(&self) -> anyhow::Result<()> {
        if self.base.exists() {
            std::fs::remove_dir_all(&self.base)
                .with_context(|| format!("cannot remove {}", self.base.display()))?;
        }
        Ok(())
    }

    /// Creates the cluster unless it exists: the directory owned by the server's user,
    /// initdb, our settings file included from postgresql.conf, and a note naming the
    /// turnlog data directory it belongs to.
    pub(crate) fn ensure_created(&self, owner_note: &Path) -> anyhow::Result<()> {
        let major = &self.cluster.bins().major;
        if self.exists() {
            let version = self.cluster.data_version().unwrap_or_default();
            anyhow::ensure!(
                &version == major,
                "the Postgres data in {} was made by PostgreSQL {version}, but {major} is installed: \
                 upgrade it with pg_upgrade, or remove {} (and the turnlog data directory) to start afresh",
                self.data_dir().display(),
                self.base.display()
            );
            return Ok(());
        }
        // No marker: nothing here ever held data (the marker is written before the first
        // start), so a half-made cluster can go.
        self.remove()?;
        local::make_owned_dir(&self.base, self.cluster.user())?;
        let dir = self.data_dir();
        tracing::info!(dir = %dir.display(), version = %major, "creating the private Postgres cluster");
        self.cluster.initdb(&self.base.join("initdb.log"), true)?;
        let conf = dir.join("postgresql.conf");
        let mut text =
            std::fs::read_to_string(&conf).with_context(|| format!("cannot read {}", conf.display()))?;
        text.push_str("\n# turnlog dev: port, addresses and limits, rewritten at every start.\n");
        text.push_str("include = 'turnlog.conf'\n");
        std::fs::write(&conf, text).with_context(|| format!("cannot write {}", conf.display()))?;
        std::fs::write(self.base.join("turnlog-data-dir"), owner_note.as_os_str().as_encoded_bytes())?;
        std::fs::write(self.initialized_marker(), b"")?;
        Ok(())
    }

    /// The port of a server already running on this cluster (left by a `turnlog dev` that
    /// was killed): it is adopted rather than started twice.
    pub(crate) fn running_port(&self) -> Option<u16> {
        self.cluster.running()?.port
    }

    /// Starts the server on `port` (loopback only) and waits until it accepts connections.
    pub(crate) fn start(&self, port: u16) -> anyhow::Result<()> {
        self.write_settings(port)?;
        self.cluster.start(&self.log_path(), &self.ctl_log, Duration::from_secs(120), &[])
    }

    /// Fast shutdown: open sessions are disconnected, a checkpoint is written.
    pub(crate) fn stop(&self) -> anyhow::Result<()> {
        self.cluster.stop(&self.ctl_log, Duration::from_secs(60))
    }

    /// Loopback TCP only: no Unix socket, whose directory may be closed to us (the
    /// system's) or too long a path (a deep data directory), and which turnlog never uses;
    /// room for every service's pool.
    fn write_settings(&self, port: u16) -> anyhow::Result<()> {
        let text = format!(
            "# Written by turnlog dev at every start.\n\
             port = {port}\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = ''\n\
             max_connections = 200\n"
        );
        let path = self.data_dir().join("turnlog.conf");
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        self.cluster.chown(&path)
    }
}

/// The URL of the turnlog database on the private server at `port`, creating the database
/// on first use. Retries while the server is still coming up.
pub(crate) async fn ensure_database(port: u16) -> anyhow::Result<String> {
    local::ensure_database(&local::local_url(port, "postgres"), DATABASE, Duration::from_secs(30))
        .await
        .with_context(|| format!("the private Postgres on port {port}"))?;
    Ok(local::local_url(port, DATABASE))
}
