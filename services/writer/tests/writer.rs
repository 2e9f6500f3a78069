//! The writer against a real Postgres and nats-server (in-process writer; the
//! kill-and-restart tests run the `turnlog` binary, in services/turnlog/tests).

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::RawMessageErrorKind;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnlog_core::events::*;
use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{
    append_and_wait, AppendOp, AppendRequest, Bus, CommittedEvent, DeadLetter, Expect, OutcomeStatus, Refusal,
};
use turnlog_runtime::lease::TurnLeases;
use turnlog_runtime::read::{self, Cursor, ListQuery};
use turnlog_testkit::{eventually, test_env, TestEnv};
use turnlog_writer::WriterConfig;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(10);

fn owner(name: &str) -> Owner {
    Owner::parse(name).unwrap()
}

struct Harness {
    env: TestEnv,
    bus: Bus,
    shutdown: CancellationToken,
    writer: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Harness {
    async fn start() -> Self {
        let env = test_env().await;
        let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
        bus.ensure_topology(None).await.unwrap();
        let (shutdown, writer) = spawn_writer(&env);
        Self { env, bus, shutdown, writer }
    }

    async fn stop(self) -> TestEnv {
        self.shutdown.cancel();
        self.writer.await.unwrap().unwrap();
        self.env
    }

    async fn create(&self, owner: &str) -> SessionId {
        let id = SessionId::new();
        let o = self.send(&AppendRequest::create(id, &Owner::parse(owner).unwrap(), None)).await;
        assert_eq!((o.status, o.seq), (OutcomeStatus::Committed, Some(1)));
        id
    }

    async fn send(&self, req: &AppendRequest) -> turnlog_runtime::bus::Outcome {
        append_and_wait(&self.bus, &self.env.pool, req, WAIT).await.unwrap()
    }

    async fn user(&self, session: SessionId, owner: &str, text: &str) -> turnlog_runtime::bus::Outcome {
        let body = EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() });
        self.send(&AppendRequest::append(session, &Owner::parse(owner).unwrap(), Uuid::now_v7(), &body)).await
    }

    /// An answer: a kind the feed stores (DESIGN §6).
    async fn answer(&self, session: SessionId, owner: &str) -> turnlog_runtime::bus::Outcome {
        let body = EventBody::AssistantTurn(AssistantTurn::default());
        self.send(&AppendRequest::append(session, &Owner::parse(owner).unwrap(), Uuid::now_v7(), &body)).await
    }

    async fn seqs(&self, session: SessionId) -> Vec<(i64, String)> {
        sqlx::query_as("SELECT seq, payload->>'text' FROM session_events WHERE session_id = $1 AND kind = 'user_message' ORDER BY seq")
            .bind(session.0)
            .fetch_all(&self.env.pool)
            .await
            .unwrap()
    }

    /// A stream's messages on `filter`, in order, read one by one by subject: an ordered
    /// consumer on `events.*.<session>` is refused by nats-server 2.9 on a feed that stores
    /// some kinds only.
    async fn stream_messages(&self, stream: &str, filter: &str) -> Vec<StreamMessage> {
        let Ok(s) = self.bus.js.get_stream_no_info(stream).await else { return vec![] };
        let (mut next, mut out) = (1, vec![]);
        loop {
            match s.get_first_raw_message_by_subject(filter, next).await {
                Ok(m) => {
                    next = m.sequence + 1;
                    out.push(m);
                }
                Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return out,
                Err(e) => panic!("reading {filter} from {stream}: {e}"),
            }
        }
    }
}

fn spawn_writer(env: &TestEnv) -> (CancellationToken, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let config = WriterConfig { backbone: env.backbone() };
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(turnlog_writer::run(config, shutdown.clone()));
    (shutdown, handle)
}

/// Every append on a connection waits on a subject of one inbox the connection subscribed
/// to once (DESIGN §6). Forty at once each hear their own outcome from the writer rather
/// than asking JetStream and the database after 500 ms, which a reply routed to the wrong
/// append, or lost, would make each of them do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_on_one_connection_each_hear_their_own_outcome() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    let before = turnlog_runtime::bus::appends_confirmed();
    let texts: Vec<String> = (0..40).map(|i| format!("m{i}")).collect();
    let outcomes = futures::future::join_all(texts.iter().map(|t| h.user(s, "alice", t))).await;
    let mut seqs: Vec<i64> = outcomes.iter().map(|o| o.seq.unwrap()).collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (2..42).collect::<Vec<i64>>());
    let confirmed = turnlog_runtime::bus::appends_confirmed() - before;
    assert!(confirmed < 10, "{confirmed} of 40 appends heard no outcome within 500 ms");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_producers_get_gapless_ordered_seqs() {
    let h = Harness::start().await;
    let shared = h.create("alice").await;
    let mut own = Vec::new();
    for _ in 0..25 {
        own.push(h.create("alice").await);
    }
    // 50 producers on one session, and 25 more each on its own session, all at once.
    let per_producer = 12;
    let mut tasks = Vec::new();
    for p in 0..75usize {
        let (bus, pool) = (h.bus.clone(), h.env.pool.clone());
        let session = if p < 50 { shared } else { own[p - 50] };
        tasks.push(tokio::spawn(async move {
            let mut seqs = Vec::new();
            for i in 0..per_producer {
                let body =
                    EventBody::UserMessage(UserMessage { text: format!("p{p}-{i}"), ..Default::default() });
                let req = AppendRequest::append(session, &owner("alice"), Uuid::now_v7(), &body);
                let o = append_and_wait(&bus, &pool, &req, WAIT).await.unwrap();
                assert_eq!(o.status, OutcomeStatus::Committed);
                seqs.push(o.seq.unwrap());
            }
            (p, seqs)
        }));
    }
    let mut reported: HashMap<usize, Vec<i64>> = HashMap::new();
    for t in tasks {
        let (p, seqs) = t.await.unwrap();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "producer {p}'s order not kept: {seqs:?}");
        reported.insert(p, seqs);
    }
    let rows = h.seqs(shared).await;
    assert_eq!(rows.len(), 50 * per_producer, "nothing lost or doubled");
    let all: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM session_events WHERE session_id = $1 ORDER BY seq")
            .bind(shared.0)
            .fetch_all(&h.env.pool)
            .await
            .unwrap();
    assert_eq!(all, (1..=all.len() as i64).collect::<Vec<_>>(), "gapless from 1");
    for (seq, text) in &rows {
        let p: usize = text[1..text.find('-').unwrap()].parse().unwrap();
        assert!(reported[&p].contains(seq), "event {text} at seq {seq} was not reported to its producer");
    }
    for (i, s) in own.iter().enumerate() {
        let seqs: Vec<i64> = h.seqs(*s).await.into_iter().map(|r| r.0).collect();
        assert_eq!(seqs, (2..=per_producer as i64 + 1).collect::<Vec<_>>());
        assert_eq!(reported[&(50 + i)], seqs);
    }
    // The stored order is the APPEND stream's order, across producers and batches (§6).
    let stored: HashMap<Uuid, i64> =
        sqlx::query_as::<_, (Uuid, i64)>("SELECT event_id, seq FROM session_events WHERE session_id = $1")
            .bind(shared.0)
            .fetch_all(&h.env.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let subject = h.bus.names.append_subject(0, shared);
    let in_stream_order: Vec<i64> = h
        .stream_messages(&h.bus.names.append_stream(), &subject)
        .await
        .iter()
        .map(|m| serde_json::from_slice::<AppendRequest>(&m.payload).unwrap().request_id)
        .map(|id| stored[&id])
        .collect();
    assert_eq!(in_stream_order, (1..=in_stream_order.len() as i64).collect::<Vec<_>>());
    assert_eq!(in_stream_order.len(), all.len(), "every stored event came from one APPEND message");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_request_id_twice_is_one_event_with_one_seq() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    let body = EventBody::UserMessage(UserMessage { text: "once".into(), ..Default::default() });
    let req = AppendRequest::append(s, &owner("alice"), Uuid::now_v7(), &body);
    let (a, b) = tokio::join!(h.send(&req), h.send(&req));
    assert_eq!(a.seq, b.seq);
    assert!(a.is_applied() && b.is_applied());
    // Within JetStream's dedup window the PubAck says duplicate: the look-up path answers.
    let ack = h.bus.publish_append(&req, None).await.unwrap();
    assert!(ack.duplicate);
    let c = h.send(&req).await;
    assert_eq!(c.seq, a.seq);
    // The id is fresh, so the writer takes the repeat for a first copy and finds it out when
    // the insert collides.
    repeat_then_append(&h, s, &req).await;
    // An id minted ten minutes ago could follow a copy that left the dedup window: its
    // outcome is looked up before applying.
    let s2 = h.create("alice").await;
    let ten_minutes_ago = (chrono::Utc::now() - chrono::TimeDelta::minutes(10)).timestamp() as u64;
    let old_id = Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, ten_minutes_ago, 0));
    let old = AppendRequest::append(s2, &owner("alice"), old_id, &body);
    assert!(h.send(&old).await.is_applied());
    repeat_then_append(&h, s2, &old).await;
    h.stop().await;
}

/// The same event_id as `first` with another payload, past JetStream's dedup (another msg
/// id), then one more append: the log keeps the first copy and the repeat takes no seq.
async fn repeat_then_append(h: &Harness, session: SessionId, first: &AppendRequest) {
    let mut other = first.clone();
    if let AppendOp::Append { payload, .. } = &mut other.op {
        *payload = json!({"text": "different"});
    }
    let raw = serde_json::to_vec(&other).unwrap();
    h.bus.publish_append_raw(session, &Uuid::now_v7().to_string(), Bytes::from(raw), None).await.unwrap();
    h.user(session, "alice", "after").await;
    assert_eq!(h.seqs(session).await.iter().map(|r| r.1.as_str()).collect::<Vec<_>>(), ["once", "after"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_compactions_with_the_same_expectation_apply_once() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    for i in 0..6 {
        h.user(s, "alice", &format!("m{i}")).await;
    }
    let compaction = |through| {
        let body = EventBody::CompactionApplied(CompactionApplied {
            summary: format!("summary through {through}"),
            replaces_through_seq: through,
            facts_extracted: vec![],
        });
        AppendRequest::append(s, &owner("alice"), Uuid::now_v7(), &body)
            .with_expect(Some(Expect { compacted_through: None }))
    };
    let (c4, c5) = (compaction(4), compaction(5));
    let (a, b) = tokio::join!(h.send(&c4), h.send(&c5));
    let statuses = [a.status, b.status];
    assert!(
        statuses.contains(&OutcomeStatus::Committed) && statuses.contains(&OutcomeStatus::Rejected),
        "{a:?} {b:?}"
    );
    let rejected = if a.status == OutcomeStatus::Rejected { &a } else { &b };
    assert_eq!(rejected.reason.as_deref(), Some("expect_failed"));
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM session_events WHERE session_id = $1 AND kind = 'compaction_applied'",
    )
    .bind(s.0)
    .fetch_one(&h.env.pool)
    .await
    .unwrap();
    assert_eq!(n, 1);
    let tail = read::live_tail(&h.env.pool, &owner("alice"), s).await.unwrap().unwrap();
    assert!(tail.state.compacted_through.is_some());
    assert!(tail
        .events
        .iter()
        .all(|e| e.seq > tail.state.compacted_through.unwrap() || e.kind() == EventKind::CompactionApplied));
    let context = turnlog_core::llm_context(&tail.events);
    assert_eq!(
        context[0].source,
        turnlog_core::llm_context::Source::Summary,
        "the live tail opens with the summary"
    );
    h.stop().await;
}

/// What the compactor's check reads (`read::live_counts`, counted in SQL from the stored
/// payloads) is what the live tail counts from the decoded ones: tool steps and results,
/// answers, the compaction's boundary, and nothing before it; another owner finds nothing.
/// A tail or counts read earlier and brought up to date (`read::live_tail_after`,
/// `read::live_counts_after`) are the ones read again, across a compaction too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_counts_are_the_live_tail_s_counts() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    let alice = owner("alice");
    let hr = &h;
    let append = |body: EventBody| {
        let req = AppendRequest::append(s, &alice, Uuid::now_v7(), &body);
        async move { assert!(hr.send(&req).await.is_applied()) }
    };
    h.user(s, "alice", "what is in the file?").await;
    let call = ToolCall { id: "c1".into(), name: "read".into(), arguments: "{}".into() };
    let step = AssistantTurn {
        llm: LlmPart { message: LlmMessage { content: None, tool_calls: vec![call] } },
        ..Default::default()
    };
    append(EventBody::AssistantTurn(step)).await;
    append(EventBody::ToolExecution(ToolExecution {
        call_id: "c1".into(),
        name: "read".into(),
        source: None,
        args: None,
        output: Some("text".into()),
        is_error: None,
        result_digest: None,
        status: "ok".into(),
        duration_ms: None,
    }))
    .await;
    append(EventBody::AssistantTurn(AssistantTurn::default())).await;
    let counts = || read::live_counts(&h.env.pool, &alice, s);
    let tail = read::live_tail(&h.env.pool, &alice, s).await.unwrap().unwrap();
    assert_eq!(counts().await.unwrap().unwrap(), tail.counted);
    assert_eq!(tail.counted.iter().filter(|c| c.tool).count(), 2, "{:?}", tail.counted);
    let (early_tail, early_counts) = (tail.clone(), counts().await.unwrap().unwrap());
    let same = read::live_tail_after(&h.env.pool, &alice, s, tail.clone()).await.unwrap().unwrap();
    assert_eq!((same.events, same.counted), (tail.events, tail.counted), "nothing new");
    let after = |c: Vec<_>| read::live_counts_after(&h.env.pool, &alice, s, c);
    assert_eq!(after(early_counts.clone()).await.unwrap().unwrap(), early_counts, "nothing new");

    h.user(s, "alice", "and now?").await;
    append(EventBody::CompactionApplied(CompactionApplied {
        summary: "the file was read".into(),
        replaces_through_seq: 3,
        facts_extracted: vec![],
    }))
    .await;
    let tail = read::live_tail(&h.env.pool, &alice, s).await.unwrap().unwrap();
    assert_eq!(counts().await.unwrap().unwrap(), tail.counted);
    assert_eq!(tail.counted.first().map(|c| c.seq), Some(4));
    assert!(tail.counted.iter().any(|c| c.replaces_through == Some(3)));
    let later = read::live_tail_after(&h.env.pool, &alice, s, early_tail.clone()).await.unwrap().unwrap();
    assert_eq!((later.state, later.events, later.counted), (tail.state, tail.events, tail.counted.clone()));
    assert_eq!(after(early_counts.clone()).await.unwrap().unwrap(), tail.counted);
    assert!(read::live_counts(&h.env.pool, &owner("bob"), s).await.unwrap().is_none());
    assert!(read::live_counts_after(&h.env.pool, &owner("bob"), s, early_counts).await.unwrap().is_none());
    assert!(read::live_tail_after(&h.env.pool, &owner("bob"), s, early_tail).await.unwrap().is_none());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_requests_are_dead_lettered_and_do_not_block() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    let valid = |text: &str| {
        AppendRequest::append(
            s,
            &owner("alice"),
            Uuid::now_v7(),
            &EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() }),
        )
    };
    let mut unknown_op = serde_json::to_value(valid("x")).unwrap();
    unknown_op["op"] = json!("explode");
    let mut wrong_schema = serde_json::to_value(valid("x")).unwrap();
    wrong_schema["payload"] = json!({"text": 42});
    let mut unknown_kind = serde_json::to_value(valid("x")).unwrap();
    unknown_kind["kind"] = json!("user_msg");
    let nul = valid("nul \u{0} here");
    let mut not_owner = valid("x");
    not_owner.owner = "mallory".into();
    let huge = valid(&"x".repeat(800 * 1024));
    let unknown_session = AppendRequest::append(
        SessionId::new(),
        &owner("alice"),
        Uuid::now_v7(),
        &EventBody::UserMessage(UserMessage::default()),
    );

    let poison: Vec<(&str, Vec<u8>, SessionId)> = vec![
        ("bad_request", b"\x00\xffgarbage{".to_vec(), s),
        ("bad_request", serde_json::to_vec(&unknown_op).unwrap(), s),
        ("bad_payload", serde_json::to_vec(&wrong_schema).unwrap(), s),
        ("unknown_kind", serde_json::to_vec(&unknown_kind).unwrap(), s),
        ("unstorable_text", serde_json::to_vec(&nul).unwrap(), s),
        ("owner_mismatch", serde_json::to_vec(&not_owner).unwrap(), s),
        ("too_large", serde_json::to_vec(&huge).unwrap(), s),
        ("unknown_session", serde_json::to_vec(&unknown_session).unwrap(), unknown_session.session_id),
    ];
    for (_, bytes, session) in &poison {
        h.bus
            .publish_append_raw(*session, &Uuid::now_v7().to_string(), Bytes::from(bytes.clone()), None)
            .await
            .unwrap();
    }
    let after = h.user(s, "alice", "behind the poison").await;
    assert_eq!(after.status, OutcomeStatus::Committed);
    assert_eq!(after.seq, Some(2), "no poison request became an event");

    let dead = h.stream_messages(&h.bus.names.dead_stream(), &format!("{}.dead.>", h.env.bus_prefix)).await;
    let letters: Vec<DeadLetter> = dead.iter().map(|m| serde_json::from_slice(&m.payload).unwrap()).collect();
    let reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
    assert_eq!(reasons, poison.iter().map(|p| p.0).collect::<Vec<_>>());
    assert!(dead.last().unwrap().subject.ends_with(".unknown_session.none"));
    // An unknown kind is refused like any request that decodes: filed under its session.
    assert!(dead[3].subject.ends_with(&format!(".unknown_kind.{s}")), "{}", dead[3].subject);
    assert!(letters.iter().all(|l| l.stream_seq.is_some() && !l.detail.is_empty()));
    // Each decodable poison request has a rejected outcome with its reason.
    let outcome =
        turnlog_runtime::read::recorded_outcome(&h.env.pool, not_owner.request_id).await.unwrap().unwrap();
    assert_eq!(
        (outcome.status, outcome.reason.as_deref()),
        (OutcomeStatus::Rejected, Some("owner_mismatch"))
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_rows_memories_and_stream_messages_of_that_session_only() {
    let h = Harness::start().await;
    let (doomed, kept) = (h.create("alice").await, h.create("alice").await);
    for s in [doomed, kept] {
        h.user(s, "alice", "remember Zanzibar").await;
        let memory = EventBody::MemoryExtracted(MemoryExtracted {
            turn_seq: 2,
            memories: vec![ExtractedMemory { id: Uuid::now_v7(), text: "likes Zanzibar".into() }],
            error: None,
        });
        h.send(&AppendRequest::append(s, &owner("alice"), Uuid::now_v7(), &memory)).await;
        h.answer(s, "alice").await;
        let mut bad = AppendRequest::append(
            s,
            &owner("alice"),
            Uuid::now_v7(),
            &EventBody::UserMessage(UserMessage::default()),
        );
        bad.owner = "mallory".into();
        h.bus.publish_append(&bad, None).await.unwrap();
    }
    h.user(kept, "alice", "sync").await;
    let o = h.send(&AppendRequest::delete(doomed, &owner("alice"))).await;
    assert_eq!(o.status, OutcomeStatus::Committed);

    let count = |sql: &'static str, s: SessionId| {
        let pool = h.env.pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).bind(s.0).fetch_one(&pool).await.unwrap() }
    };
    for s in [doomed, kept] {
        let expect = if s == doomed { 0 } else { 1 };
        assert_eq!(count("SELECT count(*) FROM sessions WHERE id = $1", s).await, expect);
        assert_eq!(count("SELECT count(*) FROM memories WHERE session_id = $1", s).await, expect);
        assert_eq!(count("SELECT count(*) FROM session_events WHERE session_id = $1", s).await, expect * 5);
    }
    eventually(WAIT, || async {
        (count("SELECT count(*) FROM pending_purges WHERE session_id = $1", doomed).await == 0).then_some(())
    })
    .await;
    let n = &h.bus.names;
    for (stream, filter, kept_count) in [
        (n.append_stream(), format!("{}.append.*.{{}}", h.env.bus_prefix), 6),
        (n.events_stream(), format!("{}.events.*.{{}}", h.env.bus_prefix), 1),
        (n.dead_stream(), format!("{}.dead.*.{{}}", h.env.bus_prefix), 1),
    ] {
        assert!(
            h.stream_messages(&stream, &filter.replace("{}", &doomed.to_string())).await.is_empty(),
            "{stream} still holds the deleted session"
        );
        assert_eq!(
            h.stream_messages(&stream, &filter.replace("{}", &kept.to_string())).await.len(),
            kept_count,
            "{stream}"
        );
    }
    // The deleted session is gone for good: appends to it are dead letters.
    let late = h.user(doomed, "alice", "hello?").await;
    assert_eq!(late.reason.as_deref(), Some("unknown_session"));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_ahead_of_a_queue_of_requests_skips_none_of_them() {
    let h = Harness::start().await;
    let (doomed, kept) = (h.create("alice").await, h.create("alice").await);
    h.user(doomed, "alice", "soon gone").await;
    let Harness { env, bus, shutdown, writer } = h;
    shutdown.cancel();
    writer.await.unwrap().unwrap();
    // The delete, then a queue the writer reads only after it has purged the session. (A
    // purge by subject on nats-server before 2.9.15 moved the writer's consumer past all
    // of them.)
    bus.publish_append(&AppendRequest::delete(doomed, &owner("alice")), None).await.unwrap();
    let mut acks = Vec::new();
    for i in 0..2_000 {
        let body = EventBody::UserMessage(UserMessage { text: format!("q{i}"), ..Default::default() });
        let req = AppendRequest::append(kept, &owner("alice"), Uuid::now_v7(), &body);
        let msg = async_nats::jetstream::message::PublishMessage::build()
            .payload(Bytes::from(serde_json::to_vec(&req).unwrap()))
            .message_id(req.request_id.to_string());
        let subject = bus.names.append_subject(0, kept);
        acks.push(bus.js.send_publish(subject, msg).await.unwrap());
    }
    for ack in acks {
        ack.await.unwrap();
    }
    let (shutdown, writer) = spawn_writer(&env);
    let h = Harness { env, bus, shutdown, writer };
    let n = eventually(WAIT, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM session_events WHERE session_id = $1")
            .bind(kept.0)
            .fetch_one(&h.env.pool)
            .await
            .unwrap();
        let purged: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pending_purges").fetch_one(&h.env.pool).await.unwrap();
        (n == 2_001 && purged == 0).then_some(n)
    })
    .await;
    assert_eq!(n, 2_001, "every queued request applied");
    assert!(h.seqs(doomed).await.is_empty());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_the_feed_in_order_and_a_crash_before_publishing_is_repaired() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    for i in 0..3 {
        h.user(s, "alice", &format!("m{i}")).await;
        h.answer(s, "alice").await;
    }
    let env = h.stop().await;
    // State as a crash between commit and feed publish leaves it: position applied, not
    // published, and the feed missing those events. (Deleting the stream, not purging it,
    // also forgets its dedup ids, as a feed that never received them would not have them.)
    sqlx::query("UPDATE writer_positions SET published_seq = 0").execute(&env.pool).await.unwrap();
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
    bus.js.delete_stream(bus.names.events_stream()).await.unwrap();
    // Core NATS sees every kind; the stream stores the answers only.
    let mut core = bus.client.subscribe(bus.names.events_subject("*", s)).await.unwrap();

    let (shutdown, writer) = spawn_writer(&env);
    let h = Harness { env, bus, shutdown, writer };
    let mut seen = vec![];
    while seen.len() < 7 {
        let m = tokio::time::timeout(WAIT, core.next()).await.expect("republished events").unwrap();
        seen.push(serde_json::from_slice::<CommittedEvent>(&m.payload).unwrap());
    }
    assert_eq!(seen.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(seen[0].kind, EventKind::SessionStarted);
    assert_eq!(seen[1].owner.as_str(), "alice");
    let feed = eventually(WAIT, || async {
        let f =
            h.stream_messages(&h.bus.names.events_stream(), &format!("{}.events.>", h.env.bus_prefix)).await;
        (f.len() >= 3).then_some(f)
    })
    .await;
    let events: Vec<CommittedEvent> =
        feed.iter().map(|m| serde_json::from_slice(&m.payload).unwrap()).collect();
    assert_eq!(
        events.iter().map(|e| (e.seq, e.kind)).collect::<Vec<_>>(),
        [3, 5, 7].map(|q| (q, EventKind::AssistantTurn))
    );
    // The writer advances its published position after the feed acknowledged the events,
    // so the position can trail what a reader of the feed already sees.
    let published = eventually(WAIT, || async {
        let seq: i64 = sqlx::query_scalar("SELECT published_seq FROM writer_positions")
            .fetch_one(&h.env.pool)
            .await
            .unwrap();
        (seq > 0).then_some(seq)
    })
    .await;
    assert!(published > 0);
    h.stop().await;
}

/// A feed an earlier version made stores every kind (`<prefix>.events.>`): services accept
/// it as it is, and the writer publishes every kind to it as before. Narrowed while the
/// writer runs, the writer's next publish of another kind finds no stream, and it carries
/// on with the feed's kinds alone (DESIGN §6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_an_earlier_version_made_keeps_every_kind() {
    let env = test_env().await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
    bus.js
        .create_stream(async_nats::jetstream::stream::Config {
            name: bus.names.events_stream(),
            subjects: vec![bus.names.every_kind_subject()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();
    bus.ensure_topology(None).await.expect("an earlier feed is accepted");
    let (shutdown, writer) = spawn_writer(&env);
    let h = Harness { env, bus, shutdown, writer };
    let s = h.create("alice").await;
    h.user(s, "alice", "hello").await;
    h.answer(s, "alice").await;
    h.user(s, "alice", "hello").await;
    let feed = eventually(WAIT, || async {
        let f = h.stream_messages(&h.bus.names.events_stream(), &h.bus.names.events_subject("*", s)).await;
        (f.len() >= 4).then_some(f)
    })
    .await;
    let kinds: Vec<EventKind> =
        feed.iter().map(|m| serde_json::from_slice::<CommittedEvent>(&m.payload).unwrap().kind).collect();
    let (user, answer) = (EventKind::UserMessage, EventKind::AssistantTurn);
    assert_eq!(kinds, [EventKind::SessionStarted, user, answer, user]);
    assert!(feed.iter().all(|m| m.headers.get("Nats-Msg-Id").is_some()));
    // The operator narrows it (`nats stream edit`).
    let narrowed = async_nats::jetstream::stream::Config {
        name: h.bus.names.events_stream(),
        subjects: h.bus.names.feed_subjects(),
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };
    h.bus.js.update_stream(&narrowed).await.unwrap();
    h.user(s, "alice", "after").await;
    h.answer(s, "alice").await;
    let feed = eventually(WAIT, || async {
        let f = h.stream_messages(&h.bus.names.events_stream(), &h.bus.names.events_subject("*", s)).await;
        (f.len() >= 5).then_some(f)
    })
    .await;
    let last: CommittedEvent = serde_json::from_slice(&feed[4].payload).unwrap();
    assert_eq!((feed.len(), last.seq, last.kind), (5, 6, answer), "the message after it is not stored");
    h.bus.ensure_topology(None).await.expect("the narrowed feed is the expected one");
    // Any other set of subjects is still refused.
    let config = async_nats::jetstream::stream::Config {
        name: h.bus.names.events_stream(),
        subjects: vec![format!("{}.events.user_message.*", h.env.bus_prefix)],
        ..Default::default()
    };
    h.bus.js.update_stream(&config).await.unwrap();
    assert!(h.bus.ensure_topology(None).await.is_err());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_whose_position_moved_steps_down_and_resumes_from_the_new_position() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    h.user(s, "alice", "before").await;
    // Another writer (simulated) has applied the next three messages.
    sqlx::query("UPDATE writer_positions SET stream_seq = stream_seq + 3, published_seq = published_seq + 3")
        .execute(&h.env.pool)
        .await
        .unwrap();
    let mut skipped = vec![];
    for i in 0..3 {
        let body = EventBody::UserMessage(UserMessage {
            text: format!("owned by the other writer {i}"),
            ..Default::default()
        });
        let req = AppendRequest::append(s, &owner("alice"), Uuid::now_v7(), &body);
        h.bus.publish_append(&req, None).await.unwrap();
        skipped.push(req.request_id);
    }
    let after = h.user(s, "alice", "after").await;
    assert_eq!(after.seq, Some(3), "the fenced batch was not applied");
    for id in skipped {
        assert!(turnlog_runtime::read::recorded_outcome(&h.env.pool, id).await.unwrap().is_none());
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_stands_by_and_takes_over() {
    let h = Harness::start().await;
    let (standby_stop, standby) = spawn_writer(&h.env);
    let s = h.create("alice").await;
    for i in 0..10 {
        h.user(s, "alice", &format!("a{i}")).await;
    }
    // Stop the active one; the standby takes the lock and carries on.
    let Harness { env, bus, shutdown, writer } = h;
    shutdown.cancel();
    writer.await.unwrap().unwrap();
    let h = Harness { env, bus, shutdown: standby_stop, writer: standby };
    for i in 0..10 {
        h.user(s, "alice", &format!("b{i}")).await;
    }
    let seqs: Vec<i64> = h.seqs(s).await.into_iter().map(|r| r.0).collect();
    assert_eq!(seqs, (2..=21).collect::<Vec<_>>());
    h.stop().await;
}

/// A delete that commits while the indexer gathers its batch (for 200 ms after a commit)
/// leaves none of its session's rows in the search index: the index write after it looks
/// its events up, as no write without a delete since needs to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_before_the_index_write_leaves_no_search_rows_behind() {
    let h = Harness::start().await;
    let pool = &h.env.pool;
    let rows = |s: SessionId| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM search_entries WHERE session_id = $1")
            .bind(s.0)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let mut raced = 0;
    for round in 0..4 {
        let (doomed, marker) = (h.create("alice").await, h.create("alice").await);
        // The indexer idle again, so the message's commit starts its next batch.
        tokio::time::sleep(Duration::from_millis(400)).await;
        h.user(doomed, "alice", "the Zanzibar plan").await;
        let committed = std::time::Instant::now();
        assert_eq!(
            h.send(&AppendRequest::delete(doomed, &owner("alice"))).await.status,
            OutcomeStatus::Committed
        );
        if committed.elapsed() < Duration::from_millis(150) {
            raced += 1;
        }
        // Indexed after the delete: once the marker's row is there, the doomed one's write is done.
        h.user(marker, "alice", "a marker").await;
        eventually(WAIT, || async { (rows(marker).await == 1).then_some(()) }).await;
        assert_eq!(rows(doomed).await, 0, "round {round}: a deleted session's message was indexed");
    }
    assert!(raced > 0, "no delete committed before its session's index write");
    h.stop().await;
}

/// New user messages, indexed for search off the commit path, wait in the full-text
/// index's pending list; the writer merges it from the side within a second or so, instead
/// of leaving it to grow to 4 MB and be merged inside some index write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_merges_full_text_pending_lists_outside_its_commits() {
    let h = Harness::start().await;
    let pool = &h.env.pool;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pgstattuple").execute(pool).await.unwrap();
    let pending_pages = || async {
        sqlx::query_scalar::<_, i64>("SELECT pending_pages::int8 FROM pgstatginindex('search_entries_fts')")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let s = h.create("alice").await;
    let requests: Vec<AppendRequest> = (0..300)
        .map(|i| {
            let text = format!("note {i}: the Lisbon figures for quarter {} look fine", i % 4);
            let body = EventBody::UserMessage(UserMessage { text, ..Default::default() });
            AppendRequest::append(s, &owner("alice"), Uuid::now_v7(), &body)
        })
        .collect();
    for o in futures::future::join_all(requests.iter().map(|r| h.send(r))).await {
        assert_eq!(o.status, OutcomeStatus::Committed);
    }
    // 300 messages are a few pages of entries; without the merge they would stay pending.
    let indexed = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM search_entries").fetch_one(pool).await.unwrap()
    };
    eventually(WAIT, || async { (indexed().await == 300 && pending_pages().await == 0).then_some(()) }).await;
    let query = ListQuery { limit: 10, q: Some("Lisbon".into()), archived: false, before: None };
    let (found, _) = read::list_sessions(pool, &owner("alice"), &query).await.unwrap();
    assert_eq!(found.iter().map(|f| f.id).collect::<Vec<_>>(), vec![s]);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_set_title_archive_and_category() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    let body = EventBody::UserMessage(UserMessage {
        text: "q".into(),
        category: Some("code".into()),
        ..Default::default()
    });
    h.send(&AppendRequest::append(s, &owner("alice"), Uuid::now_v7(), &body)).await;
    let u = AppendRequest::update(s, &owner("alice")).with_title_if_empty(Some("First title".into()));
    h.send(&u).await;
    let u = AppendRequest::update(s, &owner("alice"))
        .with_title_if_empty(Some("Ignored".into()))
        .with_archived(Some(true));
    h.send(&u).await;
    let got = read::get_session(&h.env.pool, &owner("alice"), s).await.unwrap().unwrap();
    assert_eq!(
        (got.title.as_deref(), got.archived, got.last_category.as_deref()),
        (Some("First title"), true, Some("code"))
    );
    assert!(read::get_session(&h.env.pool, &owner("bob"), s).await.unwrap().is_none(), "owner-scoped");
    h.stop().await;
}

/// An imported message's original time (`imported.created_at`) is when its session was
/// last active, what the list sorts by; every stored timestamp stays the stream's (§2), and
/// what the workers derive from the import later does not make it active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_message_sets_active_at_to_its_original_time() {
    let h = Harness::start().await;
    let live = h.create("alice").await;
    let imported = h.create("alice").await;
    let at = |t: &str| t.parse::<chrono::DateTime<chrono::Utc>>().unwrap();
    let from = |id: &str, t: &str| {
        Some(Imported { source: "chatgpt".into(), id: id.into(), created_at: Some(at(t)) })
    };
    let question = EventBody::UserMessage(UserMessage {
        text: "an old question".into(),
        imported: from("m1", "2023-03-01T10:00:00Z"),
        ..Default::default()
    });
    let answer = EventBody::AssistantTurn(AssistantTurn {
        imported: from("m2", "2023-03-01T10:00:05Z").map(Box::new),
        ..Default::default()
    });
    let o = h.send(&AppendRequest::append(imported, &owner("alice"), Uuid::now_v7(), &question)).await;
    assert_eq!(o.status, OutcomeStatus::Committed);
    let row = read::get_session(&h.env.pool, &owner("alice"), imported).await.unwrap().unwrap();
    assert_eq!(row.active_at, at("2023-03-01T10:00:00Z"));
    let o = h.send(&AppendRequest::append(imported, &owner("alice"), Uuid::now_v7(), &answer)).await;
    assert_eq!(o.status, OutcomeStatus::Committed);
    // The memory worker's extraction from the imported answer.
    let extracted = EventBody::MemoryExtracted(MemoryExtracted { turn_seq: 3, ..Default::default() });
    let o = h.send(&AppendRequest::append(imported, &owner("alice"), Uuid::now_v7(), &extracted)).await;
    assert_eq!((o.status, o.seq), (OutcomeStatus::Committed, Some(4)));

    let row = read::get_session(&h.env.pool, &owner("alice"), imported).await.unwrap().unwrap();
    assert_eq!(row.active_at, at("2023-03-01T10:00:05Z"), "each message sets it, nothing else");
    let newest: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT max(created_at) FROM session_events WHERE session_id = $1")
            .bind(imported.0)
            .fetch_one(&h.env.pool)
            .await
            .unwrap();
    assert_eq!(row.updated_at, newest, "the session's updated_at is the stream time");
    assert!(newest > chrono::Utc::now() - chrono::Duration::minutes(5), "events keep the stream time");
    // Listed by its original time: after the session created before it.
    let list = || async {
        let q = ListQuery { limit: 10, ..Default::default() };
        let (page, _) = read::list_sessions(&h.env.pool, &owner("alice"), &q).await.unwrap();
        page.iter().map(|s| s.id).collect::<Vec<_>>()
    };
    assert_eq!(list().await, [live, imported]);

    // A live message makes it active at the stream time again.
    h.user(imported, "alice", "a new question").await;
    let row = read::get_session(&h.env.pool, &owner("alice"), imported).await.unwrap().unwrap();
    assert!(row.updated_at > newest);
    assert_eq!(row.active_at, row.updated_at);
    assert_eq!(list().await, [imported, live]);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_over_tied_timestamps_loses_and_repeats_nothing() {
    let h = Harness::start().await;
    // 500 sessions in one batch of requests: many share one stream timestamp; force all to
    // one active_at to be sure.
    let mut ids = Vec::new();
    for _ in 0..500 {
        let id = SessionId::new();
        h.bus.publish_append(&AppendRequest::create(id, &owner("alice"), None), None).await.unwrap();
        ids.push(id);
    }
    h.create("alice").await;
    sqlx::query("UPDATE sessions SET active_at = '2026-01-02T03:04:05.123456Z'")
        .execute(&h.env.pool)
        .await
        .unwrap();

    let mut seen = Vec::new();
    let mut cursor: Option<Cursor> = None;
    loop {
        let q = ListQuery { limit: 37, before: cursor, ..Default::default() };
        let (page, next) = read::list_sessions(&h.env.pool, &owner("alice"), &q).await.unwrap();
        seen.extend(page.iter().map(|s| s.id));
        match next {
            Some(c) => {
                assert_eq!(c.before_text(), "2026-01-02T03:04:05.123456Z");
                cursor = Some(c);
            }
            None => break,
        }
    }
    let mut unique = seen.clone();
    unique.sort();
    unique.dedup();
    assert_eq!((seen.len(), unique.len()), (501, 501), "nothing lost or repeated");
    assert!(ids.iter().all(|id| seen.contains(id)));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_lease_is_exclusive_compare_and_set_and_expires() {
    let h = Harness::start().await;
    let leases = TurnLeases::open(&h.bus).await.unwrap();
    let s = SessionId::new();
    let lease = leases.acquire(s, "copy-a").await.unwrap().expect("free lease");
    assert!(leases.acquire(s, "copy-b").await.unwrap().is_none(), "held");
    let renewed = leases.renew(lease, "copy-a").await.unwrap().expect("renewable");
    assert!(leases.renew(lease, "copy-a").await.unwrap().is_none(), "stale revision fails");
    assert!(leases.is_held(s).await.unwrap());
    // Not renewed: it expires by itself within ~10 s.
    let started = std::time::Instant::now();
    let taken =
        eventually(Duration::from_secs(20), || async { leases.acquire(s, "copy-b").await.unwrap() }).await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(7) && waited <= Duration::from_secs(15),
        "expired after {waited:?}"
    );
    assert!(leases.renew(renewed, "copy-a").await.unwrap().is_none(), "the old holder lost it");
    leases.release(taken).await.unwrap();
    assert!(leases.acquire(s, "copy-c").await.unwrap().is_some(), "released");
    h.stop().await;
}

/// A repeat that JetStream's dedup does not catch (another message id) and that the writer
/// takes for a first copy (a fresh UUIDv7) must not change the first outcome, whatever the
/// op and whatever the repeat carries: a committed create, a committed update and a
/// rejected append each stay as they were, and the repeat is answered as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_repeat_never_replaces_the_first_outcome() {
    let h = Harness::start().await;
    let s = SessionId::new();
    let create = AppendRequest::create(s, &owner("alice"), Some("first".into()));
    assert_eq!(h.send(&create).await.status, OutcomeStatus::Committed);
    let update = AppendRequest::update(s, &owner("alice")).with_title(Some("one".into()));
    assert_eq!(h.send(&update).await.status, OutcomeStatus::Committed);
    let body = EventBody::UserMessage(UserMessage { text: "guarded".into(), ..Default::default() });
    let guarded = AppendRequest::append(s, &owner("alice"), Uuid::now_v7(), &body)
        .with_expect(Some(Expect { compacted_through: Some(5) }));
    let rejected = h.send(&guarded).await;
    assert_eq!(rejected.reason.as_deref(), Some("expect_failed"));

    let update_again = update.clone().with_title(Some("two".into()));
    let unguarded = guarded.clone().with_expect(None);
    for (first, repeat) in [(&create, &create), (&update, &update_again), (&guarded, &unguarded)] {
        let before: (String, Option<i64>, Option<Refusal>) =
            sqlx::query_as("SELECT status, seq, reason FROM request_outcomes WHERE request_id = $1")
                .bind(first.request_id)
                .fetch_one(&h.env.pool)
                .await
                .unwrap();
        let inbox = h.bus.client.new_inbox();
        let mut replies = h.bus.client.subscribe(inbox.clone()).await.unwrap();
        let raw = Bytes::from(serde_json::to_vec(repeat).unwrap());
        h.bus.publish_append_raw(s, &Uuid::now_v7().to_string(), raw, Some(&inbox)).await.unwrap();
        let reply = tokio::time::timeout(WAIT, replies.next()).await.unwrap().unwrap();
        let reply: turnlog_runtime::bus::Outcome = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(reply.status, OutcomeStatus::Duplicate, "{:?}: {reply:?}", first.op);
        assert_eq!((reply.seq, reply.reason.clone()), (before.1, before.2.clone()), "{:?}", first.op);
        let after: (String, Option<i64>, Option<Refusal>) =
            sqlx::query_as("SELECT status, seq, reason FROM request_outcomes WHERE request_id = $1")
                .bind(first.request_id)
                .fetch_one(&h.env.pool)
                .await
                .unwrap();
        assert_eq!(after, before, "{:?}: the first outcome was replaced", first.op);
    }
    let title: Option<String> = sqlx::query_scalar("SELECT title FROM sessions WHERE id = $1")
        .bind(s.0)
        .fetch_one(&h.env.pool)
        .await
        .unwrap();
    assert_eq!(title.as_deref(), Some("one"));
    assert_eq!(h.seqs(s).await.len(), 0, "the rejected append stayed rejected");
    // Answered, not applied again: no repeat left a dead letter behind.
    let mut dead = h.bus.js.get_stream(h.bus.names.dead_stream()).await.unwrap();
    assert_eq!(dead.info().await.unwrap().state.messages, 0, "a repeat was dead-lettered");
}

/// Every message a consumer created earlier (and not read from since) delivers now: what a
/// worker or a rebuild that had fallen behind would still get. `(subject, payload)`.
async fn drain_consumer(
    consumer: &async_nats::jetstream::consumer::Consumer<async_nats::jetstream::consumer::pull::Config>,
) -> Vec<(String, Bytes)> {
    let mut messages = consumer.messages().await.expect("the consumer's messages");
    let mut out = Vec::new();
    while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(2), messages.next()).await {
        out.push((m.subject.to_string(), m.payload.clone()));
        if m.info().is_ok_and(|i| i.pending == 0) {
            break;
        }
    }
    out
}

/// DESIGN §6: a delete removes its session's messages up to itself from the three streams,
/// one at a time. A session created again under the same id (queued right behind the
/// delete) keeps its messages and reaches the feed, other sessions keep theirs, and
/// consumers that had not read yet (a worker's on the feed, a rebuild's on APPEND) are not
/// moved past anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_removes_only_messages_up_to_itself_and_moves_no_consumer() {
    use async_nats::jetstream::consumer::{pull, AckPolicy};
    let h = Harness::start().await;
    let (doomed, kept) = (h.create("alice").await, h.create("alice").await);
    for s in [doomed, kept] {
        h.user(s, "alice", "first life").await;
        h.answer(s, "alice").await;
        let mut bad = AppendRequest::append(
            s,
            &owner("alice"),
            Uuid::now_v7(),
            &EventBody::UserMessage(UserMessage::default()),
        );
        bad.owner = "mallory".into();
        assert_eq!(h.send(&bad).await.reason.as_deref(), Some("owner_mismatch"));
    }
    let prefix = h.env.bus_prefix.clone();
    let consumer = |stream: String, filter: String| {
        let js = h.bus.js.clone();
        async move {
            let s = js.get_stream(stream).await.unwrap();
            s.create_consumer(pull::Config {
                durable_name: Some(format!("behind-{}", Uuid::now_v7().simple())),
                filter_subject: filter,
                ack_policy: AckPolicy::None,
                ..Default::default()
            })
            .await
            .unwrap()
        }
    };
    let feed_reader = consumer(h.bus.names.events_stream(), format!("{prefix}.events.>")).await;
    let append_reader = consumer(h.bus.names.append_stream(), format!("{prefix}.append.>")).await;

    // The delete, the same id created again and used, and more for the other session, all
    // queued before the writer reads the delete.
    let Harness { env, bus, shutdown, writer } = h;
    shutdown.cancel();
    writer.await.unwrap().unwrap();
    let delete =
        bus.publish_append(&AppendRequest::delete(doomed, &owner("alice")), None).await.unwrap().sequence;
    let again = AppendRequest::create(doomed, &owner("alice"), Some("second life".into()));
    bus.publish_append(&again, None).await.unwrap();
    let second = EventBody::UserMessage(UserMessage { text: "second life".into(), ..Default::default() });
    let second = AppendRequest::append(doomed, &owner("alice"), Uuid::now_v7(), &second);
    bus.publish_append(&second, None).await.unwrap();
    let answer = EventBody::AssistantTurn(AssistantTurn::default());
    let second_answer = AppendRequest::append(doomed, &owner("alice"), Uuid::now_v7(), &answer);
    bus.publish_append(&second_answer, None).await.unwrap();
    let later = EventBody::UserMessage(UserMessage { text: "later".into(), ..Default::default() });
    for body in [&later, &answer] {
        bus.publish_append(&AppendRequest::append(kept, &owner("alice"), Uuid::now_v7(), body), None)
            .await
            .unwrap();
    }
    let (shutdown, writer) = spawn_writer(&env);
    let h = Harness { env, bus, shutdown, writer };
    let pool = h.env.pool.clone();
    eventually(WAIT, || async {
        let (events, purges): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM session_events), (SELECT count(*) FROM pending_purges)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        (events == 8 && purges == 0).then_some(())
    })
    .await;
    assert_eq!(
        h.seqs(doomed).await,
        [(2, "second life".to_owned())],
        "the session created again holds its own log only"
    );

    h.env.feed_published().await;
    let of = |s: SessionId, kind: &str| format!("{prefix}.{kind}.*.{s}");
    let n = &h.bus.names;
    // APPEND: the second life's three requests, nothing of the first.
    let appends = h.stream_messages(&n.append_stream(), &of(doomed, "append")).await;
    let request_ids: Vec<Uuid> = appends
        .iter()
        .map(|m| serde_json::from_slice::<AppendRequest>(&m.payload).unwrap().request_id)
        .collect();
    assert_eq!(request_ids, [again.request_id, second.request_id, second_answer.request_id]);
    assert!(appends.iter().all(|m| m.sequence > delete));
    // EVENTS: the second life's answer, under a dedup id that names its creation time.
    let created_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT created_at FROM sessions WHERE id = $1")
            .bind(doomed.0)
            .fetch_one(&h.env.pool)
            .await
            .unwrap();
    let feed = h.stream_messages(&n.events_stream(), &of(doomed, "events")).await;
    let events: Vec<CommittedEvent> =
        feed.iter().map(|m| serde_json::from_slice(&m.payload).unwrap()).collect();
    assert_eq!(
        events.iter().map(|e| (e.seq, e.event_id.0)).collect::<Vec<_>>(),
        [(3, second_answer.request_id)],
        "the second life's events reached the feed"
    );
    for (m, e) in feed.iter().zip(&events) {
        assert!(e.stream_seq.is_some_and(|s| s > delete));
        let msg_id = m.headers.get("Nats-Msg-Id").map(|v| v.to_string());
        assert_eq!(msg_id, Some(format!("{doomed}:{}:{}", e.seq, created_at.timestamp_micros())));
    }
    assert!(h.stream_messages(&n.dead_stream(), &of(doomed, "dead")).await.is_empty());
    // The other session keeps everything.
    for (kind, count) in [("append", 6), ("events", 2), ("dead", 1)] {
        let stream = match kind {
            "append" => n.append_stream(),
            "events" => n.events_stream(),
            _ => n.dead_stream(),
        };
        assert_eq!(h.stream_messages(&stream, &of(kept, kind)).await.len(), count, "{kind}");
    }

    // The consumers that were behind still get every message that is left, in order.
    let feed_now = h.stream_messages(&n.events_stream(), &format!("{prefix}.events.>")).await;
    let delivered = drain_consumer(&feed_reader).await;
    assert_eq!(delivered.len(), feed_now.len(), "the feed's reader skipped nothing");
    assert_eq!(delivered.iter().filter(|(s, _)| s.ends_with(&kept.to_string())).count(), 2);
    let appends_now = h.stream_messages(&n.append_stream(), &format!("{prefix}.append.>")).await;
    let delivered = drain_consumer(&append_reader).await;
    assert_eq!(delivered.len(), appends_now.len(), "the APPEND reader skipped nothing");
    assert_eq!(delivered.iter().filter(|(s, _)| s.ends_with(&kept.to_string())).count(), 6);
    h.stop().await;
}

/// A create resent within JetStream's duplicate window after its session was deleted (a
/// `/v1/chat` resent with the same Idempotency-Key): JetStream drops the copy before the
/// writer sees it, and the first copy's outcome went with the session. The producer gets a
/// clear answer at once, nothing is written, and after the window the create would apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_resent_after_its_session_was_deleted_is_answered_session_deleted() {
    let h = Harness::start().await;
    // Ids derived from a key, as the ingress derives them from an Idempotency-Key.
    let key = Uuid::now_v7();
    let id = SessionId(Uuid::new_v5(&key, b"chat"));
    let mut create = AppendRequest::create(id, &owner("alice"), None);
    create.request_id = Uuid::new_v5(&key, b"create");
    assert_eq!(h.send(&create).await.status, OutcomeStatus::Committed);
    let message = h.user(id, "alice", "hello").await;
    assert_eq!(h.send(&AppendRequest::delete(id, &owner("alice"))).await.status, OutcomeStatus::Committed);

    let started = std::time::Instant::now();
    let again = h.send(&create).await;
    assert_eq!(
        (again.status, again.seq, again.reason.as_deref()),
        (OutcomeStatus::Rejected, None, Some(turnlog_runtime::bus::SESSION_DELETED))
    );
    assert!(started.elapsed() < Duration::from_secs(5), "answered after {:?}", started.elapsed());
    assert!(read::get_session(&h.env.pool, &owner("alice"), id).await.unwrap().is_none(), "nothing written");
    let recorded = turnlog_runtime::read::recorded_outcome(&h.env.pool, create.request_id).await.unwrap();
    assert!(recorded.is_none(), "an answer, not a write: the database stays a function of the APPEND stream");
    assert!(message.is_applied());
    h.stop().await;
}

/// Deleting many sessions does not stall the partition. With the tables of a deployment
/// that has run a while (200,000 outcomes and memories, seeded directly) a delete must
/// find its session's rows by index, not by reading both tables whole on the serial path:
/// over 200 deletes, `pg_stat_user_tables` counts no sequential scan of either table and at
/// least 200 index scans of each. A session appending at a steady 200/s meanwhile sees 90%
/// of its appends, and of the deletes, take under a second (a coarse guard: a delete that
/// reads the tables whole costs seconds here, every time). The mechanism is asserted rather
/// than a latency ratio, which moved with the machine's noise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_200_sessions_scans_by_index_and_never_stalls_a_steady_appender() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    // The writer's own account of its commits, indexing and removals: shown when it fails.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("turnlog_writer=debug")
        .with_ansi(false)
        .with_test_writer()
        .try_init();
    let h = Harness::start().await;
    let pool = &h.env.pool;
    for sql in [
        "INSERT INTO sessions (id, owner, last_seq, created_at, updated_at, active_at)
         SELECT gen_random_uuid(), 'seeded', 1, now(), now(), now() FROM generate_series(1, 2000)",
        "INSERT INTO request_outcomes (request_id, session_id, status, seq)
         SELECT gen_random_uuid(), id, 'committed', g FROM sessions, generate_series(1, 100) g",
        "INSERT INTO memories (id, owner, session_id, turn_seq, text, created_at)
         SELECT gen_random_uuid(), owner, id, g, 'seeded memory ' || g || ' of ' || id, now()
           FROM sessions, generate_series(1, 100) g",
        "ANALYZE sessions, request_outcomes, memories",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
    let mut doomed: Vec<SessionId> = futures::future::join_all((0..200).map(|_| async {
        let s = h.create("alice").await;
        h.user(s, "alice", "soon deleted").await;
        s
    }))
    .await;
    let steady = h.create("alice").await;
    // The seeding (and earlier tests' writes) would otherwise be checkpointed in the middle
    // of the measurement, an fsync storm on one side of it: checkpoint them first (a
    // superuser's right, which the test servers give; without it the test runs as before).
    let _ = sqlx::query("CHECKPOINT").execute(pool).await;

    // Scans of the two tables so far. A backend reports its counts at the end of a
    // transaction at most once a second (Postgres 15), so with the appender committing
    // every few milliseconds the writer's are at most a second old.
    let scans = || async {
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT relname::text, seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables
              WHERE relname IN ('memories', 'request_outcomes') ORDER BY relname",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        rows
    };
    let reported = Duration::from_secs(2);
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let appender = {
        let (bus, pool, done) = (h.bus.clone(), pool.clone(), done.clone());
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_millis(5));
            let mut sends = Vec::new();
            for i in 0.. {
                ticker.tick().await;
                if done.load(Ordering::Relaxed) {
                    break;
                }
                let (bus, pool) = (bus.clone(), pool.clone());
                sends.push(tokio::spawn(async move {
                    let body = EventBody::UserMessage(UserMessage {
                        text: format!("steady {i}"),
                        ..Default::default()
                    });
                    let req = AppendRequest::append(steady, &owner("alice"), Uuid::now_v7(), &body);
                    let t = std::time::Instant::now();
                    assert!(append_and_wait(&bus, &pool, &req, WAIT).await.unwrap().is_applied());
                    (t, t.elapsed())
                }));
            }
            let mut out = Vec::new();
            for s in sends {
                out.push(s.await.unwrap());
            }
            out
        })
    };
    // Control probes beside the appender, not through the writer: a Postgres commit and a
    // JetStream publish, one after the other. A stall of the machine's (a WAL flush or a
    // stream write held up by the disk) holds them as long as the appender.
    sqlx::query("CREATE TABLE stall_probe (n int)").execute(pool).await.unwrap();
    let probe_stream = format!("{}_PROBE", h.env.bus_prefix.to_uppercase());
    let probe_subject = format!("{}.probe", h.env.bus_prefix);
    h.bus
        .js
        .create_stream(async_nats::jetstream::stream::Config {
            name: probe_stream.clone(),
            subjects: vec![probe_subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    // Beside the probes, untimed, every 50 ms: where the appends stand (stored in APPEND,
    // delivered to the writer's consumer, committed). A stall's report says which stage
    // stood still.
    let control = {
        let (bus, pool, done) = (h.bus.clone(), pool.clone(), done.clone());
        tokio::spawn(async move {
            let append = bus.js.get_stream(bus.names.append_stream()).await.unwrap();
            let (mut took, mut stages) = (Vec::new(), Vec::new());
            while !done.load(Ordering::Relaxed) {
                let t = std::time::Instant::now();
                sqlx::query("INSERT INTO stall_probe VALUES (1)").execute(&pool).await.unwrap();
                bus.js.publish(probe_subject.clone(), "probe".into()).await.unwrap().await.unwrap();
                took.push((t, t.elapsed()));
                if stages.last().is_none_or(|(at, _)| t.duration_since(*at) >= Duration::from_millis(50)) {
                    stages.push((t, stages_now(&append, &pool).await));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (took, stages)
        })
    };
    tokio::time::sleep(reported).await;
    let before = scans().await;
    let mut deletes = Vec::new();
    for s in doomed.drain(..) {
        let t = std::time::Instant::now();
        let o =
            append_and_wait(&h.bus, pool, &AppendRequest::delete(s, &owner("alice")), WAIT).await.unwrap();
        assert_eq!(o.status, OutcomeStatus::Committed);
        deletes.push((t, t.elapsed()));
    }
    tokio::time::sleep(reported).await;
    let after = scans().await;
    done.store(true, Ordering::Relaxed);
    let (appends, (control, stages)) = (appender.await.unwrap(), control.await.unwrap());
    let mut latencies: Vec<Duration> = appends.iter().map(|(_, took)| *took).collect();
    latencies.sort_unstable();
    let (p99, max) = (latencies[latencies.len() * 99 / 100], latencies[latencies.len() - 1]);
    eprintln!("steady appender during 200 deletes: p99 {p99:?}, max {max:?} ({} appends)", latencies.len());

    // Stall episodes: the windows of appends that took a second or more, overlapping ones
    // merged. A delete that reads the tables whole costs seconds every time, so most deletes
    // and the appends queued behind them would take a second: many episodes, or one over
    // the whole run. One episode shorter than 6 s is reported with where each stage stood,
    // and the writer's debug log above, not failed: CI saw one of 4.2–4.9 s four times,
    // with or without a delete in it, the control probes fast (docs/tests.md).
    let slow = Duration::from_secs(1);
    let mut windows: Vec<(Instant, Instant)> =
        appends.iter().filter(|(_, took)| *took >= slow).map(|(t, took)| (*t, *t + *took)).collect();
    windows.sort_unstable();
    let mut episodes: Vec<(Instant, Instant)> = Vec::new();
    for (from, to) in windows {
        match episodes.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(to),
            _ => episodes.push((from, to)),
        }
    }
    let overlapping = |ops: &[(Instant, Duration)], (from, to): (Instant, Instant)| -> Vec<Duration> {
        ops.iter().filter(|(t, d)| *t < to && *t + *d > from).map(|(_, d)| *d).collect()
    };
    let run_start = appends[0].0;
    for &(from, to) in &episodes {
        // Where the stages stood half a second into the episode and half a second before its
        // end (the appends' windows reach past the stall by their own commit).
        let margin = ((to - from) / 4).min(Duration::from_millis(500));
        let at = |t: Instant| stages.iter().rev().find(|(s, _)| *s <= t).or(stages.first()).map(|(_, st)| st);
        eprintln!(
            "stall episode {:?} to {:?} into the run: deletes meanwhile took {:?}; control probes at most {:?}; \
             stages (APPEND stored, consumers' delivered/pending/pulls waiting, committed) {:?} in: {:?}, \
             {:?} in: {:?}",
            from.duration_since(run_start),
            to.duration_since(run_start),
            overlapping(&deletes, (from, to)),
            overlapping(&control, (from, to)).into_iter().max().unwrap_or_default(),
            (from + margin).duration_since(run_start),
            at(from + margin),
            (to - margin).duration_since(run_start),
            at(to - margin),
        );
    }
    let worst = episodes.iter().copied().max_by_key(|(from, to)| *to - *from);
    let outside: Vec<Duration> = appends
        .iter()
        .filter(|(t, took)| worst.is_none_or(|w| overlapping(&[(*t, *took)], w).is_empty()))
        .map(|(_, took)| *took)
        .collect();
    let longest = worst.map(|(from, to)| to - from).unwrap_or_default();
    let p90 = |mut d: Vec<Duration>| {
        d.sort_unstable();
        d.get(d.len() * 9 / 10).copied().unwrap_or_default()
    };
    let delete_p90 = p90(deletes.iter().map(|(_, took)| *took).collect());
    let append_p90 = p90(outside);
    eprintln!("deletes: p90 {delete_p90:?}; appends meanwhile, outside the longest stall episode: p90 {append_p90:?}");
    assert!(
        delete_p90 < slow && append_p90 < slow && episodes.len() <= 1 && longest < Duration::from_secs(6),
        "deletes p90 {delete_p90:?}, appends p90 {append_p90:?} outside the longest of {} stall episodes \
         ({longest:?}): the deletes held the writer",
        episodes.len()
    );

    for ((table, seq_before, idx_before), (_, seq_after, idx_after)) in before.iter().zip(&after) {
        assert_eq!(seq_after - seq_before, 0, "{table}: a delete read the table whole");
        assert!(
            idx_after - idx_before >= 200,
            "{table}: {} index scans for 200 deletes",
            idx_after - idx_before
        );
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM sessions WHERE owner = 'alice'")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(left, 1, "every doomed session deleted");
    h.stop().await;
}

/// Where the appends stand: the APPEND stream's last sequence (stored), the writer's
/// consumers' last delivered sequence, messages pending for each and pull requests waiting
/// at the server, and the writer's position (committed).
#[derive(Debug)]
#[allow(dead_code)] // read through Debug, in a stall's report
struct Stages {
    stored: u64,
    consumers: Vec<(u64, u64, usize)>,
    committed: i64,
}

async fn stages_now(append: &async_nats::jetstream::stream::Stream, pool: &sqlx::PgPool) -> Stages {
    let mut append = append.clone();
    let stored = append.info().await.map(|i| i.state.last_sequence).unwrap_or_default();
    // The writer's reader's ordered consumer (and any other on the stream).
    let consumers: Vec<(u64, u64, usize)> = append
        .consumers()
        .filter_map(|c| async move { c.ok() })
        .map(|c| (c.delivered.stream_sequence, c.num_pending, c.num_waiting))
        .collect()
        .await;
    let committed: i64 = sqlx::query_scalar("SELECT coalesce(max(stream_seq), 0) FROM writer_positions")
        .fetch_one(pool)
        .await
        .unwrap_or_default();
    Stages { stored, consumers, committed }
}

/// A request whose trace its producer did not sample is applied without a span of the
/// writer's (none would be recorded), and its committed event goes on in the producer's
/// trace context: the workers' log lines keep the trace id. A malformed one goes no further.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_request_s_event_carries_its_producer_s_trace_context() {
    let h = Harness::start().await;
    let s = h.create("alice").await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    let malformed = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7";
    let inbox = h.bus.client.new_inbox();
    let mut replies = h.bus.client.subscribe(inbox.clone()).await.unwrap();
    for (sent, seq) in [(traceparent, 2), (malformed, 3)] {
        let body = EventBody::AssistantTurn(AssistantTurn::default());
        let req = AppendRequest::append(s, &owner("alice"), Uuid::now_v7(), &body);
        let msg = turnlog_runtime::bus::append_message(
            Bytes::from(serde_json::to_vec(&req).unwrap()),
            &req.request_id.to_string(),
            Some(&inbox),
            Some(sent),
        );
        let subject = h.bus.names.append_subject(h.bus.partition_of(s), s);
        h.bus.js.send_publish(subject, msg).await.unwrap().await.unwrap();
        let reply = tokio::time::timeout(WAIT, replies.next()).await.unwrap().unwrap();
        let reply: turnlog_runtime::bus::Outcome = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!((reply.status, reply.seq), (OutcomeStatus::Committed, Some(seq)));
    }
    let feed = eventually(WAIT, || async {
        let messages = h
            .stream_messages(&h.bus.names.events_stream(), &format!("{}.events.*.{s}", h.env.bus_prefix))
            .await;
        (messages.len() == 2).then_some(messages)
    })
    .await;
    let carried: Vec<Option<&str>> =
        feed.iter().map(|m| m.headers.get("traceparent").map(|v| v.as_str())).collect();
    assert_eq!(carried, [Some(traceparent), None], "the answer's producer did not sample its trace");
    h.stop().await;
}
