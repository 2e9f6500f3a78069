//! The bus contract (DESIGN.md §6): stream and subject names under `TURNLOG_BUS_PREFIX`,
//! the messages on them, the topology every service creates or verifies at start, the
//! turn-lease bucket, and `append_and_wait` — the one way any producer appends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self, message::PublishMessage, stream};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use turnlog_core::events::{EventKind, ForkPoint};
use turnlog_core::ids::{EventId, Owner, SessionId};

/// Header naming the core NATS subject the writer answers a request's outcome on.
pub const REPLY_HEADER: &str = "Turnlog-Reply-To";
/// The writer refuses an event whose serialized payload is larger (a constant, not a
/// setting, so a rebuild applies the same rule). Producers measure with [`json_len`].
pub const MAX_EVENT_BYTES: usize = 768 * 1024;
/// JetStream's dedup window on every stream; resending a request within it is a no-op
/// even before the writer sees it.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// The turn lease expires unless renewed within this.
pub const TURN_LEASE_TTL: Duration = Duration::from_secs(10);
/// The reason `append_and_wait` reports for a request applied once and then deleted with
/// its session, when the same request id is sent again within the duplicate window.
/// JetStream drops the copy as a duplicate, so the writer never sees it, and the first
/// copy's outcome went with the session: without this the producer could only wait for an
/// outcome that never comes (a 503 forever). It is an answer, not a write — the database
/// stays a function of the APPEND stream. After the window the same request is applied
/// anew (a create makes the session again), as a rebuild would apply it.
pub const SESSION_DELETED: &str = "session_deleted";

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("invalid TURNLOG_BUS_PREFIX {0:?}: use 1-32 characters of a-z, 0-9, _ or -")]
    BadPrefix(String),
    #[error("cannot reach NATS at {url}: {source}")]
    Connect { url: String, source: async_nats::ConnectError },
    #[error("JetStream: {0}")]
    JetStream(String),
    #[error("stream {name} exists with subjects {found:?}, expected {expected:?}")]
    Mismatch { name: String, found: Vec<String>, expected: Vec<String> },
}

fn js_err(e: impl std::fmt::Display) -> BusError {
    BusError::JetStream(e.to_string())
}

/// Every stream, bucket and subject name, derived from the bus prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusNames {
    prefix: String,
    upper: String,
}

impl BusNames {
    pub fn new(prefix: &str) -> Result<Self, BusError> {
        let ok = !prefix.is_empty()
            && prefix.len() <= 32
            && prefix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !ok {
            return Err(BusError::BadPrefix(prefix.chars().take(40).collect()));
        }
        Ok(Self { prefix: prefix.to_owned(), upper: prefix.to_ascii_uppercase() })
    }
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn append_stream(&self) -> String {
        format!("{}_APPEND", self.upper)
    }
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.upper)
    }
    pub fn dead_stream(&self) -> String {
        format!("{}_DEAD", self.upper)
    }
    pub fn turns_bucket(&self) -> String {
        format!("{}_TURNS", self.upper)
    }
    pub fn append_subject(&self, partition: u32, session: SessionId) -> String {
        format!("{}.append.{partition}.{session}", self.prefix)
    }
    /// Everything a partition's writer reads.
    pub fn append_partition_filter(&self, partition: u32) -> String {
        format!("{}.append.{partition}.*", self.prefix)
    }
    pub fn events_subject(&self, kind: &str, session: SessionId) -> String {
        format!("{}.events.{kind}.{session}", self.prefix)
    }
    pub fn events_kind_filter(&self, kind: &str) -> String {
        format!("{}.events.{kind}.*", self.prefix)
    }
    /// `session` is None when the request named no session the writer could read.
    pub fn dead_subject(&self, reason: &str, session: Option<SessionId>) -> String {
        match session {
            Some(s) => format!("{}.dead.{reason}.{s}", self.prefix),
            None => format!("{}.dead.{reason}.none", self.prefix),
        }
    }
    pub fn compact_subject(&self, session: SessionId) -> String {
        format!("{}.compact.{session}", self.prefix)
    }
    pub fn live_subject(&self, session: SessionId) -> String {
        format!("{}.live.{session}", self.prefix)
    }
    pub fn turn_subject(&self, session: SessionId) -> String {
        format!("{}.turn.{session}", self.prefix)
    }
    pub fn control_subject(&self, session: SessionId) -> String {
        format!("{}.control.{session}", self.prefix)
    }
    /// Answered with its session by the ingress copy running attempt `attempt_id`.
    pub fn attempt_subject(&self, attempt_id: &str) -> String {
        format!("{}.attempt.{attempt_id}", self.prefix)
    }
    /// Subjects of one session in each stream, for purging a deleted session.
    pub fn session_filters(&self, partition: u32, session: SessionId) -> [(String, String); 3] {
        [
            (self.append_stream(), self.append_subject(partition, session)),
            (self.events_stream(), format!("{}.events.*.{session}", self.prefix)),
            (self.dead_stream(), format!("{}.dead.*.{session}", self.prefix)),
        ]
    }
}

/// The partition a session's appends go to: FNV-1a of its id's bytes, mod the partition
/// count. Stable across versions and processes; the count is fixed for a deployment.
pub fn partition_of(session: SessionId, partitions: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in session.0.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(partitions.max(1))) as u32
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Create,
    Append,
    Update,
    Delete,
    /// A file's metadata (DESIGN §12): `session_id` is the file's id, `payload` its
    /// [`crate::files::FileMeta`].
    FilePut,
    /// Marks a file deleted (its blobs go later, when no stored message refers to them).
    FileDelete,
    /// Records that a deleted file's blobs are gone (the sweep's, after it removed them).
    FileSwept,
}

/// `expect` of a conditional append; `compacted_through` null means "no compaction yet".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Expect {
    #[serde(default)]
    pub compacted_through: Option<i64>,
}

/// An append's event kind as it arrives: one this build knows, or another name — which
/// the writer refuses as `unknown_kind` (an outcome the producer hears of), not as a
/// request that does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestKind {
    Known(EventKind),
    Unknown(String),
}

impl Serialize for RequestKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Known(kind) => serializer.serialize_str(kind.as_str()),
            Self::Unknown(name) => serializer.serialize_str(name),
        }
    }
}

/// Read as a string and looked up once (not `untagged`, which buffers the value and tries
/// each variant in turn on every append).
impl<'de> Deserialize<'de> for RequestKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        Ok(match name.parse() {
            Ok(kind) => Self::Known(kind),
            Err(_) => Self::Unknown(name),
        })
    }
}

/// A request to the writer, the body of a TURNLOG_APPEND message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AppendRequest {
    /// Equals the event's `event_id` when `op` is append.
    pub request_id: Uuid,
    pub op: Op,
    pub session_id: SessionId,
    pub owner: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<RequestKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<Expect>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archived: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title_if_empty: Option<String>,
    /// On a `create`: the session is a fork of this branch point (DESIGN §10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkPoint>,
    /// On a `create` or an `update`: the session's metadata, replaced whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

/// Most metadata pairs a session keeps, and the longest key and value (OpenAI's limits).
pub const MAX_METADATA_PAIRS: usize = 16;
pub const MAX_METADATA_KEY: usize = 64;
pub const MAX_METADATA_VALUE: usize = 512;

/// Why `metadata` cannot be a session's metadata, if it cannot: an object of at most 16
/// string pairs, keys up to 64 characters, values up to 512, no NUL characters.
pub fn metadata_error(metadata: &Value) -> Option<String> {
    let Some(pairs) = metadata.as_object() else { return Some("metadata must be an object".into()) };
    if pairs.len() > MAX_METADATA_PAIRS {
        return Some(format!("metadata holds at most {MAX_METADATA_PAIRS} pairs"));
    }
    for (key, value) in pairs {
        // No message names a key: a client's key can be as long as its body.
        let Some(value) = value.as_str() else { return Some("metadata values must be strings".into()) };
        if key.chars().count() > MAX_METADATA_KEY || value.chars().count() > MAX_METADATA_VALUE {
            return Some(format!(
                "metadata keys take at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}"
            ));
        }
        if key.contains('\0') || value.contains('\0') {
            return Some("metadata must not contain NUL characters".into());
        }
    }
    None
}

impl AppendRequest {
    fn base(op: Op, session_id: SessionId, owner: &str) -> Self {
        Self {
            request_id: Uuid::now_v7(),
            op,
            session_id,
            owner: owner.to_owned(),
            kind: None,
            payload: None,
            expect: None,
            title: None,
            archived: None,
            title_if_empty: None,
            forked_from: None,
            metadata: None,
        }
    }
    pub fn create(session_id: SessionId, owner: &str, title: Option<String>) -> Self {
        Self { title, ..Self::base(Op::Create, session_id, owner) }
    }
    /// A `create` of `session_id` as a fork of `from`; its id must hash to the parent's
    /// partition ([`partition_of`]), or the writer dead-letters it.
    pub fn fork(session_id: SessionId, owner: &str, title: Option<String>, from: ForkPoint) -> Self {
        Self { title, forked_from: Some(from), ..Self::base(Op::Create, session_id, owner) }
    }
    /// An append of `body`, with `event_id` as the request id.
    pub fn append(
        session_id: SessionId,
        owner: &str,
        event_id: Uuid,
        body: &turnlog_core::EventBody,
    ) -> Self {
        Self {
            request_id: event_id,
            kind: Some(RequestKind::Known(body.kind())),
            payload: Some(body.to_payload()),
            ..Self::base(Op::Append, session_id, owner)
        }
    }
    /// An append of a payload as it is (an import's: fields this build does not know kept).
    pub fn append_payload(
        session_id: SessionId,
        owner: &str,
        event_id: Uuid,
        kind: EventKind,
        payload: Value,
    ) -> Self {
        Self {
            request_id: event_id,
            kind: Some(RequestKind::Known(kind)),
            payload: Some(payload),
            ..Self::base(Op::Append, session_id, owner)
        }
    }
    pub fn update(session_id: SessionId, owner: &str) -> Self {
        Self::base(Op::Update, session_id, owner)
    }
    pub fn delete(session_id: SessionId, owner: &str) -> Self {
        Self::base(Op::Delete, session_id, owner)
    }
    /// A file's metadata; the file id stands in the session's place (subject and partition).
    pub fn file_put(file: Uuid, owner: &str, meta: &crate::files::FileMeta) -> Self {
        Self { payload: serde_json::to_value(meta).ok(), ..Self::base(Op::FilePut, SessionId(file), owner) }
    }
    pub fn file_delete(file: Uuid, owner: &str) -> Self {
        Self::base(Op::FileDelete, SessionId(file), owner)
    }
    pub fn file_swept(file: Uuid, owner: &str) -> Self {
        Self::base(Op::FileSwept, SessionId(file), owner)
    }
}

pub use turnlog_core::storable::has_nul;

/// The length of `value` serialized as JSON, escapes included (a quote or a line break
/// takes two bytes, another control character six), without building the text.
pub fn json_len(value: &(impl Serialize + ?Sized)) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Only a failing `Serialize` impl errs (never for JSON values and strings): too large.
    match serde_json::to_writer(&mut counter, value) {
        Ok(()) => counter.0,
        Err(_) => usize::MAX,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeStatus {
    Committed,
    Rejected,
    /// The request was applied before; `seq` and `reason` are the recorded ones.
    Duplicate,
}

impl OutcomeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeStatus::Committed => "committed",
            OutcomeStatus::Rejected => "rejected",
            OutcomeStatus::Duplicate => "duplicate",
        }
    }
}

/// What became of a request: recorded in `request_outcomes` with its effect, and sent to
/// the request's reply subject after the commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub request_id: Uuid,
    pub status: OutcomeStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Outcome {
    /// Committed now or before (a duplicate of a committed request carries its seq).
    pub fn is_applied(&self) -> bool {
        match self.status {
            OutcomeStatus::Committed => true,
            OutcomeStatus::Duplicate => self.reason.is_none(),
            OutcomeStatus::Rejected => false,
        }
    }
}

/// An event on TURNLOG_EVENTS, published by the writer after its commit.
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

/// A connection to the bus: core NATS, JetStream and the names.
#[derive(Clone)]
pub struct Bus {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub names: BusNames,
    pub partitions: u32,
    /// `TURNLOG_STREAM_REPLICAS`: the replicas [`Bus::ensure_topology`] creates streams and
    /// the lease bucket with (1 unless [`Bus::with_replicas`] says otherwise).
    pub replicas: usize,
    /// Counts reconnects after a lost connection (not the first connect).
    reconnects: tokio::sync::watch::Receiver<u64>,
}

/// The streams' replica counts one can configure (`TURNLOG_STREAM_REPLICAS`): a JetStream
/// cluster needs an odd count to keep a majority.
pub const STREAM_REPLICAS: [usize; 3] = [1, 3, 5];

/// What a service logs when it finds a stream with fewer replicas than configured: it does
/// not change the stream itself (an operator's step, since it moves data across the cluster).
pub fn replicas_warning(stream: &str, have: usize, want: usize) -> String {
    format!(
        "stream {stream} has {have} replica(s) but TURNLOG_STREAM_REPLICAS is {want}; \
         run `turnlog migrate --bus` to change it"
    )
}

/// What `turnlog migrate --bus` did to one stream ([`Bus::migrate_replicas`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaChange {
    pub stream: String,
    /// None when the stream did not exist (then it was created with `after`).
    pub before: Option<usize>,
    pub after: usize,
}

impl std::fmt::Display for ReplicaChange {
    /// `TURNLOG_APPEND: replicas 1 → 3`, `… replicas 3 (unchanged)` or `… created with replicas 3`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.before {
            Some(before) if before == self.after => {
                write!(f, "{}: replicas {before} (unchanged)", self.stream)
            }
            Some(before) => write!(f, "{}: replicas {before} → {}", self.stream, self.after),
            None => write!(f, "{}: created with replicas {}", self.stream, self.after),
        }
    }
}

impl Bus {
    /// Connects (retrying in the background after a disconnect, as async-nats does). `url`
    /// may list several servers of a cluster, comma-separated.
    pub async fn connect(url: &str, prefix: &str, partitions: u32) -> Result<Self, BusError> {
        let names = BusNames::new(prefix)?;
        let servers: Vec<&str> = url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
        let (reconnected, reconnects) = tokio::sync::watch::channel(0u64);
        let lost = Arc::new(AtomicBool::new(false));
        let client = async_nats::ConnectOptions::new()
            .event_callback(move |event| {
                match event {
                    async_nats::Event::Disconnected => lost.store(true, Ordering::Relaxed),
                    async_nats::Event::Connected if lost.swap(false, Ordering::Relaxed) => {
                        reconnected.send_modify(|n| *n += 1);
                    }
                    _ => {}
                }
                std::future::ready(())
            })
            .connection_timeout(Duration::from_secs(5))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connect(servers)
            .await
            .map_err(|source| BusError::Connect { url: url.to_owned(), source })?;
        // First contact: fail fast rather than hang when nothing listens.
        tokio::time::timeout(Duration::from_secs(10), client.flush())
            .await
            .map_err(|_| BusError::JetStream(format!("no answer from NATS at {url} within 10 s")))?
            .map_err(js_err)?;
        let js = jetstream::new(client.clone());
        Ok(Self { client, js, names, partitions: partitions.max(1), replicas: 1, reconnects })
    }

    /// The same bus, creating streams with `replicas` replicas (`TURNLOG_STREAM_REPLICAS`).
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Changes each time the client reconnects after losing its connection. A restarted
    /// nats-server has forgotten every ephemeral consumer; async-nats' ordered consumer
    /// notices only after about 15 s of retries, so readers watch this and start over.
    pub fn reconnects(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reconnects.clone()
    }

    pub fn partition_of(&self, session: SessionId) -> u32 {
        partition_of(session, self.partitions)
    }

    /// Creates the streams and the turn-lease bucket with [`Bus::replicas`] replicas, or
    /// verifies that existing ones carry the expected subjects (and warns, naming `turnlog
    /// migrate --bus`, about one with fewer replicas). `append_max_age` None keeps appends
    /// forever (rebuildable).
    pub async fn ensure_topology(&self, append_max_age: Option<Duration>) -> Result<(), BusError> {
        for config in self.topology(append_max_age) {
            let (name, want) = (config.name.clone(), config.num_replicas);
            let have = self.ensure_stream(config).await?;
            if have < want {
                tracing::warn!(stream = %name, have, want, "{}", replicas_warning(&name, have, want));
            }
        }
        Ok(())
    }

    /// The four streams' configs, in order: TURNLOG_APPEND, TURNLOG_EVENTS, TURNLOG_DEAD and
    /// the lease bucket's backing stream `KV_<bucket>`.
    fn topology(&self, append_max_age: Option<Duration>) -> [stream::Config; 4] {
        let n = &self.names;
        let num_replicas = self.replicas;
        let log_stream = |name: String, subject: String, max_age: Duration| stream::Config {
            name,
            subjects: vec![subject],
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            duplicate_window: DUPLICATE_WINDOW,
            max_age,
            num_replicas,
            ..Default::default()
        };
        let p = n.prefix();
        // The KV bucket through its backing stream: on nats-server 2.9 async-nats'
        // create_key_value cannot parse the server's account reply.
        let bucket = n.turns_bucket();
        [
            log_stream(n.append_stream(), format!("{p}.append.>"), append_max_age.unwrap_or_default()),
            log_stream(n.events_stream(), format!("{p}.events.>"), Duration::ZERO),
            log_stream(n.dead_stream(), format!("{p}.dead.>"), Duration::ZERO),
            stream::Config {
                name: format!("KV_{bucket}"),
                subjects: vec![format!("$KV.{bucket}.>")],
                max_messages_per_subject: 1,
                max_age: TURN_LEASE_TTL,
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::New,
                storage: stream::StorageType::File,
                duplicate_window: Duration::from_secs(2),
                num_replicas,
                ..Default::default()
            },
        ]
    }

    /// Creates the stream unless it exists, checks its subjects, and returns its replicas.
    async fn ensure_stream(&self, config: stream::Config) -> Result<usize, BusError> {
        let (name, expected) = (config.name.clone(), config.subjects.clone());
        // Services starting together race to create the streams; the loser's create fails
        // ("subjects overlap"), and a second look finds the winner's stream.
        let mut attempt = 0;
        let mut s = loop {
            match self.js.get_or_create_stream(config.clone()).await {
                Ok(s) => break s,
                Err(e) if attempt < 5 => {
                    tracing::debug!(stream = %name, error = %e, "stream create raced; retrying");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                // "replicas > 1 not supported in non-clustered mode", "insufficient resources".
                Err(e) if config.num_replicas > 1 => {
                    return Err(BusError::JetStream(format!(
                        "creating stream {name} with {} replicas (TURNLOG_STREAM_REPLICAS): {e}",
                        config.num_replicas
                    )))
                }
                Err(e) => return Err(js_err(e)),
            }
        };
        let info = s.info().await.map_err(js_err)?;
        let found = info.config.subjects.clone();
        if found != expected {
            return Err(BusError::Mismatch { name, found, expected });
        }
        Ok(info.config.num_replicas.max(1))
    }

    /// `turnlog migrate --bus`: brings each of the four streams to [`Bus::replicas`] with a
    /// stream update of its own config (the KV bucket's backing stream too: async-nats'
    /// `update_key_value` asks `query_account`, which fails on nats-server 2.9), creates
    /// any that is missing, and says what it did to each, in topology order.
    pub async fn migrate_replicas(
        &self,
        append_max_age: Option<Duration>,
    ) -> Result<Vec<ReplicaChange>, BusError> {
        let want = self.replicas;
        let mut changes = Vec::new();
        for config in self.topology(append_max_age) {
            let name = config.name.clone();
            let existing = match self.js.get_stream(&name).await {
                Ok(mut s) => Some(s.info().await.map_err(js_err)?.config.clone()),
                Err(e) => match e.kind() {
                    jetstream::context::GetStreamErrorKind::JetStream(j)
                        if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                    {
                        None
                    }
                    _ => return Err(BusError::JetStream(format!("{name}: {e}"))),
                },
            };
            let before = match existing {
                Some(mut current) => {
                    let have = current.num_replicas.max(1);
                    if have != want {
                        current.num_replicas = want;
                        self.js.update_stream(&current).await.map_err(|e| {
                            BusError::JetStream(format!("{name}: replicas {have} → {want}: {e}"))
                        })?;
                    }
                    Some(have)
                }
                None => {
                    self.ensure_stream(config).await?;
                    None
                }
            };
            changes.push(ReplicaChange { stream: name, before, after: want });
        }
        Ok(changes)
    }

    /// The turn-lease bucket (created by [`Bus::ensure_topology`]).
    pub async fn turn_leases(&self) -> Result<jetstream::kv::Store, BusError> {
        self.js.get_key_value(self.names.turns_bucket()).await.map_err(js_err)
    }

    /// Publishes a request to TURNLOG_APPEND and waits for JetStream's PubAck.
    pub async fn publish_append(
        &self,
        req: &AppendRequest,
        reply_to: Option<&str>,
    ) -> Result<jetstream::publish::PublishAck, BusError> {
        let body = serde_json::to_vec(req).map_err(js_err)?;
        self.publish_append_raw(req.session_id, &req.request_id.to_string(), Bytes::from(body), reply_to)
            .await
    }

    /// Publishes already-serialized request bytes (also how poison is injected in tests).
    pub async fn publish_append_raw(
        &self,
        session: SessionId,
        msg_id: &str,
        body: Bytes,
        reply_to: Option<&str>,
    ) -> Result<jetstream::publish::PublishAck, BusError> {
        let subject = self.names.append_subject(self.partition_of(session), session);
        let traceparent = crate::trace::current_traceparent();
        let msg = append_message(body, msg_id, reply_to, traceparent.as_deref());
        let ack = self.js.send_publish(subject, msg).await.map_err(js_err)?;
        ack.await.map_err(js_err)
    }

    /// Publishes an append request until it is acknowledged or `deadline` passes: while
    /// JetStream elects a new stream leader (4–9 s after a node dies) a publish finds no
    /// responder, and the same `Nats-Msg-Id` sent again is stored once (DESIGN §6).
    async fn publish_append_until(
        &self,
        req: &AppendRequest,
        reply_to: Option<&str>,
        deadline: tokio::time::Instant,
    ) -> Result<jetstream::publish::PublishAck, String> {
        let body = Bytes::from(serde_json::to_vec(req).map_err(|e| e.to_string())?);
        let subject = self.names.append_subject(self.partition_of(req.session_id), req.session_id);
        let msg_id = req.request_id.to_string();
        let traceparent = crate::trace::current_traceparent();
        let mut republished = 0;
        loop {
            let msg = append_message(body.clone(), &msg_id, reply_to, traceparent.as_deref());
            let publish = async {
                let ack = self.js.send_publish(subject.clone(), msg).await?;
                ack.await
            };
            let error = match tokio::time::timeout_at(deadline, publish).await {
                Ok(Ok(ack)) => {
                    if republished > 0 {
                        tracing::info!(request_id = %req.request_id, republished, "append acknowledged after republishing");
                    }
                    return Ok(ack);
                }
                Ok(Err(e)) if is_transient(e.kind()) => e.to_string(),
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => "no PubAck before the deadline".to_owned(),
            };
            if tokio::time::Instant::now() + REPUBLISH_EVERY >= deadline {
                return Err(error);
            }
            if republished == 0 {
                tracing::warn!(request_id = %req.request_id, error, "append not acknowledged; republishing until the deadline");
            }
            republished += 1;
            tokio::time::sleep(REPUBLISH_EVERY).await;
        }
    }
}

/// An append request as published: its body, its id for JetStream's dedup, and the headers
/// naming where the writer replies and the producer's trace context.
pub fn append_message(
    body: Bytes,
    msg_id: &str,
    reply_to: Option<&str>,
    traceparent: Option<&str>,
) -> PublishMessage {
    let mut msg = PublishMessage::build().payload(body).message_id(msg_id);
    if let Some(r) = reply_to {
        msg = msg.header(REPLY_HEADER, r);
    }
    if let Some(t) = traceparent {
        msg = msg.header(crate::trace::TRACEPARENT, t);
    }
    msg
}

/// How often a producer republishes an unacknowledged append.
const REPUBLISH_EVERY: Duration = Duration::from_millis(250);

/// Publish failures that pass by themselves: no responder (async-nats's "stream not found":
/// a leader election, or nats-server restarting), a lost connection, a late PubAck, and
/// errors the server puts in the PubAck (such as a stream without a quorum).
fn is_transient(kind: jetstream::context::PublishErrorKind) -> bool {
    use jetstream::context::PublishErrorKind as K;
    matches!(kind, K::StreamNotFound | K::TimedOut | K::BrokenPipe | K::Other)
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

#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// NATS (or the writer behind it) could not take the request in time; retrying with
    /// the same request id is safe.
    #[error("the bus could not take the request: {0}")]
    Unavailable(String),
    /// Published, but no outcome arrived before the deadline; resending the same request
    /// id is always safe.
    #[error("outcome unknown after {0:?}")]
    OutcomeUnknown(Duration),
}

/// Appends through the writer and waits for the outcome: subscribe to an inbox, publish
/// with the reply header, await the PubAck, await the outcome until the deadline. When the
/// PubAck says duplicate, or the reply does not come, the outcome is looked up in
/// `request_outcomes` until found or the deadline passes.
pub async fn append_and_wait(
    bus: &Bus,
    pool: &PgPool,
    req: &AppendRequest,
    timeout: Duration,
) -> Result<Outcome, AppendError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let inbox = bus.client.new_inbox();
    let mut replies =
        bus.client.subscribe(inbox.clone()).await.map_err(|e| AppendError::Unavailable(e.to_string()))?;

    let ack = bus
        .publish_append_until(req, Some(&inbox), deadline)
        .await
        .map_err(|e| AppendError::Unavailable(format!("not acknowledged within {timeout:?}: {e}")))?;
    if !ack.duplicate {
        use futures::StreamExt;
        while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, replies.next()).await {
            if let Ok(outcome) = serde_json::from_slice::<Outcome>(&msg.payload) {
                if outcome.request_id == req.request_id {
                    return Ok(outcome);
                }
            }
        }
    }
    // The reply went to an earlier sender (duplicate) or was lost: the database knows —
    // unless the request's session was deleted since ([`SESSION_DELETED`]).
    loop {
        match crate::read::recorded_outcome(pool, req.request_id).await {
            // A delete is answered once its session's messages are gone (as the writer's
            // reply is), so that nothing of the session is left behind it.
            Ok(Some(outcome)) if req.op == Op::Delete => {
                if let Ok(false) = crate::read::purge_pending(pool, req.session_id).await {
                    return Ok(outcome);
                }
            }
            Ok(Some(outcome)) => return Ok(outcome),
            Ok(None) if removed_from_stream(bus, ack.sequence).await => {
                return Ok(Outcome {
                    request_id: req.request_id,
                    status: OutcomeStatus::Rejected,
                    seq: None,
                    reason: Some(SESSION_DELETED.to_owned()),
                });
            }
            Ok(None) | Err(_) => {}
        }
        if tokio::time::Instant::now() + Duration::from_millis(25) > deadline {
            return Err(AppendError::OutcomeUnknown(timeout));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Whether TURNLOG_APPEND message `seq` is gone. Only a deleted session's purge removes
/// messages while they can still be resent (the stream keeps every message at least as long
/// as its duplicate window), and it removes only messages already applied.
async fn removed_from_stream(bus: &Bus, seq: u64) -> bool {
    let Ok(stream) = bus.js.get_stream_no_info(bus.names.append_stream()).await else { return false };
    matches!(stream.get_raw_message(seq).await, Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound)
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
    fn names_follow_the_prefix() {
        let n = BusNames::new("turnlog").unwrap();
        assert_eq!(n.append_stream(), "TURNLOG_APPEND");
        assert_eq!(n.turns_bucket(), "TURNLOG_TURNS");
        let s: SessionId = "0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0a".parse().unwrap();
        assert_eq!(n.append_subject(0, s), format!("turnlog.append.0.{s}"));
        assert_eq!(n.dead_subject("bad_json", None), "turnlog.dead.bad_json.none");
        assert!(BusNames::new("Bad.Prefix").is_err());
        assert!(BusNames::new("").is_err());
    }

    #[test]
    fn replica_reports_name_the_stream_the_counts_and_the_command() {
        let change = |before, after| ReplicaChange { stream: "TURNLOG_APPEND".into(), before, after };
        assert_eq!(change(Some(1), 3).to_string(), "TURNLOG_APPEND: replicas 1 → 3");
        assert_eq!(change(Some(3), 1).to_string(), "TURNLOG_APPEND: replicas 3 → 1");
        assert_eq!(change(Some(3), 3).to_string(), "TURNLOG_APPEND: replicas 3 (unchanged)");
        assert_eq!(change(None, 3).to_string(), "TURNLOG_APPEND: created with replicas 3");
        let warning = replicas_warning("KV_TURNLOG_TURNS", 1, 3);
        assert_eq!(
            warning,
            "stream KV_TURNLOG_TURNS has 1 replica(s) but TURNLOG_STREAM_REPLICAS is 3; \
             run `turnlog migrate --bus` to change it"
        );
    }

    #[test]
    fn partitions_are_stable_and_spread() {
        let ids: Vec<SessionId> = (0..1000).map(|_| SessionId::new()).collect();
        let mut counts = [0u32; 4];
        for id in &ids {
            let p = partition_of(*id, 4);
            assert_eq!(p, partition_of(*id, 4));
            counts[p as usize] += 1;
        }
        assert!(counts.iter().all(|c| *c > 150), "{counts:?}");
        assert_eq!(partition_of(ids[0], 1), 0);
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
        let request = AppendRequest::delete(session, "alice");
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
        let mut r = AppendRequest::append(
            s,
            "alice",
            Uuid::nil(),
            &turnlog_core::EventBody::TurnFailed(turnlog_core::events::TurnFailed::default()),
        );
        r.expect = Some(Expect { compacted_through: None });
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["op"], "append");
        assert_eq!(v["kind"], "turn_failed");
        assert_eq!(v["expect"], serde_json::json!({"compacted_through": null}));
        assert_eq!(serde_json::from_value::<AppendRequest>(v).unwrap(), r);
    }

    #[test]
    fn nul_is_found_anywhere() {
        assert!(has_nul(&serde_json::json!({"a": ["x\0"]})));
        assert!(has_nul(&serde_json::json!({"a\0": 1})));
        assert!(!has_nul(&serde_json::json!({"a": ["x", 1, null]})));
    }

    #[test]
    fn json_len_counts_escapes() {
        for text in ["plain", "\"quoted\" \\ line\n", "\u{1}\u{1b}[0m", "é ✓"] {
            assert_eq!(json_len(text), serde_json::to_vec(text).unwrap().len(), "{text:?}");
        }
        assert_eq!(json_len("\u{1}"), 8, "a control character is six bytes, plus the quotes");
        let payload = serde_json::json!({"partial": "\"".repeat(1000), "n": [1, 2.5, null]});
        assert_eq!(json_len(&payload), serde_json::to_vec(&payload).unwrap().len());
        assert!(json_len(&payload) > 2000);
    }
}
