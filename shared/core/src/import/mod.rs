//! Reading exports people bring (issue 25): ChatGPT's `conversations.json`, ShareGPT JSON
//! or JSONL, and turnlog's own JSONL. Each conversation of a file becomes a [`Conversation`]:
//! the sessions it makes (the main one first, then its forks, a parent before its forks)
//! with the events each appends, seqs numbered as the writer will number them. Pure: the
//! runtime's importer gives the sessions their ids and sends the events through the writer.
//!
//! A file is read as a stream, one conversation at a time; whatever a conversation cannot
//! be imported by is a [`Rejected`] of its own (the others go on), whatever is wrong with
//! the file as a whole a [`FileError`].

pub mod chatgpt;
pub mod sharegpt;
pub mod turnlog;

use std::io::BufRead;
use std::ops::ControlFlow;

use serde::de::{DeserializeSeed, SeqAccess, Visitor};
use serde_json::Value;

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

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "chatgpt" => Ok(Format::ChatGpt),
            "sharegpt" => Ok(Format::ShareGpt),
            "turnlog" => Ok(Format::Turnlog),
            other => {
                let shown: String = other.chars().take(40).collect();
                Err(format!("format must be chatgpt, sharegpt or turnlog, not {shown:?}"))
            }
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
    /// What could not be brought in as it was (each left a visible note in its message).
    pub skipped: Vec<Skipped>,
}

impl Conversation {
    /// How the summary names it: its title, or its id.
    pub fn label(&self) -> String {
        label(self.title.as_deref(), &self.source_id)
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
    pub payload: Value,
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

/// Reads `reader` as an export in `format` (None: told from its first element) and calls
/// `each` with every conversation, or why one cannot be imported, in file order until it
/// breaks. Returns the format read.
pub fn read<R: BufRead>(
    reader: R,
    format: Option<Format>,
    mut each: impl FnMut(Result<Conversation, Rejected>) -> ControlFlow<()>,
) -> Result<Format, FileError> {
    let mut chosen = format;
    let mut family = turnlog::Families::default();
    let mut index = 0usize;
    let mut stopped = false;
    elements(reader, |element| {
        let format = match chosen {
            Some(f) => f,
            None => {
                let f = Format::sniff(&element).ok_or_else(|| {
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
            expect_first(format, &element)?;
        }
        index += 1;
        let flow = match format {
            Format::ChatGpt => each(tidy(chatgpt::conversation(&element))),
            Format::ShareGpt => each(tidy(sharegpt::conversation(&element, index))),
            Format::Turnlog => match family.push(element)? {
                Some(done) => each(tidy(done)),
                None => ControlFlow::Continue(()),
            },
        };
        stopped = flow.is_break();
        Ok(flow)
    })?;
    if index == 0 {
        return Err(FileError::Empty);
    }
    if !stopped {
        if let Some(done) = family.finish() {
            let _ = each(tidy(done));
        }
    }
    Ok(chosen.unwrap_or(Format::ChatGpt))
}

/// Titles of every format kept within what a session takes.
fn tidy(c: Result<Conversation, Rejected>) -> Result<Conversation, Rejected> {
    let mut c = c?;
    c.title = tidy_title(c.title.take());
    for s in &mut c.sessions {
        s.title = tidy_title(s.title.take());
    }
    Ok(c)
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

/// Calls `f` with each element of a JSON array, or each value of a sequence of JSON values
/// (JSON lines), read from `reader` one at a time.
fn elements<R: BufRead>(
    mut reader: R,
    mut f: impl FnMut(Value) -> Result<ControlFlow<()>, FileError>,
) -> Result<(), FileError> {
    let first = loop {
        let buf = reader.fill_buf().map_err(|e| FileError::Syntax(e.to_string()))?;
        let Some(&b) = buf.first() else { return Err(FileError::Empty) };
        if b.is_ascii_whitespace() {
            reader.consume(1);
            continue;
        }
        // A byte order mark, as some editors write.
        if buf.starts_with(&[0xEF, 0xBB, 0xBF]) {
            reader.consume(3);
            continue;
        }
        break b;
    };
    match first {
        b'[' => {
            let mut de = serde_json::Deserializer::from_reader(reader);
            let mut error = None;
            let seed = EachElement { f: &mut f, error: &mut error };
            let result = seed.deserialize(&mut de).and_then(|()| de.end());
            match (error, result) {
                (Some(e), _) => Err(e),
                (None, Err(e)) => Err(syntax(&e)),
                (None, Ok(())) => Ok(()),
            }
        }
        b'{' => {
            for value in serde_json::Deserializer::from_reader(reader).into_iter::<Value>() {
                let value = value.map_err(|e| syntax(&e))?;
                if f(value)?.is_break() {
                    break;
                }
            }
            Ok(())
        }
        _ => Err(FileError::Shape("expected a JSON array or JSON lines of objects".into())),
    }
}

fn syntax(e: &serde_json::Error) -> FileError {
    if e.is_eof() {
        FileError::Syntax(format!("it ends early (truncated?) at line {}", e.line()))
    } else {
        FileError::Syntax(e.to_string())
    }
}

/// Deserializes a JSON array, handing each element to `f` as it is read.
struct EachElement<'a, F> {
    f: &'a mut F,
    error: &'a mut Option<FileError>,
}

impl<'de, F> DeserializeSeed<'de> for EachElement<'_, F>
where
    F: FnMut(Value) -> Result<ControlFlow<()>, FileError>,
{
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, F> Visitor<'de> for EachElement<'_, F>
where
    F: FnMut(Value) -> Result<ControlFlow<()>, FileError>,
{
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of conversations")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(value) = seq.next_element::<Value>()? {
            match (self.f)(value) {
                Ok(ControlFlow::Continue(())) => {}
                Ok(ControlFlow::Break(())) => {
                    // The rest is still read (and checked) but not handed on.
                    while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                    return Ok(());
                }
                Err(e) => {
                    *self.error = Some(e);
                    return Err(serde::de::Error::custom("stopped"));
                }
            }
        }
        Ok(())
    }
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
pub(crate) fn user_payload(text: String, imported: crate::events::Imported) -> Value {
    let message = crate::events::UserMessage { text, imported: Some(imported), ..Default::default() };
    crate::events::EventBody::UserMessage(message).to_payload()
}

/// An answer's payload: `text` (what the model and the user see), reasoning shown apart.
pub(crate) fn answer_payload(
    reasoning: Vec<String>,
    text: String,
    model: Option<String>,
    imported: crate::events::Imported,
) -> Value {
    use crate::events::{AssistantTurn, Block, BlockType, LlmMessage, LlmPart, MessageContent, UiPart};
    let mut blocks: Vec<Block> = reasoning
        .into_iter()
        .map(|r| Block { kind: BlockType::Reasoning, text: Some(r), meta: None })
        .collect();
    blocks.push(Block { kind: BlockType::Text, text: Some(text.clone()), meta: None });
    let turn = AssistantTurn {
        ui: UiPart { blocks },
        llm: LlmPart { message: LlmMessage { content: Some(MessageContent::Text(text)) } },
        model,
        finish_reason: Some("stop".into()),
        imported: Some(Box::new(imported)),
        ..Default::default()
    };
    crate::events::EventBody::AssistantTurn(turn).to_payload()
}

#[cfg(test)]
mod tests {
    use super::*;

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
