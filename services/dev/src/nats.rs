//! The private nats-server of a `turnlog dev` data directory: JetStream on, loopback only,
//! its store kept in the data directory between runs, stopped with SIGTERM (which flushes
//! the store) and killed only if it does not go.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use nix::sys::signal::Signal;

use crate::os;

const COMM: &str = "nats-server";

pub(crate) fn find_bin() -> anyhow::Result<PathBuf> {
    os::find_executable(COMM).context(
        "nats-server not found on PATH or in /usr/sbin: install the Debian package `nats-server` \
         (apt-get install nats-server), or set NATS_URL to a server of your own with JetStream",
    )
}

/// A running nats-server: ours (`child`), or one a killed `turnlog dev` left behind.
pub(crate) struct NatsServer {
    pub(crate) pid: u32,
    child: Option<Child>,
}

impl NatsServer {
    /// Adopts the server recorded at `pid` if it is still a nats-server accepting on `port`.
    pub(crate) fn adopt(pid: u32, port: u16) -> Option<NatsServer> {
        let alive = os::process_alive(pid, COMM)
            && os::wait_accepting(port, Duration::from_secs(5), || !os::process_alive(pid, COMM));
        alive.then_some(NatsServer { pid, child: None })
    }

    /// Starts nats-server with JetStream on 127.0.0.1:`port`, its store in `store`, its
    /// output appended to `log`, and waits until it accepts clients (JetStream is enabled
    /// before it does).
    pub(crate) fn start(bin: &Path, port: u16, store: &Path, log: &Path) -> anyhow::Result<NatsServer> {
        use std::os::unix::process::CommandExt;
        std::fs::create_dir_all(store).with_context(|| format!("cannot create {}", store.display()))?;
        let log_file = os::append_log(log)?;
        let child = Command::new(bin)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(store)
            // Its own process group: the terminal's Ctrl-C reaches only `turnlog dev`, which
            // stops the server itself once the services no longer need it.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let mut server = NatsServer { pid: child.id(), child: Some(child) };
        let up = os::wait_accepting(port, Duration::from_secs(30), || !server.running());
        if !up {
            server.stop();
            anyhow::bail!(
                "nats-server did not come up on port {port}; {}:\n{}",
                log.display(),
                os::tail_lines(log, 20)
            );
        }
        Ok(server)
    }

    fn running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => os::process_alive(self.pid, COMM),
        }
    }

    /// SIGTERM, up to 15 s to finish writing the store, then SIGKILL.
    pub(crate) fn stop(mut self) {
        if !self.running() {
            return;
        }
        if let Err(e) = os::signal(self.pid, Signal::SIGTERM) {
            tracing::warn!(error = format!("{e:#}"), "cannot stop nats-server");
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while self.running() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if self.running() {
            tracing::warn!(pid = self.pid, "nats-server still running 15 s after SIGTERM; killing it");
            let _ = os::signal(self.pid, Signal::SIGKILL);
            os::wait_gone(self.pid, COMM, Duration::from_secs(5));
        }
        if let Some(child) = &mut self.child {
            // Reaped, so no zombie lingers while `turnlog dev` finishes.
            let _ = child.try_wait();
        }
    }
}
