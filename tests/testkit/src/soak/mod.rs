//! The reliability soak (issue 11): real `turnlog` processes on a private nats-server and
//! Postgres, many chat clients, a schedule of kills, restarts and freezes, and a
//! Jepsen-style checker that compares everything a client saw acknowledged with the log.
//!
//! One machinery serves `turnlog-bench soak` (minutes, strict bounds) and the short CI test
//! (about a minute, a few faults, generous bounds):
//!
//! ```ignore
//! let report = turnlog_testkit::soak::run(SoakConfig::short(env!("CARGO_BIN_EXE_turnlog"))).await?;
//! println!("{}", report.render());
//! assert!(report.violations.is_empty());
//! ```

mod check;
mod client;
mod cluster;
mod faults;
mod report;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use faults::FaultKind;
pub use report::{FaultRow, RssLine, SoakReport, ViolationKind};

/// What to run and how strictly to judge it.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// The `turnlog` binary.
    pub bin: PathBuf,
    /// How long the clients send; faults run inside this span.
    pub duration: Duration,
    /// Concurrent chat clients, each with its own sessions.
    pub clients: usize,
    /// Faults in the order they are injected, one at a time, each after the previous one
    /// recovered; with `cycle` the list repeats until the load ends.
    pub faults: Vec<FaultKind>,
    pub cycle: bool,
    /// Load before the first fault.
    pub warmup: Duration,
    /// No fault starts this close to the end of the load, so the last one can recover.
    pub quiet_tail: Duration,
    /// A pause after each recovery before the next fault.
    pub gap: Duration,
    /// Recovery slower than this (from the end of a fault until the process kind serves
    /// again) is a violation.
    pub recovery_bound: Duration,
    /// Probes give up after this; a process kind not back by then "did not recover".
    pub recovery_cap: Duration,
    /// An interrupted turn must keep the text the client had `checkpoint_interval +
    /// checkpoint_slack` before the stream broke (the slack covers a checkpoint published
    /// in the instant of the kill and timer lateness on a loaded machine).
    pub checkpoint_interval: Duration,
    pub checkpoint_slack: Duration,
    /// Resident memory may grow at most this much (0.10 = 10%) from minute 2 to the end,
    /// judged only when the load lasts at least `rss_judged_from` + 2 minutes.
    pub rss_growth_limit: f64,
    pub rss_judged_from: Duration,
    /// How long the end waits for the workers to catch up before checking.
    pub settle: Duration,
    /// Seed of the clients' choices (messages, lengths, which ones leave or stop).
    pub seed: u64,
    /// Progress lines on stderr while running.
    pub progress: bool,
    /// Run on a three-node nats-server cluster (streams with three replicas), with four
    /// partitions spread over the two writers, instead of one nats-server and one partition.
    pub cluster: bool,
}

impl SoakConfig {
    /// The benchmark: every fault kind in turn for `minutes`, 30 clients, the issue's bounds.
    pub fn bench(bin: impl Into<PathBuf>, minutes: f64) -> SoakConfig {
        SoakConfig {
            bin: bin.into(),
            duration: Duration::from_secs_f64((minutes * 60.0).max(60.0)),
            clients: 30,
            faults: FaultKind::ALL.to_vec(),
            cycle: true,
            warmup: Duration::from_secs(20),
            quiet_tail: Duration::from_secs(25),
            gap: Duration::from_secs(3),
            recovery_bound: Duration::from_secs(15),
            recovery_cap: Duration::from_secs(90),
            checkpoint_interval: Duration::from_secs(2),
            checkpoint_slack: Duration::from_millis(300),
            rss_growth_limit: 0.10,
            rss_judged_from: Duration::from_secs(120),
            settle: Duration::from_secs(120),
            seed: 0x5eed_0011,
            progress: true,
            cluster: false,
        }
    }

    /// The CI version: about 75 s of load, one writer kill, one ingress kill and one
    /// nats-server restart; generous bounds for a loaded 2-core machine (the strict 15 s
    /// recovery bound is the benchmark's).
    pub fn short(bin: impl Into<PathBuf>) -> SoakConfig {
        SoakConfig {
            duration: Duration::from_secs(75),
            clients: 8,
            faults: vec![FaultKind::KillWriter, FaultKind::KillIngress, FaultKind::RestartNats],
            cycle: false,
            warmup: Duration::from_secs(8),
            quiet_tail: Duration::from_secs(10),
            gap: Duration::from_secs(2),
            recovery_bound: Duration::from_secs(60),
            recovery_cap: Duration::from_secs(90),
            checkpoint_slack: Duration::from_millis(1500),
            settle: Duration::from_secs(120),
            progress: false,
            ..SoakConfig::bench(bin, 1.0)
        }
    }

    /// The CI version on a three-node NATS cluster (issue 26): about 75 s of load while the
    /// node leading TURNLOG_APPEND, then the one leading TURNLOG_EVENTS, is SIGKILLed (and
    /// restarted 15 s later), then a writer; the write outage of each leader
    /// kill is reported.
    pub fn short_cluster(bin: impl Into<PathBuf>) -> SoakConfig {
        SoakConfig {
            cluster: true,
            faults: vec![FaultKind::KillAppendLeader, FaultKind::KillEventsLeader, FaultKind::KillWriter],
            ..SoakConfig::short(bin)
        }
    }

    /// `TURNLOG_MAX_TURNS_PER_OWNER` of each ingress copy: every client is the one owner
    /// `local`, and with a copy down all of them (and the probes) use the other, so the cap
    /// sits well above the clients or their turns would be refused with 429.
    pub fn turn_cap_per_owner(&self) -> usize {
        self.clients * 2 + 8
    }
}

/// Runs the soak and checks the outcome. Errors only when the system cannot be set up;
/// everything found wrong while running is in [`SoakReport::violations`].
pub async fn run(config: SoakConfig) -> anyhow::Result<SoakReport> {
    let config = Arc::new(config);
    let cluster = Arc::new(cluster::Cluster::start(&config).await?);
    let shared = Arc::new(Shared::new(Arc::clone(&config)));
    shared.say(&format!(
        "soak: {} clients for {:.0} s on {}; per-owner turn cap {}; ingress {}; logs under {}",
        config.clients,
        config.duration.as_secs_f64(),
        cluster.topology(),
        config.turn_cap_per_owner(),
        cluster.ingress.join(" "),
        crate::process::log_dir().display()
    ));
    let probes = faults::Probes::create(&cluster).await?;

    let stop_at = Instant::now() + config.duration;
    let sampler = tokio::spawn(cluster::sample_rss(Arc::clone(&cluster), Arc::clone(&shared), stop_at));
    let clearer = tokio::spawn(cluster::clear_mock_log(Arc::clone(&cluster), stop_at));
    let mut clients = Vec::new();
    for id in 0..config.clients {
        let client = client::Client::new(id, &cluster, &shared);
        clients.push(tokio::spawn(client.run(stop_at)));
    }
    let progress = tokio::spawn(report::progress(Arc::clone(&shared), stop_at));

    let runs = faults::run_schedule(&cluster, &shared, &probes, stop_at).await;
    for c in clients {
        // Each client's last operation is bounded by its own deadlines.
        let _ = tokio::time::timeout(Duration::from_secs(180), c).await;
    }
    progress.abort();
    clearer.abort();
    let _ = sampler.await;
    shared.say("load finished; waiting for the workers, then checking");

    let checked = check::check(&cluster, &shared).await;
    let mut report = report::build(&config, &shared, runs, checked);
    report.durable = cluster.env.durable().await.unwrap_or(false);
    cluster.shutdown().await;
    Ok(report)
}

/// What the clients, the fault schedule and the checker share while running.
pub(crate) struct Shared {
    pub config: Arc<SoakConfig>,
    pub started: Instant,
    /// Every turn stream a client followed.
    pub records: Mutex<Vec<client::TurnRecord>>,
    /// Every user message a client sent: (session, text).
    pub sent: Mutex<Vec<(uuid::Uuid, String)>>,
    /// Appends the writer probe saw committed: (event id, session, seq, when).
    pub probe_acks: Mutex<Vec<(uuid::Uuid, uuid::Uuid, i64, f64)>>,
    /// Request ids of the poison published straight to TURNLOG_APPEND.
    pub poison: Mutex<Vec<uuid::Uuid>>,
    /// Sessions the clients use, for poison aimed at live sessions.
    pub sessions: Mutex<Vec<uuid::Uuid>>,
    /// When an ingress copy was SIGKILLed (Unix seconds): the moment its turns died.
    pub ingress_kills: Mutex<Vec<f64>>,
    /// Fault windows: (kind, run index, wall-clock start in Unix seconds).
    pub windows: Mutex<Vec<(FaultKind, usize, f64)>>,
    pub violations: Mutex<Vec<report::Violation>>,
    pub rss: Mutex<Vec<report::RssSample>>,
    /// Set from a fault's start until shortly after its recovery: a 503 is then expected.
    pub disturbed: AtomicBool,
    pub counters: Counters,
}

/// Tallies shown in the report.
#[derive(Default)]
pub(crate) struct Counters {
    pub turns: AtomicUsize,
    pub completed: AtomicUsize,
    pub interrupted: AtomicUsize,
    pub stopped: AtomicUsize,
    pub failed: AtomicUsize,
    pub cut: AtomicUsize,
    pub left_early: AtomicUsize,
    pub reattached: AtomicUsize,
    pub retries: AtomicUsize,
    pub resends: AtomicUsize,
    pub model_faults: AtomicUsize,
    pub mistakes: AtomicUsize,
    pub mistakes_503: AtomicUsize,
    pub unavailable_503: AtomicUsize,
    pub unavailable_503_calm: AtomicUsize,
    pub gave_up: AtomicUsize,
    pub poison_sent: AtomicUsize,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicUsize) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl Shared {
    fn new(config: Arc<SoakConfig>) -> Shared {
        START.get_or_init(now_s);
        Shared {
            config,
            started: Instant::now(),
            records: Mutex::default(),
            sent: Mutex::default(),
            probe_acks: Mutex::default(),
            poison: Mutex::default(),
            sessions: Mutex::default(),
            ingress_kills: Mutex::default(),
            windows: Mutex::default(),
            violations: Mutex::default(),
            rss: Mutex::default(),
            disturbed: AtomicBool::new(false),
            counters: Counters::default(),
        }
    }

    /// Records a violation found now.
    pub(crate) fn violation(&self, kind: ViolationKind, detail: String) {
        self.violation_at(kind, detail, now_s());
    }

    /// Records a violation about something that happened at `at` (Unix seconds), which
    /// decides the fault it is reported under.
    pub(crate) fn violation_at(&self, kind: ViolationKind, detail: String, at: f64) {
        if self.config.progress {
            eprintln!("[{:>6.1}s] VIOLATION {kind:?}: {detail}", self.elapsed());
        }
        lock(&self.violations).push(report::Violation { kind, detail, at });
    }

    pub(crate) fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// A progress line (stderr; shown by the benchmark, captured in CI).
    pub(crate) fn say(&self, line: &str) {
        eprintln!("[{:>6.1}s] {line}", self.elapsed());
    }
}

/// Locks a std mutex; a panic elsewhere while holding it leaves plain records usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// When the running soak started (Unix seconds), for times shown relative to it.
static START: std::sync::OnceLock<f64> = std::sync::OnceLock::new();

/// A Unix time as seconds since the soak started.
pub(crate) fn rel(t: f64) -> f64 {
    t - START.get().copied().unwrap_or(0.0)
}

/// Wall-clock time in Unix seconds: comparable with the timestamps the writer stores (the
/// APPEND stream's, taken on this same machine).
pub(crate) fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// A small deterministic generator (SplitMix64): the clients' choices repeat for a seed
/// without a `rand` dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (`lo` when the range is empty).
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next() % (hi - lo)
    }

    pub(crate) fn percent(&mut self, p: u64) -> bool {
        self.range(0, 100) < p
    }

    pub(crate) fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.range(0, items.len() as u64) as usize]
    }
}
