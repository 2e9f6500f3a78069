//! Every event stream the ingress answers with is built here, one way: keep-alive comments
//! every 15 s, no proxy buffering (`X-Accel-Buffering: no`), no caching. The native turn
//! stream (DESIGN §7) and OpenAI's streams (§13) differ only in their frames.

use std::convert::Infallible;
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _};
use serde_json::Value;
use turnlog_core::ids::SessionId;
use turnlog_core::stream::StreamEvent;

use crate::Ingress;

const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// A turn's native events (`id:`, `event:`, `data:`), with `X-Session-Id` before any body
/// byte, counted as an open turn stream until it closes.
pub fn turn(app: &Ingress, session: SessionId, events: BoxStream<'static, StreamEvent>) -> Response {
    let guard = app.metrics.stream_opened();
    let frames = events.map(move |e| {
        let _held = &guard;
        let data = e.event.data().to_string();
        Event::default().id(e.id.to_string()).event(e.event.name()).data(data)
    });
    respond(frames, Some(session))
}

/// OpenAI's stream: each value as `data:` (after `event: <name>` when it has one), then
/// `data: [DONE]`.
pub fn openai(events: impl Stream<Item = (Option<String>, Value)> + Send + 'static) -> Response {
    let frames = events
        .map(|(name, data)| match name {
            Some(name) => Event::default().event(name).data(data.to_string()),
            None => Event::default().data(data.to_string()),
        })
        .chain(futures::stream::once(async { Event::default().data("[DONE]") }));
    respond(frames, None)
}

/// The one SSE response: `frames` as they come, keep-alive comments, `X-Session-Id` when a
/// session is named, no proxy buffering or caching.
fn respond(frames: impl Stream<Item = Event> + Send + 'static, session: Option<SessionId>) -> Response {
    let frames = frames.map(Ok::<_, Infallible>);
    let mut response = Sse::new(frames).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response();
    let headers = response.headers_mut();
    if let Some(v) = session.and_then(|s| HeaderValue::from_str(&s.to_string()).ok()) {
        headers.insert("x-session-id", v);
    }
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
    response
}
