//! TURNLOG_STREAM_REPLICAS on real servers (issue 26): a three-node nats-server cluster of
//! the test's own, streams created with three replicas, `turnlog migrate --bus` as an
//! operator runs it (R1 → R3, the lease bucket still working, a second run a no-op), and
//! the warning a service logs when it finds fewer replicas than configured, and a worker
//! whose node freezes.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::process::Output;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnlog_core::events::EventKind;

use turnlog_core::events::{EventBody, UserMessage};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{append_and_wait, AppendRequest, Bus, BusNames, CommittedEvent};
use turnlog_runtime::lease::TurnLeases;
use turnlog_runtime::worker::{ConsumerSettings, Delivery, HandleError, Handler, Worker};
use turnlog_testkit::{eventually, private_nats_cluster, test_env, TurnlogProcess};

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");

/// A bus prefix of the test's own (the cluster is too, but names stay unique anyway).
fn prefix() -> String {
    format!("r{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// The four streams ensure_topology makes, in its order.
fn streams(prefix: &str) -> [String; 7] {
    let n = BusNames::new(prefix).unwrap();
    [
        n.append_stream(),
        n.events_stream(),
        n.dead_stream(),
        format!("KV_{}", n.turns_bucket()),
        n.tool_calls_stream(),
        format!("KV_{}", n.tool_catalog_bucket()),
        format!("KV_{}", n.tool_claims_bucket()),
    ]
}

/// A stream's configured replicas and the peers its cluster info lists beside the leader.
async fn replicas(bus: &Bus, stream: &str) -> (usize, usize) {
    let mut s = bus.js.get_stream(stream).await.unwrap();
    let info = s.info().await.unwrap();
    let peers = info.cluster.as_ref().map_or(0, |c| c.replicas.len());
    (info.config.num_replicas, peers)
}

/// Waits (up to 15 s) until every stream has `want` replicas and `want - 1` peers listed.
async fn all_have(bus: &Bus, prefix: &str, want: usize) {
    for stream in streams(prefix) {
        let got = eventually(Duration::from_secs(15), || async {
            let got = replicas(bus, &stream).await;
            (got == (want, want - 1)).then_some(got)
        })
        .await;
        assert_eq!(got, (want, want - 1), "{stream}");
    }
}

/// `turnlog migrate --bus` as a process on `nats_url`, with TURNLOG_STREAM_REPLICAS=`replicas`
/// and no other TURNLOG_ setting or DATABASE_URL from the test's environment.
async fn migrate_bus(nats_url: &str, prefix: &str, replicas: &str) -> Output {
    let mut command = tokio::process::Command::new(BIN);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TURNLOG_") {
            command.env_remove(key);
        }
    }
    command
        .args(["migrate", "--bus"])
        .env_remove("DATABASE_URL")
        .env("NATS_URL", nats_url)
        .env("TURNLOG_BUS_PREFIX", prefix)
        .env("TURNLOG_STREAM_REPLICAS", replicas)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(30), command.output())
        .await
        .expect("in time")
        .expect("runs");
    eprintln!(
        "$ turnlog migrate --bus\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_on_a_three_node_cluster_has_three_replicas() {
    let cluster = private_nats_cluster().await;
    let prefix = prefix();
    let bus = Bus::connect(&cluster.urls(), &prefix, 1).await.unwrap().with_replicas(3);
    bus.ensure_topology(None).await.unwrap();
    all_have(&bus, &prefix, 3).await;
    // A second service starting finds them as they are.
    bus.ensure_topology(None).await.unwrap();
    all_have(&bus, &prefix, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_bus_brings_single_replica_streams_to_three() {
    let cluster = private_nats_cluster().await;
    let prefix = prefix();
    let bus = Bus::connect(&cluster.urls(), &prefix, 1).await.unwrap();
    bus.ensure_topology(None).await.unwrap();
    all_have(&bus, &prefix, 1).await;
    let leases = TurnLeases::open(&bus).await.unwrap();
    let held = leases.acquire(SessionId::new(), "before").await.unwrap().unwrap();

    let first = migrate_bus(&cluster.urls(), &prefix, "3").await;
    assert!(first.status.success());
    let expected: Vec<String> = streams(&prefix).iter().map(|s| format!("{s}: replicas 1 → 3")).collect();
    assert_eq!(lines(&first), expected);
    all_have(&bus, &prefix, 3).await;

    // The lease bucket works on its migrated stream: a lease taken before is still held
    // and can be renewed and released; a new one is taken, refused twice, renewed, released.
    assert!(leases.is_held(held.session).await.unwrap());
    let held = leases.renew(held, "before").await.unwrap().expect("renewed after the migration");
    leases.release(held).await.unwrap();
    let session = SessionId::new();
    let lease = leases.acquire(session, "after").await.unwrap().expect("taken");
    assert!(leases.acquire(session, "other").await.unwrap().is_none(), "held once");
    let lease = leases.renew(lease, "after").await.unwrap().expect("renewed");
    leases.release(lease).await.unwrap();
    assert!(!leases.is_held(session).await.unwrap());

    let second = migrate_bus(&cluster.urls(), &prefix, "3").await;
    assert!(second.status.success());
    let expected: Vec<String> =
        streams(&prefix).iter().map(|s| format!("{s}: replicas 3 (unchanged)")).collect();
    assert_eq!(lines(&second), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_bus_refuses_replicas_other_than_one_three_or_five() {
    let out = migrate_bus("nats://127.0.0.1:1", "turnlog", "2").await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("1, 3 or 5") && err.contains("TURNLOG_STREAM_REPLICAS"), "{err}");
}

/// A writer configured for three replicas that finds single-replica streams says so,
/// naming the command, and serves on (it does not change them itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_warns_about_fewer_replicas_than_configured() {
    let env = test_env().await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
    bus.ensure_topology(None).await.unwrap();
    let mut writer = TurnlogProcess::start(BIN, &env, &["writer"], &[("TURNLOG_STREAM_REPLICAS", "3")]);
    let append = streams(&env.bus_prefix)[0].clone();
    let line = eventually(Duration::from_secs(20), || async {
        writer.log_tail(200).lines().find(|l| l.contains(&append) && l.contains("replica")).map(str::to_owned)
    })
    .await;
    assert!(
        line.contains("has 1 replica") && line.contains("is 3") && line.contains("turnlog migrate --bus"),
        "{line}"
    );
    assert!(writer.is_running(), "the writer serves on");
    let (n, _) = replicas(&bus, &append).await;
    assert_eq!(n, 1, "the service leaves the stream as it is");
    writer.terminate();
}

/// A writer running while `turnlog migrate --bus` moves its streams from one replica to
/// three keeps applying: appends before, right after and a while after the move are all
/// applied within their deadlines (its reader makes a new consumer when the old one goes
/// with the stream's move).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_keeps_applying_through_migrate_bus() {
    let cluster = private_nats_cluster().await;
    let env = turnlog_testkit::test_env_on(None, Some(&cluster.urls())).await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
    bus.ensure_topology(None).await.unwrap();
    let mut writer = TurnlogProcess::start(BIN, &env, &["writer"], &[("RUST_LOG", "info")]);
    let (session, alice) = (SessionId::new(), Owner::parse("alice").unwrap());
    let create = AppendRequest::create(session, &alice, None);
    let o = append_and_wait(&bus, &env.pool, &create, Duration::from_secs(30)).await.unwrap();
    assert!(o.is_applied());
    let append = |i: usize| {
        let body = EventBody::UserMessage(UserMessage { text: format!("message {i}"), ..Default::default() });
        AppendRequest::append(session, &alice, uuid::Uuid::now_v7(), &body)
    };
    let o = append_and_wait(&bus, &env.pool, &append(0), Duration::from_secs(30)).await.unwrap();
    assert_eq!(o.seq, Some(2));

    let moved = migrate_bus(&cluster.urls(), &env.bus_prefix, "3").await;
    assert!(moved.status.success());
    for i in 1..=10 {
        let o = append_and_wait(&bus, &env.pool, &append(i), Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("append {i} after the move: {e}\n{}", writer.log_tail(40)));
        assert_eq!(o.seq, Some(i as i64 + 2));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(writer.is_running());
    writer.terminate();
}

/// Records when each event (by seq) was handled.
struct Record(tokio::sync::mpsc::UnboundedSender<(i64, Instant)>);

impl Handler for Record {
    async fn handle(&self, event: CommittedEvent, _: Delivery) -> Result<(), HandleError> {
        let _ = self.0.send((event.seq, Instant::now()));
        Ok(())
    }
}

/// When the event `seq` was handled, waiting up to `within` (None: not by then).
async fn handled(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<(i64, Instant)>,
    seq: i64,
    within: Duration,
) -> Option<Instant> {
    let wait = async {
        loop {
            match rx.recv().await {
                Some((s, at)) if s == seq => return at,
                Some(_) => continue,
                None => panic!("the worker stopped"),
            }
        }
    };
    tokio::time::timeout(within, wait).await.ok()
}

/// The leader a stream (or, with `consumer`, one of its consumers) names, as a node index.
async fn leader(bus: &Bus, stream: &str, consumer: Option<&str>) -> Option<usize> {
    let mut s = bus.js.get_stream(stream).await.ok()?;
    let cluster = match consumer {
        Some(name) => s.consumer_info(name).await.ok()?.cluster.clone(),
        None => s.info().await.ok()?.cluster.clone(),
    };
    cluster?.leader?.strip_prefix('n')?.parse().ok()
}

/// Waits until neither the stream nor its consumer is led by node `not`, asking a leader
/// there to step down (a thaw can bring leadership back to it). A step-down starts an
/// election that takes seconds on nats-server 2.9, and the leader the cluster reports
/// meanwhile is the old one: asking again before it settles only starts more elections
/// (the new leader steps down too, and `not` can win again), so each ask waits its turn.
async fn lead_elsewhere(bus: &Bus, stream: &str, consumer: &str, not: usize) {
    const SETTLE: Duration = Duration::from_secs(3);
    let deadline = Instant::now() + Duration::from_secs(90);
    let (mut stream_asked, mut consumer_asked) = (None::<Instant>, None::<Instant>);
    let due = |asked: Option<Instant>| asked.is_none_or(|at| at.elapsed() >= SETTLE);
    loop {
        let leaders = (leader(bus, stream, None).await, leader(bus, stream, Some(consumer)).await);
        match leaders {
            (Some(s), Some(c)) if s != not && c != not => return,
            (s, c) => {
                if s == Some(not) && due(stream_asked) {
                    let _: Result<serde_json::Value, _> =
                        bus.js.request(format!("STREAM.LEADER.STEPDOWN.{stream}"), &()).await;
                    stream_asked = Some(Instant::now());
                }
                if c == Some(not) && due(consumer_asked) {
                    let _: Result<serde_json::Value, _> =
                        bus.js.request(format!("CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}"), &()).await;
                    consumer_asked = Some(Instant::now());
                }
            }
        }
        assert!(Instant::now() < deadline, "n{not} still leads {stream} or {consumer}: {leaders:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A worker's copy whose node freezes (SIGSTOP 5 s, SIGCONT) handles an event published
/// meanwhile within 3 s of the thaw, in each of three rounds (issue 38). The copy is on
/// the node that leads neither the feed nor the worker's consumer, and the event comes
/// right after the freeze starts, while the copy's last pull request is still open at the
/// consumer's leader: the leader sends the event toward the frozen node at once. A copy
/// that gives its pull requests up after 2 s with an inbox each dropped that inbox before
/// the thaw, and the event came again only after its ack wait (30 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_a_frozen_node_handles_what_came_meanwhile_soon_after_the_thaw() {
    let mut cluster = private_nats_cluster().await;
    let prefix = prefix();
    let admin = Bus::connect(&cluster.urls(), &prefix, 1).await.unwrap().with_replicas(3);
    admin.ensure_topology(None).await.unwrap();
    all_have(&admin, &prefix, 3).await;
    let events = admin.names.events_stream();
    let session = SessionId::new();
    let publish = |bus: Bus, seq: i64| async move {
        let event = json!({
            "session_id": session, "owner": "alice", "seq": seq, "event_id": uuid::Uuid::new_v4(),
            "kind": "assistant_turn", "payload": {}, "created_at": "2026-12-02T12:00:00Z",
        });
        let subject = bus.names.events_subject("assistant_turn", session);
        let payload = serde_json::to_vec(&event).unwrap().into();
        let published = async { bus.js.publish(subject, payload).await.ok()?.await.ok() };
        published.await.unwrap_or_else(|| panic!("event {seq} not published"));
    };
    let settings = ConsumerSettings { ack_wait: Duration::from_secs(30), ..ConsumerSettings::default() };
    let worker = Worker::new("frozen", &[EventKind::AssistantTurn], settings);
    let run = |bus: Bus| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (worker, stop) = (worker.clone(), CancellationToken::new());
        let shutdown = stop.clone().cancelled_owned();
        let task =
            tokio::spawn(
                async move { worker.run(bus, Arc::new(Record(tx)), Arc::default(), shutdown).await },
            );
        (rx, stop, task)
    };
    // The consumer made (one event handled), the copy goes to the node leading neither.
    let (mut rx, stop, task) = run(admin.clone());
    publish(admin.clone(), 1).await;
    handled(&mut rx, 1, Duration::from_secs(30)).await.expect("handled before any fault");
    stop.cancel();
    task.await.unwrap();
    let consumer = worker.consumer_name(&admin);
    let busy = [leader(&admin, &events, None).await, leader(&admin, &events, Some(&consumer)).await]
        .map(|n| n.expect("a leader"));
    let frozen = (0..3).rfind(|n| !busy.contains(n)).unwrap();
    let other = (0..3).find(|n| *n != frozen).unwrap();
    let (bus, publisher) = (
        Bus::connect(&cluster.url(frozen), &prefix, 1).await.unwrap(),
        Bus::connect(&cluster.url(other), &prefix, 1).await.unwrap(),
    );
    let (mut rx, stop, task) = run(bus);
    publish(publisher.clone(), 2).await;
    handled(&mut rx, 2, Duration::from_secs(30)).await.expect("handled on the node to freeze");

    let mut recoveries = Vec::new();
    for seq in 3..6 {
        lead_elsewhere(&publisher, &events, &consumer, frozen).await;
        // A pull request of the copy's is open at the leader (each lasts 1 s).
        tokio::time::sleep(Duration::from_millis(300)).await;
        cluster.stop(frozen);
        let frozen_at = Instant::now();
        publish(publisher.clone(), seq).await;
        tokio::time::sleep_until((frozen_at + Duration::from_secs(5)).into()).await;
        cluster.cont(frozen);
        let thawed = Instant::now();
        let at = handled(&mut rx, seq, Duration::from_secs(45)).await.expect("handled at last");
        recoveries.push(at.saturating_duration_since(thawed));
    }
    stop.cancel();
    task.await.unwrap();
    eprintln!("handled after the thaw: {recoveries:?} (n{frozen} frozen)");
    assert!(recoveries.iter().all(|r| *r <= Duration::from_secs(3)), "{recoveries:?}");
}
