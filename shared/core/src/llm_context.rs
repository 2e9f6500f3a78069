//! What the model sees: a pure projection of a session's events into chat messages.
//! Appending an event only ever extends this list (prefix stability, so provider prompt
//! caches keep hitting); only a new compaction moves the prefix, and the live pending
//! disappears when its turn's successor completes.

use crate::events::{
    AssistantTurn, CompactionApplied, Event, EventBody, EventKind, PendingReason, PendingState, Projection,
    ToolExecution, TurnFailed, TurnMemory, UserMessage,
};
use crate::message::{ChatMessage, Content, ContentPart, Role};

/// First line of the user-role message that stands for everything a compaction replaced.
pub const SUMMARY_MARKER: &str = "[Summary of the earlier conversation; it replaces those messages]";
/// Ends the live pending when its answer was cut off by a fault.
pub const INTERRUPTED_NOTE: &str = "[this response was interrupted mid-stream; continue from it]";
/// Ends the live pending when the user stopped it.
pub const STOPPED_NOTE: &str = "[this response was stopped by the user]";

/// Which event a projected message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The newest compaction's summary, standing for everything up to its boundary.
    Summary,
    User,
    Assistant,
    /// The newest unsuperseded partial answer.
    LivePending,
    TurnMemory,
    TurnFailed,
    /// A tool's result (DESIGN §14), within its turn.
    Tool,
}

/// How long a turn's tool traffic stays in the model's history (`TURNLOG_TOOL_HISTORY`,
/// DESIGN §14): within its turn only (`turn`, the default), or until a compaction
/// summarizes it (`keep`). A request records which it was built with (§11).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolHistory {
    #[default]
    Turn,
    Keep,
}

impl ToolHistory {
    pub fn is_turn(&self) -> bool {
        *self == ToolHistory::Turn
    }

    /// Whether tool traffic at `seq` projects, the current turn starting at `turn_start`.
    fn projects(self, seq: i64, turn_start: i64) -> bool {
        self == ToolHistory::Keep || seq > turn_start
    }
}

impl std::str::FromStr for ToolHistory {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "turn" => Ok(ToolHistory::Turn),
            "keep" => Ok(ToolHistory::Keep),
            other => Err(format!("`{other}` is not turn or keep")),
        }
    }
}

/// One message of the model's history and the event it came from. For the summary, `seq`
/// is the compaction's boundary (`replaces_through_seq`), so seqs rise along the list.
#[derive(Debug, Clone, PartialEq)]
pub struct ProjectedMessage {
    pub seq: i64,
    pub source: Source,
    pub message: ChatMessage,
}

/// The model's history: the newest compaction's summary, then every projecting event after
/// its boundary in seq order. Accepts the whole log or just its live tail (the newest
/// compaction and the events after its boundary) — both give the same result. Events must
/// be in seq order. Never trims to a budget: the compactor enforces the budget.
///
/// Tool traffic (DESIGN §14: a step's tool calls and the tools' results) projects only
/// within its turn: after the newest user message. Once a later user message exists, a
/// turn's tool traffic leaves the history; its answer and turn memory stay. (With
/// [`ToolHistory::Keep`], [`llm_context_with`], it stays until a compaction.)
pub fn llm_context(events: &[Event]) -> Vec<ProjectedMessage> {
    llm_context_with(events, ToolHistory::Turn)
}

/// [`llm_context`] under tool history policy `history`.
pub fn llm_context_with(events: &[Event], history: ToolHistory) -> Vec<ProjectedMessage> {
    let compaction = newest_compaction(events);
    let boundary = compaction.map_or(0, |(_, c)| c.replaces_through_seq);
    let live_pending = live_pending_seq(events);
    let turn_start = current_turn_start(events);

    let mut out = Vec::new();
    if let Some((_, c)) = compaction {
        out.push(ProjectedMessage { seq: boundary, source: Source::Summary, message: summary_message(c) });
    }
    for e in events.iter().filter(|e| e.seq > boundary) {
        let projects = match e.kind().projection() {
            _ if e.body.is_tool_traffic() => history.projects(e.seq, turn_start),
            Projection::Each | Projection::Answer => true,
            Projection::LivePending => Some(e.seq) == live_pending,
            // Only the newest summary projects, and it opens the list (above); tool
            // traffic is decided above.
            Projection::Summary | Projection::Never | Projection::Tool => false,
        };
        if let Some((source, message)) = projects.then(|| render(&e.body)).flatten() {
            out.push(ProjectedMessage { seq: e.seq, source, message });
        }
    }
    out
}

/// Just the messages of [`llm_context`].
pub fn llm_messages(events: &[Event]) -> Vec<ChatMessage> {
    llm_messages_with(events, ToolHistory::Turn)
}

/// Just the messages of [`llm_context_with`].
pub fn llm_messages_with(events: &[Event], history: ToolHistory) -> Vec<ChatMessage> {
    llm_context_with(events, history).into_iter().map(|p| p.message).collect()
}

/// The newest `compaction_applied` event and its payload.
pub fn newest_compaction(events: &[Event]) -> Option<(i64, &CompactionApplied)> {
    events.iter().rev().find_map(|e| {
        let EventBody::CompactionApplied(c) = &e.body else { return None };
        Some((e.seq, c))
    })
}

/// The seq of the newest user message (0 when there is none): tool traffic before it
/// belongs to a finished turn and no longer projects.
pub fn current_turn_start(events: &[Event]) -> i64 {
    events.iter().rev().find(|e| e.kind() == EventKind::UserMessage).map_or(0, |e| e.seq)
}

/// The seq of the pending that projects, if any: the newest `pending_state`, unless an
/// `assistant_turn` follows it or the newest compaction covers it. A later user message
/// does not supersede it — the question after an interruption must still see the partial.
pub fn live_pending_seq(events: &[Event]) -> Option<i64> {
    let boundary = newest_compaction(events).map_or(0, |(_, c)| c.replaces_through_seq);
    for e in events.iter().rev() {
        match e.kind().projection() {
            Projection::Answer => return None,
            Projection::LivePending => return (e.seq > boundary).then_some(e.seq),
            Projection::Each | Projection::Summary | Projection::Never | Projection::Tool => {}
        }
    }
    None
}

/// The message a live event projects to, or None when the kind never projects (or a turn
/// memory is empty). A pending always renders as live here; whether it is live is the
/// caller's business. This is what per-event token counts are computed from.
pub fn project_event(body: &EventBody) -> Option<ChatMessage> {
    render(body).map(|(_, message)| message)
}

/// What an event renders as, and its source. Which events project is
/// [`EventKind::projection`](crate::events::EventKind::projection)'s to say; the kinds it
/// calls `Never` render nothing here (a test holds the two together).
fn render(body: &EventBody) -> Option<(Source, ChatMessage)> {
    match body {
        EventBody::UserMessage(m) => Some((Source::User, user_message(m))),
        EventBody::AssistantTurn(t) => Some((Source::Assistant, assistant_message(t))),
        EventBody::TurnMemory(m) => turn_memory_note(m).map(|n| (Source::TurnMemory, n)),
        EventBody::TurnFailed(f) => Some((Source::TurnFailed, turn_failed_note(f))),
        EventBody::PendingState(p) => Some((Source::LivePending, pending_message(p))),
        EventBody::CompactionApplied(c) => Some((Source::Summary, summary_message(c))),
        EventBody::ToolExecution(t) => Some((Source::Tool, tool_message(t))),
        EventBody::SessionStarted(_)
        | EventBody::PermissionRequest(_)
        | EventBody::PermissionResolved(_)
        | EventBody::MemoryExtracted(_) => None,
    }
}

fn summary_message(c: &CompactionApplied) -> ChatMessage {
    ChatMessage::text(Role::User, format!("{SUMMARY_MARKER}\n{}", c.summary))
}

/// Document markdown rides as text blocks after the message; images stay references.
fn user_message(m: &UserMessage) -> ChatMessage {
    if m.documents.is_empty() && m.images.is_empty() {
        return ChatMessage::text(Role::User, m.text.clone());
    }
    let mut parts = vec![ContentPart::Text { text: m.text.clone() }];
    parts.extend(m.documents.iter().map(|d| {
        let name = d.name.as_deref().unwrap_or(&d.id);
        ContentPart::Text { text: format!("[document {name} ({})]\n{}", d.mime, d.markdown) }
    }));
    parts.extend(m.images.iter().map(|i| ContentPart::ImageRef {
        id: i.id.clone(),
        mime: i.mime.clone(),
        width: i.width,
        height: i.height,
    }));
    ChatMessage::new(Role::User, Content::Parts(parts))
}

fn assistant_message(t: &AssistantTurn) -> ChatMessage {
    let text = match &t.llm.message.content {
        Some(c) => c.text(),
        // A step that asks for tools said what it said in its content, if anything.
        None if t.asks_for_tools() => String::new(),
        None => t.ui_text(),
    };
    ChatMessage { tool_calls: t.llm.message.tool_calls.clone(), ..ChatMessage::text(Role::Assistant, text) }
}

/// A tool's result as the model is sent it: exactly the stored output.
fn tool_message(t: &ToolExecution) -> ChatMessage {
    let output = t.output.clone().unwrap_or_default();
    ChatMessage { tool_call_id: Some(t.call_id.clone()), ..ChatMessage::text(Role::Tool, output) }
}

fn pending_message(p: &PendingState) -> ChatMessage {
    let note = match p.reason.unwrap_or_default() {
        PendingReason::Interrupted => INTERRUPTED_NOTE,
        PendingReason::Stopped => STOPPED_NOTE,
    };
    let text = if p.partial.is_empty() { note.to_owned() } else { format!("{}\n\n{note}", p.partial) };
    ChatMessage::text(Role::Assistant, text)
}

/// How a turn's residue note begins (`[turn memory of turn #<seq>]`).
pub const TURN_MEMORY_MARKER: &str = "[turn memory of turn #";

/// A user-role note, never assistant-role: models imitate what they seem to have written.
fn turn_memory_note(m: &TurnMemory) -> Option<ChatMessage> {
    if m.is_empty() {
        return None;
    }
    let mut text = format!("{TURN_MEMORY_MARKER}{}]", m.turn_seq);
    if !m.files_changed.is_empty() {
        text.push_str(&format!("\nfiles changed: {}", m.files_changed.join(", ")));
    }
    for f in &m.failures {
        text.push_str(&format!("\nfailed: {} — {}", f.what, f.why));
    }
    for k in &m.key_findings {
        text.push_str(&format!("\nfinding: {k}"));
    }
    Some(ChatMessage::text(Role::User, text))
}

fn turn_failed_note(f: &TurnFailed) -> ChatMessage {
    ChatMessage::text(Role::User, format!("[previous turn failed: {}: {}]", f.code, f.message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_renders_exactly_when_its_projection_says_it_reaches_the_model() {
        for kind in EventKind::ALL {
            let mut body = EventBody::default_of(kind);
            if let EventBody::TurnMemory(m) = &mut body {
                m.key_findings.push("a finding".into()); // an empty one renders nothing
            }
            assert_eq!(render(&body).is_some(), kind.projection() != Projection::Never, "{kind}");
        }
    }
}
