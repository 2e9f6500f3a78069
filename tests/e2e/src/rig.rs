//! The one rig of the worker suites (distiller, memory, compactor, ops, and the process
//! suites of the `turnlog` binary): a test environment with the writer running in-process,
//! the mock model, workers spawned and stopped one by one, turns simulated on the bus as the
//! ingress would append them, and ways to wait until the workers have handled everything.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::{self, OrderedConfig};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use futures::StreamExt;
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turnlog_core::budget::{history_tokens, request_size};
use turnlog_core::events::{
    AssistantTurn, Block, BlockType, EventBody, LlmMessage, LlmPart, MessageContent, UiPart, UserMessage,
};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_mock_llm::{MockConfig, MockHandle};
use turnlog_runtime::bus::{append_and_wait, AppendRequest, Bus, DeadLetter, OutcomeStatus};
use turnlog_runtime::upstream::UpstreamConfig;
use turnlog_testkit::{test_env_on, TestEnv};
use uuid::Uuid;

use crate::config;

pub const OWNER: &str = "alice";

/// An owner as the requests on the bus and the reads name it: `owner(OWNER)`.
pub fn owner(name: &str) -> Owner {
    Owner::parse(name).unwrap()
}
/// The longest any wait in these suites may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(60);

/// A mock whose every call fails with HTTP 500.
pub fn failing_mock() -> MockConfig {
    let mut config = MockConfig::default();
    config.defaults.status = Some(500);
    config
}

type Task = (CancellationToken, JoinHandle<anyhow::Result<()>>);

pub struct Rig {
    pub env: TestEnv,
    pub bus: Bus,
    pub mock: MockHandle,
    writer: Option<Task>,
    workers: Vec<Task>,
}

impl Rig {
    /// A fresh environment with the writer running and a healthy mock model.
    pub async fn start() -> Rig {
        Self::start_on(None).await
    }

    /// [`Rig::start`] on a given NATS server (a private one a test can restart).
    pub async fn start_on(nats_url: Option<&str>) -> Rig {
        Self::start_with(nats_url, 1).await
    }

    /// [`Rig::start_on`] with `partitions` (every config built from `rig.env` carries them).
    pub async fn start_with(nats_url: Option<&str>, partitions: u32) -> Rig {
        let mut env = test_env_on(None, nats_url).await;
        env.partitions = partitions;
        let bus = Bus::connect(&env.nats_url, &env.bus_prefix, partitions).await.expect("bus");
        bus.ensure_topology(None).await.expect("topology");
        let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.expect("mock model");
        let stop = CancellationToken::new();
        let writer = tokio::spawn(turnlog_writer::run(config::writer(&env), stop.clone()));
        Rig { env, bus, mock, writer: Some((stop, writer)), workers: Vec::new() }
    }

    pub fn upstream(&self) -> UpstreamConfig {
        config::upstream_at(&self.mock.base_url())
    }

    /// Runs a worker (`run(config, shutdown)`) in-process until [`Rig::stop`]; returns its
    /// index for [`Rig::stop_worker`].
    pub fn spawn<F, Fut>(&mut self, run: F) -> usize
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let stop = CancellationToken::new();
        let task = tokio::spawn(run(stop.clone()));
        self.workers.push((stop, task));
        self.workers.len() - 1
    }

    /// Stops one worker gracefully and checks it ended cleanly.
    pub async fn stop_worker(&mut self, index: usize) {
        let (stop, task) = &mut self.workers[index];
        stop.cancel();
        let ended = tokio::time::timeout(WAIT, task).await.expect("worker did not stop in time");
        ended.expect("worker panicked").expect("worker failed");
    }

    /// Stops every worker (each must end cleanly and in time), then the writer.
    pub async fn stop(mut self) -> TestEnv {
        for (stop, _) in &self.workers {
            stop.cancel();
        }
        for (_, task) in self.workers.drain(..) {
            let ended = tokio::time::timeout(WAIT, task).await.expect("worker did not stop in time");
            ended.expect("worker panicked").expect("worker failed");
        }
        if let Some((stop, task)) = self.writer.take() {
            stop.cancel();
            task.await.expect("writer panicked").expect("writer failed");
        }
        self.env
    }

    /// Appends through the writer, resending the same request after a failure (the bus may
    /// be coming back from a restart) as a well-behaved producer does.
    pub async fn send(&self, request: &AppendRequest) -> turnlog_runtime::bus::Outcome {
        let deadline = tokio::time::Instant::now() + WAIT;
        let outcome = loop {
            match append_and_wait(&self.bus, &self.env.pool, request, Duration::from_secs(5)).await {
                Ok(outcome) => break outcome,
                Err(e) if tokio::time::Instant::now() < deadline => {
                    eprintln!("append failed ({e}); resending");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("append failed: {e}"),
            }
        };
        assert!(outcome.is_applied(), "append not applied: {outcome:?}");
        outcome
    }

    pub async fn create_session(&self) -> SessionId {
        let id = SessionId::new();
        let outcome = self.send(&AppendRequest::create(id, &owner(OWNER), None)).await;
        assert_eq!(outcome.status, OutcomeStatus::Committed);
        id
    }

    pub async fn user(&self, session: SessionId, text: &str) -> i64 {
        let body = EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() });
        let outcome = self.send(&AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &body)).await;
        outcome.seq.expect("seq")
    }

    pub async fn answer(&self, session: SessionId, text: &str, model: Option<&str>) -> i64 {
        let body = EventBody::AssistantTurn(AssistantTurn {
            ui: UiPart { blocks: vec![Block { kind: BlockType::Text, text: Some(text.into()), meta: None }] },
            llm: LlmPart {
                message: LlmMessage {
                    content: Some(MessageContent::Text(text.into())),
                    ..Default::default()
                },
            },
            model: model.map(str::to_owned),
            finish_reason: Some("stop".into()),
            ..Default::default()
        });
        let outcome = self.send(&AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &body)).await;
        outcome.seq.expect("seq")
    }

    /// A whole turn as the ingress appends it; returns the answer's seq.
    pub async fn turn(&self, session: SessionId, question: &str, answer: &str) -> i64 {
        self.user(session, question).await;
        self.answer(session, answer, None).await
    }

    /// `(seq, event_id, payload)` of a session's events of `kind`, in seq order.
    pub async fn events_of(&self, session: SessionId, kind: &str) -> Vec<(i64, Uuid, Value)> {
        sqlx::query_as(
            "SELECT seq, event_id, payload FROM session_events WHERE session_id = $1 AND kind = $2 ORDER BY seq",
        )
        .bind(session.0)
        .bind(kind)
        .fetch_all(&self.env.pool)
        .await
        .expect("events")
    }

    pub async fn title(&self, session: SessionId) -> Option<String> {
        sqlx::query_scalar("SELECT title FROM sessions WHERE id = $1")
            .bind(session.0)
            .fetch_one(&self.env.pool)
            .await
            .expect("title")
    }

    /// The session's next request size with no system prompt or extras.
    pub async fn next_request_tokens(&self, session: SessionId) -> u32 {
        let tail = turnlog_runtime::read::live_tail(&self.env.pool, &owner(OWNER), session)
            .await
            .expect("live tail")
            .expect("session");
        request_size(history_tokens(&tail.counted), 0)
    }

    pub fn consumer(&self, worker: &str) -> String {
        format!("{}-{worker}", self.env.bus_prefix)
    }

    /// The state of a worker's durable consumer.
    pub async fn consumer_info(&self, worker: &str) -> async_nats::jetstream::consumer::Info {
        let stream = self.bus.js.get_stream(self.bus.names.events_stream()).await.expect("stream");
        stream.consumer_info(self.consumer(worker)).await.expect("consumer")
    }

    /// A worker's durable consumer as an earlier version made it, on `filter` (the subjects
    /// after `<prefix>.events.`).
    pub async fn earlier_consumer(&self, worker: &str, filter: &str) -> PullConsumer {
        let stream = self.bus.js.get_stream(self.bus.names.events_stream()).await.expect("stream");
        let config = pull::Config {
            durable_name: Some(self.consumer(worker)),
            filter_subject: format!("{}.events.{filter}", self.env.bus_prefix),
            ack_policy: AckPolicy::Explicit,
            ..Default::default()
        };
        stream.create_consumer(config).await.expect("the earlier consumer")
    }

    /// Waits (20 s at most) until a worker's consumer was switched to `filter` (the subjects
    /// after `<prefix>.events.`).
    pub async fn switched_to(&self, worker: &str, filter: &str) {
        let filter = format!("{}.events.{filter}", self.env.bus_prefix);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while self.consumer_info(worker).await.config.filter_subject != filter {
            assert!(tokio::time::Instant::now() < deadline, "{worker} was never switched to {filter}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether a worker's consumer has nothing left ([`consumer_idle`]).
    pub async fn consumer_idle(&self, worker: &str) -> bool {
        consumer_idle(&self.bus, worker).await
    }

    /// Waits until every named worker has handled everything on the feed ([`settle`]).
    pub async fn settle(&self, workers: &[&str]) {
        settle(&self.env, &self.bus, workers).await
    }

    /// Every dead letter so far, with its subject.
    pub async fn dead_letters(&self) -> Vec<(String, DeadLetter)> {
        self.stream_messages(&self.bus.names.dead_stream())
            .await
            .into_iter()
            .map(|(subject, body)| (subject, serde_json::from_slice(&body).expect("dead letter")))
            .collect()
    }

    /// Every message of a stream, read from the start: `(subject, payload)`.
    pub async fn stream_messages(&self, stream: &str) -> Vec<(String, Vec<u8>)> {
        let mut s = self.bus.js.get_stream(stream).await.expect("stream");
        let count = s.info().await.expect("stream info").state.messages;
        if count == 0 {
            return vec![];
        }
        let consumer = s
            .create_consumer(OrderedConfig { deliver_policy: DeliverPolicy::All, ..Default::default() })
            .await
            .expect("ordered consumer");
        let mut messages = consumer.messages().await.expect("messages");
        let mut out = Vec::new();
        while (out.len() as u64) < count {
            match tokio::time::timeout(Duration::from_secs(5), messages.next()).await {
                Ok(Some(Ok(m))) => out.push((m.subject.to_string(), m.payload.to_vec())),
                _ => break,
            }
        }
        out
    }

    /// Publishes every committed event again under new message ids, as a confused
    /// publisher or a replayed feed would: the workers must append nothing new.
    pub async fn republish_feed(&self) -> usize {
        let events = self.stream_messages(&self.bus.names.events_stream()).await;
        for (subject, body) in &events {
            let msg = async_nats::jetstream::message::PublishMessage::build()
                .payload(body.clone().into())
                .message_id(format!("replay-{}", Uuid::now_v7()));
            self.bus.js.send_publish(subject.clone(), msg).await.expect("publish").await.expect("ack");
        }
        events.len()
    }

    /// Deletes a worker's durable consumer: its copies recreate it from the start of the
    /// feed and see every event again.
    pub async fn reset_consumer(&self, worker: &str) {
        let stream = self.bus.js.get_stream(self.bus.names.events_stream()).await.expect("stream");
        stream.delete_consumer(&self.consumer(worker)).await.expect("delete consumer");
    }

    /// How many requests of a worker task (`[turnlog:distill]` etc.) the mock received.
    pub fn model_calls(&self, marker: &str) -> usize {
        model_calls(&self.mock, marker)
    }
}

pub fn model_calls(mock: &MockHandle, marker: &str) -> usize {
    mock.log()
        .entries()
        .iter()
        .filter(|r| r.path == "/v1/chat/completions")
        .filter(|r| r.body["messages"][0]["content"].as_str().is_some_and(|s| s.contains(marker)))
        .count()
}

/// Deterministic filler for answers: lower-case words without digits, so the mock finds no
/// names or numbers in it (the facts of a conversation come from its user messages).
pub fn filler(words: usize, seed: usize) -> String {
    const WORDS: [&str; 16] = [
        "the", "plan", "looks", "sound", "and", "we", "can", "keep", "going", "with", "that", "idea", "for",
        "now", "while", "waiting",
    ];
    let mut out = String::new();
    for i in 0..words {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(i * 7 + seed * 3) % WORDS.len()]);
        if i % 12 == 11 {
            out.push('.');
        }
    }
    out.push('.');
    out
}

/// Whether a worker's consumer has nothing left: nothing undelivered, nothing in hand,
/// nothing waiting for a retry. False while the consumer does not exist yet.
pub async fn consumer_idle(bus: &Bus, worker: &str) -> bool {
    let Ok(stream) = bus.js.get_stream(bus.names.events_stream()).await else { return false };
    match stream.consumer_info(format!("{}-{worker}", bus.names.prefix())).await {
        Ok(info) => info.num_pending == 0 && info.num_ack_pending == 0,
        Err(_) => false,
    }
}

/// The durable consumers a worker process consumes with.
pub fn consumers_of(worker: &str) -> Vec<&str> {
    match worker {
        "compactor" => vec!["compactor", "compactor-residue"],
        "memory" => vec!["memory", "memory-imported"],
        _ => vec![worker],
    }
}

/// Waits until every named worker has handled everything on the feed, the feed holding
/// everything committed. The writer answers a producer before it publishes the commit's
/// events, so a turn (or a worker's append) can be answered while its events are not on the
/// feed yet; a settle waits for them. It returns once one pass found the feed caught up
/// with the commits ([`TestEnv::feed_caught_up`]) and every worker idle, and the feed did
/// not grow during that pass: anything committed before it was then on the feed and handled.
pub async fn settle(env: &TestEnv, bus: &Bus, workers: &[&str]) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let before = feed_last_seq(bus).await;
        let mut idle = env.feed_caught_up().await;
        for c in workers.iter().flat_map(|w| consumers_of(w)) {
            idle = idle && consumer_idle(bus, c).await;
        }
        if idle && env.feed_caught_up().await && feed_last_seq(bus).await == before {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "workers {workers:?} did not settle within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The feed's last sequence (None while it cannot be read).
pub async fn feed_last_seq(bus: &Bus) -> Option<u64> {
    let mut stream = bus.js.get_stream(bus.names.events_stream()).await.ok()?;
    Some(stream.info().await.ok()?.state.last_sequence)
}
