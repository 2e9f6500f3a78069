//! A streamed answer read item by item. The reader must tell an answer that ended with
//! `[DONE]` (complete, store it) from one that broke off (checkpoint the partial), so the
//! clean end is the only `Ok(None)` and every other ending is an error.

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use eventsource_stream::{Event, EventStream, EventStreamError};
use futures::{Stream, StreamExt};

use super::{error_chain, wire, TimeoutPhase, UpstreamError, Usage};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamItem {
    Text(String),
    Reasoning(String),
    Usage(Usage),
    /// The provider's `finish_reason` (`stop`, `length`, `tool_calls`, ...).
    Finish(String),
}

/// Why the byte stream under the SSE parser stopped.
enum BodyError {
    Transport(reqwest::Error),
    Idle,
}

type Events = Pin<Box<dyn Stream<Item = Result<Event, EventStreamError<BodyError>>> + Send>>;

enum State {
    Open,
    Done,
    Failed(UpstreamError),
}

/// One streamed answer, from a success status to `[DONE]` or an error. Dropping it closes
/// the connection, which is how a reader stops an answer early.
pub struct ChatStream {
    events: Events,
    pending: VecDeque<StreamItem>,
    state: State,
    idle: Duration,
}

impl ChatStream {
    pub(super) fn new(response: reqwest::Response, idle: Duration) -> Self {
        // The idle clock runs on bytes, not events: a `: keep-alive` comment proves the
        // provider is alive (routers send them while a model is queued) though the SSE
        // parser swallows it.
        let bytes = futures::stream::unfold(Some(response.bytes_stream()), move |body| async move {
            let mut body = body?;
            match tokio::time::timeout(idle, body.next()).await {
                Ok(Some(Ok(chunk))) => Some((Ok::<Bytes, _>(chunk), Some(body))),
                Ok(Some(Err(e))) => Some((Err(BodyError::Transport(e)), None)),
                Ok(None) => None,
                Err(_) => Some((Err(BodyError::Idle), None)),
            }
        });
        Self { events: Box::pin(EventStream::new(bytes)), pending: VecDeque::new(), state: State::Open, idle }
    }

    /// The next item; `Ok(None)` once the provider has sent `[DONE]`. After an error the
    /// stream is finished and repeats that error.
    pub async fn next(&mut self) -> Result<Option<StreamItem>, UpstreamError> {
        loop {
            if let Some(item) = self.pending.pop_front() {
                return Ok(Some(item));
            }
            match &self.state {
                State::Open => {}
                State::Done => return Ok(None),
                State::Failed(e) => return Err(e.clone()),
            }
            match self.read_event().await {
                Ok(Some(items)) => self.pending.extend(items),
                Ok(None) => self.state = State::Done,
                Err(e) => self.state = State::Failed(e),
            }
        }
    }

    /// The items of the next data event; `None` at `[DONE]`.
    async fn read_event(&mut self) -> Result<Option<Vec<StreamItem>>, UpstreamError> {
        let event = match self.events.next().await {
            Some(Ok(event)) => event,
            Some(Err(EventStreamError::Transport(BodyError::Idle))) => {
                return Err(UpstreamError::Timeout { phase: TimeoutPhase::Idle, after: self.idle })
            }
            Some(Err(EventStreamError::Transport(BodyError::Transport(e)))) => {
                return Err(UpstreamError::Incomplete(error_chain(&e)))
            }
            Some(Err(EventStreamError::Utf8(e))) => {
                return Err(UpstreamError::Malformed(format!("stream is not UTF-8: {e}")))
            }
            Some(Err(EventStreamError::Parser(e))) => {
                return Err(UpstreamError::Malformed(format!("stream is not SSE: {e}")))
            }
            None => return Err(UpstreamError::Incomplete("connection closed".into())),
        };
        let data = event.data.trim();
        if data == "[DONE]" {
            return Ok(None);
        }
        if data.is_empty() {
            return Ok(Some(Vec::new()));
        }
        wire::parse_chunk(data).map(Some)
    }
}
