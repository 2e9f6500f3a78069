//! `turnlog dead list | show N | redrive N`: the dead letters in TURNLOG_DEAD (N is the
//! dead stream's sequence) with their reasons, and sending a writer's dead letter back to
//! TURNLOG_APPEND once its cause is fixed. A worker's dead letter (a committed event its
//! handler gave up on) is redone with `turnlog replay` instead.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures::StreamExt as _;
use sqlx::PgPool;
use turnlog_runtime::bus::{AppendRequest, Bus, CommittedEvent, DeadLetter, Outcome, REPLY_HEADER};
use turnlog_runtime::read::recorded_outcome;
use turnlog_writer::REDRIVE_HEADER;

/// One dead letter as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadEntry {
    /// Its TURNLOG_DEAD sequence: what `show` and `redrive` take.
    pub seq: u64,
    pub time: DateTime<Utc>,
    pub subject: String,
    pub letter: DeadLetter,
}

/// What the dead letter held: a writer's request or a worker's committed event.
#[derive(Debug, Clone, PartialEq)]
pub enum DeadRequest {
    Append(AppendRequest),
    /// `worker` is the worker that gave up (from the letter's detail).
    Event {
        worker: String,
        event: CommittedEvent,
    },
    /// Neither decodes (the writer dead-lettered it as bad JSON).
    Undecodable,
}

impl DeadEntry {
    pub fn request(&self) -> DeadRequest {
        if let Ok(r) = serde_json::from_str::<AppendRequest>(&self.letter.request) {
            return DeadRequest::Append(r);
        }
        match serde_json::from_str::<CommittedEvent>(&self.letter.request) {
            Ok(event) => {
                let worker = self.letter.detail.split(':').next().unwrap_or_default().trim().to_owned();
                DeadRequest::Event { worker, event }
            }
            Err(_) => DeadRequest::Undecodable,
        }
    }

    /// The session the letter's subject names ("none" when the writer could not tell).
    pub fn session(&self) -> &str {
        self.subject.rsplit('.').next().unwrap_or("none")
    }

    fn line(&self) -> String {
        let detail: String = self.letter.detail.chars().take(100).collect();
        format!(
            "{:>8}  {}  {:<18} {:<36}  {detail}",
            self.seq,
            self.time.format("%Y-%m-%d %H:%M:%S"),
            self.letter.reason,
            self.session(),
        )
    }
}

/// Prints every dead letter there is when it starts, oldest first, one line each; calls
/// `each` with every one (a test's or a script's hook). Returns how many there were.
pub async fn list(bus: &Bus, mut each: impl FnMut(&DeadEntry)) -> anyhow::Result<u64> {
    let name = bus.names.dead_stream();
    let mut stream = bus.js.get_stream(&name).await.with_context(|| format!("opening {name}"))?;
    let through = stream.info().await.with_context(|| format!("reading {name}"))?.state.last_sequence;
    println!("{:>8}  {:<19}  {:<18} {:<36}  detail", "seq", "time (UTC)", "reason", "session");
    let consumer = stream
        .create_consumer(OrderedConfig { deliver_policy: DeliverPolicy::All, ..Default::default() })
        .await
        .context("creating an ordered consumer")?;
    let mut count = 0;
    if consumer.cached_info().num_pending > 0 {
        let mut messages = consumer.messages().await.context("reading the dead letters")?;
        while let Some(m) = messages.next().await {
            let m = m.context("reading the dead letters")?;
            let info = m.info().map_err(|e| anyhow::anyhow!("dead letter without JetStream info: {e}"))?;
            let (seq, time, pending) = (info.stream_sequence, info.published, info.pending);
            if seq > through {
                break;
            }
            let entry = entry(seq, time, m.subject.to_string(), &m.payload)?;
            println!("{}", entry.line());
            each(&entry);
            count += 1;
            if pending == 0 || seq == through {
                break;
            }
        }
    }
    println!("{count} dead letter{}", if count == 1 { "" } else { "s" });
    Ok(count)
}

/// Reads dead letter `seq` and prints it whole.
pub async fn show(bus: &Bus, seq: u64) -> anyhow::Result<DeadEntry> {
    let entry = get(bus, seq).await?;
    println!("dead letter {}  {}", entry.seq, entry.time.to_rfc3339());
    println!("subject:    {}", entry.subject);
    println!("reason:     {}", entry.letter.reason);
    println!("detail:     {}", entry.letter.detail);
    match entry.request() {
        DeadRequest::Append(_) => {
            if let Some(s) = entry.letter.stream_seq {
                println!("from:       TURNLOG_APPEND sequence {s} (the writer refused it)");
            }
            println!("redrive:    turnlog dead redrive {} (once the cause is fixed)", entry.seq);
        }
        DeadRequest::Event { worker, event } => {
            let from = entry.letter.stream_seq.unwrap_or_default();
            println!("from:       TURNLOG_EVENTS sequence {from} (the {worker} worker gave up on it)");
            // A worker's consumers are named after it (`memory-imported`, `compactor-residue`).
            let process = worker.split('-').next().unwrap_or_default();
            println!(
                "redo:       turnlog replay --worker {process} --from-seq {from} --session {}",
                event.session_id
            );
        }
        DeadRequest::Undecodable => println!("redrive:    impossible, the request does not decode"),
    }
    let request = serde_json::from_str::<serde_json::Value>(&entry.letter.request)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or_else(|_| entry.letter.request.clone());
    println!("request:\n{request}");
    Ok(entry)
}

/// What a redrive led to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redriven {
    /// The TURNLOG_APPEND sequence the request was republished at.
    pub append_seq: u64,
    /// The writer's answer: committed, rejected again (a new dead letter), or duplicate
    /// (applied by an earlier redrive: nothing added). None when none came in time.
    pub outcome: Option<Outcome>,
}

/// Republishes the original bytes of a writer's dead letter to TURNLOG_APPEND (the subject
/// derived from its session, a fresh message id so JetStream's dedup lets it through,
/// marked as a redrive) and waits up to `timeout` for the writer's outcome; `pool`, when
/// given, is asked once the writer's position has passed the request, should the reply be
/// lost. The writer applies a redriven request only if its recorded outcome is a
/// dead-letter rejection, so a second redrive adds nothing.
pub async fn redrive(
    bus: &Bus,
    pool: Option<&PgPool>,
    seq: u64,
    timeout: Duration,
) -> anyhow::Result<Redriven> {
    let entry = get(bus, seq).await?;
    let request = match entry.request() {
        DeadRequest::Append(r) => r,
        DeadRequest::Event { worker, event } => anyhow::bail!(
            "dead letter {seq} is a committed event the {worker} worker gave up on, not a request: redo it with \
             `turnlog replay --worker {worker} --from-seq {} --session {}`",
            entry.letter.stream_seq.unwrap_or_default(),
            event.session_id
        ),
        DeadRequest::Undecodable => {
            anyhow::bail!("dead letter {seq}'s request does not decode ({}): nothing to redrive", entry.letter.reason)
        }
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let inbox = bus.client.new_inbox();
    let mut replies = bus.client.subscribe(inbox.clone()).await.context("subscribing to the reply")?;
    let partition = bus.partition_of(request.session_id);
    let subject = bus.names.append_subject(partition, request.session_id);
    let msg = PublishMessage::build()
        .payload(Bytes::from(entry.letter.request.clone().into_bytes()))
        .message_id(format!("redrive:{seq}:{}", uuid::Uuid::now_v7()))
        .header(REPLY_HEADER, inbox.as_str())
        .header(REDRIVE_HEADER, seq.to_string().as_str());
    let ack = bus.js.send_publish(subject, msg).await.context("publishing the request")?;
    let append_seq = ack.await.context("TURNLOG_APPEND did not take the request")?.sequence;

    let mut outcome = None;
    while let Ok(Some(reply)) = tokio::time::timeout_at(deadline, replies.next()).await {
        if let Ok(o) = serde_json::from_slice::<Outcome>(&reply.payload) {
            if o.request_id == request.request_id {
                outcome = Some(o);
                break;
            }
        }
    }
    if let (None, Some(pool)) = (&outcome, pool) {
        outcome = outcome_after(pool, partition, append_seq, request.request_id, deadline).await?;
    }
    match &outcome {
        Some(o) if o.status == turnlog_runtime::bus::OutcomeStatus::Duplicate => println!(
            "redrove dead letter {seq} as TURNLOG_APPEND {append_seq}: already applied{} — nothing added",
            o.seq.map(|s| format!(" at seq {s}")).unwrap_or_default()
        ),
        Some(o) if o.is_applied() => println!(
            "redrove dead letter {seq} as TURNLOG_APPEND {append_seq}: committed{}",
            o.seq.map(|s| format!(" at seq {s}")).unwrap_or_default()
        ),
        Some(o) => println!(
            "redrove dead letter {seq} as TURNLOG_APPEND {append_seq}: rejected again ({}); see `turnlog dead list`",
            o.reason.as_deref().unwrap_or("no reason")
        ),
        None => println!(
            "redrove dead letter {seq} as TURNLOG_APPEND {append_seq}: no outcome within {timeout:?} (is the writer \
             running?)"
        ),
    }
    Ok(Redriven { append_seq, outcome })
}

/// The recorded outcome once the writer of `partition` has applied `append_seq` (before
/// that, the recorded outcome may still be the dead letter's).
async fn outcome_after(
    pool: &PgPool,
    partition: u32,
    append_seq: u64,
    request_id: uuid::Uuid,
    deadline: tokio::time::Instant,
) -> anyhow::Result<Option<Outcome>> {
    let partition = i32::try_from(partition)?;
    let append_seq = i64::try_from(append_seq)?;
    loop {
        let applied: Option<i64> =
            sqlx::query_scalar("SELECT stream_seq FROM writer_positions WHERE partition = $1")
                .bind(partition)
                .fetch_optional(pool)
                .await?;
        if applied.is_some_and(|a| a >= append_seq) {
            return Ok(recorded_outcome(pool, request_id).await?);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn get(bus: &Bus, seq: u64) -> anyhow::Result<DeadEntry> {
    let name = bus.names.dead_stream();
    let stream = bus.js.get_stream(&name).await.with_context(|| format!("opening {name}"))?;
    let m = stream.get_raw_message(seq).await.with_context(|| format!("no dead letter {seq} in {name}"))?;
    entry(m.sequence, m.time, m.subject.to_string(), &m.payload)
}

fn entry(seq: u64, time: DateTime<Utc>, subject: String, payload: &[u8]) -> anyhow::Result<DeadEntry> {
    let letter: DeadLetter =
        serde_json::from_slice(payload).with_context(|| format!("message {seq} is not a dead letter"))?;
    Ok(DeadEntry { seq, time, subject, letter })
}
