//! Starting a turn (DESIGN §5): a message checked before anything is written, the session
//! it goes to, the caps, the lease and the durable user message, then the runner; a retry
//! of the last message (§5.7); and the forks an edit or a regenerate runs in (§10). Every
//! route that runs a turn — the native ones and the OpenAI-compatible ones — starts it here
//! and gets the turn's native events, from its `meta`.

use futures::stream::BoxStream;
use turnlog_core::events::{EventBody, EventKind, UserMessage};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{AppendRequest, OutcomeStatus};
use turnlog_runtime::read::{self, recorded_outcome, SessionRow};
use uuid::Uuid;

use super::follow::{follow_local, resent_events};
use super::{start_turn, StreamEvent, TurnOptions, TurnSlot, TurnStart};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::idempotency::derived;
use crate::sessions::{create_fork, fork_request, owned_session};
use crate::writes::submit;
use crate::{files, validate, AppState, Ingress};

/// Longest category or model name, in characters.
pub const MAX_NAME_CHARS: usize = 200;
const MAX_ATTACHMENTS: usize = 32;

/// A message to send, as a route received it: its text, and optionally a category, a model
/// and the ids of uploaded files it attaches.
#[derive(Debug, Default)]
pub struct NewMessage {
    pub text: String,
    pub category: Option<String>,
    pub model: Option<String>,
    pub images: Vec<String>,
    pub documents: Vec<String>,
}

/// The `user_message` a message becomes, checked: its text, names and model, its
/// attachments resolved (each must be one of `owner`'s live files, DESIGN §12) and its
/// size — all before anything is written, so a chat is refused before it creates a session.
pub async fn prepared(app: &Ingress, owner: &Owner, m: &NewMessage) -> Result<UserMessage, ApiError> {
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

/// The session of `POST /v1/chat`: the caller's `session_id`, or a new one (its id derived
/// from the Idempotency-Key when there is one, so a resent chat finds the session its first
/// try created) with the `create` to submit first.
pub async fn chat_session(
    app: &Ingress,
    caller: &Caller,
    session_id: Option<Uuid>,
    key: Option<&str>,
) -> Result<(SessionId, Option<AppendRequest>), ApiError> {
    if let Some(id) = session_id {
        let id = SessionId(id);
        owned_session(app, caller, id).await?;
        return Ok((id, None));
    }
    let id = key.map_or_else(SessionId::new, |k| SessionId(derived(caller.owner(), "chat", k)));
    let mut create = AppendRequest::create(id, caller.owner(), None);
    if let Some(k) = key {
        create.request_id = derived(caller.owner(), "create", k);
    }
    Ok((id, Some(create)))
}

/// 503 while the copy shuts down or has no model gateway.
pub fn ready_for_turns(app: &Ingress) -> Result<(), ApiError> {
    if app.turns.is_closing() {
        return Err(ApiError::Unavailable("shutting down".into()));
    }
    if app.upstream.is_none() {
        return Err(ApiError::Unavailable("no model gateway is configured (TURNLOG_LLM_URL)".into()));
    }
    Ok(())
}

/// A slot under the concurrent-turn caps (released when the turn ends, or when the guard
/// is dropped on any earlier exit), or 429.
pub fn take_slot(app: &Ingress, caller: &Caller) -> Result<TurnSlot, ApiError> {
    app.turns
        .take_slot(caller.owner(), app.config.turn_limits)
        .map_err(|cap| ApiError::TooManyRequests(cap.to_string()))
}

fn turn_running() -> ApiError {
    ApiError::Conflict("a turn is already running in this session".into())
}

/// Runs a turn: a resent request (same key) follows its first try; otherwise, within the
/// caps, `create` (a new session's) and the user message are appended under the lease.
/// The turn's native events, from its `meta` (a resent request's from its first try's, or
/// its outcome read from the log).
pub async fn begin_turn(
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
    let owner = caller.owner();
    super::server::check_client_names(app, owner, options.tools.as_ref()).await?;
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
    // A turn paused for tools ends without their results (a new session has none). The
    // live tail read for that is the start of the one the request is built from.
    let tail = match create {
        Some(_) => None,
        None => match super::cancel_waiting(app, caller, session).await {
            Ok(tail) => Some(tail),
            Err(e) => {
                let _ = app.leases.release(lease).await;
                return Err(e);
            }
        },
    };

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
    if outcome.status == OutcomeStatus::Duplicate {
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
            results: Vec::new(),
            continued: false,
            tail,
        },
    );
    Ok(follow_local(turn, 0))
}

/// Edit (DESIGN §10): the `create` of a fork through the seq before `edit_of`, which must
/// be a user message of `session`; the new text runs there.
pub async fn edit_fork(
    app: &Ingress,
    caller: &Caller,
    session: &SessionRow,
    edit_of: i64,
    key: Option<&str>,
) -> Result<AppendRequest, ApiError> {
    let edited = read::event_at(&app.pool, caller.owner(), session.id, edit_of).await?;
    if edited.is_none_or(|e| e.kind != EventKind::UserMessage) {
        return Err(ApiError::bad_request(format!(
            "edit_of must be the seq of a user message of this session; {edit_of} is not"
        )));
    }
    fork_request(app, caller, session, edit_of - 1, key, "edit").await
}

/// Regenerate (DESIGN §10): the `create` of a fork through the user message the answer at
/// `of` answered, and that message's seq.
pub async fn regenerate_fork(
    app: &Ingress,
    caller: &Caller,
    session: &SessionRow,
    of: i64,
    key: Option<&str>,
) -> Result<(AppendRequest, i64), ApiError> {
    let answer = read::event_at(&app.pool, caller.owner(), session.id, of).await?;
    if answer.is_none_or(|e| e.kind != EventKind::AssistantTurn) {
        return Err(ApiError::bad_request(format!(
            "of must be the seq of an answer of this session; {of} is not"
        )));
    }
    let question = read::turn_events(&app.pool, session.id, of, 1).await?;
    let Some(user_seq) = question.first().filter(|e| e.kind() == EventKind::UserMessage).map(|e| e.seq)
    else {
        return Err(ApiError::bad_request(format!("the answer at {of} follows no user message")));
    };
    let create = fork_request(app, caller, session, user_seq, key, "regenerate").await?;
    Ok((create, user_seq))
}

/// Runs the user message at `user_seq` again in the fork `create` names, within the caps.
/// With a key (`keyed`) and the fork already there, the request is a resend: it answers
/// from its first try.
pub async fn regenerate(
    app: &AppState,
    caller: &Caller,
    create: &AppendRequest,
    user_seq: i64,
    keyed: bool,
) -> Result<BoxStream<'static, StreamEvent>, ApiError> {
    let fork = create.session_id;
    if keyed && read::get_session(&app.pool, caller.owner(), fork).await?.is_some() {
        return resent_events(app, caller, fork, user_seq).await;
    }
    ready_for_turns(app)?;
    let slot = take_slot(app, caller)?;
    create_fork(app, caller, create).await?;
    retried(app, caller, fork, slot, None, TurnOptions::default()).await
}

/// Runs the session's last user message again, when no answer follows it (DESIGN §5.7),
/// within the caps: the turn's native events. `model` (an allowed one) replaces the one the
/// message asked for.
pub async fn retry_last(
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
    let last = match read::last_user_message(&app.pool, caller.owner(), id).await {
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
    // A turn paused for client tools goes on with their results, not a retry; one whose
    // results are in (its next step never ran), or that waits only for server calls (the
    // copy running it went away), continues from the log with its last step's options.
    let (options, recorded_model, continued) = match continued_options(app, caller, id).await {
        Ok(Continued::Waiting) => {
            let _ = app.leases.release(lease).await;
            return Err(ApiError::Conflict(
                "the turn waits for tool results: send them with POST /v1/sessions/{id}/tool_results".into(),
            ));
        }
        Ok(Continued::Step(o, m, settle)) => (*o, Some(m), settle),
        Ok(Continued::Fresh) => (options, None, false),
        Err(e) => {
            let _ = app.leases.release(lease).await;
            return Err(e);
        }
    };
    let model = model.or(recorded_model).or_else(|| message.model_hint.clone());
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
        results: Vec::new(),
        continued,
        tail: None,
    };
    Ok(follow_local(start_turn(app, start), 0))
}

/// What a retry of the session's current turn runs with (DESIGN §14).
enum Continued {
    /// A step asked for client tools that have no result yet.
    Waiting,
    /// The last step's recorded options and model: its results are in, or (true) its
    /// server calls are still to be seen to (DESIGN §14).
    Step(Box<TurnOptions>, String, bool),
    /// No step asked for tools: the retry's own options.
    Fresh,
}

async fn continued_options(app: &Ingress, caller: &Caller, id: SessionId) -> Result<Continued, ApiError> {
    let tail =
        read::live_tail(&app.pool, caller.owner(), id).await?.ok_or_else(ApiError::session_not_found)?;
    let waiting = turnlog_core::stream::waiting_calls(&tail.events);
    let sources = super::server::sources(&tail.events);
    if waiting.iter().any(|c| !super::server::is_server(&sources, &c.id)) {
        return Ok(Continued::Waiting);
    }
    let start = turnlog_core::llm_context::current_turn_start(&tail.events);
    let step = tail.events.iter().rev().take_while(|e| e.seq > start).find_map(|e| match &e.body {
        EventBody::AssistantTurn(t) if t.asks_for_tools() => t.request.as_ref(),
        _ => None,
    });
    let Some(recorded) = step else { return Ok(Continued::Fresh) };
    // As it was sent: what the record left for the log to give back, taken from it.
    let r = turnlog_core::audit::resolved(&tail.events, recorded).map_err(ApiError::internal)?;
    Ok(Continued::Step(Box::new(TurnOptions::of_recorded(&r)), r.model.clone(), !waiting.is_empty()))
}
