//! A Responses request that resends its history (DESIGN §13) — the Vercel AI SDK's
//! `messages` with `response.messages`, LangChain's message list, the Agents SDK's
//! `to_input_list()` — reconciled the way Chat Completions is: the items that carry
//! turnlog's ids (`msg_…` on a message, or an `item_reference`) find the session and its
//! family, and the branch planner ([`crate::openai::branches`]) continues the branch, forks
//! it (an edited or regenerated message) or runs its last message again. A history with
//! none of turnlog's ids is a new session that imports the earlier messages first. Nothing
//! is stored twice.
//!
//! One pattern names no session at all: the Agents SDK's `OpenAIConversationsSession`
//! adds the user's message to a conversation (`items.create`), then asks for a response
//! with that message alone and no `conversation` ([`waiting_twin`] finds the
//! conversation), then adds the answer back (`conversations::already_held` finds it
//! there).

use std::collections::HashMap;

use turnlog_core::events::EventBody;
use turnlog_core::ids::SessionId;
use turnlog_runtime::read;
use uuid::Uuid;

use super::request::{no_item, HistoryItem, ToolItem};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::openai::chat::{Conversation, Family, Image};
use crate::openai::{message_id, OaiError};
use crate::turn::{NewMessage, ToolResult};
use crate::AppState;

/// A message of the caller's an id names: where it is, its role and its text as the
/// transcript shows it.
#[derive(Debug, Clone)]
struct Found {
    session: SessionId,
    user: bool,
    text: String,
}

/// The family a history belongs to and its conversation (the request's `system` text
/// beside it). The family is that of the last item naming one of the caller's messages;
/// an `item_reference` to none is a 404, a message's own id that names none is ignored
/// (its text is what counts).
pub async fn conversation(
    app: &AppState,
    caller: &Caller,
    items: Vec<HistoryItem>,
    system: Option<String>,
) -> Result<(Family, Conversation), OaiError> {
    let found = resolve(app, caller, &items).await?;
    let (mut messages, mut images, mut documents) = (Vec::new(), Vec::new(), Vec::new());
    let mut named = None;
    // The results after the last step's calls, when that step follows the last user
    // message: the turn they continue (DESIGN §14). Earlier tool traffic is the log's.
    let (mut step_open, mut tool_results) = (false, Vec::new());
    let last = items.len().saturating_sub(1);
    for (i, item) in items.into_iter().enumerate() {
        if let Some(tool) = item.tool {
            if let Some(f) = item.id.and_then(|id| found.get(&id)) {
                named = Some(f.session);
            }
            match tool {
                ToolItem::Call => (step_open, tool_results) = (true, Vec::new()),
                ToolItem::Output(result) if step_open => tool_results.push(result),
                ToolItem::Output(_) => {}
            }
            continue;
        }
        let hit = item.id.and_then(|id| found.get(&id)).filter(|f| item.reference || f.user == item.user);
        let (user, text) = match (item.reference, hit) {
            (true, None) => return Err(no_item(&message_id(item.id.unwrap_or_default()))),
            (true, Some(f)) => (f.user, f.text.clone()),
            (false, _) => (item.user, item.text.unwrap_or_default()),
        };
        if let Some(f) = hit {
            named = Some(f.session);
        }
        if !item.documents.is_empty() {
            if i != last {
                return Err(OaiError::bad_request("files can be attached to the last message only"));
            }
            documents = item.documents;
        }
        // A branch's conversation has no empty messages (a failed answer, say).
        if text.trim().is_empty() {
            if !item.images.is_empty() {
                return Err(OaiError::bad_request("a message with images needs text too"));
            }
            continue;
        }
        if user {
            (step_open, tool_results) = (false, Vec::new());
        }
        messages.push((user, text));
        images.push(item.images.into_iter().map(Image::File).collect());
    }
    if step_open && tool_results.is_empty() {
        return Err(OaiError::bad_request(
            "input ends with function_call items: send their function_call_output items after them",
        ));
    }
    if named.is_none() && !tool_results.is_empty() {
        named = waiting_for(app, caller, &tool_results).await?;
    }
    match messages.last() {
        Some((true, _)) => {}
        // A step's text may follow the user message of the turn its results continue.
        Some((false, _)) if !tool_results.is_empty() => {}
        Some((false, _)) => {
            return Err(OaiError::bad_request(
                "the last input message must be a user message (continuing an answer is not supported)",
            ))
        }
        None => return Err(OaiError::bad_request("input needs a user message with text")),
    }
    let family = match named {
        None => Family::fresh(),
        Some(session) => {
            let row = read::get_session(&app.pool, caller.owner(), session)
                .await?
                .ok_or_else(|| OaiError(ApiError::session_not_found()))?;
            Family::of(&row)
        }
    };
    Ok((family, Conversation { system, messages, images, documents, tool_results }))
}

/// How recently a session must have been active for results naming none of turnlog's ids
/// to find the turn that waits for them (seconds).
const WAITING_WINDOW_SECS: f64 = 3600.0;

/// The session whose turn waits for one of `results`' calls, when results come in a
/// history without turnlog's ids (a client that rebuilt its `function_call` items): the
/// caller's most recently active session, when it was active within the hour and waits.
async fn waiting_for(
    app: &AppState,
    caller: &Caller,
    results: &[ToolResult],
) -> Result<Option<SessionId>, OaiError> {
    let Some(row) = read::latest_active(&app.pool, caller.owner(), WAITING_WINDOW_SECS).await? else {
        return Ok(None);
    };
    let waiting = crate::turn::waiting(app, caller, row.id).await?;
    Ok(results.iter().any(|r| waiting.iter().any(|c| c.call_id == r.call_id)).then_some(row.id))
}

/// The caller's messages the items' ids name: user messages and answers by event id,
/// answers (and stopped or interrupted ones' partials) by attempt id.
async fn resolve(
    app: &AppState,
    caller: &Caller,
    items: &[HistoryItem],
) -> Result<HashMap<Uuid, Found>, OaiError> {
    let mut ids: Vec<Uuid> = items.iter().filter_map(|i| i.id).collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let mut found = HashMap::new();
    for stored in read::message_events(&app.pool, caller.owner(), &ids).await? {
        let event = stored.decode().map_err(ApiError::internal)?;
        let session = SessionId(stored.session_id);
        match &event.body {
            EventBody::UserMessage(m) => {
                found.insert(event.event_id.as_uuid(), Found { session, user: true, text: m.text.clone() });
            }
            EventBody::AssistantTurn(a) => {
                let answer = Found { session, user: false, text: a.ui_text() };
                if let Some(attempt) = a.attempt_id.as_ref().and_then(|a| a.as_uuid()) {
                    found.insert(attempt, answer.clone());
                }
                found.insert(event.event_id.as_uuid(), answer);
            }
            // A stopped or interrupted answer's partial: what the client holds of it.
            EventBody::PendingState(p) if p.reason.is_some() => {
                if let Some(attempt) = p.attempt_id.as_ref().and_then(|a| a.as_uuid()) {
                    found.insert(attempt, Found { session, user: false, text: p.partial.clone() });
                }
            }
            _ => {}
        }
    }
    Ok(found)
}

/// How recent a conversation's lone message must be for a response naming no session to
/// answer it (seconds).
const TWIN_WINDOW_SECS: f64 = 60.0;

/// The conversation a response request that names none answers: the caller's most
/// recently active session, when it was active within the last minute and holds exactly
/// this message and nothing else — no answer, no attempt at one, no fork — added without
/// running the model. The request then answers that message in place instead of storing
/// it again in a new session. (Were it another client's unrelated request with the same
/// text, the outcome is the same exchange in an otherwise empty conversation.)
pub async fn waiting_twin(
    app: &AppState,
    caller: &Caller,
    message: &NewMessage,
) -> Result<Option<SessionId>, OaiError> {
    if !message.images.is_empty() || !message.documents.is_empty() || message.text.trim().is_empty() {
        return Ok(None);
    }
    let Some(row) = read::latest_active(&app.pool, caller.owner(), TWIN_WINDOW_SECS).await? else {
        return Ok(None);
    };
    if !row.lineage.is_empty() || row.last_seq > 8 {
        return Ok(None);
    }
    let Some(events) = read::all_events(&app.pool, caller.owner(), row.id).await? else {
        return Ok(None);
    };
    let mut messages = events.iter().filter(|e| !matches!(e.body, EventBody::SessionStarted(_)));
    let lone = match (messages.next(), messages.next()) {
        (Some(e), None) => match &e.body {
            EventBody::UserMessage(m) => m.text.trim() == message.text.trim() && m.images.is_empty(),
            _ => false,
        },
        _ => false,
    };
    Ok(lone.then_some(row.id))
}
