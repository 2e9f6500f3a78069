//! A response's stream (DESIGN §13): a turn's native events as OpenAI's `response.*`
//! events, its terminal response read back from the log, numbered by `sequence_number`
//! and answered as an event stream, or as the one response object a request without
//! `stream` gets.

use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use futures::StreamExt as _;
use serde_json::{json, Value};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_core::stream::{StreamEvent, TurnEnd, TurnEvent};
use turnlog_runtime::read;

use super::translate::{from_log, Echo, Translator};
use crate::error::ApiError;
use crate::openai::{conversation_id, OaiError};
use crate::{sse, AppState};

/// The native events of a turn as OpenAI's `response.*` events (without their
/// `sequence_number`, which [`numbered`] numbers: a pure function of the native events, so
/// a re-attach from the turn's first event numbers them alike). Ends with the terminal
/// event, whose response is read back from the log (usage included) when the `end` names
/// the turn's outcome: the one read here; the rest is `Translator`'s.
pub fn translate(
    app: AppState,
    owner: Owner,
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
    owner: &Owner,
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

/// A created response's answer: with `stream`, its events; with `background`, its object
/// at once (`in_progress`; the turn runs on by itself, as every turn does, and the client
/// polls or re-attaches by the response's id); else the object it ended with.
pub async fn answer(
    translated: BoxStream<'static, Value>,
    stream: bool,
    background: bool,
) -> Result<Response, OaiError> {
    if stream {
        return Ok(numbered(translated, None));
    }
    if background {
        return Ok(Json(created_response(translated).await).into_response());
    }
    match last_response(translated).await {
        Some(response) => Ok(Json(response).into_response()),
        None => Err(OaiError(ApiError::internal(anyhow::anyhow!("the turn ended without a response")))),
    }
}

/// The response object of a stream's terminal event (it ends with one).
pub async fn last_response(translated: BoxStream<'static, Value>) -> Option<Value> {
    let mut last = translated.fold(None, |_, e| async move { Some(e) }).await?;
    last.get_mut("response").map(Value::take)
}

/// The response object of a stream's first event, `response.created` (`in_progress`).
pub async fn created_response(mut translated: BoxStream<'static, Value>) -> Value {
    let first = translated.next().await;
    first.and_then(|mut e| e.get_mut("response").map(Value::take)).unwrap_or_default()
}

/// OpenAI's stream: `event: <type>`, `sequence_number` counted from 0, events at or before
/// `starting_after` left out, then `data: [DONE]`.
pub fn numbered(events: BoxStream<'static, Value>, starting_after: Option<u64>) -> Response {
    let numbered = events
        .enumerate()
        .filter_map(move |(n, mut e)| {
            let n = n as u64;
            e["sequence_number"] = json!(n);
            futures::future::ready(starting_after.is_none_or(|after| n > after).then_some(e))
        })
        .map(|e| (Some(e["type"].as_str().unwrap_or("message").to_owned()), e));
    sse::openai(numbered)
}
