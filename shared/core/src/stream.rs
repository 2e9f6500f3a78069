//! A turn's event stream (DESIGN §5, §7), typed once: what the ingress tells a client while a
//! turn runs (`meta`, `delta`, `reasoning`, `error`, exactly one `end`), the same on SSE and
//! on the bus between ingress copies; and how a turn ended, decided from its log for a client
//! that was not there to see its `end` ([`turn_end_from_log`]).

use std::fmt;

use serde::de::{self, Deserializer};
use serde::ser::{SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::events::{Event, EventBody, PendingReason, TurnFailed, Usage};
use crate::ids::{AttemptId, SessionId};

/// The message a `turn_failed` of a turn stopped by its user before any text holds.
pub const STOPPED_BEFORE_TEXT: &str = "stopped by the user before any text arrived";

/// One event of a turn's stream and its id, counted from 1 within the turn (the SSE `id:`,
/// a re-attach's `Last-Event-ID`). On the bus it is `{"id", "event", "data"}`.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamEvent {
    pub id: u64,
    pub event: TurnEvent,
}

impl StreamEvent {
    pub fn is_end(&self) -> bool {
        matches!(self.event, TurnEvent::End(_))
    }
}

impl Serialize for StreamEvent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("StreamEvent", 3)?;
        st.serialize_field("id", &self.id)?;
        st.serialize_field("event", self.event.name())?;
        st.serialize_field("data", &self.event.data())?;
        st.end()
    }
}

impl<'de> Deserialize<'de> for StreamEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Wire {
            id: u64,
            event: String,
            data: Value,
        }
        let w = Wire::deserialize(d)?;
        let event = TurnEvent::from_parts(&w.event, w.data).map_err(de::Error::custom)?;
        Ok(Self { id: w.id, event })
    }
}

/// What a turn tells its client, by SSE event name; its data is the variant's JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", content = "data", rename_all = "snake_case")]
pub enum TurnEvent {
    /// First, once.
    Meta(Meta),
    /// Answer text, as it arrives.
    Delta(Text),
    /// Reasoning text, as it arrives.
    Reasoning(Text),
    /// What failed, before the `end` of a turn that did not complete.
    Error(StreamError),
    /// A tool the model asks for (DESIGN §14), once its step is stored.
    ToolCall(ToolCallEvent),
    /// A tool's result, as it is recorded.
    ToolResult(ToolResultEvent),
    /// A server tool waits for the user's permission (DESIGN §14).
    Permission(PermissionEvent),
    /// Last, exactly once.
    End(TurnEnd),
}

impl TurnEvent {
    /// The SSE event name (serde's tag).
    pub fn name(&self) -> &'static str {
        match self {
            TurnEvent::Meta(_) => "meta",
            TurnEvent::Delta(_) => "delta",
            TurnEvent::Reasoning(_) => "reasoning",
            TurnEvent::Error(_) => "error",
            TurnEvent::ToolCall(_) => "tool_call",
            TurnEvent::ToolResult(_) => "tool_result",
            TurnEvent::Permission(_) => "permission",
            TurnEvent::End(_) => "end",
        }
    }

    /// The event's data as JSON. Written as text, its keys are in serde_json's map order
    /// (sorted), the bytes clients have always read.
    pub fn data(&self) -> Value {
        let data = match self {
            TurnEvent::Meta(m) => serde_json::to_value(m),
            TurnEvent::Delta(t) | TurnEvent::Reasoning(t) => serde_json::to_value(t),
            TurnEvent::Error(e) => serde_json::to_value(e),
            TurnEvent::ToolCall(c) => serde_json::to_value(c),
            TurnEvent::ToolResult(r) => serde_json::to_value(r),
            TurnEvent::Permission(p) => serde_json::to_value(p),
            TurnEvent::End(e) => serde_json::to_value(e),
        };
        // Plain structs with string keys: their JSON cannot fail.
        data.unwrap_or(Value::Null)
    }

    /// The event named `name` with data `data` (an SSE event's, or the bus's).
    pub fn from_parts(name: &str, data: Value) -> Result<Self, serde_json::Error> {
        let mut tagged = serde_json::Map::new();
        tagged.insert("event".into(), Value::String(name.to_owned()));
        tagged.insert("data".into(), data);
        serde_json::from_value(Value::Object(tagged))
    }
}

/// `meta`: the turn a stream follows. A live turn's names all four; a resent request's,
/// answered from the log, only the session and the user message; a stateless
/// pass-through's (`store: false`, no session) only the attempt and the model.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Meta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// The seq of the user message the turn answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_seq: Option<i64>,
    /// The attempt the turn runs (a response's id on the OpenAI-compatible routes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_id: Option<AttemptId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// `tool_call`: a call the model made (its id is the call id everywhere).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallEvent {
    pub call_id: String,
    pub name: String,
    /// The JSON text the model produced.
    pub arguments: String,
    /// `client` (the client runs it) or `mcp:<label>`.
    pub source: String,
}

/// `tool_result`: a call's result was recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolResultEvent {
    pub call_id: String,
    /// `ok`, `error`, `denied`, `cancelled` or `timeout`.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// `permission`: a server tool's call waits for the user's answer to the request `id`
/// (`POST /v1/sessions/{id}/permissions/{perm_id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PermissionEvent {
    pub id: String,
    pub call_id: String,
    /// The namespaced name, `<label>__<tool>`.
    pub tool: String,
    pub args: Value,
    pub danger_level: String,
}

/// What a paused turn waits for (`end.required`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Required {
    pub call_id: String,
    pub name: String,
    pub arguments: String,
    /// `tool` (a client tool's result) or `permission`.
    pub kind: String,
    /// The permission request to answer, for `kind: permission`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permission_id: Option<String>,
}

impl Required {
    pub fn tool(call: &crate::events::ToolCall) -> Self {
        Self {
            call_id: call.id.clone(),
            name: call.name.clone(),
            arguments: call.arguments.clone(),
            kind: "tool".into(),
            permission_id: None,
        }
    }

    /// A server tool's call waiting for the answer to permission request `id`.
    pub fn permission(call: &crate::events::ToolCall, id: &str) -> Self {
        Self { kind: "permission".into(), permission_id: Some(id.to_owned()), ..Self::tool(call) }
    }
}

/// `delta` and `reasoning`: a piece of text.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Text {
    pub text: String,
}

/// `error`: why a turn did not complete (the client's copy of its `turn_failed`, or of a
/// failure kept as a partial).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamError {
    pub code: FailureCode,
    pub message: String,
}

/// Why a turn failed: the `code` of its `turn_failed` and of its stream's `error`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FailureCode {
    /// Cut off (a shutdown, a lost lease) before any text arrived.
    Interrupted,
    /// Stopped by its user before any text arrived.
    Stopped,
    UpstreamError,
    UpstreamTimeout,
    ContextOverflow,
    /// The answer is over the log's per-event limit; it is kept as a partial.
    AnswerTooLarge,
    /// The session went away under the turn.
    NotFound,
    /// The turn's model calls reached `TURNLOG_MAX_TOOL_STEPS` and the last still asked
    /// for tools (DESIGN §14).
    TooManySteps,
    Unavailable,
    Internal,
    /// A code this build does not name (an import's, a newer copy's), kept as it is.
    Other(String),
}

impl FailureCode {
    pub fn as_str(&self) -> &str {
        match self {
            FailureCode::Interrupted => "interrupted",
            FailureCode::Stopped => "stopped",
            FailureCode::UpstreamError => "upstream_error",
            FailureCode::UpstreamTimeout => "upstream_timeout",
            FailureCode::ContextOverflow => "context_overflow",
            FailureCode::AnswerTooLarge => "answer_too_large",
            FailureCode::NotFound => "not_found",
            FailureCode::TooManySteps => "too_many_steps",
            FailureCode::Unavailable => "unavailable",
            FailureCode::Internal => "internal",
            FailureCode::Other(code) => code,
        }
    }
}

impl From<&str> for FailureCode {
    fn from(code: &str) -> Self {
        match code {
            "interrupted" => FailureCode::Interrupted,
            "stopped" => FailureCode::Stopped,
            "upstream_error" => FailureCode::UpstreamError,
            "upstream_timeout" => FailureCode::UpstreamTimeout,
            "context_overflow" => FailureCode::ContextOverflow,
            "answer_too_large" => FailureCode::AnswerTooLarge,
            "not_found" => FailureCode::NotFound,
            "too_many_steps" => FailureCode::TooManySteps,
            "unavailable" => FailureCode::Unavailable,
            "internal" => FailureCode::Internal,
            other => FailureCode::Other(other.to_owned()),
        }
    }
}

impl fmt::Display for FailureCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for FailureCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for FailureCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(FailureCode::from(String::deserialize(d)?.as_str()))
    }
}

/// How a turn ended, as its `end` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    /// Its answer is stored (`assistant_turn`).
    Completed,
    /// Stopped by its user: its partial is stored (`pending_state`, reason `stopped`), or
    /// its failure when no text had arrived.
    Stopped,
    /// Cut off with text: its partial is stored (`pending_state`).
    Interrupted,
    /// Without text, or without its outcome stored.
    Failed,
    /// Paused (DESIGN §14): its last step asked for client tools whose results are not
    /// recorded yet; `end.required` lists them.
    RequiresAction,
}

impl TurnStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnStatus::Completed => "completed",
            TurnStatus::Stopped => "stopped",
            TurnStatus::Interrupted => "interrupted",
            TurnStatus::Failed => "failed",
            TurnStatus::RequiresAction => "requires_action",
        }
    }
}

/// The event a turn's outcome is stored as, by seq: the `end`'s `assistant_seq`,
/// `pending_seq` or `failed_seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutcomeEvent {
    /// `assistant_turn`.
    Answer(i64),
    /// `pending_state` (a final partial, or the last checkpoint of a turn that died).
    Partial(i64),
    /// `turn_failed`.
    Failure(i64),
}

impl OutcomeEvent {
    pub fn seq(self) -> i64 {
        match self {
            OutcomeEvent::Answer(s) | OutcomeEvent::Partial(s) | OutcomeEvent::Failure(s) => s,
        }
    }
}

/// `end`: how the turn ended, and where its outcome is in the log. A live turn's carries
/// the session, the model and the duration (and the usage and finish reason when the model
/// told them); a resent request's, read from the log, the session, status and seq only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "EndWire", into = "EndWire")]
pub struct TurnEnd {
    /// Absent only for a stateless pass-through (`store: false`).
    pub session_id: Option<SessionId>,
    pub status: TurnStatus,
    /// None when the outcome could not be stored (or, read from the log, none is there).
    pub outcome: Option<OutcomeEvent>,
    pub usage: Option<Usage>,
    pub model: Option<String>,
    pub duration_ms: Option<u64>,
    /// On a turn whose answer stream reached its end: the model's finish reason (`null`
    /// when it gave none). Absent otherwise.
    pub finish_reason: Option<Option<String>>,
    /// What a `requires_action` turn waits for.
    pub required: Vec<Required>,
}

impl TurnEnd {
    pub fn new(session_id: Option<SessionId>, status: TurnStatus) -> Self {
        Self {
            session_id,
            status,
            outcome: None,
            usage: None,
            model: None,
            duration_ms: None,
            finish_reason: None,
            required: Vec::new(),
        }
    }

    /// Whether the model stopped at its output cap (`finish_reason: length`).
    pub fn hit_length(&self) -> bool {
        matches!(&self.finish_reason, Some(Some(f)) if f == "length")
    }
}

/// [`TurnEnd`] as JSON: its outcome is one of three fields.
#[derive(Serialize, Deserialize)]
struct EndWire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    session_id: Option<SessionId>,
    status: TurnStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    assistant_seq: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pending_seq: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    failed_seq: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    finish_reason: Option<Option<String>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    required: Vec<Required>,
}

/// A field that is present, `null` included (absent is the `default`).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

impl From<EndWire> for TurnEnd {
    fn from(w: EndWire) -> Self {
        let outcome = (w.assistant_seq.map(OutcomeEvent::Answer))
            .or(w.pending_seq.map(OutcomeEvent::Partial))
            .or(w.failed_seq.map(OutcomeEvent::Failure));
        Self {
            session_id: w.session_id,
            status: w.status,
            outcome,
            usage: w.usage,
            model: w.model,
            duration_ms: w.duration_ms,
            finish_reason: w.finish_reason,
            required: w.required,
        }
    }
}

impl From<TurnEnd> for EndWire {
    fn from(e: TurnEnd) -> Self {
        let (mut assistant_seq, mut pending_seq, mut failed_seq) = (None, None, None);
        match e.outcome {
            Some(OutcomeEvent::Answer(seq)) => assistant_seq = Some(seq),
            Some(OutcomeEvent::Partial(seq)) => pending_seq = Some(seq),
            Some(OutcomeEvent::Failure(seq)) => failed_seq = Some(seq),
            None => {}
        }
        Self {
            session_id: e.session_id,
            status: e.status,
            assistant_seq,
            pending_seq,
            failed_seq,
            usage: e.usage,
            model: e.model,
            duration_ms: e.duration_ms,
            finish_reason: e.finish_reason,
            required: e.required,
        }
    }
}

/// Whether a `turn_failed` is a stop by the user before any text. Its code says so; one
/// stored before the code existed (issue 39) said it only as [`STOPPED_BEFORE_TEXT`] with
/// code `interrupted`.
pub fn failure_is_stop(f: &TurnFailed) -> bool {
    match FailureCode::from(f.code.as_str()) {
        FailureCode::Stopped => true,
        FailureCode::Interrupted => f.message == STOPPED_BEFORE_TEXT,
        _ => false,
    }
}

/// How a turn ended, decided from its log: `events` are the turn's events after its user
/// message, in seq order (from the next user message on they are another turn's, and are
/// not read); one outcome event alone is a turn too. Its answer ends it `completed`;
/// otherwise its last partial (`stopped` when its reason says the user stopped it, else
/// `interrupted`, a checkpoint included: the copy running it died) or failure (`stopped`
/// when the user stopped it before any text, else `failed`) does; with none of them (the
/// copy died before its first checkpoint) it is `interrupted` with no outcome. The `end`
/// names the session, the status and the outcome's seq.
pub fn turn_end_from_log<'a>(session: SessionId, events: impl IntoIterator<Item = &'a Event>) -> TurnEnd {
    let mut end = TurnEnd::new(Some(session), TurnStatus::Interrupted);
    for e in events {
        let (status, outcome) = match &e.body {
            EventBody::UserMessage(_) => break,
            // A step that asks for tools pauses the turn until their results are recorded
            // (DESIGN §14); then the next step runs (or the copy running it died).
            EventBody::AssistantTurn(t) if t.asks_for_tools() => {
                end.required = t.llm.message.tool_calls.iter().map(Required::tool).collect();
                (TurnStatus::RequiresAction, OutcomeEvent::Answer(e.seq))
            }
            EventBody::ToolExecution(x) => {
                end.required.retain(|r| r.call_id != x.call_id);
                if end.status == TurnStatus::RequiresAction && end.required.is_empty() {
                    end.status = TurnStatus::Interrupted;
                    end.outcome = None;
                }
                continue;
            }
            EventBody::AssistantTurn(_) => {
                end.status = TurnStatus::Completed;
                end.outcome = Some(OutcomeEvent::Answer(e.seq));
                end.required.clear();
                return end;
            }
            EventBody::PendingState(p) if p.reason == Some(PendingReason::Stopped) => {
                (TurnStatus::Stopped, OutcomeEvent::Partial(e.seq))
            }
            EventBody::PendingState(_) => (TurnStatus::Interrupted, OutcomeEvent::Partial(e.seq)),
            EventBody::TurnFailed(f) if failure_is_stop(f) => {
                (TurnStatus::Stopped, OutcomeEvent::Failure(e.seq))
            }
            EventBody::TurnFailed(_) => (TurnStatus::Failed, OutcomeEvent::Failure(e.seq)),
            _ => continue,
        };
        end.status = status;
        end.outcome = Some(outcome);
    }
    end
}

/// The calls the current turn waits for (DESIGN §14): those of its last step asking for
/// tools that have no result yet. `events` run from at least the turn's user message (a
/// live tail does: compaction never cuts inside the turn in progress).
pub fn waiting_calls(events: &[Event]) -> Vec<crate::events::ToolCall> {
    let start = crate::llm_context::current_turn_start(events);
    let mut waiting: Vec<crate::events::ToolCall> = Vec::new();
    for e in events.iter().filter(|e| e.seq > start) {
        match &e.body {
            EventBody::AssistantTurn(t) => waiting = t.llm.message.tool_calls.clone(),
            EventBody::ToolExecution(x) => waiting.retain(|c| c.id != x.call_id),
            _ => {}
        }
    }
    waiting
}

/// How many model calls of the current turn asked for tools.
pub fn tool_steps(events: &[Event]) -> usize {
    let start = crate::llm_context::current_turn_start(events);
    events
        .iter()
        .filter(|e| e.seq > start && matches!(&e.body, EventBody::AssistantTurn(t) if t.asks_for_tools()))
        .count()
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use serde_json::json;

    use super::*;
    use crate::events::{AssistantTurn, PendingState, TurnMemory, UserMessage};
    use crate::ids::EventId;

    fn session() -> SessionId {
        SessionId("0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0a".parse().unwrap())
    }

    fn event(seq: i64, body: EventBody) -> Event {
        Event { seq, event_id: EventId::new(), created_at: Utc::now(), body }
    }

    fn failed(code: &str, message: &str) -> EventBody {
        EventBody::TurnFailed(TurnFailed { code: code.into(), message: message.into(), ..Default::default() })
    }

    fn pending(reason: Option<PendingReason>) -> EventBody {
        EventBody::PendingState(PendingState { partial: "Hel".into(), reason, ..Default::default() })
    }

    /// The bytes the ingress wrote before the stream was typed: `json!` data, sorted keys.
    #[test]
    fn the_wire_is_the_json_the_stream_always_had() {
        let s = session();
        let usage = Usage { input_tokens: 10, output_tokens: 2, cached_input_tokens: Some(8) };
        let end = TurnEnd {
            outcome: Some(OutcomeEvent::Answer(3)),
            usage: Some(usage),
            model: Some("m".into()),
            duration_ms: Some(1234),
            finish_reason: Some(None),
            ..TurnEnd::new(Some(s), TurnStatus::Completed)
        };
        let cases = [
            (
                TurnEvent::Meta(Meta {
                    session_id: Some(s),
                    user_seq: Some(2),
                    attempt_id: Some("a1".into()),
                    model: Some("m".into()),
                }),
                json!({"session_id": s, "user_seq": 2, "attempt_id": "a1", "model": "m"}),
            ),
            (
                TurnEvent::Meta(Meta { session_id: Some(s), user_seq: Some(2), ..Default::default() }),
                json!({"session_id": s, "user_seq": 2}),
            ),
            (TurnEvent::Delta(Text { text: "Hi \"you\"".into() }), json!({"text": "Hi \"you\""})),
            (TurnEvent::Reasoning(Text { text: "hm".into() }), json!({"text": "hm"})),
            (
                TurnEvent::Error(StreamError { code: FailureCode::UpstreamTimeout, message: "slow".into() }),
                json!({"code": "upstream_timeout", "message": "slow"}),
            ),
            (
                TurnEvent::End(end.clone()),
                json!({"session_id": s, "duration_ms": 1234, "model": "m", "usage": usage,
                       "finish_reason": null, "status": "completed", "assistant_seq": 3}),
            ),
            (
                TurnEvent::End(TurnEnd {
                    outcome: Some(OutcomeEvent::Failure(4)),
                    ..TurnEnd::new(Some(s), TurnStatus::Stopped)
                }),
                json!({"session_id": s, "status": "stopped", "failed_seq": 4}),
            ),
            (
                TurnEvent::End(TurnEnd {
                    outcome: Some(OutcomeEvent::Partial(5)),
                    ..TurnEnd::new(Some(s), TurnStatus::Interrupted)
                }),
                json!({"session_id": s, "status": "interrupted", "pending_seq": 5}),
            ),
        ];
        for (id, (event, data)) in (1..).zip(cases) {
            assert_eq!(event.data().to_string(), data.to_string(), "{event:?}");
            let tagged = serde_json::to_value(&event).unwrap();
            assert_eq!(tagged["event"], event.name(), "serde's tag is the SSE name");
            let e = StreamEvent { id, event: event.clone() };
            let bus = serde_json::to_string(&e).unwrap();
            let before = json!({"id": id, "event": event.name(), "data": data});
            assert_eq!(bus, format!(r#"{{"id":{id},"event":"{}","data":{}}}"#, event.name(), data));
            assert_eq!(serde_json::from_str::<StreamEvent>(&bus).unwrap(), e);
            assert_eq!(serde_json::from_value::<StreamEvent>(before).unwrap(), e);
        }
    }

    #[test]
    fn a_finish_reason_is_absent_null_or_named() {
        let data = |v: Value| match TurnEvent::from_parts("end", v).unwrap() {
            TurnEvent::End(e) => e,
            other => panic!("{other:?}"),
        };
        assert_eq!(data(json!({"status": "failed"})).finish_reason, None);
        assert_eq!(data(json!({"status": "completed", "finish_reason": null})).finish_reason, Some(None));
        let length = data(json!({"status": "completed", "finish_reason": "length"}));
        assert!(length.hit_length());
        assert!(TurnEvent::from_parts("nonsense", json!({})).is_err());
    }

    #[test]
    fn failure_codes_read_and_write_as_the_same_strings() {
        for code in [
            "interrupted",
            "stopped",
            "upstream_error",
            "upstream_timeout",
            "context_overflow",
            "answer_too_large",
            "not_found",
            "unavailable",
            "internal",
            "an_imported_one",
        ] {
            let c: FailureCode = serde_json::from_value(json!(code)).unwrap();
            assert_eq!(serde_json::to_value(&c).unwrap(), json!(code));
            assert_eq!(c.to_string(), code);
            assert_eq!(matches!(c, FailureCode::Other(_)), code == "an_imported_one");
        }
    }

    #[test]
    fn a_turn_ends_as_its_log_says() {
        let s = session();
        let user = || EventBody::UserMessage(UserMessage { text: "q".into(), ..Default::default() });
        let memory = || EventBody::TurnMemory(TurnMemory::default());
        let answer = || EventBody::AssistantTurn(AssistantTurn::default());
        let end = |bodies: Vec<EventBody>| {
            let events: Vec<Event> = (3..).zip(bodies).map(|(seq, b)| event(seq, b)).collect();
            let end = turn_end_from_log(s, &events);
            assert_eq!(end.session_id, Some(s));
            (end.status, end.outcome)
        };
        use OutcomeEvent::*;
        use TurnStatus::*;
        assert_eq!(end(vec![]), (Interrupted, None), "died before its first checkpoint");
        assert_eq!(end(vec![pending(None), answer(), memory()]), (Completed, Some(Answer(4))));
        assert_eq!(end(vec![pending(None), pending(None)]), (Interrupted, Some(Partial(4))));
        assert_eq!(
            end(vec![pending(None), pending(Some(PendingReason::Stopped))]),
            (Stopped, Some(Partial(4)))
        );
        assert_eq!(end(vec![pending(Some(PendingReason::Interrupted))]), (Interrupted, Some(Partial(3))));
        assert_eq!(end(vec![failed("upstream_error", "500")]), (Failed, Some(Failure(3))));
        assert_eq!(end(vec![failed("stopped", STOPPED_BEFORE_TEXT)]), (Stopped, Some(Failure(3))));
        assert_eq!(
            end(vec![failed("interrupted", "interrupted before any text arrived")]),
            (Failed, Some(Failure(3)))
        );
        // As stored before the code said it.
        assert_eq!(end(vec![failed("interrupted", STOPPED_BEFORE_TEXT)]), (Stopped, Some(Failure(3))));
        assert_eq!(end(vec![failed("upstream_error", STOPPED_BEFORE_TEXT)]), (Failed, Some(Failure(3))));
        // The next turn's events are not this one's.
        assert_eq!(end(vec![pending(None), user(), answer()]), (Interrupted, Some(Partial(3))));
    }

    /// DESIGN §14: a step that asks for tools pauses the turn until every result is in;
    /// then the next step's outcome (or none yet) decides; `waiting_calls` and
    /// `tool_steps` read the same turn.
    #[test]
    fn a_turn_with_tool_steps_ends_by_its_last_step() {
        use crate::log_builder::LogBuilder;
        let mut log = LogBuilder::new();
        log.user("old question");
        log.tool_step("", "old", "ls", "{}");
        let user_seq = log.user("q");
        let step = log.tool_step("", "c1", "ls", "{}");
        let after =
            |log: &LogBuilder| turn_end_from_log(session(), log.events.iter().filter(|e| e.seq > user_seq));
        let paused = after(&log);
        assert_eq!(
            (paused.status, paused.outcome),
            (TurnStatus::RequiresAction, Some(OutcomeEvent::Answer(step)))
        );
        assert_eq!(paused.required.iter().map(|r| r.call_id.as_str()).collect::<Vec<_>>(), ["c1"]);
        assert_eq!(waiting_calls(&log.events).iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["c1"]);
        assert_eq!(tool_steps(&log.events), 1, "only the current turn's steps count");
        log.tool_result("c1", "ls", "a.txt");
        // Results in, next step not stored yet: as a copy that died before its checkpoint.
        let between = after(&log);
        assert_eq!(
            (between.status, between.outcome, between.required.len()),
            (TurnStatus::Interrupted, None, 0)
        );
        assert!(waiting_calls(&log.events).is_empty());
        let answer = log.assistant("done");
        let done = after(&log);
        assert_eq!((done.status, done.outcome), (TurnStatus::Completed, Some(OutcomeEvent::Answer(answer))));
        // The end's JSON carries `required` only while paused.
        let wire = serde_json::to_value(EndWire::from(paused)).unwrap();
        assert_eq!(wire["status"], "requires_action");
        assert_eq!(wire["required"][0]["kind"], "tool");
        assert!(serde_json::to_value(EndWire::from(done)).unwrap().get("required").is_none());
    }
}
