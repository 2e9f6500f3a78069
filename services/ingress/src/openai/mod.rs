//! The OpenAI-compatible surface's own layer (DESIGN §13): a translation of OpenAI's wire
//! formats onto sessions and turns, not a second model of a conversation. A conversation
//! is a session (`conv_<32 hex>`), a response one attempt (`resp_<32 hex>`), an item a
//! visible event (`msg_<32 hex>`: a user message's event id, an answer's attempt id, so
//! an answer keeps the id it was announced with while it streamed). The handlers are in
//! `routes/openai/`; what they share — ids, objects, the error shape, the branches of Chat
//! Completions, the Responses and Chat Completions translations — is here.

pub mod branches;
pub mod chat;
pub mod conversations;
pub mod error;
pub mod params;
pub mod responses;
pub mod wire;

use serde_json::{json, Value};
use turnlog_core::events::{Event, EventBody, ToolCall};
use turnlog_core::ids::{AttemptId, SessionId};
use turnlog_core::ui_transcript::{ui_transcript, ItemKind};
use uuid::Uuid;

pub use error::{OaiBody, OaiError, OaiErrorBody, OaiPath, OaiQuery};

/// `conv_` and the session id's 32 hex digits.
pub fn conversation_id(s: SessionId) -> String {
    format!("conv_{}", s.0.simple())
}

/// A conversation id, or the session's own UUID form.
pub fn parse_conversation(id: &str) -> Result<SessionId, OaiError> {
    prefixed(id, "conv_").map(SessionId).ok_or_else(|| OaiError::not_found("conversation"))
}

/// `resp_` and the attempt id's 32 hex digits.
pub fn response_id(attempt: Uuid) -> String {
    format!("resp_{}", attempt.simple())
}

/// The attempt id a response id names, as the log spells it (hyphenated).
pub fn parse_response(id: &str) -> Result<AttemptId, OaiError> {
    prefixed(id, "resp_").map(AttemptId::from).ok_or_else(|| OaiError::not_found("response"))
}

pub fn message_id(id: Uuid) -> String {
    format!("msg_{}", id.simple())
}

/// A `function_call` item's id: `fc_`, the attempt id's 32 hex digits (the response that
/// made the call) and the call's place among the response's calls (4 hex digits).
pub fn call_item_id(attempt: Uuid, index: usize) -> String {
    format!("fc_{}{:04x}", attempt.simple(), index)
}

/// The attempt a `function_call` item's id names.
pub fn parse_call_item(id: &str) -> Option<Uuid> {
    let hex = id.strip_prefix("fc_")?.get(..32)?;
    Uuid::try_parse(hex).ok()
}

pub fn reasoning_id(attempt: Uuid) -> String {
    format!("rs_{}", attempt.simple())
}

/// `<prefix><32 hex>` or a plain UUID.
fn prefixed(id: &str, prefix: &str) -> Option<Uuid> {
    let hex = id.strip_prefix(prefix).unwrap_or(id);
    if hex.len() != 32 && hex.len() != 36 {
        return None;
    }
    Uuid::parse_str(hex).ok()
}

/// OpenAI's list page of `data`.
pub fn list_page(data: Vec<Value>, has_more: bool) -> Value {
    let first = data.first().map_or(json!(""), |i| i["id"].clone());
    let last = data.last().map_or(json!(""), |i| i["id"].clone());
    json!({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more})
}

/// A user message's item.
pub fn user_item(event_id: Uuid, text: &str) -> Value {
    json!({
        "type": "message", "id": message_id(event_id), "role": "user", "status": "completed",
        "content": [{"type": "input_text", "text": text}],
    })
}

/// An answer's item: its text as one `output_text` part.
pub fn output_message(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message", "id": id, "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    })
}

/// A step's call as a `function_call` item: the `index`-th call of `attempt`'s response.
pub fn function_call_item(attempt: Uuid, index: usize, call: &ToolCall, status: &str) -> Value {
    json!({
        "type": "function_call", "id": call_item_id(attempt, index), "call_id": call.id,
        "name": call.name, "arguments": call.arguments, "status": status,
    })
}

/// A reasoning item with its text.
pub fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}

/// The conversation items of a branch log: its user messages and its answers (interrupted
/// ones included, `incomplete`), as the transcript shows them; a step's tool calls as
/// `function_call` items after its text (a step without text has no message item) and
/// each result as a `function_call_output` (DESIGN §14).
pub fn conversation_items(events: &[Event]) -> Vec<Value> {
    let shown: std::collections::HashSet<i64> = ui_transcript(events)
        .into_iter()
        .filter(|i| {
            matches!(i.kind, ItemKind::User | ItemKind::Assistant | ItemKind::Interrupted | ItemKind::Tool)
        })
        .map(|i| i.seq)
        .collect();
    let attempt_of = |attempt: &Option<AttemptId>, event: Uuid| {
        attempt.as_ref().and_then(AttemptId::as_uuid).unwrap_or(event)
    };
    let sources = crate::turn::server::sources(events);
    let server = |id: &str| crate::turn::server::is_server(&sources, id);
    let mut items = Vec::new();
    for e in events.iter().filter(|e| shown.contains(&e.seq)) {
        match &e.body {
            EventBody::UserMessage(m) => items.push(user_item(e.event_id.as_uuid(), &m.text)),
            EventBody::AssistantTurn(a) => {
                let attempt = attempt_of(&a.attempt_id, e.event_id.as_uuid());
                let text = a.ui_text();
                if !text.is_empty() || !a.asks_for_tools() {
                    items.push(output_message(&message_id(attempt), &text, "completed"));
                }
                for (i, c) in a.llm.message.tool_calls.iter().enumerate().filter(|(_, c)| !server(&c.id)) {
                    items.push(function_call_item(attempt, i, c, "completed"));
                }
            }
            EventBody::PendingState(p) => items.push(output_message(
                &message_id(attempt_of(&p.attempt_id, e.event_id.as_uuid())),
                &p.partial,
                "incomplete",
            )),
            // A server call and its result, as one item.
            EventBody::ToolExecution(t) if server(&t.call_id) => {
                let (label, tool) =
                    t.name.split_once(turnlog_runtime::tools::SEPARATOR).unwrap_or(("", &t.name));
                let ok = t.status == "ok";
                let output = t.output.clone().unwrap_or_default();
                items.push(json!({
                    "type": "mcp_call", "id": format!("mcp_{}", e.event_id.as_uuid().simple()),
                    "server_label": label, "name": tool,
                    "arguments": t.args.as_ref().map(Value::to_string).unwrap_or_default(),
                    "output": ok.then_some(&output),
                    "error": (!ok).then(|| json!({"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": output}]})),
                    "status": if ok { "completed" } else { "failed" },
                }));
            }
            EventBody::ToolExecution(t) => items.push(json!({
                "type": "function_call_output", "id": format!("fco_{}", e.event_id.as_uuid().simple()),
                "call_id": t.call_id, "output": t.output.clone().unwrap_or_default(), "status": "completed",
            })),
            _ => {}
        }
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_accept_the_uuid_form() {
        let s = SessionId::new();
        assert_eq!(parse_conversation(&conversation_id(s)).unwrap(), s);
        assert_eq!(parse_conversation(&s.to_string()).unwrap(), s);
        assert!(parse_conversation("conv_nothex").is_err());
        assert!(parse_conversation("").is_err());
        let a = Uuid::now_v7();
        assert_eq!(parse_response(&response_id(a)).unwrap(), a.hyphenated().to_string());
        assert!(parse_response("resp_123").is_err());
    }
}
