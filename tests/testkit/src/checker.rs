//! A Jepsen-style check for the log: producers record every append they saw acknowledged,
//! then the database and the committed-event feed are compared with that record — nothing
//! acknowledged lost, nothing stored twice, seqs gapless, every committed event of a kind the
//! feed stores on it.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use turnlog_core::events::{AssistantTurn, EventBody, LlmMessage, LlmPart, MessageContent, UserMessage};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{append_and_wait, feed_token, on_feed, AppendRequest, Bus, CommittedEvent};
use uuid::Uuid;

use crate::env::TestEnv;

/// What producers saw acknowledged: request (= event) id → (session, seq).
pub type Acked = HashMap<Uuid, (SessionId, i64)>;

/// Appends `n` events to `session`, user messages and answers in turn (answers are what the
/// feed stores, DESIGN §6), as a well-behaved producer: after any failure it
/// resends the same request id until it gets an outcome. Returns how many attempts failed
/// and the acknowledged (request id, seq) pairs, in order.
pub async fn produce(
    bus: Bus,
    pool: sqlx::PgPool,
    owner: Owner,
    session: SessionId,
    n: usize,
) -> (usize, Vec<(Uuid, i64)>) {
    produce_while(bus, pool, owner, session, |i| i < n).await
}

/// [`produce`] for as long as `more(appends so far)` says so.
pub async fn produce_while(
    bus: Bus,
    pool: sqlx::PgPool,
    owner: Owner,
    session: SessionId,
    more: impl Fn(usize) -> bool,
) -> (usize, Vec<(Uuid, i64)>) {
    let (mut failures, mut acked) = (0, Vec::new());
    for i in (0..).take_while(|i| more(*i)) {
        let text = format!("{session} #{i}");
        let body = if i % 2 == 0 {
            EventBody::UserMessage(UserMessage { text, ..Default::default() })
        } else {
            let content = Some(MessageContent::Text(text));
            EventBody::AssistantTurn(AssistantTurn {
                llm: LlmPart { message: LlmMessage { content, ..Default::default() } },
                ..Default::default()
            })
        };
        let req = AppendRequest::append(session, &owner, Uuid::now_v7(), &body);
        loop {
            match append_and_wait(&bus, &pool, &req, Duration::from_secs(3)).await {
                Ok(o) if o.is_applied() => {
                    acked.push((req.request_id, o.seq.unwrap_or_default()));
                    break;
                }
                Ok(o) => panic!("checker: request rejected: {o:?}"),
                Err(_) => {
                    failures += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    (failures, acked)
}

/// Compares what was acknowledged with the database and the feed; panics naming the first
/// violation. Sessions must hold only `session_started` plus the checked appends.
pub async fn check_log(env: &TestEnv, bus: &Bus, acked: &Acked) {
    let rows: Vec<(Uuid, Uuid, i64, String, bool)> =
        sqlx::query_as("SELECT event_id, session_id, seq, kind, payload ? 'imported' FROM session_events")
            .fetch_all(&env.pool)
            .await
            .expect("checker: reading events");
    let mut stored: HashMap<Uuid, (Uuid, i64)> = HashMap::new();
    let mut per_session: HashMap<Uuid, Vec<i64>> = HashMap::new();
    for (event, session, seq, _, _) in &rows {
        assert!(stored.insert(*event, (*session, *seq)).is_none(), "checker: event {event} stored twice");
        per_session.entry(*session).or_default().push(*seq);
    }
    for (id, (session, seq)) in acked {
        assert_eq!(
            stored.get(id),
            Some(&(session.0, *seq)),
            "checker: acknowledged append {id} lost or moved"
        );
    }
    // A fork's own events start after its fork point.
    let first: HashMap<Uuid, i64> = sqlx::query_as(
        "SELECT id, coalesce(lineage_through[cardinality(lineage_through)], 0) + 1 FROM sessions",
    )
    .fetch_all(&env.pool)
    .await
    .expect("checker: reading sessions")
    .into_iter()
    .collect();
    for (session, seqs) in &mut per_session {
        seqs.sort_unstable();
        let first = first.get(session).copied().unwrap_or(1);
        assert!(
            seqs.iter().enumerate().all(|(i, s)| *s == i as i64 + first),
            "checker: seqs of {session} are not gapless from {first}"
        );
    }
    // Every committed event of a kind the feed stores reached it, exactly once (wait for
    // the publisher).
    let fed: Vec<(Uuid, Uuid, i64)> = rows
        .into_iter()
        .filter(|(_, _, _, kind, imported)| on_feed(&feed_token(kind, *imported)))
        .map(|(event, session, seq, _, _)| (event, session, seq))
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let feed = feed(env, bus).await;
        if feed.len() >= fed.len() || tokio::time::Instant::now() > deadline {
            for (event, session, seq) in &fed {
                let e = feed.get(&format!("{session}:{seq}"));
                assert_eq!(
                    e.map(|e| e.event_id.0),
                    Some(*event),
                    "checker: event {session}:{seq} missing from the feed"
                );
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every committed event on the feed, by `<session_id>:<seq>`; panics on a duplicate.
pub async fn feed(env: &TestEnv, bus: &Bus) -> HashMap<String, CommittedEvent> {
    let scan = scan_feed(env, bus).await;
    assert!(scan.repeats == 0, "checker: an event reached the feed twice");
    assert!(
        scan.conflicts.is_empty(),
        "checker: two different events at one seq on the feed: {:?}",
        scan.conflicts
    );
    scan.events
}

/// What the committed-event feed holds.
pub struct FeedScan {
    /// Every event, by `<session_id>:<seq>` (the first copy).
    pub events: HashMap<String, CommittedEvent>,
    /// How many times an id came again with the same content (the feed is at-least-once: a
    /// republish outside the duplicate window repeats an event, which a long soak reports
    /// rather than fails on).
    pub repeats: usize,
    /// Ids that came again with different content: (first, later). Never acceptable: two
    /// consumers would see two different events at one seq.
    pub conflicts: Vec<(CommittedEvent, CommittedEvent)>,
}

/// Reads the whole committed-event feed of `env`'s bus.
pub async fn scan_feed(env: &TestEnv, bus: &Bus) -> FeedScan {
    let mut scan = FeedScan { events: HashMap::new(), repeats: 0, conflicts: Vec::new() };
    let Ok(stream) = bus.js.get_stream(bus.names.events_stream()).await else { return scan };
    let config = async_nats::jetstream::consumer::pull::OrderedConfig {
        filter_subject: format!("{}.events.>", env.bus_prefix),
        ..Default::default()
    };
    let Ok(consumer) = stream.create_consumer(config).await else { return scan };
    let Ok(mut messages) = consumer.messages().await else { return scan };
    while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(700), messages.next()).await {
        let e: CommittedEvent = serde_json::from_slice(&m.payload).expect("checker: feed event decodes");
        match scan.events.entry(format!("{}:{}", e.session_id, e.seq)) {
            Entry::Vacant(v) => {
                v.insert(e);
            }
            Entry::Occupied(o) if *o.get() == e => scan.repeats += 1,
            Entry::Occupied(o) => scan.conflicts.push((o.get().clone(), e)),
        }
    }
    scan
}
