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
    /// A piece of a tool call (DESIGN §14).
    ToolCall(ToolCallDelta),
}

/// A piece of the step's tool call number `index`: its id and name arrive once (with its
/// first piece), its arguments' JSON text in pieces to concatenate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub index: usize,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

/// A step's tool calls put together from their pieces, in index order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolCalls {
    calls: Vec<turnlog_core::events::ToolCall>,
}

/// Most tool calls one step may make, and most bytes their arguments may take together.
pub const MAX_TOOL_CALLS: usize = 128;
pub const MAX_TOOL_ARGUMENTS_BYTES: usize = 256 * 1024;

impl ToolCalls {
    /// Adds a piece; an error when the step passes [`MAX_TOOL_CALLS`] or
    /// [`MAX_TOOL_ARGUMENTS_BYTES`] (a provider's answer is input like any other).
    pub fn add(&mut self, delta: ToolCallDelta) -> Result<(), String> {
        if delta.index >= MAX_TOOL_CALLS {
            return Err(format!("a step asked for more than {MAX_TOOL_CALLS} tool calls"));
        }
        let total: usize = self.calls.iter().map(|c| c.arguments.len()).sum();
        if total + delta.arguments.len() > MAX_TOOL_ARGUMENTS_BYTES {
            return Err(format!("a step's tool arguments took more than {MAX_TOOL_ARGUMENTS_BYTES} bytes"));
        }
        if self.calls.len() <= delta.index {
            self.calls.resize_with(delta.index + 1, Default::default);
        }
        let call = &mut self.calls[delta.index];
        if let Some(id) = delta.id {
            call.id = id;
        }
        if let Some(name) = delta.name {
            call.name = name;
        }
        call.arguments.push_str(&delta.arguments);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// The calls, or the first one a provider left without an id or a name.
    pub fn finish(self) -> Result<Vec<turnlog_core::events::ToolCall>, String> {
        match self.calls.iter().position(|c| c.id.is_empty() || c.name.is_empty()) {
            Some(i) => Err(format!("tool call {i} came without an id or a name")),
            None => Ok(self.calls),
        }
    }
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
