//! The fault schedule: one fault at a time (a process SIGKILLed and restarted, nats-server
//! restarted or frozen, Postgres crashed and restarted, a burst of poison), then probes that
//! time how long each affected process kind takes to serve again.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use turnlog_core::events::{EventBody, UserMessage};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{append_and_wait, AppendRequest, CompactReply, CompactRequest};
use uuid::Uuid;

use super::client::{probe_turn, victim_turn, Client};
use super::cluster::{owner, Cluster, Nats, Role};
use super::report::ViolationKind;
use super::{lock, now_s, Counters, Shared};

/// How long a killed process stays down before it is started again.
const DOWNTIME: Duration = Duration::from_secs(1);
/// How long nats-server and Postgres stay down when restarted, and nats-server frozen.
const SERVER_DOWNTIME: Duration = Duration::from_secs(2);
const FREEZE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    KillIngress,
    KillWriter,
    RestartNats,
    KillDistiller,
    RestartPostgres,
    KillCompactor,
    FreezeNats,
    KillMemory,
    PoisonBurst,
    KillAppendLeader,
    KillEventsLeader,
}

impl FaultKind {
    /// A name for the command line: `kill_ingress`, `restart_nats`, ...
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::KillIngress => "kill_ingress",
            FaultKind::KillWriter => "kill_writer",
            FaultKind::KillDistiller => "kill_distiller",
            FaultKind::KillCompactor => "kill_compactor",
            FaultKind::KillMemory => "kill_memory",
            FaultKind::RestartNats => "restart_nats",
            FaultKind::RestartPostgres => "restart_postgres",
            FaultKind::FreezeNats => "freeze_nats",
            FaultKind::PoisonBurst => "poison",
            FaultKind::KillAppendLeader => "kill_append_leader",
            FaultKind::KillEventsLeader => "kill_events_leader",
        }
    }

    pub fn from_name(name: &str) -> Option<FaultKind> {
        FaultKind::ALL.into_iter().chain(FaultKind::CLUSTER).find(|k| k.name() == name)
    }

    /// The kinds a cluster soak adds (on one nats-server each is a nats-server kill).
    pub const CLUSTER: [FaultKind; 2] = [FaultKind::KillAppendLeader, FaultKind::KillEventsLeader];

    /// Every kind, in the benchmark's order (server faults between process kills).
    pub const ALL: [FaultKind; 9] = [
        FaultKind::KillIngress,
        FaultKind::KillWriter,
        FaultKind::RestartNats,
        FaultKind::KillDistiller,
        FaultKind::RestartPostgres,
        FaultKind::KillCompactor,
        FaultKind::FreezeNats,
        FaultKind::KillMemory,
        FaultKind::PoisonBurst,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FaultKind::KillIngress => "SIGKILL ingress (1 of 2), restart",
            FaultKind::KillWriter => "SIGKILL active writer, restart",
            FaultKind::KillDistiller => "SIGKILL distiller (1 of 2), restart",
            FaultKind::KillCompactor => "SIGKILL compactor (1 of 2), restart",
            FaultKind::KillMemory => "SIGKILL memory (1 of 2), restart",
            FaultKind::RestartNats => "nats-server SIGKILL, 2 s down, restart",
            FaultKind::RestartPostgres => "Postgres crash (SIGQUIT), 2 s down, restart",
            FaultKind::FreezeNats => "nats-server SIGSTOP 5 s, SIGCONT",
            FaultKind::PoisonBurst => "poison burst (APPEND + HTTP)",
            FaultKind::KillAppendLeader => "SIGKILL the NATS node leading TURNLOG_APPEND, restart 15 s later",
            FaultKind::KillEventsLeader => "SIGKILL the NATS node leading TURNLOG_EVENTS, restart 15 s later",
        }
    }
}

/// One injected fault and how the system came back.
#[derive(Debug, Clone)]
pub(crate) struct FaultRun {
    pub kind: FaultKind,
    pub run: usize,
    /// Seconds since the start: when it was injected and when it ended.
    pub at: f64,
    pub healed_at: f64,
    /// Seconds from the fault's end until each probe succeeded (None: not within the cap).
    pub probes: Vec<(String, Option<f64>)>,
    /// The slowest probe; None when one never succeeded.
    pub recovery: Option<f64>,
    /// For a NATS leader kill: seconds from the kill until an append was applied again
    /// (None: not within the cap).
    pub outage: Option<Option<f64>>,
}

/// The sessions the probes use, one per probe so they never wait on each other's lease.
pub(crate) struct Probes {
    ingress: Vec<Uuid>,
    distiller: Uuid,
    memory: Uuid,
    compactor: Uuid,
    writer: Uuid,
}

impl Probes {
    pub(super) async fn create(cluster: &Cluster) -> anyhow::Result<Probes> {
        let mut ids = Vec::new();
        for i in 0..6 {
            let id = SessionId::new();
            let create = AppendRequest::create(id, &owner(), Some(format!("probe {i}")));
            let o =
                append_and_wait(&cluster.bus, &cluster.env.pool, &create, Duration::from_secs(30)).await?;
            anyhow::ensure!(o.is_applied(), "probe session refused: {o:?}");
            ids.push(id.0);
        }
        Ok(Probes {
            ingress: ids[..2].to_vec(),
            distiller: ids[2],
            memory: ids[3],
            compactor: ids[4],
            writer: ids[5],
        })
    }
}

/// Injects the configured faults one after another until the load is about to end; returns
/// what happened to each.
pub(crate) async fn run_schedule(
    cluster: &Cluster,
    shared: &Arc<Shared>,
    probes: &Probes,
    stop_at: Instant,
) -> Vec<FaultRun> {
    let config = &shared.config;
    tokio::time::sleep(config.warmup.min(stop_at.saturating_duration_since(Instant::now()))).await;
    let mut runs = Vec::new();
    let mut per_kind: HashMap<FaultKind, usize> = HashMap::new();
    for (i, kind) in config.faults.iter().copied().cycle().enumerate() {
        if (!config.cycle && i >= config.faults.len()) || Instant::now() + config.quiet_tail > stop_at {
            break;
        }
        let run = {
            let n = per_kind.entry(kind).or_default();
            *n += 1;
            *n
        };
        shared.disturbed.store(true, Ordering::Relaxed);
        lock(&shared.windows).push((kind, run, now_s()));
        let at = shared.elapsed();
        shared.say(&format!("fault {}: {} (run {run})", i + 1, kind.label()));
        let (restarted, outage) = inject(cluster, shared, probes, kind).await;
        if let Some(o) = outage {
            shared.say(&match o {
                Some(s) => format!("  write outage {s:.1} s"),
                None => "  writes did not resume".to_owned(),
            });
            if o.is_none_or(|s| s > config.recovery_bound.as_secs_f64()) {
                shared.violation(
                    ViolationKind::Recovery,
                    format!("{} (run {run}): write outage {o:?}", kind.label()),
                );
            }
        }
        let healed = Instant::now();
        let healed_at = shared.elapsed();

        let results = probe(cluster, shared, probes, kind, &restarted, healed).await;
        let mut recovery = results.iter().map(|(_, r)| *r).try_fold(0.0_f64, |m, r| r.map(|r| m.max(r)));
        for (role, copy) in &restarted {
            let mut slots = cluster.slots.lock().await;
            if let Some(slot) = slots.iter_mut().find(|s| s.role == *role && s.copy == *copy) {
                if !slot.process.is_running() {
                    shared.violation(
                        ViolationKind::Recovery,
                        format!(
                            "{} exited after its restart; log {}",
                            slot.label(),
                            slot.process.log_path().display()
                        ),
                    );
                    recovery = None;
                }
            }
        }
        let shown: Vec<String> = results
            .iter()
            .map(|(name, r)| match r {
                Some(s) => format!("{name} {s:.1}s"),
                None => format!("{name} NOT RECOVERED"),
            })
            .collect();
        shared.say(&format!("  recovered: {}", shown.join(", ")));
        match recovery {
            None => shared.violation(
                ViolationKind::Recovery,
                format!(
                    "{} (run {run}) did not recover within {:?}: {}",
                    kind.label(),
                    config.recovery_cap,
                    shown.join(", ")
                ),
            ),
            Some(r) if r > config.recovery_bound.as_secs_f64() => shared.violation(
                ViolationKind::Recovery,
                format!("{} (run {run}) took {r:.1} s to recover: {}", kind.label(), shown.join(", ")),
            ),
            Some(_) => {}
        }
        runs.push(FaultRun { kind, run, at, healed_at, probes: results, recovery, outage });
        // 503s right after a recovery still belong to the fault (clients' retries back off).
        tokio::time::sleep(Duration::from_secs(2)).await;
        shared.disturbed.store(false, Ordering::Relaxed);
        tokio::time::sleep(config.gap).await;
    }
    runs
}

/// Injects one fault; returns the processes it killed and restarted, and for a NATS leader
/// kill the write outage.
async fn inject(
    cluster: &Cluster,
    shared: &Arc<Shared>,
    probes: &Probes,
    kind: FaultKind,
) -> (Vec<(Role, usize)>, Option<Option<f64>>) {
    let restarted = match kind {
        FaultKind::KillAppendLeader | FaultKind::KillEventsLeader => {
            let stream = match kind {
                FaultKind::KillAppendLeader => cluster.bus.names.append_stream(),
                _ => cluster.bus.names.events_stream(),
            };
            let outage = kill_leader(cluster, shared, probes, &stream).await;
            return (Vec::new(), Some(outage));
        }
        FaultKind::KillIngress => {
            let victim = victim_turn(cluster, shared, 0).await;
            if victim.is_none() {
                shared.say("kill_ingress: no victim turn could be started; killing anyway");
            }
            let restarted = kill_restart(cluster, shared, Role::Ingress, 0).await;
            if let Some(v) = victim {
                let _ = v.await;
            }
            restarted
        }
        FaultKind::KillWriter => {
            let copy = active_writer(cluster).await;
            kill_restart(cluster, shared, Role::Writer, copy).await
        }
        FaultKind::KillDistiller => kill_restart(cluster, shared, Role::Distiller, 0).await,
        FaultKind::KillCompactor => kill_restart(cluster, shared, Role::Compactor, 0).await,
        FaultKind::KillMemory => kill_restart(cluster, shared, Role::Memory, 0).await,
        FaultKind::RestartNats => {
            let mut servers = cluster.servers.lock().await;
            match &mut servers.nats {
                Nats::One(n) => n.kill(),
                Nats::Three(c) => c.kill(0),
            }
            tokio::time::sleep(SERVER_DOWNTIME).await;
            match &mut servers.nats {
                Nats::One(n) => n.restart().await,
                Nats::Three(c) => c.restart(0).await,
            }
            Vec::new()
        }
        FaultKind::FreezeNats => {
            let mut servers = cluster.servers.lock().await;
            match &mut servers.nats {
                Nats::One(n) => n.stop(),
                Nats::Three(c) => c.stop(0),
            }
            tokio::time::sleep(FREEZE).await;
            match &mut servers.nats {
                Nats::One(n) => n.cont(),
                Nats::Three(c) => c.cont(0),
            }
            Vec::new()
        }
        FaultKind::RestartPostgres => {
            let mut servers = cluster.servers.lock().await;
            // An immediate shutdown waits (briefly) for the server to exit.
            tokio::task::block_in_place(|| servers.pg.kill());
            tokio::time::sleep(SERVER_DOWNTIME).await;
            servers.pg.restart().await;
            Vec::new()
        }
        FaultKind::PoisonBurst => {
            poison(cluster, shared).await;
            Vec::new()
        }
    };
    (restarted, None)
}

/// SIGKILLs the nats-server leading `stream` (the only one on a single-node soak), times
/// how long until the writer applies an append again, then starts the node again.
async fn kill_leader(cluster: &Cluster, shared: &Shared, probes: &Probes, stream: &str) -> Option<f64> {
    let mut servers = cluster.servers.lock().await;
    let node = match &servers.nats {
        Nats::One(_) => None,
        Nats::Three(_) => {
            // The node to kill is the stream's leader, read from the cluster: asked again
            // until one is named (an election may be under way). None named: a violation,
            // and no node is killed, so the fault's figures never stand for another node.
            let leader = async {
                loop {
                    let named = async {
                        let mut s = cluster.bus.js.get_stream(stream).await.ok()?;
                        let name = s.info().await.ok()?.cluster.clone()?.leader?;
                        name.strip_prefix('n')?.parse::<usize>().ok()
                    };
                    match named.await {
                        Some(node) => return node,
                        None => tokio::time::sleep(Duration::from_millis(250)).await,
                    }
                }
            };
            let Ok(node) = tokio::time::timeout(Duration::from_secs(15), leader).await else {
                shared.violation(
                    ViolationKind::Other,
                    format!("no leader of {stream} named within 15 s; no node killed"),
                );
                return None;
            };
            shared.say(&format!("  {stream} is led by n{node}"));
            Some(node)
        }
    };
    let killed = Instant::now();
    match (&mut servers.nats, node) {
        (Nats::Three(c), Some(node)) => c.kill(node),
        (Nats::One(n), _) => n.kill(),
        _ => {}
    }
    let outage = write_outage(cluster, shared, probes.writer, killed).await;
    match (&mut servers.nats, node) {
        (Nats::Three(c), Some(node)) => c.restart(node).await,
        (Nats::One(n), _) => n.restart().await,
        _ => {}
    }
    outage
}

/// Log lines a copy writes once it is connected and serving (or standing by).
fn up_markers(role: Role) -> &'static [&'static str] {
    match role {
        Role::Writer => &["writer active", "standing by", "partition share worked out"],
        Role::Distiller => &["distiller running"],
        Role::Compactor => &["compactor running"],
        Role::Memory => &["memory extraction running"],
        Role::Ingress => &[],
    }
}

/// SIGKILLs one copy, waits the downtime, starts it again.
async fn kill_restart(cluster: &Cluster, shared: &Shared, role: Role, copy: usize) -> Vec<(Role, usize)> {
    let mut slots = cluster.slots.lock().await;
    let Some(slot) = slots.iter_mut().find(|s| s.role == role && s.copy == copy) else { return Vec::new() };
    if role == Role::Ingress {
        lock(&shared.ingress_kills).push(now_s());
    }
    slot.process.kill();
    tokio::time::sleep(DOWNTIME).await;
    slot.process.restart().await;
    vec![(role, copy)]
}

/// The writer copy holding the partition, from the last of its log's state lines.
async fn active_writer(cluster: &Cluster) -> usize {
    let mut slots = cluster.slots.lock().await;
    for slot in slots.iter_mut().filter(|s| s.role == Role::Writer) {
        if !slot.process.is_running() {
            continue;
        }
        let text = std::fs::read(slot.process.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let active = text.rfind("writer active");
        let idle = ["standing by", "stepping down"].iter().filter_map(|m| text.rfind(m)).max();
        if active.is_some() && active > idle {
            return slot.copy;
        }
    }
    0
}

type Probe<'a> = Pin<Box<dyn Future<Output = Option<f64>> + Send + 'a>>;

/// Runs the probes that matter for `kind` side by side; each reports seconds from
/// `healed` until it succeeded.
async fn probe(
    cluster: &Cluster,
    shared: &Shared,
    probes: &Probes,
    kind: FaultKind,
    restarted: &[(Role, usize)],
    healed: Instant,
) -> Vec<(String, Option<f64>)> {
    let cap = shared.config.recovery_cap;
    let mut set: Vec<(String, Probe<'_>)> = Vec::new();
    let everything = matches!(
        kind,
        FaultKind::RestartNats
            | FaultKind::FreezeNats
            | FaultKind::RestartPostgres
            | FaultKind::KillAppendLeader
            | FaultKind::KillEventsLeader
    );
    let writer = everything || matches!(kind, FaultKind::KillWriter | FaultKind::PoisonBurst);
    if writer {
        set.push((
            "writer commits".into(),
            Box::pin(probe_writer(cluster, shared, probes.writer, healed, cap)),
        ));
    }
    for copy in 0..cluster.ingress.len() {
        if everything || restarted.contains(&(Role::Ingress, copy)) {
            let name = format!("turn via ingress#{copy}");
            let session = probes.ingress[copy];
            set.push((name, Box::pin(probe_ingress(cluster, shared, copy, session, healed, cap))));
        }
    }
    for (role, session, output) in [
        (Role::Distiller, probes.distiller, "turn_memory"),
        (Role::Memory, probes.memory, "memory_extracted"),
    ] {
        if everything || restarted.iter().any(|(r, _)| *r == role) {
            let name = format!("{} handles a new turn", role.name());
            set.push((name, Box::pin(probe_worker(cluster, shared, session, output, healed, cap))));
        }
    }
    if everything || restarted.iter().any(|(r, _)| *r == Role::Compactor) {
        let name = "compactor answers a pre-send check".to_owned();
        set.push((name, Box::pin(probe_compactor(cluster, probes.compactor, healed, cap))));
    }
    for (role, copy) in restarted.iter().filter(|(r, _)| *r != Role::Ingress) {
        let name = format!("{}#{copy} restarted and up", role.name());
        set.push((name, Box::pin(probe_up(cluster, *role, *copy, healed, cap))));
    }
    let (names, futures): (Vec<String>, Vec<Probe<'_>>) = set.into_iter().unzip();
    let results = futures::future::join_all(futures).await;
    names.into_iter().zip(results).collect()
}

fn since(healed: Instant) -> f64 {
    healed.elapsed().as_secs_f64()
}

/// The writer commits an append (the same request id on every attempt, as a producer
/// should); the acknowledgement joins the checked ones.
async fn probe_writer(
    cluster: &Cluster,
    shared: &Shared,
    session: Uuid,
    healed: Instant,
    cap: Duration,
) -> Option<f64> {
    let n = shared.elapsed();
    let body =
        EventBody::UserMessage(UserMessage { text: format!("writer probe at {n:.1}"), ..Default::default() });
    let req = AppendRequest::append(SessionId(session), &owner(), Uuid::now_v7(), &body);
    loop {
        if let Ok(o) = append_and_wait(&cluster.bus, &cluster.env.pool, &req, Duration::from_secs(2)).await {
            if let (true, Some(seq)) = (o.is_applied(), o.seq) {
                lock(&shared.probe_acks).push((req.request_id, session, seq, now_s()));
                return Some(since(healed));
            }
        }
        if healed.elapsed() > cap {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How long after a leader kill the writer probe keeps appending.
const OUTAGE_WATCH: Duration = Duration::from_secs(15);

/// Appends one after another from `killed` for [`OUTAGE_WATCH`] (and until writes flow);
/// returns the longest wait for an applied append, counted from the kill (None: writes did
/// not resume within the recovery cap). Every acknowledgement joins the checked ones.
async fn write_outage(cluster: &Cluster, shared: &Shared, session: Uuid, killed: Instant) -> Option<f64> {
    let cap = shared.config.recovery_cap;
    let (mut last, mut worst) = (killed, 0.0_f64);
    let mut n = 0;
    loop {
        n += 1;
        let body = EventBody::UserMessage(UserMessage {
            text: format!("outage probe {n} at {:.1}", shared.elapsed()),
            ..Default::default()
        });
        let req = AppendRequest::append(SessionId(session), &owner(), Uuid::now_v7(), &body);
        loop {
            match append_and_wait(&cluster.bus, &cluster.env.pool, &req, Duration::from_secs(2)).await {
                Ok(o) if o.is_applied() => {
                    lock(&shared.probe_acks).push((
                        req.request_id,
                        session,
                        o.seq.unwrap_or_default(),
                        now_s(),
                    ));
                    worst = worst.max(last.elapsed().as_secs_f64());
                    last = Instant::now();
                    break;
                }
                _ if last.elapsed() > cap => return None,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        if killed.elapsed() > OUTAGE_WATCH {
            return Some(worst);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A turn through ingress copy `copy` completes and its answer is stored.
async fn probe_ingress(
    cluster: &Cluster,
    shared: &Shared,
    copy: usize,
    session: Uuid,
    healed: Instant,
    cap: Duration,
) -> Option<f64> {
    let mut n = 0;
    loop {
        n += 1;
        let text = format!("ingress probe {copy}.{n} at {:.1} [mock words=3]", shared.elapsed());
        if probe_turn(cluster, shared, copy, session, &text).await.is_some() {
            return Some(since(healed));
        }
        if healed.elapsed() > cap {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A new turn (through whichever copy answers) gets the worker's output.
async fn probe_worker(
    cluster: &Cluster,
    shared: &Shared,
    session: Uuid,
    output: &str,
    healed: Instant,
    cap: Duration,
) -> Option<f64> {
    let mut n: usize = 0;
    loop {
        n += 1;
        // Names and numbers give the distiller findings and the memory worker facts.
        let text = format!(
            "Probe {n} at {:.1}: Petra moved room {} to Friday. [mock words=4]",
            shared.elapsed(),
            100 + n
        );
        if let Some(turn) = probe_turn(cluster, shared, 1 - n % 2, session, &text).await {
            while healed.elapsed() <= cap {
                let found: Result<i64, _> = sqlx::query_scalar(
                    "SELECT count(*) FROM session_events WHERE session_id = $1 AND kind = $2 \
                     AND (payload->>'turn_seq')::bigint = $3",
                )
                .bind(session)
                .bind(output)
                .bind(turn)
                .fetch_one(&cluster.env.pool)
                .await;
                if found.is_ok_and(|c| c > 0) {
                    return Some(since(healed));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        if healed.elapsed() > cap {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A compactor (either copy: one queue group) answers a pre-send check.
async fn probe_compactor(cluster: &Cluster, session: Uuid, healed: Instant, cap: Duration) -> Option<f64> {
    let bus = &cluster.bus;
    let request = CompactRequest {
        session_id: SessionId(session),
        owner: owner(),
        model: Some("mock".into()),
        reserve_tokens: 0,
    };
    let body = serde_json::to_vec(&request).ok()?;
    loop {
        let asked = bus.client.request(bus.names.compact_subject(SessionId(session)), body.clone().into());
        if let Ok(Ok(reply)) = tokio::time::timeout(Duration::from_secs(3), asked).await {
            if serde_json::from_slice::<CompactReply>(&reply.payload).is_ok() {
                return Some(since(healed));
            }
        }
        if healed.elapsed() > cap {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The restarted copy itself says it is connected (serving, or standing by for a writer):
/// with two copies the kind serves on while one is down, so this is what shows that the
/// restarted one came back.
async fn probe_up(cluster: &Cluster, role: Role, copy: usize, healed: Instant, cap: Duration) -> Option<f64> {
    let path = {
        let slots = cluster.slots.lock().await;
        slots.iter().find(|s| s.role == role && s.copy == copy)?.process.log_path().to_path_buf()
    };
    let markers = up_markers(role);
    // Each run appends a start header to the same log; count the markers after the last.
    let header = "=== turnlog-testkit: started";
    loop {
        let text = std::fs::read(&path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
        let last_start = text.rfind(header).unwrap_or(0);
        if count_markers_in(&text[last_start..], markers) > 0 {
            return Some(since(healed));
        }
        if healed.elapsed() > cap {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn count_markers_in(text: &str, markers: &[&str]) -> usize {
    markers.iter().map(|m| text.matches(m).count()).sum()
}

/// Poison straight to TURNLOG_APPEND — undecodable, unknown op and kind, a payload that
/// does not decode, an unknown session, a foreign owner, a NUL character, an event over
/// 768 KiB — then a burst of client mistakes at both ingress copies. None of it may be
/// stored or block what follows.
async fn poison(cluster: &Cluster, shared: &Arc<Shared>) {
    let live: Vec<Uuid> = lock(&shared.sessions).iter().rev().take(4).copied().collect();
    let target = |i: usize| SessionId(live.get(i % live.len().max(1)).copied().unwrap_or_else(Uuid::now_v7));
    let user = |text: String| EventBody::UserMessage(UserMessage { text, ..Default::default() });
    let request = |session: SessionId, owner: &Owner, text: &str| {
        AppendRequest::append(session, owner, Uuid::now_v7(), &user(text.to_owned()))
    };
    let edit = |req: AppendRequest, field: &str, value: Value| {
        let mut v = serde_json::to_value(&req).unwrap_or(Value::Null);
        v[field] = value;
        (req.session_id, req.request_id, serde_json::to_vec(&v).unwrap_or_default())
    };
    let whole =
        |req: AppendRequest| (req.session_id, req.request_id, serde_json::to_vec(&req).unwrap_or_default());
    let cases: Vec<(SessionId, Uuid, Vec<u8>)> = vec![
        (target(0), Uuid::now_v7(), b"{not json".to_vec()),
        edit(request(target(1), &owner(), "poison: unknown op"), "op", json!("frobnicate")),
        edit(request(target(2), &owner(), "poison: unknown kind"), "kind", json!("no_such_kind")),
        edit(request(target(3), &owner(), "poison: bad payload"), "payload", json!({"text": 5})),
        whole(request(SessionId::new(), &owner(), "poison: unknown session")),
        whole(request(target(0), &Owner::parse("mallory").expect("a valid owner"), "poison: foreign owner")),
        whole(request(target(1), &owner(), "poison: a\u{0}b")),
        whole(request(target(2), &owner(), &"p".repeat(800 * 1024))),
    ];
    for (session, id, body) in cases {
        let msg_id = id.to_string();
        let published = cluster.bus.publish_append_raw(session, &msg_id, Bytes::from(body), None);
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), published).await {
            Counters::add(&shared.counters.poison_sent);
            lock(&shared.poison).push(id);
        }
    }
    // Client mistakes in a burst, from a client of its own.
    let mut mistaken = Client::new(10_000, cluster, shared);
    for _ in 0..20 {
        mistaken.mistake().await;
    }
}
