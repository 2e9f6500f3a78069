//! Compaction planning: which part of the model's history the next summary replaces.
//! Pure; the compactor worker calls it, writes the summary, and appends the result as a
//! conditional `compaction_applied`.

use crate::events::{Event, EventBody};
use crate::llm_context::{llm_context_with, newest_compaction, ProjectedMessage, Source, ToolHistory};

/// Fewer live messages than this are never compacted.
pub const MIN_LIVE_MESSAGES: usize = 4;

#[derive(Debug, Clone, PartialEq)]
pub struct CompactionPlan {
    /// `replaces_through_seq` of the new compaction.
    pub through_seq: i64,
    /// What the summary must cover, oldest first; the previous summary (if any) is first,
    /// so the new summary folds it in.
    pub span: Vec<ProjectedMessage>,
    /// Seqs of the `assistant_turn`s in the span, whose facts are extracted first.
    pub turn_seqs: Vec<i64>,
    /// The session's current boundary, for the append's `expect.compacted_through`.
    pub expect_compacted_through: Option<i64>,
    /// Each tool result in the span (under `keep`, DESIGN §14): its seq, the tool's name and
    /// the result's status — what the summary is told of it, never its output.
    pub tool_results: Vec<(i64, String, String)>,
}

/// Plans a compaction of the oldest half of the live projected messages.
pub fn plan_compaction(events: &[Event]) -> Option<CompactionPlan> {
    plan_compaction_shrunk(events, 0)
}

/// As [`plan_compaction`], with the span halved `halvings` times — what the compactor uses
/// after repeated refused summaries, so a session cannot stay stuck on one span.
pub fn plan_compaction_shrunk(events: &[Event], halvings: u32) -> Option<CompactionPlan> {
    plan_compaction_with(events, halvings, ToolHistory::Turn)
}

/// [`plan_compaction_shrunk`] of the history under tool history policy `history`. A cut
/// never parts a step that asks for tools from its results (the model would be sent a
/// result without its call): it moves past them.
pub fn plan_compaction_with(events: &[Event], halvings: u32, history: ToolHistory) -> Option<CompactionPlan> {
    let msgs = llm_context_with(events, history);
    let n = msgs.len();
    if n < MIN_LIVE_MESSAGES {
        return None;
    }
    // At least one turn stays live: the last user message and what follows it.
    let last_user = msgs.iter().rposition(|m| m.source == Source::User)?;

    let mut cut = (n / 2).checked_shr(halvings).unwrap_or(0).max(1);
    // Never end on an unanswered user message, nor between a step's calls and their
    // results: extend the cut past them.
    let splits_step = |cut: usize| {
        msgs[cut - 1].source == Source::User
            || !msgs[cut - 1].message.tool_calls.is_empty()
            || msgs.get(cut).is_some_and(|m| m.source == Source::Tool)
    };
    while cut < n && splits_step(cut) {
        cut += 1;
    }
    if cut > last_user {
        cut = last_user;
        while cut > 0 && splits_step(cut) {
            cut -= 1;
        }
    }
    let span = &msgs[..cut];
    // Nothing new to summarize: an empty span, or only the previous summary.
    if span.iter().all(|m| m.source == Source::Summary) {
        return None;
    }

    // Map the cut back to an event seq; if the projection's order does not line up with
    // the seqs, do nothing rather than summarize the wrong events.
    let through_seq = span.last()?.seq;
    let lines_up =
        span.iter().all(|m| m.seq <= through_seq) && msgs[cut..].iter().all(|m| m.seq > through_seq);
    let expect = newest_compaction(events).map(|(_, c)| c.replaces_through_seq);
    if !lines_up || expect.is_some_and(|b| through_seq <= b) {
        return None;
    }

    // Events are in seq order: each result's event by binary search.
    let tool_results = span
        .iter()
        .filter(|m| m.source == Source::Tool)
        .filter_map(|m| events.binary_search_by_key(&m.seq, |e| e.seq).ok().map(|i| &events[i]))
        .filter_map(|e| match &e.body {
            EventBody::ToolExecution(t) => Some((e.seq, t.name.clone(), t.status.clone())),
            _ => None,
        })
        .collect();
    Some(CompactionPlan {
        through_seq,
        turn_seqs: span.iter().filter(|m| m.source == Source::Assistant).map(|m| m.seq).collect(),
        span: span.to_vec(),
        expect_compacted_through: expect,
        tool_results,
    })
}
