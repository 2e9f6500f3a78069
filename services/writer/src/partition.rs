//! One partition's writer: wait for room in this writer's share and for the partition's
//! advisory lock, then serve it — republish what a crash left unpublished, and run the
//! apply loop that takes read-ahead requests into batches and commits them (DESIGN §6).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{partition_of, Bus};
use turnlog_runtime::settings::Secret;
use turnlog_runtime::trace;

use crate::apply::{EventRow, Incoming, SessionRow};
use crate::commit::{apply_and_commit, commit_fault, is_unique_violation, CommitFault, Committed};
use crate::publisher::{publish_events, publisher, send_replies, Feed, INDEX_QUEUE};
use crate::purger::{finish_purges, purger, PURGE_QUEUE};
use crate::read_ahead::{read_ahead, ReadAhead, READ_AHEAD_BYTES};
use crate::{gin, metrics, search, share, store, MAX_BATCH};

/// How often the advisory lock's connection is checked.
const LOCK_PING: Duration = Duration::from_secs(5);

/// Base of the advisory-lock keys, one per partition ("TLWR").
pub(crate) const LOCK_BASE: i64 = 0x544C_5752_0000;

/// One partition: wait for room in this writer's share and for the lock, serve until an
/// error, a hand-over or shutdown, start over.
pub(crate) async fn partition_writer(
    partition: u32,
    pool: PgPool,
    bus: Bus,
    url: Secret,
    pending: Arc<gin::PendingRows>,
    share: Arc<share::Share>,
    shutdown: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        match serve_partition(partition, &pool, &bus, &url, &pending, &share, &shutdown).await {
            Ok(()) => backoff = Duration::from_millis(100),
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

/// Gives a claimed partition's room back when its serving ends, however it ends (after
/// the partition's connection, and so its lock, is gone: it is declared first).
struct Claimed<'a>(&'a share::Share, u32);

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        metrics::metrics().held(self.1, false);
        self.0.release(self.1);
    }
}

/// Serves one partition once this writer has room for it and holds its lock, until an
/// error, shutdown, or the share asks for it back (then `Ok`, after finishing what was
/// taken: the next writer reads on from the committed position).
#[allow(clippy::too_many_arguments)]
async fn serve_partition(
    partition: u32,
    pool: &PgPool,
    bus: &Bus,
    url: &Secret,
    pending: &Arc<gin::PendingRows>,
    share: &share::Share,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let p = i32::try_from(partition).context("partition out of range")?;
    let mut waiting_logged = false;
    let mut standby: Option<PgConnection> = None;
    let (stop, _claimed, mut conn) = loop {
        let changed = share.changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if let Some(stop) = share.claim(partition, shutdown) {
            let claimed = Claimed(share, partition);
            // The lock lives on the partition's own connection, held exactly as long as it;
            // every commit goes through it too, planned once (the commit's plan does not
            // depend on its arrays; see `connect_generic_plans`).
            let mut conn = match standby.take() {
                Some(conn) => conn,
                None => turnlog_runtime::db::connect_generic_plans(url.expose(), &share::application_name())
                    .await
                    .context("partition connection")?,
            };
            let (got,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
                .bind(LOCK_BASE + i64::from(partition))
                .fetch_one(&mut conn)
                .await?;
            if got {
                break (stop, claimed, conn);
            }
            standby = Some(conn);
            if !waiting_logged {
                tracing::info!(partition, "another writer holds this partition; standing by");
                waiting_logged = true;
            }
        }
        // A share change wakes this at once; another writer's lock is polled for.
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = &mut changed => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    };
    let shutdown = &stop;
    metrics::metrics().held(partition, true);

    let (applied, published) = store::positions(pool, p).await?;
    tracing::info!(partition, applied, published, "writer active");
    finish_purges(pool, bus, partition, applied).await?;
    let feed = Arc::new(Feed::read(bus).await?);
    if published < applied {
        let events = store::committed_between(pool, published, applied).await?;
        let events: Vec<_> = events
            .into_iter()
            .filter(|e| partition_of(e.event.session_id, bus.partitions) == partition)
            .collect();
        tracing::info!(partition, count = events.len(), "republishing events committed before a crash");
        publish_events(bus, &feed, &events).await?;
        store::mark_published(pool, p, applied).await?;
    }

    let stream = bus.js.get_stream(bus.names.append_stream()).await.context("opening the APPEND stream")?;
    let duplicate_window = stream.cached_info().config.duplicate_window;
    let start = u64::try_from(applied).unwrap_or(0) + 1;
    let (to_writer, mut from_reader) = tokio::sync::mpsc::channel(2 * MAX_BATCH);
    let budget = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
    let reader = tokio::spawn(read_ahead(bus.clone(), stream, partition, start, budget, to_writer));

    // Publishing runs behind the next commit: the feed and `published_seq` of batch N go
    // out while batch N+1 is applied (its replies went at its commit). Deleted sessions'
    // messages are removed behind the publisher, so that other sessions' replies do not
    // wait for a removal.
    let (to_purger, from_publisher) = tokio::sync::mpsc::channel(PURGE_QUEUE);
    let purger = tokio::spawn(purger(pool.clone(), bus.clone(), from_publisher));
    // The search index follows the feed, in its own transactions (search::indexer).
    let (to_indexer, from_publisher) = tokio::sync::mpsc::channel(INDEX_QUEUE);
    let indexer = tokio::spawn(search::indexer(
        pool.clone(),
        p,
        bus.partitions,
        applied,
        from_publisher,
        pending.clone(),
    ));
    let (to_publisher, from_writer) = tokio::sync::mpsc::channel(8);
    let publisher =
        tokio::spawn(publisher(pool.clone(), bus.clone(), feed, p, from_writer, to_purger, to_indexer));
    let result = apply_loop(
        p,
        pool,
        bus,
        shutdown,
        &mut conn,
        &mut from_reader,
        duplicate_window,
        applied,
        pending,
        to_publisher,
    )
    .await;
    reader.abort();
    // Let the publisher finish what was committed (on error too: anything it misses is
    // republished by the next writer from `published_seq`), and the purger the removals
    // handed to it (any it misses are recorded, and done by the next writer first).
    let published = publisher.await.context("publisher panicked")?;
    let purged = purger.await.context("purger panicked")?;
    let indexed = indexer.await.context("search indexer panicked")?;
    // A task that stops closes its channel and so stops the one feeding it: the cause is
    // the error furthest down the pipeline.
    indexed.context("search indexer").and(purged.context("purger")).and(published).and(result)
}

#[allow(clippy::too_many_arguments)]
async fn apply_loop(
    p: i32,
    pool: &PgPool,
    bus: &Bus,
    shutdown: &CancellationToken,
    conn: &mut PgConnection,
    from_reader: &mut tokio::sync::mpsc::Receiver<ReadAhead>,
    duplicate_window: Duration,
    mut applied: i64,
    pending: &gin::PendingRows,
    to_publisher: tokio::sync::mpsc::Sender<Committed>,
) -> anyhow::Result<()> {
    let mut cache: HashMap<SessionId, SessionRow> = HashMap::new();
    let mut carry: Vec<Incoming> = Vec::new();
    let mut permits: Vec<OwnedSemaphorePermit> = Vec::new();
    // Each carried request's apply span, for those sent with a trace context.
    let mut spans: Vec<Option<tracing::Span>> = Vec::new();
    let mut last_ping = Instant::now();
    // How many carried requests the next commit takes: fewer while a batch is split to
    // find the request its data fails on.
    let mut limit = MAX_BATCH;
    // The error an unclassified commit failure gave, once: it is the data's when the same
    // batch reproduces it.
    let mut reproduced: Option<String> = None;
    loop {
        if carry.is_empty() {
            let first = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                m = from_reader.recv() => m,
            };
            let (message, permit) = first.context("the APPEND reader stopped")?;
            spans.push(apply_span(&message));
            carry.push(message);
            permits.push(permit);
        }
        // Take what has been read without waiting.
        while carry.len() < MAX_BATCH {
            let Ok((message, permit)) = from_reader.try_recv() else { break };
            spans.push(apply_span(&message));
            carry.push(message);
            permits.push(permit);
        }

        let started = Instant::now();
        let take = carry.len().min(limit);
        let batch = &carry[..take];
        let result = match apply_and_commit(pool, conn, bus, p, applied, batch, &mut cache, duplicate_window)
            .await
        {
            // A request taken for a first copy repeated an event (a producer's clock far
            // off nats-server's): the batch again, every earlier outcome looked up.
            Err(e) if is_unique_violation(&e) => {
                tracing::warn!(error = format!("{e:#}"), "a request was a repeat; applying its batch again");
                apply_and_commit(pool, conn, bus, p, applied, batch, &mut cache, Duration::ZERO).await
            }
            result => result,
        };
        let (consumed, mut committed) = match result {
            Ok(done) => {
                (limit, reproduced) = (MAX_BATCH, None);
                done
            }
            Err(e) => {
                // A batch its data keeps from committing is split until the request that
                // does it is found; that one is dead-lettered (DESIGN §6: it never blocks
                // what follows). Anything else steps down and is tried again.
                let why = match commit_fault(&e, &mut reproduced) {
                    CommitFault::Data(why) => why,
                    CommitFault::Again => {
                        tracing::warn!(
                            partition = p,
                            error = format!("{e:#}"),
                            "a commit failed; trying its batch again"
                        );
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                    CommitFault::Transient => return Err(e),
                };
                if take > 1 {
                    limit = take / 2;
                    tracing::warn!(
                        partition = p,
                        requests = take,
                        trying = limit,
                        error = why,
                        "a batch's data failed its commit; splitting it to find the request"
                    );
                } else if carry[0].is_unstorable() {
                    // Even its dead letter does not commit: not this request's doing.
                    return Err(e.context("committing a dead-lettered request's outcome"));
                } else {
                    tracing::warn!(
                        partition = p,
                        stream_seq = carry[0].stream_seq,
                        error = why,
                        "the database refuses this request's writes; dead-lettering it"
                    );
                    carry[0].mark_unstorable(why);
                }
                continue;
            }
        };
        applied = committed.last_stream_seq;
        metrics::metrics().committed(p.unsigned_abs(), consumed, started.elapsed().as_secs_f64(), applied);
        pending.add(committed.events.len());
        end_apply_spans(spans.drain(..consumed), &mut carry[..consumed], &mut committed.events);
        carry.drain(..consumed);
        permits.drain(..consumed);
        // The commit is durable: its producers hear now, not behind the feed's PubAcks for
        // the batches before (a delete's, once its purge is done, behind the publisher).
        if committed.purges.is_empty() {
            send_replies(bus, &std::mem::take(&mut committed.replies)).await?;
        }
        to_publisher.send(committed).await.context("publisher stopped")?;
        // The lock lives as long as its connection: notice when that is gone.
        if last_ping.elapsed() > LOCK_PING {
            conn.ping().await.context("partition connection (and its lock) lost")?;
            last_ping = Instant::now();
        }
    }
}

/// The span of a request's apply, from when the writer takes it to its commit: a child of
/// the producer's span when the request carries a sampled trace context, else none (a
/// span per append is worth its cost only in a trace that is recorded).
fn apply_span(m: &Incoming) -> Option<tracing::Span> {
    let parent = m.traceparent.as_deref().filter(|_| m.sampled)?;
    let span =
        tracing::info_span!("writer.apply", stream_seq = m.stream_seq, request_id = tracing::field::Empty);
    trace::follow(&span, Some(parent));
    Some(span)
}

/// Ends the apply spans of committed requests, each with a line in its trace, and gives
/// each committed event its request's span as the trace context it is published with; an
/// event whose request was traced unsampled goes on in its producer's trace context (taken
/// from the request, which is done with).
fn end_apply_spans(
    spans: impl Iterator<Item = Option<tracing::Span>>,
    batch: &mut [Incoming],
    events: &mut [EventRow],
) {
    // Both are in APPEND order, a request making at most one event.
    let mut events = events.iter_mut().peekable();
    for (span, m) in spans.zip(batch) {
        while events.next_if(|e| e.event.stream_seq < Some(m.stream_seq)).is_some() {}
        let event = events.next_if(|e| e.event.stream_seq == Some(m.stream_seq));
        let Some(span) = span else {
            if let Some((e, parent)) = event.zip(m.traceparent.take()) {
                tracing::debug!(trace_id = trace::remote(&parent).map(|r| r.trace_id), session_id = %e.event.session_id, seq = e.event.seq, kind = %e.event.kind.as_str(), "request applied");
                e.traceparent = Some(parent);
            }
            continue;
        };
        if let Some(id) = m.request_id() {
            span.record("request_id", tracing::field::display(id));
        }
        span.in_scope(|| match &event {
            Some(e) => tracing::debug!(session_id = %e.event.session_id, seq = e.event.seq, kind = %e.event.kind.as_str(), "request applied"),
            None => tracing::debug!("request answered without an event"),
        });
        if let Some(e) = event {
            e.traceparent = trace::traceparent(&span);
        }
    }
}
