//! `POST /v1/chat/completions` and `GET /v1/models` (DESIGN §13): chat front ends that
//! resend their whole conversation every time get durable sessions by sending a session
//! header. The client's history only tells which branch of the header's family the request
//! continues and what is new ([`super::branches`]); the model gets turnlog's context.
//! Without a session header the request goes to the gateway as it is and nothing is stored.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{json, Value};
use turnlog_core::audit::MAX_SYSTEM_PROMPT_BYTES;
use turnlog_core::ids::SessionId;
use turnlog_core::stream::{TurnEnd, TurnEvent, TurnStatus};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read::{self, SessionRow};
use uuid::Uuid;

use super::branches::{plan, request_messages, Branch, Plan};
use super::conversations::{append_items, NewItem};
use super::{OaiBody, OaiError};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::idempotency::derived;
use crate::sessions::fork_request;
use crate::turn::{begin_turn, prepared, ready_for_turns, retry_last, take_slot, NewMessage};
use crate::turn::{StreamEvent, TurnOptions};
use crate::validate::MAX_CHAT_BODY_BYTES;
use crate::writes::submit;
use crate::{files, validate, AppState};

/// Longest session header value.
const MAX_SESSION_HEADER: usize = 200;
/// Most messages one request may add to a branch besides the one it runs (a client's
/// earlier history, the first time it names a session).
const MAX_NEW_MESSAGES: usize = 1_000;

/// The fields of OpenAI's `ChatCompletionCreateParams` turnlog reads; the rest are ignored
/// (and forwarded untouched by the pass-through).
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<WireMessage>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    reasoning_effort: Option<String>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    functions: Option<Vec<Value>>,
}

/// `stop`: one sequence or up to four.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Most stop sequences, and the longest reasoning effort name, a request may give.
const MAX_STOP: usize = 4;
const MAX_PARAM_CHARS: usize = 64;

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct WireMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Value>,
}

/// A request's conversation: its system text, and its other messages as (is_user, text).
struct Conversation {
    system: Option<String>,
    messages: Vec<(bool, String)>,
    /// Each message's images, as the `data:` URLs the client sent (aligned with `messages`).
    images: Vec<Vec<String>>,
}

/// Create a chat completion. With a session header (`X-Session-Id`, or one named in
/// `TURNLOG_COMPAT_SESSION_HEADERS`), the request continues — or forks — a durable session
/// of that header's family, and the response's `X-Session-Id` names the branch; without
/// one, it is passed to the gateway and nothing is stored.
#[utoipa::path(
    post, path = "/v1/chat/completions", tag = "openai", security(("bearer" = [])),
    params(("X-Session-Id" = Option<String>, Header, description = "A session id, or any string naming a family of branches")),
    request_body(content = Object, description = "OpenAI's `ChatCompletionCreateParams`"),
    responses(
        (status = 200, description = "A `chat.completion`, or with `stream: true` text/event-stream of `chat.completion.chunk`s ending with `data: [DONE]`", body = Object),
        (status = 400, body = Object), (status = 404, body = Object), (status = 409, body = Object),
        (status = 413, description = "Over 16 MiB", body = Object),
        (status = 429, body = Object),
        (status = 502, description = "The model gateway failed the turn (its message is stored)", body = Object),
        (status = 503, body = Object),
    )
)]
#[tracing::instrument(skip_all, fields(session_id), err(Debug, level = "debug"))]
pub async fn completions(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    OaiBody(body): OaiBody<MAX_CHAT_BODY_BYTES>,
) -> Result<Response, OaiError> {
    // (serde would read an array as the request's fields in order.)
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(OaiError::bad_request("the request body must be a JSON object"));
    }
    let req: CompletionRequest = serde_json::from_slice(&body).map_err(|e| {
        OaiError::bad_request(format!("the request body is not a valid chat completion request: {e}"))
    })?;
    if let Some(model) = &req.model {
        validate::model(&app.config, model)?;
    }
    let Some(family) = session_header(&app, &headers)? else {
        return pass_through(&app, &caller, body, req.model.is_none()).await;
    };
    if req.n.is_some_and(|n| n != 1) {
        return Err(OaiError::bad_request("n must be 1: a session stores one answer per turn"));
    }
    if req.tools.as_ref().is_some_and(|t| !t.is_empty())
        || req.functions.as_ref().is_some_and(|f| !f.is_empty())
    {
        return Err(OaiError::bad_request("tools are not supported: turnlog does not run tools yet"));
    }
    let conversation = conversation(&req.messages)?;
    let streamed = req.stream == Some(true);
    let options = options(&req, conversation.system.clone())?;
    let t0 = std::time::Instant::now();
    let request = request_messages(conversation.messages.iter().map(|(u, t)| (*u, t.as_str())));
    let (root, named) = family_root(&app, &caller, &family).await?;
    let rows = read::family(&app.pool, caller.as_str(), root).await?;
    let mut branches = Vec::with_capacity(rows.len());
    for row in rows {
        let links = app.chains.links(&app.pool, caller.as_str(), &row).await?;
        branches.push(Branch { named: Some(row.id) == named, row, links });
    }
    let reconciled = t0.elapsed();
    let (target, from) = if branches.is_empty() {
        (Target::New(new_family(&caller, root)), 0)
    } else {
        match plan(&branches, &request, streamed) {
            Plan::PassThrough => return pass_through(&app, &caller, body, req.model.is_none()).await,
            Plan::Continue { branch, from } => (Target::Existing(branches[branch].row.clone()), from),
            Plan::Fork { branch, through, from } => {
                let create =
                    fork_request(&app, &caller, &branches[branch].row, through, None, "chat").await?;
                (Target::New(create), from)
            }
        }
    };
    let turn = Turn { conversation: &conversation, from, options, model: req.model.clone() };
    let (session, events) = run(&app, &caller, target, turn).await?;
    tracing::Span::current().record("session_id", tracing::field::display(session));
    // The time to hash the request, read the family and compare (µs).
    tracing::debug!(
        messages = conversation.messages.len(),
        new_messages = conversation.messages.len() - from,
        reconcile_us = reconciled.as_micros() as u64,
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

/// The value of the first session header the request carries, if any.
fn session_header(app: &AppState, headers: &HeaderMap) -> Result<Option<String>, OaiError> {
    for name in &app.config.compat_session_headers {
        let Some(v) = headers.get(name.as_str()) else { continue };
        let value =
            v.to_str().map_err(|_| OaiError::bad_request(format!("{name} must be visible ASCII")))?.trim();
        if value.is_empty() {
            continue;
        }
        if value.len() > MAX_SESSION_HEADER {
            return Err(OaiError::bad_request(format!("{name} is at most {MAX_SESSION_HEADER} characters")));
        }
        return Ok(Some(value.to_owned()));
    }
    Ok(None)
}

/// The root of the family a header value names, and the session it named when it is one
/// of the caller's sessions (then its fork tree is the family). Any other value names the
/// family of a session whose id derives from the owner and the value.
async fn family_root(
    app: &AppState,
    caller: &Caller,
    value: &str,
) -> Result<(SessionId, Option<SessionId>), OaiError> {
    if let Ok(id) = Uuid::parse_str(value) {
        if let Some(row) = read::get_session(&app.pool, caller.as_str(), SessionId(id)).await? {
            let root = row.lineage.first().copied().map_or(row.id, SessionId);
            return Ok((root, Some(row.id)));
        }
    }
    let root = SessionId(derived(caller.as_str(), "chat completions session", value));
    Ok((root, Some(root)))
}

/// The `create` of a family's first session.
fn new_family(caller: &Caller, root: SessionId) -> AppendRequest {
    let mut create = AppendRequest::create(root, caller.as_str(), None);
    create.request_id = derived(caller.as_str(), "chat completions create", &root.to_string());
    create
}

/// Checks a request's messages and reads them as a [`Conversation`].
/// Most images the new messages of one request may add (the native API's attachment cap).
const MAX_NEW_IMAGES: usize = 32;
/// Most image parts a request may carry in all (the history's included), so a body of tiny
/// images is refused before anything else is done with it.
const MAX_IMAGE_PARTS: usize = 1_000;

fn conversation(messages: &[WireMessage]) -> Result<Conversation, OaiError> {
    let mut system = Vec::new();
    let mut rest = Vec::new();
    let mut images = Vec::new();
    for m in messages {
        if m.tool_calls.as_ref().is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(OaiError::bad_request(
                "tool calls are not supported: turnlog does not run tools yet",
            ));
        }
        let user = match m.role.as_str() {
            "system" | "developer" => {
                let (text, urls) = content(m.content.as_ref())?;
                if !urls.is_empty() {
                    return Err(OaiError::bad_request("a system message cannot carry images"));
                }
                system.push(text);
                continue;
            }
            "user" => true,
            "assistant" => false,
            "tool" | "function" => {
                return Err(OaiError::bad_request(
                    "tool messages are not supported: turnlog does not run tools yet",
                ))
            }
            other => return Err(OaiError::bad_request(format!("unknown message role {other:?}"))),
        };
        let (text, urls) = content(m.content.as_ref())?;
        if !user && !urls.is_empty() {
            return Err(OaiError::bad_request("an assistant message cannot carry images"));
        }
        // A branch's conversation has no empty messages either (a failed answer, say).
        if !text.trim().is_empty() {
            rest.push((user, text));
            images.push(urls);
        } else if !urls.is_empty() {
            return Err(OaiError::bad_request("a message with images needs text too"));
        }
    }
    match rest.last() {
        None => return Err(OaiError::bad_request("messages need a user message with text")),
        Some((false, _)) => {
            return Err(OaiError::bad_request(
                "the last message must be a user message (continuing an answer is not supported)",
            ))
        }
        Some(_) => {}
    }
    let system = system.join("\n\n");
    if system.len() > MAX_SYSTEM_PROMPT_BYTES {
        return Err(OaiError::bad_request(format!(
            "the system messages take more than {MAX_SYSTEM_PROMPT_BYTES} bytes"
        )));
    }
    if images.iter().map(Vec::len).sum::<usize>() > MAX_IMAGE_PARTS {
        return Err(OaiError::bad_request(format!("a request carries at most {MAX_IMAGE_PARTS} images")));
    }
    Ok(Conversation { system: (!system.is_empty()).then_some(system), messages: rest, images })
}

/// A message's text (a string, or its text parts joined) and its images' URLs (`image_url`
/// parts, stored as files when the message is).
fn content(content: Option<&Value>) -> Result<(String, Vec<String>), OaiError> {
    let parts = match content {
        Some(Value::String(t)) => return Ok((t.clone(), Vec::new())),
        Some(Value::Array(parts)) => parts,
        None | Some(Value::Null) => return Ok((String::new(), Vec::new())),
        Some(_) => {
            return Err(OaiError::bad_request("a message's content must be a string or an array of parts"))
        }
    };
    let (mut text, mut urls) = (String::new(), Vec::new());
    for p in parts {
        let url = p.get("image_url").and_then(|i| i.get("url").or(Some(i))).and_then(Value::as_str);
        match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str), url) {
            (Some("text"), Some(t), _) => text.push_str(t),
            (Some("image_url"), _, Some(url)) => urls.push(url.to_owned()),
            (kind, _, _) => {
                return Err(OaiError::bad_request(format!(
                    "content parts of type {} cannot be stored; send text and image_url parts (or no \
                     session header)",
                    kind.unwrap_or("(none)")
                )))
            }
        }
    }
    Ok((text, urls))
}

/// Where a turn runs: a session of the family, or one to create first (the family's first,
/// or a fork).
enum Target {
    Existing(SessionRow),
    New(AppendRequest),
}

/// The turn a request asks for: its conversation's messages from `from` on are new.
struct Turn<'a> {
    conversation: &'a Conversation,
    from: usize,
    options: TurnOptions,
    model: Option<String>,
}

/// Runs `turn` on `target`: the new messages are appended, the last one answered; with
/// none new, the branch's last message is run again — in place when it has no answer (§5.7),
/// in a fork through it when it has one that left no text to compare (a regenerate). Every
/// check that can refuse the request comes before the first write. Returns the session the
/// turn runs in and its native events.
async fn run(
    app: &AppState,
    caller: &Caller,
    target: Target,
    turn: Turn<'_>,
) -> Result<(SessionId, BoxStream<'static, StreamEvent>), OaiError> {
    let Turn { conversation, from, options, model } = turn;
    let from = from.min(conversation.messages.len());
    let new = &conversation.messages[from..];
    let new_images = &conversation.images[from..];
    let Some(((_, last), earlier)) = new.split_last() else {
        let session = match target {
            Target::New(create) => {
                submit(app, &create).await?;
                create.session_id
            }
            Target::Existing(row) => match read::last_user_message(&app.pool, caller.as_str(), row.id).await?
            {
                Some((seq, _, true)) => {
                    let create = fork_request(app, caller, &row, seq, None, "chat").await?;
                    submit(app, &create).await?;
                    create.session_id
                }
                _ => row.id,
            },
        };
        return Ok((session, retry_last(app, caller, session, model, options).await?));
    };
    if earlier.len() > MAX_NEW_MESSAGES {
        return Err(OaiError::bad_request(format!(
            "at most {MAX_NEW_MESSAGES} earlier messages can be added to a session at once"
        )));
    }
    // The new messages' images become the owner's files (the same bytes resent on every
    // request are one file), so the log keeps references (DESIGN §12) — after every check
    // that needs no file, so a refused request stores none.
    let owner = caller.as_str();
    let images: usize = new_images.iter().map(Vec::len).sum();
    if images > MAX_NEW_IMAGES {
        return Err(OaiError::bad_request(format!(
            "at most {MAX_NEW_IMAGES} images can be added to a session at once"
        )));
    }
    for (_, text) in new {
        validate::text(text)?;
    }
    if let Some(model) = &model {
        validate::model(&app.config, model)?;
    }
    let mut stored = Vec::with_capacity(new_images.len());
    for urls in new_images {
        let mut ids = Vec::with_capacity(urls.len());
        for url in urls {
            ids.push(files::image_from_data_url(app, owner, url).await?);
        }
        stored.push(ids);
    }
    let message = NewMessage {
        text: last.clone(),
        category: None,
        model,
        images: stored.pop().unwrap_or_default(),
        documents: Vec::new(),
    };
    let message = prepared(app, owner, &message).await?;
    let mut items: Vec<NewItem> = Vec::with_capacity(earlier.len());
    for ((user, text), ids) in earlier.iter().zip(&stored) {
        let images = files::attachments(&app.pool, app.files.as_ref(), owner, ids, &[]).await?.0;
        items.push(NewItem { assistant: !user, text: text.clone(), images });
    }
    for item in &items {
        validate::text(&item.text)?;
        let body = item.body();
        validate::event(body.kind(), &body.to_payload())?;
    }
    ready_for_turns(app)?;
    let (session, mut create) = match target {
        Target::Existing(row) => (row.id, None),
        Target::New(create) => (create.session_id, Some(create)),
    };
    if !items.is_empty() {
        if let Some(c) = create.take() {
            submit(app, &c).await?;
        }
        append_items(app, caller, session, items).await?;
    }
    Ok((session, begin_turn(app, caller, session, message, None, create, options).await?))
}

/// The turn options of a request: its system text and the sampling parameters it sets.
fn options(req: &CompletionRequest, system: Option<String>) -> Result<TurnOptions, OaiError> {
    let stop = match &req.stop {
        None => None,
        Some(Stop::One(s)) => Some(vec![s.clone()]),
        Some(Stop::Many(v)) => Some(v.clone()),
    };
    let too_long = |s: &String| s.is_empty() || s.chars().count() > MAX_PARAM_CHARS;
    if stop.as_ref().is_some_and(|s| s.len() > MAX_STOP || s.iter().any(too_long)) {
        return Err(OaiError::bad_request(format!(
            "stop is at most {MAX_STOP} sequences of 1-{MAX_PARAM_CHARS} characters"
        )));
    }
    if req.reasoning_effort.as_ref().is_some_and(too_long) {
        return Err(OaiError::bad_request(format!("reasoning_effort is 1-{MAX_PARAM_CHARS} characters")));
    }
    let options = TurnOptions {
        system,
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        temperature: req.temperature,
        top_p: req.top_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        seed: req.seed,
        stop,
        reasoning_effort: req.reasoning_effort.clone(),
    };
    // Before the request's earlier messages are added to its session.
    validate::turn_options(&options)?;
    Ok(options)
}

/// The stateless pass-through: the client's own body to the gateway (with the default
/// model when it names none), its answer back as it came.
async fn pass_through(
    app: &AppState,
    caller: &Caller,
    body: Bytes,
    without_model: bool,
) -> Result<Response, OaiError> {
    // Within the same caps as a stored turn, held until the answer is relayed.
    ready_for_turns(app)?;
    let slot = take_slot(app, caller)?;
    let upstream = app.upstream.clone().ok_or_else(|| {
        OaiError(ApiError::Unavailable("no model gateway is configured (TURNLOG_LLM_URL)".into()))
    })?;
    let v: Value = serde_json::from_slice(&body).map_err(|e| OaiError::bad_request(e.to_string()))?;
    let Value::Object(mut fields) = v else {
        return Err(OaiError::bad_request("the request body must be a JSON object"));
    };
    pass_through_fields(app, &fields)?;
    let body = if without_model {
        fields.insert("model".into(), json!(app.config.model));
        Bytes::from(Value::Object(fields).to_string())
    } else {
        body
    };
    let answer = upstream.forward(body).await.map_err(|e| {
        tracing::warn!(error = %e, "upstream failed (chat completions pass-through)");
        OaiError(ApiError::BadGateway(e.public_message()))
    })?;
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let relayed = answer.body.map(move |chunk| {
        let _held = &slot;
        chunk
    });
    let mut response = Response::new(Body::from_stream(relayed));
    *response.status_mut() = status;
    let content_type = answer.content_type.as_deref().unwrap_or("application/json");
    if let Ok(v) = HeaderValue::from_str(content_type) {
        response.headers_mut().insert("content-type", v);
    }
    response.headers_mut().insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// The fields of a pass-through body that choose a model or multiply the cost, checked as
/// a stored turn's are: a gateway's fallback models (OpenRouter's `models`, LiteLLM's
/// `fallbacks`, as names or `{model: [fallbacks]}` maps) must be allowed models; one answer
/// (`n`); no dearer service tier; and nothing stored at the gateway (`store`).
fn pass_through_fields(app: &AppState, fields: &serde_json::Map<String, Value>) -> Result<(), OaiError> {
    fn names<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::String(s) => out.push(s),
            Value::Array(a) => a.iter().for_each(|v| names(v, out)),
            Value::Object(o) => o.iter().for_each(|(k, v)| {
                out.push(k);
                names(v, out);
            }),
            _ => {}
        }
    }
    let mut models = Vec::new();
    for field in ["models", "fallbacks"] {
        if let Some(v) = fields.get(field) {
            names(v, &mut models);
        }
    }
    for model in models {
        validate::model(&app.config, model)?;
    }
    if fields.get("n").is_some_and(|n| !n.is_null() && n.as_u64() != Some(1)) {
        return Err(OaiError::bad_request("n must be 1"));
    }
    match fields.get("service_tier") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if matches!(t.as_str(), "auto" | "default" | "flex") => {}
        Some(_) => return Err(OaiError::bad_request("service_tier must be auto, default or flex")),
    }
    if fields.get("store").is_some_and(|s| *s != Value::Bool(false) && !s.is_null()) {
        return Err(OaiError::bad_request(
            "store: the gateway keeps nothing of a request turnlog does not store; send X-Session-Id to \
             store the conversation in turnlog",
        ));
    }
    Ok(())
}

/// What a turn's native events add up to: a pure fold of its [`TurnEvent`]s into Chat
/// Completions chunks and the completion.
#[derive(Default)]
struct Answer {
    id: String,
    created: i64,
    model: String,
    text: String,
    reasoning: String,
    error: Option<String>,
    end: Option<TurnEnd>,
}

impl Answer {
    /// Takes in a native event; the chunk it streams as, if any.
    fn on(&mut self, e: &TurnEvent) -> Option<Value> {
        match e {
            TurnEvent::Meta(m) => {
                let attempt =
                    m.attempt_id.as_deref().and_then(|a| Uuid::parse_str(a).ok()).unwrap_or_default();
                self.id = format!("chatcmpl-{}", attempt.simple());
                self.created = attempt.get_timestamp().map_or(0, |t| t.to_unix().0 as i64);
                self.model = m.model.clone().unwrap_or_default();
                Some(self.chunk(json!({"role": "assistant", "content": ""}), None))
            }
            TurnEvent::Delta(t) => {
                self.text.push_str(&t.text);
                Some(self.chunk(json!({"content": t.text}), None))
            }
            TurnEvent::Reasoning(t) => {
                self.reasoning.push_str(&t.text);
                Some(self.chunk(json!({"reasoning_content": t.text}), None))
            }
            TurnEvent::Error(e) => {
                self.error = Some(e.message.clone());
                None
            }
            TurnEvent::End(end) => {
                self.end = Some(end.clone());
                None
            }
        }
    }

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        })
    }

    /// `stop` or `length` when the turn ended with an answer (stopped ones included); else
    /// the failure's message.
    fn finish_reason(&self) -> Result<&'static str, String> {
        let failed = || Err(self.error.clone().unwrap_or_else(|| "the answer failed".into()));
        let Some(end) = &self.end else { return failed() };
        match end.status {
            TurnStatus::Completed if end.hit_length() => Ok("length"),
            TurnStatus::Completed | TurnStatus::Stopped => Ok("stop"),
            TurnStatus::Interrupted => Err(format!(
                "the answer was interrupted; its partial text is kept in session {}",
                end.session_id.map(|s| s.to_string()).unwrap_or_default()
            )),
            TurnStatus::Failed => failed(),
        }
    }

    /// OpenAI's usage object, with the cached share of the prompt.
    fn usage(&self) -> Value {
        let Some(u) = self.end.as_ref().and_then(|e| e.usage) else { return Value::Null };
        let (input, output) = (u.input_tokens, u.output_tokens);
        json!({
            "prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output,
            "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens.unwrap_or(0)},
        })
    }
}

/// A streamed completion: `chat.completion.chunk`s, the finish (or an error object, as
/// OpenAI streams one), the usage chunk when asked for, then `data: [DONE]`.
fn chunks(events: BoxStream<'static, StreamEvent>, include_usage: bool) -> Response {
    let chunks = futures::stream::unfold(
        (events, Answer::default(), false),
        move |(mut events, mut a, done)| async move {
            if done {
                return None;
            }
            loop {
                let Some(e) = events.next().await else {
                    return Some((end_chunks(&a, include_usage), (events, a, true)));
                };
                if let Some(chunk) = a.on(&e.event) {
                    return Some((vec![chunk], (events, a, false)));
                }
                if e.is_end() {
                    return Some((end_chunks(&a, include_usage), (events, a, true)));
                }
            }
        },
    )
    .flat_map(futures::stream::iter)
    .map(|chunk| Ok::<_, Infallible>(SseEvent::default().data(chunk.to_string())))
    .chain(futures::stream::once(async { Ok(SseEvent::default().data("[DONE]")) }));
    let mut response = Sse::new(chunks).keep_alive(KeepAlive::default()).into_response();
    let headers = response.headers_mut();
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
    response
}

fn end_chunks(a: &Answer, include_usage: bool) -> Vec<Value> {
    let mut out = vec![match a.finish_reason() {
        Ok(reason) => a.chunk(json!({}), Some(reason)),
        Err(message) => {
            json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}})
        }
    }];
    if include_usage {
        let mut usage = a.chunk(json!({}), None);
        usage["choices"] = json!([]);
        usage["usage"] = a.usage();
        out.push(usage);
    }
    out
}

/// A completion answered whole: `chat.completion`, or the turn's failure as an error.
async fn completion(mut events: BoxStream<'static, StreamEvent>) -> Result<Response, OaiError> {
    let mut a = Answer::default();
    while let Some(e) = events.next().await {
        a.on(&e.event);
    }
    let finish = a.finish_reason().map_err(|m| OaiError(ApiError::BadGateway(m)))?;
    let mut message = json!({"role": "assistant", "content": a.text, "refusal": null});
    if !a.reasoning.is_empty() {
        message["reasoning_content"] = json!(a.reasoning);
    }
    Ok(Json(json!({
        "id": a.id, "object": "chat.completion", "created": a.created, "model": a.model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
        "usage": a.usage(),
    }))
    .into_response())
}

/// List the models a client may ask for: the gateway's (cached), those turnlog allows.
#[utoipa::path(
    get, path = "/v1/models", tag = "openai", security(("bearer" = [])),
    responses((status = 200, description = "OpenAI's model list", body = Object), (status = 401, body = Object))
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

#[cfg(test)]
mod tests {
    use turnlog_core::stream::{Meta, Text};

    use super::*;

    fn messages(v: Value) -> Vec<WireMessage> {
        serde_json::from_value::<Vec<Value>>(v)
            .unwrap()
            .into_iter()
            .map(|m| WireMessage {
                role: m["role"].as_str().unwrap_or_default().to_owned(),
                content: m.get("content").cloned(),
                tool_calls: m.get("tool_calls").cloned(),
            })
            .collect()
    }

    #[test]
    fn a_conversation_keeps_system_text_apart_and_drops_empty_messages() {
        let c = conversation(&messages(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": ""},
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": "Weather?"},
        ])))
        .unwrap();
        assert_eq!(c.system.as_deref(), Some("Be brief.\n\nUse metric units."));
        assert_eq!(c.messages, vec![(true, "Hi there".to_owned()), (true, "Weather?".to_owned())]);
    }

    #[test]
    fn image_parts_ride_beside_their_message() {
        let c = conversation(&messages(json!([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "auto"}},
            ]},
        ])))
        .unwrap();
        assert_eq!(c.messages.last(), Some(&(true, "What is this?".to_owned())));
        assert_eq!(c.images, vec![vec![], vec![], vec!["data:image/png;base64,AAAA".to_owned()]]);
    }

    #[test]
    fn what_a_session_cannot_hold_is_refused() {
        for refused in [
            json!([]),
            json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]),
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
            json!([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, {"role": "user", "content": "x"}]),
            json!([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}, {"type": "text", "text": "x"}]}]),
            json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}, {"role": "user", "content": "x"}]),
            json!([{"role": "tool", "content": "42"}, {"role": "user", "content": "x"}]),
            json!([{"role": "narrator", "content": "x"}]),
            json!([{"role": "user", "content": 7}]),
            json!([{"role": "system", "content": "x".repeat(MAX_SYSTEM_PROMPT_BYTES + 1)}, {"role": "user", "content": "x"}]),
        ] {
            assert!(conversation(&messages(refused.clone())).is_err(), "{refused}");
        }
    }

    #[test]
    fn a_turn_reads_as_chunks_and_a_completion() {
        let event = |_id: u64, event: &str, data: Value| TurnEvent::from_parts(event, data).unwrap();
        let attempt = Uuid::now_v7();
        let mut a = Answer::default();
        let first =
            a.on(&event(1, "meta", json!({"attempt_id": attempt.to_string(), "model": "m"}))).unwrap();
        assert_eq!(first["id"], format!("chatcmpl-{}", attempt.simple()));
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(
            a.on(&event(2, "delta", json!({"text": "Hel"}))).unwrap()["choices"][0]["delta"]["content"],
            "Hel"
        );
        a.on(&event(3, "delta", json!({"text": "lo"})));
        let usage = json!({"input_tokens": 10, "output_tokens": 2, "cached_input_tokens": 8});
        assert!(a
            .on(&event(4, "end", json!({"status": "completed", "finish_reason": "length", "usage": usage})))
            .is_none());
        assert_eq!((a.text.as_str(), a.finish_reason()), ("Hello", Ok("length")));
        assert_eq!(a.usage()["prompt_tokens_details"]["cached_tokens"], 8);
        let ends = end_chunks(&a, true);
        assert_eq!(ends[0]["choices"][0]["finish_reason"], "length");
        assert_eq!(
            (ends[1]["choices"].as_array().map(Vec::len), &ends[1]["usage"]["total_tokens"]),
            (Some(0), &json!(12))
        );
        let mut failed = Answer::default();
        failed.on(&event(
            1,
            "error",
            json!({"code": "upstream_error", "message": "the model gateway answered 500"}),
        ));
        failed.on(&event(2, "end", json!({"status": "failed"})));
        assert_eq!(end_chunks(&failed, false)[0]["error"]["message"], "the model gateway answered 500");
    }

    #[test]
    fn how_a_turn_ended_is_how_its_completion_finishes() {
        let session = SessionId::new();
        let attempt = Uuid::now_v7();
        let meta =
            Meta { attempt_id: Some(attempt.to_string()), model: Some("m".into()), ..Default::default() };
        let text = |t: &str| Text { text: t.into() };
        let fold = |ending: Option<TurnStatus>| {
            let mut events = vec![
                TurnEvent::Meta(meta.clone()),
                TurnEvent::Reasoning(text("hm")),
                TurnEvent::Delta(text("Hi")),
            ];
            events.extend(ending.map(|status| TurnEvent::End(TurnEnd::new(Some(session), status))));
            let mut a = Answer::default();
            let chunks: Vec<Value> = events.iter().filter_map(|e| a.on(e)).collect();
            (a, chunks)
        };
        let (stopped, chunks) = fold(Some(TurnStatus::Stopped));
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(
            deltas,
            [
                &json!({"role": "assistant", "content": ""}),
                &json!({"reasoning_content": "hm"}),
                &json!({"content": "Hi"})
            ]
        );
        assert!(chunks
            .iter()
            .all(|c| c["id"] == format!("chatcmpl-{}", attempt.simple()) && c["model"] == "m"));
        // A stopped answer is an answer: it finishes as `stop`, without usage when none came.
        let ends = end_chunks(&stopped, true);
        assert_eq!(ends[0]["choices"][0]["finish_reason"], "stop");
        assert_eq!(ends[1]["usage"], Value::Null);
        let (interrupted, _) = fold(Some(TurnStatus::Interrupted));
        let message = end_chunks(&interrupted, false)[0]["error"]["message"].clone();
        assert_eq!(
            message,
            format!("the answer was interrupted; its partial text is kept in session {session}")
        );
        let (cut, _) = fold(None);
        assert_eq!(end_chunks(&cut, false)[0]["error"]["message"], "the answer failed");
    }
}
