//! turnlog's distiller: for each committed `assistant_turn`, one mini-model call turns the
//! turn's raw material (question, answer, tool executions) into the small `turn_memory`
//! residue later turns see instead of raw traces; after a session's first turn it also
//! names the session. Appends go through the writer with deterministic ids.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use turnlog_core::events::{EventBody, EventKind, Failure, TurnMemory};
use turnlog_core::ids::{EventId, SessionId};
use turnlog_core::message::{ChatMessage, Role};
use turnlog_runtime::bus::{AppendRequest, CommittedEvent, Outcome};
use turnlog_runtime::turn_worker::{TurnTask, TurnWorker, TurnWorkerConfig};
use turnlog_runtime::upstream::ChatRequest;
use turnlog_runtime::worker::{Delivery, HandleError, Origin};

/// Selects the distillation task (the mock model keys on it; a real model ignores it).
pub const DISTILL_MARKER: &str = "[turnlog:distill]";
/// Selects the title task.
pub const TITLE_MARKER: &str = "[turnlog:title]";

const DISTILL_PROMPT: &str = "[turnlog:distill] You distill one finished turn of a conversation between a user \
and an assistant into the residue the assistant needs in later turns, instead of the raw tool traffic. Answer \
with only a JSON object: {\"files_changed\": [paths of files the turn created or changed], \"failures\": \
[{\"what\": what failed, \"why\": why it failed}], \"key_findings\": [short statements of facts established \
in the turn, keeping every name, date and number]}. Use empty arrays when nothing qualifies; invent nothing.";

const TITLE_PROMPT: &str = "[turnlog:title] You name a conversation from its first exchange. Answer with \
only the title: at most six words, no quotes, no trailing punctuation.";

/// The most of each list a residue keeps, and the longest entry: the residue rides in every
/// later request until a compaction, so it stays small.
const MAX_FILES: usize = 30;
const MAX_FAILURES: usize = 10;
const MAX_FINDINGS: usize = 12;
const MAX_ENTRY_CHARS: usize = 400;
const MAX_TITLE_CHARS: usize = 80;

/// The distiller's settings: a worker on finished turns, with `TURNLOG_MINI_MODEL` for
/// distillation and titles, and a `call_deadline` for one distillation (its retry
/// included) and one title.
pub type DistillerConfig = TurnWorkerConfig;

/// Distills committed turns until `shutdown`; every copy shares one durable consumer.
pub async fn run(config: DistillerConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    turnlog_runtime::turn_worker::run(
        "distiller",
        Origin::Live,
        "distiller running",
        config,
        Distiller::default(),
        shutdown.cancelled_owned(),
    )
    .await
}

/// Sessions whose answers a distiller remembers having seen.
const ANSWERED_KEPT: usize = 65_536;

#[derive(Default)]
struct Distiller {
    /// The lowest seq of an answer seen in each recently seen session: a later answer is not
    /// its first, so it needs no title look-up (a fork is a session of its own).
    answered: Mutex<HashMap<SessionId, i64>>,
}

impl Distiller {
    /// Whether an answer of `turn`'s session before it was seen; notes `turn` either way.
    fn answered_before(&self, turn: &CommittedEvent) -> bool {
        // Whole entries only; a panic elsewhere cannot leave one half-written.
        let mut seen = self.answered.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(first) = seen.get_mut(&turn.session_id) {
            let before = *first < turn.seq;
            *first = (*first).min(turn.seq);
            return before;
        }
        if seen.len() >= ANSWERED_KEPT {
            if let Some(any) = seen.keys().next().copied() {
                seen.remove(&any);
            }
        }
        seen.insert(turn.session_id, turn.seq);
        false
    }
}

impl TurnTask for Distiller {
    async fn handle(
        &self,
        w: &TurnWorker,
        event: CommittedEvent,
        _delivery: Delivery,
    ) -> Result<(), HandleError> {
        // An imported answer (issue 25) has no raw material to distill, and its session a title.
        // (The feed puts imports on subjects this consumer does not take; an earlier version
        // did not.)
        if event.is_imported() {
            return Ok(());
        }
        distill_turn(w, &event).await?;
        if self.answered_before(&event) {
            return Ok(());
        }
        title_session(w, &event).await
    }
}

#[tracing::instrument(skip_all, fields(session_id = %turn.session_id, turn_seq = turn.seq), err)]
async fn distill_turn(w: &TurnWorker, turn: &CommittedEvent) -> Result<(), HandleError> {
    let event_id = EventId::derived(turn.session_id, turn.seq, EventKind::TurnMemory.as_str());
    let Some(material) = w.material_to(turn, event_id, "distill").await? else { return Ok(()) };
    let residue: Residue = w
        .ask_json(DISTILL_PROMPT, &material, Residue::validated)
        .await
        .map_err(|e| HandleError::retry("distill_failed", e))?;
    let memory = residue.into_turn_memory(turn.seq);
    if memory.is_empty() {
        tracing::debug!("empty residue; nothing appended");
        return Ok(());
    }
    let body = EventBody::TurnMemory(memory);
    let request = AppendRequest::append(turn.session_id, &turn.owner, event_id.0, &body);
    let outcome = w.append(&request).await?;
    log_unapplied(&outcome, EventKind::TurnMemory.as_str());
    Ok(())
}

/// After the session's first answered turn, a title unless the session has one. The
/// `update` carries `title_if_empty`, so a title the user set meanwhile wins.
#[tracing::instrument(skip_all, fields(session_id = %turn.session_id, turn_seq = turn.seq), err)]
async fn title_session(w: &TurnWorker, turn: &CommittedEvent) -> Result<(), HandleError> {
    let request_id = EventId::derived(turn.session_id, turn.seq, "title").0;
    let state = turnlog_runtime::read::get_session(&w.pool, &turn.owner, turn.session_id)
        .await
        .map_err(|e| HandleError::retry("read_failed", e))?;
    let Some(state) = state else { return Ok(()) };
    let untitled = state.title.as_deref().is_none_or(|t| t.trim().is_empty());
    if !untitled || !is_first_turn(w, turn.session_id, turn.seq).await? {
        return Ok(());
    }
    if w.already_applied(request_id).await? {
        return Ok(());
    }
    let Some(material) = w.material(turn).await? else { return Ok(()) };
    let request = ChatRequest {
        model: w.model.clone(),
        messages: vec![
            ChatMessage::text(Role::System, TITLE_PROMPT),
            ChatMessage::text(Role::User, material.question.clone()),
            ChatMessage::text(Role::Assistant, material.answer.clone()),
            ChatMessage::text(Role::User, "title this conversation."),
        ],
        max_tokens: Some(40),
        temperature: Some(0.0),
        ..ChatRequest::default()
    };
    let completion = w
        .upstream
        .complete(&request, w.call_deadline)
        .await
        .map_err(|e| HandleError::retry("title_failed", e))?;
    let Some(title) = clean_title(&completion.text) else {
        tracing::info!("the model proposed no usable title; the session stays untitled");
        return Ok(());
    };
    let mut update = AppendRequest::update(turn.session_id, &turn.owner).with_title_if_empty(Some(title));
    update.request_id = request_id;
    let outcome = w.append(&update).await?;
    log_unapplied(&outcome, "title");
    Ok(())
}

async fn is_first_turn(w: &TurnWorker, session: SessionId, turn_seq: i64) -> Result<bool, HandleError> {
    // Over the branch log: a fork's first own turn follows its parent's.
    let earlier = turnlog_runtime::read::answered_before(&w.pool, session, turn_seq)
        .await
        .map_err(|e| HandleError::retry("read_failed", e))?;
    Ok(!earlier)
}

/// The writer refused the request (it dead-lettered it, or the session is gone): retrying
/// would be refused again, so the turn is done.
fn log_unapplied(outcome: &Outcome, what: &str) {
    if !outcome.is_applied() {
        tracing::warn!(what, reason = ?outcome.reason, "the writer did not apply the worker's request");
    }
}

/// What the model answers: TurnMemory without its `turn_seq`, which is ours to set.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Residue {
    #[serde(default)]
    pub files_changed: Vec<String>,
    #[serde(default)]
    pub failures: Vec<Failure>,
    #[serde(default)]
    pub key_findings: Vec<String>,
}

impl Residue {
    /// Trims, drops blanks and repeats, and caps lengths, so a chatty model cannot bloat
    /// every later request. Never refuses: every residue, even an empty one, is kept.
    pub fn validated(self) -> Result<Self, std::convert::Infallible> {
        let failures: Vec<Failure> = self
            .failures
            .into_iter()
            .map(|f| Failure { what: entry(&f.what), why: entry(&f.why) })
            .filter(|f| !f.what.is_empty())
            .take(MAX_FAILURES)
            .collect();
        Ok(Self {
            files_changed: entries(self.files_changed, MAX_FILES),
            failures,
            key_findings: entries(self.key_findings, MAX_FINDINGS),
        })
    }

    pub fn into_turn_memory(self, turn_seq: i64) -> TurnMemory {
        TurnMemory {
            turn_seq,
            files_changed: self.files_changed,
            failures: self.failures,
            key_findings: self.key_findings,
        }
    }
}

fn entry(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(MAX_ENTRY_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

fn entries(items: Vec<String>, max: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in items.iter().map(|i| entry(i)) {
        if !item.is_empty() && !out.contains(&item) && out.len() < max {
            out.push(item);
        }
    }
    out
}

/// The first line of the model's answer without quotes or trailing punctuation, at most
/// `MAX_TITLE_CHARS`; None when nothing is left.
pub fn clean_title(text: &str) -> Option<String> {
    let line = text.lines().map(str::trim).find(|l| !l.is_empty())?;
    let line = line.strip_prefix("Title:").unwrap_or(line).trim();
    let line = line.trim_matches(|c: char| matches!(c, '"' | '\'' | '`' | '*' | '#')).trim();
    let line = line.trim_end_matches(['.', '!', '?', ':', ';', ',']).trim();
    let title: String = line.chars().take(MAX_TITLE_CHARS).collect();
    (!title.is_empty()).then_some(title)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residue_is_trimmed_deduplicated_and_capped() {
        let residue = Residue {
            files_changed: vec![" src/a.rs ".into(), "src/a.rs".into(), "".into()],
            failures: vec![
                Failure { what: "  ".into(), why: "nothing".into() },
                Failure { what: "build".into(), why: "x".repeat(1_000) },
            ],
            key_findings: (0..40).map(|i| format!("finding {i}")).collect(),
        }
        .validated()
        .unwrap();
        assert_eq!(residue.files_changed, ["src/a.rs"]);
        assert_eq!(residue.failures.len(), 1);
        assert!(residue.failures[0].why.chars().count() <= MAX_ENTRY_CHARS + 1);
        assert_eq!(residue.key_findings.len(), MAX_FINDINGS);
        assert!(Residue::default().validated().unwrap().into_turn_memory(3).is_empty());
    }

    #[test]
    fn model_json_with_unknown_fields_still_decodes() {
        let r: Residue =
            serde_json::from_str(r#"{"key_findings": ["Alice is 30."], "mood": "fine"}"#).unwrap();
        assert_eq!(r.key_findings, ["Alice is 30."]);
        assert!(serde_json::from_str::<Residue>(r#"{"key_findings": "not a list"}"#).is_err());
    }

    #[test]
    fn an_answer_after_one_seen_is_not_a_sessions_first() {
        let answer = |session: SessionId, seq: i64| -> CommittedEvent {
            serde_json::from_value(serde_json::json!({
                "session_id": session, "owner": "alice", "seq": seq, "event_id": EventId::new(),
                "kind": "assistant_turn", "payload": {}, "created_at": "2026-12-07T00:00:00Z",
            }))
            .unwrap()
        };
        let (d, s, fork) = (Distiller::default(), SessionId::new(), SessionId::new());
        assert!(!d.answered_before(&answer(s, 5)), "the first seen is looked up");
        assert!(!d.answered_before(&answer(s, 5)), "so is its redelivery");
        assert!(d.answered_before(&answer(s, 9)));
        assert!(!d.answered_before(&answer(fork, 12)), "a fork is a session of its own");
        assert!(!d.answered_before(&answer(s, 2)), "an earlier answer seen late is looked up");
        assert!(d.answered_before(&answer(s, 5)));
    }

    #[test]
    fn titles_are_cleaned() {
        assert_eq!(clean_title("\"Plan a trip to Rome.\"\n").as_deref(), Some("Plan a trip to Rome"));
        assert_eq!(clean_title("\n  Title: Budget review  ").as_deref(), Some("Budget review"));
        assert_eq!(clean_title("  \n "), None);
        assert_eq!(clean_title(&"w".repeat(200)).map(|t| t.len()), Some(MAX_TITLE_CHARS));
    }
}
