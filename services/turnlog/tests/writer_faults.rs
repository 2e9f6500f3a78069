//! The writer as a real process under load while things fail: SIGKILL (with a standby, and
//! restarted alone), nats-server restarted, Postgres restarted, nats-server frozen. After
//! each, a checker proves every acknowledged append is stored once, with gapless seqs, and
//! reached the committed-event feed. Fault servers are private instances on fixed ports.
//! And a request whose first publish is lost.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{append_and_wait, AppendRequest, Bus, CONFIRM_AFTER};
use turnlog_testkit::checker::{check_log, produce, Acked};
use turnlog_testkit::{
    eventually, free_port, private_nats, private_postgres, test_env, test_env_on, TestEnv, TurnlogProcess,
};

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");
const SESSIONS: usize = 6;
const PER_SESSION: usize = 150;

type Producers = Vec<(SessionId, tokio::task::JoinHandle<(usize, Vec<(uuid::Uuid, i64)>)>)>;

/// Creates the sessions (waiting for a writer) and starts one producer per session.
async fn start_load(env: &TestEnv) -> (Bus, Producers) {
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
    bus.ensure_topology(None).await.unwrap();
    let (mut producers, alice) = (Vec::new(), Owner::parse("alice").unwrap());
    for _ in 0..SESSIONS {
        let s = SessionId::new();
        let o = append_and_wait(
            &bus,
            &env.pool,
            &AppendRequest::create(s, &alice, None),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        assert!(o.is_applied());
        let task = tokio::spawn(produce(bus.clone(), env.pool.clone(), alice.clone(), s, PER_SESSION));
        producers.push((s, task));
    }
    // Let load flow before the fault.
    eventually(Duration::from_secs(30), || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM session_events").fetch_one(&env.pool).await.ok()?;
        (n > 150).then_some(())
    })
    .await;
    (bus, producers)
}

/// A writer process on `env` with load flowing, not yet all applied: a fault injected next
/// hits while load flows.
async fn writer_under_load(env: &TestEnv) -> (TurnlogProcess, Bus, Producers) {
    let writer = TurnlogProcess::start(BIN, env, &["writer"], &[]);
    let (bus, producers) = start_load(env).await;
    let before: i64 =
        sqlx::query_scalar("SELECT count(*) FROM session_events").fetch_one(&env.pool).await.unwrap();
    assert!(before < (SESSIONS * (PER_SESSION + 1)) as i64, "the fault must hit while load is flowing");
    (writer, bus, producers)
}

/// Waits for the producers (bounded) and runs the checker.
async fn finish_and_check(env: &TestEnv, bus: &Bus, producers: Producers) {
    let mut acked = Acked::new();
    for (s, task) in producers {
        let (_resent, pairs) = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("producers did not finish: the writer did not recover")
            .unwrap();
        assert_eq!(pairs.len(), PER_SESSION);
        acked.extend(pairs.into_iter().map(|(id, seq)| (id, (s, seq))));
    }
    check_log(env, bus, &acked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_after_sigkill() {
    let env = test_env().await;
    let mut active = TurnlogProcess::start(BIN, &env, &["writer"], &[]);
    let (bus, producers) = start_load(&env).await;
    let mut standby = TurnlogProcess::start(BIN, &env, &["writer"], &[]);
    active.kill();
    finish_and_check(&env, &bus, producers).await;
    assert!(standby.is_running(), "the standby serves on");
    standby.terminate();
    assert!(standby.wait_exit(Duration::from_secs(10)).await.is_some(), "SIGTERM stops the writer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_killed_and_restarted_under_load() {
    let env = test_env().await;
    let mut writer = TurnlogProcess::start(BIN, &env, &["writer"], &[]);
    let (bus, producers) = start_load(&env).await;
    writer.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    writer.restart().await;
    finish_and_check(&env, &bus, producers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_under_load() {
    let mut nats = private_nats(free_port()).await;
    let env = test_env_on(None, Some(&nats.url())).await;
    let (_writer, bus, producers) = writer_under_load(&env).await;
    nats.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    nats.restart().await;
    // Producers may or may not see the outage (their retries can outlast it); either way
    // nothing acknowledged may be lost or doubled.
    finish_and_check(&env, &bus, producers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_under_load() {
    let mut pg = private_postgres(free_port()).await;
    let env = test_env_on(Some(&pg.url()), None).await;
    let (_writer, bus, producers) = writer_under_load(&env).await;
    pg.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    pg.restart().await;
    finish_and_check(&env, &bus, producers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_frozen_for_five_seconds_under_load() {
    let mut nats = private_nats(free_port()).await;
    let env = test_env_on(None, Some(&nats.url())).await;
    let (_writer, bus, producers) = writer_under_load(&env).await;
    nats.stop();
    tokio::time::sleep(Duration::from_secs(5)).await;
    nats.cont();
    finish_and_check(&env, &bus, producers).await;
}

/// `append_and_wait` publishes a request without asking for a PubAck (DESIGN §6), and one
/// that is lost is published again with a PubAck when no outcome has come after
/// CONFIRM_AFTER. Here the first publish finds no stream (the bus prefix's streams are not
/// made yet: NATS drops it, as it does while a stream has no leader); the writer, started
/// meanwhile, makes them, and the confirming publish is stored and committed, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_whose_first_publish_is_lost_is_confirmed_and_committed_once() {
    let env = test_env().await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
    let create = AppendRequest::create(SessionId::new(), &Owner::parse("alice").unwrap(), None);
    let started = std::time::Instant::now();
    let append = tokio::spawn({
        let (bus, pool, create) = (bus.clone(), env.pool.clone(), create.clone());
        async move { append_and_wait(&bus, &pool, &create, Duration::from_secs(30)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(bus.js.get_stream(bus.names.append_stream()).await.is_err(), "no stream took the first publish");
    let mut writer = TurnlogProcess::start(BIN, &env, &["writer"], &[]);
    let outcome = append.await.unwrap().unwrap_or_else(|e| panic!("{e}\n{}", writer.log_tail(40)));
    assert!(outcome.is_applied(), "{outcome:?}");
    assert!(started.elapsed() >= CONFIRM_AFTER, "the outcome came only after the confirming publish");
    let mut stream = bus.js.get_stream(bus.names.append_stream()).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1, "stored once");
    writer.terminate();
}
