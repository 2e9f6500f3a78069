//! `/v1/conversations`: sessions as OpenAI's conversations, their visible messages as
//! items (DESIGN §13).

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use turnlog_runtime::bus::{metadata_error, AppendRequest};
use turnlog_runtime::read::{self, SessionRow};

use turnlog_core::events::{
    AssistantTurn, Block, BlockType, EventBody, ImageRef, LlmMessage, LlmPart, MessageContent, UiPart,
    UserMessage,
};
use turnlog_core::ids::SessionId;
use uuid::Uuid;

use super::{
    conversation_id, conversation_items, list_page, message_id, parse_conversation, OaiBody, OaiError,
    OaiPath, OaiQuery,
};
use crate::auth::Caller;

use crate::writes::submit;
use crate::AppState;

/// Items per page: OpenAI's default and most.
const ITEMS_DEFAULT: usize = 20;
const ITEMS_MAX: usize = 100;

fn conversation(row: &SessionRow) -> Value {
    json!({
        "id": conversation_id(row.id),
        "object": "conversation",
        "created_at": row.created_at.timestamp(),
        "metadata": row.metadata,
    })
}

async fn owned(app: &AppState, caller: &Caller, id: &str) -> Result<SessionRow, OaiError> {
    let id = parse_conversation(id)?;
    read::get_session(&app.pool, caller.as_str(), id)
        .await?
        .ok_or_else(|| OaiError::not_found("conversation"))
}

/// Create a conversation (a session), with starting messages if given.
#[utoipa::path(
    post, path = "/v1/conversations", tag = "openai", security(("bearer" = [])),
    request_body(content = Object, description = "OpenAI's `ConversationCreateParams`"),
    responses((status = 200, body = Object), (status = 400, body = Object))
)]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    OaiBody(body): OaiBody,
) -> Result<Json<Value>, OaiError> {
    let params = json_body(&body)?;
    let items = match params.get("items") {
        None | Some(Value::Null) => Vec::new(),
        Some(items) => parse_items(items)?,
    };
    let metadata = metadata_of(&params)?;
    let id = SessionId::new();
    submit(&app, &AppendRequest::create(id, caller.as_str(), None).with_metadata(metadata)).await?;
    let row = read::get_session(&app.pool, caller.as_str(), id).await?.ok_or_else(|| {
        OaiError(crate::error::ApiError::internal(anyhow::anyhow!("session {id} committed but not readable")))
    })?;
    if !items.is_empty() {
        append_items(&app, &caller, id, items).await?;
    }
    Ok(Json(conversation(&row)))
}

/// Most items one request adds (OpenAI's limit).
const MAX_NEW_ITEMS: usize = 20;

/// An item to add: a user message or an answer, as text.
pub(super) struct NewItem {
    pub(super) assistant: bool,
    pub(super) text: String,
    /// A user message's images (stored files), from Chat Completions' image parts.
    pub(super) images: Vec<ImageRef>,
}

/// `items` of a create: messages whose content is a string or text parts.
fn parse_items(items: &Value) -> Result<Vec<NewItem>, OaiError> {
    let items = items.as_array().ok_or_else(|| OaiError::bad_request("items must be an array"))?;
    if items.len() > MAX_NEW_ITEMS {
        return Err(OaiError::bad_request(format!("at most {MAX_NEW_ITEMS} items at once")));
    }
    items.iter().map(parse_item).collect()
}

fn parse_item(item: &Value) -> Result<NewItem, OaiError> {
    if item.get("type").and_then(Value::as_str).is_some_and(|t| t != "message") {
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
    Ok(NewItem { assistant, text, images: Vec::new() })
}

impl NewItem {
    /// The event the item becomes: a user message, or an answer with its text.
    pub(super) fn body(&self) -> EventBody {
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
            llm: LlmPart { message: LlmMessage { content: Some(MessageContent::Text(text)) } },
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
pub(super) async fn append_items(
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
    let (app, owner) = (app.clone(), caller.as_str().to_owned());
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

/// Add messages to a conversation without running the model (an import path).
#[utoipa::path(
    post, path = "/v1/conversations/{id}/items", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID")),
    request_body(content = Object, description = "`{items: [message, ...]}`: user or assistant messages, at most 20"),
    responses((status = 200, body = Object), (status = 400, body = Object), (status = 404, body = Object),
              (status = 409, body = Object))
)]
pub async fn add_items(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
    OaiBody(body): OaiBody,
) -> Result<Json<Value>, OaiError> {
    let row = owned(&app, &caller, &id).await?;
    let params = json_body(&body)?;
    let items = parse_items(params.get("items").unwrap_or(&Value::Null))?;
    if items.is_empty() {
        return Err(OaiError::bad_request("items must name at least one message"));
    }
    let added = append_items(&app, &caller, row.id, items).await?;
    Ok(Json(list_page(added, false)))
}

/// A request body as JSON; an empty body is `{}`.
fn json_body(body: &[u8]) -> Result<Value, OaiError> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| OaiError::bad_request(format!("the body is not JSON: {e}")))
}

/// A request's `metadata`: absent or null, else checked as the writer checks it.
fn metadata_of(params: &Value) -> Result<Option<Value>, OaiError> {
    match params.get("metadata") {
        None | Some(Value::Null) => Ok(None),
        Some(m) => match metadata_error(m) {
            Some(why) => Err(OaiError::bad_request(why)),
            None => Ok(Some(m.clone())),
        },
    }
}

/// Update a conversation's metadata (replaced whole).
#[utoipa::path(
    post, path = "/v1/conversations/{id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID")),
    request_body(content = Object, description = "`{metadata: {key: value, ...}}`, at most 16 string pairs"),
    responses((status = 200, body = Object), (status = 400, body = Object), (status = 404, body = Object))
)]
pub async fn update(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
    OaiBody(body): OaiBody,
) -> Result<Json<Value>, OaiError> {
    let row = owned(&app, &caller, &id).await?;
    let params = json_body(&body)?;
    let metadata = metadata_of(&params)?.ok_or_else(|| OaiError::bad_request("metadata is required"))?;
    submit(&app, &AppendRequest::update(row.id, caller.as_str()).with_metadata(Some(metadata))).await?;
    Ok(Json(conversation(&owned(&app, &caller, &id).await?)))
}

/// A conversation.
#[utoipa::path(
    get, path = "/v1/conversations/{id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID")),
    responses((status = 200, body = Object), (status = 404, body = Object))
)]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
) -> Result<Json<Value>, OaiError> {
    Ok(Json(conversation(&owned(&app, &caller, &id).await?)))
}

/// Delete a conversation (its session, as `DELETE /v1/sessions/{id}`).
#[utoipa::path(
    delete, path = "/v1/conversations/{id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID")),
    responses((status = 200, body = Object), (status = 404, body = Object))
)]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
) -> Result<Json<Value>, OaiError> {
    let row = owned(&app, &caller, &id).await?;
    submit(&app, &AppendRequest::delete(row.id, caller.as_str())).await?;
    Ok(Json(json!({"id": conversation_id(row.id), "object": "conversation.deleted", "deleted": true})))
}

#[derive(Debug, Deserialize)]
pub struct ItemsParams {
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    order: Option<String>,
}

/// A conversation's items: its user messages and answers, oldest first with
/// `order=asc`, newest first by default (as OpenAI's).
#[utoipa::path(
    get, path = "/v1/conversations/{id}/items", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID"),
           ("after" = Option<String>, Query, description = "An item id: the items after it"),
           ("limit" = Option<usize>, Query, description = "1–100, default 20"),
           ("order" = Option<String>, Query, description = "asc or desc (default)")),
    responses((status = 200, body = Object), (status = 400, body = Object), (status = 404, body = Object))
)]
pub async fn items(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
    OaiQuery(params): OaiQuery<ItemsParams>,
) -> Result<Json<Value>, OaiError> {
    let limit = params.limit.unwrap_or(ITEMS_DEFAULT);
    if !(1..=ITEMS_MAX).contains(&limit) {
        return Err(OaiError::bad_request(format!("limit must be 1 to {ITEMS_MAX}")));
    }
    let ascending = match params.order.as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(other) => return Err(OaiError::bad_request(format!("order must be asc or desc, not {other}"))),
    };
    let mut all = all_items(&app, &caller, &id).await?;
    if !ascending {
        all.reverse();
    }
    let start = match &params.after {
        None => 0,
        Some(after) => {
            all.iter().position(|i| i["id"] == after.as_str()).map(|p| p + 1).ok_or_else(|| {
                OaiError::bad_request(format!("after names no item of this conversation: {after}"))
            })?
        }
    };
    let page: Vec<Value> = all.iter().skip(start).take(limit).cloned().collect();
    let has_more = all.len() > start + page.len();
    Ok(Json(list_page(page, has_more)))
}

/// One item of a conversation.
#[utoipa::path(
    get, path = "/v1/conversations/{id}/items/{item_id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID"),
           ("item_id" = String, Path, description = "msg_<32 hex>")),
    responses((status = 200, body = Object), (status = 404, body = Object))
)]
pub async fn item(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath((id, item_id)): OaiPath<(String, String)>,
) -> Result<Json<Value>, OaiError> {
    let all = all_items(&app, &caller, &id).await?;
    all.into_iter().find(|i| i["id"] == item_id.as_str()).map(Json).ok_or_else(|| OaiError::not_found("item"))
}

/// Deleting an item is refused: the log only grows.
#[utoipa::path(
    delete, path = "/v1/conversations/{id}/items/{item_id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID"),
           ("item_id" = String, Path, description = "msg_<32 hex>")),
    responses((status = 400, body = Object), (status = 404, body = Object))
)]
pub async fn delete_item(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath((id, _item_id)): OaiPath<(String, String)>,
) -> Result<Json<Value>, OaiError> {
    owned(&app, &caller, &id).await?;
    Err(OaiError::bad_request(
        "items cannot be deleted: a conversation's log is append-only; fork it before the item instead \
         (POST /v1/sessions/{id}/fork)",
    ))
}

async fn all_items(app: &AppState, caller: &Caller, id: &str) -> Result<Vec<Value>, OaiError> {
    let row = owned(app, caller, id).await?;
    let events = read::all_events(&app.pool, caller.as_str(), row.id)
        .await?
        .ok_or_else(|| OaiError::not_found("conversation"))?;
    Ok(conversation_items(&events))
}
