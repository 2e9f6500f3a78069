//! `/v1/conversations` (DESIGN §13): sessions as OpenAI's conversations, their visible
//! messages as items; the objects and the appends are [`crate::openai::conversations`]'.

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read;
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::ErrorBody;
use crate::openai::conversations::{
    all_items, already_held, append_items, conversation, json_body, metadata_of, owned, parse_items,
};
use crate::openai::wire::{
    Conversation, ConversationDeleted, ConversationUpdate, ItemList, ItemsCreate, MessageItem,
};
use crate::openai::{conversation_id, list_page, OaiBody, OaiError, OaiErrorBody, OaiPath, OaiQuery};
use crate::openapi::UNAUTHORIZED;
use crate::writes::submit;
use crate::AppState;

/// Items per page: OpenAI's default and most.
const ITEMS_DEFAULT: usize = 20;
const ITEMS_MAX: usize = 100;

/// Create a conversation (a session), with starting messages if given.
#[utoipa::path(
    post, path = "/v1/conversations", tag = "openai", security(("bearer" = [])),
    request_body(content = ref("#/components/schemas/ConversationCreate"), content_type = "application/json", description = "OpenAI's `ConversationCreateParams`; may be empty"),
    responses(
        (status = 200, body = Conversation), (status = 400, body = OaiErrorBody),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 413, body = OaiErrorBody), (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id), err(Display, level = "debug"))]
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
    tracing::Span::current().record("session_id", tracing::field::display(id));
    submit(&app, &AppendRequest::create(id, caller.owner(), None).with_metadata(metadata)).await?;
    let row = read::get_session(&app.pool, caller.owner(), id).await?.ok_or_else(|| {
        OaiError(crate::error::ApiError::internal(anyhow::anyhow!("session {id} committed but not readable")))
    })?;
    if !items.is_empty() {
        append_items(&app, &caller, id, items).await?;
    }
    Ok(Json(conversation(&row)))
}

/// Add messages to a conversation without running the model (an import path).
#[utoipa::path(
    post, path = "/v1/conversations/{id}/items", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID")),
    request_body(content = ItemsCreate, description = "`{items: [message, ...]}`: user or assistant messages, at most 20"),
    responses(
        (status = 200, description = "The items added", body = ItemList), (status = 400, body = OaiErrorBody),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody),
        (status = 409, description = "A response is running in this conversation", body = OaiErrorBody),
        (status = 413, body = OaiErrorBody), (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(conversation_id = %id), err(Display, level = "debug"))]
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
    let (new, order) = already_held(&app, &caller, row.id, items).await?;
    let mut added =
        if new.is_empty() { Vec::new() } else { append_items(&app, &caller, row.id, new).await? }.into_iter();
    let listed = order.into_iter().filter_map(|held| held.or_else(|| added.next())).collect();
    Ok(Json(list_page(listed, false)))
}

/// Update a conversation's metadata (replaced whole).
#[utoipa::path(
    post, path = "/v1/conversations/{id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID")),
    request_body(content = ConversationUpdate, description = "`{metadata: {key: value, ...}}`, at most 16 string pairs"),
    responses(
        (status = 200, body = Conversation), (status = 400, body = OaiErrorBody),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody), (status = 413, body = OaiErrorBody), (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(conversation_id = %id), err(Display, level = "debug"))]
pub async fn update(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
    OaiBody(body): OaiBody,
) -> Result<Json<Value>, OaiError> {
    let row = owned(&app, &caller, &id).await?;
    let params = json_body(&body)?;
    let metadata = metadata_of(&params)?.ok_or_else(|| OaiError::bad_request("metadata is required"))?;
    submit(&app, &AppendRequest::update(row.id, caller.owner()).with_metadata(Some(metadata))).await?;
    Ok(Json(conversation(&owned(&app, &caller, &id).await?)))
}

/// A conversation.
#[utoipa::path(
    get, path = "/v1/conversations/{id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID")),
    responses(
        (status = 200, body = Conversation),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(conversation_id = %id), err(Display, level = "debug"))]
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
    responses(
        (status = 200, body = ConversationDeleted),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody), (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(conversation_id = %id), err(Display, level = "debug"))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
) -> Result<Json<Value>, OaiError> {
    let row = owned(&app, &caller, &id).await?;
    submit(&app, &AppendRequest::delete(row.id, caller.owner())).await?;
    Ok(Json(json!({"id": conversation_id(row.id), "object": "conversation.deleted", "deleted": true})))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ItemsParams {
    /// An item id of this conversation (400 otherwise): the items after it.
    #[serde(default)]
    after: Option<String>,
    /// 1–100, default 20.
    #[serde(default)]
    #[param(minimum = 1, maximum = 100)]
    limit: Option<usize>,
    /// `asc` or `desc` (the default).
    #[serde(default)]
    #[param(inline, value_type = Option<Order>)]
    order: Option<String>,
}

/// The orders of a page of items.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
pub enum Order {
    Asc,
    Desc,
}

/// A conversation's items: its user messages and answers, oldest first with
/// `order=asc`, newest first by default (as OpenAI's).
#[utoipa::path(
    get, path = "/v1/conversations/{id}/items", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "conv_<32 hex> or the session's UUID"), ItemsParams),
    responses(
        (status = 200, body = ItemList), (status = 400, body = OaiErrorBody),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(conversation_id = %id), err(Display, level = "debug"))]
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
    responses(
        (status = 200, body = MessageItem),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(conversation_id = %id, item_id = %item_id), err(Display, level = "debug"))]
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
    responses(
        (status = 400, description = "Always, for a conversation of the caller's: the log is append-only", body = OaiErrorBody),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(conversation_id = %id, item_id = %_item_id), err(Display, level = "debug"))]
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
