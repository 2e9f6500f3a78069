//! Apply-only mode: a database rebuilt from TURNLOG_APPEND by the writer's own apply code.
//! No feed, no replies, no dead-letter publishing, no purges — but every outcome, rejected
//! ones included, is recorded as the live writer records it. The target starts empty, so
//! the whole state stays in memory, no batch reads the database, and rows are bulk-loaded
//! (`bulk`); a rebuild that stops part-way leaves a database to drop, not to resume.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::stream::RawMessageErrorKind;
use futures::StreamExt as _;
use sqlx::{PgConnection, PgPool};
use turnlog_runtime::bus::{Bus, DeadLetter, OutcomeStatus, Refusal};

use crate::apply::{apply_batch, BatchEffects, Incoming, LoadedState};
use crate::bulk;
use crate::read_ahead::incoming;

/// Most requests applied and written per transaction: ten times the live writer's, since
/// no producer waits for a reply and a larger COPY spreads each commit's costs thinner.
const REBUILD_BATCH: usize = 5_000;
/// Connections loading rows at once, the partitions' together: a partition's batches are
/// spread over its share of them, at least one (a COPY keeps one server core busy).
const LOADING_CONNECTIONS: u32 = 2;
/// Applied batches waiting for the database: applying runs ahead of writing by this much.
const WRITE_QUEUE: usize = 2;
/// Events a loading connection copies in one transaction: a batch is cut into shares of
/// this size, which the connections take as each comes free.
const EVENTS_PER_SHARE: usize = 1_250;
/// Chunks read ahead of applying.
const READ_AHEAD: usize = 2;
/// How long one pull request waits for messages (they are all there: it never waits long).
const PULL_EXPIRES: Duration = Duration::from_secs(10);
/// The rebuild's consumer is removed by the server this long after the rebuild went away
/// without deleting it.
const READER_INACTIVE: Duration = Duration::from_secs(60);

/// How far a rebuild got; shared with whoever shows it.
#[derive(Debug, Default)]
pub struct RebuildProgress {
    /// APPEND messages in the stream when the rebuild started.
    pub total: AtomicU64,
    /// APPEND messages applied and written so far.
    pub applied: AtomicU64,
    /// Events written so far.
    pub events: AtomicU64,
}

/// What a finished rebuild did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildSummary {
    /// APPEND messages applied.
    pub messages: u64,
    pub events: u64,
    /// Requests that went to the dead letters when first applied (none is published again).
    pub dead_lettered: u64,
    /// Requests recorded as rejected (dead letters that decoded, failed `expect`s).
    pub rejected: u64,
    /// The last APPEND sequence applied, per partition.
    pub positions: Vec<(u32, u64)>,
    /// Messages the stream held at start that no partition applied: on partitions past
    /// `TURNLOG_PARTITIONS` (a wrong setting), or purged meanwhile by a live writer.
    pub unread: u64,
    pub elapsed: Duration,
}

/// Applies TURNLOG_APPEND from its first message through its last one at start into the
/// empty, migrated database at `database_url`, every partition, and leaves each partition's
/// position where a writer started on it carries on. Refuses a database holding anything.
/// (Partitions are applied independently, as live; a request id reused across partitions
/// — which the live writer answers by timing — makes the final write fail.)
pub async fn rebuild(
    database_url: &str,
    bus: &Bus,
    progress: Arc<RebuildProgress>,
) -> anyhow::Result<RebuildSummary> {
    let connections = (LOADING_CONNECTIONS / bus.partitions.max(1)).max(1) * bus.partitions;
    let pool = turnlog_runtime::db::connect(database_url, connections.max(2) + 1)
        .await
        .context("connecting to the target database")?;
    anyhow::ensure!(
        bulk::is_empty(&pool).await.context("reading the target database (is it migrated?)")?,
        "the target database is not empty: rebuild writes only into an empty, migrated database"
    );
    let name = bus.names.append_stream();
    let mut stream = bus.js.get_stream(&name).await.with_context(|| format!("opening {name}"))?;
    let info = stream.info().await.with_context(|| format!("reading {name}"))?.clone();
    let limits = &info.config;
    if !limits.max_age.is_zero() || limits.max_messages > 0 || limits.max_bytes > 0 {
        tracing::warn!(stream = %name, max_age = ?limits.max_age, max_messages = limits.max_messages,
            max_bytes = limits.max_bytes, "the stream drops old requests: the rebuild has only what is left");
    }
    let through = info.state.last_sequence;
    let unstorable = Arc::new(unstorable_requests(bus).await?);
    progress.total.store(info.state.messages, Ordering::Relaxed);
    let started = Instant::now();
    let set_aside = bulk::set_aside(&mut *pool.acquire().await?).await.context("preparing the target")?;

    let mut tasks = tokio::task::JoinSet::new();
    for partition in 0..bus.partitions {
        let (pool, bus, stream, progress, unstorable) =
            (pool.clone(), bus.clone(), stream.clone(), progress.clone(), unstorable.clone());
        tasks.spawn(async move {
            let done =
                rebuild_partition(partition, &pool, &bus, &stream, through, &unstorable, &progress).await;
            done.with_context(|| format!("rebuilding partition {partition}"))
        });
    }
    let mut summary = RebuildSummary {
        messages: 0,
        events: 0,
        dead_lettered: 0,
        rejected: 0,
        positions: Vec::new(),
        unread: 0,
        elapsed: Duration::ZERO,
    };
    let mut finals = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let part = done.context("a partition's rebuild panicked")??;
        finals.push(part.end);
        summary.messages += part.messages;
        summary.events += part.events;
        summary.dead_lettered += part.dead_lettered;
        summary.rejected += part.rejected;
        summary.positions.push((part.partition, part.position));
    }
    summary.positions.sort_unstable();
    summary.unread = info.state.messages.saturating_sub(summary.messages);
    if summary.unread > 0 {
        tracing::warn!(
            unread = summary.unread,
            partitions = bus.partitions,
            "some requests in the stream were not on the partitions rebuilt: is TURNLOG_PARTITIONS right?"
        );
    }
    let t0 = Instant::now();
    bulk::restore(&pool, set_aside, finals)
        .await
        .context("writing the final state and indexing the target")?;
    tracing::debug!(
        restore_us = t0.elapsed().as_micros() as u64,
        "final state, indexes and constraints written"
    );
    crate::search::positions_at_writer(&pool).await.context("moving the search positions")?;
    summary.elapsed = started.elapsed();
    pool.close().await;
    Ok(summary)
}

struct PartitionDone {
    partition: u32,
    position: u64,
    /// What is written once every partition is loaded ([`bulk::restore`]).
    end: bulk::PartitionEnd,
    messages: u64,
    events: u64,
    dead_lettered: u64,
    rejected: u64,
}

/// One partition, as its live writer applied it: in stream order, batch by batch — read,
/// applied and written by three tasks in a pipeline, so NATS, this process and Postgres
/// work at once.
async fn rebuild_partition(
    partition: u32,
    pool: &PgPool,
    bus: &Bus,
    stream: &async_nats::jetstream::stream::Stream,
    through: u64,
    unstorable: &Arc<HashMap<u64, String>>,
    progress: &Arc<RebuildProgress>,
) -> anyhow::Result<PartitionDone> {
    let p = i32::try_from(partition).context("partition out of range")?;
    let mut dead_lettered = 0;
    let consumer: PullConsumer = stream
        .create_consumer(pull::Config {
            description: Some("turnlog rebuild".to_owned()),
            filter_subject: bus.names.append_partition_filter(partition),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::None,
            inactive_threshold: READER_INACTIVE,
            ..Default::default()
        })
        .await
        .context("creating a consumer of the APPEND stream")?;
    let name = consumer.cached_info().name.clone();
    let nothing = consumer.cached_info().num_pending == 0;

    let (to_applier, mut from_reader) = tokio::sync::mpsc::channel(READ_AHEAD);
    let unstorable = unstorable.clone();
    let reader = tokio::spawn(async move {
        if nothing {
            return Ok(());
        }
        read_partition(consumer, through, &unstorable, to_applier).await
    });
    let (to_writer, from_applier) = tokio::sync::mpsc::channel(WRITE_QUEUE);
    let lanes = (LOADING_CONNECTIONS / bus.partitions.max(1)).max(1);
    let writer = tokio::spawn(write_batches(pool.clone(), p, lanes, from_applier, progress.clone()));
    let mut state = LoadedState { partitions: bus.partitions, ..LoadedState::default() };
    let mut carry: Vec<Incoming> = Vec::new();
    'chunks: while let Some(chunk) = from_reader.recv().await {
        carry.extend(chunk);
        // A chunk is one batch, unless a delete (applied alone) splits it.
        while !carry.is_empty() {
            let t0 = Instant::now();
            let fx = apply_batch(&carry, &mut state);
            state.forget_deleted(&fx);
            tracing::debug!(
                partition,
                requests = fx.consumed,
                apply_us = t0.elapsed().as_micros() as u64,
                "batch applied"
            );
            carry.drain(..fx.consumed);
            dead_lettered += fx.dead.len() as u64;
            if to_writer.send(fx).await.is_err() {
                // The writer stopped: its error says why, below.
                break 'chunks;
            }
        }
    }
    let rejected =
        state.outcomes.values().filter(|(o, _)| o.status == OutcomeStatus::Rejected).count() as u64;
    drop(from_reader);
    drop(to_writer);
    // Whatever stopped early, the reader or the writer, reports its error here.
    let reader = reader.await.context("the rebuild's reader panicked")?;
    let (position, messages, events) = writer.await.context("the rebuild's writer panicked")??;
    reader?;
    if let Err(e) = stream.delete_consumer(&name).await {
        tracing::debug!(consumer = %name, error = %e, "rebuild consumer not deleted; it expires by itself");
    }
    tracing::info!(partition, position, messages, events, "partition loaded");
    Ok(PartitionDone {
        partition,
        position: u64::try_from(position).unwrap_or_default(),
        end: bulk::PartitionEnd { partition: p, position, state },
        messages,
        events,
        dead_lettered,
        rejected,
    })
}

/// Reads a partition's messages through `through` in order, in chunks of up to
/// [`REBUILD_BATCH`], one pull request each. (Not an ordered consumer: its recovery from
/// missed heartbeats stalled a loaded rebuild for a minute.)
async fn read_partition(
    consumer: PullConsumer,
    through: u64,
    unstorable: &HashMap<u64, String>,
    chunks: tokio::sync::mpsc::Sender<Vec<Incoming>>,
) -> anyhow::Result<()> {
    let mut delivered = 0u64;
    loop {
        let mut batch = consumer
            .batch()
            .max_messages(REBUILD_BATCH)
            .expires(PULL_EXPIRES)
            .messages()
            .await
            .context("pulling from the APPEND stream")?;
        let mut chunk = Vec::with_capacity(REBUILD_BATCH);
        let mut last = false;
        while let Some(m) = batch.next().await {
            let m = m.map_err(|e| anyhow::anyhow!("pulling from the APPEND stream: {e}"))?;
            let info = m.info().map_err(|e| anyhow::anyhow!("message without JetStream info: {e}"))?;
            let (seq, pending) = (info.stream_sequence, info.pending);
            // Every delivery counts: nothing may go missing between the server and here.
            anyhow::ensure!(
                info.consumer_sequence == delivered + 1,
                "APPEND message {seq} arrived out of order: the rebuild cannot go on (start it again)"
            );
            delivered += 1;
            if seq > through {
                last = true;
                break;
            }
            let mut request = incoming(m)?;
            if let Some(why) = unstorable.get(&seq) {
                request.mark_unstorable(why.clone());
            }
            chunk.push(request);
            if seq >= through || pending == 0 {
                last = true;
                break;
            }
        }
        if !chunk.is_empty() && chunks.send(chunk).await.is_err() {
            // The applier stopped; its side says why.
            return Ok(());
        }
        if last {
            return Ok(());
        }
    }
}

/// The requests the live writer found the database refuses to store, by APPEND sequence,
/// with the database's message: its `unstorable` dead letters, which a rebuild refuses
/// again rather than fail on.
async fn unstorable_requests(bus: &Bus) -> anyhow::Result<HashMap<u64, String>> {
    let name = bus.names.dead_stream();
    let stream = bus.js.get_stream_no_info(&name).await.with_context(|| format!("opening {name}"))?;
    let filter = format!("{}.dead.{}.*", bus.names.prefix(), Refusal::Unstorable);
    let (mut next, mut found) = (1, HashMap::new());
    loop {
        let m = match stream.get_first_raw_message_by_subject(&filter, next).await {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(found),
            Err(e) => return Err(e).with_context(|| format!("reading {filter} in {name}")),
        };
        next = m.sequence + 1;
        if let Ok(letter) = serde_json::from_slice::<DeadLetter>(&m.payload) {
            if let Some(seq) = letter.stream_seq {
                found.insert(seq, letter.detail);
            }
        }
    }
}

/// An applied batch on its way to the database, and how many of its writes are left.
struct Writing {
    fx: BatchEffects,
    left: AtomicUsize,
}

/// One write of a batch: its head ([`bulk::write_head`]) or a share of its events.
struct Job {
    batch: Arc<Writing>,
    events: Option<Range<usize>>,
}

/// Writes applied batches over `lanes` connections until the applier is done; returns the
/// partition's position, the messages and the events written. Each batch's events are cut
/// into shares that the connections take as each comes free, so none waits for another at
/// a batch's end; the first connection also writes the heads, in batch order (sessions
/// before the memories that name them, file ops in turn). A delete is written alone:
/// everything before it first, nothing after it until it has committed.
async fn write_batches(
    pool: PgPool,
    partition: i32,
    lanes: u32,
    mut writes: tokio::sync::mpsc::Receiver<BatchEffects>,
    progress: Arc<RebuildProgress>,
) -> anyhow::Result<(i64, u64, u64)> {
    let (heads, heads_out) = tokio::sync::mpsc::channel::<Job>(WRITE_QUEUE);
    let (shares, shares_out) =
        tokio::sync::mpsc::channel::<Job>(WRITE_QUEUE * REBUILD_BATCH / EVENTS_PER_SHARE);
    let (done_in, done) = tokio::sync::mpsc::unbounded_channel();
    let shares_out = Arc::new(tokio::sync::Mutex::new(shares_out));
    let mut heads_out = Some(heads_out);
    let mut writers = tokio::task::JoinSet::new();
    for lane in 0..lanes {
        let mut conn = pool.acquire().await?;
        // A crashed rebuild is started again from an empty database, so these commits need
        // not wait for the disk: the final state's commit does, and makes every earlier one
        // durable.
        sqlx::query("SET synchronous_commit = off").execute(&mut *conn).await?;
        let (heads, shares, done) = (heads_out.take(), shares_out.clone(), done_in.clone());
        writers.spawn(async move {
            let written = write_lane(&mut conn, partition, lane, heads, shares, &done).await;
            if let Err(e) = written {
                // Sent before this task ends, so the dispatcher hears the error itself.
                let _ = done.send(Err(e));
                return Ok(());
            }
            sqlx::query("RESET synchronous_commit").execute(&mut *conn).await.map(drop)
        });
    }
    drop((done_in, shares_out));
    let mut lanes = Lanes { done, writers, in_flight: 0, position: 0, messages: 0, events: 0, progress };
    while let Some(fx) = writes.recv().await {
        let alone = fx.deleted.is_some();
        while alone && lanes.in_flight > 0 {
            lanes.wait().await?;
        }
        let head = bulk::has_head(&fx);
        let cuts: Vec<Range<usize>> = (0..fx.events.len())
            .step_by(EVENTS_PER_SHARE)
            .map(|from| from..fx.events.len().min(from + EVENTS_PER_SHARE))
            .collect();
        let batch = Arc::new(Writing { left: AtomicUsize::new(cuts.len() + usize::from(head)), fx });
        lanes.in_flight += 1;
        if !head && cuts.is_empty() {
            lanes.written(&batch)?;
            continue;
        }
        // A send fails only when a lane stopped, whose error `wait` returns.
        if head && heads.send(Job { batch: batch.clone(), events: None }).await.is_err() {
            return Err(lanes.failure().await);
        }
        for events in cuts {
            if shares.send(Job { batch: batch.clone(), events: Some(events) }).await.is_err() {
                return Err(lanes.failure().await);
            }
        }
        while alone && lanes.in_flight > 0 {
            lanes.wait().await?;
        }
        while let Ok(w) = lanes.done.try_recv() {
            let w = w?;
            lanes.written(&w)?;
        }
    }
    drop((heads, shares));
    while lanes.in_flight > 0 {
        lanes.wait().await?;
    }
    while let Some(lane) = lanes.writers.join_next().await {
        lane.context("a loading connection's task panicked")??;
    }
    Ok((lanes.position, lanes.messages, lanes.events))
}

/// The loading connections' tasks, what they report, and what they have written.
struct Lanes {
    done: tokio::sync::mpsc::UnboundedReceiver<Result<Arc<Writing>, sqlx::Error>>,
    writers: tokio::task::JoinSet<Result<(), sqlx::Error>>,
    /// Batches handed to the lanes and not yet written.
    in_flight: usize,
    position: i64,
    messages: u64,
    events: u64,
    progress: Arc<RebuildProgress>,
}

impl Lanes {
    /// Waits for the next batch to be written, or for a lane's error.
    async fn wait(&mut self) -> anyhow::Result<()> {
        loop {
            tokio::select! {
                // A lane's error is sent before its task ends: it comes first.
                biased;
                w = self.done.recv() => {
                    let w = w.context("the loading connections stopped with batches unwritten")??;
                    return self.written(&w);
                }
                // A lane whose queues are closed ends while others still write.
                Some(ended) = self.writers.join_next() => ended.context("a loading connection's task panicked")??,
            }
        }
    }

    /// Why a lane stopped: the error it reported.
    async fn failure(&mut self) -> anyhow::Error {
        loop {
            if let Err(e) = self.wait().await {
                return e;
            }
        }
    }

    fn written(&mut self, w: &Writing) -> anyhow::Result<()> {
        self.in_flight -= 1;
        self.position = self.position.max(i64::try_from(w.fx.last_stream_seq)?);
        self.messages += w.fx.consumed as u64;
        self.events += w.fx.events.len() as u64;
        self.progress.applied.fetch_add(w.fx.consumed as u64, Ordering::Relaxed);
        self.progress.events.fetch_add(w.fx.events.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// One loading connection: takes the heads first (the first lane only), then any share of
/// events, until both queues are closed; reports each batch whose last write it made.
async fn write_lane(
    conn: &mut PgConnection,
    partition: i32,
    lane: u32,
    mut heads: Option<tokio::sync::mpsc::Receiver<Job>>,
    shares: Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Job>>>,
    done: &tokio::sync::mpsc::UnboundedSender<Result<Arc<Writing>, sqlx::Error>>,
) -> Result<(), sqlx::Error> {
    let next_share = || async { shares.lock().await.recv().await };
    loop {
        let job = match &mut heads {
            Some(queue) => tokio::select! {
                biased;
                head = queue.recv() => match head {
                    Some(job) => job,
                    None => {
                        heads = None;
                        continue;
                    }
                },
                Some(job) = next_share() => job,
            },
            None => match next_share().await {
                Some(job) => job,
                None => return Ok(()),
            },
        };
        let t0 = Instant::now();
        let fx = &job.batch.fx;
        match &job.events {
            None => bulk::write_head(conn, fx).await?,
            Some(events) => bulk::write_events(conn, &fx.events[events.clone()]).await?,
        }
        tracing::debug!(
            partition,
            lane,
            events = job.events.as_ref().map_or(0, ExactSizeIterator::len),
            write_us = t0.elapsed().as_micros() as u64,
            "written"
        );
        if job.batch.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _ = done.send(Ok(job.batch));
        }
    }
}
