//! `/v1/responses` (DESIGN §13): create a response (one turn's attempt, or with
//! `store: false` a pass-through that stores nothing), retrieve or re-attach to it, cancel
//! it, and list its input. What a request becomes, where a response is and how it is
//! translated is [`crate::openai::responses`]'.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt as _;
use serde_json::Value;
use turnlog_core::events::{EventBody, PendingReason, ToolCall};
use turnlog_core::ids::SessionId;
use turnlog_core::stream::TurnEvent;
use turnlog_runtime::read;

use crate::auth::Caller;
use crate::error::ErrorBody;
use crate::openai::chat::{reconcile, run, Reconciled, Turn};
use crate::openai::responses::stream::translate;
use crate::openai::responses::{
    answer, created_response, history, last_response, locate, numbered, replay_finished, stored_response,
    target, Approval, CreateResponse, Echo, Located, McpList, RetrieveParams, StoredInput,
};
use crate::openai::wire::{ItemList, ResponseObject};
use crate::openai::{
    list_page, parse_response, user_item, OaiBody, OaiError, OaiErrorBody, OaiPath, OaiQuery,
};
use crate::openapi::UNAUTHORIZED;
use crate::turn::{self, remote_stop};
use crate::{passthrough, AppState};

/// Create a model response (OpenAI's Responses API): one turn of a conversation.
#[utoipa::path(
    post, path = "/v1/responses", tag = "openai", security(("bearer" = [])),
    request_body(content = CreateResponse, description = "OpenAI's `ResponseCreateParams`: the fields turnlog reads (it ignores the others)"),
    responses(
        (status = 200, description = "A `response` object, or with `stream: true` text/event-stream of `response.*` events ending with `data: [DONE]`",
         content((ResponseObject = "application/json"), ("text/event-stream"))),
        (status = 400, body = OaiErrorBody), (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, description = "No such conversation or previous response", body = OaiErrorBody),
        (status = 409, description = "A response is running in this conversation", body = OaiErrorBody),
        (status = 413, body = OaiErrorBody),
        (status = 429, description = "Too many turns at once", body = OaiErrorBody),
        (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id), err(Display, level = "debug"))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    OaiBody(body): OaiBody,
) -> Result<Response, OaiError> {
    let req = CreateResponse::parse(&body)?;
    let owner = caller.owner().clone();
    if req.store == Some(false) {
        req.check_stateless()?;
        let upstream = passthrough::gateway(&app)?;
        let (model, body) = req.stateless(&app.config)?;
        let slot = passthrough::slot(&app, &caller)?;
        let events = passthrough::relay(&upstream, &body, model, slot).await?;
        let echo = Echo { store: false, ..req.echo() };
        return answer(translate(app.clone(), owner, events, echo), req.stream, false).await;
    }
    req.check_stored()?;
    let options = req.options()?;
    // The servers it names, checked before anything is written.
    let mut echo = req.echo();
    echo.mcp = mcp_lists(&app, &caller, &req).await?;
    let (session, events) = match req.stored_input()? {
        StoredInput::Turn(message) => {
            let named = req.conversation.is_some() || req.previous_response_id.is_some();
            if !named {
                if let Some(session) = history::waiting_twin(&app, &caller, &message).await? {
                    let model = message.model.clone();
                    tracing::Span::current().record("session_id", tracing::field::display(session));
                    let events = turn::retry_last(&app, &caller, session, model, options).await?;
                    let translated = translate(app.clone(), owner, events, echo);
                    return answer(translated, req.stream, req.background).await;
                }
            }
            let message = turn::prepared(&app, caller.owner(), &message).await?;
            let (session, create) = target(&app, &caller, &req).await?;
            (session, turn::begin_turn(&app, &caller, session, message, None, create, options).await?)
        }
        StoredInput::ToolResults(results) => {
            let (session, create) = target(&app, &caller, &req).await?;
            if create.is_some() {
                // A previous response that later messages followed: its turn is over.
                return Err(OaiError(crate::error::ApiError::Conflict(
                    "the previous response's turn is over: its conversation went on".into(),
                )));
            }
            (session, turn::continue_with_results(&app, &caller, session, results).await?)
        }
        StoredInput::Approvals(approvals) => {
            let (session, create) = target(&app, &caller, &req).await?;
            if create.is_some() {
                return Err(OaiError(crate::error::ApiError::Conflict(
                    "the previous response's turn is over: its conversation went on".into(),
                )));
            }
            let (approved, events) = approve(&app, &caller, session, approvals).await?;
            echo.approved = approved;
            (session, events)
        }
        StoredInput::History(items) => {
            let (family, conversation) =
                history::conversation(&app, &caller, items, options.system.clone()).await?;
            // Never a pass-through: a Responses request is always stored.
            let Reconciled { target, from, .. } = reconcile(&app, &caller, family, &conversation, true)
                .await?
                .ok_or_else(|| OaiError::bad_request("input shares nothing with a conversation"))?;
            let turn = Turn { conversation: &conversation, from, options, model: req.model.clone() };
            run(&app, &caller, target, turn).await?
        }
    };
    tracing::Span::current().record("session_id", tracing::field::display(session));
    let translated = translate(app.clone(), owner, events, echo);
    answer(translated, req.stream, req.background).await
}

/// The servers a request names, as its `mcp_list_tools` items show them (DESIGN §14); an
/// unknown label (or one that does not serve the caller) is a 400.
async fn mcp_lists(app: &AppState, caller: &Caller, req: &CreateResponse) -> Result<Vec<McpList>, OaiError> {
    let named = req.mcp_servers()?;
    if named.is_empty() {
        return Ok(Vec::new());
    }
    let catalog = app.catalog.for_owner(app, caller.owner()).await;
    let offered = turn::server::offered(&catalog, &turn::ServerTools::Named(named.clone()));
    for n in &named {
        if !offered.iter().any(|s| s.label == n.label) {
            return Err(OaiError::bad_request(format!("no MCP server {:?} is configured", n.label)));
        }
    }
    Ok(offered.into_iter().map(McpList::of).collect())
}

/// The approved calls and the continued turn's events.
type Approved = (Vec<(ToolCall, String)>, futures::stream::BoxStream<'static, turn::StreamEvent>);

/// Answers the approval requests a paused turn waits for and continues it (a response
/// pauses at its first prompt, §14): the calls let run (each with its approval request's
/// id), which the new response shows first, and the continued turn's events.
async fn approve(
    app: &AppState,
    caller: &Caller,
    session: SessionId,
    approvals: Vec<Approval>,
) -> Result<Approved, OaiError> {
    // The calls the approvals are for, from the paused step.
    let events = read::current_turn(&app.pool, caller.owner(), session, 20_000)
        .await?
        .ok_or_else(|| OaiError::not_found("conversation"))?;
    let mut approved = Vec::new();
    let mut call = None;
    for a in &approvals {
        let decision = if a.approve { "allow" } else { "deny" };
        let resolved = turn::server::resolve_permission(app, caller, session, &a.request_id, decision)
            .await
            .map_err(|e| match e {
                crate::error::ApiError::NotFound(_) => OaiError::not_found("approval request"),
                e => OaiError(e),
            })?;
        if a.approve {
            let made = events.iter().rev().find_map(|e| match &e.body {
                EventBody::AssistantTurn(t) => t
                    .llm
                    .message
                    .tool_calls
                    .iter()
                    .find(|c| Some(&c.id) == resolved.call_id.as_ref())
                    .cloned(),
                _ => None,
            });
            approved.extend(made.map(|c| (c, a.request_id.clone())));
        }
        call = call.or(resolved.call_id);
    }
    let waits = match call {
        Some(call) => {
            turn::continue_after_permission(app, caller, session, &call, Some(std::time::Duration::ZERO))
                .await?
        }
        None => None,
    };
    let events = waits.ok_or_else(|| {
        OaiError(crate::error::ApiError::Conflict(
            "no response waits for this approval (its turn went on, or runs now)".into(),
        ))
    })?;
    Ok((approved, events))
}

/// Retrieve a response; with `stream=true`, re-attach: its events from `response.created`
/// (after `starting_after`, a `sequence_number`), live while it runs.
#[utoipa::path(
    get, path = "/v1/responses/{id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "resp_<32 hex>"), RetrieveParams),
    responses(
        (status = 200, description = "The `response` object, or with `stream=true` text/event-stream of its `response.*` events",
         content((ResponseObject = "application/json"), ("text/event-stream"))),
        (status = 400, body = OaiErrorBody), (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody), (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(response_id = %id), err(Display, level = "debug"))]
pub async fn retrieve(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
    OaiQuery(params): OaiQuery<RetrieveParams>,
) -> Result<Response, OaiError> {
    let owner = caller.owner().clone();
    let starting_after = params.starting_after()?;
    match locate(&app, &caller, &parse_response(&id)?).await? {
        Located::Running(_, events) => {
            let translated = translate(app.clone(), owner, events, Echo::default());
            if params.stream == Some(true) {
                return Ok(numbered(translated, starting_after));
            }
            // A running response's object as it was created (status `in_progress`).
            Ok(Json(created_response(translated).await).into_response())
        }
        Located::Stored(event) => {
            let response = stored_response(&app, &owner, event, &Echo::default()).await?;
            if params.stream == Some(true) {
                let events = replay_finished(response);
                return Ok(numbered(futures::stream::iter(events).boxed(), starting_after));
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
    responses(
        (status = 200, body = ResponseObject), (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody), (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(response_id = %id), err(Display, level = "debug"))]
pub async fn cancel(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
) -> Result<Response, OaiError> {
    let attempt = parse_response(&id)?;
    let owner = caller.owner().clone();
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
    Ok(Json(stored_response(&app, &owner, event, &Echo::default()).await?).into_response())
}

/// The input items of a response: the user message its turn answered.
#[utoipa::path(
    get, path = "/v1/responses/{id}/input_items", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "resp_<32 hex>")),
    responses(
        (status = 200, body = ItemList), (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody), (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(response_id = %id), err(Display, level = "debug"))]
pub async fn input_items(
    State(app): State<AppState>,
    caller: Caller,
    OaiPath(id): OaiPath<String>,
) -> Result<Json<Value>, OaiError> {
    let owner = caller.owner();
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
