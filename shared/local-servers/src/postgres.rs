//! Running PostgreSQL of our own: the server binaries (Debian keeps them in
//! `/usr/lib/postgresql/<v>/bin`), the user to run them as (Postgres refuses root, so as root
//! it runs as `postgres`, in a directory that user owns and can reach), and a [`Cluster`]:
//! initdb, `pg_ctl start`/`stop`, the postmaster of a server already running.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use sqlx::Connection as _;

use crate::os::{self, RunAs};

const MISSING: &str = "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found under \
    /usr/lib/postgresql/<version>/bin or on PATH: install the Debian package `postgresql` \
    (apt-get install postgresql), or set DATABASE_URL to a server of your own";

/// Where initdb, pg_ctl and postgres are, and their major version.
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

/// Who runs Postgres: the `postgres` user when we are root (Postgres refuses to run as
/// root), `None` (ourselves) otherwise.
pub fn postgres_user() -> anyhow::Result<Option<RunAs>> {
    if !os::is_root() {
        return Ok(None);
    }
    let user = RunAs::user("postgres")?.context(
        "running as root, and Postgres refuses to: there is no `postgres` user to run it as; \
         install the Debian package `postgresql` (it creates the user), or set DATABASE_URL",
    )?;
    Ok(Some(user))
}

/// Creates `dir` (mode 0700) owned by `user` when given, for a cluster to live in.
pub fn make_owned_dir(dir: &Path, user: Option<RunAs>) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if let Some(user) = user {
        user.chown(dir)?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(())
}

/// URL of database `database` as superuser `postgres` on 127.0.0.1:`port`.
pub fn local_url(port: u16, database: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/{database}")
}

/// The postmaster of a cluster as its `postmaster.pid` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Postmaster {
    pub pid: u32,
    /// `None` while the server has not written it yet.
    pub port: Option<u16>,
}

impl Postmaster {
    /// What `data_dir/postmaster.pid` records, whether or not that server still lives.
    pub fn read(data_dir: &Path) -> Option<Postmaster> {
        let text = std::fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
        let mut lines = text.lines();
        let pid = lines.next()?.trim().parse().ok()?;
        // Line 4 of postmaster.pid is the port.
        let port = lines.nth(2).and_then(|l| l.trim().parse().ok());
        Some(Postmaster { pid, port })
    }

    pub fn alive(&self) -> bool {
        os::process_alive(self.pid, "postgres")
    }
}

/// An immediate shutdown of the postmaster `pid` (SIGQUIT: connections drop, no
/// checkpoint), SIGKILL if it is not gone within 10 s.
pub fn kill_postmaster(pid: u32) {
    if !os::process_alive(pid, "postgres") {
        return;
    }
    let _ = os::signal(pid, nix::sys::signal::Signal::SIGQUIT);
    if !os::wait_gone(pid, "postgres", Duration::from_secs(10)) {
        let _ = os::signal(pid, nix::sys::signal::Signal::SIGKILL);
        os::wait_gone(pid, "postgres", Duration::from_secs(5));
    }
}

/// One cluster: its binaries, the user it runs as, and its data directory, whose parent
/// the server's user must own (the binaries run from there: the caller's working
/// directory may be closed to that user).
#[derive(Debug, Clone)]
pub struct Cluster {
    bins: PgBins,
    user: Option<RunAs>,
    data_dir: PathBuf,
}

impl Cluster {
    pub fn new(bins: PgBins, user: Option<RunAs>, data_dir: PathBuf) -> Cluster {
        Cluster { bins, user, data_dir }
    }

    pub fn bins(&self) -> &PgBins {
        &self.bins
    }

    pub fn user(&self) -> Option<RunAs> {
        self.user
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Where the binaries run: the data directory's parent.
    pub fn base(&self) -> &Path {
        self.data_dir.parent().unwrap_or(Path::new("/"))
    }

    /// The major version that made the data directory, if there is one.
    pub fn data_version(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.data_dir.join("PG_VERSION")).ok()?;
        Some(text.trim().to_owned())
    }

    /// Hands `path` to the server's user (a no-op when that is us).
    pub fn chown(&self, path: &Path) -> anyhow::Result<()> {
        match self.user {
            Some(user) => user.chown(path),
            None => Ok(()),
        }
    }

    /// A server binary, run as the server's user from the data directory's parent, in a
    /// process group of its own so signals to the caller's group (a terminal's Ctrl-C, a
    /// test runner's timeout) miss the server, which its owner stops itself.
    pub fn command(&self, name: &str) -> Command {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(self.bins.bin(name));
        command.current_dir(self.base()).process_group(0).stdin(Stdio::null());
        if let Some(user) = self.user {
            user.apply(&mut command);
        }
        command
    }

    /// `initdb` into the data directory (which must not exist yet): trust auth, superuser
    /// `postgres`, UTF-8, C locale. Not `durable` adds `--no-sync` (disposable data).
    /// Output goes to `log`.
    pub fn initdb(&self, log: &Path, durable: bool) -> anyhow::Result<()> {
        let log_file = os::append_log(log)?;
        let mut command = self.command("initdb");
        command.arg("-D").arg(&self.data_dir).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
        ]);
        if !durable {
            command.arg("--no-sync");
        }
        let status =
            command.stdout(log_file.try_clone()?).stderr(log_file).status().context("cannot run initdb")?;
        anyhow::ensure!(status.success(), "initdb failed ({status}):\n{}", os::tail_lines(log, 20));
        Ok(())
    }

    /// The live postmaster of this cluster (a server an earlier run left, to adopt rather
    /// than start twice). A stale `postmaster.pid`, whose pid may since belong to another
    /// process and would make Postgres refuse to start, is removed.
    pub fn running(&self) -> Option<Postmaster> {
        let postmaster = Postmaster::read(&self.data_dir)?;
        if !postmaster.alive() {
            let _ = std::fs::remove_file(self.data_dir.join("postmaster.pid"));
            return None;
        }
        Some(postmaster)
    }

    /// `pg_ctl start`, waiting up to `wait` until the server accepts connections; the
    /// server logs to `server_log` (which the server's user must be able to write), pg_ctl
    /// to `ctl_log` (a file, not a pipe: the server pg_ctl starts must hold nothing of
    /// this process's). `options` are passed to the server.
    pub fn start(
        &self,
        server_log: &Path,
        ctl_log: &Path,
        wait: Duration,
        options: &[String],
    ) -> anyhow::Result<()> {
        // Clears a stale postmaster.pid.
        self.running();
        let mut args: Vec<OsString> = vec!["-l".into(), server_log.into()];
        if !options.is_empty() {
            args.extend(["-o".into(), options.join(" ").into()]);
        }
        args.push("start".into());
        self.pg_ctl(&args, ctl_log, wait, Some(server_log))
    }

    /// Fast shutdown (open sessions are disconnected, a checkpoint is written), waiting up
    /// to `wait`; pg_ctl's output goes to `ctl_log`.
    pub fn stop(&self, ctl_log: &Path, wait: Duration) -> anyhow::Result<()> {
        self.pg_ctl(&["-m".into(), "fast".into(), "stop".into()], ctl_log, wait, None)
    }

    /// `pg_ctl -D <data> -w -t <wait> <args>`, its output appended to `ctl_log`; a failure
    /// quotes the tail of that and of `server_log`.
    fn pg_ctl(
        &self,
        args: &[OsString],
        ctl_log: &Path,
        wait: Duration,
        server_log: Option<&Path>,
    ) -> anyhow::Result<()> {
        let ctl_file = os::append_log(ctl_log)?;
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-w", "-t", &wait.as_secs().to_string()])
            .args(args)
            .stdout(ctl_file.try_clone()?)
            .stderr(ctl_file)
            .status()
            .context("cannot run pg_ctl")?;
        if status.success() {
            return Ok(());
        }
        let action = args.last().map(|a| a.to_string_lossy()).unwrap_or_default();
        let mut message = format!(
            "pg_ctl {action} failed ({status}); {}:\n{}",
            ctl_log.display(),
            os::tail_lines(ctl_log, 10)
        );
        if let Some(log) = server_log {
            message.push_str(&format!("\n{}:\n{}", log.display(), os::tail_lines(log, 20)));
        }
        anyhow::bail!(message)
    }
}

/// Creates `database` through `admin_url` unless it exists, retrying the connection for up
/// to `timeout` while the server is still coming up.
pub async fn ensure_database(admin_url: &str, database: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut conn = loop {
        match sqlx::PgConnection::connect(admin_url).await {
            Ok(conn) => break conn,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(e).context("cannot connect to the private Postgres");
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(database)
        .fetch_one(&mut conn)
        .await?;
    if !exists {
        // CREATE DATABASE cannot run in a transaction; raw_sql uses the simple protocol.
        sqlx::raw_sql(&format!("CREATE DATABASE \"{database}\"")).execute(&mut conn).await?;
    }
    let _ = conn.close().await;
    Ok(())
}
