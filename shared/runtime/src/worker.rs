//! The one consumer loop every worker on the committed-event feed runs — a durable pull
//! consumer shared by the worker's copies: bounded concurrency, ack after the append is
//! committed, nak with backoff, dead letters, graceful stop, counters. The same loop
//! replays history: with `ConsumerSettings::replay` set, a worker's `run` consumes a
//! temporary consumer from a start point to the feed's end instead of its durable one.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, FromConsumer as _, PullConsumer};
use async_nats::jetstream::message::{AckKind, PublishMessage};
use async_nats::jetstream::{self, Message};
use futures::StreamExt;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::bus::{feed_token, Bus, CommittedEvent, DeadLetter};
use crate::telemetry::{self, Histogram};
use turnlog_core::events::EventKind;
use turnlog_core::ids::SessionId;

/// How long one pull request waits for messages. Short, because permits freed while a
/// request is open are used only by the next one, and a stop drains the open request.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// A pull request not ended by the server this long after it was sent was lost (a
/// restarted nats-server forgets them, a frozen one holds them). A message the server still
/// sends to it after that reaches the same inbox and is started or handed back.
const PULL_LOST_AFTER: Duration = Duration::from_secs(2);
/// How often the consumer's backlog is read for the lag counter.
const LAG_INTERVAL: Duration = Duration::from_secs(5);
/// The counters are logged every this many lag readings (once a minute), when they moved.
const STATS_LOG_EVERY: u32 = 12;
/// A consumer that failed after running this long starts its backoff from the shortest.
const HEALTHY_RUN: Duration = Duration::from_secs(30);
/// Longest pause between two attempts to reach a lost bus or a missing stream.
const MAX_RECONNECT_BACKOFF: Duration = Duration::from_secs(5);
/// How often a consumer waiting to switch to this version's filter looks whether nothing is
/// pending under its earlier one.
const SWITCH_RECHECK: Duration = Duration::from_secs(5);
/// A replay's temporary consumer is removed by the server this long after its replayer
/// went away without deleting it (a crash, a kill).
const REPLAY_CONSUMER_INACTIVE: Duration = Duration::from_secs(60);
/// How often a replay reads its consumer's state to see whether it is through.
const REPLAY_END_POLL: Duration = Duration::from_millis(250);

/// How a worker consumes: the same for every worker, tuned by settings.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// Events handled at once by one copy of the worker.
    pub concurrency: usize,
    /// Deliveries of one event before it goes to the dead letters.
    pub max_deliver: u32,
    /// How long a delivered event may go unacknowledged before JetStream redelivers it;
    /// a handler still working reports progress well within it.
    pub ack_wait: Duration,
    /// Delay before the n-th redelivery after a failure (the last repeats).
    pub retry_backoff: Vec<Duration>,
    /// Replay mode: `Some` makes [`Worker::run`] go over past events on a temporary
    /// consumer and return when through, instead of consuming the durable consumer.
    pub replay: Option<Replay>,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        Self {
            concurrency: 4,
            max_deliver: 5,
            ack_wait: Duration::from_secs(60),
            retry_backoff: vec![
                Duration::from_secs(2),
                Duration::from_secs(10),
                Duration::from_secs(30),
                Duration::from_secs(60),
            ],
            replay: None,
        }
    }
}

impl ConsumerSettings {
    /// The delay before redelivering an event whose `attempt`-th delivery failed.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let i = usize::try_from(attempt.saturating_sub(1)).unwrap_or(usize::MAX);
        self.retry_backoff.get(i).or(self.retry_backoff.last()).copied().unwrap_or(Duration::ZERO)
    }
}

/// Which delivery of an event a handler is working on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// 1 for the first delivery.
    pub attempt: u32,
    pub max_deliver: u32,
    /// The event's sequence in TURNLOG_EVENTS.
    pub stream_seq: u64,
}

impl Delivery {
    /// After a failure of this delivery the event is dead-lettered, so a handler that can
    /// give up gracefully (append an error event) should do it now.
    pub fn is_last(&self) -> bool {
        self.attempt >= self.max_deliver
    }
}

/// Why a handler did not finish an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    /// Might work later (the model failed, the writer did not answer in time): redelivered
    /// after a backoff, dead-lettered with `reason` after the last delivery.
    #[error("{reason}: {detail}")]
    Retry { reason: &'static str, detail: String },
    /// Can never work (the event does not decode): dead-lettered at once.
    #[error("{reason}: {detail}")]
    Poison { reason: &'static str, detail: String },
}

impl HandleError {
    pub fn retry(reason: &'static str, detail: impl std::fmt::Display) -> Self {
        Self::Retry { reason, detail: detail.to_string() }
    }
    pub fn poison(reason: &'static str, detail: impl std::fmt::Display) -> Self {
        Self::Poison { reason, detail: detail.to_string() }
    }
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Retry { reason, .. } | Self::Poison { reason, .. } => reason,
        }
    }
}

/// What a worker does with one committed event. Returning `Ok` acknowledges the event, so
/// a handler returns only once its append is committed (or it decided to append nothing).
/// Deliveries are at least once: a handler must be idempotent (deterministic event ids).
pub trait Handler: Send + Sync + 'static {
    fn handle(
        &self,
        event: CommittedEvent,
        delivery: Delivery,
    ) -> impl Future<Output = Result<(), HandleError>> + Send;
}

/// Counters a metrics exporter reads; shared by every task of one worker.
#[derive(Debug)]
pub struct WorkerStats {
    /// Events handled and acknowledged.
    pub processed: AtomicU64,
    /// Deliveries after the first (a retry, or a dead copy's event).
    pub redelivered: AtomicU64,
    /// Time a handler took, by delivery.
    pub handler_seconds: Histogram,
    /// Whether the worker's consumer is running now (readiness).
    pub consuming: AtomicBool,
    /// Failed deliveries (each nak and each dead letter).
    pub failed: AtomicU64,
    /// Events given up on and sent to the dead letters.
    pub dead_lettered: AtomicU64,
    /// Events on the feed not yet delivered to the consumer (from the consumer's info).
    pub lag: AtomicU64,
    /// Events delivered but not yet acknowledged (from the consumer's info).
    pub in_flight: AtomicU64,
}

/// A point-in-time copy of [`WorkerStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub processed: u64,
    pub failed: u64,
    pub dead_lettered: u64,
    pub lag: u64,
    pub in_flight: u64,
}

impl Default for WorkerStats {
    fn default() -> Self {
        Self {
            processed: AtomicU64::new(0),
            redelivered: AtomicU64::new(0),
            handler_seconds: Histogram::new(telemetry::SECONDS),
            consuming: AtomicBool::new(false),
            failed: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            lag: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
        }
    }
}

/// The workers of this process whose metrics are exported, by name.
static EXPORTED: LazyLock<Mutex<BTreeMap<String, Arc<WorkerStats>>>> = LazyLock::new(Mutex::default);

/// Exports a worker's counters (`TURNLOG_METRICS_LISTEN`) and makes readiness wait for its
/// consumer and a connection to NATS.
fn export(name: &str, stats: &Arc<WorkerStats>, bus: &Bus) {
    EXPORTED.lock().unwrap_or_else(PoisonError::into_inner).insert(name.to_owned(), stats.clone());
    let registry = telemetry::registry();
    registry.export("workers", render_workers);
    let (stats, client) = (stats.clone(), bus.client.clone());
    registry.ready_when(&format!("worker {name}"), move || {
        stats.consuming.load(Ordering::Relaxed)
            && client.connection_state() == async_nats::connection::State::Connected
    });
}

fn render_workers(out: &mut String) {
    let workers = EXPORTED.lock().unwrap_or_else(PoisonError::into_inner);
    type Get = fn(&WorkerStats) -> u64;
    let families: [(&str, &str, &str, Get); 6] = [
        ("turnlog_worker_processed_total", "counter", "Events handled and acknowledged", |s| {
            s.processed.load(Ordering::Relaxed)
        }),
        ("turnlog_worker_failed_total", "counter", "Failed deliveries (retried or dead-lettered)", |s| {
            s.failed.load(Ordering::Relaxed)
        }),
        ("turnlog_worker_redelivered_total", "counter", "Deliveries after an event's first", |s| {
            s.redelivered.load(Ordering::Relaxed)
        }),
        ("turnlog_worker_dead_lettered_total", "counter", "Events given up on", |s| {
            s.dead_lettered.load(Ordering::Relaxed)
        }),
        (
            "turnlog_worker_pending_messages",
            "gauge",
            "Committed events not yet delivered to the worker",
            |s| s.lag.load(Ordering::Relaxed),
        ),
        ("turnlog_worker_in_flight_messages", "gauge", "Events delivered, not yet acknowledged", |s| {
            s.in_flight.load(Ordering::Relaxed)
        }),
    ];
    for (name, kind, help, get) in families {
        telemetry::family(out, name, kind, help);
        for (worker, stats) in workers.iter() {
            telemetry::sample(out, name, &[("worker", worker)], get(stats) as f64);
        }
    }
    let name = "turnlog_worker_handler_seconds";
    telemetry::family(out, name, "histogram", "Time a handler took for one delivery");
    for (worker, stats) in workers.iter() {
        telemetry::histogram(out, name, &[("worker", worker)], &stats.handler_seconds);
    }
}

impl WorkerStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            processed: self.processed.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            lag: self.lag.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
        }
    }
}

/// Where a replay starts on the committed-event feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayFrom {
    /// This TURNLOG_EVENTS stream sequence.
    Sequence(u64),
    /// The first event the feed received at or after this time.
    Time(chrono::DateTime<chrono::Utc>),
}

/// A replay: a worker's own handler run again over past committed events, on a temporary
/// consumer from `from` through the feed's last event when the replay starts. Handlers are
/// idempotent (deterministic event ids), so a replay appends only what is missing.
#[derive(Debug, Clone)]
pub struct Replay {
    pub from: ReplayFrom,
    /// Only this session's events (by subject, so nothing else is even delivered).
    pub session: Option<SessionId>,
    pub progress: Arc<ReplayProgress>,
}

impl Replay {
    pub fn new(from: ReplayFrom, session: Option<SessionId>) -> Self {
        Self { from, session, progress: Arc::default() }
    }
}

/// How far a replay got; shared with whoever shows it.
#[derive(Debug, Default)]
pub struct ReplayProgress {
    /// Events the replay is to handle, known once its consumer exists (0 before).
    pub total: AtomicU64,
    /// The feed's last sequence when the replay started: where it ends.
    pub through_seq: AtomicU64,
    /// Handled (`processed`), failed deliveries and dead letters so far.
    pub stats: Arc<WorkerStats>,
    finished: AtomicBool,
    error: Mutex<Option<String>>,
}

impl ReplayProgress {
    /// Whether the replay is over (done, stopped or failed).
    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Why the replay failed, once finished.
    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    fn finish(&self, result: Result<(), ConsumeError>) {
        if let Err(e) = result {
            *self.error.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(e.to_string());
        }
        self.finished.store(true, Ordering::Release);
    }
}

/// Which of its kind's events a worker takes. The feed puts an import's events on subjects
/// of their own (`<kind>-imported`, DESIGN §6), so a worker on live turns never receives an
/// import's thousands, nor one on imports the live turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Live,
    Imported,
    /// Both (a replay over history).
    Any,
}

/// One worker's consumer: its name (the durable consumer is `<prefix>-<name>`), the event
/// kinds it handles, and how it consumes.
#[derive(Debug, Clone)]
pub struct Worker {
    pub name: String,
    pub kinds: Vec<EventKind>,
    pub origin: Origin,
    /// Another worker's consumer that took this one's events before (an earlier version's):
    /// created, this one starts where that one's acknowledgements stand, not at the feed's
    /// beginning.
    pub takes_over: Option<String>,
    pub settings: ConsumerSettings,
    /// A replay's session ([`Replay::session`]).
    only_session: Option<SessionId>,
}

impl Worker {
    /// A worker on the live events of `kinds`.
    pub fn new(name: &str, kinds: &[EventKind], settings: ConsumerSettings) -> Self {
        Self {
            name: name.to_owned(),
            kinds: kinds.to_vec(),
            origin: Origin::Live,
            takes_over: None,
            settings,
            only_session: None,
        }
    }

    pub fn origin(self, origin: Origin) -> Self {
        Self { origin, ..self }
    }

    pub fn taking_over(self, name: &str) -> Self {
        Self { takes_over: Some(name.to_owned()), ..self }
    }

    /// The subjects this worker takes: all of them, or one session's. One kind is filtered
    /// by subject; several need the whole feed (nats-server 2.9 has one filter per consumer),
    /// which only a replay uses. The whole feed is not filtered by session: 2.9 refuses
    /// `events.*.<session>` on a feed that stores some kinds only ([`handles`] skips the
    /// other sessions instead).
    ///
    /// [`handles`]: Self::handles
    fn filter_subject(&self, bus: &Bus, session: Option<SessionId>) -> String {
        let token = match (self.kinds.as_slice(), self.origin) {
            ([kind], Origin::Live) => kind.as_str().to_owned(),
            ([kind], Origin::Imported) => feed_token(kind.as_str(), true),
            _ => "*".to_owned(),
        };
        match session {
            Some(session) if token != "*" => bus.names.events_subject(&token, session),
            _ => bus.names.events_kind_filter(&token),
        }
    }

    /// Whether an event this worker's filter let through is its business: the whole feed,
    /// or an earlier version's consumer not switched over yet, brings other kinds too, and
    /// a replay of one session on the whole feed other sessions.
    fn handles(&self, event: &CommittedEvent) -> bool {
        self.kinds.contains(&event.kind) && self.only_session.is_none_or(|s| s == event.session_id)
    }

    /// The durable consumer every copy of this worker shares.
    pub fn consumer_name(&self, bus: &Bus) -> String {
        format!("{}-{}", bus.names.prefix(), self.name)
    }

    /// Consumes until `shutdown` completes, then stops pulling, hands back events not yet
    /// started (nak, so another copy takes them at once) and waits for those in hand.
    /// Reconnects by itself: a lost bus or a missing stream is retried with backoff.
    /// In replay mode (`settings.replay`) it replays instead, counting in the replay's progress.
    pub async fn run<H: Handler>(
        &self,
        bus: Bus,
        handler: Arc<H>,
        stats: Arc<WorkerStats>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        if let Some(replay) = &self.settings.replay {
            let result = self.replay(&bus, &handler, replay, shutdown).await;
            if let Err(e) = &result {
                tracing::error!(worker = %self.name, error = %e, "replay failed");
            }
            replay.progress.finish(result);
            return;
        }
        let stop = stop_signal(shutdown);
        let permits = Arc::new(Semaphore::new(self.settings.concurrency.max(1)));
        let mut in_hand = JoinSet::new();
        let mut backoff = Duration::from_millis(100);
        export(&self.name, &stats, &bus);
        while !*stop.borrow() {
            let started = tokio::time::Instant::now();
            let result = match self.consumer(&bus).await {
                Ok((consumer, switching)) => {
                    stats.consuming.store(true, Ordering::Relaxed);
                    let until = if switching {
                        Until::Recheck(tokio::time::Instant::now() + SWITCH_RECHECK)
                    } else {
                        Until::Stopped
                    };
                    let r = self
                        .consume(
                            &bus,
                            consumer,
                            &handler,
                            &stats,
                            &permits,
                            &mut in_hand,
                            stop.clone(),
                            until,
                        )
                        .await;
                    stats.consuming.store(false, Ordering::Relaxed);
                    r
                }
                Err(e) => Err(e),
            };
            // A consumer that ran a while before failing was healthy: start backing off anew.
            if started.elapsed() > HEALTHY_RUN {
                backoff = Duration::from_millis(100);
            }
            // Reap finished handlers so the set does not grow over a long run.
            while in_hand.try_join_next().is_some() {}
            match result {
                Ok(Ended::Stopped) => break,
                // See whether the consumer can switch filters now.
                Ok(Ended::Recheck) => continue,
                Err(e) => {
                    tracing::warn!(worker = %self.name, error = %e, "consumer interrupted; reconnecting");
                    let mut stop = stop.clone();
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => {}
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_RECONNECT_BACKOFF);
                }
            }
        }
        while let Some(done) = in_hand.join_next().await {
            if let Err(e) = done {
                tracing::error!(worker = %self.name, error = %e, "event handler panicked");
            }
        }
        tracing::info!(worker = %self.name, stats = ?stats.snapshot(), "worker stopped");
    }

    /// The durable consumer, created when missing: at the feed's beginning, or where
    /// `takes_over`'s acknowledgements stand. One an earlier version made with another filter
    /// keeps that filter while anything is pending or in hand under it (switching now would
    /// skip what the old filter still owes) and takes this version's once nothing is; `true`
    /// says it still waits, and is looked at again every [`SWITCH_RECHECK`] (events it brings
    /// that are not this worker's are acknowledged unhandled).
    async fn consumer(&self, bus: &Bus) -> Result<(PullConsumer, bool), ConsumeError> {
        let stream = bus
            .js
            .get_stream(bus.names.events_stream())
            .await
            .map_err(|source| ConsumeError::NoFeed { stream: bus.names.events_stream(), source })?;
        let name = self.consumer_name(bus);
        let filter = self.filter_subject(bus, None);
        let mut config = pull::Config {
            durable_name: Some(name.clone()),
            description: Some(format!("turnlog {} on the committed-event feed", self.name)),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.settings.ack_wait,
            // One more than the worker's own limit: the worker dead-letters on the last
            // delivery it is told about, so a crash during that one still gets a successor.
            max_deliver: i64::from(self.settings.max_deliver.max(1)) + 1,
            filter_subject: filter.clone(),
            ..Default::default()
        };
        if let Some(other) = &self.takes_over {
            if let Ok(info) = stream.consumer_info(format!("{}-{other}", bus.names.prefix())).await {
                let start_sequence = info.ack_floor.stream_sequence + 1;
                config.deliver_policy = DeliverPolicy::ByStartSequence { start_sequence };
            }
        }
        let consumer_error = |source| ConsumeError::Consumer { name: name.clone(), source };
        let consumer: PullConsumer =
            stream.get_or_create_consumer(&name, config).await.map_err(consumer_error)?;
        let current = consumer.cached_info();
        if current.config.filter_subject == filter {
            return Ok((consumer, false));
        }
        if current.num_pending > 0 || current.num_ack_pending > 0 {
            tracing::info!(consumer = %name, from = %current.config.filter_subject, to = %filter,
                pending = current.num_pending, "consumer keeps its earlier filter until nothing is pending under it");
            return Ok((consumer, true));
        }
        let mut config = pull::Config::try_from_consumer_config(current.config.clone())
            .map_err(|e| ConsumeError::NotPull { name: name.clone(), detail: e.to_string() })?;
        config.filter_subject = filter.clone();
        // An update in place (nats-server 2.9 too): the consumer keeps its position.
        let consumer = stream.create_consumer(config).await.map_err(consumer_error)?;
        tracing::info!(consumer = %name, %filter, "consumer switched to this version's filter");
        Ok((consumer, false))
    }

    /// Replays history on a temporary consumer (see [`Replay`]) until through, stopped by
    /// `shutdown`, or the bus fails; waits for the events in hand either way.
    async fn replay<H: Handler>(
        &self,
        bus: &Bus,
        handler: &Arc<H>,
        replay: &Replay,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ConsumeError> {
        let events = bus.names.events_stream();
        let mut stream = bus
            .js
            .get_stream(&events)
            .await
            .map_err(|source| ConsumeError::NoReplayFeed { stream: events.clone(), source })?;
        let through = match stream.info().await {
            Ok(info) => info.state.last_sequence,
            Err(source) => return Err(ConsumeError::FeedInfo { stream: events, source }),
        };
        let progress = &replay.progress;
        progress.through_seq.store(through, Ordering::Relaxed);
        let deliver_policy = match replay.from {
            ReplayFrom::Sequence(seq) => DeliverPolicy::ByStartSequence { start_sequence: seq.max(1) },
            ReplayFrom::Time(start_time) => DeliverPolicy::ByStartTime { start_time },
        };
        let filter_subject = self.filter_subject(bus, replay.session);
        let config = pull::Config {
            description: Some(format!("turnlog {} replay", self.name)),
            deliver_policy,
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.settings.ack_wait,
            max_deliver: i64::from(self.settings.max_deliver.max(1)) + 1,
            filter_subject,
            inactive_threshold: REPLAY_CONSUMER_INACTIVE,
            ..Default::default()
        };
        let consumer: PullConsumer =
            stream.create_consumer(config).await.map_err(ConsumeError::ReplayConsumer)?;
        let name = consumer.cached_info().name.clone();
        progress.total.store(consumer.cached_info().num_pending, Ordering::Relaxed);
        tracing::info!(worker = %self.name, consumer = %name, from = ?replay.from, session = ?replay.session,
            through, total = consumer.cached_info().num_pending, "replaying");

        // Stop on the caller's shutdown or once every event through `through` is settled.
        let (stop_tx, stop) = watch::channel(false);
        let mut cancelled = stop_signal(shutdown);
        let mut watched = consumer.clone();
        let end = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = cancelled.wait_for(|s| *s) => break,
                    _ = tokio::time::sleep(REPLAY_END_POLL) => {}
                }
                if let Ok(info) = watched.info().await {
                    let delivered_all = info.num_pending == 0 || info.delivered.stream_sequence >= through;
                    if delivered_all && info.num_ack_pending == 0 {
                        break;
                    }
                }
            }
            let _ = stop_tx.send(true);
        });
        let _end = AbortOnDrop(end);
        let permits = Arc::new(Semaphore::new(self.settings.concurrency.max(1)));
        let mut in_hand = JoinSet::new();
        let replaying = Self { only_session: replay.session, ..self.clone() };
        let result = replaying
            .consume(
                bus,
                consumer,
                handler,
                &progress.stats,
                &permits,
                &mut in_hand,
                stop,
                Until::Seq(through),
            )
            .await
            .map(|_| ());
        while let Some(done) = in_hand.join_next().await {
            if let Err(e) = done {
                tracing::error!(worker = %self.name, error = %e, "event handler panicked");
            }
        }
        if let Err(e) = stream.delete_consumer(&name).await {
            tracing::debug!(consumer = %name, error = %e, "replay consumer not deleted; it expires by itself");
        }
        result
    }

    /// Pulls and dispatches until stopped, until the first pull request that ends after a
    /// recheck time, or until the bus fails (Err). Events past a replay's end are
    /// acknowledged unhandled.
    #[allow(clippy::too_many_arguments)]
    async fn consume<H: Handler>(
        &self,
        bus: &Bus,
        consumer: PullConsumer,
        handler: &Arc<H>,
        stats: &Arc<WorkerStats>,
        permits: &Arc<Semaphore>,
        in_hand: &mut JoinSet<()>,
        mut stop: watch::Receiver<bool>,
        until: Until,
    ) -> Result<Ended, ConsumeError> {
        let lag = tokio::spawn(watch_lag(self.name.clone(), consumer.clone(), stats.clone(), stop.clone()));
        let _lag = AbortOnDrop(lag);
        // One inbox for every pull request of this run, each request answered on a subject
        // of its own under it. A request the server answers late (one sent while a node was
        // frozen, passed on after the thaw) still reaches this copy, which starts the event
        // or hands it back; an inbox per request, dropped by then, would leave the event
        // to its ack wait.
        let inbox = bus.client.new_inbox();
        let mut replies =
            bus.client.subscribe(format!("{inbox}.*")).await.map_err(ConsumeError::Subscribe)?;
        let mut requests: u64 = 0;
        loop {
            let first = tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => return Ok(Ended::Stopped),
                p = permits.clone().acquire_owned() => Ok(p.map_err(ConsumeError::Permits)?),
                m = replies.next() => Err(pull_reply(m, &bus.js, None)?),
            };
            let first = match first {
                Ok(permit) => permit,
                // An earlier request's event while every permit is in use.
                Err(PullReply::Event(message)) => {
                    hand_back_late(&message).await;
                    continue;
                }
                Err(_) => continue,
            };
            let mut free = vec![first];
            while free.len() < self.settings.concurrency {
                match permits.clone().try_acquire_owned() {
                    Ok(p) => free.push(p),
                    Err(_) => break,
                }
            }
            requests += 1;
            let reply = format!("{inbox}.{requests}");
            let request =
                pull::BatchConfig { batch: free.len(), expires: Some(PULL_EXPIRES), ..Default::default() };
            consumer.request_batch(request, reply.clone().into()).await.map_err(ConsumeError::Pull)?;
            let lost_at = tokio::time::Instant::now() + PULL_LOST_AFTER;
            let (mut wanted, mut stopping) = (free.len(), false);
            // Until the request is answered in full, ends, or is given up for lost.
            while wanted > 0 {
                let next = tokio::select! {
                    biased;
                    m = replies.next() => m,
                    _ = stop.wait_for(|s| *s), if !stopping => {
                        // Keep draining the open request (it ends within PULL_EXPIRES) so
                        // nothing it delivers sits unhandled until its ack wait runs out.
                        stopping = true;
                        continue;
                    }
                    _ = tokio::time::sleep_until(lost_at) => break,
                };
                let message = match pull_reply(next, &bus.js, Some(&reply))? {
                    PullReply::Event(message) => message,
                    PullReply::End => break,
                    PullReply::Other => continue,
                };
                // (An earlier request's late event counts too: this one's own, if any,
                // come in after it and are started or handed back like it.)
                wanted -= 1;
                match (stopping, free.pop()) {
                    (false, Some(permit)) => {
                        let job = Job {
                            worker: self.clone(),
                            bus: bus.clone(),
                            handler: handler.clone(),
                            stats: stats.clone(),
                            until: match until {
                                Until::Seq(seq) => Some(seq),
                                _ => None,
                            },
                        };
                        in_hand.spawn(job.process(*message, permit));
                    }
                    _ => hand_back(&message).await,
                }
            }
            drop(free);
            if stopping {
                return Ok(Ended::Stopped);
            }
            if let Until::Recheck(at) = until {
                if tokio::time::Instant::now() >= at {
                    return Ok(Ended::Recheck);
                }
            }
            while in_hand.try_join_next().is_some() {}
        }
    }
}

/// Where [`Worker::consume`] ends besides a stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Until {
    Stopped,
    /// At the first pull request that ends after this time (a consumer waiting to switch
    /// filters looks again).
    Recheck(tokio::time::Instant),
    /// A replay's last sequence: later events are acknowledged unhandled.
    Seq(u64),
}

enum Ended {
    Stopped,
    Recheck,
}

/// Why a consumer stopped before it was told to (the worker reconnects), or a replay failed.
#[derive(Debug, thiserror::Error)]
enum ConsumeError {
    #[error("cannot open {stream} (is the writer running?): {source}")]
    NoFeed { stream: String, source: jetstream::context::GetStreamError },
    #[error("consumer {name}: {source}")]
    Consumer { name: String, source: jetstream::stream::ConsumerError },
    #[error("consumer {name} is not a pull consumer: {detail}")]
    NotPull { name: String, detail: String },
    #[error("cannot open {stream}: {source}")]
    NoReplayFeed { stream: String, source: jetstream::context::GetStreamError },
    #[error("{stream}: {source}")]
    FeedInfo { stream: String, source: jetstream::stream::InfoError },
    #[error("creating the replay consumer: {0}")]
    ReplayConsumer(jetstream::stream::ConsumerError),
    #[error("subscribing to the pull replies failed: {0}")]
    Subscribe(async_nats::SubscribeError),
    #[error("{0}")]
    Permits(tokio::sync::AcquireError),
    #[error("pull request failed: {0}")]
    Pull(pull::BatchRequestError),
    #[error("the pull requests' inbox was closed")]
    InboxClosed,
    /// A status the consumer cannot go on after.
    #[error("pulling events failed: {status} {description}")]
    PullStatus { status: async_nats::StatusCode, description: String },
}

/// What arrived on the pull requests' inbox.
enum PullReply {
    Event(Box<Message>),
    /// The open request's end: expired (408), nothing to wait for (404), or ended by the
    /// server (409: a leadership change, too many requests waiting).
    End,
    /// A heartbeat, or an earlier request's end.
    Other,
}

/// Reads one message of the pull requests' inbox; `open` is the open request's subject.
/// A status the consumer cannot go on after (deleted, push based, the inbox gone, an
/// unknown status of the open request) is an error: the worker reconnects.
fn pull_reply(
    message: Option<async_nats::Message>,
    js: &async_nats::jetstream::Context,
    open: Option<&str>,
) -> Result<PullReply, ConsumeError> {
    use async_nats::StatusCode;
    let message = message.ok_or(ConsumeError::InboxClosed)?;
    let Some(status) = message.status.filter(|s| *s != StatusCode::OK) else {
        return Ok(PullReply::Event(Box::new(Message { message, context: js.clone() })));
    };
    let why = message.description.as_deref().unwrap_or_default();
    let ours = open == Some(message.subject.as_str());
    match status {
        StatusCode::IDLE_HEARTBEAT => Ok(PullReply::Other),
        StatusCode::REQUEST_TERMINATED if why.contains("Consumer Deleted") || why.contains("push based") => {
            Err(ConsumeError::PullStatus { status, description: why.to_owned() })
        }
        StatusCode::TIMEOUT | StatusCode::NOT_FOUND | StatusCode::REQUEST_TERMINATED if ours => {
            Ok(PullReply::End)
        }
        _ if ours => Err(ConsumeError::PullStatus { status, description: why.to_owned() }),
        _ => Ok(PullReply::Other),
    }
}

/// Turns the caller's shutdown future into a flag every task can watch.
fn stop_signal(shutdown: impl Future<Output = ()> + Send + 'static) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        tokio::select! {
            _ = shutdown => { let _ = tx.send(true); }
            // Every receiver gone: the worker ended on its own.
            _ = tx.closed() => {}
        }
    });
    rx
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An event this copy will not start: back to the consumer at once, for another copy.
async fn hand_back(message: &Message) {
    nak(message, None).await;
}

/// An event a late answer to an earlier request brought while every permit is in use: back
/// to the consumer after PULL_EXPIRES, when the other late requests have expired (at once,
/// it could go to one of them again, and again, each a delivery counted toward
/// `max_deliver`).
async fn hand_back_late(message: &Message) {
    nak(message, Some(PULL_EXPIRES)).await;
}

async fn nak(message: &Message, delay: Option<Duration>) {
    if let Err(e) = message.ack_with(AckKind::Nak(delay)).await {
        tracing::debug!(error = %e, "could not hand an event back; it is redelivered after its ack wait");
    }
}

/// Keeps the lag counters current and, now and then, logs the counters when they moved.
async fn watch_lag(
    worker: String,
    mut consumer: PullConsumer,
    stats: Arc<WorkerStats>,
    mut stop: watch::Receiver<bool>,
) {
    let mut logged = StatsSnapshot::default();
    let mut ticks: u32 = 0;
    loop {
        if let Ok(info) = consumer.info().await {
            stats.lag.store(info.num_pending, Ordering::Relaxed);
            stats.in_flight.store(info.num_ack_pending as u64, Ordering::Relaxed);
        }
        ticks = ticks.wrapping_add(1);
        let now = stats.snapshot();
        if ticks.is_multiple_of(STATS_LOG_EVERY) && now != logged {
            tracing::info!(%worker, processed = now.processed, failed = now.failed,
                dead_lettered = now.dead_lettered, lag = now.lag, in_flight = now.in_flight, "worker progress");
            logged = now;
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(LAG_INTERVAL) => {}
        }
    }
}

/// Everything one event's processing needs, moved onto its task.
struct Job<H> {
    worker: Worker,
    bus: Bus,
    handler: Arc<H>,
    stats: Arc<WorkerStats>,
    /// A replay's last sequence: later events are not its business.
    until: Option<u64>,
}

impl<H: Handler> Job<H> {
    /// Handles one event inside a span that joins the trace of the turn it came from.
    async fn process(self, message: Message, permit: OwnedSemaphorePermit) {
        let span = tracing::info_span!("worker.handle", worker = %self.worker.name, stream_seq = tracing::field::Empty);
        crate::trace::follow(&span, crate::trace::from_headers(message.headers.as_ref()).as_deref());
        self.handle_one(message, permit).instrument(span).await
    }

    async fn handle_one(self, message: Message, _permit: OwnedSemaphorePermit) {
        let (attempt, stream_seq) = match message.info() {
            Ok(info) => (u32::try_from(info.delivered).unwrap_or(u32::MAX), info.stream_sequence),
            Err(e) => {
                tracing::warn!(worker = %self.worker.name, error = %e, "event without JetStream info; skipped");
                return;
            }
        };
        if self.until.is_some_and(|until| stream_seq > until) {
            if let Err(e) = message.ack_with(AckKind::Ack).await {
                tracing::debug!(error = %e, "could not acknowledge an event past the replay's end");
            }
            return;
        }
        tracing::Span::current().record("stream_seq", stream_seq);
        let delivery = Delivery { attempt, max_deliver: self.worker.settings.max_deliver, stream_seq };
        if attempt > 1 {
            self.stats.redelivered.fetch_add(1, Ordering::Relaxed);
        }
        let started = std::time::Instant::now();
        let decoded = CommittedEvent::decode(&message.payload);
        let session = decoded.as_ref().ok().and_then(Option::as_ref).map(|e| e.session_id);
        let result = match decoded {
            Ok(None) => Ok(()),
            Ok(Some(event)) if !self.worker.handles(&event) => Ok(()),
            Ok(Some(event)) => self.handle_with_progress(&message, event, delivery).await,
            Err(e) => Err(HandleError::poison("bad_event", format!("committed event does not decode: {e}"))),
        };
        self.stats.handler_seconds.observe(started.elapsed().as_secs_f64());
        let settle = match result {
            Ok(()) => {
                tracing::debug!(session_id = ?session, attempt, "event handled");
                self.stats.processed.fetch_add(1, Ordering::Relaxed);
                message.ack_with(AckKind::Ack).await
            }
            Err(HandleError::Retry { reason, detail }) if !delivery.is_last() => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                let delay = self.worker.settings.backoff(attempt);
                tracing::warn!(
                    worker = %self.worker.name, session_id = ?session, attempt, reason, %detail, ?delay,
                    "event failed; retrying later"
                );
                message.ack_with(AckKind::Nak(Some(delay))).await
            }
            Err(e) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                self.dead_letter(&message, session, delivery, &e).await
            }
        };
        if let Err(e) = settle {
            // The event comes back after its ack wait; handlers are idempotent.
            tracing::warn!(worker = %self.worker.name, error = %e, "could not settle an event with JetStream");
        }
    }

    /// Runs the handler, telling JetStream it is still at work so a long model call does
    /// not get the event redelivered to another copy.
    async fn handle_with_progress(
        &self,
        message: &Message,
        event: CommittedEvent,
        delivery: Delivery,
    ) -> Result<(), HandleError> {
        let every = (self.worker.settings.ack_wait / 3).max(Duration::from_millis(100));
        let work = self.handler.handle(event, delivery);
        tokio::pin!(work);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                result = &mut work => return result,
                _ = tick.tick() => {
                    let _ = message.ack_with(AckKind::Progress).await;
                }
            }
        }
    }

    /// Publishes the event to the dead letters and ends its deliveries; when the dead
    /// letter cannot be published the event is retried instead, so it is never lost.
    async fn dead_letter(
        &self,
        message: &Message,
        session: Option<SessionId>,
        delivery: Delivery,
        error: &HandleError,
    ) -> Result<(), async_nats::Error> {
        let reason = error.reason();
        tracing::error!(
            worker = %self.worker.name, session_id = ?session, attempt = delivery.attempt, %error,
            "giving up on an event; dead-lettered"
        );
        let letter = DeadLetter {
            reason: reason.to_owned(),
            detail: format!("{}: {error} (after {} deliveries)", self.worker.name, delivery.attempt),
            stream_seq: Some(delivery.stream_seq),
            request: String::from_utf8_lossy(&message.payload).into_owned(),
        };
        let subject = self.bus.names.dead_subject(reason, session);
        // One dead letter per worker and event, however often this runs.
        let msg_id = format!("dead:{}:{}", self.worker.name, delivery.stream_seq);
        let published = async {
            let body = serde_json::to_vec(&letter)?;
            let msg = PublishMessage::build().payload(body.into()).message_id(msg_id);
            let ack = self.bus.js.send_publish(subject, msg).await?;
            Ok::<_, async_nats::Error>(ack.await?)
        };
        match published.await {
            Ok(_) => {
                self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                message.ack_with(AckKind::Term).await
            }
            Err(e) => {
                tracing::warn!(worker = %self.worker.name, error = %e, "cannot publish a dead letter; retrying the event");
                message.ack_with(AckKind::Nak(Some(self.worker.settings.backoff(delivery.attempt)))).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_follows_the_list_then_repeats_its_last() {
        let s = ConsumerSettings {
            retry_backoff: vec![Duration::from_secs(1), Duration::from_secs(5)],
            ..Default::default()
        };
        assert_eq!(s.backoff(1), Duration::from_secs(1));
        assert_eq!(s.backoff(2), Duration::from_secs(5));
        assert_eq!(s.backoff(9), Duration::from_secs(5));
        let none = ConsumerSettings { retry_backoff: vec![], ..Default::default() };
        assert_eq!(none.backoff(3), Duration::ZERO);
    }

    #[test]
    fn the_last_delivery_is_known() {
        let d = Delivery { attempt: 4, max_deliver: 5, stream_seq: 1 };
        assert!(!d.is_last());
        assert!(Delivery { attempt: 5, ..d }.is_last());
        assert!(Delivery { attempt: 6, ..d }.is_last());
    }
}
