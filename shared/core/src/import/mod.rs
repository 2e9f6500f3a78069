//! Reading exports people bring (issue 25): ChatGPT's `conversations.json`, ShareGPT JSON
//! or JSONL, and turnlog's own JSONL. Each conversation of a file becomes a [`Conversation`]:
//! the sessions it makes (the main one first, then its forks, a parent before its forks)
//! with the events each appends, seqs numbered as the writer will number them. Pure: the
//! runtime's importer gives the sessions their ids and sends the events through the writer.
//!
//! A file is read as a stream, one conversation at a time and none past
//! [`MAX_CONVERSATION_BYTES`]; whatever a conversation cannot be imported by is a
//! [`Rejected`] of its own (the others go on), whatever is wrong with the file as a whole a
//! [`FileError`]. A conversation's plan is checked whole as it is read (every seq it names,
//! every fork point), so what the importer appends of it the writer takes.

pub mod chatgpt;
mod elements;
pub mod sharegpt;
pub mod turnlog;

use std::io::BufRead;
use std::ops::ControlFlow;

use serde_json::Value;

use elements::Element;

use crate::events::{EventKind, MAX_TITLE_CHARS};

/// The formats `POST /v1/import` and `turnlog import` read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    ChatGpt,
    ShareGpt,
    Turnlog,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::ChatGpt => "chatgpt",
            Format::ShareGpt => "sharegpt",
            Format::Turnlog => "turnlog",
        }
    }

    /// The format of an export whose first element (array item or line) is `first`.
    pub fn sniff(first: &Value) -> Option<Format> {
        if first.get("mapping").is_some() {
            Some(Format::ChatGpt)
        } else if first.get("format").and_then(Value::as_str) == Some("turnlog") {
            Some(Format::Turnlog)
        } else if first.get("conversations").or_else(|| first.get("messages")).is_some_and(Value::is_array) {
            Some(Format::ShareGpt)
        } else {
            None
        }
    }
}

/// A format name that is none of [`Format`]'s, shown up to 40 characters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("format must be chatgpt, sharegpt or turnlog, not {0:?}")]
pub struct UnknownFormat(String);

impl std::str::FromStr for Format {
    type Err = UnknownFormat;
    fn from_str(s: &str) -> Result<Self, UnknownFormat> {
        match s {
            "chatgpt" => Ok(Format::ChatGpt),
            "sharegpt" => Ok(Format::ShareGpt),
            "turnlog" => Ok(Format::Turnlog),
            other => Err(UnknownFormat(other.chars().take(40).collect())),
        }
    }
}

/// One conversation of an export, as the sessions it makes.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The export it came from.
    pub format: Format,
    /// Its id in the export (for an export without ids, a hash of its content), from which
    /// the importer derives its sessions' ids: importing it again names the same sessions.
    pub source_id: String,
    pub title: Option<String>,
    /// The main session first; every fork after its parent.
    pub sessions: Vec<PlannedSession>,
    /// What could not be brought in as it was (each left a visible note in its message):
    /// the first [`MAX_SKIPPED_LISTED`].
    pub skipped: Vec<Skipped>,
    /// How many more were skipped than `skipped` lists.
    pub skipped_unlisted: usize,
}

/// Most skipped parts a conversation lists (a conversation of a million images is summed up
/// in a few kilobytes); the rest are counted.
pub const MAX_SKIPPED_LISTED: usize = 100;

/// Adds a skipped part to `listed`, or counts it in `unlisted` once `listed` is full.
pub(crate) fn skip(listed: &mut Vec<Skipped>, unlisted: &mut usize, what: String, reason: &str) {
    if listed.len() < MAX_SKIPPED_LISTED {
        listed.push(Skipped { what, reason: reason.to_owned() });
    } else {
        *unlisted += 1;
    }
}

impl Conversation {
    /// How the summary names it: its title, or its id.
    pub fn label(&self) -> String {
        label(self.title.as_deref(), &self.source_id)
    }

    /// About what its plan takes in memory: its payloads as JSON, and a little more for
    /// each event and session.
    pub fn bytes(&self) -> usize {
        let events = |s: &PlannedSession| -> usize {
            s.events.iter().map(|e| 96 + e.source_id.len() + e.payload.json_len()).sum()
        };
        self.sessions.iter().map(|s| 256 + s.key.len() + events(s)).sum()
    }

    /// The user messages and answers it appends.
    pub fn messages(&self) -> usize {
        self.sessions
            .iter()
            .flat_map(|s| &s.events)
            .filter(|e| matches!(e.kind, EventKind::UserMessage | EventKind::AssistantTurn))
            .count()
    }
}

/// How a summary and the logs name a conversation: at most 80 characters of its title or
/// id, control characters (a line break in a title) as spaces.
fn label(title: Option<&str>, id: &str) -> String {
    let shown = title.map(str::trim).filter(|t| !t.is_empty()).unwrap_or(id);
    shown.chars().take(80).map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// A title as a session keeps it: trimmed, at most [`MAX_TITLE_CHARS`] characters (the
/// API's limit), none when blank.
fn tidy_title(title: Option<String>) -> Option<String> {
    let title = title?;
    let trimmed = title.trim();
    (!trimmed.is_empty()).then(|| trimmed.chars().take(MAX_TITLE_CHARS).collect())
}

/// A session an import creates.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedSession {
    /// Names it within its conversation (a branch's leaf node, an exported session id).
    pub key: String,
    pub title: Option<String>,
    /// For a fork: its parent (an earlier session of the conversation) and the last seq of
    /// the parent's branch log it inherits, as numbered here.
    pub fork: Option<PlannedFork>,
    pub events: Vec<PlannedEvent>,
    pub archived: bool,
    pub metadata: Option<Value>,
    /// Deleted in the export, kept for the forks that inherit its prefix: deleted again
    /// once they exist (DESIGN §10).
    pub deleted: bool,
}

impl PlannedSession {
    /// The seq of its `session_started`: 1, or for a fork the one after its fork point.
    pub fn first_seq(&self) -> i64 {
        self.fork.map_or(1, |f| f.through_seq + 1)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedFork {
    pub parent: usize,
    pub through_seq: i64,
}

/// An event an import appends.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedEvent {
    /// Its id in the export (a node, a message index, an event id): its event id derives
    /// from it and the session's.
    pub source_id: String,
    /// Its seq as numbered here (the writer's, unless another producer appends to the
    /// session meanwhile: the importer maps one to the other).
    pub seq: i64,
    pub kind: EventKind,
    pub payload: Payload,
    /// The seq its payload names, if any.
    pub refers: Option<SeqRef>,
}

/// An event's payload as JSON text: a plan holds every event of a conversation, and as text
/// each takes about a tenth of what a parsed [`Value`] does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload(Box<str>);

impl Payload {
    /// `payload` as JSON text.
    pub fn of(payload: &impl serde::Serialize) -> Payload {
        // Plain structs and JSON values always serialize.
        Payload(serde_json::to_string(payload).unwrap_or_else(|_| "null".to_owned()).into())
    }

    /// The payload, parsed.
    pub fn value(&self) -> Value {
        serde_json::from_str(&self.0).unwrap_or(Value::Null)
    }

    /// Its length as JSON, in bytes: what the writer's event limit measures.
    pub fn json_len(&self) -> usize {
        self.0.len()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A seq of its branch log that an event's payload names, which the importer maps to the
/// target log's ([`turnlog::rewrite`]) and `check_plan` checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqRef {
    /// A compaction's `replaces_through_seq`.
    Compacts(i64),
    /// The answer a memory event is of (`turn_seq`).
    Turn(i64),
    /// The last seq an attempt's recorded request read (`request.through_seq`).
    Request(i64),
}

impl SeqRef {
    /// The seq a decoded event's payload names.
    pub fn of(body: &crate::events::EventBody) -> Option<SeqRef> {
        use crate::events::EventBody;
        match body {
            EventBody::CompactionApplied(c) => Some(SeqRef::Compacts(c.replaces_through_seq)),
            EventBody::TurnMemory(m) => Some(SeqRef::Turn(m.turn_seq)),
            EventBody::MemoryExtracted(m) => Some(SeqRef::Turn(m.turn_seq)),
            other => other.recorded_request().map(|r| SeqRef::Request(r.through_seq)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    pub what: String,
    pub reason: String,
}

/// A conversation of the file that cannot be imported, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Rejected {
    pub conversation: String,
    pub reason: String,
}

impl Rejected {
    pub fn new(title: Option<&str>, id: &str, reason: impl Into<String>) -> Self {
        Self { conversation: label(title, id), reason: reason.into() }
    }
}

/// What is wrong with a file as a whole: nothing of it is imported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    #[error("the file is not valid JSON: {0}")]
    Syntax(String),
    #[error("{0}")]
    Shape(String),
    #[error("the file holds no conversations")]
    Empty,
}

/// Most bytes of JSON one conversation may take: a ChatGPT conversation, a ShareGPT item,
/// a turnlog session family. Read, a conversation takes about ten times its bytes (one is
/// read at a time), so this bounds an import's memory whatever the file holds.
pub const MAX_CONVERSATION_BYTES: usize = 32 * 1024 * 1024;

/// Most sessions one conversation may make (its main session and its forks; for a ChatGPT
/// conversation, branches): each is a create and a fork the writer places.
pub const MAX_SESSIONS: usize = 1_000;

/// Reads `reader` as an export in `format` (None: told from its first element) and calls
/// `each` with every conversation, or why one cannot be imported, in file order until it
/// breaks. Returns the format read.
pub fn read<R: BufRead>(
    reader: R,
    format: Option<Format>,
    each: impl FnMut(Result<Conversation, Rejected>) -> ControlFlow<()>,
) -> Result<Format, FileError> {
    read_with(reader, format, MAX_CONVERSATION_BYTES, each)
}

/// [`read`], with conversations of more than `max_bytes` of JSON refused (each alone).
pub fn read_with<R: BufRead>(
    reader: R,
    format: Option<Format>,
    max_bytes: usize,
    mut each: impl FnMut(Result<Conversation, Rejected>) -> ControlFlow<()>,
) -> Result<Format, FileError> {
    let mut chosen = format;
    let mut family = turnlog::Families::new(max_bytes);
    let mut index = 0usize;
    let mut stopped = false;
    elements::each(reader, max_bytes, |element| {
        let shown = match &element {
            Element::Whole { value, .. } => value,
            Element::TooLarge(head) => &Value::Object(head.skeleton.clone()),
        };
        let format = match chosen {
            Some(f) => f,
            None => {
                let f = Format::sniff(shown).ok_or_else(|| {
                    FileError::Shape(
                        "cannot tell the format: expected a ChatGPT export (conversations with a `mapping`), \
                         ShareGPT (objects with `conversations`) or a turnlog export (JSON lines after a \
                         `{\"format\": \"turnlog\"}` header)"
                            .into(),
                    )
                })?;
                chosen = Some(f);
                f
            }
        };
        if index == 0 {
            expect_first(format, shown)?;
        }
        index += 1;
        let flow = match (format, element) {
            (Format::ChatGpt | Format::ShareGpt, Element::TooLarge(head)) => {
                let id = head.get("conversation_id").or(head.get("id")).unwrap_or("");
                let id = if id.is_empty() { format!("item {index}") } else { id.to_owned() };
                each(Err(Rejected::new(head.get("title"), &id, too_large(max_bytes))))
            }
            (Format::ChatGpt, Element::Whole { value, .. }) => {
                let c = chatgpt::conversation(&value);
                drop(value);
                each(finish(c))
            }
            (Format::ShareGpt, Element::Whole { value, .. }) => {
                let c = sharegpt::conversation(&value, index);
                drop(value);
                each(finish(c))
            }
            (Format::Turnlog, element) => match family.push(element)? {
                Some(done) => each(finish(done)),
                None => ControlFlow::Continue(()),
            },
        };
        stopped = flow.is_break();
        Ok(flow)
    })?;
    if !stopped {
        if let Some(done) = family.finish() {
            let _ = each(finish(done));
        }
    }
    Ok(chosen.unwrap_or(Format::ChatGpt))
}

/// Why a conversation over the cap is not imported.
pub(crate) fn too_large(max_bytes: usize) -> String {
    let size = match max_bytes {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    };
    format!("it is larger than the {size} of JSON a conversation may take")
}

/// A conversation as it leaves the reader: titles of every format kept within what a
/// session takes, and its plan checked whole (see [`check_plan`]).
fn finish(c: Result<Conversation, Rejected>) -> Result<Conversation, Rejected> {
    let mut c = c?;
    c.title = tidy_title(c.title.take());
    for s in &mut c.sessions {
        s.title = tidy_title(s.title.take());
    }
    if let Err(why) = check_plan(&c) {
        return Err(Rejected::new(c.title.as_deref(), &c.source_id, why.to_string()));
    }
    Ok(c)
}

/// What the writer would refuse of a plan, found before anything of it is appended: more
/// sessions than [`MAX_SESSIONS`], a session named twice, a fork of a later session or
/// through a seq past its parent's end or nested deeper than the writer takes, seqs not
/// gapless, an event named twice in a session, and every seq a payload names
/// (`replaces_through_seq` after the previous compaction and before its own seq,
/// `turn_seq` and a request's `through_seq` before its own seq).
fn check_plan(c: &Conversation) -> Result<(), PlanError> {
    use crate::branch::{fork_lineage, Segment, MAX_FORK_DEPTH};
    use crate::ids::SessionId;
    use std::collections::HashSet;

    if c.sessions.len() > MAX_SESSIONS {
        return Err(PlanError::TooManySessions);
    }
    let mut keys = HashSet::with_capacity(c.sessions.len());
    if let Some(twice) = c.sessions.iter().find(|s| !keys.insert(s.key.as_str())) {
        return Err(PlanError::SessionTwice(twice.key.clone()));
    }
    // Per session: its lineage, last seq, and compactions as (seq, replaces_through_seq).
    let mut lineages: Vec<Vec<Segment>> = Vec::with_capacity(c.sessions.len());
    let mut last_seqs: Vec<i64> = Vec::with_capacity(c.sessions.len());
    let mut compactions: Vec<Vec<(i64, i64)>> = Vec::with_capacity(c.sessions.len());
    let id_of = |i: usize| SessionId(uuid::Uuid::from_u128(i as u128));
    let index_of = |id: SessionId| id.0.as_u128() as usize;
    for (i, s) in c.sessions.iter().enumerate() {
        let n = i + 1;
        let lineage = match s.fork {
            None => Vec::new(),
            Some(f) => {
                if f.parent >= i {
                    return Err(PlanError::ForkOfLater { session: n });
                }
                let end = last_seqs[f.parent];
                if f.through_seq < 1 || f.through_seq > end {
                    return Err(PlanError::ForkPastEnd { session: n, through_seq: f.through_seq, end });
                }
                let lineage = fork_lineage(id_of(f.parent), &lineages[f.parent], f.through_seq);
                if lineage.len() > MAX_FORK_DEPTH {
                    return Err(PlanError::TooDeep);
                }
                lineage
            }
        };
        // The boundary of the newest compaction at or before `seq` in a list of them in seq
        // order, and in this session's branch log (its own, then its ancestors').
        let newest = |list: &[(i64, i64)], seq: i64| {
            let before = list.partition_point(|(at, _)| *at <= seq);
            before.checked_sub(1).map(|k| list[k].1)
        };
        let boundary_at = |seq: i64, own: &[(i64, i64)]| -> Option<i64> {
            newest(own, seq).or_else(|| {
                let mut seq = seq;
                lineage.iter().rev().find_map(|segment| {
                    seq = seq.min(segment.through);
                    newest(&compactions[index_of(segment.session)], seq)
                })
            })
        };
        let mut own: Vec<(i64, i64)> = Vec::new();
        let mut ids = HashSet::with_capacity(s.events.len());
        let mut expected = s.first_seq() + 1;
        for e in &s.events {
            let at = || PlannedAt { kind: e.kind, seq: e.seq, session: n };
            if e.seq != expected {
                return Err(PlanError::SeqGap { session: n, after: expected - 1, seq: e.seq });
            }
            expected += 1;
            if !ids.insert(e.source_id.as_str()) {
                return Err(PlanError::EventTwice { session: n, event: e.source_id.clone() });
            }
            match e.refers {
                None => {}
                Some(SeqRef::Compacts(through)) => {
                    let previous = boundary_at(e.seq, &own).unwrap_or(0);
                    if through <= previous || through >= e.seq {
                        return Err(PlanError::OutsideLiveLog { event: at(), through, from: previous + 1 });
                    }
                    own.push((e.seq, through));
                }
                Some(SeqRef::Turn(seq)) if seq < 1 || seq >= e.seq => {
                    return Err(PlanError::TurnNotBefore { event: at(), seq });
                }
                Some(SeqRef::Request(seq)) if seq < 1 || seq >= e.seq => {
                    return Err(PlanError::RequestNotBefore { event: at(), seq });
                }
                Some(SeqRef::Turn(_) | SeqRef::Request(_)) => {}
            }
        }
        lineages.push(lineage);
        last_seqs.push(expected - 1);
        compactions.push(own);
    }
    Ok(())
}

/// What [`check_plan`] finds the writer would refuse: a conversation's `Rejected` reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum PlanError {
    #[error("it has more than {} sessions", MAX_SESSIONS)]
    TooManySessions,
    #[error("it names session {0} twice")]
    SessionTwice(String),
    #[error("session {session} forks from a session after it")]
    ForkOfLater { session: usize },
    #[error(
        "session {session} forks through seq {through_seq}, which its parent's log (1..={end}) does not hold"
    )]
    ForkPastEnd { session: usize, through_seq: i64, end: i64 },
    #[error("its forks nest more than {} deep", crate::branch::MAX_FORK_DEPTH)]
    TooDeep,
    #[error("session {session} skips from seq {after} to {seq}")]
    SeqGap { session: usize, after: i64, seq: i64 },
    #[error("session {session} has event {event} twice")]
    EventTwice { session: usize, event: String },
    #[error("{event} has replaces_through_seq {through}, outside its live log ({from}..{})", .event.seq)]
    OutsideLiveLog { event: PlannedAt, through: i64, from: i64 },
    #[error("{event} names turn_seq {seq}, which is not before it")]
    TurnNotBefore { event: PlannedAt, seq: i64 },
    #[error("{event} records a request through_seq {seq}, which is not before it")]
    RequestNotBefore { event: PlannedAt, seq: i64 },
}

/// An event of a plan as [`PlanError`] names it: "the user message at seq 4 of session 2".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PlannedAt {
    kind: EventKind,
    seq: i64,
    /// The session's place in the conversation, from 1.
    session: usize,
}

impl std::fmt::Display for PlannedAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = self.kind.as_str().replace('_', " ");
        write!(f, "the {kind} at seq {} of session {}", self.seq, self.session)
    }
}

/// The first element must be of the format asked for: a file of another format fails as a
/// whole, not conversation by conversation.
fn expect_first(format: Format, first: &Value) -> Result<(), FileError> {
    if Format::sniff(first) == Some(format) {
        return Ok(());
    }
    let is = Format::sniff(first).map(|f| format!(" (it looks like {})", f.as_str())).unwrap_or_default();
    Err(FileError::Shape(match format {
        Format::ChatGpt => format!("not a ChatGPT export: its first conversation has no `mapping`{is}"),
        Format::ShareGpt => format!("not a ShareGPT file: its first item has no `conversations` list{is}"),
        Format::Turnlog => format!("not a turnlog export: it does not start with a turnlog header line{is}"),
    }))
}

/// A short title from a first message: its first line, at most 80 characters.
pub(crate) fn title_from(text: &str) -> Option<String> {
    let line = text.lines().map(str::trim).find(|l| !l.is_empty())?;
    let mut title: String = line.chars().take(80).collect();
    if line.chars().count() > 80 {
        title.push('…');
    }
    Some(title)
}

/// A user message event's payload.
pub(crate) fn user_payload(text: String, imported: crate::events::Imported) -> Payload {
    Payload::of(&crate::events::UserMessage { text, imported: Some(imported), ..Default::default() })
}

/// An answer's payload: `text` (what the model and the user see), reasoning shown apart.
pub(crate) fn answer_payload(
    reasoning: Vec<String>,
    text: String,
    model: Option<String>,
    imported: crate::events::Imported,
) -> Payload {
    use crate::events::{AssistantTurn, Block, BlockType, LlmMessage, LlmPart, MessageContent, UiPart};
    let mut blocks: Vec<Block> = reasoning
        .into_iter()
        .map(|r| Block { kind: BlockType::Reasoning, text: Some(r), meta: None })
        .collect();
    blocks.push(Block { kind: BlockType::Text, text: Some(text.clone()), meta: None });
    let turn = AssistantTurn {
        ui: UiPart { blocks },
        llm: LlmPart {
            message: LlmMessage { content: Some(MessageContent::Text(text)), ..Default::default() },
        },
        model,
        finish_reason: Some("stop".into()),
        imported: Some(Box::new(imported)),
        ..Default::default()
    };
    Payload::of(&turn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn all(
        text: &str,
        format: Option<Format>,
    ) -> Result<(Format, Vec<Result<Conversation, Rejected>>), FileError> {
        let mut out = Vec::new();
        let f = read(text.as_bytes(), format, |c| {
            out.push(c);
            ControlFlow::Continue(())
        })?;
        Ok((f, out))
    }

    #[test]
    fn files_that_are_not_exports_fail_whole() {
        assert_eq!(all("", None).unwrap_err(), FileError::Empty);
        assert_eq!(all("  []", None).unwrap_err(), FileError::Empty);
        assert!(matches!(all("\"text\"", None).unwrap_err(), FileError::Shape(_)));
        let truncated = r#"[{"title": "a", "mapping": {}}, {"title": "#;
        let err = all(truncated, None).unwrap_err();
        assert!(matches!(&err, FileError::Syntax(m) if m.contains("ends early")), "{err}");
        let sharegpt = r#"[{"conversations": [{"from": "human", "value": "hi"}]}]"#;
        let err = all(sharegpt, Some(Format::ChatGpt)).unwrap_err();
        assert!(err.to_string().contains("looks like sharegpt"), "{err}");
        let garbage_after = r#"[{"conversations": []}] x"#;
        assert!(matches!(all(garbage_after, None).unwrap_err(), FileError::Syntax(_)));
    }

    #[test]
    fn titles_are_cut_to_what_a_session_takes_and_labels_to_one_line() {
        let long = format!(
            "{{\"title\": \"{}\", \"conversations\": [{{\"from\": \"human\", \"value\": \"hi\"}}]}}",
            "é".repeat(600)
        );
        let (_, out) = all(&long, None).unwrap();
        let c = out[0].as_ref().unwrap();
        assert_eq!(c.title.as_ref().map(|t| t.chars().count()), Some(MAX_TITLE_CHARS));
        assert_eq!(c.sessions[0].title, c.title);
        assert_eq!(label(Some("two\nlines"), "id"), "two lines");
        assert_eq!(tidy_title(Some("  ".into())), None);
    }

    fn all_with(
        text: &str,
        format: Option<Format>,
        max_bytes: usize,
    ) -> Result<(Format, Vec<Result<Conversation, Rejected>>), FileError> {
        let mut out = Vec::new();
        let f = read_with(text.as_bytes(), format, max_bytes, |c| {
            out.push(c);
            ControlFlow::Continue(())
        })?;
        Ok((f, out))
    }

    #[test]
    fn a_conversation_over_the_cap_fails_alone_and_the_rest_is_read() {
        let small = |id: &str| json!({"id": id, "conversations": [{"from": "human", "value": "hi"}]});
        // Named by what comes before the bulk (the title after it is not read).
        let x = "x".repeat(10_000);
        let big = format!(
            r#"{{"id": "big", "conversations": [{{"from": "human", "value": "{x}"}}], "title": "Huge"}}"#
        );
        let (s1, s2) = (small("s1"), small("s2"));
        let array = format!("[{s1}, {big}, {s2}]");
        let lines = format!("{s1}\n{big}\n{s2}\n");
        for text in [array, lines] {
            let (format, out) = all_with(&text, None, 4096).unwrap();
            assert_eq!(format, Format::ShareGpt);
            assert_eq!(out.len(), 3, "{out:?}");
            assert_eq!(out[0].as_ref().unwrap().source_id, "s1");
            let err = out[1].as_ref().unwrap_err();
            assert_eq!(err.conversation, "big");
            assert!(err.reason.contains("larger than the 4 KiB"), "{err:?}");
            assert_eq!(out[2].as_ref().unwrap().source_id, "s2");
        }
        // A first element over the cap still tells the format; a ChatGPT conversation is
        // named by its title, which comes first (its ids come after its messages).
        let mapping: serde_json::Map<String, Value> = (0..100)
            .map(|i| (format!("n{i}"), json!({"message": null, "parent": null, "children": []})))
            .collect();
        let mapping = Value::Object(mapping);
        let chatgpt =
            format!(r#"[{{"title": "Big one", "mapping": {mapping}, "conversation_id": "c-big"}}]"#);
        let (format, out) = all_with(&chatgpt, None, 1024).unwrap();
        assert_eq!(format, Format::ChatGpt);
        assert_eq!(out[0].as_ref().unwrap_err().conversation, "Big one");
        let untitled = chatgpt.replace(r#""title": "Big one", "#, "");
        let (_, out) = all_with(&untitled, None, 1024).unwrap();
        assert_eq!(out[0].as_ref().unwrap_err().conversation, "item 1");
        // What is over the cap is still read as JSON: cut short, the file fails whole.
        let cut = &chatgpt[..chatgpt.len() - 30];
        assert!(matches!(all_with(cut, None, 1024).unwrap_err(), FileError::Syntax(_)));
        // A turnlog family is one conversation: its lines count together.
        let header = json!({"format": "turnlog", "version": 1, "session": {"id": ROOT, "title": "Long"}});
        let mut text = format!("{header}\n{}\n", turnlog_event(1, "session_started", json!({})));
        for seq in 2..200 {
            text.push_str(&format!(
                "{}\n",
                turnlog_event(seq, "user_message", json!({"text": "hello there"}))
            ));
        }
        let other = json!({"format": "turnlog", "version": 1, "session": {"id": FORK}});
        text.push_str(&format!("{other}\n{}\n", turnlog_event(1, "session_started", json!({}))));
        let (_, out) = all_with(&text, None, 8192).unwrap();
        assert_eq!(out.len(), 2);
        assert!(out[0].as_ref().unwrap_err().reason.contains("larger than the 8 KiB"), "{out:?}");
        assert!(out[1].is_ok(), "{out:?}");
    }

    const ROOT: &str = "0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0a";
    const FORK: &str = "0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0b";

    fn turnlog_event(seq: i64, kind: &str, payload: Value) -> Value {
        json!({"seq": seq, "event_id": format!("0190a0e4-0000-7000-8000-{seq:012}"), "kind": kind, "payload": payload})
    }

    /// A session of a turnlog export: its id, its fork point, its events after its
    /// `session_started` as (kind, payload).
    type Exported<'a> = (&'a str, Option<(&'a str, i64)>, Vec<(&'a str, Value)>);

    /// A turnlog export of one family; why it cannot be imported, if so.
    fn family_problem(sessions: &[Exported<'_>]) -> Option<String> {
        let mut text = String::new();
        for (id, from, events) in sessions {
            let forked = from.map(|(p, t)| json!({"session_id": p, "through_seq": t}));
            let header =
                json!({"format": "turnlog", "version": 1, "session": {"id": id, "forked_from": forked}});
            let first = from.map_or(1, |(_, t)| t + 1);
            text.push_str(&format!("{header}\n{}\n", turnlog_event(first, "session_started", json!({}))));
            for (i, (kind, payload)) in events.iter().enumerate() {
                let line = turnlog_event(first + 1 + i as i64, kind, payload.clone());
                text.push_str(&format!("{line}\n"));
            }
        }
        let (_, out) = all(&text, Some(Format::Turnlog)).unwrap();
        assert_eq!(out.len(), 1);
        out.into_iter().next().and_then(|c| c.err()).map(|r| r.reason)
    }

    #[test]
    fn every_cross_reference_is_checked_against_the_plan() {
        let user = || ("user_message", json!({"text": "hi"}));
        let answer = || ("assistant_turn", json!({"llm": {"message": {"content": "yo"}}}));
        let compaction =
            |through: i64| ("compaction_applied", json!({"summary": "s", "replaces_through_seq": through}));
        let request = |through: i64| {
            json!({"through_seq": through, "model": "m", "params": {}, "system": {"sha256": "ab", "text": "be kind"},
                   "tokens": 1, "body_sha256": "cd"})
        };
        // Sound: a fork through its parent's last seq, a compaction after the inherited one,
        // facts of an earlier answer, a request through the seq before its answer.
        let sound = family_problem(&[
            (ROOT, None, vec![user(), answer(), compaction(3), user()]),
            (
                FORK,
                Some((ROOT, 5)),
                vec![
                    compaction(5),
                    ("memory_extracted", json!({"turn_seq": 3})),
                    ("turn_memory", json!({"turn_seq": 3})),
                    user(),
                    (
                        "assistant_turn",
                        json!({"llm": {"message": {"content": "yo"}}, "request": request(10)}),
                    ),
                ],
            ),
        ]);
        assert_eq!(sound, None);
        let refused = [
            (family_problem(&[(ROOT, None, vec![user()]), (FORK, Some((ROOT, 5)), vec![user()])]), "fork"),
            (
                family_problem(&[(ROOT, None, vec![user(), answer(), compaction(999)])]),
                "replaces_through_seq 999",
            ),
            (
                family_problem(&[(ROOT, None, vec![user(), answer(), compaction(0)])]),
                "replaces_through_seq 0",
            ),
            (
                family_problem(&[
                    (ROOT, None, vec![user(), answer(), compaction(3), user()]),
                    (FORK, Some((ROOT, 5)), vec![compaction(2)]),
                ]),
                "replaces_through_seq 2",
            ),
            (
                family_problem(&[(ROOT, None, vec![user(), ("memory_extracted", json!({"turn_seq": 9}))])]),
                "turn_seq 9",
            ),
            (
                family_problem(&[(ROOT, None, vec![user(), ("turn_memory", json!({"turn_seq": 0}))])]),
                "turn_seq 0",
            ),
            (
                family_problem(&[(
                    ROOT,
                    None,
                    vec![
                        user(),
                        (
                            "assistant_turn",
                            json!({"llm": {"message": {"content": "yo"}}, "request": request(3)}),
                        ),
                    ],
                )]),
                "through_seq 3",
            ),
            (
                family_problem(&[(
                    ROOT,
                    None,
                    vec![
                        user(),
                        ("turn_failed", json!({"code": "x", "message": "y", "request": request(70)})),
                    ],
                )]),
                "through_seq 70",
            ),
            // The same session twice: the second names the first as its parent.
            (
                family_problem(&[
                    (ROOT, None, vec![user()]),
                    (FORK, Some((ROOT, 2)), vec![]),
                    (ROOT, Some((FORK, 2)), vec![]),
                ]),
                "twice",
            ),
        ];
        for (problem, says) in refused {
            let problem = problem.unwrap_or_else(|| panic!("not refused: {says}"));
            assert!(problem.contains(says), "{problem:?} should say {says:?}");
        }
        // More sessions than a conversation may make.
        let mut many: Vec<Exported<'_>> = vec![(ROOT, None, vec![user()])];
        let ids: Vec<String> =
            (0..MAX_SESSIONS).map(|i| format!("0190a0e4-3b1c-7cc1-9a2b-{i:012}")).collect();
        many.extend(ids.iter().map(|id| (id.as_str(), Some((ROOT, 2)), vec![])));
        let problem = family_problem(&many).unwrap();
        assert!(problem.contains("more than 1000 sessions"), "{problem}");
    }

    #[test]
    fn json_lines_and_arrays_read_alike() {
        let lines = "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}]}\n\n\
                     {\"conversations\": [{\"from\": \"gpt\", \"value\": \"yo\"}]}\n";
        let (format, out) = all(lines, None).unwrap();
        assert_eq!(format, Format::ShareGpt);
        assert_eq!(out.len(), 2);
        let array = format!("\u{feff}[{}]", lines.trim().replace("\n\n", ","));
        assert_eq!(all(&array, None).unwrap().1, out);
    }
}
