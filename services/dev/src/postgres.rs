//! The private PostgreSQL of a `turnlog dev` data directory: the server binaries (Debian
//! keeps them in /usr/lib/postgresql/<v>/bin), a cluster created once and kept, started
//! with `pg_ctl` and stopped with `pg_ctl stop -m fast`. Postgres refuses to run as root, so
//! as root it runs as the `postgres` user, in a directory that user owns and can reach.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use nix::unistd::{Gid, Uid};
use sqlx::Connection as _;

use crate::os;

const MISSING: &str = "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found under \
    /usr/lib/postgresql/<version>/bin or on PATH: install the Debian package `postgresql` \
    (apt-get install postgresql), or set DATABASE_URL to a server of your own";

/// The database `turnlog dev` keeps its log in.
const DATABASE: &str = "turnlog";

/// Where initdb, pg_ctl and postgres are, and their major version (the testkit's private
/// servers use it too).
#[derive(Debug, Clone)]
pub struct PgBins {
    pub dir: PathBuf,
    /// Major version, to notice a data directory made by another one.
    pub major: String,
}

impl PgBins {
    /// The highest version under /usr/lib/postgresql (Debian's layout), else `PATH`.
    pub fn find() -> anyhow::Result<PgBins> {
        let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
                    .filter(|(_, bin)| Self::complete(bin))
                    .collect()
            })
            .unwrap_or_default();
        versions.sort();
        if let Some((major, dir)) = versions.pop() {
            return Ok(PgBins { dir, major: major.to_string() });
        }
        let pg_ctl = os::find_executable("pg_ctl").context(MISSING)?;
        // Debian's /usr/bin/pg_ctl is a wrapper script and /usr/local/bin may hold links:
        // `postgres` is looked up beside the real binary.
        let dir = std::fs::canonicalize(&pg_ctl)?.parent().map(Path::to_path_buf).context(MISSING)?;
        anyhow::ensure!(Self::complete(&dir), "{MISSING}");
        let out = Command::new(dir.join("postgres")).arg("--version").output()?;
        // "postgres (PostgreSQL) 15.8 (Debian 15.8-1)" → "15"
        let version = String::from_utf8_lossy(&out.stdout);
        let major = version
            .split_whitespace()
            .nth(2)
            .and_then(|v| v.split('.').next())
            .context("cannot read the version of postgres")?
            .to_owned();
        Ok(PgBins { dir, major })
    }

    fn complete(dir: &Path) -> bool {
        ["initdb", "pg_ctl", "postgres"].iter().all(|b| os::is_executable(&dir.join(b)))
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// One cluster: its binaries, the user it runs as, and where it lives.
pub(crate) struct Cluster {
    bins: PgBins,
    /// `Some` when we are root: the `postgres` user's uid and gid.
    user: Option<(Uid, Gid)>,
    /// Owned by the server's user: the data directory, the server log, the settings.
    base: PathBuf,
    /// Where pg_ctl's own output goes (a file of ours, not a pipe: the server pg_ctl starts
    /// must hold nothing of this process's).
    ctl_log: PathBuf,
}

impl Cluster {
    /// The cluster of the data directory `data_dir` (absolute). As root the cluster cannot
    /// live there (a path under /root is closed to `postgres`), so it goes to
    /// /var/tmp/turnlog-pg-<hash of data_dir>, which survives reboots as the data must.
    pub(crate) fn of(data_dir: &Path) -> anyhow::Result<Cluster> {
        let bins = PgBins::find()?;
        let (user, base) = if os::is_root() {
            let user = os::lookup_user("postgres")?.context(
                "running as root, and Postgres refuses to: there is no `postgres` user to run it as; \
                 install the Debian package `postgresql` (it creates the user), or set DATABASE_URL",
            )?;
            let hash =
                uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, data_dir.as_os_str().as_encoded_bytes());
            let short = hash.simple().to_string();
            (Some(user), PathBuf::from(format!("/var/tmp/turnlog-pg-{}", &short[..16])))
        } else {
            (None, data_dir.join("postgres"))
        };
        Ok(Cluster { bins, user, base, ctl_log: data_dir.join("pg_ctl.log") })
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.base.join("data")
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
        if self.exists() {
            let version = std::fs::read_to_string(self.data_dir().join("PG_VERSION")).unwrap_or_default();
            anyhow::ensure!(
                version.trim() == self.bins.major,
                "the Postgres data in {} was made by PostgreSQL {}, but {} is installed: upgrade it \
                 with pg_upgrade, or remove {} (and the turnlog data directory) to start afresh",
                self.data_dir().display(),
                version.trim(),
                self.bins.major,
                self.base.display()
            );
            return Ok(());
        }
        // No marker: nothing here ever held data (the marker is written before the first
        // start), so a half-made cluster can go.
        self.remove()?;
        self.make_owned_dir()?;
        let (dir, version) = (self.data_dir(), &self.bins.major);
        tracing::info!(dir = %dir.display(), %version, "creating the private Postgres cluster");
        let initdb_log = self.base.join("initdb.log");
        let log_file = os::append_log(&initdb_log)?;
        let status = self
            .command("initdb")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C"])
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .status()
            .context("cannot run initdb")?;
        anyhow::ensure!(status.success(), "initdb failed ({status}):\n{}", os::tail_lines(&initdb_log, 20));
        let conf = self.data_dir().join("postgresql.conf");
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
    /// was killed): it is adopted rather than started twice. A stale `postmaster.pid`
    /// (whose pid may since belong to another process, which would make Postgres refuse
    /// to start) is removed.
    pub(crate) fn running_port(&self) -> Option<u16> {
        let pid_file = self.data_dir().join("postmaster.pid");
        let text = std::fs::read_to_string(&pid_file).ok()?;
        let mut lines = text.lines();
        let pid: u32 = lines.next()?.trim().parse().ok()?;
        if !os::process_alive(pid, "postgres") {
            let _ = std::fs::remove_file(&pid_file);
            return None;
        }
        // Line 4 of postmaster.pid is the port.
        lines.nth(2)?.trim().parse().ok()
    }

    /// Starts the server on `port` (loopback only) and waits until it accepts connections.
    pub(crate) fn start(&self, port: u16) -> anyhow::Result<()> {
        self.write_settings(port)?;
        let ctl_log = os::append_log(&self.ctl_log)?;
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", "120", "start"])
            .stdin(Stdio::null())
            .stdout(ctl_log.try_clone()?)
            .stderr(ctl_log)
            .status()
            .context("cannot run pg_ctl")?;
        anyhow::ensure!(
            status.success(),
            "pg_ctl start failed ({status}); {}:\n{}\n{}:\n{}",
            self.ctl_log.display(),
            os::tail_lines(&self.ctl_log, 10),
            self.log_path().display(),
            os::tail_lines(&self.log_path(), 20)
        );
        Ok(())
    }

    /// Fast shutdown: open sessions are disconnected, a checkpoint is written.
    pub(crate) fn stop(&self) -> anyhow::Result<()> {
        let ctl_log = os::append_log(&self.ctl_log)?;
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", "fast", "-w", "-t", "60", "stop"])
            .stdin(Stdio::null())
            .stdout(ctl_log.try_clone()?)
            .stderr(ctl_log)
            .status()
            .context("cannot run pg_ctl")?;
        anyhow::ensure!(
            status.success(),
            "pg_ctl stop failed ({status}); {}:\n{}",
            self.ctl_log.display(),
            os::tail_lines(&self.ctl_log, 10)
        );
        Ok(())
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
        self.chown(&path)
    }

    fn make_owned_dir(&self) -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(&self.base)
            .with_context(|| format!("cannot create {}", self.base.display()))?;
        self.chown(&self.base)?;
        std::fs::set_permissions(&self.base, std::fs::Permissions::from_mode(0o700))?;
        Ok(())
    }

    fn chown(&self, path: &Path) -> anyhow::Result<()> {
        if let Some((uid, gid)) = self.user {
            std::os::unix::fs::chown(path, Some(uid.as_raw()), Some(gid.as_raw()))
                .with_context(|| format!("cannot hand {} to the postgres user", path.display()))?;
        }
        Ok(())
    }

    /// A server binary, run as the server's user from a directory it can enter, in a
    /// process group of its own so the terminal's Ctrl-C reaches only `turnlog dev`,
    /// which stops the server itself, last.
    fn command(&self, name: &str) -> Command {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(self.bins.bin(name));
        command.current_dir(&self.base).process_group(0);
        if let Some((uid, gid)) = self.user {
            // std drops root's supplementary groups before switching.
            command.uid(uid.as_raw()).gid(gid.as_raw());
        }
        command
    }
}

/// The URL of the turnlog database on the private server at `port`, creating the database
/// on first use. Retries while the server is still coming up.
pub(crate) async fn ensure_database(port: u16) -> anyhow::Result<String> {
    let admin = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut conn = loop {
        match sqlx::PgConnection::connect(&admin).await {
            Ok(conn) => break conn,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(e).context(format!("cannot connect to the private Postgres on port {port}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(DATABASE)
        .fetch_one(&mut conn)
        .await?;
    if !exists {
        sqlx::query(&format!("CREATE DATABASE {DATABASE}")).execute(&mut conn).await?;
    }
    let _ = conn.close().await;
    Ok(format!("postgres://postgres@127.0.0.1:{port}/{DATABASE}"))
}
