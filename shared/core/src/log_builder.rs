//! Builds in-memory session logs (seq, ids and timestamps assigned as the writer would)
//! for tests, property tests and benchmarks across the workspace.

use chrono::{DateTime, TimeZone, Utc};

use crate::events::*;
use crate::ids::{AttemptId, EventId};

#[derive(Debug, Clone, Default)]
pub struct LogBuilder {
    pub events: Vec<Event>,
}

impl LogBuilder {
    /// A log holding its `session_started` (seq 1).
    pub fn new() -> Self {
        let mut b = Self::default();
        b.push(EventBody::SessionStarted(SessionStarted::default()));
        b
    }

    pub fn next_seq(&self) -> i64 {
        self.events.last().map_or(1, |e| e.seq + 1)
    }

    /// Appends an event; returns its seq.
    pub fn push(&mut self, body: EventBody) -> i64 {
        let seq = self.next_seq();
        let created_at: DateTime<Utc> =
            Utc.timestamp_opt(1_700_000_000 + seq, 0).single().unwrap_or_default();
        self.events.push(Event { seq, event_id: EventId::new(), created_at, body });
        seq
    }

    pub fn user(&mut self, text: &str) -> i64 {
        self.push(EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() }))
    }

    pub fn assistant(&mut self, text: &str) -> i64 {
        self.push(EventBody::AssistantTurn(assistant_turn(text, None)))
    }

    pub fn pending(&mut self, partial: &str, reason: Option<PendingReason>) -> i64 {
        self.push(EventBody::PendingState(PendingState {
            partial: partial.into(),
            reason,
            ..Default::default()
        }))
    }

    /// A step that asks for tool `name` with `arguments` (call `id`), saying `text` first.
    pub fn tool_step(&mut self, text: &str, id: &str, name: &str, arguments: &str) -> i64 {
        let mut step = assistant_turn(text, None);
        step.llm.message.content = (!text.is_empty()).then(|| MessageContent::Text(text.into()));
        step.llm.message.tool_calls.push(ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        });
        step.ui.blocks.push(Block {
            kind: BlockType::ToolCall,
            text: None,
            meta: Some(serde_json::json!({"call_id": id, "name": name, "arguments": arguments})),
        });
        step.finish_reason = Some("tool_calls".into());
        self.push(EventBody::AssistantTurn(step))
    }

    /// Call `id`'s result: `output`, from a client tool.
    pub fn tool_result(&mut self, id: &str, name: &str, output: &str) -> i64 {
        self.push(EventBody::ToolExecution(ToolExecution {
            call_id: id.into(),
            name: name.into(),
            source: Some("client".into()),
            output: Some(output.into()),
            status: "ok".into(),
            ..Default::default()
        }))
    }

    pub fn compaction(&mut self, summary: &str, through: i64) -> i64 {
        self.push(EventBody::CompactionApplied(CompactionApplied {
            summary: summary.into(),
            replaces_through_seq: through,
            facts_extracted: vec![],
        }))
    }
}

/// An `assistant_turn` whose UI text and model message are both `text`.
pub fn assistant_turn(text: &str, attempt_id: Option<&str>) -> AssistantTurn {
    AssistantTurn {
        ui: UiPart { blocks: vec![Block { kind: BlockType::Text, text: Some(text.into()), meta: None }] },
        llm: LlmPart {
            message: LlmMessage { content: Some(MessageContent::Text(text.into())), ..Default::default() },
        },
        attempt_id: attempt_id.map(AttemptId::from),
        ..Default::default()
    }
}

/// A `permission_request` `id` for the tool `shell` (call `call-<id>`, arguments
/// `{"cmd": "ls"}`) at `danger_level`.
pub fn permission_request(id: &str, danger_level: &str) -> EventBody {
    EventBody::PermissionRequest(PermissionRequest {
        id: id.into(),
        call_id: format!("call-{id}"),
        tool: "shell".into(),
        args: serde_json::json!({"cmd": "ls"}),
        danger_level: danger_level.into(),
        rationale: String::new(),
    })
}
