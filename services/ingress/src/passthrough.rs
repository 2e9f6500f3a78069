//! The stateless pass-through (DESIGN §13): a request turnlog does not store — Responses'
//! `store: false`, a Chat Completions request without a session header, or one that is a
//! front end's side task — goes to the model gateway and its answer back, and nothing is
//! written: no session, no event, no turn. It holds one of the owner's concurrent-turn slots
//! while it is relayed, as a stored turn does. A body turnlog built is streamed back as a
//! turn's native events ([`relay`]); a client's own Chat Completions body is forwarded as it
//! came, its answer relayed byte for byte ([`forward`]).

use std::collections::VecDeque;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use futures::stream::BoxStream;
use futures::StreamExt as _;
use serde_json::{json, Value};
use turnlog_core::events::Usage;
use turnlog_core::ids::AttemptId;
use turnlog_core::request_body::RequestBody;
use turnlog_core::stream::{
    FailureCode, Meta, StreamError, StreamEvent, Text, TurnEnd, TurnEvent, TurnStatus,
};
use turnlog_runtime::upstream::{ChatStream, StreamItem, UpstreamClient};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::turn::{ready_for_turns, take_slot, TurnSlot};
use crate::{validate, Ingress};

/// The model gateway, or 503 when none is configured.
pub fn gateway(app: &Ingress) -> Result<UpstreamClient, ApiError> {
    app.upstream
        .clone()
        .ok_or_else(|| ApiError::Unavailable("no model gateway is configured (TURNLOG_LLM_URL)".into()))
}

/// A slot under the same caps as a stored turn (503 while the copy shuts down, 429 over
/// the caps), held until the answer is relayed.
pub fn slot(app: &Ingress, caller: &Caller) -> Result<TurnSlot, ApiError> {
    ready_for_turns(app)?;
    take_slot(app, caller)
}

/// Streams `body` (a request for `model`) from the gateway, read as a turn's native events:
/// a `meta` with a fresh attempt id, the deltas and reasoning, an `end` (completed, with
/// the usage and finish reason) or an `error` and a failed `end`. `slot` is given back when
/// the stream ends or its client leaves.
pub async fn relay(
    upstream: &UpstreamClient,
    body: &RequestBody,
    model: String,
    slot: TurnSlot,
) -> Result<BoxStream<'static, StreamEvent>, ApiError> {
    let chat = upstream.stream_body(body).await.map_err(|e| {
        tracing::warn!(error = %e, "upstream failed (store: false)");
        ApiError::Unavailable(e.public_message())
    })?;
    let meta = Meta { attempt_id: Some(AttemptId::new()), model: Some(model), ..Default::default() };
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
                // No tools are offered through this relay (`tools` is refused), so a call
                // is a model's own mistake: nothing to relay.
                Ok(Some(StreamItem::ToolCall(_))) => {}
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
    Ok(events.boxed())
}

/// A gateway's stream read as a turn's native events.
struct Relay {
    chat: ChatStream,
    /// Events read and not yet given out.
    queue: VecDeque<TurnEvent>,
    /// The next event's id.
    id: u64,
    usage: Option<Usage>,
    finish: Option<String>,
    /// The gateway's stream is over.
    done: bool,
    /// The owner's turn slot, given back when the relay ends or its client leaves.
    _slot: TurnSlot,
}

/// A client's own Chat Completions `body` to the gateway (with the default model when it
/// names none), after `forwarded_fields`' checks; the gateway's answer back as it came,
/// its status and content type included. `slot` is given back when the answer is relayed.
pub async fn forward(
    app: &Ingress,
    upstream: &UpstreamClient,
    body: Bytes,
    without_model: bool,
    slot: TurnSlot,
) -> Result<Response, ApiError> {
    let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let Value::Object(mut fields) = v else {
        return Err(ApiError::bad_request("the request body must be a JSON object"));
    };
    forwarded_fields(app, &fields)?;
    let body = if without_model {
        fields.insert("model".into(), json!(app.config.model));
        Bytes::from(Value::Object(fields).to_string())
    } else {
        body
    };
    let answer = upstream.forward(body).await.map_err(|e| {
        tracing::warn!(error = %e, "upstream failed (chat completions pass-through)");
        ApiError::BadGateway(e.public_message())
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

/// The fields of a forwarded body that choose a model or multiply the cost, checked as a
/// stored turn's are: a gateway's fallback models (OpenRouter's `models`, LiteLLM's
/// `fallbacks`, as names or `{model: [fallbacks]}` maps) must be allowed models; one answer
/// (`n`); no dearer service tier; and nothing stored at the gateway (`store`).
fn forwarded_fields(app: &Ingress, fields: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
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
        return Err(ApiError::bad_request("n must be 1"));
    }
    match fields.get("service_tier") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if matches!(t.as_str(), "auto" | "default" | "flex") => {}
        Some(_) => return Err(ApiError::bad_request("service_tier must be auto, default or flex")),
    }
    if fields.get("store").is_some_and(|s| *s != Value::Bool(false) && !s.is_null()) {
        return Err(ApiError::bad_request(
            "store: the gateway keeps nothing of a request turnlog does not store; send X-Session-Id to \
             store the conversation in turnlog",
        ));
    }
    Ok(())
}
