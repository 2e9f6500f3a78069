//! Conversations (DESIGN §13): a session as OpenAI's conversation, its visible messages as
//! items, and items added without calling the model (an import path, under the turn lease).

use serde_json::{json, Value};
use turnlog_core::events::{
    AssistantTurn, Block, BlockType, EventBody, ImageRef, LlmMessage, LlmPart, MessageContent, UiPart,
    UserMessage,
};
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{metadata_error, AppendRequest};
use turnlog_runtime::read::{self, SessionRow};
use uuid::Uuid;

use super::{conversation_id, conversation_items, message_id, parse_conversation, OaiError};
use crate::auth::Caller;
use crate::writes::submit;
use crate::AppState;

/// A session as OpenAI's conversation object.
pub fn conversation(row: &SessionRow) -> Value {
    json!({
        "id": conversation_id(row.id),
        "object": "conversation",
        "created_at": row.created_at.timestamp(),
        "metadata": row.metadata,
    })
}

/// The caller's conversation `id` (its `conv_` or its UUID form), or 404.
pub async fn owned(app: &AppState, caller: &Caller, id: &str) -> Result<SessionRow, OaiError> {
    let id = parse_conversation(id)?;
    read::get_session(&app.pool, caller.owner(), id).await?.ok_or_else(|| OaiError::not_found("conversation"))
}

/// Most items one request adds (OpenAI's limit).
const MAX_NEW_ITEMS: usize = 20;

/// An item to add: a user message or an answer, as text.
pub struct NewItem {
    pub assistant: bool,
    pub text: String,
    /// A user message's images (stored files), from Chat Completions' image parts.
    pub images: Vec<ImageRef>,
    /// The id the item came with when it is one of turnlog's (`msg_<32 hex>`): an item a
    /// client adds back after reading it from a response (the Agents SDK's sessions).
    pub id: Option<Uuid>,
}

/// `items` of a create: messages whose content is a string or text parts.
pub fn parse_items(items: &Value) -> Result<Vec<NewItem>, OaiError> {
    let items = items.as_array().ok_or_else(|| OaiError::bad_request("items must be an array"))?;
    if items.len() > MAX_NEW_ITEMS {
        return Err(OaiError::bad_request(format!("at most {MAX_NEW_ITEMS} items at once")));
    }
    items.iter().map(parse_item).collect()
}

fn parse_item(item: &Value) -> Result<NewItem, OaiError> {
    if item.get("type").is_some_and(|t| t != "message") {
        return Err(OaiError::bad_request("only message items can be added"));
    }
    let assistant = match item.get("role").and_then(Value::as_str) {
        Some("user") => false,
        Some("assistant") => true,
        _ => return Err(OaiError::bad_request("an item's role must be user or assistant")),
    };
    let text = match item.get("content") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("input_text" | "output_text" | "text"), Some(t)) => Ok(t),
                _ => Err(OaiError::bad_request("an item's content parts must be text")),
            })
            .collect::<Result<Vec<_>, _>>()?
            .join(""),
        _ => return Err(OaiError::bad_request("an item needs content")),
    };
    if text.is_empty() {
        return Err(OaiError::bad_request("an item's text must not be empty"));
    }
    crate::validate::text(&text)?;
    let id = item.get("id").and_then(Value::as_str).and_then(|id| id.strip_prefix("msg_"));
    let id = id.filter(|hex| hex.len() == 32).and_then(|hex| Uuid::parse_str(hex).ok());
    Ok(NewItem { assistant, text, images: Vec::new(), id })
}

impl NewItem {
    /// The event the item becomes: a user message, or an answer with its text.
    pub fn body(&self) -> EventBody {
        let text = self.text.clone();
        if !self.assistant {
            return EventBody::UserMessage(UserMessage {
                text,
                images: self.images.clone(),
                ..Default::default()
            });
        }
        EventBody::AssistantTurn(AssistantTurn {
            ui: UiPart {
                blocks: vec![Block { kind: BlockType::Text, text: Some(text.clone()), meta: None }],
            },
            llm: LlmPart {
                message: LlmMessage { content: Some(MessageContent::Text(text)), ..Default::default() },
            },
            ..Default::default()
        })
    }

    /// The item as a conversation item of id `event_id`.
    fn item(&self, event_id: Uuid) -> Value {
        let (role, part) = if self.assistant {
            (
                "assistant",
                json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}),
            )
        } else {
            ("user", json!({"type": "input_text", "text": self.text}))
        };
        json!({"type": "message", "id": message_id(event_id), "role": role, "status": "completed", "content": [part]})
    }
}

/// Appends `items` in order under the session's turn lease (no turn runs meanwhile), without
/// calling the model: an import path. Returns them as conversation items. Every item is
/// sized before the first is written, and the appends go on (and the lease is released) if
/// the client leaves meanwhile.
pub async fn append_items(
    app: &AppState,
    caller: &Caller,
    session: SessionId,
    items: Vec<NewItem>,
) -> Result<Vec<Value>, OaiError> {
    let bodies: Vec<EventBody> = items.iter().map(NewItem::body).collect();
    for body in &bodies {
        crate::validate::event(body.kind(), &body.to_payload())?;
    }
    let lease = app.leases.acquire(session, &app.instance_id).await?.ok_or_else(|| {
        OaiError(crate::error::ApiError::Conflict("a response is running in this conversation".into()))
    })?;
    let (app, owner) = (app.clone(), caller.owner().clone());
    let appending = tokio::spawn(async move {
        let mut added = Vec::new();
        let mut result = Ok(());
        for (item, body) in items.iter().zip(&bodies) {
            let event_id = Uuid::now_v7();
            if let Err(e) = submit(&app, &AppendRequest::append(session, &owner, event_id, body)).await {
                result = Err(e);
                break;
            }
            added.push(item.item(event_id));
        }
        let _ = app.leases.release(lease).await;
        result.map(|()| added)
    });
    match appending.await {
        Ok(result) => Ok(result?),
        Err(e) => Err(OaiError(crate::error::ApiError::internal(e))),
    }
}

/// `items` without those the conversation already holds: an item whose turnlog id names a
/// message of the session's conversation with the same role and text is that message; so
/// is a first item without an id that repeats the conversation's last message when that
/// is an answer a response gave (the Agents SDK's sessions add a response's answer back to
/// the conversation, without its id). Each is listed as it is and not stored again.
/// Returns the items to append and, in the request's order, the listed item of each one
/// left out (`None` where an appended item goes).
pub async fn already_held(
    app: &AppState,
    caller: &Caller,
    session: SessionId,
    items: Vec<NewItem>,
) -> Result<(Vec<NewItem>, Vec<Option<Value>>), OaiError> {
    let answer_first = items.first().is_some_and(|i| i.assistant);
    if items.iter().all(|i| i.id.is_none()) && !answer_first {
        let n = items.len();
        return Ok((items, vec![None; n]));
    }
    let events = read::all_events(&app.pool, caller.owner(), session)
        .await?
        .ok_or_else(|| OaiError::not_found("conversation"))?;
    let held = conversation_items(&events);
    // The conversation's last message when it is an answer a response gave (not one added
    // as an item): the answer an Agents SDK session adds back, without its id.
    let last_answer = held.last().filter(|h| {
        let answered = |e: &turnlog_core::events::Event| match &e.body {
            EventBody::AssistantTurn(a) => a.attempt_id.as_ref().and_then(|a| a.as_uuid()).map(message_id),
            _ => None,
        };
        h["role"] == "assistant"
            && events.iter().rev().find_map(answered).is_some_and(|id| h["id"] == id.as_str())
    });
    let same_text = |h: &Value, item: &NewItem| {
        h["content"][0]["text"].as_str().is_some_and(|t| t.trim() == item.text.trim())
    };
    let (mut new, mut order) = (Vec::new(), Vec::new());
    for (i, item) in items.into_iter().enumerate() {
        let same = match item.id.map(message_id) {
            Some(id) => held.iter().find(|h| {
                h["id"] == id.as_str() && (h["role"] == "assistant") == item.assistant && same_text(h, &item)
            }),
            None if i == 0 && item.assistant => last_answer.filter(|h| same_text(h, &item)),
            None => None,
        };
        match same {
            Some(h) => order.push(Some(h.clone())),
            None => {
                order.push(None);
                new.push(item);
            }
        }
    }
    Ok((new, order))
}

/// A request body as a JSON object; an empty body is `{}`.
pub fn json_body(body: &[u8]) -> Result<Value, OaiError> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    let params = serde_json::from_slice(body)
        .map_err(|e| OaiError::bad_request(format!("the body is not JSON: {e}")))?;
    crate::extract::json_object(body)?;
    Ok(params)
}

/// A request's `metadata`: absent or null, else checked as the writer checks it.
pub fn metadata_of(params: &Value) -> Result<Option<Value>, OaiError> {
    match params.get("metadata") {
        None | Some(Value::Null) => Ok(None),
        Some(m) => match metadata_error(m) {
            Some(why) => Err(OaiError::bad_request(why)),
            None => Ok(Some(m.clone())),
        },
    }
}

/// A conversation's items, oldest first.
pub async fn all_items(app: &AppState, caller: &Caller, id: &str) -> Result<Vec<Value>, OaiError> {
    let row = owned(app, caller, id).await?;
    let events = read::all_events(&app.pool, caller.owner(), row.id)
        .await?
        .ok_or_else(|| OaiError::not_found("conversation"))?;
    Ok(conversation_items(&events))
}
