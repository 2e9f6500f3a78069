//! Partitions spread over writer processes (issue 26, DESIGN §6 Scale-out): four partitions,
//! writers 1 → 2 → 3 → 2 (the last step a SIGKILL) under steady appends. At every step each
//! partition has one holder, the shares differ by at most one and settle within 10 s; at
//! the end the checker proves every acknowledged append is stored once, in order, gapless,
//! and on the feed. A writer whose host drops off the network hands its partitions over
//! within the same 10 s, and a deposed writer that comes back applies nothing.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{append_and_wait, AppendRequest, Bus};
use turnlog_testkit::checker::{check_log, produce_while, Acked};
use turnlog_testkit::{
    free_port, private_nats_for, private_postgres_for, test_env, test_env_on, test_host, TestEnv,
    TurnlogProcess,
};

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");
const PARTITIONS: u32 = 4;
/// The bound on settling after a writer comes or goes.
const SETTLE: Duration = Duration::from_secs(10);

/// Partition → the pid of the writer process holding it.
async fn holders(env: &TestEnv) -> BTreeMap<u32, u32> {
    turnlog_writer::holders(&env.pool, PARTITIONS)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|(p, name)| Some((p, name.strip_prefix("turnlog-writer pid=")?.parse().ok()?)))
        .collect()
}

/// Waits until every partition is held, only by `live` writers, with shares within one of
/// P/W; returns the time it took and the shares by pid. Panics after [`SETTLE`].
async fn settled(env: &TestEnv, live: &[&TurnlogProcess]) -> (Duration, BTreeMap<u32, usize>) {
    let started = Instant::now();
    let pids: Vec<u32> = live.iter().map(|w| w.pid()).collect();
    let (lo, hi) = (PARTITIONS as usize / pids.len(), (PARTITIONS as usize).div_ceil(pids.len()));
    let mut last = BTreeMap::new();
    while started.elapsed() < SETTLE {
        let now = holders(env).await;
        let mut shares: BTreeMap<u32, usize> = pids.iter().map(|p| (*p, 0)).collect();
        let mut foreign = false;
        for pid in now.values() {
            match shares.get_mut(pid) {
                Some(n) => *n += 1,
                None => foreign = true,
            }
        }
        if now.len() == PARTITIONS as usize && !foreign && shares.values().all(|n| (lo..=hi).contains(n)) {
            return (started.elapsed(), shares);
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logs: Vec<String> = live.iter().map(|w| w.log_tail(30)).collect();
    panic!("writers {pids:?} did not settle within {SETTLE:?}; holders {last:?}\n{}", logs.join("\n---\n"));
}

/// A producer's failed attempts and (request id, seq) of each acknowledged append.
type Produced = (usize, Vec<(uuid::Uuid, i64)>);

/// Appends on two sessions a partition, a producer each, until [`Load::check`].
struct Load {
    stop: Arc<AtomicBool>,
    producers: Vec<(SessionId, tokio::task::JoinHandle<Produced>)>,
}

impl Load {
    async fn start(env: &TestEnv, bus: &Bus) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let mut sessions = Vec::new();
        while sessions.len() < 2 * PARTITIONS as usize {
            let s = SessionId::new();
            let p = bus.partition_of(s);
            if sessions.iter().filter(|t| bus.partition_of(**t) == p).count() < 2 {
                sessions.push(s);
            }
        }
        let (mut producers, alice) = (Vec::new(), Owner::parse("alice").unwrap());
        for s in &sessions {
            let create = AppendRequest::create(*s, &alice, None);
            assert!(append_and_wait(bus, &env.pool, &create, Duration::from_secs(30))
                .await
                .unwrap()
                .is_applied());
            let stop = stop.clone();
            let task = produce_while(bus.clone(), env.pool.clone(), alice.clone(), *s, move |_| {
                !stop.load(Ordering::Relaxed)
            });
            producers.push((*s, tokio::spawn(task)));
        }
        Load { stop, producers }
    }

    /// Stops the producers; the checker proves every acknowledged append is stored once,
    /// in order, gapless, and on the feed.
    async fn check(self, env: &TestEnv, bus: &Bus) {
        self.stop.store(true, Ordering::Relaxed);
        let mut acked = Acked::new();
        let mut retried = 0;
        for (s, task) in self.producers {
            let (failures, pairs) =
                tokio::time::timeout(Duration::from_secs(60), task).await.unwrap().unwrap();
            retried += failures;
            assert!(pairs.windows(2).all(|w| w[0].1 < w[1].1), "{s}: appends applied out of order");
            acked.extend(pairs.into_iter().map(|(id, seq)| (id, (s, seq))));
        }
        eprintln!("{} appends acknowledged, {retried} attempts retried", acked.len());
        check_log(env, bus, &acked).await;
    }
}

/// Waits until more than 20 events were stored after the first call; panics after 10 s.
async fn appends_flow(env: &TestEnv) {
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM session_events")
            .fetch_one(&env.pool)
            .await
            .unwrap()
    };
    let before = count().await;
    for _ in 0..100 {
        if count().await > before + 20 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("appends stopped flowing");
}

/// `env` with [`PARTITIONS`], and a bus on it with its streams made.
async fn partitioned(mut env: TestEnv) -> (TestEnv, Bus) {
    env.partitions = PARTITIONS;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, PARTITIONS).await.unwrap();
    bus.ensure_topology(None).await.unwrap();
    (env, bus)
}

/// [`settled`] with `live`, said as `step`, then appends flowing again.
async fn settled_and_flowing(env: &TestEnv, live: &[&TurnlogProcess], step: &str) {
    let (took, shares) = settled(env, live).await;
    eprintln!("{step}: {shares:?} after {took:?}");
    appends_flow(env).await;
}

fn start_writer(env: &TestEnv) -> TurnlogProcess {
    TurnlogProcess::start(BIN, env, &["writer"], &[("RUST_LOG", "info")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_spread_over_writers_as_they_come_and_go() {
    let (env, bus) = partitioned(test_env().await).await;

    let a = start_writer(&env);
    let (took, shares) = settled(&env, &[&a]).await;
    eprintln!("1 writer: {shares:?} after {took:?}");
    let load = Load::start(&env, &bus).await;
    appends_flow(&env).await;

    let mut b = start_writer(&env);
    settled_and_flowing(&env, &[&a, &b], "2 writers").await;

    let c = start_writer(&env);
    settled_and_flowing(&env, &[&a, &b, &c], "3 writers").await;

    b.kill();
    settled_and_flowing(&env, &[&a, &c], "SIGKILL one of 3").await;

    load.check(&env, &bus).await;
}

/// A writer whose host vanishes — its link goes down, no connection is closed, as when a
/// machine loses power — hands its partitions over within 10 s all the same: Postgres's
/// TCP keepalive on the writer's lock connections (probes after 3 s of silence) ends its
/// sessions, and with them its locks. The writers run on different hosts: one in a network
/// namespace of the test's own, one on this machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_whose_host_vanishes_hands_its_partitions_over_within_10_s() {
    let host = test_host();
    let pg = private_postgres_for(free_port(), &host).await;
    let nats = private_nats_for(free_port(), &host).await;
    let (env, bus) = partitioned(test_env_on(Some(&pg.url()), Some(&nats.url())).await).await;

    let (program, mut args) = host.command(BIN);
    args.push("writer".to_owned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let database = pg.url_from(&host, env.database_name());
    let mut remote =
        TurnlogProcess::start(program, &env, &args, &[("DATABASE_URL", &database), ("RUST_LOG", "info")]);
    settled(&env, &[&remote]).await;
    let local = start_writer(&env);
    let (took, shares) = settled(&env, &[&remote, &local]).await;
    eprintln!("a writer on each host: {shares:?} after {took:?}");
    let load = Load::start(&env, &bus).await;
    appends_flow(&env).await;

    host.cut();
    settled_and_flowing(&env, &[&local], "the test host cut off").await;
    load.check(&env, &bus).await;
    remote.kill();
}

/// A deposed writer comes back (issue 38). Of two writers under steady appends, one is
/// frozen (SIGSTOP) holding its partitions and batches in hand; its database sessions are
/// ended, as Postgres ends those of a writer it stops hearing from, so its locks go; the
/// other takes every partition and appends flow. Thawed (SIGCONT), the deposed writer
/// commits nothing of what it held (the position check fences it), claims its share back,
/// and the checker finds every acknowledged append stored once, in order, gapless, and on
/// the feed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_writer_that_comes_back_applies_nothing_twice() {
    let (env, bus) = partitioned(test_env().await).await;
    let mut a = start_writer(&env);
    let b = start_writer(&env);
    settled(&env, &[&a, &b]).await;
    let load = Load::start(&env, &bus).await;
    appends_flow(&env).await;

    a.stop();
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(format!("turnlog-writer pid={}", a.pid()))
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(ended > 0, "the frozen writer had database sessions");
    settled_and_flowing(&env, &[&b], "one writer frozen, its sessions ended").await;

    a.cont();
    settled_and_flowing(&env, &[&a, &b], "the deposed writer back").await;
    load.check(&env, &bus).await;
}
