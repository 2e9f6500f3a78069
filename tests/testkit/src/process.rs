//! Child processes a test controls: [`ExternalProcess`] (any program, output appended to a
//! log file, signals, restart with the same arguments, killed on drop) and
//! [`TurnlogProcess`], a `turnlog <subcommand>` wired to a [`TestEnv`].

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;

use turnlog_local_servers::{append_log, current_uid, tail_lines, RunAs, Signal};

use crate::env::TestEnv;
use crate::util::random_alnum;

/// How many log lines a failing test prints for each of its processes.
const TAIL_ON_FAILURE: usize = 40;

/// Where every process log goes: one file per process, kept after the test so a failure
/// can be read at leisure (the sweep removes them after a day). One directory per user, as
/// the temp directory is shared.
pub(crate) fn log_dir() -> PathBuf {
    std::env::temp_dir().join(format!("turnlog-testkit-logs-{}", current_uid()))
}

/// A child process with its output in a log file. Start it with [`ExternalProcess::start`];
/// it is SIGKILLed when dropped, and when a test panics its log path and tail are printed.
///
/// ```ignore
/// let mut sleeper = ExternalProcess::new("sleeper", "/bin/sleep").arg("30");
/// sleeper.start()?;
/// sleeper.stop();   // SIGSTOP
/// sleeper.cont();   // SIGCONT
/// sleeper.kill();   // SIGKILL, reaped
/// ```
#[derive(Debug)]
pub struct ExternalProcess {
    name: String,
    program: PathBuf,
    args: Vec<OsString>,
    envs: Vec<(OsString, Option<OsString>)>,
    current_dir: Option<PathBuf>,
    /// The user to run as (Postgres refuses to run as root).
    user: Option<RunAs>,
    log_path: PathBuf,
    child: Option<Child>,
    last_pid: u32,
}

impl ExternalProcess {
    /// Describes a process; nothing runs until [`start`](Self::start). `name` labels the log
    /// file and messages.
    pub fn new(name: &str, program: impl Into<PathBuf>) -> ExternalProcess {
        let safe_name: String =
            name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        ExternalProcess {
            name: name.to_owned(),
            program: program.into(),
            args: Vec::new(),
            envs: Vec::new(),
            current_dir: None,
            user: None,
            log_path: log_dir().join(format!("{safe_name}-{}.log", random_alnum(8))),
            child: None,
            last_pid: 0,
        }
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> ExternalProcess {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> ExternalProcess
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets an environment variable for the child (on top of this process's environment).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> ExternalProcess {
        self.envs.push((key.as_ref().to_owned(), Some(value.as_ref().to_owned())));
        self
    }

    /// Removes an inherited environment variable from the child's environment.
    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> ExternalProcess {
        self.envs.push((key.as_ref().to_owned(), None));
        self
    }

    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> ExternalProcess {
        self.current_dir = Some(dir.into());
        self
    }

    /// Runs the child as another user (only root may); see [`RunAs::apply`].
    pub(crate) fn run_as(mut self, user: Option<RunAs>) -> ExternalProcess {
        self.user = user;
        self
    }

    /// Starts the process (again, after it exited), appending its stdout and stderr to
    /// the log file. Starting one that is running is an error.
    pub fn start(&mut self) -> anyhow::Result<()> {
        if self.is_running() {
            anyhow::bail!("{} is already running (pid {})", self.name, self.last_pid);
        }
        let mut log = append_log(&self.log_path)?;
        let command_line = std::iter::once(self.program.as_os_str())
            .chain(self.args.iter().map(OsString::as_os_str))
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        let mut command = Command::new(&self.program);
        command.args(&self.args).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log.try_clone()?);
        for (key, value) in &self.envs {
            match value {
                Some(value) => command.env(key, value),
                None => command.env_remove(key),
            };
        }
        if let Some(dir) = &self.current_dir {
            command.current_dir(dir);
        }
        if let Some(user) = self.user {
            user.apply(&mut command);
        }
        let child = command.spawn().with_context(|| format!("cannot start {}: {command_line}", self.name))?;
        self.last_pid = child.id();
        // The header goes in after the spawn so it can name the pid; the child's first
        // lines may precede it, which is harmless.
        let _ = writeln!(
            log,
            "=== turnlog-testkit: started {} (pid {}) at {}s: {command_line}",
            self.name,
            self.last_pid,
            unix_now()
        );
        self.child = Some(child);
        Ok(())
    }

    /// The pid of the current (or, once it exited, the last) run; 0 before the first.
    pub fn pid(&self) -> u32 {
        self.last_pid
    }

    /// Whether the process has been started and has not exited (a stopped one is running).
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// SIGKILL, then reap. No-op when not running.
    pub fn kill(&mut self) {
        if let Some(child) = &mut self.child {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// Starts the process unless it is running, then polls `ready` every 50 ms for up to
    /// `timeout`; panics naming `what`, with the log's tail, when the process exits first
    /// or is not ready in time.
    pub(crate) async fn start_until_ready<F, Fut>(&mut self, what: &str, timeout: Duration, mut ready: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        if !self.is_running() {
            if let Err(e) = self.start() {
                panic!("turnlog-testkit: {e:#}");
            }
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if !self.is_running() {
                panic!(
                    "turnlog-testkit: {what} exited while starting (port taken?); log {}:\n{}",
                    self.log_path.display(),
                    self.log_tail(30)
                );
            }
            if ready().await {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "turnlog-testkit: {what} not ready after {timeout:?}; log {}:\n{}",
                    self.log_path.display(),
                    self.log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends SIGTERM and returns at once; follow with [`wait_exit`](Self::wait_exit).
    pub fn terminate(&mut self) {
        self.signal("TERM");
    }

    /// SIGSTOP: the process freezes (its sockets stay open, nothing answers). Returns once
    /// every thread is stopped: a signal reaches a busy process's threads one by one, and
    /// one still running could answer a request sent right after.
    pub fn stop(&mut self) {
        self.signal("STOP");
        let tasks = format!("/proc/{}/task", self.last_pid);
        let stopped = || {
            let Ok(entries) = std::fs::read_dir(&tasks) else { return true };
            entries.flatten().all(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state follows the parenthesized command name.
                stat.rsplit_once(") ").is_none_or(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
            })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while !stopped() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONT after [`stop`](Self::stop).
    pub fn cont(&mut self) {
        self.signal("CONT");
    }

    /// Sends a signal by name (`TERM`, `INT`, `QUIT`, `HUP`, …) if the process is running.
    /// Only an unreaped child is signalled, so a recycled pid is never hit.
    pub fn signal(&mut self, name: &str) {
        if self.is_running() {
            let sent = format!("SIG{name}")
                .parse::<Signal>()
                .map_err(|e| anyhow::anyhow!("no signal {name}: {e}"))
                .and_then(|signal| turnlog_local_servers::signal(self.last_pid, signal));
            if let Err(e) = sent {
                panic!("turnlog-testkit: signalling {} failed: {e:#}", self.name);
            }
        }
    }

    /// Waits up to `timeout` for the process to exit; its status, or `None` if it is still
    /// running (or was never started).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.child.as_mut().map(Child::try_wait) {
                None | Some(Err(_)) => return None,
                Some(Ok(Some(status))) => return Some(status),
                Some(Ok(None)) if tokio::time::Instant::now() >= deadline => return None,
                Some(Ok(None)) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// Stops the process gracefully: SIGCONT (a stopped process cannot act on SIGTERM),
    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub async fn shutdown(&mut self, grace: Duration) -> Option<ExitStatus> {
        if !self.is_running() {
            return self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        }
        self.cont();
        self.terminate();
        if let Some(status) = self.wait_exit(grace).await {
            return Some(status);
        }
        self.kill();
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Graceful [`shutdown`](Self::shutdown) (10 s grace) if running, then a new run with
    /// the same program, arguments and environment, appending to the same log. For a
    /// crash-restart, [`kill`](Self::kill) first.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.shutdown(Duration::from_secs(10)).await;
        self.start()
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        tail_lines(&self.log_path, n)
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ExternalProcess {
    fn drop(&mut self) {
        if self.child.is_none() {
            return;
        }
        if std::thread::panicking() {
            eprintln!(
                "--- turnlog-testkit: {} (pid {}) log: {}\n{}\n--- end of {} log",
                self.name,
                self.last_pid,
                self.log_path.display(),
                self.log_tail(TAIL_ON_FAILURE),
                self.name
            );
        }
        self.kill();
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A `turnlog <subcommand> [args]` child process running against a [`TestEnv`]: the
/// environment's DATABASE_URL, NATS_URL and TURNLOG_BUS_PREFIX plus the extra variables
/// given, and no other inherited `TURNLOG_*` setting (a developer's shell must not leak
/// into a test). The binary path comes from the caller because only the `turnlog`
/// package's own tests get `env!("CARGO_BIN_EXE_turnlog")`.
///
/// ```ignore
/// let env = test_env().await;
/// let mut writer = TurnlogProcess::start(env!("CARGO_BIN_EXE_turnlog"), &env, &["writer"], &[]);
/// writer.kill();
/// writer.restart().await;
/// println!("writer log: {}", writer.log_path().display());
/// ```
#[derive(Debug)]
pub struct TurnlogProcess {
    process: ExternalProcess,
}

impl TurnlogProcess {
    /// Starts `bin args...`; panics with a clear message when it cannot be spawned.
    pub fn start(
        bin: impl AsRef<Path>,
        env: &TestEnv,
        args: &[&str],
        extra_env: &[(&str, &str)],
    ) -> TurnlogProcess {
        let label = match args.first() {
            Some(sub) => format!("turnlog-{sub}-{}", env.bus_prefix),
            None => format!("turnlog-{}", env.bus_prefix),
        };
        let mut process = ExternalProcess::new(&label, bin.as_ref()).args(args);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("TURNLOG_") {
                process = process.env_remove(key);
            }
        }
        for (key, value) in env.env_vars() {
            process = process.env(key, value);
        }
        for (key, value) in extra_env {
            process = process.env(key, value);
        }
        if let Err(e) = process.start() {
            panic!("turnlog-testkit: {e:#}");
        }
        TurnlogProcess { process }
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// SIGKILL (a crash), then reap.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGTERM (graceful shutdown); follow with [`wait_exit`](Self::wait_exit).
    pub fn terminate(&mut self) {
        self.process.terminate();
    }

    /// SIGSTOP: frozen with its connections open.
    pub fn stop(&mut self) {
        self.process.stop();
    }

    /// SIGCONT.
    pub fn cont(&mut self) {
        self.process.cont();
    }

    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.process.wait_exit(timeout).await
    }

    /// Graceful stop if running (SIGTERM, SIGKILL after 10 s), then the same command again.
    pub async fn restart(&mut self) {
        if let Err(e) = self.process.restart().await {
            panic!("turnlog-testkit: {e:#}");
        }
    }

    pub fn log_path(&self) -> &Path {
        self.process.log_path()
    }

    pub fn log_tail(&self, n: usize) -> String {
        self.process.log_tail(n)
    }
}
