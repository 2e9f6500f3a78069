//! [`PrivateNats`]: a nats-server with JetStream of one test's own, on a fixed port whose
//! store survives restarts, for fault tests; [`PrivateNatsCluster`]: three of them as one
//! nats-server cluster.

use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use turnlog_local_servers::{accepts, nats_server_args, nats_server_bin};

use crate::netns::TestHost;
use crate::process::ExternalProcess;
use crate::util::{free_port, random_alnum};

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
    addr: Ipv4Addr,
    port: u16,
    store_dir: PathBuf,
    process: ExternalProcess,
}

/// Starts nats-server with JetStream on `port` and waits until it accepts connections.
/// Panics with a clear message when it cannot.
pub async fn private_nats(port: u16) -> PrivateNats {
    start_private(port, Ipv4Addr::LOCALHOST).await
}

/// [`private_nats`] on this machine's address on a [`TestHost`]'s link (only there: this
/// machine reaches it there too), so processes on both reach it.
pub async fn private_nats_for(port: u16, host: &TestHost) -> PrivateNats {
    start_private(port, host.local_addr()).await
}

async fn start_private(port: u16, addr: Ipv4Addr) -> PrivateNats {
    let bin = nats_server_bin().unwrap_or_else(|e| panic!("turnlog-testkit: {e:#}"));
    let store_dir = std::env::temp_dir().join(format!("turnlog-testkit-nats-{port}-{}", random_alnum(8)));
    if let Err(e) = std::fs::create_dir_all(&store_dir) {
        panic!("turnlog-testkit: cannot create {}: {e}", store_dir.display());
    }
    // A later `-a` wins over the loopback one.
    let process = ExternalProcess::new(&format!("nats-server-{port}"), bin)
        .args(nats_server_args(port, &store_dir))
        .args(["-a".to_owned(), addr.to_string()]);
    let mut nats = PrivateNats { addr, port, store_dir, process };
    nats.start().await;
    nats
}

impl PrivateNats {
    /// `nats://127.0.0.1:<port>` (the link's address for [`private_nats_for`]).
    pub fn url(&self) -> String {
        format!("nats://{}:{}", self.addr, self.port)
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
        let (addr, port) = (self.addr, self.port);
        let what = format!("private nats-server on port {port}");
        self.process
            .start_until_ready(&what, Duration::from_secs(15), || async move {
                tokio::task::spawn_blocking(move || {
                    TcpStream::connect_timeout(&(addr, port).into(), Duration::from_millis(250)).is_ok()
                })
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

/// Three nodes of one nats-server cluster on loopback, JetStream on each, of one test's own:
/// every node its own `server_name`, client port, cluster port, store directory and config
/// file (`cluster { name, listen, routes }`). Ports are chosen once, so a killed node comes
/// back where it was; all are killed and their stores deleted on drop.
///
/// ```ignore
/// let mut cluster = private_nats_cluster().await; // returns once JetStream has a meta leader
/// let bus = Bus::connect(&cluster.urls(), &prefix, 1).await?.with_replicas(3);
/// cluster.kill(0);            // SIGKILL node 0
/// cluster.restart(0).await;   // same ports, same store
/// ```
#[derive(Debug)]
pub struct PrivateNatsCluster {
    dir: PathBuf,
    nodes: Vec<ClusterNode>,
}

#[derive(Debug)]
struct ClusterNode {
    port: u16,
    process: ExternalProcess,
}

/// The nodes in a [`PrivateNatsCluster`].
pub const CLUSTER_NODES: usize = 3;

/// Starts a three-node cluster and waits (up to 30 s) until every node accepts connections
/// and JetStream has elected a meta leader (a throwaway three-replica stream can be
/// created). Panics with a clear message when it cannot.
pub async fn private_nats_cluster() -> PrivateNatsCluster {
    let bin = nats_server_bin().unwrap_or_else(|e| panic!("turnlog-testkit: {e:#}"));
    // Six distinct ports: a client and a cluster port a node.
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < 2 * CLUSTER_NODES {
        let p = free_port();
        if !ports.contains(&p) {
            ports.push(p);
        }
    }
    let (client, routes) = ports.split_at(CLUSTER_NODES);
    let dir =
        std::env::temp_dir().join(format!("turnlog-testkit-nats-cluster-{}-{}", client[0], random_alnum(8)));
    let mut nodes = Vec::new();
    for i in 0..CLUSTER_NODES {
        let store = dir.join(format!("n{i}"));
        if let Err(e) = std::fs::create_dir_all(&store) {
            panic!("turnlog-testkit: cannot create {}: {e}", store.display());
        }
        let peers: Vec<String> = (0..CLUSTER_NODES)
            .filter(|j| *j != i)
            .map(|j| format!("nats-route://127.0.0.1:{}", routes[j]))
            .collect();
        let config = format!(
            "server_name: n{i}\nlisten: 127.0.0.1:{port}\njetstream {{ store_dir: {store:?} }}\n\
             cluster {{\n  name: turnlog-test\n  listen: 127.0.0.1:{route}\n  routes: [{peers}]\n}}\n",
            port = client[i],
            store = store.display().to_string(),
            route = routes[i],
            peers = peers.join(", "),
        );
        let path = dir.join(format!("n{i}.conf"));
        if let Err(e) = std::fs::write(&path, config) {
            panic!("turnlog-testkit: cannot write {}: {e}", path.display());
        }
        let process = ExternalProcess::new(&format!("nats-cluster-{}-n{i}", client[0]), bin.clone())
            .arg("-c")
            .arg(&path);
        nodes.push(ClusterNode { port: client[i], process });
    }
    let mut cluster = PrivateNatsCluster { dir, nodes };
    for i in 0..CLUSTER_NODES {
        cluster.start(i).await;
    }
    cluster.wait_for_jetstream(Duration::from_secs(30)).await;
    cluster
}

impl PrivateNatsCluster {
    /// Every node's URL, comma-separated: what NATS_URL and `Bus::connect` take.
    pub fn urls(&self) -> String {
        (0..self.nodes.len()).map(|i| self.url(i)).collect::<Vec<_>>().join(",")
    }

    /// Node `i`'s URL alone.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// Node `i`'s `server_name` (`n<i>`), as stream cluster info names leaders and peers.
    pub fn server_name(&self, i: usize) -> String {
        format!("n{i}")
    }

    pub fn pid(&self, i: usize) -> u32 {
        self.nodes[i].process.pid()
    }

    pub fn log_path(&self, i: usize) -> &Path {
        self.nodes[i].process.log_path()
    }

    pub fn is_running(&mut self, i: usize) -> bool {
        self.nodes[i].process.is_running()
    }

    /// SIGKILL node `i` (a crash), then reap. Bring it back with [`restart`](Self::restart).
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].process.kill();
    }

    /// SIGSTOP node `i` (frozen, connections open); [`cont`](Self::cont) resumes it.
    pub fn stop(&mut self, i: usize) {
        self.nodes[i].process.stop();
    }

    pub fn cont(&mut self, i: usize) {
        self.nodes[i].process.cont();
    }

    /// Graceful stop of node `i` if running (SIGTERM; SIGKILL after 10 s), then a start with
    /// the same ports and store; returns once it accepts connections (it rejoins the cluster
    /// and catches up on its own).
    pub async fn restart(&mut self, i: usize) {
        self.nodes[i].process.shutdown(Duration::from_secs(10)).await;
        self.start(i).await;
    }

    async fn start(&mut self, i: usize) {
        let port = self.nodes[i].port;
        let what = format!("nats-server cluster node n{i} on port {port}");
        self.nodes[i]
            .process
            .start_until_ready(&what, Duration::from_secs(15), || async move {
                tokio::task::spawn_blocking(move || accepts(port, Duration::from_millis(250)))
                    .await
                    .unwrap_or(false)
            })
            .await;
    }

    /// Waits until JetStream answers with a meta leader: a throwaway in-memory stream of
    /// three replicas is created (then deleted). Panics after `timeout`.
    pub async fn wait_for_jetstream(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        let urls = self.urls();
        let servers: Vec<&str> = urls.split(',').collect();
        let mut last_error = String::new();
        while tokio::time::Instant::now() < deadline {
            match probe_r3_stream(&servers).await {
                Ok(()) => return,
                Err(e) => last_error = format!("{e:#}"),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        panic!(
            "turnlog-testkit: the nats-server cluster {urls} has no JetStream meta leader after {timeout:?} \
             ({last_error}); node 0's log {}:\n{}",
            self.nodes[0].process.log_path().display(),
            self.nodes[0].process.log_tail(30)
        );
    }
}

async fn probe_r3_stream(servers: &[&str]) -> anyhow::Result<()> {
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .request_timeout(Some(Duration::from_secs(2)))
        .connect(servers)
        .await?;
    let js = async_nats::jetstream::new(client);
    let name = format!("TESTKIT_PROBE_{}", random_alnum(8).to_ascii_uppercase());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("testkit.probe.{}", name.to_ascii_lowercase())],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        num_replicas: CLUSTER_NODES,
        ..Default::default()
    })
    .await?;
    js.delete_stream(&name).await?;
    Ok(())
}

impl Drop for PrivateNatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.process.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
