//! The messages on the bus (DESIGN §6): append requests and their header, committed
//! events, dead letters, and the compaction check's request and reply. Their shapes are a
//! contract: kinds are added, new fields are optional, old messages always decode.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use turnlog_core::events::{EventKind, ForkPoint, KindName};
use turnlog_core::ids::{EventId, Owner, SessionId};

/// Header naming the core NATS subject the writer answers a request's outcome on.
pub const REPLY_HEADER: &str = "Turnlog-Reply-To";

/// `expect` of a conditional append; `compacted_through` null means "no compaction yet".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Expect {
    #[serde(default)]
    pub compacted_through: Option<i64>,
}

/// An append's event kind as it arrives: one this build knows, or another name — which
/// the writer refuses as `unknown_kind` (an outcome the producer hears of), not as a
/// request that does not decode.
pub type RequestKind = KindName;

/// A request to the writer, the body of a TURNLOG_APPEND message. On the wire it is one
/// flat object (DESIGN §6: `op` names the op, whose fields sit beside it), read and written
/// through `WireAppendRequest`; here each op carries exactly its own fields.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "WireAppendRequest<'static>")]
pub struct AppendRequest {
    /// Equals the event's `event_id` when the op is an append.
    pub request_id: Uuid,
    /// A file op's file id (its subject and partition are the file's).
    pub session_id: SessionId,
    /// As sent: the writer refuses one that is not an [`Owner`] (`bad_request`), with an
    /// outcome the producer hears of, rather than as a request that does not decode.
    pub owner: String,
    pub op: AppendOp,
}

/// What a request does, with the fields of its op.
#[derive(Debug, Clone, PartialEq)]
pub enum AppendOp {
    /// Inserts the session and its `session_started` event: a fork of `forked_from` when
    /// given (DESIGN §10); `metadata` is the session's, whole (§13).
    Create {
        title: Option<String>,
        forked_from: Option<ForkPoint>,
        metadata: Option<Value>,
    },
    /// Appends an event; with `expect`, only if the session's compaction is as expected.
    Append {
        kind: RequestKind,
        payload: Value,
        expect: Option<Expect>,
    },
    /// Changes what is given: `title_if_empty` names a session that has no title yet;
    /// `metadata` replaces the session's whole.
    Update {
        title: Option<String>,
        archived: Option<bool>,
        title_if_empty: Option<String>,
        metadata: Option<Value>,
    },
    Delete,
    /// A file's metadata (DESIGN §12), a [`crate::files::FileMeta`] (null when missing: the
    /// writer refuses it as `bad_payload`).
    FilePut {
        payload: Value,
    },
    /// Marks a file deleted (its blobs go later, when no stored message refers to them).
    FileDelete,
    /// Records that a deleted file's blobs are gone (the sweep's, after it removed them).
    FileSwept,
}

impl AppendOp {
    /// The op's name on the wire, for logs and metrics.
    pub fn name(&self) -> &'static str {
        OpName::of(self).as_str()
    }
}

/// The op's name on the wire.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum OpName {
    Create,
    Append,
    Update,
    Delete,
    FilePut,
    FileDelete,
    FileSwept,
}

impl OpName {
    fn of(op: &AppendOp) -> Self {
        match op {
            AppendOp::Create { .. } => Self::Create,
            AppendOp::Append { .. } => Self::Append,
            AppendOp::Update { .. } => Self::Update,
            AppendOp::Delete => Self::Delete,
            AppendOp::FilePut { .. } => Self::FilePut,
            AppendOp::FileDelete => Self::FileDelete,
            AppendOp::FileSwept => Self::FileSwept,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Append => "append",
            Self::Update => "update",
            Self::Delete => "delete",
            Self::FilePut => "file_put",
            Self::FileDelete => "file_delete",
            Self::FileSwept => "file_swept",
        }
    }
}

/// An [`AppendRequest`] as it is on the wire: every op's fields, optional, in the order
/// they have always been written. Written borrowing the request's fields; read owned and
/// checked into an [`AppendOp`] in one pass (no `flatten` or tagged enum, which would
/// buffer every append the writer reads). Fields an op does not use are ignored.
#[derive(Serialize, Deserialize)]
struct WireAppendRequest<'a> {
    request_id: Uuid,
    op: OpName,
    session_id: SessionId,
    owner: Cow<'a, str>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kind: Option<Cow<'a, RequestKind>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    payload: Option<Cow<'a, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expect: Option<Expect>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    title: Option<Cow<'a, str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    archived: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    title_if_empty: Option<Cow<'a, str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    forked_from: Option<ForkPoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    metadata: Option<Cow<'a, Value>>,
}

impl Serialize for AppendRequest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut wire = WireAppendRequest {
            request_id: self.request_id,
            op: OpName::of(&self.op),
            session_id: self.session_id,
            owner: Cow::Borrowed(&self.owner),
            kind: None,
            payload: None,
            expect: None,
            title: None,
            archived: None,
            title_if_empty: None,
            forked_from: None,
            metadata: None,
        };
        match &self.op {
            AppendOp::Create { title, forked_from, metadata } => {
                wire.title = title.as_deref().map(Cow::Borrowed);
                wire.forked_from = *forked_from;
                wire.metadata = metadata.as_ref().map(Cow::Borrowed);
            }
            AppendOp::Append { kind, payload, expect } => {
                wire.kind = Some(Cow::Borrowed(kind));
                wire.payload = Some(Cow::Borrowed(payload));
                wire.expect = *expect;
            }
            AppendOp::Update { title, archived, title_if_empty, metadata } => {
                wire.title = title.as_deref().map(Cow::Borrowed);
                wire.archived = *archived;
                wire.title_if_empty = title_if_empty.as_deref().map(Cow::Borrowed);
                wire.metadata = metadata.as_ref().map(Cow::Borrowed);
            }
            // Null and missing are one on the wire (an `Option` reads null as missing).
            AppendOp::FilePut { payload } => {
                wire.payload = Some(payload).filter(|p| !p.is_null()).map(Cow::Borrowed)
            }
            AppendOp::Delete | AppendOp::FileDelete | AppendOp::FileSwept => {}
        }
        wire.serialize(serializer)
    }
}

impl TryFrom<WireAppendRequest<'static>> for AppendRequest {
    type Error = &'static str;

    /// Refuses only an append without its kind or payload: the writer then refuses it as
    /// `bad_request`, as it always has.
    fn try_from(wire: WireAppendRequest<'static>) -> Result<Self, Self::Error> {
        let text = |t: Option<Cow<'static, str>>| t.map(Cow::into_owned);
        let op = match wire.op {
            OpName::Create => AppendOp::Create {
                title: text(wire.title),
                forked_from: wire.forked_from,
                metadata: wire.metadata.map(Cow::into_owned),
            },
            OpName::Append => match (wire.kind, wire.payload) {
                (Some(kind), Some(payload)) => AppendOp::Append {
                    kind: kind.into_owned(),
                    payload: payload.into_owned(),
                    expect: wire.expect,
                },
                _ => return Err("append needs kind and payload"),
            },
            OpName::Update => AppendOp::Update {
                title: text(wire.title),
                archived: wire.archived,
                title_if_empty: text(wire.title_if_empty),
                metadata: wire.metadata.map(Cow::into_owned),
            },
            OpName::Delete => AppendOp::Delete,
            OpName::FilePut => {
                AppendOp::FilePut { payload: wire.payload.map_or(Value::Null, Cow::into_owned) }
            }
            OpName::FileDelete => AppendOp::FileDelete,
            OpName::FileSwept => AppendOp::FileSwept,
        };
        Ok(Self {
            request_id: wire.request_id,
            session_id: wire.session_id,
            owner: wire.owner.into_owned(),
            op,
        })
    }
}

impl AppendRequest {
    fn new(op: AppendOp, session_id: SessionId, owner: &Owner) -> Self {
        Self { request_id: Uuid::now_v7(), session_id, owner: owner.as_str().to_owned(), op }
    }
    pub fn create(session_id: SessionId, owner: &Owner, title: Option<String>) -> Self {
        Self::new(AppendOp::Create { title, forked_from: None, metadata: None }, session_id, owner)
    }
    /// A `create` of `session_id` as a fork of `from`; its id must hash to the parent's
    /// partition ([`partition_of`](super::partition_of)), or the writer dead-letters it.
    pub fn fork(session_id: SessionId, owner: &Owner, title: Option<String>, from: ForkPoint) -> Self {
        Self::new(AppendOp::Create { title, forked_from: Some(from), metadata: None }, session_id, owner)
    }
    /// An append of `body`, with `event_id` as the request id.
    pub fn append(
        session_id: SessionId,
        owner: &Owner,
        event_id: Uuid,
        body: &turnlog_core::EventBody,
    ) -> Self {
        Self::append_payload(session_id, owner, event_id, body.kind(), body.to_payload())
    }
    /// An append of a payload as it is (an import's: fields this build does not know kept).
    pub fn append_payload(
        session_id: SessionId,
        owner: &Owner,
        event_id: Uuid,
        kind: EventKind,
        payload: Value,
    ) -> Self {
        let op = AppendOp::Append { kind: RequestKind::Known(kind), payload, expect: None };
        Self { request_id: event_id, ..Self::new(op, session_id, owner) }
    }
    /// An update that changes nothing yet: see the `with_` methods.
    pub fn update(session_id: SessionId, owner: &Owner) -> Self {
        let op = AppendOp::Update { title: None, archived: None, title_if_empty: None, metadata: None };
        Self::new(op, session_id, owner)
    }
    pub fn delete(session_id: SessionId, owner: &Owner) -> Self {
        Self::new(AppendOp::Delete, session_id, owner)
    }
    /// A file's metadata; the file id stands in the session's place (subject and partition).
    pub fn file_put(file: Uuid, owner: &Owner, meta: &crate::files::FileMeta) -> Self {
        let payload = serde_json::to_value(meta).unwrap_or_default();
        Self::new(AppendOp::FilePut { payload }, SessionId(file), owner)
    }
    pub fn file_delete(file: Uuid, owner: &Owner) -> Self {
        Self::new(AppendOp::FileDelete, SessionId(file), owner)
    }
    pub fn file_swept(file: Uuid, owner: &Owner) -> Self {
        Self::new(AppendOp::FileSwept, SessionId(file), owner)
    }

    /// An append's condition (no other op has one).
    pub fn with_expect(mut self, expect: Option<Expect>) -> Self {
        if let AppendOp::Append { expect: e, .. } = &mut self.op {
            *e = expect;
        }
        self
    }
    /// A create's or an update's title.
    pub fn with_title(mut self, title: Option<String>) -> Self {
        if let AppendOp::Create { title: t, .. } | AppendOp::Update { title: t, .. } = &mut self.op {
            *t = title;
        }
        self
    }
    /// A create's or an update's metadata, the session's whole.
    pub fn with_metadata(mut self, metadata: Option<Value>) -> Self {
        if let AppendOp::Create { metadata: m, .. } | AppendOp::Update { metadata: m, .. } = &mut self.op {
            *m = metadata;
        }
        self
    }
    /// An update's archived flag.
    pub fn with_archived(mut self, archived: Option<bool>) -> Self {
        if let AppendOp::Update { archived: a, .. } = &mut self.op {
            *a = archived;
        }
        self
    }
    /// An update's title for a session that has none yet.
    pub fn with_title_if_empty(mut self, title: Option<String>) -> Self {
        if let AppendOp::Update { title_if_empty: t, .. } = &mut self.op {
            *t = title;
        }
        self
    }
}

/// A committed event, published by the writer after its commit: on TURNLOG_EVENTS when a
/// worker consumes its kind, otherwise as a core NATS message (DESIGN §6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommittedEvent {
    pub session_id: SessionId,
    pub owner: Owner,
    pub seq: i64,
    pub event_id: EventId,
    pub kind: EventKind,
    pub payload: Value,
    pub created_at: DateTime<Utc>,
    /// The TURNLOG_APPEND message it was committed from: what a deleted session's purge
    /// compares with the delete's own sequence. None on events published before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_seq: Option<u64>,
}

impl CommittedEvent {
    /// Decodes a feed message; `Ok(None)` for an event of a kind this build does not know
    /// (a newer writer's), which no worker here handles.
    pub fn decode(payload: &[u8]) -> Result<Option<Self>, serde_json::Error> {
        #[derive(Deserialize)]
        struct KindOnly {
            kind: String,
        }
        match serde_json::from_slice::<Self>(payload) {
            Ok(event) => Ok(Some(event)),
            Err(e) => match serde_json::from_slice::<KindOnly>(payload) {
                Ok(k) if k.kind.parse::<EventKind>().is_err() => Ok(None),
                _ => Err(e),
            },
        }
    }

    /// Whether an import appended it (its payload says where from).
    pub fn is_imported(&self) -> bool {
        self.payload.get("imported").is_some()
    }

    /// Its token on the feed: its kind, `-imported` when an import appended it.
    pub fn feed_token(&self) -> String {
        super::feed_token(self.kind.as_str(), self.is_imported())
    }

    /// The feed's dedup id, given the creation time of the event's session: the same event
    /// republished after a crash is dropped as a duplicate, while a session created again
    /// under a deleted one's id is not mistaken for it (JetStream remembers dedup ids after
    /// their messages are deleted).
    pub fn msg_id(&self, session_created_at: DateTime<Utc>) -> String {
        format!("{}:{}:{}", self.session_id, self.seq, session_created_at.timestamp_micros())
    }
}

/// A dead letter: a request the writer could not apply, with the original bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub reason: String,
    pub detail: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_seq: Option<u64>,
    pub request: String,
}

impl DeadLetter {
    /// The TURNLOG_APPEND sequence the letter comes from: a writer's letter names it in
    /// `stream_seq`; a worker's letter holds a committed event, which carries its own (the
    /// letter's `stream_seq` is then the event's TURNLOG_EVENTS sequence).
    pub fn append_seq(&self) -> Option<u64> {
        if serde_json::from_str::<AppendRequest>(&self.request).is_err() {
            if let Ok(event) = serde_json::from_str::<CommittedEvent>(&self.request) {
                return event.stream_seq;
            }
        }
        self.stream_seq
    }
}

/// A pre-send check, as the ingress sends it to `<prefix>.compact.<session_id>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompactRequest {
    pub session_id: SessionId,
    pub owner: Owner,
    /// The model about to be called; its window sets the budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// What the system prompt and this turn's extras add to the request.
    #[serde(default)]
    pub reserve_tokens: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompactStatus {
    /// This check committed a compaction; the request is within budget unless `tokens`
    /// says otherwise.
    Compacted,
    /// Already within budget.
    NotNeeded,
    /// Still over budget (nothing left to compact, refused summaries, a failed call).
    Failed,
}

/// The answer to a [`CompactRequest`]. `tokens` and `budget` are the next request's size
/// and limit as the compactor measured them after its work.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompactReply {
    pub status: CompactStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub through_seq: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_kind_reads_known_and_unknown_names_alike() {
        for (json, kind) in [
            ("\"user_message\"", RequestKind::Known(EventKind::UserMessage)),
            ("\"user_msg\"", RequestKind::Unknown("user_msg".into())),
        ] {
            assert_eq!(serde_json::from_str::<RequestKind>(json).unwrap(), kind);
            assert_eq!(serde_json::to_string(&kind).unwrap(), json);
        }
        assert!(serde_json::from_str::<RequestKind>("42").is_err());
    }

    #[test]
    fn feed_ids_name_the_session_life_and_bodies_name_their_append_sequence() {
        let session = SessionId::new();
        let created: DateTime<Utc> = "2026-12-01T02:03:04.567891Z".parse().unwrap();
        let event: CommittedEvent = serde_json::from_value(serde_json::json!({
            "session_id": session, "owner": "alice", "seq": 3, "event_id": Uuid::nil(),
            "kind": "user_message", "payload": {}, "created_at": created, "stream_seq": 42
        }))
        .unwrap();
        assert_eq!(event.msg_id(created), format!("{session}:3:1796090584567891"));
        let later = created + chrono::TimeDelta::microseconds(1);
        assert_ne!(event.msg_id(later), event.msg_id(created), "a session created again is another");
        // Events published before bodies carried it still decode.
        let mut old = serde_json::to_value(&event).unwrap();
        old.as_object_mut().unwrap().remove("stream_seq");
        assert_eq!(serde_json::from_value::<CommittedEvent>(old).unwrap().stream_seq, None);

        // A writer's dead letter names its APPEND sequence; a worker's holds an event that does.
        let request = AppendRequest::delete(session, &Owner::parse("alice").unwrap());
        let writer_letter = DeadLetter {
            reason: "owner_mismatch".into(),
            detail: String::new(),
            stream_seq: Some(7),
            request: serde_json::to_string(&request).unwrap(),
        };
        assert_eq!(writer_letter.append_seq(), Some(7));
        let undecodable = DeadLetter { request: "{garbage".into(), ..writer_letter.clone() };
        assert_eq!(undecodable.append_seq(), Some(7));
        let worker_letter = DeadLetter {
            stream_seq: Some(1_000),
            request: serde_json::to_string(&event).unwrap(),
            ..writer_letter
        };
        assert_eq!(worker_letter.append_seq(), Some(42));
    }

    #[test]
    fn request_wire_shape() {
        let s = SessionId::new();
        let r = AppendRequest::append(
            s,
            &Owner::parse("alice").unwrap(),
            Uuid::nil(),
            &turnlog_core::EventBody::TurnFailed(turnlog_core::events::TurnFailed::default()),
        )
        .with_expect(Some(Expect { compacted_through: None }));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["op"], "append");
        assert_eq!(v["kind"], "turn_failed");
        assert_eq!(v["expect"], serde_json::json!({"compacted_through": null}));
        assert_eq!(serde_json::from_value::<AppendRequest>(v).unwrap(), r);
    }
}
