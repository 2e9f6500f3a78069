//! Bringing conversations in (issue 25): the sessions a read export plans
//! (`turnlog_core::import`) created and filled through the writer, like every other append.
//!
//! - Ids derive from the owner, the target session and the id in the export, so importing a
//!   file again adds nothing, and an import cut short is completed by running it again.
//! - A conversation is checked whole (sizes, text Postgres can store, every seq it names;
//!   and against what the log holds of an earlier import of it) before its first append;
//!   one that fails the check appends nothing.
//! - Memory: a process imports [`FILES_AT_ONCE`] files at once (an upload waits for its
//!   turn before it is read), each reading one conversation at a time (at most
//!   `MAX_CONVERSATION_BYTES` of JSON) and keeping at most [`READ_AHEAD_BYTES`] of planned
//!   conversations ahead of its appends.
//! - Each session's events go one after the other (the writer numbers them in that order);
//!   many conversations go at once, with as many appends in flight a partition, across
//!   every import of the process, as keeps the queue they add short (a [`Budget`] that
//!   follows the appends' round trips, at most [`MAX_IN_FLIGHT_PER_PARTITION`]), so live
//!   turns keep their share of the writer.

use std::collections::HashMap;
use std::io::BufRead;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::StreamExt;
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use turnlog_core::branch::{fork_lineage, Segment};
use turnlog_core::events::{EventKind, ForkPoint};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_core::import::{self, Conversation, FileError, Format, PlannedSession, Rejected};
use uuid::Uuid;

use crate::budget::Budget;
use crate::bus::{
    append_and_wait, metadata_error, partition_of, AppendError, AppendOp, AppendRequest, Bus, Refusal,
    RequestKind, MAX_EVENT_BYTES,
};

/// Most appends imports keep in flight on one partition: as many as a live append may find
/// queued ahead of it in the partition's stream. Within it the [`Budget`] keeps as many as
/// the round trips allow. 200 kept the writer's batches full and made live appends wait
/// about 0.1 s (p99) during an import; a fixed 8 made them wait up to 3.3× what they wait
/// without one on a fast machine (docs/benchmarks.md, Import).
pub const MAX_IN_FLIGHT_PER_PARTITION: usize = 16;

/// Imported ids are name-based uuids in this namespace.
const IMPORT_NAMESPACE: Uuid = Uuid::from_u128(0x2b9e_51c7_0f4a_4d38_a6e2_7c15_93d0_4e81);

/// Files a process imports at once; more wait their turn (an upload before it is read).
pub const FILES_AT_ONCE: usize = 2;

/// Most bytes of planned conversations (their payloads as JSON) one import reads ahead of
/// its appends: the reader waits for room. A conversation larger than this still goes, alone.
pub const READ_AHEAD_BYTES: usize = 64 * 1024 * 1024;

/// The appends imports may have in flight, one budget per partition, and the files
/// imported at once, shared by every import a process runs.
pub struct ImportLanes {
    lanes: Vec<Budget>,
    files: Arc<Semaphore>,
}

/// One of the [`FILES_AT_ONCE`] turns to import a file, held until the import ends.
pub struct FileSlot {
    _permit: OwnedSemaphorePermit,
}

impl ImportLanes {
    pub fn new(partitions: u32) -> Self {
        Self::with(partitions, || Budget::adaptive(MAX_IN_FLIGHT_PER_PARTITION))
    }

    /// [`ImportLanes::new`] allowing the appends `target_share` of their base round trip as
    /// queueing (the benchmark compares shares).
    pub fn adaptive_to(partitions: u32, target_share: f64) -> Self {
        Self::with(partitions, || Budget::adaptive_to(MAX_IN_FLIGHT_PER_PARTITION, target_share))
    }

    /// [`ImportLanes::new`] with a fixed `per_lane` appends in flight a partition (the
    /// benchmark compares with it).
    pub fn fixed(partitions: u32, per_lane: usize) -> Self {
        Self::with(partitions, || Budget::fixed(per_lane))
    }

    fn with(partitions: u32, budget: impl Fn() -> Budget) -> Self {
        let lanes = (0..partitions.max(1)).map(|_| budget()).collect();
        Self { lanes, files: Arc::new(Semaphore::new(FILES_AT_ONCE)) }
    }

    /// Waits for a turn to import a file.
    pub async fn file_slot(&self) -> Result<FileSlot, FileError> {
        let permit =
            self.files.clone().acquire_owned().await.map_err(|_| FileError::Shape("shutting down".into()))?;
        Ok(FileSlot { _permit: permit })
    }

    /// The budget of `partition`'s appends.
    pub fn lane(&self, partition: u32) -> &Budget {
        &self.lanes[partition as usize % self.lanes.len()]
    }

    /// How many conversations an import works on at once: enough to fill every lane at its
    /// widest (each has one append in flight at a time).
    fn width(&self) -> usize {
        self.lanes.iter().map(Budget::max).sum()
    }
}

/// What an import did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Conversations imported, or found imported already.
    pub conversations: usize,
    /// Of those, how many were there whole already.
    pub unchanged: usize,
    /// Sessions created (forks included).
    pub sessions: usize,
    /// User messages and answers appended.
    pub messages: usize,
    /// Every event appended.
    pub events: usize,
    /// What was brought in as a note instead of as it was (the first [`MAX_LISTED`]).
    pub skipped: Vec<SkippedPart>,
    /// How many parts were skipped, listed or not.
    pub skipped_total: usize,
    /// Conversations not imported, or not completely (run the import again to complete
    /// them; the first [`MAX_LISTED`]).
    pub failed: Vec<Rejected>,
    /// How many conversations failed, listed or not.
    pub failed_total: usize,
}

/// Most entries a [`Summary`] lists as skipped, and as failed: a file of a million broken
/// conversations is summed up in a few hundred kilobytes, and logged in a thousand lines.
pub const MAX_LISTED: usize = 1_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkippedPart {
    pub conversation: String,
    pub what: String,
    pub reason: String,
}

/// A file checked whole before anything of it is appended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    pub format: Format,
    pub conversations: usize,
    pub messages: usize,
}

/// Reads the whole file once: a file that is not an export of `format` (or of any format,
/// when None), or is cut short, fails here, before anything is appended.
pub fn check(reader: impl BufRead, format: Option<Format>) -> Result<Checked, FileError> {
    let (mut conversations, mut messages) = (0, 0);
    let format = import::read(reader, format, |c| {
        conversations += 1;
        messages += c.map(|c| c.messages()).unwrap_or(0);
        ControlFlow::Continue(())
    })?;
    Ok(Checked { format, conversations, messages })
}

/// Where an import writes: the owner's log, through the writer.
#[derive(Clone)]
pub struct Importer {
    pub bus: Bus,
    pub pool: PgPool,
    pub owner: Owner,
    pub lanes: Arc<ImportLanes>,
    /// How long one append waits for its outcome.
    pub append_timeout: Duration,
}

/// What importing one conversation did.
#[derive(Debug, Clone, Copy, Default)]
struct Done {
    sessions: usize,
    messages: usize,
    events: usize,
}

/// A conversation as read, with its share of the read-ahead room (given back once it is
/// imported).
type Incoming = (Result<Conversation, Rejected>, Option<OwnedSemaphorePermit>);

impl Importer {
    /// Imports the export at `path` (checked first; see [`check`]) once a turn is free:
    /// conversations go through the writer as they are read, `progress` hears of each one
    /// done.
    pub async fn file(
        &self,
        path: &Path,
        format: Option<Format>,
        progress: impl Fn(&Summary, &Checked),
    ) -> Result<Summary, FileError> {
        let slot = self.lanes.file_slot().await?;
        self.file_in(slot, path, format, progress).await
    }

    /// [`Importer::file`] in a turn taken already (the ingress takes it before it reads the
    /// upload).
    pub async fn file_in(
        &self,
        _slot: FileSlot,
        path: &Path,
        format: Option<Format>,
        progress: impl Fn(&Summary, &Checked),
    ) -> Result<Summary, FileError> {
        // Both passes on one thread: the second reuses what the first allocated and freed
        // (the allocator keeps a thread's freed memory for that thread's next allocations).
        let (reader, again) = (open(path)?, open(path)?);
        let (checked_tx, checked_rx) = tokio::sync::oneshot::channel();
        let (tx, rx) = mpsc::channel(64);
        let room = Arc::new(Semaphore::new(READ_AHEAD_BYTES >> 10));
        let runtime = tokio::runtime::Handle::current();
        let read = tokio::task::spawn_blocking(move || {
            let checked = check(reader, format);
            let format = checked.as_ref().ok().map(|c| c.format);
            if checked_tx.send(checked).is_err() {
                return Ok(());
            }
            let Some(format) = format else { return Ok(()) };
            import::read(again, Some(format), |c| {
                // Waits for room for it (a rejected conversation needs none).
                let kib = c.as_ref().map_or(0, |c| (c.bytes() >> 10) + 1).min(READ_AHEAD_BYTES >> 10);
                let permit = match kib {
                    0 => None,
                    kib => match runtime.block_on(room.clone().acquire_many_owned(kib as u32)) {
                        Ok(permit) => Some(permit),
                        Err(_) => return ControlFlow::Break(()),
                    },
                };
                match tx.blocking_send((c, permit)) {
                    Ok(()) => ControlFlow::Continue(()),
                    Err(_) => ControlFlow::Break(()),
                }
            })
            .map(drop)
        });
        let checked = match checked_rx.await {
            Ok(checked) => checked?,
            Err(_) => {
                let stopped = read.await.err().map(|e| e.to_string()).unwrap_or_default();
                return Err(FileError::Shape(format!("the check stopped: {stopped}")));
            }
        };
        let summary = self.conversations(rx, |s| progress(s, &checked)).await;
        read.await.map_err(|e| FileError::Shape(format!("the reader stopped: {e}")))??;
        Ok(summary)
    }

    /// Imports the conversations `rx` yields, many at once, and sums up.
    async fn conversations(&self, rx: mpsc::Receiver<Incoming>, progress: impl Fn(&Summary)) -> Summary {
        let incoming = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
        // Once an append's outcome is unknown (the writer or the bus did not answer), the
        // conversations not yet begun fail at once instead of each waiting out the append
        // timeout: the import ends soon, and running it again completes it.
        let interrupted = AtomicBool::new(false);
        let interrupted = &interrupted;
        let results = incoming
            .map(|(c, room)| -> BoxFuture<'_, (Option<Conversation>, Result<Done, Rejected>)> {
                Box::pin(async move {
                    let done = match c {
                        Ok(c) if interrupted.load(Ordering::Relaxed) => {
                            let reason =
                                "not begun: an earlier append's outcome is unknown (the writer did not \
                                          answer in time); importing the file again completes it";
                            let rejected = Rejected { conversation: c.label(), reason: reason.to_owned() };
                            (Some(c), Err(rejected))
                        }
                        Ok(c) => {
                            let outcome = self.conversation(&c, interrupted).await;
                            (Some(c), outcome)
                        }
                        Err(rejected) => (None, Err(rejected)),
                    };
                    drop(room);
                    done
                })
            })
            .buffer_unordered(self.lanes.width());
        let mut results = std::pin::pin!(results);
        let mut summary = Summary::default();
        while let Some((conversation, outcome)) = results.next().await {
            match outcome {
                Ok(done) => {
                    summary.conversations += 1;
                    summary.unchanged += usize::from(done.events == 0 && done.sessions == 0);
                    summary.sessions += done.sessions;
                    summary.messages += done.messages;
                    summary.events += done.events;
                    if let Some(c) = conversation {
                        let label = c.label();
                        summary.skipped_total += c.skipped.len() + c.skipped_unlisted;
                        let room = MAX_LISTED.saturating_sub(summary.skipped.len());
                        summary.skipped.extend(c.skipped.into_iter().take(room).map(|s| SkippedPart {
                            conversation: label.clone(),
                            what: s.what,
                            reason: s.reason,
                        }));
                    }
                }
                Err(rejected) => {
                    summary.failed_total += 1;
                    if summary.failed.len() < MAX_LISTED {
                        tracing::info!(conversation = %rejected.conversation, reason = %rejected.reason, "not imported");
                        summary.failed.push(rejected);
                    }
                }
            }
            progress(&summary);
        }
        summary
    }

    /// Imports one conversation: checked whole, and against what the log holds of an
    /// earlier import of it, then its sessions in order (a parent before its forks), each
    /// session's missing events in order, then the deletes.
    async fn conversation(&self, c: &Conversation, interrupted: &AtomicBool) -> Result<Done, Rejected> {
        let reject = |why: NotImported| {
            if why.is_interrupted() {
                interrupted.store(true, Ordering::Relaxed);
            }
            Rejected { conversation: c.label(), reason: why.to_string() }
        };
        checked(c).map_err(reject)?;
        let targets = self.targets(c).await.map_err(reject)?;
        let mut done = Done::default();
        let mut placed: Vec<Placed> = Vec::with_capacity(c.sessions.len());
        let mut index: HashMap<SessionId, usize> = HashMap::with_capacity(c.sessions.len());
        for (i, (s, target)) in c.sessions.iter().zip(targets).enumerate() {
            let session = self
                .session(s, target, &placed, &index, &mut done, interrupted)
                .await
                .map_err(|why| reject(why.in_session(i)))?;
            index.insert(session.id, i);
            placed.push(session);
        }
        for (s, p) in c.sessions.iter().zip(&placed) {
            if s.deleted && !p.hidden {
                let mut delete = AppendRequest::delete(p.id, &self.owner);
                delete.request_id = name(&format!("{}\ndelete", p.id));
                self.send(&delete, interrupted).await.map_err(reject)?;
            }
        }
        Ok(done)
    }

    /// Where each session of `c` goes and what the log holds of it already, read (and found
    /// to be a start of the plan) before anything is appended: a conversation changed or
    /// deleted since it was imported fails whole.
    async fn targets(&self, c: &Conversation) -> Result<Vec<Target>, NotImported> {
        let owner = &self.owner;
        let mut targets: Vec<Target> = Vec::with_capacity(c.sessions.len());
        for (i, s) in c.sessions.iter().enumerate() {
            let parent = s.fork.map(|f| &targets[f.parent]);
            let id = match parent {
                None => self.root_id(c.format, &c.source_id),
                Some(p) => self.fork_id(p.id, &s.key),
            };
            let existing =
                existing(&self.pool, owner, id).await.map_err(|e| NotImported::Read(e).in_session(i))?;
            let deleted = || NotImported::Deleted.in_session(i);
            let Some(existing) = existing else {
                // The writer forks only a live parent.
                if parent.is_some_and(|p| p.existing.as_ref().is_some_and(|e| e.hidden)) {
                    return Err(deleted());
                }
                targets.push(Target { id, existing: None });
                continue;
            };
            let mut missing = false;
            for e in &s.events {
                let stored = existing.events.contains_key(&event_id(owner, id, &e.source_id));
                if stored && missing {
                    return Err(NotImported::Changed.in_session(i));
                }
                missing |= !stored;
            }
            if missing && existing.hidden {
                return Err(deleted());
            }
            targets.push(Target { id, existing: Some(existing) });
        }
        Ok(targets)
    }

    /// Creates session `target` unless it exists, then appends the events it lacks;
    /// `placed` are the sessions before it (`index`: by id).
    async fn session(
        &self,
        s: &PlannedSession,
        target: Target,
        placed: &[Placed],
        index: &HashMap<SessionId, usize>,
        done: &mut Done,
        interrupted: &AtomicBool,
    ) -> Result<Placed, NotImported> {
        let owner = &self.owner;
        let Target { id, existing } = target;
        // Its branch log: the planned seqs it reads from each ancestor, and the target seq
        // of each planned one (an ancestor's from the ancestor).
        let (fork, lineage) = match s.fork {
            None => (None, Vec::new()),
            Some(f) => {
                let p = &placed[f.parent];
                let through_seq = seq_in(placed, index, &p.lineage, &p.seqs, f.through_seq)
                    .ok_or(NotImported::ForkPointMissing)?;
                let lineage = fork_lineage(p.id, &p.lineage, f.through_seq);
                (Some(ForkPoint { session_id: p.id, through_seq }), lineage)
            }
        };
        let hidden = existing.as_ref().is_some_and(|e| e.hidden);
        if existing.is_none() {
            let mut create = match fork {
                None => AppendRequest::create(id, owner, s.title.clone()),
                Some(from) => AppendRequest::fork(id, owner, s.title.clone(), from),
            }
            .with_metadata(s.metadata.clone());
            create.request_id = name(&format!("{id}\ncreate"));
            self.send(&create, interrupted).await?;
            done.sessions += 1;
        }
        let mut seqs: HashMap<i64, i64> = HashMap::with_capacity(s.events.len() + 1);
        seqs.insert(s.first_seq(), fork.map_or(1, |f| f.through_seq + 1));
        let stored = existing.map(|e| e.events).unwrap_or_default();
        for e in &s.events {
            let event_id = event_id(owner, id, &e.source_id);
            if let Some(seq) = stored.get(&event_id) {
                seqs.insert(e.seq, *seq);
                continue;
            }
            let mut payload = e.payload.value();
            import::turnlog::rewrite(
                e.kind,
                &mut payload,
                |seq| seq_in(placed, index, &lineage, &seqs, seq),
                |memory| name(&format!("{id}\nmemory\n{memory}")).to_string(),
            );
            let append = AppendRequest::append_payload(id, owner, event_id, e.kind, payload);
            let seq = self.send(&append, interrupted).await?;
            seqs.insert(e.seq, seq.ok_or(NotImported::NoSeq)?);
            done.events += 1;
            done.messages += usize::from(matches!(e.kind, EventKind::UserMessage | EventKind::AssistantTurn));
        }
        if s.archived && !hidden {
            let mut archive = AppendRequest::update(id, owner).with_archived(Some(true));
            archive.request_id = name(&format!("{id}\narchive"));
            self.send(&archive, interrupted).await?;
        }
        Ok(Placed { id, lineage, seqs, hidden })
    }

    /// Sends one request on its partition's lane and waits for its outcome; the seq it
    /// committed at (or committed at before, for a repeat). Once an append of the import
    /// has an unknown outcome (`interrupted`), sends nothing more: with the writer gone,
    /// each conversation waiting for its lane would otherwise wait out a timeout in turn.
    async fn send(&self, req: &AppendRequest, interrupted: &AtomicBool) -> Result<Option<i64>, NotImported> {
        let lane = self.lanes.lane(partition_of(req.session_id, self.bus.partitions));
        let slot = lane.slot().await.map_err(|_| NotImported::ShuttingDown)?;
        if interrupted.load(Ordering::Relaxed) {
            return Err(NotImported::Stopped);
        }
        let outcome = append_and_wait(&self.bus, &self.pool, req, self.append_timeout)
            .await
            .map_err(NotImported::Interrupted)?;
        slot.done();
        if outcome.is_applied() {
            Ok(outcome.seq)
        } else {
            Err(NotImported::Refused { request: describe(req), reason: outcome.reason })
        }
    }

    /// A conversation's main session: named by the owner, the export's kind and its id there.
    fn root_id(&self, format: Format, source_id: &str) -> SessionId {
        SessionId(name(&format!("{}\nroot\n{}\n{source_id}", self.owner.as_str(), format.as_str())))
    }

    /// A fork's id: derived from its parent's and its key, drawn again (with a counter)
    /// until it hashes to the parent's partition (DESIGN §10).
    fn fork_id(&self, parent: SessionId, key: &str) -> SessionId {
        let partitions = self.bus.partitions;
        let target = partition_of(parent, partitions);
        (0u64..)
            .map(|n| SessionId(name(&format!("{}\nfork\n{parent}\n{key}\n{n}", self.owner.as_str()))))
            .find(|id| partition_of(*id, partitions) == target)
            .unwrap_or_else(SessionId::new)
    }
}

fn open(path: &Path) -> Result<std::io::BufReader<std::fs::File>, FileError> {
    std::fs::File::open(path)
        .map(|f| std::io::BufReader::with_capacity(1 << 16, f))
        .map_err(|e| FileError::Shape(format!("cannot read the file: {e}")))
}

/// Where a session of the conversation goes, and what the log holds of it already.
struct Target {
    id: SessionId,
    existing: Option<Existing>,
}

/// A session of the conversation, once placed.
struct Placed {
    id: SessionId,
    /// The ancestors its branch log reads, through planned seqs.
    lineage: Vec<Segment>,
    /// Its own events' (and its `session_started`'s) planned seq → seq in the log.
    seqs: HashMap<i64, i64>,
    hidden: bool,
}

/// The seq in the log of planned seq `seq` of a branch log whose ancestors are `lineage`
/// and own events `own`.
fn seq_in(
    placed: &[Placed],
    index: &HashMap<SessionId, usize>,
    lineage: &[Segment],
    own: &HashMap<i64, i64>,
    seq: i64,
) -> Option<i64> {
    match lineage.iter().find(|s| seq <= s.through) {
        Some(segment) => placed[*index.get(&segment.session)?].seqs.get(&seq).copied(),
        None => own.get(&seq).copied(),
    }
}

fn name(text: &str) -> Uuid {
    Uuid::new_v5(&IMPORT_NAMESPACE, text.as_bytes())
}

/// An imported event's id: from the owner, its session and its id in the export.
fn event_id(owner: &Owner, session: SessionId, source_id: &str) -> Uuid {
    name(&format!("{owner}\n{session}\n{source_id}"))
}

fn describe(req: &AppendRequest) -> String {
    match &req.op {
        AppendOp::Append { kind: RequestKind::Known(kind), .. } => kind.as_str().replace('_', " "),
        op => op.name().replace('_', " "),
    }
}

/// What the writer would refuse, found before the first append.
fn checked(c: &Conversation) -> Result<(), NotImported> {
    for (i, s) in c.sessions.iter().enumerate() {
        for e in &s.events {
            let at = || format!("{} {} of session {}", e.kind.as_str().replace('_', " "), e.source_id, i + 1);
            if e.payload.json_len() > MAX_EVENT_BYTES {
                return Err(NotImported::TooLarge { event: at() });
            }
            if let Some(why) = turnlog_core::storable::payload_problem(e.kind, &e.payload.value()) {
                return Err(NotImported::Unstorable { event: at(), why });
            }
        }
        if s.title.as_deref().is_some_and(|t| t.contains('\0')) {
            return Err(NotImported::NulTitle);
        }
        if let Some(why) = s.metadata.as_ref().and_then(metadata_error) {
            return Err(NotImported::Metadata { session: i + 1, why });
        }
    }
    Ok(())
}

/// Why a conversation was not imported, or not completely: the `reason` its summary gives.
#[derive(Debug, thiserror::Error)]
enum NotImported {
    #[error("the {event} is larger than the log accepts ({} KiB)", MAX_EVENT_BYTES / 1024)]
    TooLarge { event: String },
    #[error("the {event}: {why}")]
    Unstorable { event: String, why: String },
    #[error("its title contains NUL characters")]
    NulTitle,
    #[error("session {session}: {why}")]
    Metadata { session: usize, why: String },
    #[error("reading the log failed: {0}")]
    Read(sqlx::Error),
    #[error("it was deleted since it was imported")]
    Deleted,
    #[error(
        "the conversation changed since it was imported (run it into a new account, or delete the \
         imported sessions first)"
    )]
    Changed,
    #[error("its fork point is not in its parent")]
    ForkPointMissing,
    #[error("the writer named no seq")]
    NoSeq,
    #[error("shutting down")]
    ShuttingDown,
    #[error("interrupted ({0}); importing the file again completes it")]
    Interrupted(AppendError),
    #[error(
        "stopped before its next append: an earlier append's outcome is unknown (the writer did not \
         answer in time); importing the file again completes it"
    )]
    Stopped,
    /// The writer refused a request (`request` names it: its kind, or its op).
    #[error("the log refused a {request} ({})", .reason.as_deref().unwrap_or("rejected"))]
    Refused { request: String, reason: Option<Refusal> },
    /// Any of the above, about the conversation's `session`-th session (from 1).
    #[error("{why} (session {session} of the conversation)")]
    InSession { session: usize, why: Box<NotImported> },
}

impl NotImported {
    /// Whether an append's outcome is unknown (the writer or the bus did not answer).
    fn is_interrupted(&self) -> bool {
        match self {
            Self::Interrupted(_) => true,
            Self::InSession { why, .. } => why.is_interrupted(),
            _ => false,
        }
    }

    /// This, about the session at `index` of the conversation.
    fn in_session(self, index: usize) -> Self {
        Self::InSession { session: index + 1, why: Box::new(self) }
    }
}

/// A session already in the log: whether it is hidden (deleted, kept for its forks), and
/// its own events' seqs by event id.
struct Existing {
    hidden: bool,
    events: HashMap<Uuid, i64>,
}

async fn existing(pool: &PgPool, owner: &Owner, id: SessionId) -> Result<Option<Existing>, sqlx::Error> {
    let row: Option<(bool,)> =
        sqlx::query_as("SELECT hidden_seq IS NOT NULL FROM sessions WHERE id = $1 AND owner = $2")
            .bind(id.0)
            .bind(owner.as_str())
            .fetch_optional(pool)
            .await?;
    let Some((hidden,)) = row else { return Ok(None) };
    let events: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT event_id, seq FROM session_events WHERE session_id = $1")
            .bind(id.0)
            .fetch_all(pool)
            .await?;
    Ok(Some(Existing { hidden, events: events.into_iter().collect() }))
}
