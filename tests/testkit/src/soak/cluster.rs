//! The system under test: a private nats-server (or a three-node cluster) and Postgres on
//! fixed ports (so the fault schedule can kill and restart them under load), the mock model
//! in this process, and every `turnlog` process in a named slot that can be killed and
//! started again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::Mutex;
use turnlog_core::ids::{Owner, SessionId};
use turnlog_mock_llm::{MockConfig, MockHandle};
use turnlog_runtime::bus::{append_and_wait, AppendRequest, Bus};

use super::{lock, report::RssSample, Shared, SoakConfig};
use crate::{
    free_port, private_nats, private_nats_cluster, private_postgres, try_test_env_on, PrivateNats,
    PrivateNatsCluster, PrivatePostgres, TestEnv, TurnlogProcess,
};

/// The owner every request runs as (the ingress runs without tokens, on loopback).
pub(crate) const OWNER: &str = "local";

/// [`OWNER`], as the requests on the bus name it.
pub(crate) fn owner() -> Owner {
    Owner::parse(OWNER).expect("OWNER is a valid owner")
}
/// The chat model's window: small, so long sessions get compacted during the soak.
const MODEL_WINDOWS: &str = "mock=5000";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Role {
    Ingress,
    Writer,
    Distiller,
    Compactor,
    Memory,
}

impl Role {
    pub(super) fn name(self) -> &'static str {
        match self {
            Role::Ingress => "ingress",
            Role::Writer => "writer",
            Role::Distiller => "distiller",
            Role::Compactor => "compactor",
            Role::Memory => "memory",
        }
    }
}

/// One `turnlog` process of the system, restarted in place after a kill.
pub(crate) struct Slot {
    pub role: Role,
    pub copy: usize,
    pub process: TurnlogProcess,
}

impl Slot {
    pub(super) fn label(&self) -> String {
        format!("{}#{}", self.role.name(), self.copy)
    }
}

pub(crate) struct Servers {
    pub nats: Nats,
    pub pg: PrivatePostgres,
}

/// One nats-server, or a three-node cluster.
pub(crate) enum Nats {
    One(PrivateNats),
    Three(PrivateNatsCluster),
}

impl Nats {
    fn url(&self) -> String {
        match self {
            Nats::One(n) => n.url(),
            Nats::Three(c) => c.urls(),
        }
    }
}

/// Partitions and stream replicas of a cluster soak (DESIGN §6, Scale-out).
const CLUSTER_PARTITIONS: u32 = 4;
const CLUSTER_REPLICAS: usize = 3;

/// Field order is drop order: processes first, then the servers under them.
pub(crate) struct Cluster {
    pub slots: Mutex<Vec<Slot>>,
    pub servers: Mutex<Servers>,
    pub env: TestEnv,
    pub bus: Bus,
    pub http: reqwest::Client,
    pub mock: MockHandle,
    /// Base URLs of the ingress copies, by copy.
    pub ingress: Vec<String>,
}

impl Cluster {
    pub(super) async fn start(config: &SoakConfig) -> anyhow::Result<Cluster> {
        let nats = if config.cluster {
            Nats::Three(private_nats_cluster().await)
        } else {
            Nats::One(private_nats(free_port()).await)
        };
        let pg = private_postgres(free_port()).await;
        let mut env = try_test_env_on(Some(&pg.url()), Some(&nats.url())).await?;
        let replicas = if config.cluster { CLUSTER_REPLICAS } else { 1 };
        if config.cluster {
            env.partitions = CLUSTER_PARTITIONS;
        }
        let mock = turnlog_mock_llm::spawn(MockConfig::default()).await?;
        let bus = Bus::connect(&env.nats_url, &env.bus_prefix, env.partitions).await?.with_replicas(replicas);
        bus.ensure_topology(None).await?;
        let replicas = replicas.to_string();
        // Every process creates or checks the streams with the same replicas; on a cluster a
        // write waits through a leader election (4–9 s) instead of failing after 5 s.
        let cluster_env: &[(&str, &str)] = if config.cluster {
            &[("TURNLOG_STREAM_REPLICAS", replicas.as_str()), ("TURNLOG_APPEND_TIMEOUT", "20s")]
        } else {
            &[]
        };
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .pool_max_idle_per_host(64)
            .build()?;

        let llm = mock.base_url();
        // The processes' log filter: `info`, or TURNLOG_SOAK_RUST_LOG's (to look closer).
        let log_filter = std::env::var("TURNLOG_SOAK_RUST_LOG").unwrap_or_else(|_| "info".to_owned());
        let worker_env = [
            ("TURNLOG_LLM_URL", llm.as_str()),
            ("TURNLOG_MODEL", "mock"),
            ("TURNLOG_MODEL_WINDOWS", MODEL_WINDOWS),
            // A killed copy's events come back to the other copy this soon.
            ("TURNLOG_WORKER_ACK_WAIT", "15s"),
            ("TURNLOG_FACTS_WAIT", "2s"),
            ("TURNLOG_UPSTREAM_TIMEOUT", "20s"),
            ("RUST_LOG", log_filter.as_str()),
        ];
        let worker_env = [&worker_env[..], cluster_env].concat();
        let bin = &config.bin;
        let mut slots = Vec::new();
        for copy in 0..2 {
            let vars = [&[("RUST_LOG", log_filter.as_str())][..], cluster_env].concat();
            let process = TurnlogProcess::start(bin, &env, &["writer"], &vars);
            slots.push(Slot { role: Role::Writer, copy, process });
            if copy == 0 {
                // The first copy takes every partition; the second takes its share of them
                // (with one partition it waits as the standby).
                wait_for_writer(&env, &bus).await?;
            }
        }
        for role in [Role::Distiller, Role::Compactor, Role::Memory] {
            for copy in 0..2 {
                let process = TurnlogProcess::start(bin, &env, &[role.name()], &worker_env);
                slots.push(Slot { role, copy, process });
            }
        }
        let mut ingress = Vec::new();
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < 2 {
            let p = free_port();
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        let turn_cap = config.turn_cap_per_owner().to_string();
        for (copy, port) in ports.into_iter().enumerate() {
            let listen = format!("127.0.0.1:{port}");
            let vars = [
                ("TURNLOG_LISTEN", listen.as_str()),
                ("TURNLOG_MAX_TURNS_PER_OWNER", turn_cap.as_str()),
                ("TURNLOG_LLM_URL", llm.as_str()),
                ("TURNLOG_MODEL_WINDOWS", MODEL_WINDOWS),
                // A hung model turns into a failed turn this soon.
                ("TURNLOG_UPSTREAM_TIMEOUT", "5s"),
                ("TURNLOG_COMPACT_TIMEOUT", "3s"),
                ("RUST_LOG", log_filter.as_str()),
            ];
            let vars = [&vars[..], cluster_env].concat();
            let process = TurnlogProcess::start(bin, &env, &["ingress"], &vars);
            slots.push(Slot { role: Role::Ingress, copy, process });
            ingress.push(format!("http://{listen}"));
        }
        for base in &ingress {
            wait_ready(&http, base, Duration::from_secs(60)).await?;
        }
        let servers = Mutex::new(Servers { nats, pg });
        Ok(Cluster { slots: Mutex::new(slots), servers, env, bus, http, mock, ingress })
    }

    /// What the soak runs on, for its first line.
    pub(super) fn topology(&self) -> String {
        format!(
            "{} with {} partition(s) over 2 writers",
            if self.env.nats_url.contains(',') {
                "a three-node NATS cluster (replicas 3)"
            } else {
                "one nats-server"
            },
            self.env.partitions
        )
    }

    /// Stops every process gracefully (SIGTERM, so logs end cleanly), ingress first and
    /// the writers last, as `turnlog dev` does; the servers go when the cluster is dropped.
    pub(super) async fn shutdown(&self) {
        let mut slots = self.slots.lock().await;
        slots.sort_by_key(|s| match s.role {
            Role::Ingress => 0,
            Role::Writer => 2,
            _ => 1,
        });
        for slot in slots.iter_mut() {
            slot.process.terminate();
        }
        for slot in slots.iter_mut() {
            if slot.process.wait_exit(Duration::from_secs(20)).await.is_none() {
                slot.process.kill();
            }
        }
    }
}

/// Waits until a writer commits (it is up, migrated and holds the partition).
async fn wait_for_writer(env: &TestEnv, bus: &Bus) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let create = AppendRequest::create(SessionId::new(), &owner(), Some("writer warm-up".into()));
    loop {
        match append_and_wait(bus, &env.pool, &create, Duration::from_secs(3)).await {
            Ok(o) if o.is_applied() => return Ok(()),
            Ok(o) => anyhow::bail!("the writer refused a session create: {o:?}"),
            Err(e) if Instant::now() > deadline => return Err(e).context("no writer committed within 60 s"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn wait_ready(http: &reqwest::Client, base: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let ready = http
            .get(format!("{base}/readyz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "ingress {base} not ready within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// VmRSS of a process in KiB, from `/proc/<pid>/status`.
pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Samples every running process's resident memory every few seconds until `until`.
pub(crate) async fn sample_rss(cluster: Arc<Cluster>, shared: Arc<Shared>, until: Instant) {
    const EVERY: Duration = Duration::from_secs(5);
    while Instant::now() < until {
        let t = shared.elapsed();
        let mut samples = Vec::new();
        {
            let mut slots = cluster.slots.lock().await;
            for slot in slots.iter_mut() {
                if !slot.process.is_running() {
                    continue;
                }
                let pid = slot.process.pid();
                if let Some(kib) = rss_kib(pid) {
                    samples.push(RssSample { slot: slot.label(), pid, t, kib });
                }
            }
        }
        lock(&shared.rss).extend(samples);
        tokio::time::sleep(EVERY.min(until.saturating_duration_since(Instant::now()))).await;
    }
}

/// The in-process mock keeps every request it served (for tests that inspect them); over a
/// long soak that would be this process's largest allocation, so it is emptied regularly.
pub(crate) async fn clear_mock_log(cluster: Arc<Cluster>, until: Instant) {
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(5)).await;
        cluster.mock.log().clear();
    }
}
