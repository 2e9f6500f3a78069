//! Request assembly: a stable system prompt, then the history, then this turn's extras.
//! Extras (recalled memories, the date) change every turn, so they go after the whole
//! history — anything that changes early in a request breaks the provider's prompt cache
//! for everything after it.

use crate::message::{ChatMessage, Role};
use crate::tokens::message_tokens;

/// Opens the per-turn extras message.
pub const EXTRAS_MARKER: &str = "[context for this turn; not part of the conversation]";

// The extras are recorded with the request (`events::RecordedRequest`); their old path stays.
pub use crate::events::Extras;

impl Extras {
    /// The user-role message that carries the extras, or None when there are none.
    pub fn message(&self) -> Option<ChatMessage> {
        if self.is_empty() {
            return None;
        }
        let mut text = EXTRAS_MARKER.to_owned();
        if let Some(date) = &self.date {
            text.push_str(&format!("\ntoday: {date}"));
        }
        if !self.memories.is_empty() {
            text.push_str("\nremembered from earlier conversations:");
            for m in &self.memories {
                text.push_str(&format!("\n- {m}"));
            }
        }
        Some(ChatMessage::text(Role::User, text))
    }
}

/// The messages of one request: system prompt, history, extras last — before the turn's
/// tool traffic, which (under `TURNLOG_TOOL_HISTORY=turn`) is the only tool traffic the
/// history holds.
pub fn assemble(system_prompt: &str, history: Vec<ChatMessage>, extras: &Extras) -> Vec<ChatMessage> {
    let tools_at = history.iter().position(|m| m.role == Role::Tool || !m.tool_calls.is_empty());
    assemble_at(system_prompt, history, extras, tools_at)
}

/// [`assemble`] with the extras before history message `tools_at`, the current turn's
/// first tool traffic (none: last). The extras stay where a turn's first step put them,
/// after the history it had; the turn's tool traffic follows them, so each step's request
/// extends the previous one's (DESIGN §14).
pub fn assemble_at(
    system_prompt: &str,
    history: Vec<ChatMessage>,
    extras: &Extras,
    tools_at: Option<usize>,
) -> Vec<ChatMessage> {
    let mut out = Vec::with_capacity(history.len() + 2);
    if !system_prompt.is_empty() {
        out.push(ChatMessage::text(Role::System, system_prompt));
    }
    let mut history = history.into_iter();
    out.extend(history.by_ref().take(tools_at.unwrap_or(usize::MAX)));
    out.extend(extras.message());
    out.extend(history);
    out
}

/// What the system prompt and extras add to a request (the compactor's `reserve_tokens`).
pub fn reserve_tokens(system_prompt: &str, extras: &Extras) -> u32 {
    let system = if system_prompt.is_empty() {
        0
    } else {
        message_tokens(&ChatMessage::text(Role::System, system_prompt))
    };
    system.saturating_add(extras.message().map_or(0, |m| message_tokens(&m)))
}
