//! Running a turn over HTTP (DESIGN.md §5, §7): send a message (or chat, creating the
//! session), stop, retry, and re-attach. Everything before the user message is durable is
//! an ordinary JSON error; after it, the turn answers as an event stream that always ends
//! with exactly one `end`, and it goes on (and is stored) if the client leaves.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use turnlog_core::events::{EventBody, EventKind, PendingReason, UserMessage};
use turnlog_core::ids::SessionId;
use turnlog_core::stream::{turn_end_from_log, Meta, TurnEnd};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read;
use turnlog_runtime::read::recorded_outcome;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::routes::forks::{create_fork, fork_request};
use crate::routes::sessions::owned_session;
use crate::turn::{
    remote_stop, remote_stream, start_turn, ActiveTurn, StreamEvent, TurnEvent, TurnOptions, TurnSlot,
    TurnStart,
};
use crate::writes::submit;
use crate::{files, validate, AppState, Ingress};

const KEEP_ALIVE: Duration = Duration::from_secs(15);
const IDEMPOTENCY_HEADER: &str = "idempotency-key";
const MAX_IDEMPOTENCY_KEY: usize = 200;
const MAX_NAME_CHARS: usize = 200;
const MAX_ATTACHMENTS: usize = 32;
/// Namespace of ids derived from an `Idempotency-Key`.
const IDEMPOTENCY_NS: Uuid = Uuid::from_u128(0x2b7e_1516_28ae_d2a6_abf7_1588_09cf_4f3c);

/// A message to send: the text, and optionally a category, a model and attachments.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SendMessage {
    /// 1 byte to 256 KiB.
    pub text: String,
    #[serde(default)]
    pub category: Option<String>,
    /// The model to call (default: TURNLOG_MODEL); one of TURNLOG_ALLOWED_MODELS when that is set.
    #[serde(default)]
    pub model: Option<String>,
    /// Ids of the caller's uploaded images (`POST /v1/files`).
    #[serde(default)]
    pub images: Vec<String>,
    /// Ids of the caller's uploaded documents; their markdown (512 KiB in all) goes with
    /// the message.
    #[serde(default)]
    pub documents: Vec<String>,
    /// Edit: the seq of a user message of this session. The message is sent instead into a
    /// new fork through the seq before it (DESIGN §10); the stream's `meta` names the fork.
    #[serde(default)]
    pub edit_of: Option<i64>,
}

/// `POST /v1/sessions/{id}/retry`: without `of`, run the last user message again after an
/// interrupted or failed turn; with `of`, regenerate that answer in a new fork.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryRequest {
    /// Regenerate: the seq of an answer (`assistant_turn`) of this session. Its user
    /// message runs again in a fork through that message (DESIGN §10).
    #[serde(default)]
    pub of: Option<i64>,
}

/// `POST /v1/chat`: a message to a session, or to a new one when `session_id` is absent.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    #[serde(default)]
    pub session_id: Option<Uuid>,
    pub text: String,
    #[serde(default)]
    pub category: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    /// Ids of the caller's uploaded images.
    #[serde(default)]
    pub images: Vec<String>,
    /// Ids of the caller's uploaded documents.
    #[serde(default)]
    pub documents: Vec<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Stopping {
    pub session_id: Uuid,
    pub stopping: bool,
}

/// The `user_message` a message becomes, checked: its text, names and model, its
/// attachments resolved (each must be one of `owner`'s live files, DESIGN §12) and its
/// size — all before anything is written, so a chat is refused before it creates a session.
pub(crate) async fn prepared(app: &Ingress, owner: &str, m: &SendMessage) -> Result<UserMessage, ApiError> {
    validate::text(&m.text)?;
    if m.images.len() + m.documents.len() > MAX_ATTACHMENTS {
        return Err(ApiError::bad_request(format!("at most {MAX_ATTACHMENTS} attachments")));
    }
    for value in [m.category.as_deref(), m.model.as_deref()].into_iter().flatten() {
        validate::storable("a name", value)?;
        if value.trim().is_empty() || value.chars().count() > MAX_NAME_CHARS {
            return Err(ApiError::bad_request(format!(
                "category and model are 1-{MAX_NAME_CHARS} characters"
            )));
        }
    }
    if let Some(model) = &m.model {
        validate::model(&app.config, model)?;
    }
    let (images, documents) =
        files::attachments(&app.pool, app.files.as_ref(), owner, &m.images, &m.documents).await?;
    validate::documents(documents.iter().map(|d| d.markdown.as_str()))?;
    let message = UserMessage {
        text: m.text.clone(),
        category: m.category.clone(),
        model_hint: m.model.clone(),
        images,
        documents,
        imported: None,
    };
    let body = EventBody::UserMessage(message.clone());
    validate::event(body.kind(), &body.to_payload())?;
    Ok(message)
}

pub(crate) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(IDEMPOTENCY_HEADER) else { return Ok(None) };
    let key = v.to_str().map_err(|_| ApiError::bad_request("Idempotency-Key must be visible ASCII"))?;
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY {
        return Err(ApiError::bad_request(format!("Idempotency-Key is 1-{MAX_IDEMPOTENCY_KEY} characters")));
    }
    Ok(Some(key.to_owned()))
}

/// An id derived from an `Idempotency-Key` for one purpose, so a resend names the same thing.
pub(crate) fn derived(owner: &str, purpose: &str, key: &str) -> Uuid {
    Uuid::new_v5(&IDEMPOTENCY_NS, format!("{owner}\n{purpose}\n{key}").as_bytes())
}

/// Send a message and stream the turn.
#[utoipa::path(
    post, path = "/v1/sessions/{id}/messages", tag = "turns", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"),
           ("Idempotency-Key" = Option<String>, Header, description = "A resent POST with the same key answers the same turn")),
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
    let message = prepared(&app, caller.as_str(), &body).await?;
    let session = owned_session(&app, &caller, id).await?;
    let Some(edit_of) = body.edit_of else { return send_turn(&app, &caller, id, message, key, None).await };
    let edited = read::event_at(&app.pool, caller.as_str(), id, edit_of).await?;
    if edited.is_none_or(|e| e.kind != "user_message") {
        return Err(ApiError::bad_request(format!(
            "edit_of must be the seq of a user message of this session; {edit_of} is not"
        )));
    }
    let create = fork_request(&app, &caller, &session, edit_of - 1, key.as_deref(), "edit").await?;
    let fork = create.session_id;
    tracing::Span::current().record("fork_id", tracing::field::display(fork));
    send_turn(&app, &caller, fork, message, key, Some(create)).await
}

/// Send a message to a session, or to a new one, and stream the turn.
#[utoipa::path(
    post, path = "/v1/chat", tag = "turns", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "A resent POST with the same key answers the same turn")),
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
    let message = SendMessage {
        text: body.text,
        category: body.category,
        model: body.model,
        images: body.images,
        documents: body.documents,
        edit_of: None,
    };
    let key = idempotency_key(&headers)?;
    let message = prepared(&app, caller.as_str(), &message).await?;
    let (id, create) = match body.session_id {
        Some(id) => {
            let id = SessionId(id);
            owned_session(&app, &caller, id).await?;
            (id, None)
        }
        None => {
            // With a key, a resent chat finds the session its first try created.
            let id = key
                .as_deref()
                .map_or_else(SessionId::new, |k| SessionId(derived(caller.as_str(), "chat", k)));
            let mut create = AppendRequest::create(id, caller.as_str(), None);
            if let Some(k) = &key {
                create.request_id = derived(caller.as_str(), "create", k);
            }
            (id, Some(create))
        }
    };
    tracing::Span::current().record("session_id", tracing::field::display(id));
    send_turn(&app, &caller, id, message, key, create).await
}

pub(crate) fn ready_for_turns(app: &Ingress) -> Result<(), ApiError> {
    if app.turns.is_closing() {
        return Err(ApiError::Unavailable("shutting down".into()));
    }
    if app.upstream.is_none() {
        return Err(ApiError::Unavailable("no model gateway is configured (TURNLOG_LLM_URL)".into()));
    }
    Ok(())
}

/// Runs a turn: a resent request (same key) follows its first try; otherwise, within the
/// caps, `create` (a new session's) and the user message are appended under the lease.
async fn send_turn(
    app: &AppState,
    caller: &Caller,
    session: SessionId,
    message: UserMessage,
    key: Option<String>,
    create: Option<AppendRequest>,
) -> Result<Response, ApiError> {
    let events = begin_turn(app, caller, session, message, key, create, TurnOptions::default()).await?;
    Ok(stream_response(app, session, events))
}

/// [`send_turn`]'s work, for any route: the turn's native events, from its `meta` (a
/// resent request's from its first try's, or its outcome read from the log).
pub(crate) async fn begin_turn(
    app: &AppState,
    caller: &Caller,
    session: SessionId,
    message: UserMessage,
    key: Option<String>,
    create: Option<AppendRequest>,
    options: TurnOptions,
) -> Result<BoxStream<'static, StreamEvent>, ApiError> {
    ready_for_turns(app)?;
    validate::turn_options(&options)?;
    let owner = caller.as_str();
    let event_id =
        key.as_deref().map_or_else(Uuid::now_v7, |k| derived(owner, &format!("message {session}"), k));
    if key.is_some() {
        if let Some(o) = recorded_outcome(&app.pool, event_id).await? {
            if let Some(user_seq) = o.seq {
                return resent_events(app, caller, session, user_seq).await;
            }
        }
    }
    let slot = take_slot(app, caller)?;
    let t0 = std::time::Instant::now();
    if let Some(create) = &create {
        submit(app, create).await?;
    }
    let holder = app.instance_id.clone();
    let lease = app.leases.acquire(session, &holder).await?.ok_or_else(turn_running)?;
    let leased = t0.elapsed();

    let model = app.config.model_for(&message);
    let user_text = message.text.clone();
    let req = AppendRequest::append(session, owner, event_id, &EventBody::UserMessage(message));
    let outcome = match submit(app, &req).await {
        Ok(o) => o,
        Err(e) => {
            let _ = app.leases.release(lease).await;
            return Err(e);
        }
    };
    let Some(user_seq) = outcome.seq else {
        let _ = app.leases.release(lease).await;
        return Err(ApiError::internal(anyhow::anyhow!("the writer answered without a seq")));
    };
    if outcome.status == turnlog_runtime::bus::OutcomeStatus::Duplicate {
        // The same key raced itself: the first request runs the turn.
        let _ = app.leases.release(lease).await;
        return resent_events(app, caller, session, user_seq).await;
    }
    // Where a turn's time before its request is built goes (cumulative, µs).
    tracing::debug!(
        lease_us = leased.as_micros() as u64,
        appended_us = t0.elapsed().as_micros() as u64,
        "user message durable"
    );
    let turn = start_turn(
        app,
        TurnStart {
            session,
            owner: caller.owner().clone(),
            user_seq,
            user_text,
            model,
            lease,
            slot,
            options,
        },
    );
    Ok(follow_local(turn, 0))
}

/// A slot under the concurrent-turn caps (released when the turn ends, or when the guard
/// is dropped on any earlier exit), or 429.
pub(crate) fn take_slot(app: &Ingress, caller: &Caller) -> Result<TurnSlot, ApiError> {
    app.turns
        .take_slot(caller.owner(), app.config.turn_limits)
        .map_err(|cap| ApiError::TooManyRequests(cap.to_string()))
}

fn turn_running() -> ApiError {
    ApiError::Conflict("a turn is already running in this session".into())
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
    params(("id" = Uuid, Path, description = "Session id"),
           ("Idempotency-Key" = Option<String>, Header, description = "With `of`: a resent POST answers from the same fork")),
    request_body(content = RetryRequest, description = "Empty, `{}`, or `{\"of\": <answer seq>}`"),
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
        ready_for_turns(&app)?;
        let slot = take_slot(&app, &caller)?;
        return retry_turn(&app, &caller, id, slot).await;
    };
    let key = idempotency_key(&headers)?;
    let answer = read::event_at(&app.pool, caller.as_str(), id, of).await?;
    if answer.is_none_or(|e| e.kind != "assistant_turn") {
        return Err(ApiError::bad_request(format!(
            "of must be the seq of an answer of this session; {of} is not"
        )));
    }
    let question = read::turn_events(&app.pool, id, of, 1).await?;
    let Some(user_seq) = question.first().filter(|e| e.kind() == EventKind::UserMessage).map(|e| e.seq)
    else {
        return Err(ApiError::bad_request(format!("the answer at {of} follows no user message")));
    };
    let create = fork_request(&app, &caller, &session, user_seq, key.as_deref(), "regenerate").await?;
    let fork = create.session_id;
    tracing::Span::current().record("fork_id", tracing::field::display(fork));
    if key.is_some() && read::get_session(&app.pool, caller.as_str(), fork).await?.is_some() {
        return answer_resend(&app, &caller, fork, user_seq).await;
    }
    ready_for_turns(&app)?;
    let slot = take_slot(&app, &caller)?;
    create_fork(&app, &caller, &create).await?;
    retry_turn(&app, &caller, fork, slot).await
}

/// Runs the session's last user message again, when no answer follows it.
async fn retry_turn(
    app: &AppState,
    caller: &Caller,
    id: SessionId,
    slot: TurnSlot,
) -> Result<Response, ApiError> {
    let events = retried(app, caller, id, slot, None, TurnOptions::default()).await?;
    Ok(stream_response(app, id, events))
}

/// [`retry_turn`] for any route, within the caps: the turn's native events. `model` (an
/// allowed one) replaces the one the message asked for.
pub(crate) async fn retry_last(
    app: &AppState,
    caller: &Caller,
    id: SessionId,
    model: Option<String>,
    options: TurnOptions,
) -> Result<BoxStream<'static, StreamEvent>, ApiError> {
    ready_for_turns(app)?;
    let slot = take_slot(app, caller)?;
    retried(app, caller, id, slot, model, options).await
}

async fn retried(
    app: &AppState,
    caller: &Caller,
    id: SessionId,
    slot: TurnSlot,
    model: Option<String>,
    options: TurnOptions,
) -> Result<BoxStream<'static, StreamEvent>, ApiError> {
    let lease = app.leases.acquire(id, &app.instance_id).await?.ok_or_else(turn_running)?;
    let last = match read::last_user_message(&app.pool, caller.as_str(), id).await {
        Ok(Some((seq, message, false))) => (seq, message),
        Ok(found) => {
            let _ = app.leases.release(lease).await;
            let why = if found.is_some() { "the last turn completed" } else { "there is no message" };
            return Err(ApiError::Conflict(format!("nothing to retry: {why}")));
        }
        Err(e) => {
            let _ = app.leases.release(lease).await;
            return Err(e.into());
        }
    };
    let (user_seq, message) = last;
    let model = model.or_else(|| message.model_hint.clone());
    if let Some(Err(e)) = model.as_deref().map(|m| validate::model(&app.config, m)) {
        // The message asked for a model that is no longer allowed.
        let _ = app.leases.release(lease).await;
        return Err(e);
    }
    let model = model.unwrap_or_else(|| app.config.model_for(&message));
    let start = TurnStart {
        session: id,
        owner: caller.owner().clone(),
        user_seq,
        user_text: message.text,
        model,
        lease,
        slot,
        options,
    };
    Ok(follow_local(start_turn(app, start), 0))
}

/// Re-attach to the turn in flight: its events after `Last-Event-ID`, then live.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/stream", tag = "turns", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "Session id"),
           ("Last-Event-ID" = Option<u64>, Header, description = "The last event id the client has")),
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
    let after =
        match headers.get("last-event-id") {
            None => 0,
            Some(v) => v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()).ok_or_else(|| {
                ApiError::bad_request("Last-Event-ID must be a turn event id (1, 2, 3, ...)")
            })?,
        };
    if let Some(turn) = app.turns.get(id) {
        if turn.is_over() && turn.events_after(after).is_empty() {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        return Ok(stream_response(&app, id, follow_local(turn, after)));
    }
    match remote_stream(&app, id, after).await {
        Some(events) => Ok(stream_response(&app, id, events.boxed())),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

/// A resent POST (same `Idempotency-Key`): follow its turn if it still runs, else answer
/// its outcome from the log.
async fn answer_resend(
    app: &AppState,
    caller: &Caller,
    session: SessionId,
    user_seq: i64,
) -> Result<Response, ApiError> {
    Ok(stream_response(app, session, resent_events(app, caller, session, user_seq).await?))
}

/// [`answer_resend`]'s events.
async fn resent_events(
    app: &AppState,
    caller: &Caller,
    session: SessionId,
    user_seq: i64,
) -> Result<BoxStream<'static, StreamEvent>, ApiError> {
    let is_ours = |first: Option<&StreamEvent>| {
        first.is_some_and(|e| matches!(&e.event, TurnEvent::Meta(m) if m.user_seq == Some(user_seq)))
    };
    if let Some(turn) = app.turns.get(session) {
        if is_ours(turn.events_after(0).first().map(|e| e.as_ref())) {
            return Ok(follow_local(turn, 0));
        }
    }
    if let Some(events) = remote_stream(app, session, 0).await {
        let mut events = events.boxed().peekable();
        if is_ours(std::pin::Pin::new(&mut events).peek().await) {
            return Ok(events.boxed());
        }
    }
    let end = outcome_from_log(app, caller, session, user_seq).await?;
    let meta = Meta { session_id: Some(session), user_seq: Some(user_seq), ..Default::default() };
    let events = vec![
        StreamEvent { id: 1, event: TurnEvent::Meta(meta) },
        StreamEvent { id: 2, event: TurnEvent::End(end) },
    ];
    Ok(futures::stream::iter(events).boxed())
}

/// How the turn after `user_seq` ended, read from the log (for a resent request).
async fn outcome_from_log(
    app: &Ingress,
    caller: &Caller,
    session: SessionId,
    user_seq: i64,
) -> Result<TurnEnd, ApiError> {
    let rows = read::events_page(&app.pool, caller.as_str(), session, user_seq, 10_000)
        .await?
        .ok_or_else(ApiError::session_not_found)?;
    // The turn's own events (to the next user message), those this build can read.
    let events: Vec<_> =
        rows.iter().take_while(|r| r.kind != "user_message").filter_map(|r| r.decode().ok()).collect();
    Ok(turn_end_from_log(session, &events))
}

/// Events of a local turn with an id above `after`, live until its `end`.
pub(crate) fn follow_local(turn: Arc<ActiveTurn>, after: u64) -> BoxStream<'static, StreamEvent> {
    let watch = turn.watch();
    let state = (turn, after, watch, std::collections::VecDeque::<Arc<StreamEvent>>::new(), false);
    futures::stream::unfold(state, |(turn, mut last, mut watch, mut queue, ended)| async move {
        loop {
            if let Some(e) = queue.pop_front() {
                last = e.id;
                let is_end = e.is_end();
                return Some(((*e).clone(), (turn, last, watch, queue, is_end)));
            }
            if ended {
                return None;
            }
            // Read before the events: an ended turn with nothing after `last` has nothing
            // more for a follower already past its end (a Last-Event-ID beyond it).
            let over = turn.is_over();
            queue.extend(turn.events_after(last));
            if queue.is_empty() && over {
                return None;
            }
            if queue.is_empty() && watch.changed().await.is_err() {
                queue.extend(turn.events_after(last));
                if queue.is_empty() {
                    return None;
                }
            }
        }
    })
    .boxed()
}

/// The event stream response: `X-Session-Id` before any body byte, no proxy buffering,
/// keep-alive comments.
fn stream_response(
    app: &AppState,
    session: SessionId,
    events: futures::stream::BoxStream<'static, StreamEvent>,
) -> Response {
    let guard = app.metrics.stream_opened();
    let sse = events.map(move |e| {
        let _held = &guard;
        let data = e.event.data().to_string();
        Ok::<_, Infallible>(SseEvent::default().id(e.id.to_string()).event(e.event.name()).data(data))
    });
    let mut response = Sse::new(sse).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response();
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&session.to_string()) {
        headers.insert("x-session-id", v);
    }
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
    response
}
