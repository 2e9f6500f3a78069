//! After each commit, behind the next one: committed events onto the feed, `published_seq`
//! moved on, and the search indexer and purger handed their share. (The producers heard
//! already: the apply loop answers them as soon as the commit is durable.)

use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::message::PublishMessage;
use sqlx::PgPool;
use turnlog_runtime::bus::{Bus, Outcome};
use turnlog_runtime::trace;

use crate::apply::EventRow;
use crate::commit::Committed;
use crate::purger::DeleteDone;
use crate::read_ahead::RECREATE_PAUSE;
use crate::{metrics, search, store};

/// Committed groups waiting to be indexed for search (a full queue holds the publisher back).
pub(crate) const INDEX_QUEUE: usize = 256;

/// `published_seq` moves when no commit has come for this long, or every
/// [`MARK_EVERY`] batches under load: it is a crash's restart point, so its lag costs only
/// republishing (deduplicated by the feed), while a move per commit cost a transaction.
const MARK_IDLE: Duration = Duration::from_millis(100);
const MARK_EVERY: usize = 16;

pub(crate) async fn publisher(
    pool: PgPool,
    bus: Bus,
    partition: i32,
    mut from_writer: tokio::sync::mpsc::Receiver<Committed>,
    to_purger: tokio::sync::mpsc::Sender<DeleteDone>,
    to_indexer: tokio::sync::mpsc::Sender<search::Committed>,
) -> anyhow::Result<()> {
    let mut unmarked: Option<i64> = None;
    let mut batches_unmarked = 0;
    loop {
        let first = match unmarked {
            Some(through) => match tokio::time::timeout(MARK_IDLE, from_writer.recv()).await {
                Ok(first) => first,
                Err(_idle) => {
                    store::mark_published(&pool, partition, through).await?;
                    (unmarked, batches_unmarked) = (None, 0);
                    continue;
                }
            },
            None => from_writer.recv().await,
        };
        let Some(first) = first else { break };
        // What was committed meanwhile goes out together.
        let mut group = vec![first];
        while let Ok(next) = from_writer.try_recv() {
            group.push(next);
        }
        let started = Instant::now();
        // A deleted session's earlier events are on the feed before its removal starts.
        let events: Vec<&EventRow> = group.iter().flat_map(|c| c.events.iter()).collect();
        publish_events(&bus, events).await?;
        tracing::debug!(
            partition,
            batches = group.len(),
            elapsed_us = started.elapsed().as_micros() as u64,
            "events published"
        );
        let Some(last_stream_seq) = group.last().map(|c| c.last_stream_seq) else { continue };
        metrics::metrics().published(partition.unsigned_abs(), last_stream_seq);
        let indexing = search::Committed::of(group.iter().flat_map(|c| c.events.iter()), last_stream_seq);
        to_indexer.send(indexing).await.context("search indexer stopped")?;
        batches_unmarked += group.len();
        for committed in group.into_iter().filter(|c| !c.purges.is_empty()) {
            to_purger.send((committed.purges, committed.replies)).await.context("purger stopped")?;
        }
        unmarked = Some(last_stream_seq);
        if batches_unmarked >= MARK_EVERY {
            store::mark_published(&pool, partition, last_stream_seq).await?;
            (unmarked, batches_unmarked) = (None, 0);
        }
    }
    if let Some(through) = unmarked {
        store::mark_published(&pool, partition, through).await?;
    }
    Ok(())
}

/// Best effort: a producer that misses its reply looks the outcome up.
pub(crate) async fn send_replies(bus: &Bus, replies: &[(String, Outcome)]) -> anyhow::Result<()> {
    for (reply_to, outcome) in replies {
        let _ = bus.client.publish(reply_to.clone(), serde_json::to_vec(outcome)?.into()).await;
    }
    Ok(())
}

/// How long a publish keeps being retried (JetStream deduplicates the copies) before the
/// writer steps down: a leader election on a NATS cluster takes 4–9 s.
const PUBLISH_PATIENCE: Duration = Duration::from_secs(30);

/// Runs `attempt` until it succeeds or [`PUBLISH_PATIENCE`] has passed.
pub(crate) async fn patiently<F, Fut>(what: &str, mut attempt: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let deadline = Instant::now() + PUBLISH_PATIENCE;
    let mut retries = 0;
    loop {
        match attempt().await {
            Ok(()) => {
                if retries > 0 {
                    tracing::info!(retries, "{what}: done after retrying");
                }
                return Ok(());
            }
            Err(e) if Instant::now() + RECREATE_PAUSE < deadline => {
                if retries == 0 {
                    tracing::warn!(error = format!("{e:#}"), "{what}: failed; retrying");
                }
                retries += 1;
                tokio::time::sleep(RECREATE_PAUSE).await;
            }
            Err(e) => return Err(e).context(what.to_owned()),
        }
    }
}

/// Publishes committed events to TURNLOG_EVENTS and waits for every PubAck (sent all at
/// once, acknowledged together; all again, deduplicated, until they are).
pub(crate) async fn publish_events(
    bus: &Bus,
    events: impl IntoIterator<Item = &EventRow>,
) -> anyhow::Result<()> {
    let events: Vec<&EventRow> = events.into_iter().collect();
    patiently("publishing committed events", || publish_events_once(bus, &events)).await
}

async fn publish_events_once(bus: &Bus, events: &[&EventRow]) -> anyhow::Result<()> {
    let mut acks = Vec::new();
    for e in events {
        let subject = e.event.subject(&bus.names);
        let mut msg =
            PublishMessage::build().payload(serde_json::to_vec(&e.event)?.into()).message_id(e.msg_id());
        if let Some(t) = &e.traceparent {
            msg = msg.header(trace::TRACEPARENT, t.as_str());
        }
        acks.push(bus.js.send_publish(subject, msg).await.context("publishing a committed event")?);
    }
    for ack in acks {
        ack.await.context("committed event not acknowledged")?;
    }
    Ok(())
}
