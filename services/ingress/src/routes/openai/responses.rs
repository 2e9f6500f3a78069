//! `POST /v1/responses` and friends: a response is one turn's attempt, streamed as
//! OpenAI's `response.*` events translated from the turn's native events (DESIGN §13).

mod translate;

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
use turnlog_core::events::{EventBody, PendingReason, Usage};
use turnlog_core::ids::SessionId;
use turnlog_core::request_body::{request_body, RequestParams, StreamOptions};
use turnlog_core::stream::{FailureCode, Meta, StreamError, Text, TurnEnd, TurnEvent, TurnStatus};
use turnlog_core::{ChatMessage, Role};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read::{self, StoredEvent};
use turnlog_runtime::upstream::{ChatStream, StreamItem};
use uuid::Uuid;

use super::{conversation_id, list_page, parse_conversation, parse_response, user_item};
use super::{OaiBody, OaiError, OaiPath, OaiQuery};
use crate::auth::Caller;

use crate::sessions::{fork_request, owned_session};
use crate::turn::{begin_turn, follow_local, prepared, ready_for_turns, take_slot, NewMessage};
use crate::turn::{remote_attempt, remote_stop, remote_stream, StreamEvent, TurnOptions, TurnSlot};
use crate::AppState;
use translate::{from_log, replay_finished, Echo, Translator};

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
    let message = NewMessage {
        text: input.text,
        category: None,
        model: req.model.clone(),
        images: input.images,
        documents: input.documents,
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
    let meta = Meta { attempt_id: Some(attempt), model: Some(model), ..Default::default() };
    let state = Relay {
        chat,
        queue: [TurnEvent::Meta(meta)].into(),
        id: 1,
        usage: None,
        finish: None,
        done: false,
        _slot: slot,
    };
    let events = futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.queue.pop_front() {
                let e = StreamEvent { id: s.id, event };
                s.id += 1;
                return Some((e, s));
            }
            if s.done {
                return None;
            }
            match s.chat.next().await {
                Ok(Some(StreamItem::Text(text))) => s.queue.push_back(TurnEvent::Delta(Text { text })),
                Ok(Some(StreamItem::Reasoning(text))) => {
                    s.queue.push_back(TurnEvent::Reasoning(Text { text }))
                }
                Ok(Some(StreamItem::Usage(u))) => {
                    s.usage = Some(Usage {
                        input_tokens: u64::from(u.prompt_tokens),
                        output_tokens: u64::from(u.completion_tokens),
                        cached_input_tokens: u.cached_tokens.map(u64::from),
                    });
                }
                Ok(Some(StreamItem::Finish(f))) => s.finish = Some(f),
                Ok(None) => {
                    let end = TurnEnd {
                        usage: s.usage,
                        finish_reason: Some(s.finish.take()),
                        ..TurnEnd::new(None, TurnStatus::Completed)
                    };
                    s.queue.push_back(TurnEvent::End(end));
                    s.done = true;
                }
                Err(e) => {
                    let error = StreamError { code: FailureCode::UpstreamError, message: e.public_message() };
                    s.queue.push_back(TurnEvent::Error(error));
                    s.queue.push_back(TurnEvent::End(TurnEnd::new(None, TurnStatus::Failed)));
                    s.done = true;
                }
            }
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
    /// Events read and not yet given out.
    queue: std::collections::VecDeque<TurnEvent>,
    /// The next event's id.
    id: u64,
    usage: Option<Usage>,
    finish: Option<String>,
    /// The gateway's stream is over.
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
            let user_seq = meta.and_then(|m| match m.event {
                TurnEvent::Meta(m) => m.user_seq,
                _ => None,
            });
            (session, user_seq.unwrap_or(0) + 1)
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
    Running(SessionId, BoxStream<'static, StreamEvent>),
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
            let ours = |e: &StreamEvent| matches!(&e.event, TurnEvent::Meta(m) if m.attempt_id.as_deref() == Some(attempt));
            if first.is_some_and(ours) {
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

/// The native events of a turn as OpenAI's `response.*` events (without their
/// `sequence_number`, which [`sse`] numbers: a pure function of the native events, so a
/// re-attach from the turn's first event numbers them alike). Ends with the terminal event,
/// whose response is read back from the log (usage included) when the `end` names the
/// turn's outcome: the one read here; the rest is [`Translator`]'s.
fn translate(
    app: AppState,
    owner: String,
    events: BoxStream<'static, StreamEvent>,
    echo: Echo,
) -> BoxStream<'static, Value> {
    let state = (Translator::new(echo), events, app, owner);
    futures::stream::unfold(state, |(mut t, mut events, app, owner)| async move {
        let e = events.next().await?;
        let out = match &e.event {
            TurnEvent::End(end) => {
                let stored = stored_outcome(&app, &owner, t.session(), end, t.echo()).await;
                t.end(end, stored)
            }
            event => t.on(event),
        };
        Some((futures::stream::iter(out), (t, events, app, owner)))
    })
    .flatten()
    .boxed()
}

/// The response object of a turn's stored outcome (the `end` names its seq), with the
/// request's echo; None when there is none or it cannot be read.
async fn stored_outcome(
    app: &AppState,
    owner: &str,
    session: SessionId,
    end: &TurnEnd,
    echo: &Echo,
) -> Option<Value> {
    let seq = end.outcome?.seq();
    let event = read::event_at(&app.pool, owner, session, seq).await.ok()??;
    let mut response = from_log(&event, echo);
    response["conversation"] = json!({"id": conversation_id(session)});
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
