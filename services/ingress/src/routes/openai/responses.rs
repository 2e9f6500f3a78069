//! `POST /v1/responses` and friends: a response is one turn's attempt, streamed as
//! OpenAI's `response.*` events translated from the turn's native events (DESIGN §13).

use std::convert::Infallible;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{json, Value};
use turnlog_core::audit::MAX_SYSTEM_PROMPT_BYTES;
use turnlog_core::events::{BlockType, EventBody, PendingReason};
use turnlog_core::ids::SessionId;
use turnlog_core::request_body::{request_body, RequestParams, StreamOptions};
use turnlog_core::{ChatMessage, Role};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read::{self, StoredEvent};
use turnlog_runtime::upstream::{ChatStream, StreamItem};
use uuid::Uuid;

use super::{conversation_id, message_id, output_message, parse_conversation, parse_response, reasoning_id};
use super::{list_page, reasoning_item, response_id, user_item, OaiBody, OaiError, OaiPath, OaiQuery};
use crate::auth::Caller;

use crate::routes::forks::fork_request;
use crate::routes::sessions::owned_session;
use crate::routes::turns::{begin_turn, follow_local, prepared, ready_for_turns, take_slot, SendMessage};
use crate::turn::{remote_attempt, remote_stop, remote_stream, TurnEvent, TurnOptions, TurnSlot};
use crate::AppState;

/// The body of `POST /v1/responses`; fields OpenAI defines that turnlog does not act on
/// are refused when they would change the answer (`tools`) and ignored otherwise.
#[derive(Debug, Deserialize)]
pub struct CreateResponse {
    #[serde(default)]
    model: Option<String>,
    input: Input,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    conversation: Option<ConversationRef>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    background: bool,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

#[derive(Debug, Deserialize)]
struct InputItem {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ConversationRef {
    Id(String),
    Object { id: String },
}

/// The user's text of this turn: a string, or the text of user message items.
fn user_input(input: &Input) -> Result<UserInput, OaiError> {
    let items = match input {
        Input::Text(t) => return Ok(UserInput { text: t.clone(), ..Default::default() }),
        Input::Items(items) => items,
    };
    let mut texts = Vec::new();
    let mut input = UserInput::default();
    for item in items {
        match item.role.as_deref() {
            Some("user") => texts.push(user_content(item.content.as_ref(), &mut input)?),
            Some("system" | "developer") => {
                return Err(OaiError::bad_request("send system text as `instructions`"));
            }
            _ => {
                return Err(OaiError::bad_request(
                    "input items must be user messages; earlier turns belong in the conversation \
                     (POST /v1/conversations/{id}/items), or send store: false with the whole history",
                ))
            }
        }
    }
    input.text = texts.join("\n\n");
    Ok(input)
}

/// A stored turn's input: its text and the uploaded files it attaches (DESIGN §12).
#[derive(Debug, Default)]
struct UserInput {
    text: String,
    images: Vec<String>,
    documents: Vec<String>,
}

/// A user item's text; its `input_image` and `input_file` parts, by `file_id`, go to
/// `input` (bytes inline are refused: upload them once, send the id every time).
fn user_content(content: Option<&Content>, input: &mut UserInput) -> Result<String, OaiError> {
    let Some(Content::Parts(parts)) = content else { return content_text(content) };
    let mut text = String::new();
    for part in parts {
        let kind = part.get("type").and_then(Value::as_str);
        let file_id = part.get("file_id").and_then(Value::as_str);
        match (kind, file_id) {
            (Some("input_image"), Some(id)) => input.images.push(id.to_owned()),
            (Some("input_file"), Some(id)) => input.documents.push(id.to_owned()),
            (Some("input_image" | "input_file"), None) => {
                return Err(OaiError::bad_request(
                    "send an image or a file by file_id: upload it with POST /v1/files first",
                ))
            }
            _ => text.push_str(part_text(part)?),
        }
    }
    Ok(text)
}

/// What a created response's object repeats of its request.
#[derive(Debug, Clone)]
struct Echo {
    instructions: Option<String>,
    previous_response_id: Option<String>,
    max_output_tokens: Option<u32>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    store: bool,
    background: bool,
}

impl Default for Echo {
    fn default() -> Self {
        Self {
            instructions: None,
            previous_response_id: None,
            max_output_tokens: None,
            temperature: None,
            top_p: None,
            store: true,
            background: false,
        }
    }
}

/// Create a model response (OpenAI's Responses API): one turn of a conversation.
#[utoipa::path(
    post, path = "/v1/responses", tag = "openai", security(("bearer" = [])),
    request_body(content = Object, description = "OpenAI's `ResponseCreateParams`"),
    responses(
        (status = 200, description = "A `response` object, or with `stream: true` text/event-stream of `response.*` events ending with `data: [DONE]`", body = Object),
        (status = 400, body = Object), (status = 404, body = Object), (status = 409, body = Object),
    )
)]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    OaiBody(body): OaiBody,
) -> Result<Response, OaiError> {
    let req: CreateResponse = serde_json::from_slice(&body).map_err(|e| {
        OaiError::bad_request(format!("the request body is not a valid response request: {e}"))
    })?;
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(OaiError::bad_request("tools are not supported: turnlog does not run tools yet"));
    }
    if req.store == Some(false) {
        if req.background {
            return Err(OaiError::bad_request("background responses are stored: send store: true"));
        }
        if req.conversation.is_some() || req.previous_response_id.is_some() {
            return Err(OaiError::bad_request(
                "store: false keeps nothing: it cannot continue a conversation or a previous response",
            ));
        }
        return pass_through(&app, &caller, req).await;
    }
    if req.conversation.is_some() && req.previous_response_id.is_some() {
        return Err(OaiError::bad_request("send conversation or previous_response_id, not both"));
    }
    if req.instructions.as_ref().is_some_and(|i| i.len() > MAX_SYSTEM_PROMPT_BYTES) {
        return Err(OaiError::bad_request(format!(
            "instructions take more than {MAX_SYSTEM_PROMPT_BYTES} bytes"
        )));
    }
    let input = user_input(&req.input)?;
    let message = SendMessage {
        text: input.text,
        category: None,
        model: req.model.clone(),
        images: input.images,
        documents: input.documents,
        edit_of: None,
    };
    let message = prepared(&app, caller.as_str(), &message).await?;
    let (session, create) = target(&app, &caller, &req).await?;
    let options = TurnOptions {
        system: req.instructions.clone(),
        max_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        ..Default::default()
    };
    let echo = echo_of(&req);
    let events = begin_turn(&app, &caller, session, message, None, create, options).await?;
    let translated = translate(app.clone(), caller.as_str().to_owned(), events, echo);
    if req.stream {
        return Ok(sse(translated, None));
    }
    if req.background {
        // Answered at once, `in_progress`; the turn runs on by itself (as every turn does),
        // and the client polls or re-attaches by the response's id.
        return Ok(Json(created_response(translated).await).into_response());
    }
    final_response(translated).await
}

/// `store: false` (DESIGN §13): a stateless client sends its whole history as `input`; it
/// goes to the gateway as it is (instructions first), is answered in the same format, and
/// nothing is stored — no session, no event, no turn.
async fn pass_through(app: &AppState, caller: &Caller, req: CreateResponse) -> Result<Response, OaiError> {
    let owner = caller.as_str().to_owned();
    let upstream = app.upstream.clone().ok_or_else(|| {
        OaiError(crate::error::ApiError::Unavailable(
            "no model gateway is configured (TURNLOG_LLM_URL)".into(),
        ))
    })?;
    let model = req.model.clone().unwrap_or_else(|| app.config.model.clone());
    crate::validate::model(&app.config, &model)?;
    let mut messages = Vec::new();
    if let Some(system) = &req.instructions {
        messages.push(ChatMessage::text(Role::System, system.clone()));
    }
    messages.extend(stateless_messages(&req.input)?);
    if messages.iter().all(|m| m.role != Role::User) {
        return Err(OaiError::bad_request("input needs a user message"));
    }
    let params = RequestParams {
        stream: true,
        stream_options: Some(StreamOptions { include_usage: true }),
        max_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        ..Default::default()
    };
    let body = request_body(&model, &messages, &params, None);
    // Within the same caps as a stored turn, held until the answer is relayed.
    ready_for_turns(app)?;
    let slot = take_slot(app, caller)?;
    let chat = upstream.stream_body(&body).await.map_err(|e| {
        tracing::warn!(error = %e, "upstream failed (store: false)");
        OaiError(crate::error::ApiError::Unavailable(e.public_message()))
    })?;
    let attempt = Uuid::now_v7().hyphenated().to_string();
    let meta =
        TurnEvent { id: 1, event: "meta".into(), data: json!({"attempt_id": attempt, "model": model}) };
    let state = Relay { chat, meta: Some(meta), id: 2, usage: None, finish: None, done: false, _slot: slot };
    let events = futures::stream::unfold(state, |mut s| async move {
        if let Some(meta) = s.meta.take() {
            return Some((meta, s));
        }
        if s.done {
            return None;
        }
        loop {
            let (event, data) = match s.chat.next().await {
                Ok(Some(StreamItem::Text(t))) => ("delta", json!({"text": t})),
                Ok(Some(StreamItem::Reasoning(t))) => ("reasoning", json!({"text": t})),
                Ok(Some(StreamItem::Usage(u))) => {
                    s.usage =
                        Some(json!([u.prompt_tokens, u.completion_tokens, u.cached_tokens.unwrap_or(0)]));
                    continue;
                }
                Ok(Some(StreamItem::Finish(f))) => {
                    s.finish = Some(f);
                    continue;
                }
                Ok(None) => {
                    ("end", json!({"status": "completed", "finish_reason": s.finish, "usage": s.usage}))
                }
                Err(e) => ("end", json!({"status": "failed", "message": e.public_message()})),
            };
            s.done = event == "end";
            let e = TurnEvent { id: s.id, event: event.into(), data };
            s.id += 1;
            return Some((e, s));
        }
    });
    let echo = Echo { store: false, ..echo_of(&req) };
    let translated = translate(app.clone(), owner, events.boxed(), echo);
    if req.stream {
        return Ok(sse(translated, None));
    }
    final_response(translated).await
}

/// A gateway's stream read as a turn's native events (`store: false`).
struct Relay {
    chat: ChatStream,
    meta: Option<TurnEvent>,
    id: u64,
    usage: Option<Value>,
    finish: Option<String>,
    done: bool,
    /// The owner's turn slot, given back when the relay ends or its client leaves.
    _slot: TurnSlot,
}

/// The messages of a stateless request's `input`: its whole history.
fn stateless_messages(input: &Input) -> Result<Vec<ChatMessage>, OaiError> {
    let items = match input {
        Input::Text(t) => return Ok(vec![ChatMessage::text(Role::User, t.clone())]),
        Input::Items(items) => items,
    };
    items
        .iter()
        .map(|item| {
            let role = match item.role.as_deref() {
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                Some("system" | "developer") => Role::System,
                _ => return Err(OaiError::bad_request("input items must be messages with a role")),
            };
            Ok(ChatMessage::text(role, content_text(item.content.as_ref())?))
        })
        .collect()
}

/// The text of an input item's content: a string, or its text parts joined.
fn content_text(content: Option<&Content>) -> Result<String, OaiError> {
    match content {
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            parts.iter().map(part_text).collect::<Result<Vec<_>, _>>().map(|texts| texts.join(""))
        }
        None => Ok(String::new()),
    }
}

/// A content part's text: `input_text` or `output_text`.
fn part_text(part: &Value) -> Result<&str, OaiError> {
    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
        (Some("input_text" | "output_text"), Some(t)) => Ok(t),
        (kind, _) => Err(OaiError::bad_request(format!(
            "input content of type {} is not supported here; send input_text (and, on a stored \
             response, input_image or input_file by file_id)",
            kind.unwrap_or("(none)")
        ))),
    }
}

/// The response object of a stream's terminal event (it ends with one).
async fn last_response(translated: BoxStream<'static, Value>) -> Option<Value> {
    let mut last = translated.fold(None, |_, e| async move { Some(e) }).await?;
    last.get_mut("response").map(Value::take)
}

/// The response object of a stream's first event, `response.created` (`in_progress`).
async fn created_response(mut translated: BoxStream<'static, Value>) -> Value {
    let first = translated.next().await;
    first.and_then(|mut e| e.get_mut("response").map(Value::take)).unwrap_or_default()
}

/// The last event's response: what a non-streamed request answers.
async fn final_response(translated: BoxStream<'static, Value>) -> Result<Response, OaiError> {
    match last_response(translated).await {
        Some(response) => Ok(Json(response).into_response()),
        None => Err(OaiError(crate::error::ApiError::internal(anyhow::anyhow!(
            "the turn ended without a response"
        )))),
    }
}

fn echo_of(req: &CreateResponse) -> Echo {
    Echo {
        instructions: req.instructions.clone(),
        previous_response_id: req.previous_response_id.clone(),
        max_output_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        store: true,
        background: req.background,
    }
}

/// The session the response runs in, and the `create` to submit first when it is new: the
/// named conversation; the conversation of `previous_response_id`, forked after it when
/// it is not that conversation's latest answer (DESIGN §10); or a new conversation.
async fn target(
    app: &AppState,
    caller: &Caller,
    req: &CreateResponse,
) -> Result<(SessionId, Option<AppendRequest>), OaiError> {
    if let Some(c) = &req.conversation {
        let id = match c {
            ConversationRef::Id(id) | ConversationRef::Object { id } => parse_conversation(id)?,
        };
        owned_session(app, caller, id).await.map_err(|_| OaiError::not_found("conversation"))?;
        return Ok((id, None));
    }
    if let Some(previous) = &req.previous_response_id {
        let attempt = parse_response(previous)?;
        let event = read::attempt_event(&app.pool, caller.as_str(), &attempt)
            .await?
            .ok_or_else(|| OaiError::not_found("previous response"))?;
        let session = SessionId(event.session_id);
        let row = owned_session(app, caller, session)
            .await
            .map_err(|_| OaiError::not_found("previous response"))?;
        let later = read::last_user_message(&app.pool, caller.as_str(), session).await?;
        if later.is_some_and(|(user_seq, _, _)| user_seq > event.seq) {
            let create = fork_request(app, caller, &row, event.seq, None, "response").await?;
            return Ok((create.session_id, Some(create)));
        }
        return Ok((session, None));
    }
    let id = SessionId::new();
    Ok((id, Some(AppendRequest::create(id, caller.as_str(), None))))
}

#[derive(Debug, Deserialize)]
pub struct RetrieveParams {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    starting_after: Option<u64>,
}

/// Retrieve a response; with `stream=true`, re-attach: its events from `response.created`
/// (after `starting_after`, a `sequence_number`), live while it runs.
#[utoipa::path(
    get, path = "/v1/responses/{id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "resp_<32 hex>"),
           ("stream" = Option<bool>, Query, description = "Re-attach as an event stream"),
           ("starting_after" = Option<u64>, Query, description = "The last sequence_number the client has")),
    responses((status = 200, body = Object), (status = 404, body = Object))
)]
pub async fn retrieve(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
    OaiQuery(params): OaiQuery<RetrieveParams>,
) -> Result<Response, OaiError> {
    let owner = caller.as_str().to_owned();
    match locate(&app, &caller, &parse_response(&id)?).await? {
        Located::Running(_, events) => {
            let translated = translate(app.clone(), owner, events, Echo::default());
            if params.stream == Some(true) {
                return Ok(sse(translated, params.starting_after));
            }
            // A running response's object as it was created (status `in_progress`).
            Ok(Json(created_response(translated).await).into_response())
        }
        Located::Stored(event) => {
            let response = from_log(&event, &Echo::default());
            if params.stream == Some(true) {
                let events = replay_finished(response);
                return Ok(sse(futures::stream::iter(events).boxed(), params.starting_after));
            }
            Ok(Json(response).into_response())
        }
    }
}

/// Cancel a response (= stop: its partial answer is kept as an incomplete item), on
/// whichever ingress copy runs it.
#[utoipa::path(
    post, path = "/v1/responses/{id}/cancel", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "resp_<32 hex>")),
    responses((status = 200, body = Object), (status = 404, body = Object))
)]
pub async fn cancel(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
) -> Result<Response, OaiError> {
    let attempt = parse_response(&id)?;
    let owner = caller.as_str().to_owned();
    if let Located::Running(session, events) = locate(&app, &caller, &attempt).await? {
        match app.turns.by_attempt(&attempt) {
            Some(turn) => turn.stop(PendingReason::Stopped),
            None => {
                remote_stop(&app, session).await;
            }
        }
        if let Some(response) =
            last_response(translate(app.clone(), owner.clone(), events, Echo::default())).await
        {
            return Ok(Json(response).into_response());
        }
    }
    let event = read::attempt_event(&app.pool, &owner, &attempt)
        .await?
        .ok_or_else(|| OaiError::not_found("response"))?;
    Ok(Json(from_log(&event, &Echo::default())).into_response())
}

/// The input items of a response: the user message its turn answered.
#[utoipa::path(
    get, path = "/v1/responses/{id}/input_items", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "resp_<32 hex>")),
    responses((status = 200, body = Object), (status = 404, body = Object))
)]
pub async fn input_items(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
) -> Result<Json<Value>, OaiError> {
    let owner = caller.as_str();
    // The session, and a seq after the turn's user message.
    let (session, after_question) = match locate(&app, &caller, &parse_response(&id)?).await? {
        Located::Running(session, mut events) => {
            let meta = events.next().await;
            (session, meta.and_then(|m| m.data["user_seq"].as_i64()).unwrap_or(0) + 1)
        }
        Located::Stored(event) => (SessionId(event.session_id), event.seq),
    };
    let events =
        read::all_events(&app.pool, owner, session).await?.ok_or_else(|| OaiError::not_found("response"))?;
    let question = events.iter().rev().filter(|e| e.seq < after_question).find_map(|e| match &e.body {
        EventBody::UserMessage(m) => Some(user_item(e.event_id.as_uuid(), &m.text)),
        _ => None,
    });
    Ok(Json(list_page(question.into_iter().collect(), false)))
}

/// Where a response is: running (on this copy or another), with its session and its native
/// events from the first; or stored, by its attempt's newest event.
enum Located {
    Running(SessionId, BoxStream<'static, TurnEvent>),
    Stored(StoredEvent),
}

/// Finds the caller's response of attempt `attempt` (DESIGN §13): this copy's running
/// turns; the log, when it holds the attempt's outcome; another copy running it (asked on
/// its attempt subject); else the log's latest checkpoint (a copy that died mid-answer).
async fn locate(app: &AppState, caller: &Caller, attempt: &str) -> Result<Located, OaiError> {
    let not_found = || OaiError::not_found("response");
    if let Some(turn) = app.turns.by_attempt(attempt) {
        owned_session(app, caller, turn.session).await.map_err(|_| not_found())?;
        return Ok(Located::Running(turn.session, follow_local(turn, 0)));
    }
    let stored = read::attempt_event(&app.pool, caller.as_str(), attempt).await?;
    if stored.as_ref().is_some_and(is_outcome) {
        return Ok(Located::Stored(stored.ok_or_else(not_found)?));
    }
    if let Some(session) = remote_attempt(app, attempt).await {
        owned_session(app, caller, session).await.map_err(|_| not_found())?;
        if let Some(events) = remote_stream(app, session, 0).await {
            let mut events = events.boxed().peekable();
            let first = std::pin::Pin::new(&mut events).peek().await;
            if first.is_some_and(|m| m.data["attempt_id"] == attempt) {
                return Ok(Located::Running(session, events.boxed()));
            }
        }
    }
    stored.map(Located::Stored).ok_or_else(not_found)
}

/// Whether an attempt's event is its outcome (a checkpoint is not).
fn is_outcome(event: &StoredEvent) -> bool {
    event.kind != "pending_state" || event.payload.get("reason").is_some_and(|r| !r.is_null())
}

/// A response's object read from its attempt's newest event.
fn from_log(event: &StoredEvent, echo: &Echo) -> Value {
    let session = SessionId(event.session_id);
    let body = EventBody::decode_str(&event.kind, &event.payload, event.seq).ok();
    let mut r = Snapshot::new(String::new(), session, echo.clone());
    match body {
        Some(EventBody::AssistantTurn(a)) => {
            r.set_attempt(a.attempt_id.as_deref());
            r.model = a.model.clone().unwrap_or_default();
            for b in &a.ui.blocks {
                if b.kind == BlockType::Reasoning {
                    r.reasoning.push_str(b.text.as_deref().unwrap_or_default());
                }
            }
            r.text = a.ui_text();
            r.usage = a.usage.map(|u| (u.input_tokens, u.output_tokens, u.cached_input_tokens.unwrap_or(0)));
            let length = a.finish_reason.as_deref() == Some("length");
            r.finish(if length { Status::Incomplete(Some("max_output_tokens")) } else { Status::Completed })
        }
        Some(EventBody::PendingState(p)) => {
            r.set_attempt(p.attempt_id.as_deref());
            r.model = p.request.as_ref().map(|q| q.model.clone()).unwrap_or_default();
            r.text = p.partial;
            match p.reason {
                Some(PendingReason::Stopped) => r.finish(Status::Cancelled),
                _ => r.finish(Status::Incomplete(None)),
            }
        }
        Some(EventBody::TurnFailed(f)) => {
            r.set_attempt(f.attempt_id.as_deref());
            r.model = f.request.as_ref().map(|q| q.model.clone()).unwrap_or_default();
            if f.code == "interrupted" && f.message.starts_with("stopped") {
                r.finish(Status::Cancelled)
            } else {
                r.finish(Status::Failed(f.message))
            }
        }
        _ => r.finish(Status::Failed("the response could not be read".into())),
    }
}

/// The events of a finished response, as a re-attach replays them.
fn replay_finished(response: Value) -> Vec<Value> {
    let mut events = vec![
        json!({"type": "response.created", "response": in_progress(&response)}),
        json!({"type": "response.in_progress", "response": in_progress(&response)}),
    ];
    let items = response["output"].as_array().cloned().unwrap_or_default();
    for (index, item) in items.iter().enumerate() {
        let id = item["id"].clone();
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        if added["type"] == "message" {
            added["content"] = json!([]);
        }
        events.push(json!({"type": "response.output_item.added", "output_index": index, "item": added}));
        let part = &item["content"][0];
        let text = part["text"].clone();
        let (part_type, delta_type, done_type) = if item["type"] == "reasoning" {
            ("reasoning_text", "response.reasoning_text.delta", "response.reasoning_text.done")
        } else {
            ("output_text", "response.output_text.delta", "response.output_text.done")
        };
        events.push(json!({"type": "response.content_part.added", "item_id": id, "output_index": index,
            "content_index": 0, "part": empty_part(part_type)}));
        let mut delta = json!({"type": delta_type, "item_id": id, "output_index": index, "content_index": 0, "delta": text});
        let mut done = json!({"type": done_type, "item_id": id, "output_index": index, "content_index": 0, "text": text});
        if part_type == "output_text" {
            delta["logprobs"] = json!([]);
            done["logprobs"] = json!([]);
        }
        events.push(delta);
        events.push(done);
        events.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": index,
            "content_index": 0, "part": part}));
        events.push(json!({"type": "response.output_item.done", "output_index": index, "item": item}));
    }
    events.push(json!({"type": terminal_type(&response), "response": response}));
    events
}

fn empty_part(kind: &str) -> Value {
    match kind {
        "output_text" => json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
        _ => json!({"type": kind, "text": ""}),
    }
}

fn in_progress(response: &Value) -> Value {
    let mut r = response.clone();
    r["status"] = json!("in_progress");
    r["output"] = json!([]);
    r["usage"] = Value::Null;
    r["error"] = Value::Null;
    r["incomplete_details"] = Value::Null;
    r
}

fn terminal_type(response: &Value) -> &'static str {
    match response["status"].as_str() {
        Some("completed") => "response.completed",
        Some("failed") => "response.failed",
        _ => "response.incomplete",
    }
}

enum Status {
    Completed,
    Cancelled,
    Incomplete(Option<&'static str>),
    Failed(String),
}

/// A response as it stands: what its object is built from.
struct Snapshot {
    owner: String,
    session: SessionId,
    attempt: Option<Uuid>,
    model: String,
    text: String,
    reasoning: String,
    usage: Option<(u64, u64, u64)>,
    echo: Echo,
    message_item: String,
    reasoning_item: String,
}

impl Snapshot {
    fn new(owner: String, session: SessionId, echo: Echo) -> Self {
        Self {
            owner,
            session,
            attempt: None,
            model: String::new(),
            text: String::new(),
            reasoning: String::new(),
            usage: None,
            echo,
            message_item: message_id(Uuid::nil()),
            reasoning_item: reasoning_id(Uuid::nil()),
        }
    }

    fn attempt(&self) -> Uuid {
        self.attempt.unwrap_or_default()
    }

    /// Names the attempt, and with it the ids of its items (made once, not per delta).
    fn set_attempt(&mut self, attempt: Option<&str>) {
        self.attempt = attempt.and_then(|a| Uuid::parse_str(a).ok());
        self.message_item = message_id(self.attempt());
        self.reasoning_item = reasoning_id(self.attempt());
    }

    fn message_id(&self) -> &str {
        &self.message_item
    }

    fn reasoning_id(&self) -> &str {
        &self.reasoning_item
    }

    /// The object with `status` and the output so far.
    fn object(&self, status: &str, output: Vec<Value>) -> Value {
        let attempt = self.attempt();
        let created_at = attempt.get_timestamp().map_or(0, |t| t.to_unix().0);
        let usage = self.usage.map(|(input, output, cached)| {
            json!({
                "input_tokens": input,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + output,
            })
        });
        json!({
            "id": response_id(attempt),
            "object": "response",
            "created_at": created_at,
            "status": status,
            "background": self.echo.background,
            "error": null,
            "incomplete_details": null,
            "instructions": self.echo.instructions,
            "max_output_tokens": self.echo.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": false,
            "previous_response_id": self.echo.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "store": self.echo.store,
            "temperature": self.echo.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": self.echo.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": {},
            // A stored response's conversation; none for `store: false`.
            "conversation": self.echo.store.then(|| json!({"id": conversation_id(self.session)})),
        })
    }

    /// The finished object.
    fn finish(&self, status: Status) -> Value {
        let item_status = if matches!(status, Status::Completed) { "completed" } else { "incomplete" };
        let mut output = Vec::new();
        if !self.reasoning.is_empty() {
            output.push(reasoning_item(self.reasoning_id(), &self.reasoning));
        }
        if !self.text.is_empty() {
            output.push(output_message(self.message_id(), &self.text, item_status));
        }
        let (name, details, error) = match status {
            Status::Completed => ("completed", Value::Null, Value::Null),
            Status::Cancelled => ("cancelled", Value::Null, Value::Null),
            Status::Incomplete(reason) => ("incomplete", json!({ "reason": reason }), Value::Null),
            Status::Failed(message) => {
                ("failed", Value::Null, json!({"code": "server_error", "message": message}))
            }
        };
        let mut r = self.object(name, output);
        r["incomplete_details"] = details;
        r["error"] = error;
        r
    }
}

/// Which item the stream has open.
#[derive(PartialEq)]
enum Open {
    None,
    Reasoning,
    Message,
}

/// The native events of a turn as OpenAI's `response.*` events (without their
/// `sequence_number`, which [`sse`] numbers: a pure function of the native events, so a
/// re-attach from the turn's first event numbers them alike). Ends with the terminal event,
/// whose response is read back from the log (usage included).
fn translate(
    app: AppState,
    owner: String,
    events: BoxStream<'static, TurnEvent>,
    echo: Echo,
) -> BoxStream<'static, Value> {
    let translator = Translator {
        app,
        r: Snapshot::new(owner, SessionId(Uuid::nil()), echo),
        open: Open::None,
        index: 0,
        failure: None,
        events,
    };
    futures::stream::unfold(translator, |mut t| async move {
        let e = t.events.next().await?;
        let out = t.on(e).await;
        Some((futures::stream::iter(out), t))
    })
    .flatten()
    .boxed()
}

/// [`translate`]'s state: the response so far and the item the stream has open.
struct Translator {
    app: AppState,
    r: Snapshot,
    open: Open,
    index: usize,
    failure: Option<String>,
    events: BoxStream<'static, TurnEvent>,
}

impl Translator {
    /// The OpenAI events of one native event.
    async fn on(&mut self, e: TurnEvent) -> Vec<Value> {
        let Self { app, r, open, index, failure, .. } = self;
        let mut out = Vec::new();
        match e.event.as_str() {
            "meta" => {
                r.session = e.data["session_id"].as_str().and_then(|s| s.parse().ok()).unwrap_or(r.session);
                r.set_attempt(e.data["attempt_id"].as_str());
                r.model = e.data["model"].as_str().unwrap_or_default().to_owned();
                let created = r.object("in_progress", Vec::new());
                out.push(json!({"type": "response.created", "response": created}));
                out.push(
                    json!({"type": "response.in_progress", "response": r.object("in_progress", Vec::new())}),
                );
            }
            "reasoning" if *open != Open::Message => {
                let delta = e.data["text"].as_str().unwrap_or_default();
                if *open == Open::None {
                    let item = json!({"type": "reasoning", "id": r.reasoning_id(), "summary": [], "content": [], "status": "in_progress"});
                    out.push(
                        json!({"type": "response.output_item.added", "output_index": *index, "item": item}),
                    );
                    out.push(json!({"type": "response.content_part.added", "item_id": r.reasoning_id(),
                        "output_index": *index, "content_index": 0, "part": empty_part("reasoning_text")}));
                    *open = Open::Reasoning;
                }
                r.reasoning.push_str(delta);
                out.push(json!({"type": "response.reasoning_text.delta", "item_id": r.reasoning_id(),
                    "output_index": *index, "content_index": 0, "delta": delta}));
            }
            "delta" => {
                let delta = e.data["text"].as_str().unwrap_or_default();
                if *open == Open::Reasoning {
                    close_reasoning(r, *index, &mut out);
                    *index += 1;
                }
                if *open != Open::Message {
                    let item = json!({"type": "message", "id": r.message_id(), "role": "assistant", "status": "in_progress", "content": []});
                    out.push(
                        json!({"type": "response.output_item.added", "output_index": *index, "item": item}),
                    );
                    out.push(json!({"type": "response.content_part.added", "item_id": r.message_id(),
                        "output_index": *index, "content_index": 0, "part": empty_part("output_text")}));
                    *open = Open::Message;
                }
                r.text.push_str(delta);
                out.push(json!({"type": "response.output_text.delta", "item_id": r.message_id(),
                    "output_index": *index, "content_index": 0, "delta": delta, "logprobs": []}));
            }
            "error" => *failure = e.data["message"].as_str().map(str::to_owned),
            "end" => {
                let stored = stored_outcome(app, r, &e.data).await;
                let response = stored.unwrap_or_else(|| {
                    // Not from the log (`store: false`): the end carries the usage.
                    if let Some(u) = e.data["usage"].as_array() {
                        let n = |k: usize| u.get(k).and_then(Value::as_u64).unwrap_or(0);
                        r.usage = Some((n(0), n(1), n(2)));
                    }
                    let length = e.data["finish_reason"] == "length";
                    let status = match e.data["status"].as_str() {
                        Some("completed") if length => Status::Incomplete(Some("max_output_tokens")),
                        Some("completed") => Status::Completed,
                        Some("stopped") => Status::Cancelled,
                        Some("interrupted") => Status::Incomplete(None),
                        _ => Status::Failed(
                            failure
                                .clone()
                                .or_else(|| e.data["message"].as_str().map(str::to_owned))
                                .unwrap_or_else(|| "the response failed".into()),
                        ),
                    };
                    r.finish(status)
                });
                let item_status = if response["status"] == "completed" { "completed" } else { "incomplete" };
                match open {
                    Open::Reasoning => close_reasoning(r, *index, &mut out),
                    Open::Message => {
                        let id = r.message_id();
                        let part =
                            json!({"type": "output_text", "text": r.text, "annotations": [], "logprobs": []});
                        out.push(
                            json!({"type": "response.output_text.done", "item_id": id, "output_index": *index,
                            "content_index": 0, "text": r.text, "logprobs": []}),
                        );
                        out.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": *index,
                            "content_index": 0, "part": part}));
                        out.push(json!({"type": "response.output_item.done", "output_index": *index,
                            "item": output_message(id, &r.text, item_status)}));
                    }
                    Open::None => {}
                }
                out.push(json!({"type": terminal_type(&response), "response": response}));
            }
            _ => {}
        }
        out
    }
}

fn close_reasoning(r: &Snapshot, index: usize, out: &mut Vec<Value>) {
    let id = r.reasoning_id();
    let part = json!({"type": "reasoning_text", "text": r.reasoning});
    out.push(json!({"type": "response.reasoning_text.done", "item_id": id, "output_index": index,
        "content_index": 0, "text": r.reasoning}));
    out.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": index,
        "content_index": 0, "part": part}));
    out.push(json!({"type": "response.output_item.done", "output_index": index,
        "item": reasoning_item(id, &r.reasoning)}));
}

/// The response object of a turn's stored outcome (the `end` names its seq), with the
/// request's echo; None when it cannot be read.
async fn stored_outcome(app: &AppState, r: &Snapshot, end: &Value) -> Option<Value> {
    let seq = ["assistant_seq", "pending_seq", "failed_seq"].iter().find_map(|k| end[*k].as_i64())?;
    let event = read::event_at(&app.pool, &r.owner, r.session, seq).await.ok()??;
    let mut response = from_log(&event, &r.echo);
    response["conversation"] = json!({"id": conversation_id(r.session)});
    Some(response)
}

/// OpenAI's stream: `event: <type>`, `sequence_number` counted from 0, events at or before
/// `starting_after` left out, then `data: [DONE]`.
fn sse(events: BoxStream<'static, Value>, starting_after: Option<u64>) -> Response {
    let numbered = events
        .enumerate()
        .filter_map(move |(n, mut e)| {
            let n = n as u64;
            e["sequence_number"] = json!(n);
            futures::future::ready(starting_after.is_none_or(|after| n > after).then_some(e))
        })
        .map(|e| {
            let kind = e["type"].as_str().unwrap_or("message").to_owned();
            Ok::<_, Infallible>(SseEvent::default().event(kind).data(e.to_string()))
        })
        .chain(futures::stream::once(async { Ok(SseEvent::default().data("[DONE]")) }));
    let mut response = Sse::new(numbered).keep_alive(KeepAlive::default()).into_response();
    let headers: &mut HeaderMap = response.headers_mut();
    headers.insert("x-accel-buffering", axum::http::HeaderValue::from_static("no"));
    headers.insert("cache-control", axum::http::HeaderValue::from_static("no-cache"));
    response
}
