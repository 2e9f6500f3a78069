//! The writer as a real process: a standby takes over when the active copy is SIGKILLed
//! under load, and a checker proves every acknowledged append is stored exactly once, with
//! gapless seqs, and reached the committed-event feed.

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use turnlog_core::bus::{append_and_wait, AppendRequest, Bus, CommittedEvent, OutcomeStatus};
use turnlog_core::events::{EventBody, UserMessage};
use turnlog_core::ids::SessionId;
use turnlog_testkit::{eventually, test_env, TestEnv, TurnlogProcess};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");

/// Appends `n` messages to `session`, resending the same request id after any failure
/// until acknowledged, as a well-behaved producer does. Returns request id → seq.
async fn produce(bus: Bus, env_pool: sqlx::PgPool, session: SessionId, n: usize) -> Vec<(Uuid, i64)> {
    let mut acked = Vec::new();
    for i in 0..n {
        let body =
            EventBody::UserMessage(UserMessage { text: format!("{session} #{i}"), ..Default::default() });
        let req = AppendRequest::append(session, "alice", Uuid::now_v7(), &body);
        loop {
            match append_and_wait(&bus, &env_pool, &req, Duration::from_secs(3)).await {
                Ok(o) if o.is_applied() => {
                    acked.push((req.request_id, o.seq.expect("applied outcome has a seq")));
                    break;
                }
                Ok(o) => panic!("request rejected: {o:?}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    acked
}

/// Every committed event in the feed, by msg id.
async fn feed(env: &TestEnv, bus: &Bus) -> HashMap<String, CommittedEvent> {
    let stream = bus.js.get_stream(bus.names.events_stream()).await.unwrap();
    let consumer =
        stream.create_consumer(async_nats_ordered(format!("{}.events.>", env.bus_prefix))).await.unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = HashMap::new();
    while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(700), messages.next()).await {
        let e: CommittedEvent = serde_json::from_slice(&m.payload).unwrap();
        assert!(out.insert(e.msg_id(), e).is_none(), "an event reached the feed twice");
    }
    out
}

fn async_nats_ordered(filter: String) -> async_nats::jetstream::consumer::pull::OrderedConfig {
    async_nats::jetstream::consumer::pull::OrderedConfig { filter_subject: filter, ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_after_sigkill_with_nothing_lost_or_doubled() {
    let env = test_env().await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
    bus.ensure_topology(None).await.unwrap();
    let mut active = TurnlogProcess::start(BIN, &env, &["writer"], &[]);

    let sessions: Vec<SessionId> = (0..6).map(|_| SessionId::new()).collect();
    for s in &sessions {
        let o = append_and_wait(
            &bus,
            &env.pool,
            &AppendRequest::create(*s, "alice", None),
            Duration::from_secs(20),
        )
        .await
        .unwrap();
        assert_eq!(o.status, OutcomeStatus::Committed);
    }
    let mut standby = TurnlogProcess::start(BIN, &env, &["writer"], &[]);

    let producers: Vec<_> =
        sessions.iter().map(|s| tokio::spawn(produce(bus.clone(), env.pool.clone(), *s, 120))).collect();
    // Kill the active writer once load is flowing.
    eventually(Duration::from_secs(20), || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM session_events").fetch_one(&env.pool).await.ok()?;
        (n > 100).then_some(())
    })
    .await;
    active.kill();

    let mut acked: HashMap<Uuid, (SessionId, i64)> = HashMap::new();
    for (p, s) in producers.into_iter().zip(&sessions) {
        for (id, seq) in p.await.unwrap() {
            acked.insert(id, (*s, seq));
        }
    }
    assert_eq!(acked.len(), 6 * 120);

    // The checker: every acknowledged append stored once, at the seq its producer saw.
    let rows: Vec<(Uuid, Uuid, i64)> = sqlx::query_as("SELECT event_id, session_id, seq FROM session_events")
        .fetch_all(&env.pool)
        .await
        .unwrap();
    let stored: HashMap<Uuid, (Uuid, i64)> = rows.iter().map(|(e, s, q)| (*e, (*s, *q))).collect();
    assert_eq!(stored.len(), rows.len(), "an event id stored twice");
    for (id, (s, seq)) in &acked {
        assert_eq!(stored.get(id), Some(&(s.0, *seq)), "acknowledged append {id} lost or moved");
    }
    for s in &sessions {
        let mut seqs: Vec<i64> = rows.iter().filter(|r| r.1 == s.0).map(|r| r.2).collect();
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=121).collect::<Vec<_>>(), "seqs of {s} not gapless");
    }
    // And every committed event reached the feed, once.
    let feed = eventually(Duration::from_secs(20), || async {
        let f = feed(&env, &bus).await;
        (f.len() == rows.len()).then_some(f)
    })
    .await;
    for (id, s, seq) in &rows {
        let e = &feed[&format!("{s}:{seq}")];
        assert_eq!(e.event_id, *id);
    }
    assert!(standby.is_running(), "the standby serves on");
    standby.terminate();
    assert!(standby.wait_exit(Duration::from_secs(10)).await.is_some(), "SIGTERM stops the writer");
}
