//! What the user sees: a pure projection of a session's events into transcript items.
//! It hides nothing — summarized turns stay visible behind a divider, and every attempt
//! that ended without an answer keeps its last checkpoint as an `interrupted` item.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::events::{
    Block, Event, EventBody, ImageRef, Imported, PendingReason, PermissionRequest, ToolExecution, Usage,
};
use crate::ids::AttemptId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemKind {
    User,
    Assistant,
    Tool,
    Permission,
    Compaction,
    Interrupted,
    Error,
}

/// A document as the transcript shows it: a reference, never its markdown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DocumentRef {
    pub id: String,
    pub mime: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TranscriptItem {
    pub seq: i64,
    pub kind: ItemKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<Block>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<Vec<ImageRef>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub documents: Option<Vec<DocumentRef>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<ToolExecution>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permission: Option<PermissionRequest>,
    /// Compaction dividers: the last seq the model now sees only as the summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub through_seq: Option<i64>,
    /// Interrupted items: why the answer stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<PendingReason>,
    /// Error items: the failure's code (`text` holds its message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_id: Option<AttemptId>,
    /// An imported message's origin, with its original time (`created_at` is the import's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imported: Option<Imported>,
    pub created_at: DateTime<Utc>,
}

impl TranscriptItem {
    fn new(e: &Event, kind: ItemKind) -> Self {
        Self {
            seq: e.seq,
            kind,
            text: None,
            blocks: None,
            images: None,
            documents: None,
            provider: None,
            model: None,
            usage: None,
            duration_ms: None,
            cost: None,
            currency: None,
            tool: None,
            permission: None,
            through_seq: None,
            reason: None,
            code: None,
            attempt_id: None,
            imported: None,
            created_at: e.created_at,
        }
    }
}

/// The transcript of a whole log (events in seq order), one item per visible event.
///
/// Whether a permission request or a checkpoint is visible depends on events after it;
/// `read::transcript_page` decides the same in SQL for one page of a long log. The two
/// state one rule and must change together (the ingress's transcript tests compare them).
pub fn ui_transcript(events: &[Event]) -> Vec<TranscriptItem> {
    let shown_pendings = interrupted_checkpoints(events);
    let resolved: HashSet<&str> = events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::PermissionResolved(r) => Some(r.id.as_str()),
            _ => None,
        })
        .collect();
    events
        .iter()
        .filter(|e| match &e.body {
            EventBody::PermissionRequest(p) => !resolved.contains(p.id.as_str()),
            EventBody::PendingState(_) => shown_pendings.contains(&e.seq),
            _ => true,
        })
        .filter_map(transcript_item)
        .collect()
}

/// The item an event shows as once it is known to be visible; None for kinds the
/// transcript never shows (`session_started`, `turn_memory`, `memory_extracted`,
/// `permission_resolved`).
pub fn transcript_item(e: &Event) -> Option<TranscriptItem> {
    let item = match &e.body {
        EventBody::UserMessage(m) => {
            let mut it = TranscriptItem::new(e, ItemKind::User);
            it.text = Some(m.text.clone());
            it.images = (!m.images.is_empty()).then(|| m.images.clone());
            it.documents = (!m.documents.is_empty()).then(|| {
                m.documents
                    .iter()
                    .map(|d| DocumentRef {
                        id: d.id.clone(),
                        mime: d.mime.clone(),
                        name: d.name.clone(),
                        bytes: d.bytes,
                    })
                    .collect()
            });
            it.imported = m.imported.clone();
            it
        }
        EventBody::AssistantTurn(t) => {
            let mut it = TranscriptItem::new(e, ItemKind::Assistant);
            it.text = Some(t.ui_text());
            it.blocks = Some(t.ui.blocks.clone());
            it.provider = t.provider.clone();
            it.model = t.model.clone();
            it.usage = t.usage;
            it.duration_ms = t.duration_ms;
            it.cost = t.cost;
            it.currency = t.currency.clone();
            it.attempt_id = t.attempt_id.clone();
            it.imported = t.imported.as_deref().cloned();
            it
        }
        EventBody::ToolExecution(t) => {
            let mut it = TranscriptItem::new(e, ItemKind::Tool);
            it.tool = Some(t.clone());
            it
        }
        EventBody::PermissionRequest(p) => {
            let mut it = TranscriptItem::new(e, ItemKind::Permission);
            it.permission = Some(p.clone());
            it
        }
        EventBody::CompactionApplied(c) => {
            let mut it = TranscriptItem::new(e, ItemKind::Compaction);
            it.text = Some(c.summary.clone());
            it.through_seq = Some(c.replaces_through_seq);
            it
        }
        EventBody::PendingState(p) => {
            let mut it = TranscriptItem::new(e, ItemKind::Interrupted);
            it.text = Some(p.partial.clone());
            it.reason = Some(p.reason.unwrap_or_default());
            it.attempt_id = p.attempt_id.clone();
            it
        }
        EventBody::TurnFailed(f) => {
            let mut it = TranscriptItem::new(e, ItemKind::Error);
            it.text = Some(f.message.clone());
            it.code = Some(f.code.clone());
            it.attempt_id = f.attempt_id.clone();
            it
        }
        EventBody::SessionStarted(_)
        | EventBody::TurnMemory(_)
        | EventBody::MemoryExtracted(_)
        | EventBody::PermissionResolved(_) => return None,
    };
    Some(item)
}

/// Which attempt a checkpoint belongs to: its `attempt_id`, or — for producers that set
/// none — the run of events since the last turn boundary.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Attempt<'a> {
    Id(&'a str),
    Anonymous(u32),
}

/// Seqs of the pendings shown as `interrupted`: the last checkpoint of every attempt that
/// has no `assistant_turn`. Earlier checkpoints of an attempt are not shown.
fn interrupted_checkpoints(events: &[Event]) -> HashSet<i64> {
    let mut segment = 0u32;
    let mut last_checkpoint: HashMap<Attempt<'_>, i64> = HashMap::new();
    let mut answered: HashSet<Attempt<'_>> = HashSet::new();
    for e in events {
        match &e.body {
            EventBody::UserMessage(_) | EventBody::TurnFailed(_) => segment += 1,
            EventBody::AssistantTurn(t) => {
                answered.insert(Attempt::Anonymous(segment));
                if let Some(id) = t.attempt_id.as_deref() {
                    answered.insert(Attempt::Id(id));
                }
                segment += 1;
            }
            EventBody::PendingState(p) => {
                let key = p.attempt_id.as_deref().map_or(Attempt::Anonymous(segment), Attempt::Id);
                last_checkpoint.insert(key, e.seq);
                // A final checkpoint (one with a reason) ends its attempt; a retry without
                // an attempt id is then a new one.
                if p.reason.is_some() && p.attempt_id.is_none() {
                    segment += 1;
                }
            }
            _ => {}
        }
    }
    last_checkpoint.into_iter().filter(|(k, _)| !answered.contains(k)).map(|(_, seq)| seq).collect()
}
