//! `POST /v1/chat/completions` and `GET /v1/models` (DESIGN §13): chat front ends that
//! resend their whole conversation every time get durable sessions by sending a session
//! header. Reading the request, reconciling it with its family's branches, running the turn
//! and folding it into chunks is [`crate::openai::chat`]'s; without a session header the
//! request goes to the gateway as it is and nothing is stored.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ErrorBody;
use crate::openai::chat::{
    chunks, completion, conversation, options, pass_through, reconcile, run, session_header,
    CompletionRequest, Family, Reconciled, Turn,
};
use crate::openai::wire::{ChatCompletion, ModelList};
use crate::openai::{OaiBody, OaiError, OaiErrorBody};
use crate::openapi::UNAUTHORIZED;
use crate::validate::MAX_CHAT_BODY_BYTES;
use crate::{validate, AppState};

/// Create a chat completion. With a session header (`X-Session-Id`, or one named in
/// `TURNLOG_COMPAT_SESSION_HEADERS`), the request continues — or forks — a durable session
/// of that header's family, and the response's `X-Session-Id` names the branch; without
/// one, it is passed to the gateway and nothing is stored.
#[utoipa::path(
    post, path = "/v1/chat/completions", tag = "openai", security(("bearer" = [])),
    params(("X-Session-Id" = Option<String>, Header, description = "A session id, or any string naming a family of branches")),
    request_body(content = CompletionRequest, description = "OpenAI's `ChatCompletionCreateParams`: the fields turnlog reads (without a session header, the body goes to the gateway as it is)"),
    responses(
        (status = 200, description = "A `chat.completion`, or with `stream: true` text/event-stream of `chat.completion.chunk`s ending with `data: [DONE]`",
         content((ChatCompletion = "application/json"), ("text/event-stream"))),
        (status = 400, description = "Refused; or without a session header, the gateway's refusal as it came", body = OaiErrorBody),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
        (status = 404, body = OaiErrorBody), (status = 409, body = OaiErrorBody),
        (status = 413, description = "Over 16 MiB", body = OaiErrorBody),
        (status = 429, body = OaiErrorBody),
        (status = 502, description = "The model gateway failed the turn (its message is stored)", body = OaiErrorBody),
        (status = 503, body = OaiErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id), err(Display, level = "debug"))]
pub async fn completions(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    OaiBody(body): OaiBody<MAX_CHAT_BODY_BYTES>,
) -> Result<Response, OaiError> {
    let req = CompletionRequest::parse(&body)?;
    if let Some(model) = &req.model {
        validate::model(&app.config, model)?;
    }
    let Some(family) = session_header(&app, &headers)? else {
        return pass_through(&app, &caller, body, req.model.is_none()).await;
    };
    req.check_stored()?;
    let conversation = conversation(&req.messages)?;
    let streamed = req.stream == Some(true);
    let options = options(&req, conversation.system.clone())?;
    let Some(Reconciled { target, from, took }) =
        reconcile(&app, &caller, Family::of_header(&app, &caller, &family).await?, &conversation, streamed)
            .await?
    else {
        return pass_through(&app, &caller, body, req.model.is_none()).await;
    };
    let turn = Turn { conversation: &conversation, from, options, model: req.model.clone() };
    let (session, events) = run(&app, &caller, target, turn).await?;
    tracing::Span::current().record("session_id", tracing::field::display(session));
    // The time to hash the request, read the family and compare (µs).
    tracing::debug!(
        messages = conversation.messages.len(),
        new_messages = conversation.messages.len() - from,
        reconcile_us = took.as_micros() as u64,
        "chat completion reconciled"
    );
    let include_usage = req.stream_options.and_then(|o| o.include_usage) == Some(true);
    // A failed turn's error names the branch too: its message is stored there.
    let mut response = if streamed {
        chunks(events, include_usage)
    } else {
        completion(events).await.unwrap_or_else(IntoResponse::into_response)
    };
    if let Ok(v) = HeaderValue::from_str(&session.to_string()) {
        response.headers_mut().insert("x-session-id", v);
    }
    Ok(response)
}

/// List the models a client may ask for: the gateway's (cached), those turnlog allows.
#[utoipa::path(
    get, path = "/v1/models", tag = "openai", security(("bearer" = [])),
    responses(
        (status = 200, description = "OpenAI's model list", body = ModelList),
        (status = 401, description = UNAUTHORIZED, body = ErrorBody),
    )
)]
pub async fn models(State(app): State<AppState>, _caller: Caller) -> Json<Value> {
    let listed = match &app.upstream {
        Some(u) => u.models().await.unwrap_or_default(),
        None => Vec::new(),
    };
    let configured = std::iter::once(app.config.model.clone())
        .chain(app.config.allowed_models.iter().flatten().cloned())
        .map(|id| json!({"id": id}));
    let mut seen = std::collections::HashSet::new();
    let data: Vec<Value> = listed
        .into_iter()
        .chain(configured)
        .filter_map(|e| {
            let id = e.get("id")?.as_str()?.to_owned();
            (app.config.allows_model(&id) && seen.insert(id.clone())).then(|| {
                let created = e.get("created").and_then(Value::as_i64).unwrap_or(0);
                let owned_by = e.get("owned_by").and_then(Value::as_str).unwrap_or("turnlog");
                json!({"id": id, "object": "model", "created": created, "owned_by": owned_by})
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}
