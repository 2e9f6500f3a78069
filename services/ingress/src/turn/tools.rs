//! A turn that pauses for client tools and continues (DESIGN §14): the results a client
//! sends are checked against what the turn waits for, recorded (one `tool_execution` each,
//! its event id derived from the call id, so a resend stores nothing twice), and the turn
//! goes on with its next step — the same turn, no new user message, with the options its
//! last step recorded.

use futures::stream::BoxStream;
use turnlog_core::events::{Event, EventBody, ToolExecution};
use turnlog_core::ids::SessionId;
use turnlog_core::limits::{capped_output, output_digest};
use turnlog_core::llm_context::current_turn_start;
use turnlog_core::stream::{waiting_calls, Required, ToolResultEvent};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read;

use super::follow::follow_local;
use super::server;
use super::start::{ready_for_turns, take_slot};
use super::{start_turn, StreamEvent, ToolOffer, TurnOptions, TurnSlot, TurnStart};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::writes::submit;
use crate::AppState;
use turnlog_runtime::lease::Lease;

/// Most results one request may send.
const MAX_RESULTS: usize = 128;
/// Most characters of a call id a client sends back (the model's ids are far shorter).
pub const MAX_CALL_ID: usize = 256;

/// Most function tools one request may offer, and most bytes their definitions may take.
const MAX_TOOLS: usize = 128;
pub(super) const MAX_TOOLS_BYTES: usize = 64 * 1024;

/// The tools a native request offers (DESIGN §14), checked: an array of Chat Completions'
/// function tools (`{type: "function", function: {name, description?, parameters?}}`,
/// names of 1-64 of `[A-Za-z0-9_-]`, each once), `tool_choice` (`none`, `auto`,
/// `required`, or a function the request offers) and `parallel_tool_calls`. The text is
/// kept as sent: it is what the model gets, and what the audit records.
pub fn tool_offer(
    tools: Option<&serde_json::value::RawValue>,
    tool_choice: Option<&serde_json::value::RawValue>,
    parallel_tool_calls: Option<bool>,
) -> Result<Option<ToolOffer>, ApiError> {
    let Some(tools) = tools else {
        if tool_choice.is_some() || parallel_tool_calls.is_some() {
            return Err(ApiError::bad_request("tool_choice and parallel_tool_calls need tools"));
        }
        return Ok(None);
    };
    if tools.get().len() > MAX_TOOLS_BYTES {
        return Err(ApiError::bad_request(format!("tools take at most {MAX_TOOLS_BYTES} bytes")));
    }
    crate::validate::storable("tools", tools.get())?;
    let bad = |why: &str| ApiError::bad_request(format!("tools: {why}"));
    let list: Vec<serde_json::Value> =
        serde_json::from_str(tools.get()).map_err(|_| bad("must be an array of function tools"))?;
    if list.is_empty() || list.len() > MAX_TOOLS {
        return Err(bad(&format!("1-{MAX_TOOLS} tools")));
    }
    let mut names = std::collections::HashSet::new();
    for t in &list {
        let name = t.pointer("/function/name").and_then(serde_json::Value::as_str).unwrap_or_default();
        let name_ok = (1..=64).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if t.get("type").and_then(serde_json::Value::as_str) != Some("function") || !name_ok {
            return Err(bad(
                "each is {type: \"function\", function: {name}} with a name of 1-64 letters, digits, _ or -",
            ));
        }
        if t.pointer("/function/parameters").is_some_and(|p| !p.is_object()) {
            return Err(bad(&format!("{name}'s parameters must be a JSON schema object")));
        }
        if !names.insert(name.to_owned()) {
            return Err(bad(&format!("{name} is offered twice")));
        }
    }
    if let Some(choice) = tool_choice {
        let v: serde_json::Value =
            serde_json::from_str(choice.get()).map_err(|_| bad("tool_choice is not JSON"))?;
        let ok = match &v {
            serde_json::Value::String(s) => matches!(s.as_str(), "none" | "auto" | "required"),
            _ => v
                .pointer("/function/name")
                .and_then(serde_json::Value::as_str)
                .is_some_and(|n| names.contains(n)),
        };
        if !ok {
            return Err(ApiError::bad_request(
                "tool_choice is none, auto, required, or {type: \"function\", function: {name}} naming an offered tool",
            ));
        }
    }
    Ok(Some(ToolOffer {
        tools: tools.get().to_owned(),
        tool_choice: tool_choice.map(|c| c.get().to_owned()),
        parallel_tool_calls,
    }))
}

/// Whether a client's call id is 1 to [`MAX_CALL_ID`] characters.
pub fn call_id_fits(call_id: &str) -> bool {
    !call_id.is_empty() && call_id.chars().count() <= MAX_CALL_ID
}

/// A client tool's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    pub call_id: String,
    pub output: String,
    pub is_error: bool,
}

/// Records `results` for the turn paused in session `id` and continues it: the turn's
/// native events, opening with `meta`, then a `tool_result` per result, then the next
/// step. Nothing is appended unless every result names a call the turn waits for and
/// every call it waits for has one: a call id the turn never made is a 404, one already
/// answered a 409, a missing one a 400 that names it. A resend after a write that failed
/// part way (some of the step's results recorded, some not) records the rest: the
/// recorded ones, while their step still waits for others, are not written again.
pub async fn continue_with_results(
    app: &AppState,
    caller: &Caller,
    id: SessionId,
    results: Vec<ToolResult>,
) -> Result<BoxStream<'static, StreamEvent>, ApiError> {
    if results.is_empty() || results.len() > MAX_RESULTS {
        return Err(ApiError::bad_request(format!("results holds 1-{MAX_RESULTS} results")));
    }
    for r in &results {
        if !call_id_fits(&r.call_id) {
            return Err(ApiError::bad_request(format!(
                "a result names its call by a call id of 1-{MAX_CALL_ID} characters"
            )));
        }
        crate::validate::storable("a tool's output", &r.output)?;
    }
    ready_for_turns(app)?;
    let slot = take_slot(app, caller)?;
    let lease = app
        .leases
        .acquire(id, &app.instance_id)
        .await?
        .ok_or_else(|| ApiError::Conflict("a turn is already running in this session".into()))?;
    let prepared = async {
        let tail =
            read::live_tail(&app.pool, caller.owner(), id).await?.ok_or_else(ApiError::session_not_found)?;
        // The client's calls: the server's are the turn's to see to.
        let sources = server::sources(&tail.events);
        let mut waiting = waiting_calls(&tail.events);
        waiting.retain(|c| !server::is_server(&sources, &c.id));
        let start = current_turn_start(&tail.events);
        let turn: Vec<_> = tail.events.iter().filter(|e| e.seq > start).collect();
        // The step that asked: its calls' names and arguments, and the request it recorded.
        let step = turn.iter().rev().find_map(|e| match &e.body {
            EventBody::AssistantTurn(t) if t.asks_for_tools() => Some(t),
            _ => None,
        });
        // A result of that step's that is recorded, while the step still waits for others.
        let recorded_for_step = |call: &str| {
            !waiting.is_empty()
                && step.is_some_and(|t| t.llm.message.tool_calls.iter().any(|c| c.id == call))
                && turn.iter().any(|e| matches!(&e.body, EventBody::ToolExecution(x) if x.call_id == call))
        };
        let mut seen = std::collections::HashSet::new();
        for r in &results {
            if !seen.insert(r.call_id.as_str()) {
                return Err(ApiError::bad_request(format!("call {:?} has two results", r.call_id)));
            }
            // Recorded by an earlier try of this request that failed part way.
            if recorded_for_step(&r.call_id) {
                continue;
            }
            if !waiting.iter().any(|c| c.id == r.call_id) {
                // A result (or a cancellation) recorded under the id this one would get.
                let answered =
                    read::recorded_outcome(&app.pool, result_event_id(caller, id, &r.call_id)).await?;
                return Err(if answered.is_some() {
                    ApiError::Conflict(format!("call {:?} is already answered", r.call_id))
                } else {
                    ApiError::NotFound(format!("no call {:?} waits for a result in this session", r.call_id))
                });
            }
        }
        let missing: Vec<&str> =
            waiting.iter().filter(|c| !seen.contains(c.id.as_str())).map(|c| c.id.as_str()).collect();
        if !missing.is_empty() {
            return Err(ApiError::bad_request(format!("results are missing for {}", missing.join(", "))));
        }
        Ok((waiting, resume_point(app, &tail.events, step)?))
    };
    let (waiting, resumed) = match prepared.await {
        Ok(p) => p,
        Err(e) => {
            let _ = app.leases.release(lease).await;
            return Err(e);
        }
    };
    let mut told = Vec::with_capacity(results.len());
    for r in results {
        let Some(call) = waiting.iter().find(|c| c.id == r.call_id) else { continue };
        let status = if r.is_error { "error" } else { "ok" };
        let output = capped_output(&r.output, app.config.tool_output_max);
        let digest = output_digest(&output);
        let body = EventBody::ToolExecution(ToolExecution {
            call_id: r.call_id.clone(),
            name: call.name.clone(),
            source: Some("client".into()),
            args: serde_json::from_str(&call.arguments).ok(),
            output: Some(output),
            is_error: r.is_error.then_some(true),
            result_digest: digest.clone(),
            status: status.into(),
            duration_ms: None,
        });
        let event_id = result_event_id(caller, id, &r.call_id);
        if let Err(e) = submit(app, &AppendRequest::append(id, caller.owner(), event_id, &body)).await {
            let _ = app.leases.release(lease).await;
            return Err(e);
        }
        told.push(ToolResultEvent { call_id: r.call_id, status: status.into(), digest });
    }
    Ok(follow_local(start_turn(app, resumed.start(caller, id, lease, slot, told)), 0))
}

/// Where a paused turn goes on from: its user message, and the options and model its
/// asking step recorded.
struct Resumed {
    user_seq: i64,
    user_text: String,
    options: TurnOptions,
    model: String,
}

impl Resumed {
    /// The continued turn's start, telling `results` (just recorded) after its `meta`.
    fn start(
        self,
        caller: &Caller,
        id: SessionId,
        lease: Lease,
        slot: TurnSlot,
        results: Vec<ToolResultEvent>,
    ) -> TurnStart {
        TurnStart {
            session: id,
            owner: caller.owner().clone(),
            user_seq: self.user_seq,
            user_text: self.user_text,
            model: self.model,
            lease,
            slot,
            options: self.options,
            results,
            continued: true,
            tail: None,
        }
    }
}

/// Where a paused turn goes on from: its user message, and the options and model its
/// asking `step` recorded — as they were sent, what the record left out taken from the log.
fn resume_point(
    app: &AppState,
    events: &[Event],
    step: Option<&turnlog_core::events::AssistantTurn>,
) -> Result<Resumed, ApiError> {
    let start = current_turn_start(events);
    let (user_seq, user_text) = events
        .iter()
        .find_map(|e| match &e.body {
            EventBody::UserMessage(m) if e.seq == start => Some((e.seq, m.text.clone())),
            _ => None,
        })
        .ok_or_else(|| ApiError::Conflict("the paused turn's message is no longer in reach".into()))?;
    let recorded = step
        .and_then(|t| t.request.as_ref())
        .map(|r| turnlog_core::audit::resolved(events, r))
        .transpose()
        .map_err(ApiError::internal)?;
    let options = recorded.as_ref().map(TurnOptions::of_recorded).unwrap_or_default();
    let model = recorded.map(|r| r.model).unwrap_or_else(|| app.config.model.clone());
    Ok(Resumed { user_seq, user_text, options, model })
}

/// After a permission answer (DESIGN §14): a turn paused on call `call_id`'s prompt goes
/// on — its events, from `meta` — unless the turn runs now (its own wait hears the answer:
/// None) or no longer waits for that call (None).
pub async fn continue_after_permission(
    app: &AppState,
    caller: &Caller,
    id: SessionId,
    call_id: &str,
    permission_wait: Option<std::time::Duration>,
) -> Result<Option<BoxStream<'static, StreamEvent>>, ApiError> {
    let waits = |events: &[Event]| waiting_calls(events).iter().any(|c| c.id == call_id);
    let events = read::current_turn(&app.pool, caller.owner(), id, CURRENT_TURN_EVENTS)
        .await?
        .ok_or_else(ApiError::session_not_found)?;
    if !waits(&events) || app.turns.get(id).is_some() {
        return Ok(None);
    }
    ready_for_turns(app)?;
    let slot = take_slot(app, caller)?;
    // Held by a turn running elsewhere: it hears the answer itself.
    let Some(lease) = app.leases.acquire(id, &app.instance_id).await? else { return Ok(None) };
    let prepared = async {
        let tail =
            read::live_tail(&app.pool, caller.owner(), id).await?.ok_or_else(ApiError::session_not_found)?;
        if !waits(&tail.events) {
            return Ok(None);
        }
        let step = tail.events.iter().rev().find_map(|e| match &e.body {
            EventBody::AssistantTurn(t) if t.asks_for_tools() => Some(t),
            _ => None,
        });
        resume_point(app, &tail.events, step).map(Some)
    };
    let mut resumed = match prepared.await {
        Ok(Some(p)) => p,
        other => {
            let _ = app.leases.release(lease).await;
            return other.map(|_| None);
        }
    };
    resumed.options.permission_wait = permission_wait;
    Ok(Some(follow_local(start_turn(app, resumed.start(caller, id, lease, slot, Vec::new())), 0)))
}

/// Most events of the current turn read to find what a paused turn waits for (a turn of
/// `TURNLOG_MAX_TOOL_STEPS` steps of [`MAX_RESULTS`] calls each fits many times over).
const CURRENT_TURN_EVENTS: i64 = 20_000;

/// The calls the session's turn waits for (DESIGN §14: a paused turn), as `required`
/// entries; empty when none.
pub async fn waiting(app: &AppState, caller: &Caller, id: SessionId) -> Result<Vec<Required>, ApiError> {
    let events = read::current_turn(&app.pool, caller.owner(), id, CURRENT_TURN_EVENTS)
        .await?
        .ok_or_else(ApiError::session_not_found)?;
    Ok(required_of(&events))
}

/// What the turn in `events` waits for from its user: each client call's result, and the
/// answer to each server call's unanswered permission request (a server call that runs,
/// or waits to, needs nothing from them).
fn required_of(events: &[Event]) -> Vec<Required> {
    let sources = server::sources(events);
    waiting_calls(events)
        .iter()
        .filter_map(|c| {
            if !server::is_server(&sources, &c.id) {
                return Some(Required::tool(c));
            }
            let perm = events.iter().find_map(|e| match &e.body {
                EventBody::PermissionRequest(p) if p.call_id == c.id => Some(p.id.as_str()),
                _ => None,
            })?;
            let answered =
                events.iter().any(|e| matches!(&e.body, EventBody::PermissionResolved(r) if r.id == perm));
            (!answered).then(|| Required::permission(c, perm))
        })
        .collect()
}

/// Before a new user message: the calls a paused turn still waits for are recorded as
/// `cancelled` (DESIGN §14), each with the event id its result would have had, so a
/// result sent later is a 409 and a resend of the message records nothing twice. A server
/// call still running is asked to stop. The live tail they were found in, as read before.
pub async fn cancel_waiting(
    app: &AppState,
    caller: &Caller,
    id: SessionId,
) -> Result<read::LiveTail, ApiError> {
    let tail =
        read::live_tail(&app.pool, caller.owner(), id).await?.ok_or_else(ApiError::session_not_found)?;
    let sources = server::sources(&tail.events);
    for call in waiting_calls(&tail.events) {
        let event_id = result_event_id(caller, id, &call.id);
        let source = sources.get(&call.id).cloned().unwrap_or_else(|| "client".into());
        if server::is_server(&sources, &call.id) {
            app.tools.cancel(event_id).await;
        }
        let body = EventBody::ToolExecution(ToolExecution {
            call_id: call.id.clone(),
            name: call.name.clone(),
            source: Some(source),
            args: serde_json::from_str(&call.arguments).ok(),
            output: Some(CANCELLED_OUTPUT.into()),
            is_error: Some(true),
            result_digest: Some(CANCELLED_OUTPUT.into()),
            status: "cancelled".into(),
            duration_ms: None,
        });
        submit(app, &AppendRequest::append(id, caller.owner(), event_id, &body)).await?;
    }
    Ok(tail)
}

/// The event id of a call's result in session `id`: one per call, so a resend records
/// nothing twice and an answered call is found by it.
fn result_event_id(caller: &Caller, id: SessionId, call_id: &str) -> uuid::Uuid {
    super::server::result_event_id(caller.owner(), id, call_id)
}

/// What a cancelled call's output says.
const CANCELLED_OUTPUT: &str = "cancelled: the user sent a new message before this tool's result";
