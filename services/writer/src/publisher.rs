//! After each commit, behind the next one: committed events published (the feed's kinds
//! stored), `published_seq` moved on, and the search indexer and purger handed their share.
//! (The producers heard already: the apply loop answers them as soon as the commit is
//! durable.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::message::PublishMessage;
use sqlx::PgPool;
use turnlog_runtime::bus::{append_headers, on_feed, Bus, Outcome};

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
    feed: Arc<Feed>,
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
        publish_events(&bus, &feed, events).await?;
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

/// Which kinds this partition's writer stores on TURNLOG_EVENTS: the feed's own
/// ([`on_feed`]), or every kind on a stream an earlier version made, published as that
/// version did (DESIGN §6). Read when the partition is taken, and again after a failed
/// publish: a stream narrowed meanwhile answers a kind it no longer stores with no responders.
pub(crate) struct Feed {
    every_kind: AtomicBool,
}

impl Feed {
    pub(crate) async fn read(bus: &Bus) -> anyhow::Result<Self> {
        let feed = Self { every_kind: AtomicBool::new(false) };
        feed.refresh(bus).await.context("reading TURNLOG_EVENTS's subjects")?;
        Ok(feed)
    }

    async fn refresh(&self, bus: &Bus) -> anyhow::Result<()> {
        let mut stream = bus.js.get_stream(bus.names.events_stream()).await?;
        let every_kind = stream.info().await?.config.subjects == [bus.names.every_kind_subject()];
        if self.every_kind.swap(every_kind, Ordering::Relaxed) != every_kind {
            tracing::info!(every_kind, "TURNLOG_EVENTS's subjects changed");
        }
        Ok(())
    }

    fn stores(&self, token: &str) -> bool {
        on_feed(token) || self.every_kind.load(Ordering::Relaxed)
    }
}

/// Publishes committed events in order: those the feed stores with a PubAck each, all sent
/// at once and acknowledged together (all again, deduplicated, until they are); the others
/// as core NATS messages (DESIGN §6).
pub(crate) async fn publish_events(
    bus: &Bus,
    feed: &Feed,
    events: impl IntoIterator<Item = &EventRow>,
) -> anyhow::Result<()> {
    let events: Vec<&EventRow> = events.into_iter().collect();
    patiently("publishing committed events", || async {
        let published = publish_events_once(bus, feed, &events).await;
        if published.is_err() {
            // Bounded: during a leader election the stream's info waits for JetStream's
            // request timeout (5 s), which would hold the retry after the election is over.
            match tokio::time::timeout(RECREATE_PAUSE, feed.refresh(bus)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = format!("{e:#}"), "TURNLOG_EVENTS's subjects not read"),
                Err(_) => tracing::debug!("TURNLOG_EVENTS's subjects not read in time"),
            }
        }
        published
    })
    .await
}

async fn publish_events_once(bus: &Bus, feed: &Feed, events: &[&EventRow]) -> anyhow::Result<()> {
    let mut acks = Vec::new();
    for e in events {
        let token = e.event.feed_token();
        let subject = bus.names.events_subject(&token, e.event.session_id);
        let payload = serde_json::to_vec(&e.event)?.into();
        let headers = append_headers(&e.msg_id(), None, e.traceparent.as_deref());
        if feed.stores(&token) {
            let msg = PublishMessage::build().payload(payload).headers(headers);
            acks.push(bus.js.send_publish(subject, msg).await.context("publishing a committed event")?);
        } else {
            bus.client
                .publish_with_headers(subject, headers, payload)
                .await
                .context("publishing a committed event")?;
        }
    }
    for ack in acks {
        ack.await.context("committed event not acknowledged")?;
    }
    Ok(())
}
