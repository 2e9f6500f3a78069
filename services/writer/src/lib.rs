//! turnlog's writer: the only process that writes Postgres. Per partition it holds an
//! advisory lock (partitions are spread over the writers running, see `share`; one that
//! dies leaves its partitions to the others), reads TURNLOG_APPEND strictly in
//! stream order from its recorded position, applies each batch and its new position in
//! one transaction, then publishes the committed events, advances `published_seq` and
//! answers the producers. A crash anywhere applies nothing twice and skips nothing.
//! `rebuild` runs the same apply code in an apply-only mode into an empty database.

mod apply;
mod bulk;
mod gin;
mod metrics;
mod rebuild;
mod search;
mod share;
mod store;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::RawMessageErrorKind;
use futures::StreamExt as _;
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{partition_of, Bus, CommittedEvent, DeadLetter, Op, Outcome, REPLY_HEADER};
use turnlog_runtime::settings::{Backbone, Secret};
use turnlog_runtime::trace;
use uuid::Uuid;

pub use apply::{apply_batch, Incoming};
use apply::{EventRow, LoadedState, SessionRow};
pub use rebuild::{rebuild, RebuildProgress, RebuildSummary};
pub use share::holders;

/// Header marking an APPEND message as an operator's redrive of a dead letter (its value is
/// the dead letter's TURNLOG_DEAD sequence): the one case where a request id seen before
/// is applied again, if its recorded outcome was a dead-letter rejection.
pub const REDRIVE_HEADER: &str = "Turnlog-Redrive";

/// Most requests applied in one transaction.
pub const MAX_BATCH: usize = 500;
/// Most bytes of request bodies read ahead of the commit (a larger request waits alone).
const READ_AHEAD_BYTES: usize = 4 << 20;
/// Sessions the writer keeps in memory (it is the only one changing them); the cache is
/// dropped whole past this size.
const SESSION_CACHE: usize = 100_000;
/// How often the advisory lock's connection is checked.
const LOCK_PING: Duration = Duration::from_secs(5);
/// Base of the advisory-lock keys, one per partition ("TLWR").
const LOCK_BASE: i64 = 0x544C_5752_0000;

#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// Its statement timeout does not apply: the writer's commits are not bounded.
    pub backbone: Backbone,
}

/// Runs a writer for every partition until `shutdown`; recovers by itself from lost
/// connections to NATS or Postgres.
pub async fn run(config: WriterConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let backbone = &config.backbone;
    let pool = backbone.connect_db(4 + backbone.partitions).await.context("connecting to Postgres")?;
    let bus = backbone.connect_bus().await?;
    bus.ensure_topology(backbone.append_max_age).await?;
    turnlog_core::tokens::warm_up();

    let pending = Arc::new(gin::PendingRows::default());
    let share = Arc::new(share::Share::default());
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(gin::merge_pending_lists(pool.clone(), pending.clone(), shutdown.clone()));
    let url = backbone.database_url.expose().to_owned();
    tasks.spawn(share::run(url, backbone.partitions, share.clone(), shutdown.clone()));
    let telemetry = turnlog_runtime::telemetry::registry();
    telemetry.export("writer", |out| metrics::metrics().render(out));
    // Ready: a member of the writers (so Postgres answers) and connected to NATS.
    let (joined, client) = (share.clone(), bus.client.clone());
    telemetry.ready_when("writer", move || {
        joined.joined() && client.connection_state() == async_nats::connection::State::Connected
    });
    for partition in 0..backbone.partitions {
        let (pool, bus, url, shutdown, pending, share) = (
            pool.clone(),
            bus.clone(),
            backbone.database_url.clone(),
            shutdown.clone(),
            pending.clone(),
            share.clone(),
        );
        tasks.spawn(
            async move { partition_writer(partition, pool, bus, url, pending, share, shutdown).await },
        );
    }
    while let Some(res) = tasks.join_next().await {
        res.context("partition writer panicked")?;
    }
    Ok(())
}

/// One partition: wait for room in this writer's share and for the lock, serve until an
/// error, a hand-over or shutdown, start over.
async fn partition_writer(
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
    if published < applied {
        let events = store::committed_between(pool, published, applied).await?;
        let events: Vec<_> = events
            .into_iter()
            .filter(|e| partition_of(e.event.session_id, bus.partitions) == partition)
            .collect();
        tracing::info!(partition, count = events.len(), "republishing events committed before a crash");
        publish_events(bus, &events).await?;
        store::mark_published(pool, p, applied).await?;
    }

    let stream = bus.js.get_stream(bus.names.append_stream()).await.context("opening the APPEND stream")?;
    let duplicate_window = stream.cached_info().config.duplicate_window;
    let start = u64::try_from(applied).unwrap_or(0) + 1;
    let (to_writer, mut from_reader) = tokio::sync::mpsc::channel(2 * MAX_BATCH);
    let budget = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
    let reader = tokio::spawn(read_ahead(bus.clone(), stream, partition, start, budget, to_writer));

    // Publishing runs behind the next commit: the feed, `published_seq` and the replies of
    // batch N go out while batch N+1 is applied. Deleted sessions' messages are removed
    // behind the publisher, so that other sessions' replies do not wait for a removal.
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
    let publisher = tokio::spawn(publisher(pool.clone(), bus.clone(), p, from_writer, to_purger, to_indexer));
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
        end_apply_spans(spans.drain(..consumed), &carry[..consumed], &mut committed.events);
        carry.drain(..consumed);
        permits.drain(..consumed);
        to_publisher.send(committed).await.context("publisher stopped")?;
        // The lock lives as long as its connection: notice when that is gone.
        if last_ping.elapsed() > LOCK_PING {
            conn.ping().await.context("partition connection (and its lock) lost")?;
            last_ping = Instant::now();
        }
    }
}

/// The span of a request's apply, from when the writer takes it to its commit: a child of
/// the producer's span when the request carries a trace context, else none.
fn apply_span(m: &Incoming) -> Option<tracing::Span> {
    let parent = m.traceparent.as_deref()?;
    let span =
        tracing::info_span!("writer.apply", stream_seq = m.stream_seq, request_id = tracing::field::Empty);
    trace::follow(&span, Some(parent));
    Some(span)
}

/// Ends the apply spans of committed requests, each with a line in its trace, and gives
/// each committed event its request's span as the trace context it is published with.
fn end_apply_spans(
    spans: impl Iterator<Item = Option<tracing::Span>>,
    batch: &[Incoming],
    events: &mut [EventRow],
) {
    // Both are in APPEND order, a request making at most one event.
    let mut events = events.iter_mut().peekable();
    for (span, m) in spans.zip(batch) {
        while events.next_if(|e| e.event.stream_seq < Some(m.stream_seq)).is_some() {}
        let event = events.next_if(|e| e.event.stream_seq == Some(m.stream_seq));
        let Some(span) = span else { continue };
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

/// Committed groups waiting to be indexed for search (a full queue holds the publisher back).
const INDEX_QUEUE: usize = 256;
/// Deleted sessions waiting for their messages to be removed (a full queue holds the
/// publisher back).
const PURGE_QUEUE: usize = 1024;

/// What a commit leaves to do: feed, position, replies, purge.
struct Committed {
    events: Vec<EventRow>,
    replies: Vec<(String, Outcome)>,
    last_stream_seq: i64,
    /// The removals a committed delete calls for; its replies wait until they are done.
    purges: Vec<Purge>,
}

/// A deleted session's stream messages to remove: those whose APPEND sequence is at most
/// `through`, the delete's own (later ones belong to a session created again under its id).
#[derive(Debug, Clone, Copy)]
struct Purge {
    session: SessionId,
    through: u64,
}

/// A committed delete's removals and the replies that wait for them.
type DeleteDone = (Vec<Purge>, Vec<(String, Outcome)>);

async fn publisher(
    pool: PgPool,
    bus: Bus,
    partition: i32,
    mut from_writer: tokio::sync::mpsc::Receiver<Committed>,
    to_purger: tokio::sync::mpsc::Sender<DeleteDone>,
    to_indexer: tokio::sync::mpsc::Sender<search::Committed>,
) -> anyhow::Result<()> {
    let mut unmarked: Option<i64> = None;
    let mut batches_unmarked = 0;
    while let Some(first) = from_writer.recv().await {
        // What was committed meanwhile goes out together.
        let mut group = vec![first];
        while let Ok(next) = from_writer.try_recv() {
            group.push(next);
        }
        let started = Instant::now();
        // The commit is durable: its producers hear first, then the feed gets its events
        // (a crash in between loses nothing: the next writer republishes from
        // `published_seq`). A delete's replies wait for its removal, below.
        for committed in group.iter().filter(|c| c.purges.is_empty()) {
            send_replies(&bus, &committed.replies).await?;
        }
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
        let indexing = search::Committed::of(group.iter().flat_map(|c| c.events.iter()), last_stream_seq);
        to_indexer.send(indexing).await.context("search indexer stopped")?;
        batches_unmarked += group.len();
        for committed in group.into_iter().filter(|c| !c.purges.is_empty()) {
            to_purger.send((committed.purges, committed.replies)).await.context("purger stopped")?;
        }
        unmarked = Some(last_stream_seq);
        // Move `published_seq` when caught up (or every few batches under load).
        if let Some(through) = unmarked.filter(|_| from_writer.is_empty() || batches_unmarked >= 16) {
            store::mark_published(&pool, partition, through).await?;
            metrics::metrics().published(partition.unsigned_abs(), through);
            (unmarked, batches_unmarked) = (None, 0);
        }
    }
    if let Some(seq) = unmarked {
        store::mark_published(&pool, partition, seq).await?;
        metrics::metrics().published(partition.unsigned_abs(), seq);
    }
    Ok(())
}

/// Best effort: a producer that misses its reply looks the outcome up.
async fn send_replies(bus: &Bus, replies: &[(String, Outcome)]) -> anyhow::Result<()> {
    for (reply_to, outcome) in replies {
        let _ = bus.client.publish(reply_to.clone(), serde_json::to_vec(outcome)?.into()).await;
    }
    Ok(())
}

/// Removes deleted sessions' messages in the order of their deletes, then answers each
/// delete (DESIGN §6: a delete is answered once its session is gone from the streams).
async fn purger(
    pool: PgPool,
    bus: Bus,
    mut purges: tokio::sync::mpsc::Receiver<DeleteDone>,
) -> anyhow::Result<()> {
    while let Some((removals, replies)) = purges.recv().await {
        for purge in removals {
            purge_session(&pool, &bus, purge).await?;
        }
        send_replies(&bus, &replies).await?;
    }
    Ok(())
}

/// Applies a batch (a delete alone) and commits it with the new position. Earlier outcomes
/// are looked up for the requests that can have one (with a zero `duplicate_window`, all).
#[allow(clippy::too_many_arguments)]
async fn apply_and_commit(
    pool: &PgPool,
    conn: &mut PgConnection,
    bus: &Bus,
    partition: i32,
    applied: i64,
    batch: &[Incoming],
    cache: &mut HashMap<SessionId, SessionRow>,
    duplicate_window: Duration,
) -> anyhow::Result<(usize, Committed)> {
    let mut to_load: Vec<Uuid> = Vec::new();
    let mut requests: Vec<Uuid> = Vec::new();
    let mut state = LoadedState::default();
    // Sessions come from the cache where it has them; earlier outcomes from the database,
    // for requests that can have one.
    for m in batch {
        if let Some(s) = m.subject_session {
            match cache.get(&s) {
                Some(row) => {
                    state.sessions.insert(s, row.clone());
                }
                None => to_load.push(s.0),
            }
        }
        match m.request_id() {
            Some(id) if !m.skips_lookup(duplicate_window) => requests.push(id),
            _ => {}
        }
    }
    to_load.sort_unstable();
    to_load.dedup();
    let t0 = Instant::now();
    let loaded = store::load_state(pool, &to_load, &requests).await?;
    let t_load = t0.elapsed();
    state.sessions.extend(loaded.sessions);
    state.outcomes = loaded.outcomes;
    state.partitions = bus.partitions;
    let (parents, deleted) = fork_parents_and_delete(batch);
    if !parents.is_empty() || deleted.is_some() {
        store::load_family(pool, &mut state, &parents, deleted).await?;
    }
    let fx = apply_batch(batch, &mut state);
    let t_apply = t0.elapsed();

    // Dead letters go out before the commit (deduplicated by stream sequence), so a crash
    // in between cannot lose one.
    for (session, letter) in &fx.dead {
        tracing::warn!(stream_seq = ?letter.stream_seq, reason = %letter.reason, detail = %letter.detail,
            "request dead-lettered");
        metrics::metrics().dead_letter(&letter.reason);
        let subject = bus.names.dead_subject(&letter.reason, *session);
        let msg_id = format!("dead:{}", letter.stream_seq.unwrap_or_default());
        let payload: bytes::Bytes = serde_json::to_vec(letter)?.into();
        patiently("publishing a dead letter", || async {
            let msg = PublishMessage::build().payload(payload.clone()).message_id(msg_id.as_str());
            bus.js.send_publish(subject.clone(), msg).await?.await?;
            Ok(())
        })
        .await?;
    }
    store::commit(conn, partition, applied, &fx).await?;

    tracing::debug!(
        partition,
        requests = fx.consumed,
        load_us = t_load.as_micros() as u64,
        apply_us = (t_apply - t_load).as_micros() as u64,
        write_us = (t0.elapsed() - t_apply).as_micros() as u64,
        "batch committed"
    );
    if cache.len() > SESSION_CACHE {
        cache.clear();
    }
    for row in fx.created.iter().chain(&fx.updated) {
        cache.insert(row.id, row.clone());
    }
    for removal in &fx.removals {
        match &removal.kept {
            Some(row) => cache.insert(removal.session, row.clone()),
            None => cache.remove(&removal.session),
        };
    }
    let committed = Committed {
        events: fx.events,
        replies: fx.replies,
        last_stream_seq: i64::try_from(fx.last_stream_seq)?,
        purges: fx
            .removals
            .iter()
            .map(|r| Purge { session: r.session, through: fx.last_stream_seq })
            .collect(),
    };
    Ok((fx.consumed, committed))
}

/// The parents of the batch's forks, and the session a delete in it names (a delete is
/// the first request of its batch when it is applied).
fn fork_parents_and_delete(batch: &[Incoming]) -> (Vec<Uuid>, Option<SessionId>) {
    let mut parents: Vec<Uuid> = batch
        .iter()
        .filter_map(|m| m.request().and_then(|r| r.forked_from))
        .map(|f| f.session_id.0)
        .collect();
    parents.sort_unstable();
    parents.dedup();
    let deleted =
        batch.first().and_then(Incoming::request).filter(|r| r.op == Op::Delete).map(|r| r.session_id);
    (parents, deleted)
}

/// What a failed commit calls for.
#[derive(Debug, PartialEq)]
enum CommitFault {
    /// The batch's data: split it (the database's message).
    Data(String),
    /// Not known yet: the same batch once more.
    Again,
    /// A lost connection, a conflict, a timeout, another writer: step down, try later.
    Transient,
}

/// Data errors ([`data_error`]) and values the driver cannot encode are the data's at
/// once. Connection, resource, conflict, lock, cancellation and system errors (SQLSTATE
/// classes 08, 40, 53, 55, 57, 58) are transient. Any other database error is the data's
/// once the same batch gave it twice in a row (`reproduced` remembers the first).
fn commit_fault(e: &anyhow::Error, reproduced: &mut Option<String>) -> CommitFault {
    let Some(store::StoreError::Sql(sql)) = e.downcast_ref() else { return CommitFault::Transient };
    if let sqlx::Error::Encode(why) = sql {
        return CommitFault::Data(format!("the value cannot be stored: {why}"));
    }
    if let Some(why) = data_error(sql) {
        return CommitFault::Data(why);
    }
    let sqlx::Error::Database(db) = sql else { return CommitFault::Transient };
    let code = db.code().unwrap_or_default().into_owned();
    let why = format!("{} (SQLSTATE {code})", db.message());
    match code.get(..2).unwrap_or_default() {
        "08" | "40" | "53" | "55" | "57" | "58" | "" => CommitFault::Transient,
        _ if reproduced.as_deref() == Some(why.as_str()) => {
            *reproduced = None;
            CommitFault::Data(why)
        }
        _ => {
            *reproduced = Some(why);
            CommitFault::Again
        }
    }
}

/// The database's message when `e` is a data error (SQLSTATE class 22, 23 or 54: a value out
/// of range, a constraint, a program limit such as an index row or a tsvector too long).
fn data_error(e: &sqlx::Error) -> Option<String> {
    let sqlx::Error::Database(db) = e else { return None };
    let code = db.code().unwrap_or_default();
    matches!(code.get(..2), Some("22" | "23" | "54")).then(|| format!("{} (SQLSTATE {code})", db.message()))
}

fn is_unique_violation(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref(), Some(store::StoreError::Sql(sqlx::Error::Database(d))) if d.is_unique_violation())
}

/// A message decoded ahead of its batch, holding its share of the read-ahead budget.
type ReadAhead = (Incoming, OwnedSemaphorePermit);

/// How often a reader that has received nothing checks that its consumer still exists, and
/// how long it waits for the answer (a consumer on a dead node does not answer at all).
const CONSUMER_CHECK: Duration = Duration::from_secs(1);
/// The expiry of the ordered consumer's pulls, which sets its idle heartbeat to half of it:
/// async-nats's default (30 s) leaves a lost consumer unnoticed for a minute.
const PULL_EXPIRES: Duration = Duration::from_secs(2);
/// How long creating a consumer may take before it is asked again.
const CONSUMER_CREATE: Duration = Duration::from_secs(2);
/// A pause before creating a consumer again (a leader election takes seconds).
const RECREATE_PAUSE: Duration = Duration::from_millis(250);

/// Reads the partition's messages in order from `next` and decodes each (tokenizing
/// included) while the writer applies and commits the batch before; at most
/// [`READ_AHEAD_BYTES`] of bodies wait, read but not yet committed.
///
/// The reader keeps its own consumer alive rather than trusting the library's: an ordered
/// consumer is an R1 ephemeral one on one nats-server, gone with that server (a restart,
/// or a stream leader dying on a cluster). When the client reconnects, when the consumer
/// is no longer there, or when the library's own recreation starts over from the stream's
/// beginning, a new consumer is made from the first sequence not yet handed on, as often
/// as it takes. Nothing is handed on twice or skipped: the writer commits in this order.
async fn read_ahead(
    bus: Bus,
    stream: async_nats::jetstream::stream::Stream,
    partition: u32,
    mut next: u64,
    budget: Arc<Semaphore>,
    to_writer: tokio::sync::mpsc::Sender<ReadAhead>,
) {
    let mut reconnects = bus.reconnects();
    let mut failures = 0u32;
    loop {
        reconnects.borrow_and_update();
        let open = async {
            let consumer = stream
                .create_consumer(OrderedConfig {
                    filter_subject: bus.names.append_partition_filter(partition),
                    deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: next },
                    max_expires: PULL_EXPIRES,
                    ..Default::default()
                })
                .await?;
            let name = consumer.cached_info().name.clone();
            anyhow::Ok((name, consumer.messages().await?))
        };
        // A stream without a leader leaves the request unanswered until the client's
        // request timeout; asking again sooner finds the new leader sooner.
        let opened = tokio::time::timeout(CONSUMER_CREATE, open)
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {CONSUMER_CREATE:?}")));
        let (name, mut messages) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                if failures == 0 {
                    tracing::warn!(
                        partition,
                        next,
                        error = format!("{e:#}"),
                        "cannot read the APPEND stream; trying again"
                    );
                }
                failures += 1;
                tokio::time::sleep(RECREATE_PAUSE).await;
                continue;
            }
        };
        if failures > 0 {
            tracing::info!(partition, next, attempts = failures + 1, "reading the APPEND stream again");
            failures = 0;
        }
        let mut check = tokio::time::interval(CONSUMER_CHECK);
        check.reset();
        let mut received = false;
        let lost = loop {
            let m = tokio::select! {
                _ = reconnects.changed() => break "reconnected to NATS".to_owned(),
                _ = check.tick() => {
                    if !std::mem::take(&mut received) {
                        match tokio::time::timeout(CONSUMER_CHECK, stream.consumer_info(&name)).await {
                            Ok(Ok(_)) => {}
                            Ok(Err(e)) => break format!("consumer {name}: {e}"),
                            Err(_) => break format!("consumer {name} did not answer within {CONSUMER_CHECK:?}"),
                        }
                    }
                    continue;
                }
                m = messages.next() => m,
            };
            let m = match m {
                Some(Ok(m)) => m,
                Some(Err(e)) => break format!("{e:#}"),
                None => break "the consumer's messages ended".to_owned(),
            };
            received = true;
            if let Ok(info) = m.info() {
                metrics::metrics().unread(partition, info.pending);
            }
            let item = match incoming(m) {
                Ok(item) => item,
                Err(e) => break format!("{e:#}"),
            };
            if item.stream_seq < next {
                break format!("the library's consumer started over at {}", item.stream_seq);
            }
            let cost = item.body.len().clamp(1, READ_AHEAD_BYTES) as u32;
            let Ok(permit) = budget.clone().acquire_many_owned(cost).await else { return };
            next = item.stream_seq + 1;
            if to_writer.send((item, permit)).await.is_err() {
                return;
            }
        };
        tracing::warn!(partition, next, reason = lost, "APPEND consumer lost; creating it again");
        tokio::time::sleep(RECREATE_PAUSE).await;
    }
}

fn incoming(m: async_nats::jetstream::Message) -> anyhow::Result<Incoming> {
    let info = m.info().map_err(|e| anyhow::anyhow!("message without JetStream info: {e}"))?;
    let (stream_seq, published) = (info.stream_sequence, info.published);
    let subject_session = m.subject.rsplit('.').next().and_then(|s| s.parse::<SessionId>().ok());
    let reply_to = m.headers.as_ref().and_then(|h| h.get(REPLY_HEADER)).map(|v| v.to_string());
    let redrive = m.headers.as_ref().is_some_and(|h| h.get(REDRIVE_HEADER).is_some());
    let traceparent = trace::from_headers(m.headers.as_ref());
    Ok(Incoming::new(
        stream_seq,
        published,
        subject_session,
        reply_to,
        traceparent,
        redrive,
        m.message.payload,
    ))
}

/// How long a publish keeps being retried (JetStream deduplicates the copies) before the
/// writer steps down: a leader election on a NATS cluster takes 4–9 s.
const PUBLISH_PATIENCE: Duration = Duration::from_secs(30);

/// Runs `attempt` until it succeeds or [`PUBLISH_PATIENCE`] has passed.
async fn patiently<F, Fut>(what: &str, mut attempt: F) -> anyhow::Result<()>
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
async fn publish_events(bus: &Bus, events: impl IntoIterator<Item = &EventRow>) -> anyhow::Result<()> {
    let events: Vec<&EventRow> = events.into_iter().collect();
    patiently("publishing committed events", || publish_events_once(bus, &events)).await
}

async fn publish_events_once(bus: &Bus, events: &[&EventRow]) -> anyhow::Result<()> {
    let mut acks = Vec::new();
    for e in events {
        let subject = bus.names.events_subject(e.event.kind.as_str(), e.event.session_id);
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

/// The removals a previous writer of `partition` left undone. A record from before deletes
/// named their sequence is bounded by the partition's position: the delete is at or below
/// it, and nothing above it has been applied yet.
async fn finish_purges(pool: &PgPool, bus: &Bus, partition: u32, applied: i64) -> anyhow::Result<()> {
    for (session, through) in store::pending_purges(pool).await? {
        if partition_of(session, bus.partitions) == partition {
            let through = u64::try_from(through.unwrap_or(applied)).unwrap_or_default();
            purge_session(pool, bus, Purge { session, through }).await?;
        }
    }
    Ok(())
}

/// Removes a deleted session's messages up to its delete from all three streams — APPEND
/// by its own sequence, EVENTS and DEAD by the APPEND sequence their bodies carry — then
/// its purge record. Later messages stay: they belong to a session created again under
/// the same id, whose log a rebuild must find. A session kept hidden for its forks keeps
/// the APPEND messages (and feed messages) of the events it keeps, and the delete that hid
/// it, so a rebuild reproduces it (DESIGN §10).
///
/// One message at a time, never a purge with a subject filter: on nats-server 2.9 such a
/// purge moves every consumer of the stream past messages it has not read yet, with or
/// without a sequence bound (nats-server#3838, #5075), so this writer, a rebuild or a worker
/// would skip other sessions' messages. Deleting single messages leaves consumers be.
async fn purge_session(pool: &PgPool, bus: &Bus, purge: Purge) -> anyhow::Result<()> {
    let Purge { session, through } = purge;
    let kept = store::kept_messages(pool, session).await?;
    let keep = |seq: Option<u64>| seq.is_some_and(|s| kept.contains(&s));
    let [append, events, dead] = bus.names.session_filters(bus.partition_of(session), session);
    // APPEND sequences only grow along the subject: the first one past the delete ends it.
    let mut removed = remove_through(bus, append, through, |m| Some(m.sequence), &keep, true).await?;
    removed += remove_through(bus, events, through, |m| event_append_seq(&m.payload), &keep, false).await?;
    removed +=
        remove_through(bus, dead, through, |m| dead_letter_append_seq(&m.payload), &|_| false, false).await?;
    store::purge_done(pool, session, i64::try_from(through).unwrap_or(i64::MAX)).await?;
    tracing::info!(%session, through, removed, kept = kept.len(), "deleted session removed from the streams");
    Ok(())
}

/// Deletes, one by one, the messages of `stream` on `filter` whose APPEND sequence (per
/// `append_seq`; None counts as old enough) is at most `through`, except those `keep`
/// names; returns how many. With `ordered`, the scan ends at the first message past
/// `through`.
async fn remove_through(
    bus: &Bus,
    (stream, filter): (String, String),
    through: u64,
    append_seq: fn(&StreamMessage) -> Option<u64>,
    keep: &(dyn Fn(Option<u64>) -> bool + Sync),
    ordered: bool,
) -> anyhow::Result<u64> {
    let s = bus.js.get_stream_no_info(&stream).await.with_context(|| format!("opening {stream}"))?;
    let (mut next, mut removed) = (1, 0);
    loop {
        let m = match s.get_first_raw_message_by_subject(&filter, next).await {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(removed),
            Err(e) => return Err(e).with_context(|| format!("finding {filter} in {stream}")),
        };
        next = m.sequence + 1;
        let seq = append_seq(&m);
        if seq.is_some_and(|seq| seq > through) {
            if ordered {
                return Ok(removed);
            }
            continue;
        }
        if keep(seq) {
            continue;
        }
        s.delete_message(m.sequence).await.with_context(|| format!("deleting {stream} {}", m.sequence))?;
        removed += 1;
    }
}

/// The APPEND sequence a committed event's body carries.
fn event_append_seq(payload: &[u8]) -> Option<u64> {
    serde_json::from_slice::<CommittedEvent>(payload).ok().and_then(|e| e.stream_seq)
}

/// The APPEND sequence a dead letter stands for.
fn dead_letter_append_seq(payload: &[u8]) -> Option<u64> {
    serde_json::from_slice::<DeadLetter>(payload).ok().and_then(|l| l.append_seq())
}
