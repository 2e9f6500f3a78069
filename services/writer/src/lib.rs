//! turnlog's writer: the only process that writes Postgres. Per partition it holds an
//! advisory lock (a second copy waits as a standby), reads TURNLOG_APPEND strictly in
//! stream order from its recorded position, applies each batch and its new position in
//! one transaction, then publishes the committed events, advances `published_seq` and
//! answers the producers. A crash anywhere applies nothing twice and skips nothing.

mod apply;
mod store;

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use async_nats::jetstream::message::PublishMessage;
use futures::{FutureExt as _, StreamExt as _};
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use turnlog_core::bus::{partition_of, Bus, CommittedEvent, REPLY_HEADER};
use turnlog_core::ids::SessionId;
use uuid::Uuid;

pub use apply::{apply_batch, Incoming};

/// Most requests applied in one transaction.
pub const MAX_BATCH: usize = 500;
/// Base of the advisory-lock keys, one per partition ("TLWR").
const LOCK_BASE: i64 = 0x544C_5752_0000;

#[derive(Debug, Clone)]
pub struct WriterConfig {
    pub database_url: String,
    pub nats_url: String,
    pub bus_prefix: String,
    pub partitions: u32,
    pub append_max_age: Option<Duration>,
}

/// Runs a writer for every partition until `shutdown`; recovers by itself from lost
/// connections to NATS or Postgres.
pub async fn run(config: WriterConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let pool = turnlog_core::db::connect(&config.database_url, 4 + config.partitions)
        .await
        .context("connecting to Postgres")?;
    let bus = Bus::connect(&config.nats_url, &config.bus_prefix, config.partitions).await?;
    bus.ensure_topology(config.append_max_age).await?;
    turnlog_core::tokens::warm_up();

    let mut tasks = tokio::task::JoinSet::new();
    for partition in 0..config.partitions {
        let (pool, bus, url, shutdown) =
            (pool.clone(), bus.clone(), config.database_url.clone(), shutdown.clone());
        tasks.spawn(async move { partition_writer(partition, pool, bus, url, shutdown).await });
    }
    while let Some(res) = tasks.join_next().await {
        res.context("partition writer panicked")?;
    }
    Ok(())
}

/// One partition: wait for the lock, serve until an error or shutdown, start over.
async fn partition_writer(partition: u32, pool: PgPool, bus: Bus, url: String, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        match serve_partition(partition, &pool, &bus, &url, &shutdown).await {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!(partition, error = format!("{e:#}"), "writer stepping down; will retry");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

async fn serve_partition(
    partition: u32,
    pool: &PgPool,
    bus: &Bus,
    url: &str,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let p = i32::try_from(partition).context("partition out of range")?;
    // The lock lives on its own connection: it is held exactly as long as that connection.
    let mut lock_conn = PgConnection::connect(url).await.context("lock connection")?;
    let mut waiting_logged = false;
    loop {
        let (got,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
            .bind(LOCK_BASE + i64::from(partition))
            .fetch_one(&mut lock_conn)
            .await?;
        if got {
            break;
        }
        if !waiting_logged {
            tracing::info!(partition, "another writer holds this partition; standing by");
            waiting_logged = true;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }

    let (mut applied, published) = store::positions(pool, p).await?;
    tracing::info!(partition, applied, published, "writer active");
    if published < applied {
        let events = store::committed_between(pool, published, applied).await?;
        let events: Vec<_> =
            events.into_iter().filter(|e| partition_of(e.session_id, bus.partitions) == partition).collect();
        tracing::info!(partition, count = events.len(), "republishing events committed before a crash");
        publish_events(bus, &events).await?;
        store::mark_published(pool, p, applied).await?;
    }
    finish_purges(pool, bus, partition).await?;

    let stream = bus.js.get_stream(bus.names.append_stream()).await.context("opening the APPEND stream")?;
    let start = u64::try_from(applied).unwrap_or(0) + 1;
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: bus.names.append_partition_filter(partition),
            deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: start },
            ..Default::default()
        })
        .await
        .context("creating the ordered consumer")?;
    let mut messages = consumer.messages().await.context("reading the APPEND stream")?;

    let mut carry: Vec<Incoming> = Vec::new();
    loop {
        if carry.is_empty() {
            let first = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                m = messages.next() => m,
            };
            let Some(first) = first else { anyhow::bail!("APPEND stream ended") };
            carry.push(incoming(first?)?);
        }
        // Take what is already there without waiting. Unconstrained: tokio's cooperative
        // budget would otherwise cut the batch short after a few dozen polls.
        while carry.len() < MAX_BATCH {
            match tokio::task::unconstrained(messages.next()).now_or_never() {
                Some(Some(m)) => carry.push(incoming(m?)?),
                Some(None) => anyhow::bail!("APPEND stream ended"),
                None => break,
            }
        }

        let consumed = apply_and_commit(pool, bus, p, applied, &carry).await?;
        applied = i64::try_from(carry[consumed - 1].stream_seq)?;
        carry.drain(..consumed);
        // Keep the lock connection alive (and notice when it is not).
        lock_conn.ping().await.context("lock connection lost")?;
    }
}

/// Applies a batch (up to its first delete) and does everything that follows a commit.
/// Returns how many messages it consumed.
async fn apply_and_commit(
    pool: &PgPool,
    bus: &Bus,
    partition: i32,
    applied: i64,
    batch: &[Incoming],
) -> anyhow::Result<usize> {
    let mut sessions: Vec<Uuid> = Vec::new();
    let mut requests: Vec<Uuid> = Vec::new();
    for m in batch {
        if let Some(s) = m.subject_session {
            sessions.push(s.0);
        }
        if let Ok(r) = serde_json::from_slice::<RequestIds>(&m.body) {
            requests.push(r.request_id);
        }
    }
    let mut tx = pool.begin().await?;
    let state = store::load_state(&mut tx, &sessions, &requests).await?;
    let fx = apply_batch(batch, state);

    // Dead letters go out before the commit (deduplicated by stream sequence), so a crash
    // in between cannot lose one.
    for (session, letter) in &fx.dead {
        let subject = bus.names.dead_subject(&letter.reason, *session);
        let msg_id = format!("dead:{}", letter.stream_seq.unwrap_or_default());
        let msg = PublishMessage::build().payload(serde_json::to_vec(letter)?.into()).message_id(msg_id);
        bus.js.send_publish(subject, msg).await?.await.context("publishing a dead letter")?;
    }
    store::write_effects(&mut tx, partition, applied, &fx).await?;
    tx.commit().await?;

    let events: Vec<CommittedEvent> = fx.events.iter().map(|e| e.event.clone()).collect();
    publish_events(bus, &events).await?;
    store::mark_published(pool, partition, i64::try_from(fx.last_stream_seq)?).await?;
    for (reply_to, outcome) in &fx.replies {
        // Best effort: a producer that misses it looks the outcome up.
        let _ = bus.client.publish(reply_to.clone(), serde_json::to_vec(outcome)?.into()).await;
    }
    if let Some(session) = fx.deleted {
        purge_session(pool, bus, session).await?;
    }
    Ok(fx.consumed)
}

#[derive(serde::Deserialize)]
struct RequestIds {
    request_id: Uuid,
}

fn incoming(m: async_nats::jetstream::Message) -> anyhow::Result<Incoming> {
    let info = m.info().map_err(|e| anyhow::anyhow!("message without JetStream info: {e}"))?;
    let (stream_seq, published) = (info.stream_sequence, info.published);
    let subject_session = m.subject.rsplit('.').next().and_then(|s| s.parse::<SessionId>().ok());
    let reply_to = m.headers.as_ref().and_then(|h| h.get(REPLY_HEADER)).map(|v| v.to_string());
    Ok(Incoming { stream_seq, published, subject_session, reply_to, body: m.message.payload })
}

/// Publishes committed events to TURNLOG_EVENTS and waits for every PubAck (sent all at
/// once, acknowledged together).
async fn publish_events(bus: &Bus, events: &[CommittedEvent]) -> anyhow::Result<()> {
    let mut acks = Vec::with_capacity(events.len());
    for e in events {
        let subject = bus.names.events_subject(&e.kind, e.session_id);
        let msg = PublishMessage::build().payload(serde_json::to_vec(e)?.into()).message_id(e.msg_id());
        acks.push(bus.js.send_publish(subject, msg).await.context("publishing a committed event")?);
    }
    for ack in acks {
        ack.await.context("committed event not acknowledged")?;
    }
    Ok(())
}

async fn finish_purges(pool: &PgPool, bus: &Bus, partition: u32) -> anyhow::Result<()> {
    for session in store::pending_purges(pool).await? {
        if partition_of(session, bus.partitions) == partition {
            purge_session(pool, bus, session).await?;
        }
    }
    Ok(())
}

/// Removes a deleted session's messages from all three streams, then its purge record.
async fn purge_session(pool: &PgPool, bus: &Bus, session: SessionId) -> anyhow::Result<()> {
    for (stream, filter) in bus.names.session_filters(bus.partition_of(session), session) {
        let s = bus.js.get_stream(&stream).await.with_context(|| format!("opening {stream}"))?;
        s.purge().filter(filter).await.with_context(|| format!("purging {stream}"))?;
    }
    store::purge_done(pool, session).await?;
    tracing::info!(%session, "deleted session purged from the streams");
    Ok(())
}
