//! turnlog's own export: JSON lines, each session a header line
//! `{"format": "turnlog", "version": 1, "session": {id, title, archived, metadata,
//! forked_from?, deleted?, …}}` followed by its own events `{seq, event_id, kind, payload,
//! created_at}` in seq order. A fork's block comes after its parent's; a root and the forks
//! after it are one conversation (a session family).
//!
//! Payloads come back as they were, with `imported` (source `turnlog`, the original time)
//! set on messages and answers. Seqs that payloads name (turn_seq, replaces_through_seq, a
//! request's through_seq) and memory ids are
//! mapped by the importer ([`rewrite`]) to what the target log holds.

use std::collections::HashMap;

use serde_json::Value;

use super::elements::Element;
use super::{
    too_large, Conversation, FileError, Payload, PlannedEvent, PlannedFork, PlannedSession, Rejected, SeqRef,
    MAX_CONVERSATION_BYTES,
};
use crate::events::{EventBody, EventKind, Imported};

pub const VERSION: u64 = 1;
const SOURCE: &str = "turnlog";

/// Gathers a file's lines into session families, handing each on when the next begins.
/// Each event line is taken as it comes (a family holds its planned events, not its lines),
/// and a family of more than `max_bytes` of lines is refused whole.
pub struct Families {
    current: Option<Family>,
    max_bytes: usize,
}

impl Default for Families {
    fn default() -> Self {
        Self::new(MAX_CONVERSATION_BYTES)
    }
}

struct Family {
    blocks: Vec<Block>,
    /// Its lines' bytes so far.
    bytes: usize,
    /// Why the family cannot be imported, found while its lines came in.
    error: Option<String>,
}

/// A session's header and its events so far.
struct Block {
    header: Value,
    id: String,
    /// The seq of its `session_started` (None when its `forked_from` is malformed, which
    /// the family's conversation reports).
    first_seq: Option<i64>,
    /// The seq its next event line must have.
    expected: i64,
    events: Vec<PlannedEvent>,
    /// The first thing wrong with its event lines.
    error: Option<LineError>,
}

/// What is wrong with an event line of a session's block: its family's `Rejected` reason,
/// after the session's id.
#[derive(Debug, thiserror::Error)]
enum LineError {
    #[error("an event line has no seq")]
    NoSeq,
    #[error("its events skip from seq {after} to {seq}")]
    SeqGap { after: i64, seq: i64 },
    #[error("seq {seq}: {source}")]
    UnknownKind { seq: i64, source: crate::events::UnknownKind },
    #[error("seq {seq} should be its session_started, not {kind}")]
    NotStarted { seq: i64, kind: EventKind },
    #[error("seq {seq} has no event_id")]
    NoEventId { seq: i64 },
    #[error("seq {seq}: its payload is not a JSON object")]
    NotAnObject { seq: i64 },
    #[error("seq {seq}: {source}")]
    Payload { seq: i64, source: crate::events::DecodeError },
}

impl Block {
    fn new(header: Value) -> Self {
        let session = header.get("session").unwrap_or(&Value::Null);
        let id = session.get("id").and_then(Value::as_str).unwrap_or("").to_owned();
        let first_seq = match session.get("forked_from").filter(|f| !f.is_null()) {
            None => Some(1),
            Some(f) => f.get("through_seq").and_then(Value::as_i64).filter(|t| *t >= 1).map(|t| t + 1),
        };
        Self { header, id, first_seq, expected: first_seq.unwrap_or(1), events: Vec::new(), error: None }
    }

    /// Takes an event line of the block.
    fn take(&mut self, line: &Value) {
        if self.error.is_none() {
            if let Err(e) = self.event(line) {
                self.error = Some(e);
            }
        }
    }

    /// Lines before `first_seq` (a fork's inherited events, as a branch-log export holds
    /// them) are its parent's and skipped; the rest must be gapless from its
    /// `session_started` (which the importer's create makes), each payload an object its
    /// kind decodes.
    fn event(&mut self, line: &Value) -> Result<(), LineError> {
        let Some(first_seq) = self.first_seq else { return Ok(()) };
        let seq = line.get("seq").and_then(Value::as_i64).ok_or(LineError::NoSeq)?;
        if seq < first_seq {
            return Ok(());
        }
        if seq != self.expected {
            return Err(LineError::SeqGap { after: self.expected - 1, seq });
        }
        self.expected += 1;
        let kind_name = line.get("kind").and_then(Value::as_str).unwrap_or("");
        let kind: EventKind = kind_name.parse().map_err(|source| LineError::UnknownKind { seq, source })?;
        if seq == first_seq {
            if kind != EventKind::SessionStarted {
                return Err(LineError::NotStarted { seq, kind });
            }
            return Ok(());
        }
        let event_id = line.get("event_id").and_then(Value::as_str).ok_or(LineError::NoEventId { seq })?;
        // An array decodes as the struct whose fields it lists, but is no payload.
        let Some(Value::Object(fields)) = line.get("payload") else {
            return Err(LineError::NotAnObject { seq });
        };
        let mut payload = Value::Object(fields.clone());
        let body =
            EventBody::decode(kind, &payload, seq).map_err(|source| LineError::Payload { seq, source })?;
        if matches!(kind, EventKind::UserMessage | EventKind::AssistantTurn) {
            // Always `turnlog` (the export brought the turn's memory events along, so
            // extraction skips it), with the original time: an earlier import's if it had one.
            let time = |v: Option<&Value>| v.and_then(Value::as_str).and_then(|t| t.parse().ok());
            let imported = Imported {
                source: SOURCE.to_owned(),
                id: event_id.to_owned(),
                created_at: time(payload.pointer("/imported/created_at")).or(time(line.get("created_at"))),
            };
            if let Value::Object(fields) = &mut payload {
                fields.insert("imported".into(), serde_json::to_value(imported).unwrap_or(Value::Null));
            }
        }
        self.events.push(PlannedEvent {
            source_id: event_id.to_owned(),
            seq,
            kind,
            payload: Payload::of(&payload),
            refers: SeqRef::of(&body),
        });
        Ok(())
    }
}

impl Families {
    pub fn new(max_bytes: usize) -> Self {
        Self { current: None, max_bytes }
    }

    /// Takes the next line; returns the family it ends, if it starts another.
    pub(crate) fn push(
        &mut self,
        element: Element,
    ) -> Result<Option<Result<Conversation, Rejected>>, FileError> {
        let (line, bytes) = match element {
            Element::Whole { value, bytes } => (value, bytes),
            // A line over the cap: its family is over it too.
            Element::TooLarge(_) => {
                let family = self.current.get_or_insert_with(|| Family {
                    blocks: vec![Block::new(Value::Null)],
                    bytes: 0,
                    error: None,
                });
                family.too_large(self.max_bytes);
                return Ok(None);
            }
        };
        if line.get("format").is_none() {
            let max_bytes = self.max_bytes;
            let Some(family) = &mut self.current else {
                return Err(FileError::Shape("an event line comes before any session header".into()));
            };
            family.bytes += bytes;
            if family.bytes > max_bytes {
                family.too_large(max_bytes);
            }
            if family.error.is_none() {
                if let Some(block) = family.blocks.last_mut() {
                    block.take(&line);
                }
            }
            return Ok(None);
        }
        if line.get("format").and_then(Value::as_str) != Some("turnlog") {
            return Err(FileError::Shape("a header line names another format than turnlog".into()));
        }
        let version = line.get("version").and_then(Value::as_u64).unwrap_or(0);
        if version != VERSION {
            return Err(FileError::Shape(format!(
                "turnlog export version {version}: this build reads version {VERSION}"
            )));
        }
        let parent =
            line.pointer("/session/forked_from/session_id").and_then(Value::as_str).map(str::to_owned);
        let block = Block::new(line);
        let joins = match (&parent, &self.current) {
            (Some(p), Some(family)) => family.blocks.iter().any(|b| b.id == *p),
            _ => false,
        };
        if joins {
            if let Some(family) = &mut self.current {
                family.blocks.push(block);
                family.bytes += bytes;
                if family.bytes > self.max_bytes {
                    family.too_large(self.max_bytes);
                }
            }
            return Ok(None);
        }
        let error =
            parent.map(|p| format!("it is a fork of session {p}, which is not before it in the file"));
        let mut family = Family { blocks: vec![block], bytes, error };
        if bytes > self.max_bytes {
            family.too_large(self.max_bytes);
        }
        let done = self.current.replace(family);
        Ok(done.map(Family::conversation))
    }

    /// The last family, once the file ends.
    pub fn finish(&mut self) -> Option<Result<Conversation, Rejected>> {
        self.current.take().map(Family::conversation)
    }
}

impl Family {
    /// Refused for its size: what it holds is let go of.
    fn too_large(&mut self, max_bytes: usize) {
        self.error = Some(too_large(max_bytes));
        for b in &mut self.blocks {
            b.events = Vec::new();
        }
    }

    fn conversation(self) -> Result<Conversation, Rejected> {
        let root = &self.blocks[0];
        let title = root.header.pointer("/session/title").and_then(Value::as_str).map(str::to_owned);
        let source_id = root.id.clone();
        let reject = |reason: String| Rejected::new(title.as_deref(), &source_id, reason);
        if let Some(e) = self.error {
            return Err(reject(e));
        }
        if uuid::Uuid::parse_str(&source_id).is_err() {
            return Err(reject("a session header has no id".into()));
        }
        let index: HashMap<&str, usize> =
            self.blocks.iter().enumerate().map(|(i, b)| (b.id.as_str(), i)).collect();
        let mut sessions = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            let s = &block.header["session"];
            let fork = match s.get("forked_from").filter(|f| !f.is_null()) {
                None => None,
                Some(f) => {
                    let parent =
                        f.get("session_id").and_then(Value::as_str).and_then(|p| index.get(p)).copied();
                    let through = f.get("through_seq").and_then(Value::as_i64).filter(|t| *t >= 1);
                    match (parent, through) {
                        (Some(parent), Some(through_seq)) => Some(PlannedFork { parent, through_seq }),
                        _ => return Err(reject(format!("session {} has a malformed forked_from", block.id))),
                    }
                }
            };
            if let Some(e) = &block.error {
                return Err(reject(format!("session {}: {e}", block.id)));
            }
            if block.expected == block.first_seq.unwrap_or(1) {
                return Err(reject(format!("session {}: it has no session_started event", block.id)));
            }
            sessions.push(PlannedSession {
                key: block.id.clone(),
                title: s.get("title").and_then(Value::as_str).map(str::to_owned),
                fork,
                events: Vec::new(),
                archived: s.get("archived").and_then(Value::as_bool).unwrap_or(false),
                metadata: s.get("metadata").filter(|m| m.as_object().is_some_and(|o| !o.is_empty())).cloned(),
                deleted: s.get("deleted").and_then(Value::as_bool).unwrap_or(false),
            });
        }
        for (session, block) in sessions.iter_mut().zip(self.blocks) {
            session.events = block.events;
        }
        Ok(Conversation {
            format: super::Format::Turnlog,
            source_id,
            title,
            sessions,
            skipped: Vec::new(),
            skipped_unlisted: 0,
        })
    }
}

/// Maps what an exported payload names in its own log to the target log: `seq` maps a seq
/// of the branch log, `memory` a memory id. A seq with no mapping stays as it was.
pub fn rewrite(
    kind: EventKind,
    payload: &mut Value,
    seq: impl Fn(i64) -> Option<i64>,
    memory: impl Fn(&str) -> String,
) {
    let map_seq = |v: Option<&mut Value>| {
        if let Some(v) = v {
            if let Some(mapped) = v.as_i64().and_then(&seq) {
                *v = Value::from(mapped);
            }
        }
    };
    match kind {
        EventKind::TurnMemory => map_seq(payload.get_mut("turn_seq")),
        EventKind::MemoryExtracted => {
            map_seq(payload.get_mut("turn_seq"));
            for m in payload.get_mut("memories").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(id) = m.get("id").and_then(Value::as_str).map(&memory) {
                    m["id"] = Value::String(id);
                }
            }
        }
        EventKind::CompactionApplied => {
            map_seq(payload.get_mut("replaces_through_seq"));
            for id in payload.get_mut("facts_extracted").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(mapped) = id.as_str().map(&memory) {
                    *id = Value::String(mapped);
                }
            }
        }
        EventKind::AssistantTurn | EventKind::PendingState | EventKind::TurnFailed => {
            map_seq(payload.get_mut("request").and_then(|r| r.get_mut("through_seq")));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ROOT: &str = "0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0a";
    const FORK: &str = "0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0b";

    fn header(id: &str, forked: Option<(&str, i64)>) -> Value {
        let from = forked.map(|(p, t)| json!({"session_id": p, "through_seq": t}));
        json!({"format": "turnlog", "version": 1, "session": {"id": id, "title": "Trip", "archived": false,
               "metadata": {}, "forked_from": from}})
    }

    fn event(seq: i64, kind: &str, payload: Value) -> Value {
        json!({"seq": seq, "event_id": format!("0190a0e4-0000-7000-8000-{seq:012}"), "kind": kind, "payload": payload,
               "created_at": "2026-05-01T10:00:00Z"})
    }

    fn whole(line: Value) -> Element {
        Element::Whole { bytes: line.to_string().len(), value: line }
    }

    fn push_all(lines: Vec<Value>) -> Vec<Result<Conversation, Rejected>> {
        let mut families = Families::default();
        let mut out: Vec<_> = lines.into_iter().filter_map(|l| families.push(whole(l)).unwrap()).collect();
        out.extend(families.finish());
        out
    }

    #[test]
    fn a_family_is_one_conversation_and_a_fork_starts_after_its_point() {
        let out = push_all(vec![
            header(ROOT, None),
            event(1, "session_started", json!({})),
            event(2, "user_message", json!({"text": "hi"})),
            event(
                3,
                "assistant_turn",
                json!({"llm": {"message": {"content": "yo"}},
                "imported": {"source": "chatgpt", "id": "n2", "created_at": "2023-11-14T22:13:20Z"}}),
            ),
            header(FORK, Some((ROOT, 2))),
            event(3, "session_started", json!({"forked_from": {"session_id": ROOT, "through_seq": 2}})),
            event(4, "assistant_turn", json!({"llm": {"message": {"content": "hey"}}})),
            header(FORK, None),
        ]);
        assert_eq!(out.len(), 2, "a second root starts a second family");
        let c = out[0].as_ref().unwrap();
        assert_eq!(c.sessions.len(), 2);
        assert_eq!(c.sessions[1].fork, Some(PlannedFork { parent: 0, through_seq: 2 }));
        assert_eq!(c.sessions[1].events[0].seq, 4);
        let imported = &c.sessions[0].events[0].payload.value()["imported"];
        assert_eq!(imported["source"], "turnlog");
        assert_eq!(imported["created_at"], "2026-05-01T10:00:00Z");
        // An answer imported before keeps its original time, now as turnlog's.
        let again = &c.sessions[0].events[1].payload.value()["imported"];
        assert_eq!(
            (&again["source"], &again["created_at"]),
            (&json!("turnlog"), &json!("2023-11-14T22:13:20Z"))
        );
        assert!(out[1].as_ref().unwrap_err().reason.contains("no session_started"));
    }

    #[test]
    fn gaps_unknown_kinds_and_orphan_forks_are_refused() {
        let gap = push_all(vec![
            header(ROOT, None),
            event(1, "session_started", json!({})),
            event(3, "user_message", json!({"text": "x"})),
        ]);
        assert!(gap[0].as_ref().unwrap_err().reason.contains("skip from seq 1 to 3"));
        let unknown = push_all(vec![
            header(ROOT, None),
            event(1, "session_started", json!({})),
            event(2, "nope", json!({})),
        ]);
        assert!(unknown[0].as_ref().unwrap_err().reason.contains("unknown"));
        let bad = push_all(vec![
            header(ROOT, None),
            event(1, "session_started", json!({})),
            event(2, "user_message", json!({"text": 3})),
        ]);
        assert!(bad[0].is_err());
        let orphan = push_all(vec![header(FORK, Some((ROOT, 2))), event(3, "session_started", json!({}))]);
        assert!(orphan[0].as_ref().unwrap_err().reason.contains("not before it"));
        let mut families = Families::default();
        assert!(families.push(whole(event(1, "session_started", json!({})))).is_err());
    }

    #[test]
    fn payloads_that_are_not_objects_are_refused() {
        // An array decodes as the struct it lists the fields of, but is no payload.
        for payload in [json!(["hi"]), json!("hi"), json!(3)] {
            let out = push_all(vec![
                header(ROOT, None),
                event(1, "session_started", json!({})),
                event(2, "user_message", payload),
            ]);
            let err = out[0].as_ref().unwrap_err();
            assert!(err.reason.contains("seq 2: its payload is not a JSON object"), "{err:?}");
        }
    }

    #[test]
    fn rewrite_maps_seqs_and_memory_ids() {
        let mut p = json!({"turn_seq": 3, "memories": [{"id": "m1", "text": "x"}]});
        rewrite(EventKind::MemoryExtracted, &mut p, |s| Some(s + 10), |m| format!("{m}'"));
        assert_eq!(p, json!({"turn_seq": 13, "memories": [{"id": "m1'", "text": "x"}]}));
        let mut p = json!({"summary": "s", "replaces_through_seq": 5, "facts_extracted": ["m1"]});
        rewrite(EventKind::CompactionApplied, &mut p, |_| None, |m| format!("{m}'"));
        assert_eq!(p, json!({"summary": "s", "replaces_through_seq": 5, "facts_extracted": ["m1'"]}));
    }
}
