//! The turn routes (DESIGN §5, §7): send a message (or chat, creating the session), stop,
//! retry, and re-attach. Everything before the user message is durable is an ordinary JSON
//! error; after it, the turn answers as an event stream that always ends with exactly one
//! `end`, and it goes on (and is stored) if the client leaves. Starting and following a
//! turn is [`crate::turn`]'s; the stream is [`crate::sse`]'s.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use turnlog_core::events::PendingReason;
use turnlog_core::ids::SessionId;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::idempotency::{idempotency_key, IdempotencyHeader};
use crate::sessions::owned_session;
use crate::turn::{self, remote_stop, NewMessage, TurnOptions};
use crate::{sse, AppState};

/// A message to send: the text, and optionally a category, a model and attachments.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SendMessage {
    /// Not blank; 1 byte to 256 KiB.
    #[schema(schema_with = crate::openapi::message_text)]
    pub text: String,
    #[serde(default)]
    #[schema(schema_with = crate::openapi::name)]
    pub category: Option<String>,
    /// The model to call (default: TURNLOG_MODEL); one of TURNLOG_ALLOWED_MODELS when that is set.
    #[serde(default)]
    #[schema(schema_with = crate::openapi::name)]
    pub model: Option<String>,
    /// Ids of the caller's uploaded images (`POST /v1/files`); at most 32 attachments in all.
    #[serde(default)]
    #[schema(max_items = 32)]
    pub images: Vec<String>,
    /// Ids of the caller's uploaded documents; their markdown (512 KiB in all) goes with
    /// the message. At most 32 attachments in all.
    #[serde(default)]
    #[schema(max_items = 32)]
    pub documents: Vec<String>,
    /// Edit: the seq of a user message of this session. The message is sent instead into a
    /// new fork through the seq before it (DESIGN §10); the stream's `meta` names the fork.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub edit_of: Option<i64>,
    /// Function tools the client runs (DESIGN §14), in Chat Completions' shape
    /// (`{type: "function", function: {name, description?, parameters?}}`), at most 128.
    /// A step that asks for them ends the stream `requires_action`; answer with
    /// `POST /v1/sessions/{id}/tool_results`.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Box<serde_json::value::RawValue>>,
    /// `none`, `auto`, `required`, or `{type: "function", function: {name}}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Box<serde_json::value::RawValue>>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
}

/// `POST /v1/sessions/{id}/retry`: without `of`, run the last user message again after an
/// interrupted or failed turn; with `of`, regenerate that answer in a new fork.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryRequest {
    /// Regenerate: the seq of an answer (`assistant_turn`) of this session. Its user
    /// message runs again in a fork through that message (DESIGN §10).
    #[serde(default)]
    #[schema(minimum = 1)]
    pub of: Option<i64>,
}

/// `POST /v1/chat`: a message to a session, or to a new one when `session_id` is absent.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    #[serde(default)]
    pub session_id: Option<Uuid>,
    /// Not blank; 1 byte to 256 KiB.
    #[schema(schema_with = crate::openapi::message_text)]
    pub text: String,
    #[serde(default)]
    #[schema(schema_with = crate::openapi::name)]
    pub category: Option<String>,
    #[serde(default)]
    #[schema(schema_with = crate::openapi::name)]
    pub model: Option<String>,
    /// Ids of the caller's uploaded images; at most 32 attachments in all.
    #[serde(default)]
    #[schema(max_items = 32)]
    pub images: Vec<String>,
    /// Ids of the caller's uploaded documents; at most 32 attachments in all.
    #[serde(default)]
    #[schema(max_items = 32)]
    pub documents: Vec<String>,
    /// Function tools the client runs (DESIGN §14), in Chat Completions' shape
    /// (`{type: "function", function: {name, description?, parameters?}}`), at most 128.
    /// A step that asks for them ends the stream `requires_action`; answer with
    /// `POST /v1/sessions/{id}/tool_results`.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Box<serde_json::value::RawValue>>,
    /// `none`, `auto`, `required`, or `{type: "function", function: {name}}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Box<serde_json::value::RawValue>>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
}

/// `POST /v1/sessions/{id}/tool_results`: the results of the calls a paused turn waits for.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolResults {
    /// One per call the turn waits for (1 to 128).
    #[schema(min_items = 1, max_items = 128)]
    pub results: Vec<ToolResultBody>,
}

/// A client tool's result: what the model is sent (over 32 KiB is cut, with a note).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolResultBody {
    /// The call's id, as `tool_call` and `required` gave it.
    #[schema(min_length = 1, max_length = 256, pattern = r"^[^\u0000]*$")]
    pub call_id: String,
    /// No NUL (Postgres cannot store U+0000).
    #[schema(pattern = r"^[^\u0000]*$")]
    pub output: String,
    #[serde(default)]
    pub is_error: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Stopping {
    pub session_id: Uuid,
    pub stopping: bool,
}

impl SendMessage {
    /// The message, the seq it edits if it is an edit, and the turn's options (its tools).
    fn split(self) -> Result<(NewMessage, Option<i64>, TurnOptions), ApiError> {
        let Self {
            text,
            category,
            model,
            images,
            documents,
            edit_of,
            tools,
            tool_choice,
            parallel_tool_calls,
        } = self;
        let tools = turn::tool_offer(tools.as_deref(), tool_choice.as_deref(), parallel_tool_calls)?;
        Ok((
            NewMessage { text, category, model, images, documents },
            edit_of,
            TurnOptions { tools, ..Default::default() },
        ))
    }
}

/// Send a message and stream the turn.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/messages", tag = "turns", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"), IdempotencyHeader),
    request_body = SendMessage,
    responses(
        (status = 200, description = "text/event-stream: meta, delta*, reasoning*, error?, end", content_type = "text/event-stream"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "A turn is already running", body = ErrorBody),
        (status = 413, body = ErrorBody),
        (status = 429, description = "Too many turns at once (`Retry-After`)", body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id, fork_id), err(Display, level = "debug"))]
pub async fn send(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<SendMessage>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let (message, edit_of, options) = body.split()?;
    let message = turn::prepared(&app, caller.owner(), &message).await?;
    let session = owned_session(&app, &caller, id).await?;
    let (target, create) = match edit_of {
        None => (id, None),
        Some(edit_of) => {
            let create = turn::edit_fork(&app, &caller, &session, edit_of, key.as_deref()).await?;
            tracing::Span::current().record("fork_id", tracing::field::display(create.session_id));
            (create.session_id, Some(create))
        }
    };
    let events = turn::begin_turn(&app, &caller, target, message, key, create, options).await?;
    Ok(sse::turn(&app, target, events))
}

/// Send the results of a paused turn's tool calls (DESIGN §14) and stream the turn as it
/// goes on: `meta`, a `tool_result` per result, then the next step.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/tool_results", tag = "turns", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id")),
    request_body = ToolResults,
    responses(
        (status = 200, description = "text/event-stream: meta, tool_result*, then the next step's events and end", content_type = "text/event-stream"),
        (status = 400, description = "A result is missing (named), or one is sent twice", body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 404, description = "No such session, or no such call waiting", body = ErrorBody),
        (status = 409, description = "A call is already answered, or a turn is running", body = ErrorBody),
        (status = 413, body = ErrorBody),
        (status = 429, description = "Too many turns at once (`Retry-After`)", body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn tool_results(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    ApiJson(body): ApiJson<ToolResults>,
) -> Result<Response, ApiError> {
    owned_session(&app, &caller, id).await?;
    let results = body
        .results
        .into_iter()
        .map(|r| turn::ToolResult {
            call_id: r.call_id,
            output: r.output,
            is_error: r.is_error == Some(true),
        })
        .collect();
    let events = turn::continue_with_results(&app, &caller, id, results).await?;
    Ok(sse::turn(&app, id, events))
}

/// Send a message to a session, or to a new one, and stream the turn.
#[utoipa::path(
    post, path = "/v1/chat", tag = "turns", security(("bearer" = [])),
    params(IdempotencyHeader),
    request_body = ChatMessage,
    responses(
        (status = 200, description = "text/event-stream; `X-Session-Id` names the session", content_type = "text/event-stream"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 413, body = ErrorBody),
        (status = 429, description = "Too many turns at once (`Retry-After`)", body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id), err(Display, level = "debug"))]
pub async fn chat(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ChatMessage>,
) -> Result<Response, ApiError> {
    let message = NewMessage {
        text: body.text,
        category: body.category,
        model: body.model,
        images: body.images,
        documents: body.documents,
    };
    let tools =
        turn::tool_offer(body.tools.as_deref(), body.tool_choice.as_deref(), body.parallel_tool_calls)?;
    let options = TurnOptions { tools, ..Default::default() };
    let key = idempotency_key(&headers)?;
    let message = turn::prepared(&app, caller.owner(), &message).await?;
    let (id, create) = turn::chat_session(&app, &caller, body.session_id, key.as_deref()).await?;
    tracing::Span::current().record("session_id", tracing::field::display(id));
    let events = turn::begin_turn(&app, &caller, id, message, key, create, options).await?;
    Ok(sse::turn(&app, id, events))
}

/// Stop the turn in flight; its partial answer is kept (`reason: stopped`).
#[utoipa::path(
    post, path = "/v1/sessions/{id}/stop", tag = "turns", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id")),
    responses(
        (status = 202, body = Stopping),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "No turn in flight", body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn stop(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
) -> Result<(StatusCode, Json<Stopping>), ApiError> {
    owned_session(&app, &caller, id).await?;
    let stopping = match app.turns.get(id) {
        Some(turn) => {
            turn.stop(PendingReason::Stopped);
            true
        }
        None => remote_stop(&app, id).await,
    };
    if !stopping {
        return Err(ApiError::Conflict("no turn is running in this session".into()));
    }
    Ok((StatusCode::ACCEPTED, Json(Stopping { session_id: id.0, stopping })))
}

/// Run the last user message again after an interrupted or failed turn, or regenerate an
/// answer in a fork.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/retry", tag = "turns", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"), IdempotencyHeader),
    request_body(content = ref("#/components/schemas/RetryRequest"), content_type = "application/json", description = "Empty, `{}`, or `{\"of\": <answer seq>}`"),
    responses(
        (status = 200, description = "text/event-stream, as for a message", content_type = "text/event-stream"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "A turn is running, or the last turn completed", body = ErrorBody),
        (status = 429, description = "Too many turns at once (`Retry-After`)", body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id, fork_id), err(Display, level = "debug"))]
pub async fn retry(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<RetryRequest>,
) -> Result<Response, ApiError> {
    let session = owned_session(&app, &caller, id).await?;
    let Some(of) = body.of else {
        let events = turn::retry_last(&app, &caller, id, None, TurnOptions::default()).await?;
        return Ok(sse::turn(&app, id, events));
    };
    let key = idempotency_key(&headers)?;
    let (create, user_seq) = turn::regenerate_fork(&app, &caller, &session, of, key.as_deref()).await?;
    let fork = create.session_id;
    tracing::Span::current().record("fork_id", tracing::field::display(fork));
    let events = turn::regenerate(&app, &caller, &create, user_seq, key.is_some()).await?;
    Ok(sse::turn(&app, fork, events))
}

/// Re-attach to the turn in flight: its events after `Last-Event-ID`, then live.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/stream", tag = "turns", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"),
           ("Last-Event-ID" = Option<i64>, Header, nullable = false, minimum = 0, description = "The last event id the client has")),
    responses(
        (status = 200, description = "text/event-stream", content_type = "text/event-stream"),
        (status = 204, description = "No turn in flight"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn reattach(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    owned_session(&app, &caller, id).await?;
    // An id the log's seqs could hold: 0 to i64::MAX.
    let after = match headers.get("last-event-id") {
        None => 0,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| ApiError::bad_request("Last-Event-ID must be a turn event id (1, 2, 3, ...)"))?,
    };
    match turn::attach(&app, id, after).await {
        Some(events) => Ok(sse::turn(&app, id, events)),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}
