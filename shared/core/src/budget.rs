//! How big a session's next request is, decided from the per-event token counts stored
//! beside the log: a sum over the live tail, never a re-encode of the history.

use crate::events::{Event, EventBody, EventKind, Projection};
use crate::llm_context::ToolHistory;
use crate::tokens::{event_tokens, REQUEST_OVERHEAD};

/// Share of the model's context window a request may fill; the rest is for the answer.
pub const BUDGET_PERCENT: u32 = 60;
/// Budget when no window is known for the model (`TURNLOG_CONTEXT_BUDGET`'s default).
pub const DEFAULT_BUDGET: u32 = 60_000;

/// 60% of the model's window, or the fallback budget when the window is unknown.
pub fn budget_for(window: Option<u32>, fallback: u32) -> u32 {
    match window {
        Some(w) if w > 0 => (u64::from(w) * u64::from(BUDGET_PERCENT) / 100) as u32,
        _ => fallback,
    }
}

/// An event as the budget sees it: its kind, its cached token count and, for a
/// compaction, its boundary. This is what the read side loads for the live tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountedEvent {
    pub seq: i64,
    pub kind: EventKind,
    pub tokens: u32,
    /// `replaces_through_seq` of a `compaction_applied`.
    pub replaces_through: Option<i64>,
    /// Tool traffic ([`EventBody::is_tool_traffic`]): counted only within its turn.
    pub tool: bool,
}

impl CountedEvent {
    /// Counts an event (done once, when it is written).
    pub fn of(e: &Event) -> Self {
        let replaces_through =
            if let EventBody::CompactionApplied(c) = &e.body { Some(c.replaces_through_seq) } else { None };
        Self {
            seq: e.seq,
            kind: e.kind(),
            tokens: event_tokens(&e.body),
            replaces_through,
            tool: e.body.is_tool_traffic(),
        }
    }
}

/// Tokens of the projected history (the messages of `llm_context`, without the request
/// overhead), from cached counts. Applies the same rules as the projection: the newest
/// compaction's summary, everything projecting after its boundary, and only the live
/// pending. Works on the whole log or on its live tail; events in seq order.
pub fn history_tokens(events: &[CountedEvent]) -> u32 {
    history_tokens_with(events, ToolHistory::Turn)
}

/// [`history_tokens`] under tool history policy `history` (as [`crate::llm_context::llm_context_with`]).
pub fn history_tokens_with(events: &[CountedEvent], history: ToolHistory) -> u32 {
    let compaction = events.iter().rev().find(|e| e.kind.projection() == Projection::Summary);
    let boundary = compaction.and_then(|c| c.replaces_through).unwrap_or(0);
    let mut total = compaction.map_or(0, |c| c.tokens);
    let mut live_pending_found = false;
    let mut answered_after = false;
    let mut user_after = false;
    // Walk backwards so the live pending and the current turn are known in the same pass.
    for e in events.iter().rev().take_while(|e| e.seq > boundary) {
        if e.tool {
            // Tool traffic counts within its turn only (DESIGN §14); a step's answer still
            // answers its pending.
            if !user_after || history == ToolHistory::Keep {
                total = total.saturating_add(e.tokens);
            }
            answered_after |= e.kind.projection() == Projection::Answer;
            continue;
        }
        user_after |= e.kind == EventKind::UserMessage;
        match e.kind.projection() {
            Projection::Each => total = total.saturating_add(e.tokens),
            Projection::Answer => {
                answered_after = true;
                total = total.saturating_add(e.tokens);
            }
            Projection::LivePending if !live_pending_found => {
                live_pending_found = true;
                if !answered_after {
                    total = total.saturating_add(e.tokens);
                }
            }
            // An older pending is never live; only the newest summary counts (above).
            Projection::LivePending | Projection::Summary | Projection::Never | Projection::Tool => {}
        }
    }
    total
}

/// The whole next request: system prompt and per-turn extras (`reserve_tokens`, already
/// counted with their message overhead) plus the history plus the request overhead.
pub fn request_size(history: u32, reserve_tokens: u32) -> u32 {
    history.saturating_add(reserve_tokens).saturating_add(REQUEST_OVERHEAD)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_sixty_percent_of_window_else_fallback() {
        assert_eq!(budget_for(Some(128_000), DEFAULT_BUDGET), 76_800);
        assert_eq!(budget_for(None, 4_000), 4_000);
        assert_eq!(budget_for(Some(0), 4_000), 4_000);
    }
}
