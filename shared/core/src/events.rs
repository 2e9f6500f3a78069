//! The event log's vocabulary: every kind a session's log can hold, with typed payloads.
//! Payloads are stored as the producer sent them; decoding tolerates unknown fields and
//! missing optional ones, so old rows keep decoding as kinds gain fields.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{AttemptId, EventId};
use crate::request_body::RequestParams;

/// The one list of event kinds. A row: the variant (of [`EventKind`] and of [`EventBody`]),
/// the wire name (stored, and sent on the bus — never changed), the payload type (a struct
/// with a `Default`), and how the kind reaches the model ([`Projection`]). The enums,
/// [`EventKind::ALL`], the names, the projection and the payload's decode and encode all
/// come from here; adding a kind is adding a row and its payload, and then the compiler
/// asks each projection how the new kind renders (both match every kind).
macro_rules! event_kinds {
    ($($kind:ident = $name:literal, $payload:ident, $projection:ident;)+) => {
        /// The kinds of event. Kinds are added, never changed.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum EventKind {
            $(#[serde(rename = $name)] $kind,)+
        }

        impl EventKind {
            pub const ALL: [EventKind; [$($name),+].len()] = [$(EventKind::$kind),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(EventKind::$kind => $name,)+
                }
            }

            /// How events of this kind reach the model's context (DESIGN §3).
            pub fn projection(self) -> Projection {
                match self {
                    $(EventKind::$kind => Projection::$projection,)+
                }
            }
        }

        /// An event's typed payload; the variant is the kind.
        #[derive(Debug, Clone, PartialEq)]
        pub enum EventBody {
            $($kind($payload),)+
        }

        impl EventBody {
            pub fn kind(&self) -> EventKind {
                match self {
                    $(EventBody::$kind(_) => EventKind::$kind,)+
                }
            }

            /// Decodes a stored payload. `seq` only labels the error (0 before a seq is assigned).
            pub fn decode(kind: EventKind, payload: &Value, seq: i64) -> Result<Self, DecodeError> {
                fn de<T: serde::de::DeserializeOwned>(v: &Value) -> serde_json::Result<T> {
                    T::deserialize(v)
                }
                let body = match kind {
                    $(EventKind::$kind => de(payload).map(EventBody::$kind),)+
                };
                body.map_err(|source| DecodeError::Payload { kind, seq, source })
            }

            /// The payload as JSON (the shape producers send and the log stores).
            pub fn to_payload(&self) -> Value {
                let v = match self {
                    $(EventBody::$kind(p) => serde_json::to_value(p),)+
                };
                // Plain structs of strings, numbers and JSON values always serialize.
                v.unwrap_or(Value::Null)
            }

            /// Whether the event is tool traffic (DESIGN §14): a `tool_execution`, or a step's
            /// `assistant_turn` that asks for tools. It reaches the model only within its turn.
            pub fn is_tool_traffic(&self) -> bool {
                match self {
                    EventBody::AssistantTurn(t) => t.asks_for_tools(),
                    other => other.kind().projection() == Projection::Tool,
                }
            }

            /// An event of `kind` with every payload field at its default (empty texts, no
            /// attachments): how property tests make one of every kind in [`EventKind::ALL`].
            pub fn default_of(kind: EventKind) -> Self {
                match kind {
                    $(EventKind::$kind => EventBody::$kind($payload::default()),)+
                }
            }
        }
    };
}

event_kinds! {
    SessionStarted = "session_started", SessionStarted, Never;
    UserMessage = "user_message", UserMessage, Each;
    AssistantTurn = "assistant_turn", AssistantTurn, Answer;
    ToolExecution = "tool_execution", ToolExecution, Tool;
    TurnMemory = "turn_memory", TurnMemory, Each;
    CompactionApplied = "compaction_applied", CompactionApplied, Summary;
    PendingState = "pending_state", PendingState, LivePending;
    PermissionRequest = "permission_request", PermissionRequest, Never;
    PermissionResolved = "permission_resolved", PermissionResolved, Never;
    TurnFailed = "turn_failed", TurnFailed, Each;
    MemoryExtracted = "memory_extracted", MemoryExtracted, Never;
}

/// How the events of a kind reach the model's context (DESIGN §3): the one answer the
/// projection (`llm_context`) and the budget's count of it (`budget`) both follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Projection {
    /// The model never sees these.
    Never,
    /// Every one after the newest compaction's boundary.
    Each,
    /// Every one after the boundary; it also answers its turn, so no pending before it is
    /// live any more.
    Answer,
    /// Only the live one: the newest, unless an answer follows it or the newest compaction
    /// covers it.
    LivePending,
    /// Only the newest, as the summary that stands for every event up to its boundary.
    Summary,
    /// Tool traffic (DESIGN §14): only within its turn — after the newest user message,
    /// until a later one exists. A step's `assistant_turn` that asks for tools follows
    /// the same rule though its kind is an `Answer`.
    Tool,
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("unknown event kind {0:?}")]
pub struct UnknownKind(pub String);

impl FromStr for EventKind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, UnknownKind> {
        EventKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownKind(s.chars().take(64).collect()))
    }
}

/// An event kind as another build may have written it (a stored row, an append request):
/// one this build knows, or a newer build's name, kept as it is rather than refused. Reads
/// and writes as the name (read as a string and looked up once, not tried variant by
/// variant as `untagged` would).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum KindName {
    Known(EventKind),
    Unknown(String),
}

impl KindName {
    pub fn as_str(&self) -> &str {
        match self {
            Self::Known(kind) => kind.as_str(),
            Self::Unknown(name) => name,
        }
    }
}

impl From<EventKind> for KindName {
    fn from(kind: EventKind) -> Self {
        Self::Known(kind)
    }
}

/// Looked up once: a name this build does not know is kept.
impl From<String> for KindName {
    fn from(name: String) -> Self {
        match name.parse() {
            Ok(kind) => Self::Known(kind),
            Err(_) => Self::Unknown(name),
        }
    }
}

impl From<&str> for KindName {
    fn from(name: &str) -> Self {
        name.parse().map_or_else(|_| Self::Unknown(name.to_owned()), Self::Known)
    }
}

impl From<KindName> for String {
    fn from(kind: KindName) -> String {
        match kind {
            KindName::Known(kind) => kind.as_str().to_owned(),
            KindName::Unknown(name) => name,
        }
    }
}

impl TryFrom<&KindName> for EventKind {
    type Error = UnknownKind;
    fn try_from(kind: &KindName) -> Result<Self, UnknownKind> {
        match kind {
            KindName::Known(kind) => Ok(*kind),
            KindName::Unknown(name) => Err(UnknownKind(name.chars().take(64).collect())),
        }
    }
}

impl PartialEq<EventKind> for KindName {
    fn eq(&self, other: &EventKind) -> bool {
        matches!(self, Self::Known(kind) if kind == other)
    }
}

impl fmt::Display for KindName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Longest session title, in characters (what the API accepts; an import cuts longer ones).
pub const MAX_TITLE_CHARS: usize = 512;

// ---- payloads -------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SessionStarted {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// Set on a fork: the branch log it continues (DESIGN §10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkPoint>,
}

/// Where a fork branches off: its parent and the last seq of the parent's branch log it
/// inherits. The fork's own events start at `through_seq + 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkPoint {
    pub session_id: crate::ids::SessionId,
    pub through_seq: i64,
}

/// An attached image: a stored file by id, never its bytes (DESIGN §12). `width` and
/// `height` are the pixels the model is sent (after scaling), which its cost is counted by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRef {
    pub id: String,
    pub mime: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
}

/// An attached document: its markdown (what the model reads) and a reference to the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Document {
    pub id: String,
    pub mime: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The size of the uploaded file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// The document converted to markdown once, at upload.
    pub markdown: String,
}

/// Where an imported message came from (`POST /v1/import`): the export it was in
/// (`chatgpt`, `sharegpt`, `turnlog`), its id there and its original time, when the export
/// kept one. The event's own `created_at` is when it was imported (§2); the UI shows this.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Imported {
    pub source: String,
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<chrono::DateTime<chrono::Utc>>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct UserMessage {
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub category: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_hint: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<ImageRef>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub documents: Vec<Document>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imported: Option<Imported>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockType {
    Text,
    Reasoning,
    ToolCall,
    Meta,
    /// A block type added after this code was written: shown as-is, never projected.
    #[serde(other)]
    Other,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: BlockType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct UiPart {
    #[serde(default)]
    pub blocks: Vec<Block>,
}

/// An OpenAI-style message content: a string, or an array of typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<Value>),
}

impl MessageContent {
    /// The text of the content; text parts joined in order, other parts skipped.
    pub fn text(&self) -> String {
        match self {
            MessageContent::Text(s) => s.clone(),
            MessageContent::Parts(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
        }
    }
}

/// The assistant message as the model produced it (what the model is shown later).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LlmMessage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// The tools a step asked for (DESIGN §14), in the model's order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// A tool call as the model made it: its call id (the id everywhere: the
/// `tool_execution`, the APIs), the tool's name, and `arguments`, the JSON text the model
/// produced, kept byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LlmPart {
    #[serde(default)]
    pub message: LlmMessage,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input_tokens: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AssistantTurn {
    #[serde(default)]
    pub ui: UiPart,
    #[serde(default)]
    pub llm: LlmPart,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_id: Option<AttemptId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// The request this attempt sent (§11); an imported answer has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RecordedRequest>,
    /// Set on an answer brought in by an import: no attempt of this log produced it, so the
    /// distiller and the post-turn compaction leave it alone. (Boxed: every event body is
    /// as large as its largest kind.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imported: Option<Box<Imported>>,
}

/// Whether a stored `assistant_turn` payload is a step that asks for tools (DESIGN §14),
/// read without decoding it: the workers that act on a turn's end skip those.
pub fn payload_asks_for_tools(payload: &Value) -> bool {
    payload.pointer("/llm/message/tool_calls").and_then(Value::as_array).is_some_and(|c| !c.is_empty())
}

impl AssistantTurn {
    /// Whether this is a step that asks for tools (DESIGN §14) rather than a turn's answer.
    pub fn asks_for_tools(&self) -> bool {
        !self.llm.message.tool_calls.is_empty()
    }

    /// The text the user saw: every text block, in order.
    pub fn ui_text(&self) -> String {
        self.ui
            .blocks
            .iter()
            .filter(|b| b.kind == BlockType::Text)
            .filter_map(|b| b.text.as_deref())
            .collect::<Vec<_>>()
            .join("")
    }
}

/// A tool call's result (DESIGN §14). `output` is what the model is sent (capped, see
/// `limits::MAX_TOOL_OUTPUT_BYTES`); `status` is `ok`, `error`, `denied`, `cancelled` or
/// `timeout`; `source` is `client` or `mcp:<label>`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ToolExecution {
    pub call_id: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_error: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_digest: Option<String>,
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub what: String,
    pub why: String,
}

/// The distilled residue of one turn: what the model needs of it in later turns.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TurnMemory {
    pub turn_seq: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files_changed: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<Failure>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key_findings: Vec<String>,
}

impl TurnMemory {
    pub fn is_empty(&self) -> bool {
        self.files_changed.is_empty() && self.failures.is_empty() && self.key_findings.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CompactionApplied {
    pub summary: String,
    pub replaces_through_seq: i64,
    #[serde(default)]
    pub facts_extracted: Vec<uuid::Uuid>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PendingReason {
    #[default]
    Interrupted,
    Stopped,
}

/// A checkpoint of an answer still streaming (or cut off): the whole partial so far.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PendingState {
    pub partial: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_id: Option<AttemptId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<PendingReason>,
    /// The request of this attempt, on its first checkpoint and on a final one (§11).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RecordedRequest>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PermissionRequest {
    pub id: String,
    pub call_id: String,
    pub tool: String,
    #[serde(default)]
    pub args: Value,
    pub danger_level: String,
    #[serde(default)]
    pub rationale: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PermissionResolved {
    pub id: String,
    pub decision: String,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TurnFailed {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_id: Option<AttemptId>,
    /// The request of this attempt; absent when it failed before anything was sent (§11).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RecordedRequest>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtractedMemory {
    pub id: uuid::Uuid,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryExtracted {
    pub turn_seq: i64,
    #[serde(default)]
    pub memories: Vec<ExtractedMemory>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

// ---- the audited request (DESIGN §11) -------------------------------------------------
// Part of the outcome payloads above; the functions that build and rebuild it are in
// `audit`, which re-exports these.

/// The request one attempt sent, as its first checkpoint and its outcome event record it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedRequest {
    /// The last seq of the branch log the projection read.
    pub through_seq: i64,
    pub model: String,
    /// Every body field not derived from the log.
    pub params: RequestParams,
    pub system: SystemPrompt,
    /// SHA-256 (lowercase hex) of the tools' JSON text when the request offered tools
    /// (DESIGN §14); `params.tools` then holds the text only when the log cannot give it
    /// back (see `audit::tools_record`), as with the system prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools_sha256: Option<String>,
    /// How long tool traffic stayed in the history the request was built from (DESIGN
    /// §14); absent for `turn`, the default.
    #[serde(default, skip_serializing_if = "crate::llm_context::ToolHistory::is_turn")]
    pub tool_history: crate::llm_context::ToolHistory,
    /// The per-turn extras sent after the history (they are nowhere else in the log).
    #[serde(default)]
    pub extras: Extras,
    /// The request's size as the budget counted it (system prompt, history, extras).
    pub tokens: u32,
    /// SHA-256 (lowercase hex) of the exact body bytes sent.
    pub body_sha256: String,
}

/// The system prompt of a request: its hash always, its text only when the log cannot
/// give it back (see `audit::system_prompt_record`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SystemPrompt {
    pub sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// Per-turn material that is not stored in the log but in the request that carried it
/// (the message it becomes is `request`'s).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extras {
    /// Today's date as the model should read it, e.g. "2026-11-29 (Sunday)".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub date: Option<String>,
    /// Recalled long-term memories, most relevant first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memories: Vec<String>,
}

impl Extras {
    pub fn is_empty(&self) -> bool {
        self.date.is_none() && self.memories.is_empty()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(transparent)]
    UnknownKind(#[from] UnknownKind),
    #[error("event seq {seq}: {kind} payload does not decode: {source}")]
    Payload {
        kind: EventKind,
        seq: i64,
        #[source]
        source: serde_json::Error,
    },
}

impl EventBody {
    /// Decodes with the kind given as text (as stored, or as sent on the bus).
    pub fn decode_str(kind: &str, payload: &Value, seq: i64) -> Result<Self, DecodeError> {
        Self::decode(kind.parse()?, payload, seq)
    }

    /// The audited request an outcome event (or first checkpoint) carries.
    pub fn recorded_request(&self) -> Option<&RecordedRequest> {
        match self {
            EventBody::AssistantTurn(t) => t.request.as_ref(),
            EventBody::PendingState(p) => p.request.as_ref(),
            EventBody::TurnFailed(f) => f.request.as_ref(),
            _ => None,
        }
    }
}

/// One committed event of a session's log.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub seq: i64,
    pub event_id: EventId,
    pub created_at: DateTime<Utc>,
    pub body: EventBody,
}

impl Event {
    pub fn kind(&self) -> EventKind {
        self.body.kind()
    }

    /// Decodes a stored row; the error names the kind and the seq.
    pub fn decode(
        seq: i64,
        event_id: EventId,
        kind: &str,
        payload: &Value,
        created_at: DateTime<Utc>,
    ) -> Result<Self, DecodeError> {
        Ok(Self { seq, event_id, created_at, body: EventBody::decode_str(kind, payload, seq)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_kind_round_trips_its_name() {
        for k in EventKind::ALL {
            assert_eq!(k.as_str().parse::<EventKind>().unwrap(), k);
            assert_eq!(serde_json::to_value(k).unwrap(), json!(k.as_str()));
        }
        assert!("user_msg".parse::<EventKind>().is_err());
    }

    #[test]
    fn a_kind_name_keeps_a_newer_builds_kind_as_written() {
        for k in EventKind::ALL {
            let name = KindName::from(k.as_str());
            assert_eq!(name, k);
            assert_eq!(serde_json::to_value(&name).unwrap(), json!(k.as_str()));
        }
        let newer: KindName = serde_json::from_value(json!("tool_call")).unwrap();
        assert_eq!(newer, KindName::Unknown("tool_call".into()));
        assert_eq!(serde_json::to_value(&newer).unwrap(), json!("tool_call"));
        assert!(EventKind::try_from(&newer).is_err());
    }

    #[test]
    fn unknown_fields_and_missing_optionals_are_tolerated() {
        let body =
            EventBody::decode(EventKind::UserMessage, &json!({"text": "hi", "future_field": {"x": 1}}), 3)
                .unwrap();
        let EventBody::UserMessage(m) = body else { panic!("wrong variant") };
        assert_eq!(m.text, "hi");
        assert!(m.images.is_empty() && m.documents.is_empty() && m.category.is_none());

        let turn = EventBody::decode(EventKind::AssistantTurn, &json!({}), 4).unwrap();
        assert!(matches!(turn, EventBody::AssistantTurn(_)));

        let blocks = json!({"ui": {"blocks": [{"type": "hologram", "text": "?"}]}});
        let EventBody::AssistantTurn(t) = EventBody::decode(EventKind::AssistantTurn, &blocks, 5).unwrap()
        else {
            panic!("wrong variant")
        };
        assert_eq!(t.ui.blocks[0].kind, BlockType::Other);
    }

    #[test]
    fn decode_error_names_kind_and_seq() {
        let err = EventBody::decode(EventKind::UserMessage, &json!({"text": 5}), 42).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("user_message") && msg.contains("42"), "{msg}");
        let err = EventBody::decode_str("nope", &json!({}), 1).unwrap_err();
        assert!(err.to_string().contains("nope"));
    }

    #[test]
    fn payloads_round_trip() {
        let body = EventBody::PendingState(PendingState {
            partial: "half an answ".into(),
            attempt_id: Some("a1".into()),
            reason: Some(PendingReason::Stopped),
            request: None,
        });
        let v = body.to_payload();
        assert_eq!(v, json!({"partial": "half an answ", "attempt_id": "a1", "reason": "stopped"}));
        assert_eq!(EventBody::decode(EventKind::PendingState, &v, 1).unwrap(), body);
    }

    #[test]
    fn llm_content_accepts_string_or_parts() {
        let t: LlmMessage = serde_json::from_value(json!({"role": "assistant", "content": "x"})).unwrap();
        assert_eq!(t.content.unwrap().text(), "x");
        let t: LlmMessage = serde_json::from_value(
            json!({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        )
        .unwrap();
        assert_eq!(t.content.unwrap().text(), "ab");
    }
}
