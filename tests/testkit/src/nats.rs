//! [`PrivateNats`]: a nats-server with JetStream of one test's own, on a fixed port whose
//! store survives restarts, for fault tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use turnlog_local_servers::{accepts, nats_server_args, nats_server_bin};

use crate::process::ExternalProcess;
use crate::util::random_alnum;

/// A nats-server (JetStream on) of one test's own, on a fixed port with its own store
/// directory, so it can be restarted, killed or frozen under a running service. Distinct
/// from the shared once-per-run server; killed and its store deleted when dropped.
///
/// ```ignore
/// let mut nats = private_nats(free_port()).await;
/// let env = test_env_on(None, Some(&nats.url())).await;
/// nats.kill();              // crash
/// nats.restart().await;     // same port, same JetStream store
/// nats.stop(); nats.cont(); // freeze and thaw
/// ```
#[derive(Debug)]
pub struct PrivateNats {
    port: u16,
    store_dir: PathBuf,
    process: ExternalProcess,
}

/// Starts nats-server with JetStream on `port` and waits until it accepts connections.
/// Panics with a clear message when it cannot.
pub async fn private_nats(port: u16) -> PrivateNats {
    let bin = nats_server_bin().unwrap_or_else(|e| panic!("turnlog-testkit: {e:#}"));
    let store_dir = std::env::temp_dir().join(format!("turnlog-testkit-nats-{port}-{}", random_alnum(8)));
    if let Err(e) = std::fs::create_dir_all(&store_dir) {
        panic!("turnlog-testkit: cannot create {}: {e}", store_dir.display());
    }
    let process =
        ExternalProcess::new(&format!("nats-server-{port}"), bin).args(nats_server_args(port, &store_dir));
    let mut nats = PrivateNats { port, store_dir, process };
    nats.start().await;
    nats
}

impl PrivateNats {
    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    pub fn log_path(&self) -> &Path {
        self.process.log_path()
    }

    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// Starts the server if it is not running, then waits (up to 15 s) until it accepts
    /// connections; nats-server enables JetStream before it accepts clients.
    pub async fn start(&mut self) {
        let port = self.port;
        let what = format!("private nats-server on port {port}");
        self.process
            .start_until_ready(&what, Duration::from_secs(15), || async move {
                tokio::task::spawn_blocking(move || accepts(port, Duration::from_millis(250)))
                    .await
                    .unwrap_or(false)
            })
            .await;
    }

    /// Graceful stop if running (SIGTERM; SIGKILL after 10 s), then a start on the same
    /// port with the same store. After [`kill`](Self::kill) it is a crash-restart.
    pub async fn restart(&mut self) {
        self.process.shutdown(Duration::from_secs(10)).await;
        self.start().await;
    }

    /// SIGKILL (a crash), then reap. Bring it back with [`restart`](Self::restart).
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGSTOP: clients stay connected to a server that answers nothing.
    pub fn stop(&mut self) {
        self.process.stop();
    }

    /// SIGCONT.
    pub fn cont(&mut self) {
        self.process.cont();
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.process.kill();
        let _ = std::fs::remove_dir_all(&self.store_dir);
    }
}
