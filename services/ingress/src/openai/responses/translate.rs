//! A response as OpenAI's objects and `response.*` events, from a turn's native events
//! (live) or from its outcome in the log (finished): pure translation, no I/O. Which
//! events a response is made of, and where its stored outcome is read, is `stream`'s.

use serde_json::{json, Value};
use turnlog_core::events::{BlockType, EventBody, ToolCall};
use turnlog_core::ids::{AttemptId, SessionId};
use turnlog_core::stream::{turn_end_from_log, Text, ToolResultEvent, TurnEnd, TurnEvent, TurnStatus};
use turnlog_runtime::read::StoredEvent;
use turnlog_runtime::tools::SEPARATOR;
use uuid::Uuid;

use crate::openai::{
    conversation_id, function_call_item, message_id, output_message, reasoning_id, reasoning_item,
    response_id,
};

/// What a created response's object repeats of its request.
#[derive(Debug, Clone)]
pub struct Echo {
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub store: bool,
    pub background: bool,
    /// `text` as the request set it (None: plain text).
    pub text: Option<Value>,
    pub reasoning_effort: Option<String>,
    /// The function tools as the request offered them, its `tool_choice` and
    /// `parallel_tool_calls`.
    pub tools: Vec<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// The MCP servers the request names, as its `mcp_list_tools` items list them (§14).
    pub mcp: Vec<McpList>,
    /// The server calls this response's approvals let run (each with its approval
    /// request's id): their `mcp_call` items come first.
    pub approved: Vec<(ToolCall, String)>,
}

/// A server's tools as an `mcp_list_tools` item lists them.
#[derive(Debug, Clone, PartialEq)]
pub struct McpList {
    pub label: String,
    pub tools: Vec<Value>,
}

impl McpList {
    pub fn of(entry: turnlog_runtime::tools::ServerCatalog) -> Self {
        let tools = entry
            .tools
            .into_iter()
            .map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.input_schema, "annotations": null}))
            .collect();
        Self { label: entry.label, tools }
    }

    fn item(&self, attempt: Uuid, index: usize) -> Value {
        json!({"type": "mcp_list_tools", "id": format!("mcpl_{}{index:04x}", attempt.simple()),
            "server_label": self.label, "tools": self.tools, "error": null})
    }
}

/// A server call's `mcp_call` item: `mcp_`, the response's attempt id and the call's place
/// among its server calls (4 hex digits); its output, or its error as the server gave it.
fn mcp_call_item(attempt: Uuid, index: usize, call: &ToolCall, status: &str, output: Option<&str>) -> Value {
    let (label, tool) = call.name.split_once(SEPARATOR).unwrap_or(("", call.name.as_str()));
    let ok = status == "ok";
    let error = (!ok).then(|| {
        json!({"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": output.unwrap_or(status)}]})
    });
    json!({"type": "mcp_call", "id": format!("mcp_{}{index:04x}", attempt.simple()), "server_label": label,
        "name": tool, "arguments": call.arguments, "output": if ok { output } else { None },
        "error": error, "status": if ok { "completed" } else { "failed" }})
}

/// A server call's `mcp_call` item after its approval, naming the approval request.
fn approved_call_item(item: Value, approval_request_id: &str) -> Value {
    let mut item = item;
    item["approval_request_id"] = json!(approval_request_id);
    item
}

/// A server call's `mcp_approval_request` item: its id is the permission request's.
fn approval_item(id: &str, call: &ToolCall) -> Value {
    let (label, tool) = call.name.split_once(SEPARATOR).unwrap_or(("", call.name.as_str()));
    json!({"type": "mcp_approval_request", "id": id, "server_label": label, "name": tool, "arguments": call.arguments})
}

impl Default for Echo {
    fn default() -> Self {
        Self {
            instructions: None,
            previous_response_id: None,
            max_output_tokens: None,
            temperature: None,
            top_p: None,
            store: true,
            background: false,
            text: None,
            reasoning_effort: None,
            tools: Vec::new(),
            tool_choice: None,
            parallel_tool_calls: None,
            mcp: Vec::new(),
            approved: Vec::new(),
        }
    }
}

/// A response's object read from the log: `events` are its first step's outcome (the
/// attempt the response id names) and the session's events after it. A response spans
/// the steps one task ran (DESIGN §14): a step whose calls are all server calls that ran
/// without a prompt is followed by the next step of the same response; the response ends
/// with an answer, a failure, a step with client calls, or one whose prompt paused it. How
/// it ended is the log's word ([`turn_end_from_log`]) on its last step.
pub fn from_log(before: &[StoredEvent], events: &[StoredEvent], echo: &Echo) -> Value {
    let Some(first) = events.first() else {
        return Snapshot::new(SessionId(Uuid::nil()), echo.clone())
            .finish(Status::Failed("the response could not be read".into()));
    };
    let session = SessionId(first.session_id);
    let mut r = Snapshot::new(session, echo.clone());
    let unreadable = || Status::Failed("the response could not be read".into());
    let decoded: Vec<_> =
        events.iter().map(StoredEvent::decode).take_while(Result::is_ok).flatten().collect();
    let Some(e) = decoded.first() else { return r.finish(unreadable()) };
    let attempt = match &e.body {
        EventBody::AssistantTurn(a) => a.attempt_id.as_ref(),
        EventBody::PendingState(p) => p.attempt_id.as_ref(),
        EventBody::TurnFailed(f) => f.attempt_id.as_ref(),
        _ => return r.finish(unreadable()),
    };
    r.set_attempt(attempt);
    let sources = crate::turn::server::sources(&decoded);
    // The calls approvals let run before this response's first step (they ran in its task).
    let earlier: Vec<_> = before.iter().filter_map(|e| e.decode().ok()).collect();
    for (call, approval, result) in approved_before(&earlier) {
        let index = r.mcp_calls;
        r.mcp_calls += 1;
        let item = mcp_call_item(r.attempt(), index, &call, &result.status, result.output.as_deref());
        r.items.push(approved_call_item(item, &approval));
    }
    let mut last;
    let mut usage: Option<(u64, u64, u64)> = None;
    let mut length = false;
    let mut failure = None;
    let mut at = 0;
    loop {
        let step = &decoded[at];
        last = step;
        match &step.body {
            EventBody::AssistantTurn(a) => {
                if r.model.is_empty() {
                    r.model = a.model.clone().unwrap_or_default();
                }
                for b in &a.ui.blocks {
                    if b.kind == BlockType::Reasoning {
                        r.reasoning.push_str(b.text.as_deref().unwrap_or_default());
                    }
                }
                r.text.push_str(&a.ui_text());
                if let Some(u) = a.usage {
                    let (i, o, c) = usage.unwrap_or_default();
                    usage = Some((
                        i + u.input_tokens,
                        o + u.output_tokens,
                        c + u.cached_input_tokens.unwrap_or(0),
                    ));
                }
                length = a.finish_reason.as_deref() == Some("length");
                let mut paused = false;
                for call in &a.llm.message.tool_calls {
                    if !crate::turn::server::is_server(&sources, &call.id) {
                        r.calls.push(call.clone());
                        paused = true;
                        continue;
                    }
                    let asked = decoded[at..].iter().find_map(|e| match &e.body {
                        EventBody::PermissionRequest(p) if p.call_id == call.id => Some(p.id.clone()),
                        _ => None,
                    });
                    if let Some(id) = asked {
                        r.items.push(approval_item(&id, call));
                        paused = true;
                        continue;
                    }
                    let result = decoded[at..].iter().find_map(|e| match &e.body {
                        EventBody::ToolExecution(x) if x.call_id == call.id => Some(x),
                        _ => None,
                    });
                    let index = r.mcp_calls;
                    r.mcp_calls += 1;
                    r.items.push(match result {
                        Some(x) => mcp_call_item(r.attempt(), index, call, &x.status, x.output.as_deref()),
                        None => paused_call(mcp_call_item(r.attempt(), index, call, "ok", None)),
                    });
                    paused |= result.is_none();
                }
                if !a.asks_for_tools() || paused {
                    break;
                }
            }
            EventBody::PendingState(p) => {
                if r.model.is_empty() {
                    r.model = p.request.as_ref().map(|q| q.model.clone()).unwrap_or_default();
                }
                r.text.push_str(&p.partial);
                break;
            }
            EventBody::TurnFailed(f) => {
                if r.model.is_empty() {
                    r.model = f.request.as_ref().map(|q| q.model.clone()).unwrap_or_default();
                }
                failure = Some(f.message.clone());
                break;
            }
            _ => break,
        }
        // The next step of the same response: the next outcome before a new message.
        let next = decoded[at + 1..].iter().position(|e| match &e.body {
            EventBody::AssistantTurn(_) | EventBody::TurnFailed(_) | EventBody::UserMessage(_) => true,
            EventBody::PendingState(p) => p.reason.is_some(),
            _ => false,
        });
        match next.map(|n| at + 1 + n) {
            Some(n) if !matches!(decoded[n].body, EventBody::UserMessage(_)) => at = n,
            _ => break,
        }
    }
    r.usage = usage;
    let end = turn_end_from_log(session, [last]);
    r.finish(Status::of(end.status, length, failure))
}

/// In the events before a response's first step: the server calls of the step before it
/// that had a prompt, were approved, and have a result — each with its approval request's id.
fn approved_before(
    events: &[turnlog_core::events::Event],
) -> Vec<(ToolCall, String, turnlog_core::events::ToolExecution)> {
    let Some(at) = events.iter().rposition(|e| matches!(&e.body, EventBody::AssistantTurn(_))) else {
        return Vec::new();
    };
    let EventBody::AssistantTurn(step) = &events[at].body else { return Vec::new() };
    let after = &events[at..];
    // A new message since: this response is a new turn's.
    if after.iter().any(|e| matches!(&e.body, EventBody::UserMessage(_))) {
        return Vec::new();
    }
    step.llm
        .message
        .tool_calls
        .iter()
        .filter_map(|call| {
            let approval = after.iter().find_map(|e| match &e.body {
                EventBody::PermissionRequest(p) if p.call_id == call.id => Some(p.id.clone()),
                _ => None,
            })?;
            let approved = after.iter().any(|e| {
                matches!(&e.body, EventBody::PermissionResolved(r) if r.id == approval && r.decision != "deny")
            });
            let result = after.iter().find_map(|e| match &e.body {
                EventBody::ToolExecution(x) if x.call_id == call.id => Some(x.clone()),
                _ => None,
            })?;
            approved.then(|| (call.clone(), approval, result))
        })
        .collect()
}

/// An `mcp_call` item whose call has no result (yet): in progress, nothing out.
fn paused_call(mut item: Value) -> Value {
    item["status"] = json!("in_progress");
    item["output"] = Value::Null;
    item
}

/// The events of a finished response, as a re-attach replays them.
pub fn replay_finished(response: Value) -> Vec<Value> {
    let mut events = vec![
        json!({"type": "response.created", "response": in_progress(&response)}),
        json!({"type": "response.in_progress", "response": in_progress(&response)}),
    ];
    let items = response["output"].as_array().cloned().unwrap_or_default();
    for (index, item) in items.iter().enumerate() {
        let id = item["id"].clone();
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        if added["type"] == "message" {
            added["content"] = json!([]);
        }
        events.push(json!({"type": "response.output_item.added", "output_index": index, "item": added}));
        if item["type"] == "function_call" {
            events.extend(call_events(index, item));
            continue;
        }
        if let Some(mcp) = mcp_events(index, item) {
            events.extend(mcp);
            continue;
        }
        let part = &item["content"][0];
        let text = part["text"].clone();
        let (part_type, delta_type, done_type) = if item["type"] == "reasoning" {
            ("reasoning_text", "response.reasoning_text.delta", "response.reasoning_text.done")
        } else {
            ("output_text", "response.output_text.delta", "response.output_text.done")
        };
        events.push(json!({"type": "response.content_part.added", "item_id": id, "output_index": index,
            "content_index": 0, "part": empty_part(part_type)}));
        let mut delta = json!({"type": delta_type, "item_id": id, "output_index": index, "content_index": 0, "delta": text});
        let mut done = json!({"type": done_type, "item_id": id, "output_index": index, "content_index": 0, "text": text});
        if part_type == "output_text" {
            delta["logprobs"] = json!([]);
            done["logprobs"] = json!([]);
        }
        events.push(delta);
        events.push(done);
        events.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": index,
            "content_index": 0, "part": part}));
        events.push(json!({"type": "response.output_item.done", "output_index": index, "item": item}));
    }
    events.push(json!({"type": terminal_type(&response), "response": response}));
    events
}

/// A `function_call` item's events after its `response.output_item.added`: its arguments
/// whole in one delta, then done.
fn call_events(index: usize, item: &Value) -> Vec<Value> {
    let (id, arguments) = (&item["id"], &item["arguments"]);
    vec![
        json!({"type": "response.function_call_arguments.delta", "item_id": id, "output_index": index, "delta": arguments}),
        json!({"type": "response.function_call_arguments.done", "item_id": id, "output_index": index, "arguments": arguments}),
        json!({"type": "response.output_item.done", "output_index": index, "item": item}),
    ]
}

/// An MCP item's events after its `response.output_item.added` (None for other items).
fn mcp_events(index: usize, item: &Value) -> Option<Vec<Value>> {
    let id = &item["id"];
    let mut events = match item["type"].as_str()? {
        "mcp_list_tools" => vec![
            json!({"type": "response.mcp_list_tools.in_progress", "item_id": id, "output_index": index}),
            json!({"type": "response.mcp_list_tools.completed", "item_id": id, "output_index": index}),
        ],
        "mcp_call" => {
            let args = &item["arguments"];
            let mut e = vec![
                json!({"type": "response.mcp_call_arguments.delta", "item_id": id, "output_index": index, "delta": args}),
                json!({"type": "response.mcp_call_arguments.done", "item_id": id, "output_index": index, "arguments": args}),
                json!({"type": "response.mcp_call.in_progress", "item_id": id, "output_index": index}),
            ];
            match item["status"].as_str() {
                Some("completed") => e.push(
                    json!({"type": "response.mcp_call.completed", "item_id": id, "output_index": index}),
                ),
                Some("failed") => {
                    e.push(json!({"type": "response.mcp_call.failed", "item_id": id, "output_index": index}))
                }
                _ => {}
            }
            e
        }
        "mcp_approval_request" => Vec::new(),
        _ => return None,
    };
    events.push(json!({"type": "response.output_item.done", "output_index": index, "item": item}));
    Some(events)
}

/// An MCP item's `response.output_item.added` (as it starts: a list without its tools, a
/// call in progress without its output) and the events that finish it.
fn mcp_item_events(index: usize, item: &Value) -> Vec<Value> {
    let mut added = item.clone();
    match item["type"].as_str() {
        Some("mcp_list_tools") => added["tools"] = json!([]),
        Some("mcp_call") => {
            added["status"] = json!("in_progress");
            added["output"] = Value::Null;
            added["error"] = Value::Null;
            added["arguments"] = json!("");
        }
        _ => {}
    }
    let mut out = vec![json!({"type": "response.output_item.added", "output_index": index, "item": added})];
    out.extend(mcp_events(index, item).unwrap_or_default());
    out
}

fn empty_part(kind: &str) -> Value {
    match kind {
        "output_text" => json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
        _ => json!({"type": kind, "text": ""}),
    }
}

fn in_progress(response: &Value) -> Value {
    let mut r = response.clone();
    r["status"] = json!("in_progress");
    r["output"] = json!([]);
    r["usage"] = Value::Null;
    r["error"] = Value::Null;
    r["incomplete_details"] = Value::Null;
    r
}

fn terminal_type(response: &Value) -> &'static str {
    match response["status"].as_str() {
        Some("completed") => "response.completed",
        Some("failed") => "response.failed",
        _ => "response.incomplete",
    }
}

enum Status {
    Completed,
    Cancelled,
    Incomplete(Option<&'static str>),
    Failed(String),
}

impl Status {
    /// OpenAI's status of a turn that ended `status` (DESIGN §13): stopped is `cancelled`;
    /// interrupted, or cut at the output cap (`length`), `incomplete`; a failure says why.
    fn of(status: TurnStatus, length: bool, failure: Option<String>) -> Self {
        match status {
            TurnStatus::Completed if length => Status::Incomplete(Some("max_output_tokens")),
            // A step that asks for the client's tools is a completed response with its
            // `function_call` items (DESIGN §14).
            TurnStatus::Completed | TurnStatus::RequiresAction => Status::Completed,
            TurnStatus::Stopped => Status::Cancelled,
            TurnStatus::Interrupted => Status::Incomplete(None),
            TurnStatus::Failed => Status::Failed(failure.unwrap_or_else(|| "the response failed".into())),
        }
    }
}

/// A response as it stands: what its object is built from.
struct Snapshot {
    session: SessionId,
    attempt: Option<Uuid>,
    model: String,
    text: String,
    reasoning: String,
    calls: Vec<ToolCall>,
    /// Server tools' items (`mcp_call`, `mcp_approval_request`), in order (§14).
    items: Vec<Value>,
    /// The server calls numbered so far (their items' ids).
    mcp_calls: usize,
    usage: Option<(u64, u64, u64)>,
    echo: Echo,
    message_item: String,
    reasoning_item: String,
}

impl Snapshot {
    fn new(session: SessionId, echo: Echo) -> Self {
        Self {
            session,
            attempt: None,
            model: String::new(),
            text: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            items: Vec::new(),
            mcp_calls: 0,
            usage: None,
            echo,
            message_item: message_id(Uuid::nil()),
            reasoning_item: reasoning_id(Uuid::nil()),
        }
    }

    fn attempt(&self) -> Uuid {
        self.attempt.unwrap_or_default()
    }

    /// Names the attempt, and with it the ids of its items (made once, not per delta).
    fn set_attempt(&mut self, attempt: Option<&AttemptId>) {
        self.attempt = attempt.and_then(AttemptId::as_uuid);
        self.message_item = message_id(self.attempt());
        self.reasoning_item = reasoning_id(self.attempt());
    }

    fn message_id(&self) -> &str {
        &self.message_item
    }

    fn reasoning_id(&self) -> &str {
        &self.reasoning_item
    }

    /// The object with `status` and the output so far.
    fn object(&self, status: &str, output: Vec<Value>) -> Value {
        let attempt = self.attempt();
        let created_at = attempt.get_timestamp().map_or(0, |t| t.to_unix().0);
        let usage = self.usage.map(|(input, output, cached)| {
            json!({
                "input_tokens": input,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + output,
            })
        });
        json!({
            "id": response_id(attempt),
            "object": "response",
            "created_at": created_at,
            "status": status,
            "background": self.echo.background,
            "error": null,
            "incomplete_details": null,
            "instructions": self.echo.instructions,
            "max_output_tokens": self.echo.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.echo.parallel_tool_calls.unwrap_or(true),
            "previous_response_id": self.echo.previous_response_id,
            "reasoning": {"effort": self.echo.reasoning_effort, "summary": null},
            "store": self.echo.store,
            "temperature": self.echo.temperature,
            "text": self.echo.text.clone().unwrap_or_else(|| json!({"format": {"type": "text"}})),
            "tool_choice": self.echo.tool_choice.clone().unwrap_or_else(|| json!("auto")),
            "tools": self.echo.tools,
            "top_p": self.echo.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": {},
            // A stored response's conversation; none for `store: false`.
            "conversation": self.echo.store.then(|| json!({"id": conversation_id(self.session)})),
        })
    }

    /// The finished object.
    fn finish(&self, status: Status) -> Value {
        let item_status = if matches!(status, Status::Completed) { "completed" } else { "incomplete" };
        let mut output = Vec::new();
        if !self.reasoning.is_empty() {
            output.push(reasoning_item(self.reasoning_id(), &self.reasoning));
        }
        output.extend(self.echo.mcp.iter().enumerate().map(|(i, l)| l.item(self.attempt(), i)));
        output.extend(self.items.iter().cloned());
        if !self.text.is_empty() {
            output.push(output_message(self.message_id(), &self.text, item_status));
        }
        for (i, call) in self.calls.iter().enumerate() {
            output.push(function_call_item(self.attempt(), i, call, "completed"));
        }
        let (name, details, error) = match status {
            Status::Completed => ("completed", Value::Null, Value::Null),
            Status::Cancelled => ("cancelled", Value::Null, Value::Null),
            Status::Incomplete(reason) => ("incomplete", json!({ "reason": reason }), Value::Null),
            Status::Failed(message) => {
                ("failed", Value::Null, json!({"code": "server_error", "message": message}))
            }
        };
        let mut r = self.object(name, output);
        r["incomplete_details"] = details;
        r["error"] = error;
        r
    }
}

/// Which item the stream has open.
#[derive(PartialEq)]
enum Open {
    None,
    Reasoning,
    Message,
}

/// A turn's native events folded into OpenAI's `response.*` events: the response so far
/// and the item the stream has open. Pure: what it needs of the log is handed to [`Self::end`].
pub(super) struct Translator {
    r: Snapshot,
    open: Open,
    index: usize,
    failure: Option<String>,
    /// Server calls of this response waiting for their result or prompt, each with its
    /// place among the response's server calls and the approval that let it run, if any.
    pending: Vec<(ToolCall, usize, Option<String>)>,
}

impl Translator {
    pub(super) fn new(echo: Echo) -> Self {
        let mut r = Snapshot::new(SessionId(Uuid::nil()), echo);
        // The approved calls run first, before the response's first step.
        let pending = r
            .echo
            .approved
            .iter()
            .enumerate()
            .map(|(n, (call, approval))| (call.clone(), n, Some(approval.clone())))
            .collect();
        r.mcp_calls = r.echo.approved.len();
        Self { r, open: Open::None, index: 0, failure: None, pending }
    }

    /// The session the response runs in (once the `meta` named it).
    pub(super) fn session(&self) -> SessionId {
        self.r.session
    }

    /// The response's first step's attempt (its id), once the `meta` named it.
    pub(super) fn first_attempt(&self) -> Option<AttemptId> {
        self.r.attempt.map(AttemptId::from)
    }

    pub(super) fn echo(&self) -> &Echo {
        &self.r.echo
    }

    /// The OpenAI events of one native event.
    pub(super) fn on(&mut self, e: &TurnEvent) -> Vec<Value> {
        let Self { r, open, index, failure, pending } = self;
        let mut out = Vec::new();
        match e {
            TurnEvent::Meta(m) => {
                r.session = m.session_id.unwrap_or(r.session);
                r.set_attempt(m.attempt_id.as_ref());
                r.model = m.model.clone().unwrap_or_default();
                let created = r.object("in_progress", Vec::new());
                out.push(json!({"type": "response.created", "response": created}));
                out.push(
                    json!({"type": "response.in_progress", "response": r.object("in_progress", Vec::new())}),
                );
                // The named servers' tools (DESIGN §14), before anything the model does.
                for (i, list) in r.echo.mcp.iter().enumerate() {
                    out.extend(mcp_item_events(*index, &list.item(r.attempt(), i)));
                    *index += 1;
                }
            }
            TurnEvent::Reasoning(Text { text: delta }) if *open != Open::Message => {
                if *open == Open::None {
                    let item = json!({"type": "reasoning", "id": r.reasoning_id(), "summary": [], "content": [], "status": "in_progress"});
                    out.push(
                        json!({"type": "response.output_item.added", "output_index": *index, "item": item}),
                    );
                    out.push(json!({"type": "response.content_part.added", "item_id": r.reasoning_id(),
                        "output_index": *index, "content_index": 0, "part": empty_part("reasoning_text")}));
                    *open = Open::Reasoning;
                }
                r.reasoning.push_str(delta);
                out.push(json!({"type": "response.reasoning_text.delta", "item_id": r.reasoning_id(),
                    "output_index": *index, "content_index": 0, "delta": delta}));
            }
            TurnEvent::Reasoning(_) => {}
            TurnEvent::Delta(Text { text: delta }) => {
                if *open == Open::Reasoning {
                    close_reasoning(r, *index, &mut out);
                    *index += 1;
                }
                if *open != Open::Message {
                    let item = json!({"type": "message", "id": r.message_id(), "role": "assistant", "status": "in_progress", "content": []});
                    out.push(
                        json!({"type": "response.output_item.added", "output_index": *index, "item": item}),
                    );
                    out.push(json!({"type": "response.content_part.added", "item_id": r.message_id(),
                        "output_index": *index, "content_index": 0, "part": empty_part("output_text")}));
                    *open = Open::Message;
                }
                r.text.push_str(delta);
                out.push(json!({"type": "response.output_text.delta", "item_id": r.message_id(),
                    "output_index": *index, "content_index": 0, "delta": delta, "logprobs": []}));
            }
            TurnEvent::Error(e) => *failure = Some(e.message.clone()),
            // A server call shows once its result (an `mcp_call`) or its prompt (an
            // `mcp_approval_request`, which ends the response) is known.
            TurnEvent::ToolCall(c) if c.source != "client" => {
                let call =
                    ToolCall { id: c.call_id.clone(), name: c.name.clone(), arguments: c.arguments.clone() };
                pending.push((call, r.mcp_calls, None));
                r.mcp_calls += 1;
            }
            TurnEvent::Permission(p) => {
                if let Some(at) = pending.iter().position(|(c, _, _)| c.id == p.call_id) {
                    let (call, _, _) = pending.remove(at);
                    close_open(r, open, index, "completed", &mut out);
                    let item = approval_item(&p.id, &call);
                    out.extend(mcp_item_events(*index, &item));
                    r.items.push(item);
                    *index += 1;
                }
            }
            // A call streams whole once the step has made it, after the step's text.
            TurnEvent::ToolCall(c) => {
                close_open(r, open, index, "completed", &mut out);
                let call =
                    ToolCall { id: c.call_id.clone(), name: c.name.clone(), arguments: c.arguments.clone() };
                let item = function_call_item(r.attempt(), r.calls.len(), &call, "completed");
                let mut added = item.clone();
                added["status"] = json!("in_progress");
                added["arguments"] = json!("");
                out.push(
                    json!({"type": "response.output_item.added", "output_index": *index, "item": added}),
                );
                out.extend(call_events(*index, &item));
                r.calls.push(call);
                *index += 1;
            }
            // The results the client sent: nothing to stream back (a server call's come
            // through `result`).
            TurnEvent::ToolResult(res) => return self.result(res, None),
            TurnEvent::End(end) => return self.end(end, None),
        }
        out
    }

    /// Whether the response shows the result of call `call_id` (a server call of its own).
    pub(super) fn shows_result(&self, call_id: &str) -> bool {
        self.pending.iter().any(|(c, _, _)| c.id == call_id)
    }

    /// A server call's result, with the output the log holds: its `mcp_call` item.
    pub(super) fn result(&mut self, res: &ToolResultEvent, output: Option<String>) -> Vec<Value> {
        let Self { r, open, index, pending, .. } = self;
        let mut out = Vec::new();
        let Some(at) = pending.iter().position(|(c, _, _)| c.id == res.call_id) else { return out };
        let (call, n, approval) = pending.remove(at);
        close_open(r, open, index, "completed", &mut out);
        let output = output.or_else(|| res.digest.clone());
        let mut item = mcp_call_item(r.attempt(), n, &call, &res.status, output.as_deref());
        if let Some(approval) = approval {
            item = approved_call_item(item, &approval);
        }
        out.extend(mcp_item_events(*index, &item));
        r.items.push(item);
        *index += 1;
        out
    }

    /// The events that close the response: its open item's, then the terminal one, whose
    /// response is `stored` (read from the log by the outcome's seq) when there is one, else
    /// built from the stream and the `end` (`store: false`, or a log that could not be read).
    pub(super) fn end(&mut self, end: &TurnEnd, stored: Option<Value>) -> Vec<Value> {
        let Self { r, open, index, failure, .. } = self;
        let mut out = Vec::new();
        let response = stored.unwrap_or_else(|| {
            if let Some(u) = end.usage {
                r.usage = Some((u.input_tokens, u.output_tokens, u.cached_input_tokens.unwrap_or(0)));
            }
            r.finish(Status::of(end.status, end.hit_length(), failure.clone()))
        });
        let item_status = if response["status"] == "completed" { "completed" } else { "incomplete" };
        close_open(r, open, index, item_status, &mut out);
        out.push(json!({"type": terminal_type(&response), "response": response}));
        out
    }
}

/// Closes the item the stream has open (its `done` events, with `item_status`), and moves
/// `index` past it.
fn close_open(r: &Snapshot, open: &mut Open, index: &mut usize, item_status: &str, out: &mut Vec<Value>) {
    match open {
        Open::Reasoning => close_reasoning(r, *index, out),
        Open::Message => {
            let id = r.message_id();
            let part = json!({"type": "output_text", "text": r.text, "annotations": [], "logprobs": []});
            out.push(json!({"type": "response.output_text.done", "item_id": id, "output_index": *index,
                "content_index": 0, "text": r.text, "logprobs": []}));
            out.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": *index,
                "content_index": 0, "part": part}));
            out.push(json!({"type": "response.output_item.done", "output_index": *index,
                "item": output_message(id, &r.text, item_status)}));
        }
        Open::None => return,
    }
    *open = Open::None;
    *index += 1;
}

fn close_reasoning(r: &Snapshot, index: usize, out: &mut Vec<Value>) {
    let id = r.reasoning_id();
    let part = json!({"type": "reasoning_text", "text": r.reasoning});
    out.push(json!({"type": "response.reasoning_text.done", "item_id": id, "output_index": index,
        "content_index": 0, "text": r.reasoning}));
    out.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": index,
        "content_index": 0, "part": part}));
    out.push(json!({"type": "response.output_item.done", "output_index": index,
        "item": reasoning_item(id, &r.reasoning)}));
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use turnlog_core::events::Usage;
    use turnlog_core::stream::{FailureCode, Meta, OutcomeEvent, StreamError, STOPPED_BEFORE_TEXT};

    use super::*;

    fn meta(attempt: Uuid) -> TurnEvent {
        TurnEvent::Meta(Meta {
            session_id: Some(SessionId(Uuid::nil())),
            user_seq: Some(2),
            attempt_id: Some(attempt.into()),
            model: Some("m".into()),
        })
    }

    fn text(t: &str) -> Text {
        Text { text: t.into() }
    }

    /// Feeds `events` to a translator as [`translate`] does, with nothing stored.
    fn translated(events: &[TurnEvent]) -> Vec<Value> {
        let mut t = Translator::new(Echo::default());
        events.iter().flat_map(|e| t.on(e)).collect()
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap_or_default()).collect()
    }

    #[test]
    fn a_turn_streams_as_reasoning_then_a_message() {
        let attempt = Uuid::now_v7();
        let usage = Usage { input_tokens: 10, output_tokens: 4, cached_input_tokens: Some(8) };
        let end = TurnEnd {
            usage: Some(usage),
            finish_reason: Some(Some("stop".into())),
            ..TurnEnd::new(Some(SessionId(Uuid::nil())), TurnStatus::Completed)
        };
        let out = translated(&[
            meta(attempt),
            TurnEvent::Reasoning(text("hm")),
            TurnEvent::Delta(text("Hel")),
            TurnEvent::Reasoning(text("ignored once the message is open")),
            TurnEvent::Delta(text("lo")),
            TurnEvent::End(end),
        ]);
        assert_eq!(
            types(&out),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(out[0]["response"]["id"], response_id(attempt));
        assert_eq!(out[0]["response"]["status"], "in_progress");
        assert_eq!(out[4]["item_id"], reasoning_id(attempt));
        assert_eq!((&out[10]["item_id"], &out[10]["output_index"]), (&json!(message_id(attempt)), &json!(1)));
        assert_eq!(out[12]["text"], "Hello");
        let response = &out[15]["response"];
        assert_eq!(response["status"], "completed");
        assert_eq!(response["output"][0]["type"], "reasoning");
        assert_eq!(response["output"][1]["content"][0]["text"], "Hello");
        assert_eq!(response["usage"]["input_tokens_details"]["cached_tokens"], 8);
        assert_eq!(response["usage"]["total_tokens"], 14);
    }

    #[test]
    fn how_a_turn_ended_is_the_response_status() {
        let s = Some(SessionId(Uuid::nil()));
        let end = |status, finish: Option<&str>| {
            TurnEvent::End(TurnEnd {
                finish_reason: Some(finish.map(str::to_owned)),
                ..TurnEnd::new(s, status)
            })
        };
        let last = |events: Vec<TurnEvent>| translated(&events).pop().unwrap();
        let partial =
            |ending: TurnEvent| last(vec![meta(Uuid::now_v7()), TurnEvent::Delta(text("Hel")), ending]);

        let length = partial(end(TurnStatus::Completed, Some("length")));
        assert_eq!(
            (length["type"].as_str(), &length["response"]["status"]),
            (Some("response.incomplete"), &json!("incomplete"))
        );
        assert_eq!(length["response"]["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(length["response"]["output"][0]["status"], "incomplete");

        let stopped = partial(TurnEvent::End(TurnEnd::new(s, TurnStatus::Stopped)));
        assert_eq!(
            (stopped["type"].as_str(), &stopped["response"]["status"]),
            (Some("response.incomplete"), &json!("cancelled"))
        );

        let interrupted = partial(TurnEvent::End(TurnEnd::new(s, TurnStatus::Interrupted)));
        assert_eq!(interrupted["response"]["status"], "incomplete");
        assert_eq!(interrupted["response"]["incomplete_details"]["reason"], Value::Null);

        let error =
            StreamError { code: FailureCode::UpstreamError, message: "the gateway answered 500".into() };
        let failed = last(vec![
            meta(Uuid::now_v7()),
            TurnEvent::Error(error),
            TurnEvent::End(TurnEnd::new(s, TurnStatus::Failed)),
        ]);
        assert_eq!(
            (failed["type"].as_str(), &failed["response"]["status"]),
            (Some("response.failed"), &json!("failed"))
        );
        assert_eq!(
            failed["response"]["error"],
            json!({"code": "server_error", "message": "the gateway answered 500"})
        );
        let silent = last(vec![meta(Uuid::now_v7()), TurnEvent::End(TurnEnd::new(s, TurnStatus::Failed))]);
        assert_eq!(silent["response"]["error"]["message"], "the response failed");
    }

    #[test]
    fn a_stored_outcome_is_the_final_response() {
        let mut t = Translator::new(Echo::default());
        t.on(&meta(Uuid::now_v7()));
        t.on(&TurnEvent::Delta(text("Hel")));
        let end = TurnEnd {
            outcome: Some(OutcomeEvent::Answer(3)),
            ..TurnEnd::new(Some(SessionId(Uuid::nil())), TurnStatus::Completed)
        };
        let stored = json!({"status": "completed", "output": [], "usage": {"total_tokens": 99}});
        let out = t.end(&end, Some(stored.clone()));
        assert_eq!(
            types(&out)[..3],
            ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
        );
        assert_eq!(out[2]["item"]["status"], "completed");
        assert_eq!(out[3], json!({"type": "response.completed", "response": stored}));
    }

    fn stored(kind: &str, payload: Value) -> StoredEvent {
        StoredEvent {
            session_id: Uuid::nil(),
            seq: 3,
            event_id: Uuid::now_v7(),
            kind: kind.into(),
            payload,
            tokens: 0,
            created_at: Utc::now(),
        }
    }

    #[test]
    fn a_response_read_from_the_log_ends_as_its_outcome_says() {
        let attempt = Uuid::now_v7().to_string();
        let status = |kind: &str, payload: Value| {
            let r = from_log(&[], &[stored(kind, payload)], &Echo::default());
            (r["status"].as_str().unwrap_or_default().to_owned(), r["error"]["message"].clone())
        };
        let failed = |code: &str, message: &str| {
            status("turn_failed", json!({"code": code, "message": message, "attempt_id": attempt}))
        };
        assert_eq!(failed("stopped", STOPPED_BEFORE_TEXT), ("cancelled".into(), Value::Null));
        // As a stop before any text was stored before its code said so.
        assert_eq!(failed("interrupted", STOPPED_BEFORE_TEXT), ("cancelled".into(), Value::Null));
        assert_eq!(
            failed("interrupted", "interrupted before any text arrived"),
            ("failed".into(), json!("interrupted before any text arrived"))
        );
        assert_eq!(failed("upstream_error", "500"), ("failed".into(), json!("500")));
        let pending = |reason: Value| {
            status("pending_state", json!({"partial": "Hel", "attempt_id": attempt, "reason": reason})).0
        };
        assert_eq!(pending(json!("stopped")), "cancelled");
        assert_eq!(pending(json!("interrupted")), "incomplete");
        assert_eq!(pending(Value::Null), "incomplete", "a checkpoint: its copy died");
        let answer = |finish: &str| {
            let ui = json!({"blocks": [{"type": "text", "text": "Hello"}]});
            status("assistant_turn", json!({"ui": ui, "attempt_id": attempt, "finish_reason": finish})).0
        };
        assert_eq!(answer("stop"), "completed");
        assert_eq!(answer("length"), "incomplete");
        assert_eq!(status("user_message", json!({"text": "q"})).1, json!("the response could not be read"));
    }
}
