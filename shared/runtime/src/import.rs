//! Bringing conversations in (issue 25): the sessions a read export plans
//! (`turnlog_core::import`) created and filled through the writer, like every other append.
//!
//! - Ids derive from the owner, the target session and the id in the export, so importing a
//!   file again adds nothing, and an import cut short is completed by running it again.
//! - A conversation is checked whole (sizes, text Postgres can store) before its first
//!   append; one that fails the check appends nothing.
//! - Each session's events go one after the other (the writer numbers them in that order);
//!   many conversations go at once, at most [`IN_FLIGHT_PER_PARTITION`] appends per
//!   partition across every import of the process, so live turns keep their share of the
//!   writer.

use std::collections::HashMap;
use std::io::BufRead;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::StreamExt;
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::{mpsc, Semaphore};
use turnlog_core::events::{EventKind, ForkPoint};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_core::import::{self, Conversation, FileError, Format, PlannedSession, Rejected};
use uuid::Uuid;

use crate::bus::{
    append_and_wait, json_len, metadata_error, partition_of, AppendRequest, Bus, Op, RequestKind,
    MAX_EVENT_BYTES,
};

/// Most appends imports keep in flight on one partition.
pub const IN_FLIGHT_PER_PARTITION: usize = 200;

/// Imported ids are name-based uuids in this namespace.
const IMPORT_NAMESPACE: Uuid = Uuid::from_u128(0x2b9e_51c7_0f4a_4d38_a6e2_7c15_93d0_4e81);

/// Files a process imports at once (each holds a few hundred conversations in memory);
/// more wait their turn.
pub const FILES_AT_ONCE: usize = 2;

/// The appends imports may have in flight, one lane per partition, and the files imported
/// at once, shared by every import a process runs.
pub struct ImportLanes {
    lanes: Vec<Arc<Semaphore>>,
    files: Semaphore,
}

impl ImportLanes {
    pub fn new(partitions: u32) -> Self {
        let lanes =
            (0..partitions.max(1)).map(|_| Arc::new(Semaphore::new(IN_FLIGHT_PER_PARTITION))).collect();
        Self { lanes, files: Semaphore::new(FILES_AT_ONCE) }
    }

    fn lane(&self, partition: u32) -> &Semaphore {
        &self.lanes[partition as usize % self.lanes.len()]
    }

    /// How many conversations an import works on at once: enough to fill every lane (each
    /// has one append in flight at a time).
    fn width(&self) -> usize {
        self.lanes.len() * IN_FLIGHT_PER_PARTITION
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
    /// What was brought in as a note instead of as it was.
    pub skipped: Vec<SkippedPart>,
    /// Conversations not imported, or not completely (run the import again to complete them).
    pub failed: Vec<Rejected>,
}

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

impl Importer {
    /// Imports the export at `path` (checked first; see [`check`]): conversations go
    /// through the writer as they are read, `progress` hears of each one done.
    pub async fn file(
        &self,
        path: &Path,
        format: Option<Format>,
        progress: impl Fn(&Summary, &Checked),
    ) -> Result<Summary, FileError> {
        let _turn = self.lanes.files.acquire().await.map_err(|_| FileError::Shape("shutting down".into()))?;
        let reader = open(path)?;
        let checked = tokio::task::spawn_blocking(move || check(reader, format))
            .await
            .map_err(|e| FileError::Shape(format!("the check stopped: {e}")))??;
        let reader = open(path)?;
        let (tx, rx) = mpsc::channel(64);
        let read = tokio::task::spawn_blocking(move || {
            import::read(reader, Some(checked.format), |c| match tx.blocking_send(c) {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            })
        });
        let summary = self.conversations(rx, |s| progress(s, &checked)).await;
        read.await.map_err(|e| FileError::Shape(format!("the reader stopped: {e}")))??;
        Ok(summary)
    }

    /// Imports the conversations `rx` yields, many at once, and sums up.
    pub async fn conversations(
        &self,
        rx: mpsc::Receiver<Result<Conversation, Rejected>>,
        progress: impl Fn(&Summary),
    ) -> Summary {
        let incoming = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
        let results = incoming
            .map(|c| -> BoxFuture<'_, (Option<Conversation>, Result<Done, Rejected>)> {
                Box::pin(async move {
                    match c {
                        Ok(c) => {
                            let outcome = self.conversation(&c).await;
                            (Some(c), outcome)
                        }
                        Err(rejected) => (None, Err(rejected)),
                    }
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
                        summary.skipped.extend(c.skipped.into_iter().map(|s| SkippedPart {
                            conversation: label.clone(),
                            what: s.what,
                            reason: s.reason,
                        }));
                    }
                }
                Err(rejected) => {
                    tracing::info!(conversation = %rejected.conversation, reason = %rejected.reason, "not imported");
                    summary.failed.push(rejected);
                }
            }
            progress(&summary);
        }
        summary
    }

    /// Imports one conversation: checked whole, then its sessions in order (a parent
    /// before its forks), each session's missing events in order, then the deletes.
    async fn conversation(&self, c: &Conversation) -> Result<Done, Rejected> {
        let reject = |reason: String| Rejected { conversation: c.label(), reason };
        checked(c).map_err(reject)?;
        let mut done = Done::default();
        let mut placed: Vec<Placed> = Vec::with_capacity(c.sessions.len());
        for (i, s) in c.sessions.iter().enumerate() {
            let parent = s.fork.map(|f| (&placed[f.parent], f.through_seq));
            let id = match parent {
                None => self.root_id(c.format, &c.source_id),
                Some((p, _)) => self.fork_id(p.id, &s.key),
            };
            let session = self
                .session(id, s, parent, &mut done)
                .await
                .map_err(|e| reject(format!("{e} (session {} of the conversation)", i + 1)))?;
            placed.push(session);
        }
        for (s, p) in c.sessions.iter().zip(&placed) {
            if s.deleted && !p.hidden {
                let mut delete = AppendRequest::delete(p.id, self.owner.as_str());
                delete.request_id = name(&format!("{}\ndelete", p.id));
                self.send(&delete).await.map_err(reject)?;
            }
        }
        Ok(done)
    }

    /// Creates session `id` unless it exists, then appends the events it lacks.
    async fn session(
        &self,
        id: SessionId,
        s: &PlannedSession,
        parent: Option<(&Placed, i64)>,
        done: &mut Done,
    ) -> Result<Placed, String> {
        let owner = self.owner.as_str();
        // Planned seq → seq in the target log, the inherited ones included.
        let mut seqs: HashMap<i64, i64> = HashMap::new();
        let fork = match parent {
            None => None,
            Some((p, through)) => {
                seqs.extend(p.seqs.iter().filter(|(planned, _)| **planned <= through));
                let through_seq = *p.seqs.get(&through).ok_or("its fork point is not in its parent")?;
                Some(ForkPoint { session_id: p.id, through_seq })
            }
        };
        let existing =
            existing(&self.pool, owner, id).await.map_err(|e| format!("reading the log failed: {e}"))?;
        let hidden = existing.as_ref().is_some_and(|e| e.hidden);
        if existing.is_none() {
            let mut create = match fork {
                None => AppendRequest::create(id, owner, s.title.clone()),
                Some(from) => AppendRequest::fork(id, owner, s.title.clone(), from),
            };
            create.request_id = name(&format!("{id}\ncreate"));
            create.metadata.clone_from(&s.metadata);
            self.send(&create).await?;
            done.sessions += 1;
        }
        seqs.insert(s.first_seq(), fork.map_or(1, |f| f.through_seq + 1));
        let stored = existing.map(|e| e.events).unwrap_or_default();
        let mut appending = false;
        for e in &s.events {
            let event_id = name(&format!("{owner}\n{id}\n{}", e.source_id));
            if let Some(seq) = stored.get(&event_id) {
                if appending {
                    return Err(
                        "the conversation changed since it was imported (run it into a new account, or \
                                delete the imported sessions first)"
                            .into(),
                    );
                }
                seqs.insert(e.seq, *seq);
                continue;
            }
            if hidden {
                return Err("it was deleted since it was imported".into());
            }
            appending = true;
            let mut payload = e.payload.clone();
            import::turnlog::rewrite(
                e.kind,
                &mut payload,
                |seq| seqs.get(&seq).copied(),
                |memory| name(&format!("{id}\nmemory\n{memory}")).to_string(),
            );
            let append = AppendRequest::append_payload(id, owner, event_id, e.kind, payload);
            let seq = self.send(&append).await?;
            seqs.insert(e.seq, seq.ok_or("the writer named no seq")?);
            done.events += 1;
            done.messages += usize::from(matches!(e.kind, EventKind::UserMessage | EventKind::AssistantTurn));
        }
        if s.archived && !hidden {
            let mut archive = AppendRequest::update(id, owner);
            archive.request_id = name(&format!("{id}\narchive"));
            archive.archived = Some(true);
            self.send(&archive).await?;
        }
        Ok(Placed { id, seqs, hidden })
    }

    /// Sends one request on its partition's lane and waits for its outcome; the seq it
    /// committed at (or committed at before, for a repeat).
    async fn send(&self, req: &AppendRequest) -> Result<Option<i64>, String> {
        let lane = self.lanes.lane(partition_of(req.session_id, self.bus.partitions));
        let _permit = lane.acquire().await.map_err(|_| "shutting down".to_owned())?;
        let outcome = append_and_wait(&self.bus, &self.pool, req, self.append_timeout)
            .await
            .map_err(|e| format!("interrupted ({e}); importing the file again completes it"))?;
        if outcome.is_applied() {
            Ok(outcome.seq)
        } else {
            let reason = outcome.reason.as_deref().unwrap_or("rejected");
            Err(format!("the log refused a {} ({reason})", describe(req)))
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

/// A session of the conversation, once placed.
struct Placed {
    id: SessionId,
    seqs: HashMap<i64, i64>,
    hidden: bool,
}

fn name(text: &str) -> Uuid {
    Uuid::new_v5(&IMPORT_NAMESPACE, text.as_bytes())
}

fn describe(req: &AppendRequest) -> String {
    match (&req.op, &req.kind) {
        (Op::Append, Some(RequestKind::Known(kind))) => kind.as_str().replace('_', " "),
        (op, _) => format!("{op:?}").to_lowercase(),
    }
}

/// What the writer would refuse, found before the first append.
fn checked(c: &Conversation) -> Result<(), String> {
    for (i, s) in c.sessions.iter().enumerate() {
        for e in &s.events {
            let at = || format!("{} {} of session {}", e.kind.as_str().replace('_', " "), e.source_id, i + 1);
            if json_len(&e.payload) > MAX_EVENT_BYTES {
                return Err(format!(
                    "the {} is larger than the log accepts ({} KiB)",
                    at(),
                    MAX_EVENT_BYTES / 1024
                ));
            }
            if let Some(why) = turnlog_core::storable::payload_problem(e.kind, &e.payload) {
                return Err(format!("the {}: {why}", at()));
            }
        }
        if s.title.as_deref().is_some_and(|t| t.contains('\0')) {
            return Err("its title contains NUL characters".into());
        }
        if let Some(why) = s.metadata.as_ref().and_then(metadata_error) {
            return Err(format!("session {}: {why}", i + 1));
        }
    }
    Ok(())
}

/// A session already in the log: whether it is hidden (deleted, kept for its forks), and
/// its own events' seqs by event id.
struct Existing {
    hidden: bool,
    events: HashMap<Uuid, i64>,
}

async fn existing(pool: &PgPool, owner: &str, id: SessionId) -> Result<Option<Existing>, sqlx::Error> {
    let row: Option<(bool,)> =
        sqlx::query_as("SELECT hidden_seq IS NOT NULL FROM sessions WHERE id = $1 AND owner = $2")
            .bind(id.0)
            .bind(owner)
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
