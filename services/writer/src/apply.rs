//! Applying a batch of append requests to the sessions they touch, in stream order, in
//! memory: what to insert and update, each request's outcome, and what goes to the dead
//! letters. No I/O here; `store` loads the state and writes the result in one transaction.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use chrono::{DateTime, Datelike as _, Utc};
use serde::Deserialize as _;
use serde_json::Value;
use turnlog_core::branch::{fork_lineage, Segment, MAX_FORK_DEPTH};
use turnlog_core::events::{EventBody, EventKind, ForkPoint, SessionStarted};
use turnlog_core::ids::{EventId, Owner, SessionId};
use turnlog_core::tokens::event_tokens;
use turnlog_runtime::bus::{
    json_len, metadata_error, partition_of, AppendOp, AppendRequest, CommittedEvent, DeadLetter, Expect,
    Outcome, OutcomeStatus, Refusal, RequestKind, MAX_EVENT_BYTES,
};
use turnlog_runtime::files::{FileMeta, FileRow};
use uuid::Uuid;

/// One TURNLOG_APPEND message as the writer received it, decoded.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub stream_seq: u64,
    /// The stream's timestamp: every stored time comes from here, so a rebuild reproduces it.
    pub published: DateTime<Utc>,
    /// The session named by the subject (`None` when the subject is malformed).
    pub subject_session: Option<SessionId>,
    pub reply_to: Option<String>,
    /// The producer's trace context (`traceparent` header), which the apply joins; a
    /// malformed one is dropped.
    pub traceparent: Option<String>,
    /// Whether the producer sampled that trace (the apply then gets a span of its own).
    pub sampled: bool,
    /// An operator's redrive of a dead letter (`turnlog dead redrive`): a request that was
    /// dead-lettered before is applied again instead of answered as a duplicate.
    pub redrive: bool,
    pub body: Bytes,
    /// The request, or why it does not decode.
    request: Result<AppendRequest, Rejection>,
    /// An append's event, checked and counted, or why it cannot be stored. Worked out from
    /// the message alone (tokenizing is most of a batch's CPU time), so that the live
    /// writer does it while the batch before commits.
    event: Option<Result<NewEvent, Rejection>>,
    /// The database's refusal of this request's writes, once the writer found that this
    /// request alone fails its commit (a rebuild learns it from the `unstorable` dead
    /// letters): it is then dead-lettered instead of applied.
    unstorable: Option<String>,
}

#[derive(Debug, Clone)]
struct NewEvent {
    kind: EventKind,
    body: EventBody,
    tokens: i32,
}

impl Incoming {
    pub fn new(
        stream_seq: u64,
        published: DateTime<Utc>,
        subject_session: Option<SessionId>,
        reply_to: Option<String>,
        traceparent: Option<String>,
        redrive: bool,
        body: Bytes,
    ) -> Self {
        let request = serde_json::from_slice::<AppendRequest>(&body)
            .map_err(|e| refuse(Refusal::BadRequest, format!("request does not decode: {e}")));
        let event = match &request {
            Ok(AppendRequest { op: AppendOp::Append { kind, payload, .. }, .. }) => {
                Some(new_event(kind, payload, body.len()))
            }
            _ => None,
        };
        // Read once here, off the commit path, like the request.
        let sampled = traceparent.as_deref().and_then(turnlog_runtime::trace::remote).map(|r| r.sampled);
        let traceparent = traceparent.filter(|_| sampled.is_some());
        Self {
            stream_seq,
            published,
            subject_session,
            reply_to,
            traceparent,
            sampled: sampled.unwrap_or(false),
            redrive,
            body,
            request,
            event,
            unstorable: None,
        }
    }

    /// Marks this request as one the database refuses to store (`why`, its message): it is
    /// dead-lettered as `unstorable` when applied.
    pub fn mark_unstorable(&mut self, why: String) {
        self.unstorable = Some(why);
    }

    pub fn is_unstorable(&self) -> bool {
        self.unstorable.is_some()
    }

    /// The request's id, when it decodes.
    pub fn request_id(&self) -> Option<Uuid> {
        self.request().map(|r| r.request_id)
    }

    /// The request, when it decodes.
    pub fn request(&self) -> Option<&AppendRequest> {
        self.request.as_ref().ok()
    }

    /// Whether the writer may apply this request without looking up an earlier outcome
    /// (see `first_copy`): only a fresh append, whose repeat would collide on its event id.
    /// Creates, updates and deletes are few and their repeats would not collide with an
    /// event, so they are always looked up (a repeat is then answered, never applied or
    /// dead-lettered again); so are redrives.
    pub fn skips_lookup(&self, duplicate_window: std::time::Duration) -> bool {
        let Ok(req) = &self.request else { return false };
        !self.redrive
            && matches!(req.op, AppendOp::Append { .. })
            && first_copy(req.request_id, self.published, duplicate_window)
    }
}

/// The event an append carries, if it is one the log can store.
fn new_event(kind: &RequestKind, payload: &Value, body_len: usize) -> Result<NewEvent, Rejection> {
    let kind = match kind {
        RequestKind::Known(kind) => *kind,
        RequestKind::Unknown(name) => name
            .parse()
            .map_err(|e: turnlog_core::events::UnknownKind| refuse(Refusal::UnknownKind, e.to_string()))?,
    };
    if kind == EventKind::SessionStarted {
        return Err(refuse(Refusal::UnknownKind, "session_started is written by create only"));
    }
    let body = EventBody::decode(kind, payload, 0).map_err(|e| refuse(Refusal::BadPayload, e.to_string()))?;
    // The payload is part of the request body, so only a large body needs measuring.
    let size = if body_len <= MAX_EVENT_BYTES { body_len } else { json_len(payload) };
    if size > MAX_EVENT_BYTES {
        return Err(refuse(
            Refusal::TooLarge,
            format!("event is {size} bytes; the limit is {MAX_EVENT_BYTES}"),
        ));
    }
    if turnlog_runtime::bus::has_nul(payload) {
        return Err(refuse(Refusal::UnstorableText, "payload text contains a NUL character"));
    }
    let tokens = i32::try_from(event_tokens(&body)).unwrap_or(i32::MAX);
    Ok(NewEvent { kind, body, tokens })
}

/// A session's row as the batch sees and changes it.
pub(crate) use turnlog_runtime::read::SessionRow;

#[derive(Debug, Clone)]
pub struct EventRow {
    /// As published, `stream_seq` included.
    pub event: CommittedEvent,
    pub tokens: i32,
    /// Part of the event's feed dedup id ([`CommittedEvent::msg_id`]).
    pub session_created_at: DateTime<Utc>,
    /// The writer's apply span, as the `traceparent` the event is published with.
    pub traceparent: Option<String>,
}

impl EventRow {
    /// The APPEND sequence it was committed from, as stored.
    pub fn stream_seq(&self) -> i64 {
        self.event.stream_seq.and_then(|s| i64::try_from(s).ok()).unwrap_or(i64::MAX)
    }

    pub fn msg_id(&self) -> String {
        self.event.msg_id(self.session_created_at)
    }
}

#[derive(Debug, Clone)]
pub struct MemoryRow {
    pub id: Uuid,
    pub owner: String,
    pub session_id: SessionId,
    pub turn_seq: i64,
    pub text: String,
    pub created_at: DateTime<Utc>,
}

/// Everything one batch does, ready to be written in one transaction.
#[derive(Debug, Default)]
pub struct BatchEffects {
    /// Sessions this batch created (inserted) — their final state.
    pub created: Vec<SessionRow>,
    /// Existing sessions this batch changed — their final state.
    pub updated: Vec<SessionRow>,
    pub events: Vec<EventRow>,
    /// Outcomes to record (new requests only; duplicates are answered, not recorded).
    pub outcomes: Vec<(Outcome, Option<SessionId>)>,
    /// Requests among `outcomes` whose outcome replaces a dead-lettered one (redrives).
    pub redriven: Vec<Uuid>,
    pub memories: Vec<MemoryRow>,
    /// A file op's write (a file op is always alone in its batch).
    pub file: Option<FileWrite>,
    /// The session a delete batch removes (a delete is always alone in its batch).
    pub deleted: Option<SessionId>,
    /// What that delete removes: the session and any hidden ancestor no surviving fork
    /// inherits from any more, each wholly or above what forks still inherit (DESIGN §10).
    pub removals: Vec<Removal>,
    pub dead: Vec<(Option<SessionId>, DeadLetter)>,
    /// Outcomes to send after the commit.
    pub replies: Vec<(String, Outcome)>,
    /// The last stream sequence this batch consumed.
    pub last_stream_seq: u64,
    /// How many of the incoming messages this batch consumed (the rest wait for the next).
    pub consumed: usize,
}

/// What a file op writes (DESIGN §12).
#[derive(Debug, Clone)]
pub enum FileWrite {
    Put(Box<FileRow>),
    /// Marks the owner's file deleted at this time (unless it is already).
    Delete {
        id: Uuid,
        owner: String,
        at: DateTime<Utc>,
    },
    /// Marks the owner's deleted file swept at this time (unless it is already).
    Swept {
        id: Uuid,
        owner: String,
        at: DateTime<Utc>,
    },
}

/// One session a delete removes, wholly or down to the prefix forks inherit.
#[derive(Debug, Clone)]
pub struct Removal {
    pub session: SessionId,
    /// None: the session goes wholly. Some: it stays, hidden, as this row, keeping its
    /// events (and their memories) through `row.last_seq`.
    pub kept: Option<SessionRow>,
}

/// A request that cannot be applied: its dead-letter reason and detail.
#[derive(Debug, Clone)]
struct Rejection {
    reason: Refusal,
    detail: String,
}

fn refuse(reason: Refusal, detail: impl Into<String>) -> Rejection {
    Rejection { reason, detail: detail.into() }
}

/// The state a batch needs from the database: loaded before each batch by the live
/// writer, the whole database kept in memory by a rebuild. Applying a batch moves it to
/// the state after the batch (a deleted session aside: see [`LoadedState::forget_deleted`]).
#[derive(Debug, Default)]
pub struct LoadedState {
    pub sessions: HashMap<SessionId, SessionRow>,
    /// Recorded outcomes by request id, with the session each names.
    pub outcomes: HashMap<Uuid, (Outcome, Option<SessionId>)>,
    /// The deployment's partition count (0 counts as 1): a fork must hash to its parent's.
    pub partitions: u32,
    /// For a session, the stored sessions whose lineage names it — the forks that inherit
    /// some of its events. Complete for the family of a session a delete removes.
    pub inheritors: HashMap<SessionId, HashSet<SessionId>>,
    /// A session's compactions as (seq, replaces_through_seq), in seq order. Complete for
    /// the sessions whose events a fork of the batch inherits.
    pub compactions: HashMap<SessionId, Vec<(i64, i64)>>,
}

impl LoadedState {
    /// After a delete batch: the removed sessions' outcomes are gone (a hidden one keeps
    /// those of the events it keeps), the delete's own outcome stays — as
    /// `store::write_delete` leaves the database. (`apply_batch` already moved the rows.)
    pub fn forget_deleted(&mut self, fx: &BatchEffects) {
        for removal in &fx.removals {
            let id = removal.session;
            let kept = removal.kept.as_ref().map(|row| row.last_seq);
            self.outcomes
                .retain(|_, (o, session)| *session != Some(id) || kept.is_some_and(|k| kept_outcome(o, k)));
        }
        for (outcome, session) in &fx.outcomes {
            self.outcomes.insert(outcome.request_id, (outcome.clone(), *session));
        }
    }

    /// Marks the session of `row` as an inheritor of each ancestor its lineage names.
    pub fn add_inheritor(&mut self, row: &SessionRow) {
        for ancestor in &row.lineage {
            self.inheritors.entry(SessionId(*ancestor)).or_default().insert(row.id);
        }
    }

    /// The newest compaction at or below `through` in a branch log made of `lineage`
    /// (the fork's own lineage, which ends at its fork point): (replaces_through, seq).
    fn compaction_at(&self, lineage: &[Segment]) -> Option<(i64, i64)> {
        lineage.iter().rev().find_map(|seg| {
            let list = self.compactions.get(&seg.session)?;
            list.iter().rev().find(|(seq, _)| *seq <= seg.through).map(|(seq, through)| (*through, *seq))
        })
    }
}

/// Whether a hidden session keeping its events through `kept` keeps this outcome: that of
/// one of those events.
pub(crate) fn kept_outcome(outcome: &Outcome, kept: i64) -> bool {
    outcome.status == OutcomeStatus::Committed && outcome.seq.is_some_and(|seq| seq <= kept)
}

/// Whether the stream can hold no earlier copy of this request, so that its outcome need
/// not be looked up before applying it. Producers publish with `Nats-Msg-Id: <request_id>`
/// and the stream drops a second copy that comes within its duplicate window of the first.
/// A UUIDv7 id carries the moment it was minted, before its first publish: a copy the
/// stream took less than half the window after that moment is the first (the other half
/// allows for clocks apart between the producer and nats-server). Other ids (derived ones,
/// idempotency keys) are always looked up, as are redrives.
pub(crate) fn first_copy(
    request_id: Uuid,
    published: DateTime<Utc>,
    duplicate_window: std::time::Duration,
) -> bool {
    if request_id.get_version() != Some(uuid::Version::SortRand) {
        return false;
    }
    let Some((secs, nanos)) = request_id.get_timestamp().map(|t| t.to_unix()) else { return false };
    let (Some(minted), Ok(half)) = (
        DateTime::<Utc>::from_timestamp(i64::try_from(secs).unwrap_or(i64::MAX), nanos),
        chrono::TimeDelta::from_std(duplicate_window / 2),
    ) else {
        return false;
    };
    (published - minted).abs() < half
}

/// A rejection that went to the dead letters (not a failed `expect`, the one rejection
/// that is not): one a redrive may apply again once its cause is fixed.
fn was_dead_lettered(outcome: &Outcome) -> bool {
    outcome.status == OutcomeStatus::Rejected && outcome.reason != Some(Refusal::ExpectFailed)
}

/// Applies `batch` in order, moving `state` along. A delete or a file op is applied alone:
/// the batch stops before one that is not its first request, and right after one that is;
/// `consumed` says how far it got.
pub fn apply_batch(batch: &[Incoming], state: &mut LoadedState) -> BatchEffects {
    let mut fx = BatchEffects::default();
    let mut created: Vec<SessionId> = Vec::new();
    let mut touched: Vec<SessionId> = Vec::new();

    for msg in batch {
        // A delete gets a batch of its own: it is written by a separate, rarer path.
        // A file op too: its few rows are written by a statement of their own.
        let alone = msg.request.as_ref().is_ok_and(|r| {
            matches!(
                r.op,
                AppendOp::Delete | AppendOp::FilePut { .. } | AppendOp::FileDelete | AppendOp::FileSwept
            )
        });
        if alone && fx.consumed > 0 {
            break;
        }
        fx.consumed += 1;
        fx.last_stream_seq = msg.stream_seq;
        let req = match &msg.request {
            Ok(r) => r,
            Err(rejection) => {
                dead_letter(&mut fx, msg, None, rejection.clone());
                continue;
            }
        };
        if let Some((prev, _)) = state.outcomes.get(&req.request_id) {
            if !(msg.redrive && was_dead_lettered(prev)) {
                let dup = Outcome { status: OutcomeStatus::Duplicate, ..prev.clone() };
                if let Some(r) = &msg.reply_to {
                    fx.replies.push((r.clone(), dup));
                }
                continue;
            }
            // Redriven: its new outcome replaces the old one, in this batch's writes too.
            fx.outcomes.retain(|(o, _)| o.request_id != req.request_id);
            fx.redriven.push(req.request_id);
        }
        let known = state.sessions.contains_key(&req.session_id).then_some(req.session_id);
        let result = apply_one(req, msg, state, &mut fx);
        let outcome = match result {
            Ok(Applied { seq, rejected }) => Outcome {
                request_id: req.request_id,
                status: if rejected.is_some() { OutcomeStatus::Rejected } else { OutcomeStatus::Committed },
                seq,
                reason: rejected,
            },
            Err(rejection) => {
                let reason = rejection.reason.clone();
                dead_letter(&mut fx, msg, known, rejection);
                Outcome {
                    request_id: req.request_id,
                    status: OutcomeStatus::Rejected,
                    seq: None,
                    reason: Some(reason),
                }
            }
        };
        if outcome.status == OutcomeStatus::Committed {
            match req.op {
                AppendOp::Create { .. } => created.push(req.session_id),
                AppendOp::Delete => fx.deleted = Some(req.session_id),
                AppendOp::Append { .. } | AppendOp::Update { .. } => touched.push(req.session_id),
                AppendOp::FilePut { .. } | AppendOp::FileDelete | AppendOp::FileSwept => {}
            }
        }
        state.outcomes.insert(req.request_id, (outcome.clone(), Some(req.session_id)));
        fx.outcomes.push((outcome.clone(), Some(req.session_id)));
        if let Some(r) = &msg.reply_to {
            fx.replies.push((r.clone(), outcome));
        }
        if fx.deleted.is_some() || fx.file.is_some() {
            break;
        }
    }

    // Each session once, in first-touched order (sets: a rebuild's batches are large).
    let mut seen: HashSet<SessionId> = HashSet::with_capacity(created.len() + touched.len());
    for id in &created {
        if let Some(row) = state.sessions.get(id) {
            if seen.insert(*id) {
                fx.created.push(row.clone());
            }
        }
    }
    for id in &touched {
        if let Some(row) = state.sessions.get(id) {
            if seen.insert(*id) {
                fx.updated.push(row.clone());
            }
        }
    }
    fx
}

struct Applied {
    seq: Option<i64>,
    /// A reason when the request was valid but its condition failed (no dead letter).
    rejected: Option<Refusal>,
}

impl Applied {
    const DONE: Applied = Applied { seq: None, rejected: None };
}

fn apply_one(
    req: &AppendRequest,
    msg: &Incoming,
    state: &mut LoadedState,
    fx: &mut BatchEffects,
) -> Result<Applied, Rejection> {
    if let Some(why) = &msg.unstorable {
        return Err(refuse(Refusal::Unstorable, why.clone()));
    }
    if msg.subject_session != Some(req.session_id) {
        return Err(refuse(
            Refusal::WrongSubject,
            "the request's session_id is not the one its subject names",
        ));
    }
    let owner = Owner::parse(&req.owner).map_err(|e| refuse(Refusal::BadRequest, e.to_string()))?;
    let (titles, metadata) = match &req.op {
        AppendOp::Create { title, metadata, .. } => ([title, &None], metadata),
        AppendOp::Update { title, title_if_empty, metadata, .. } => ([title, title_if_empty], metadata),
        _ => ([&None, &None], &None),
    };
    if titles.into_iter().flatten().any(|text| text.contains('\0')) {
        return Err(refuse(Refusal::UnstorableText, "title contains a NUL character"));
    }
    if let Some(why) = metadata.as_ref().and_then(metadata_error) {
        return Err(refuse(Refusal::BadRequest, why));
    }
    let now = msg.published;

    match &req.op {
        AppendOp::FilePut { payload } => {
            let meta = FileMeta::deserialize(payload)
                .map_err(|_| refuse(Refusal::BadPayload, "file_put needs a file's metadata"))?;
            if let Some(why) = meta.invalid() {
                return Err(refuse(Refusal::BadPayload, why));
            }
            fx.file = Some(FileWrite::Put(Box::new(FileRow::new(req.session_id.0, &owner, &meta, now))));
            return Ok(Applied::DONE);
        }
        AppendOp::FileDelete => {
            fx.file = Some(FileWrite::Delete { id: req.session_id.0, owner: owner.to_string(), at: now });
            return Ok(Applied::DONE);
        }
        AppendOp::FileSwept => {
            fx.file = Some(FileWrite::Swept { id: req.session_id.0, owner: owner.to_string(), at: now });
            return Ok(Applied::DONE);
        }
        AppendOp::Create { title, forked_from, metadata } => {
            if state.sessions.contains_key(&req.session_id) {
                return Err(refuse(Refusal::SessionExists, "create for a session that already exists"));
            }
            let mut row = SessionRow::new(req.session_id, owner, title.clone(), now);
            if let Some(m) = metadata {
                row.metadata = m.clone();
            }
            if let Some(from) = *forked_from {
                fork_row(state, &mut row, from)?;
            }
            let started = SessionStarted { title: title.clone(), forked_from: *forked_from };
            if !row.lineage.is_empty() {
                state.add_inheritor(&row);
            }
            state.sessions.insert(req.session_id, row);
            let payload = EventBody::SessionStarted(started).to_payload();
            let seq = push_event(&mut state.sessions, fx, req, msg, EventKind::SessionStarted, payload, 0);
            return Ok(Applied { seq: Some(seq), rejected: None });
        }
        AppendOp::Delete | AppendOp::Update { .. } | AppendOp::Append { .. } => {}
    }

    let Some(session) = state.sessions.get_mut(&req.session_id).filter(|s| s.hidden_seq.is_none()) else {
        return Err(refuse(Refusal::UnknownSession, format!("no session {}", req.session_id)));
    };
    if *session.owner != *req.owner {
        return Err(refuse(
            Refusal::OwnerMismatch,
            format!("session belongs to another owner than {:?}", req.owner),
        ));
    }

    match &req.op {
        // (create and file ops returned above)
        AppendOp::Create { .. } | AppendOp::FilePut { .. } | AppendOp::FileDelete | AppendOp::FileSwept => {
            Ok(Applied::DONE)
        }
        AppendOp::Delete => {
            let at = i64::try_from(msg.stream_seq).unwrap_or(i64::MAX);
            fx.removals = plan_delete(state, req.session_id, at, now);
            Ok(Applied::DONE)
        }
        AppendOp::Update { title, archived, title_if_empty, metadata } => {
            if let Some(t) = title {
                session.title = Some(t.clone());
            }
            if let Some(t) = title_if_empty {
                if session.title.as_deref().is_none_or(|s| s.trim().is_empty()) {
                    session.title = Some(t.clone());
                }
            }
            if let Some(a) = *archived {
                session.archived = a;
            }
            if let Some(m) = metadata {
                session.metadata = m.clone();
            }
            Ok(Applied::DONE)
        }
        AppendOp::Append { payload, expect, .. } => {
            let NewEvent { kind, body, tokens } = match &msg.event {
                Some(Ok(event)) => event,
                Some(Err(rejection)) => return Err(rejection.clone()),
                // `Incoming::new` reads every append's event.
                None => return Err(refuse(Refusal::BadRequest, "the append's event was not read")),
            };
            if let Some(Expect { compacted_through }) = *expect {
                if compacted_through != session.compacted_through {
                    return Ok(Applied { seq: None, rejected: Some(Refusal::ExpectFailed) });
                }
            }
            let seq = session.last_seq + 1;
            match body {
                EventBody::UserMessage(m) if m.category.is_some() => {
                    session.last_category = m.category.clone();
                }
                EventBody::CompactionApplied(c) => {
                    let after_previous = session.compacted_through.is_none_or(|b| c.replaces_through_seq > b);
                    if c.replaces_through_seq < 1 || c.replaces_through_seq >= seq || !after_previous {
                        return Err(refuse(
                            Refusal::BadPayload,
                            format!(
                                "replaces_through_seq {} is outside the live log",
                                c.replaces_through_seq
                            ),
                        ));
                    }
                    session.compacted_through = Some(c.replaces_through_seq);
                    session.compaction_seq = Some(seq);
                    state.compactions.entry(req.session_id).or_default().push((seq, c.replaces_through_seq));
                }
                EventBody::MemoryExtracted(m) => {
                    fx.memories.extend(m.memories.iter().map(|mem| MemoryRow {
                        id: mem.id,
                        owner: session.owner.to_string(),
                        session_id: req.session_id,
                        turn_seq: m.turn_seq,
                        text: mem.text.clone(),
                        created_at: msg.published,
                    }));
                }
                _ => {}
            }
            let payload = payload.clone();
            let seq = push_event(&mut state.sessions, fx, req, msg, *kind, payload, *tokens);
            Ok(Applied { seq: Some(seq), rejected: None })
        }
    }
}

/// Makes `row` a fork of `from` after the writer's checks (DESIGN §10): the parent is a
/// live session of the same owner on the same partition, the fork point is in its branch
/// log, forks nest at most [`MAX_FORK_DEPTH`] deep. The fork inherits the parent's branch
/// log through the fork point, and the newest compaction in it.
fn fork_row(state: &LoadedState, row: &mut SessionRow, from: ForkPoint) -> Result<(), Rejection> {
    let Some(parent) = state.sessions.get(&from.session_id).filter(|p| p.hidden_seq.is_none()) else {
        return Err(refuse(Refusal::UnknownSession, format!("no session {} to fork", from.session_id)));
    };
    if parent.owner != row.owner {
        return Err(refuse(Refusal::OwnerMismatch, "a fork's parent belongs to another owner"));
    }
    if partition_of(from.session_id, state.partitions) != partition_of(row.id, state.partitions) {
        return Err(refuse(
            Refusal::WrongPartition,
            format!("fork {} does not hash to its parent {}'s partition", row.id, from.session_id),
        ));
    }
    if from.through_seq < 1 || from.through_seq > parent.last_seq {
        return Err(refuse(
            Refusal::BadForkPoint,
            format!("through_seq {} is not in the parent's log (1..={})", from.through_seq, parent.last_seq),
        ));
    }
    let lineage = fork_lineage(parent.id, &parent.lineage(), from.through_seq);
    if lineage.len() > MAX_FORK_DEPTH {
        return Err(refuse(Refusal::TooDeep, format!("forks nest at most {MAX_FORK_DEPTH} deep")));
    }
    let (compacted_through, compaction_seq) = match parent.compaction_seq {
        Some(seq) if seq <= from.through_seq => (parent.compacted_through, Some(seq)),
        _ => state.compaction_at(&lineage).map_or((None, None), |(through, seq)| (Some(through), Some(seq))),
    };
    row.compacted_through = compacted_through;
    row.compaction_seq = compaction_seq;
    row.forked_from = Some(from.session_id.0);
    row.forked_through = Some(from.through_seq);
    row.last_seq = from.through_seq;
    row.set_lineage(&lineage);
    Ok(())
}

/// What deleting `deleted` (by the APPEND message at `at`) removes: the session itself,
/// then each hidden ancestor it inherited from, nearest first. Each keeps what a live
/// session still inherits from it — the highest fork point on it in any live session's
/// lineage — hidden, and goes wholly when no live session inherits from it. A live
/// ancestor ends the walk: it keeps everything, so everything above it stays as it is.
/// Moves `state` accordingly.
fn plan_delete(state: &mut LoadedState, deleted: SessionId, at: i64, now: DateTime<Utc>) -> Vec<Removal> {
    let Some(row) = state.sessions.get(&deleted) else { return Vec::new() };
    let chain: Vec<SessionId> =
        std::iter::once(deleted).chain(row.lineage.iter().rev().map(|id| SessionId(*id))).collect();
    let mut removals = Vec::new();
    for (i, id) in chain.into_iter().enumerate() {
        let Some(row) = state.sessions.get(&id) else { break };
        if i > 0 && row.hidden_seq.is_none() {
            break;
        }
        let inherited = state
            .inheritors
            .get(&id)
            .into_iter()
            .flatten()
            .filter(|v| **v != deleted)
            .filter_map(|v| state.sessions.get(v))
            .filter(|v| v.hidden_seq.is_none())
            .filter_map(|v| v.lineage.iter().position(|a| *a == id.0).map(|i| v.lineage_through[i]))
            .max();
        match inherited {
            None => {
                let Some(row) = state.sessions.remove(&id) else { break };
                for ancestor in &row.lineage {
                    if let Some(set) = state.inheritors.get_mut(&SessionId(*ancestor)) {
                        set.remove(&id);
                    }
                }
                state.inheritors.remove(&id);
                state.compactions.remove(&id);
                removals.push(Removal { session: id, kept: None });
            }
            Some(kept) => {
                let Some(row) = state.sessions.get_mut(&id) else { break };
                // Nothing of a hidden session is shown; its row keeps only what the prefix
                // needs, the same however often it was cut.
                row.hidden_seq = Some(row.hidden_seq.unwrap_or(at));
                row.title = None;
                row.archived = false;
                row.last_category = None;
                row.compacted_through = None;
                row.compaction_seq = None;
                row.last_seq = kept;
                row.updated_at = now;
                row.active_at = now;
                if let Some(list) = state.compactions.get_mut(&id) {
                    list.retain(|(seq, _)| *seq <= kept);
                }
                removals.push(Removal { session: id, kept: Some(row.clone()) });
            }
        }
    }
    removals
}

fn push_event(
    sessions: &mut HashMap<SessionId, SessionRow>,
    fx: &mut BatchEffects,
    req: &AppendRequest,
    msg: &Incoming,
    kind: EventKind,
    payload: Value,
    tokens: i32,
) -> i64 {
    let Some(session) = sessions.get_mut(&req.session_id) else { return 0 };
    session.last_seq += 1;
    session.updated_at = msg.published;
    if let Some(at) = active_at(kind, &payload, msg.published) {
        session.active_at = at;
    }
    fx.events.push(EventRow {
        event: CommittedEvent {
            session_id: req.session_id,
            owner: session.owner.clone(),
            seq: session.last_seq,
            event_id: EventId(req.request_id),
            kind,
            payload,
            created_at: msg.published,
            stream_seq: Some(msg.stream_seq),
        },
        tokens,
        session_created_at: session.created_at,
        traceparent: None,
    });
    session.last_seq
}

/// When a message (`user_message`, `assistant_turn`) published at `published` makes its
/// session last active: then, or at its original time when an import brought it
/// (`imported.created_at`, within `turnlog_core::storable::YEARS`). None for the other kinds: a turn's progress and what the workers
/// derive from a turn follow a message, and an import's memory extraction must not list
/// its old conversations as new.
fn active_at(kind: EventKind, payload: &Value, published: DateTime<Utc>) -> Option<DateTime<Utc>> {
    if !matches!(kind, EventKind::UserMessage | EventKind::AssistantTurn) {
        return None;
    }
    let original = payload.get("imported").and_then(|i| i.get("created_at")).and_then(Value::as_str);
    let original = original.and_then(|t| t.parse::<DateTime<Utc>>().ok());
    // A time Postgres cannot hold would fail the commit only when no later message of the
    // batch moves the session on: the same request would commit or not by how the stream
    // was batched, and a rebuild could fail where the live writer did not.
    Some(original.filter(|t| turnlog_core::storable::YEARS.contains(&t.year())).unwrap_or(published))
}

fn dead_letter(fx: &mut BatchEffects, msg: &Incoming, session: Option<SessionId>, rejection: Rejection) {
    fx.dead.push((
        session,
        DeadLetter {
            reason: rejection.reason.as_str().to_owned(),
            detail: rejection.detail,
            stream_seq: Some(msg.stream_seq),
            request: String::from_utf8_lossy(&msg.body).into_owned(),
        },
    ));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use uuid::{NoContext, Timestamp};

    const WINDOW: Duration = Duration::from_secs(120);

    fn minted(at: DateTime<Utc>) -> Uuid {
        Uuid::new_v7(Timestamp::from_unix(NoContext, at.timestamp() as u64, at.timestamp_subsec_nanos()))
    }

    #[test]
    fn only_a_uuid_v7_minted_within_half_the_window_is_a_first_copy() {
        let now = Utc::now();
        let s = chrono::TimeDelta::seconds;
        assert!(first_copy(minted(now), now, WINDOW));
        assert!(first_copy(minted(now - s(59)), now, WINDOW));
        // Old enough that an earlier copy may have left the duplicate window.
        assert!(!first_copy(minted(now - s(61)), now, WINDOW));
        assert!(!first_copy(minted(now - s(600)), now, WINDOW));
        // A producer's clock far ahead of nats-server's proves nothing either.
        assert!(!first_copy(minted(now + s(61)), now, WINDOW));
        // Derived and random ids carry no time.
        assert!(!first_copy(Uuid::new_v5(&Uuid::NAMESPACE_URL, b"key"), now, WINDOW));
        assert!(!first_copy(Uuid::new_v4(), now, WINDOW));
        // A stream without a duplicate window: always look up.
        assert!(!first_copy(minted(now), now, Duration::ZERO));
    }
}
