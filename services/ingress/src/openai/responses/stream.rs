//! A response's stream (DESIGN §13): a turn's native events as OpenAI's `response.*`
//! events, its terminal response read back from the log, numbered by `sequence_number`
//! and answered as an event stream, or as the one response object a request without
//! `stream` gets.

use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use futures::StreamExt as _;
use serde_json::{json, Value};
use turnlog_core::ids::{AttemptId, Owner, SessionId};
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
                let stored =
                    stored_outcome(&app, &owner, t.session(), end, t.first_attempt(), t.echo()).await;
                t.end(end, stored)
            }
            // A server call's result: its whole output, as the log holds it.
            TurnEvent::ToolResult(res) if t.shows_result(&res.call_id) => {
                let output = tool_output(&app, &owner, t.session(), &res.call_id).await;
                t.result(res, output)
            }
            event => t.on(event),
        };
        Some((futures::stream::iter(out), (t, events, app, owner)))
    })
    .flatten()
    .boxed()
}

/// The response object of a turn's stored outcome (when the `end` names one), read from
/// the log from the response's first step, with the request's echo; None when there is
/// none or it cannot be read.
async fn stored_outcome(
    app: &AppState,
    owner: &Owner,
    session: SessionId,
    end: &TurnEnd,
    first: Option<AttemptId>,
    echo: &Echo,
) -> Option<Value> {
    end.outcome?;
    let event = read::attempt_event(&app.pool, owner, &first?).await.ok()??;
    let mut response = stored_response(app, owner, event, echo).await.ok()?;
    response["conversation"] = json!({"id": conversation_id(session)});
    Some(response)
}

/// Most events after a response's first step read to build it (a turn of
/// `TURNLOG_MAX_TOOL_STEPS` steps with their results fits).
const RESPONSE_EVENTS: i64 = 2_000;
/// Most events before a response's first step read for the calls its approvals let run.
const EVENTS_BEFORE: i64 = 256;

/// A stored response's object: its first step's event (`first`, the attempt its id names)
/// and the steps and results after it (DESIGN §14).
pub async fn stored_response(
    app: &AppState,
    owner: &Owner,
    first: read::StoredEvent,
    echo: &Echo,
) -> Result<Value, sqlx::Error> {
    let session = SessionId(first.session_id);
    let from = (first.seq - 1 - EVENTS_BEFORE).max(0);
    let mut before =
        read::events_page(&app.pool, owner, session, from, EVENTS_BEFORE).await?.unwrap_or_default();
    before.retain(|e| e.seq < first.seq);
    let later =
        read::events_page(&app.pool, owner, session, first.seq, RESPONSE_EVENTS).await?.unwrap_or_default();
    let mut events = Vec::with_capacity(later.len() + 1);
    events.push(first);
    events.extend(later);
    Ok(from_log(&before, &events, echo))
}

/// The output the log holds for call `call_id`'s result (None when it cannot be read).
async fn tool_output(app: &AppState, owner: &Owner, session: SessionId, call_id: &str) -> Option<String> {
    let event_id = crate::turn::server::result_event_id(owner, session, call_id);
    let seq = read::recorded_outcome(&app.pool, event_id).await.ok()??.seq?;
    let event = read::event_at(&app.pool, owner, session, seq).await.ok()??;
    event.payload.get("output").and_then(Value::as_str).map(str::to_owned)
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
