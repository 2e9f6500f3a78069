//! Running nats-server of our own: JetStream on, loopback only, its store in a directory
//! of the caller's, stopped with SIGTERM (which flushes the store) and killed only if it
//! does not go.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nix::sys::signal::Signal;

use crate::os;

const COMM: &str = "nats-server";

/// The nats-server binary, or a message naming the package that provides it.
pub fn nats_server_bin() -> anyhow::Result<PathBuf> {
    os::find_executable(COMM).context(
        "nats-server not found on PATH or in /usr/sbin: install the Debian package `nats-server` \
         (apt-get install nats-server), or set NATS_URL to a server of your own with JetStream",
    )
}

/// Arguments for a JetStream server on 127.0.0.1:`port` keeping its store in `store`.
pub fn nats_server_args(port: u16, store: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> =
        ["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"].into_iter().map(OsString::from).collect();
    args.push(store.as_os_str().to_owned());
    args
}

/// A running nats-server: started here (`child`), or one an earlier run left behind.
#[derive(Debug)]
pub struct NatsServer {
    pid: u32,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts nats-server with JetStream on 127.0.0.1:`port`, its store in `store`, its
    /// output appended to `log`, in a process group of its own (signals to the caller's
    /// group miss it: its owner stops it), and waits until it accepts clients (JetStream is
    /// enabled before it does). Dropping the result leaves the server running.
    pub fn start(bin: &Path, port: u16, store: &Path, log: &Path) -> anyhow::Result<NatsServer> {
        use std::os::unix::process::CommandExt;
        std::fs::create_dir_all(store).with_context(|| format!("cannot create {}", store.display()))?;
        let log_file = os::append_log(log)?;
        let child = Command::new(bin)
            .args(nats_server_args(port, store))
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

    /// The nats-server at `pid`, if that is still one.
    pub fn existing(pid: u32) -> Option<NatsServer> {
        os::process_alive(pid, COMM).then_some(NatsServer { pid, child: None })
    }

    /// Adopts the server recorded at `pid` if it is still a nats-server accepting on
    /// `port`. One that lives but does not accept within 10 s is wedged: it is killed.
    pub fn adopt(pid: u32, port: u16) -> Option<NatsServer> {
        let server = NatsServer::existing(pid)?;
        if os::wait_accepting(port, Duration::from_secs(10), || !os::process_alive(pid, COMM)) {
            return Some(server);
        }
        if os::process_alive(pid, COMM) {
            tracing::warn!(pid, port, "nats-server alive but not accepting; killing it");
            let _ = os::signal(pid, Signal::SIGKILL);
            os::wait_gone(pid, COMM, Duration::from_secs(5));
        }
        None
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => os::process_alive(self.pid, COMM),
        }
    }

    /// SIGTERM, up to 15 s to finish writing the store, then SIGKILL.
    pub fn stop(mut self) {
        if !self.running() {
            return;
        }
        if let Err(e) = os::signal(self.pid, Signal::SIGTERM) {
            tracing::warn!(error = format!("{e:#}"), "cannot stop nats-server");
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if self.running() {
            tracing::warn!(pid = self.pid, "nats-server still running 15 s after SIGTERM; killing it");
            let _ = os::signal(self.pid, Signal::SIGKILL);
            os::wait_gone(self.pid, COMM, Duration::from_secs(5));
        }
        if let Some(child) = &mut self.child {
            // Reaped, so no zombie lingers while the owner finishes.
            let _ = child.try_wait();
        }
    }
}
