//! turnlog's memory extraction: for each committed `assistant_turn`, the durable facts of
//! the turn (names, dates, numbers, commitments, preferences) become exactly one
//! `memory_extracted` event — empty with `error` when the model keeps failing — whose
//! memories the writer stores for recall across the owner's sessions.

use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use turnlog_core::events::{EventBody, EventKind, ExtractedMemory, MemoryExtracted};
use turnlog_core::ids::EventId;
use turnlog_core::turn::TurnMaterial;
use turnlog_runtime::bus::{AppendRequest, CommittedEvent};
use turnlog_runtime::turn_worker::{TurnTask, TurnWorker, TurnWorkerConfig};
use turnlog_runtime::upstream::JsonAnswerError;
use turnlog_runtime::worker::{Delivery, HandleError, Origin};
use uuid::Uuid;

/// Selects the memory task (the mock model keys on it; a real model ignores it).
pub const MEMORY_MARKER: &str = "[turnlog:memory]";

const MEMORY_PROMPT: &str = "[turnlog:memory] You keep the long-term memory of an assistant. From one \
finished turn of a conversation, extract the durable facts worth remembering in later conversations: \
names, dates, numbers, commitments and preferences the user stated or the assistant promised. Each \
memory is one self-contained sentence. Answer with only a JSON object: {\"memories\": [{\"text\": \
\"...\"}]}; an empty list when there is nothing durable. Invent nothing.";

/// Most memories one turn yields, and the longest one.
const MAX_MEMORIES: usize = 20;
const MAX_MEMORY_CHARS: usize = 500;
/// The longest `error` recorded when extraction gives up.
const MAX_ERROR_CHARS: usize = 500;

/// Memory extraction's settings: a worker on finished turns, with `TURNLOG_MINI_MODEL` and a
/// `call_deadline` for one extraction (its retry included).
pub type MemoryConfig = TurnWorkerConfig;

/// Extracts memories from committed turns until `shutdown`: live turns on the `memory`
/// consumer, imported ones (issue 25; the feed gives them a subject of their own) on
/// `memory-imported`, one at a time, so a large import never delays the facts of a live
/// turn. A replay goes over both at once.
pub async fn run(config: MemoryConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let started = "memory extraction running";
    if config.consumer.replay.is_some() {
        let task = Extractor(Turns::All);
        return turnlog_runtime::turn_worker::run(
            "memory",
            Origin::Any,
            started,
            config,
            task,
            shutdown.cancelled_owned(),
        )
        .await;
    }
    let mut low = config.clone();
    low.consumer.concurrency = 1;
    let live = turnlog_runtime::turn_worker::run(
        "memory",
        Origin::Live,
        started,
        config,
        Extractor(Turns::Live),
        shutdown.clone().cancelled_owned(),
    );
    let imported = turnlog_runtime::turn_worker::run(
        "memory-imported",
        Origin::Imported,
        "memory extraction of imported turns running",
        low,
        Extractor(Turns::Imported),
        shutdown.cancelled_owned(),
    );
    let (live, imported) = tokio::join!(live, imported);
    live.and(imported)
}

/// Which turns a consumer extracts from (the others it acknowledges unhandled: an earlier
/// version published imported turns on the live subject).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turns {
    Live,
    Imported,
    All,
}

impl Turns {
    /// Whether `turn` is this consumer's. A turn imported from a turnlog export is no one's:
    /// the export brought its `memory_extracted` along.
    fn takes(self, turn: &CommittedEvent) -> bool {
        let source = turn.payload.pointer("/imported/source").and_then(|s| s.as_str());
        match (self, source) {
            (_, Some("turnlog")) => false,
            (Turns::All, _) | (Turns::Live, None) => true,
            (Turns::Imported, Some(_)) => true,
            _ => false,
        }
    }
}

/// The id of the `i`-th memory of a `memory_extracted` event: the same on every replay, so
/// a redelivered turn can never add a memory twice.
pub fn memory_id(event_id: EventId, index: usize) -> Uuid {
    Uuid::new_v5(&event_id.0, index.to_string().as_bytes())
}

struct Extractor(Turns);

impl TurnTask for Extractor {
    #[tracing::instrument(skip_all, fields(session_id = %turn.session_id, turn_seq = turn.seq, attempt = delivery.attempt), err)]
    async fn handle(
        &self,
        w: &TurnWorker,
        turn: CommittedEvent,
        delivery: Delivery,
    ) -> Result<(), HandleError> {
        if !self.0.takes(&turn) {
            return Ok(());
        }
        let event_id = EventId::derived(turn.session_id, turn.seq, EventKind::MemoryExtracted.as_str());
        let Some(material) = w.material_to(&turn, event_id, "extract").await? else { return Ok(()) };
        let extracted = match extract(w, &material).await {
            Ok(texts) => MemoryExtracted {
                turn_seq: turn.seq,
                memories: texts
                    .into_iter()
                    .enumerate()
                    .map(|(i, text)| ExtractedMemory { id: memory_id(event_id, i), text })
                    .collect(),
                error: None,
            },
            // The details stay in the log (`extract`); the retry's and the event's `error` get
            // the short public message.
            Err(e) if !delivery.is_last() => {
                return Err(HandleError::retry("memory_failed", e.public_message()));
            }
            // Out of retries: the turn still gets its one event, so whoever waits for it
            // (the compactor) knows extraction is over.
            Err(e) => {
                let why = e.public_message();
                tracing::warn!(error = %why, "memory extraction gave up");
                MemoryExtracted {
                    turn_seq: turn.seq,
                    memories: vec![],
                    error: Some(why.chars().take(MAX_ERROR_CHARS).collect()),
                }
            }
        };
        let body = EventBody::MemoryExtracted(extracted);
        let request = AppendRequest::append(turn.session_id, &turn.owner, event_id.0, &body);
        let outcome = w.append(&request).await?;
        if !outcome.is_applied() {
            tracing::warn!(reason = ?outcome.reason, "the writer did not apply memory_extracted");
        }
        Ok(())
    }
}

/// The turn's facts, or why the model gave none (logged here with its details).
async fn extract(w: &TurnWorker, material: &TurnMaterial) -> Result<Vec<String>, JsonAnswerError> {
    let answer: Memories =
        w.ask_json(MEMORY_PROMPT, material, Memories::validated).await.inspect_err(|e| {
            tracing::info!(error = %e, "no memories from the model");
        })?;
    Ok(answer.memories.into_iter().map(|m| m.text).collect())
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Memories {
    pub memories: Vec<MemoryText>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct MemoryText {
    pub text: String,
}

impl Memories {
    /// Trimmed, without blanks or repeats, capped in number and length. Never refuses: no
    /// memories is an answer too.
    pub fn validated(self) -> Result<Self, std::convert::Infallible> {
        let mut kept: Vec<MemoryText> = Vec::new();
        for m in self.memories {
            let text = m.text.trim();
            let text: String = match text.char_indices().nth(MAX_MEMORY_CHARS) {
                Some((cut, _)) => format!("{}…", &text[..cut]),
                None => text.to_owned(),
            };
            if !text.is_empty() && !kept.iter().any(|k| k.text == text) && kept.len() < MAX_MEMORIES {
                kept.push(MemoryText { text });
            }
        }
        Ok(Self { memories: kept })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnlog_core::ids::SessionId;

    #[test]
    fn memory_ids_are_deterministic_and_distinct() {
        let e = EventId::derived(SessionId::new(), 4, "memory_extracted");
        assert_eq!(memory_id(e, 0), memory_id(e, 0));
        assert_ne!(memory_id(e, 0), memory_id(e, 1));
        let other = EventId::derived(SessionId::new(), 4, "memory_extracted");
        assert_ne!(memory_id(e, 0), memory_id(other, 0));
    }

    #[test]
    fn memories_are_validated() {
        let m: Memories = serde_json::from_str(
            r#"{"memories": [{"text": " Alice lives in Lyon. "}, {"text": "Alice lives in Lyon."}, {"text": ""}]}"#,
        )
        .unwrap();
        let m = m.validated().unwrap();
        assert_eq!(m.memories, [MemoryText { text: "Alice lives in Lyon.".into() }]);
        assert!(serde_json::from_str::<Memories>(r#"{"facts": []}"#).is_err());
    }
}
