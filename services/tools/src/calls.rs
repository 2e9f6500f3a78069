//! Running the calls the turns send (DESIGN §14): each at most once. A copy claims a call
//! before it starts it; a call delivered again whose claim exists was cut off (its copy
//! crashed or was killed mid-call) and is recorded as an error, never run again, because an
//! MCP call carries no idempotency key: whether a write happened cannot be known. The
//! result goes through the writer as the call's `tool_execution`, with the event id the
//! ingress chose, so whoever records the call first (this worker; the ingress on a stop or
//! a timeout) is the only record.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::jetstream::message::{AckKind, Message};
use rmcp::model::CallToolRequestParams;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use turnlog_core::events::{EventBody, ToolExecution};
use turnlog_core::limits::{capped_output, output_digest};
use turnlog_runtime::bus::{append_and_wait, AppendRequest};
use turnlog_runtime::read::recorded_outcome;
use turnlog_runtime::tools::{namespaced, ToolCallRequest};

use crate::servers::Server;
use crate::Shared;

/// What a call cut off by a crash records.
pub const INTERRUPTED: &str =
    "the tools worker running this call stopped before it finished; the call was not \
run again, and it may or may not have taken effect";
/// How often a running call tells JetStream it is still being worked on.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How long a call waits for its server's connection before it fails.
const CONNECT_WAIT: Duration = Duration::from_secs(5);
/// How long a result's append may keep trying.
const APPEND_WAIT: Duration = Duration::from_secs(60);

/// The calls running in this copy, by event id, so a cancellation finds them.
#[derive(Default)]
pub(crate) struct Running(Mutex<HashMap<uuid::Uuid, CancellationToken>>);

impl Running {
    fn start(&self, id: uuid::Uuid) -> CancellationToken {
        let token = CancellationToken::new();
        self.0.lock().unwrap_or_else(PoisonError::into_inner).insert(id, token.clone());
        token
    }
    fn end(&self, id: uuid::Uuid) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
    }
    pub(crate) fn cancel(&self, id: uuid::Uuid) {
        if let Some(t) = self.0.lock().unwrap_or_else(PoisonError::into_inner).get(&id) {
            t.cancel();
        }
    }
}

/// How one call ended.
struct Finished {
    status: &'static str,
    output: String,
}

impl Finished {
    fn error(output: impl Into<String>) -> Self {
        Self { status: "error", output: output.into() }
    }
}

/// Handles one delivered call: acknowledged once its outcome is recorded (or known to be).
pub(crate) async fn handle(shared: Arc<Shared>, msg: Message) {
    let call: ToolCallRequest = match serde_json::from_slice(&msg.payload) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "unreadable tool call; dropped");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    let span = tracing::info_span!(
        "tool_call",
        session_id = %call.session_id,
        call_id = %call.call_id,
        tool = %namespaced(&call.label, &call.tool),
        status = tracing::field::Empty,
    );
    let parent =
        msg.headers.as_ref().and_then(|h| h.get(turnlog_runtime::trace::TRACEPARENT)).map(|v| v.to_string());
    turnlog_runtime::trace::follow(&span, parent.as_deref());
    async move {
        match run(&shared, &call, &msg).await {
            Ok(()) => {
                let _ = msg.ack().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "tool call outcome not recorded; it comes back later");
                let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(2)))).await;
            }
        }
    }
    .instrument(span)
    .await
}

async fn run(shared: &Shared, call: &ToolCallRequest, msg: &Message) -> anyhow::Result<()> {
    // Recorded already: by this worker before a lost ack, or by the ingress (a stop, a timeout).
    if recorded_outcome(&shared.pool, call.event_id).await?.is_some() {
        return Ok(());
    }
    let name = namespaced(&call.label, &call.tool);
    if chrono::Utc::now() >= call.deadline {
        tracing::info!("tool call arrived after its deadline; the turn records it");
        shared.metrics.recorded(&call.label, &call.tool, "expired");
        return Ok(());
    }
    if !shared.tools.claim(call.event_id, &shared.holder).await? {
        tracing::warn!("tool call delivered again after its worker stopped mid-call; not run again");
        shared.metrics.recorded(&call.label, &call.tool, "error");
        return record(shared, call, &name, Finished::error(INTERRUPTED), None).await;
    }
    let server = shared.servers.iter().find(|s| s.config.label == call.label);
    let cancel = shared.running.start(call.event_id);
    let started = Instant::now();
    shared.metrics.started();
    let finished = {
        let progress = async {
            loop {
                tokio::time::sleep(PROGRESS_EVERY).await;
                let _ = msg.ack_with(AckKind::Progress).await;
            }
        };
        tokio::select! {
            f = execute(shared, server.map(Arc::as_ref), call) => f,
            () = progress => unreachable!(),
            () = cancel.cancelled() => Finished { status: "cancelled", output: "cancelled: the turn was stopped".into() },
        }
    };
    shared.running.end(call.event_id);
    shared.metrics.finished(&call.label, &call.tool, finished.status, started.elapsed().as_secs_f64());
    tracing::Span::current().record("status", finished.status);
    let duration = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    record(shared, call, &name, finished, Some(duration)).await
}

/// Calls the tool within the call's time.
async fn execute(shared: &Shared, server: Option<&Server>, call: &ToolCallRequest) -> Finished {
    let Some(server) = server else {
        return Finished::error(format!("no MCP server {:?} is configured", call.label));
    };
    // A worker just started, or a server being restarted, gets a moment to connect; then
    // the call fails clearly rather than hang its turn.
    let waited = tokio::time::Instant::now() + CONNECT_WAIT;
    let peer = loop {
        match server.peer() {
            Some(peer) => break peer,
            None if tokio::time::Instant::now() < waited => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            None => {
                return Finished::error(format!(
                    "the MCP server {:?} is not running now (it is being restarted)",
                    call.label
                ))
            }
        }
    };
    let arguments = match serde_json::from_str::<serde_json::Value>(&call.arguments) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => return Finished::error("the arguments are not a JSON object"),
    };
    let left = (call.deadline - chrono::Utc::now()).to_std().unwrap_or_default();
    let limit = left.min(shared.timeout);
    let request = CallToolRequestParams::new(call.tool.clone()).with_arguments(arguments);
    // Dropping the request on a timeout sends MCP's notifications/cancelled.
    match tokio::time::timeout(limit, peer.call_tool(request)).await {
        Err(_) => Finished {
            status: "timeout",
            output: format!("the tool did not answer within {} s", limit.as_secs()),
        },
        Ok(Err(e)) => Finished::error(short(&format!("the MCP server failed the call: {e}"))),
        Ok(Ok(result)) => {
            let output = text_of(&result);
            if result.is_error == Some(true) {
                Finished::error(output)
            } else {
                Finished { status: "ok", output }
            }
        }
    }
}

/// A server's error message, shortened: the model and the user need its gist.
fn short(message: &str) -> String {
    const MAX: usize = 500;
    if message.chars().count() <= MAX {
        return message.to_owned();
    }
    message.chars().take(MAX).collect::<String>() + "…"
}

/// A result's content as the text the model is sent: text blocks as they are, other
/// blocks as a line naming them; the structured content when there is nothing else.
fn text_of(result: &rmcp::model::CallToolResult) -> String {
    let mut parts = Vec::new();
    for block in &result.content {
        let v = serde_json::to_value(block).unwrap_or_default();
        let field = |k: &str| v.get(k).and_then(serde_json::Value::as_str).unwrap_or_default().to_owned();
        let part = match field("type").as_str() {
            "text" => field("text"),
            "image" | "audio" => {
                format!("[{} {}, {} bytes of base64]", field("type"), field("mimeType"), field("data").len())
            }
            "resource_link" => format!("[resource link: {}]", field("uri")),
            "resource" => {
                let r = v.get("resource").cloned().unwrap_or_default();
                match r.get("text").and_then(serde_json::Value::as_str) {
                    Some(text) => text.to_owned(),
                    None => format!(
                        "[resource: {}]",
                        r.get("uri").and_then(serde_json::Value::as_str).unwrap_or("?")
                    ),
                }
            }
            other => format!("[{other} content]"),
        };
        parts.push(part);
    }
    if parts.is_empty() {
        if let Some(s) = &result.structured_content {
            return s.to_string();
        }
    }
    parts.join("\n")
}

/// Appends the call's `tool_execution` (the writer collapses a second record of it).
async fn record(
    shared: &Shared,
    call: &ToolCallRequest,
    name: &str,
    finished: Finished,
    duration_ms: Option<u64>,
) -> anyhow::Result<()> {
    // A server's NUL would make the result unstorable: it is shown as U+FFFD.
    let output = capped_output(&finished.output.replace('\0', "\u{FFFD}"), shared.output_max);
    let body = EventBody::ToolExecution(ToolExecution {
        call_id: call.call_id.clone(),
        name: name.to_owned(),
        source: Some(format!("mcp:{}", call.label)),
        args: serde_json::from_str(&call.arguments).ok(),
        result_digest: output_digest(&output),
        is_error: (finished.status != "ok").then_some(true),
        output: Some(output),
        status: finished.status.into(),
        duration_ms,
    });
    let req = AppendRequest::append(call.session_id, &call.owner, call.event_id, &body);
    let deadline = Instant::now() + APPEND_WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(500));
        match append_and_wait(&shared.tools.bus, &shared.pool, &req, left).await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e.into()),
            Err(e) => {
                tracing::debug!(error = %e, "tool result append failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}
