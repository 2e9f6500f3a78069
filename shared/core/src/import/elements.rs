//! A file's elements (the items of a JSON array, or a sequence of JSON values: JSON lines),
//! one at a time, none held past a cap. Each element's end is found by its brackets and
//! strings as the bytes go by; an element within the cap is then parsed whole, one over it
//! is read through without being kept (still checked to be JSON, so a file that is not
//! fails whole) and stands for itself by what its first bytes name: the title and id a
//! summary shows, and the keys the format is told by.
//!
//! Memory: one element's bytes and its parsed value at a time, however large the file or
//! any one string in it; a conversation's parsed JSON takes about ten times its bytes.

use std::io::{BufRead, Read};

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde_json::{Map, Value};

use super::FileError;

/// One element of the file.
pub(crate) enum Element {
    /// Within the cap: its value, and how many bytes of the file it took.
    Whole { value: Value, bytes: usize },
    /// Over the cap: what its first bytes name.
    TooLarge(Head),
}

/// What the first bytes of an element too large to read whole name: its top-level strings
/// that label a conversation (`title`, `id`, `conversation_id`, `format`; ChatGPT writes
/// the title first, its ids after the messages), and a stand-in for each other top-level
/// key, so the format can still be told from it.
#[derive(Debug, Default)]
pub(crate) struct Head {
    pub skeleton: Map<String, Value>,
}

/// Longest top-level string a [`Head`] keeps.
const MAX_HEAD_STRING: usize = 1024;
/// Most top-level keys a [`Head`] keeps.
const MAX_HEAD_KEYS: usize = 64;

/// Calls `f` with each element of `reader` in order until it breaks (the rest is left
/// unread) or fails: a JSON array,
/// or JSON values one after the other; elements of more than `max_bytes` as their
/// [`Head`]. An empty file (or `[]`) is [`FileError::Empty`].
pub(crate) fn each<R: BufRead>(
    reader: R,
    max_bytes: usize,
    mut f: impl FnMut(Element) -> Result<std::ops::ControlFlow<()>, FileError>,
) -> Result<(), FileError> {
    let mut src = Source { reader, line: 1 };
    // A byte order mark, as some editors write.
    if src.reader.fill_buf().map_err(io)?.starts_with(&[0xEF, 0xBB, 0xBF]) {
        src.reader.consume(3);
    }
    let array = match src.skip_whitespace()? {
        None => return Err(FileError::Empty),
        Some(b'[') => {
            src.reader.consume(1);
            true
        }
        Some(b'{') => false,
        Some(_) => return Err(FileError::Shape("expected a JSON array or JSON lines of objects".into())),
    };
    let mut index = 0usize;
    loop {
        let next = src.skip_whitespace()?;
        if array {
            match (next, index) {
                (None, _) => return Err(ends_early(src.line)),
                (Some(b']'), 0) => return Err(FileError::Empty),
                (Some(b']'), _) => {
                    src.reader.consume(1);
                    break;
                }
                (Some(b','), 1..) => {
                    src.reader.consume(1);
                    if src.skip_whitespace()?.is_none() {
                        return Err(ends_early(src.line));
                    }
                }
                (Some(_), 0) => {}
                (Some(b), _) => {
                    return Err(FileError::Syntax(format!(
                        "expected `,` or `]` after item {index}, found {:?} at line {}",
                        char::from(b),
                        src.line
                    )))
                }
            }
        } else if next.is_none() {
            break;
        }
        index += 1;
        let element = src.element(index, max_bytes)?;
        if f(element)?.is_break() {
            return Ok(());
        }
    }
    if index == 0 {
        return Err(FileError::Empty);
    }
    if let Some(b) = src.skip_whitespace()? {
        return Err(FileError::Syntax(format!(
            "trailing characters after the array ({:?} at line {})",
            char::from(b),
            src.line
        )));
    }
    Ok(())
}

fn io(e: std::io::Error) -> FileError {
    FileError::Syntax(format!("reading the file: {e}"))
}

fn ends_early(line: usize) -> FileError {
    FileError::Syntax(format!("it ends early (truncated?) at line {line}"))
}

/// The file, and the line it has been read to.
struct Source<R> {
    reader: R,
    line: usize,
}

impl<R: BufRead> Source<R> {
    /// Skips whitespace; the next byte (not consumed), None at the end.
    fn skip_whitespace(&mut self) -> Result<Option<u8>, FileError> {
        loop {
            let buf = self.reader.fill_buf().map_err(io)?;
            if buf.is_empty() {
                return Ok(None);
            }
            let blank = buf.iter().take_while(|b| b.is_ascii_whitespace()).count();
            self.line += buf[..blank].iter().filter(|b| **b == b'\n').count();
            if blank < buf.len() {
                let next = buf[blank];
                self.reader.consume(blank);
                return Ok(Some(next));
            }
            self.reader.consume(blank);
        }
    }

    /// The element starting here (the `index`-th).
    fn element(&mut self, index: usize, max_bytes: usize) -> Result<Element, FileError> {
        let start_line = self.line;
        let mut scan = Scan::default();
        let mut bytes = Vec::new();
        // Its first `max_bytes` (and one more, to tell it is over).
        loop {
            let buf = self.reader.fill_buf().map_err(io)?;
            if buf.is_empty() {
                return Err(ends_early(self.line));
            }
            let room = (max_bytes + 1).saturating_sub(bytes.len()).max(1);
            let (taken, done) = scan.feed(&buf[..buf.len().min(room)]);
            bytes.extend_from_slice(&buf[..taken]);
            self.line += buf[..taken].iter().filter(|b| **b == b'\n').count();
            self.reader.consume(taken);
            if bytes.len() > max_bytes {
                return self.too_large(index, start_line, scan, done, bytes);
            }
            if done {
                break;
            }
        }
        let at = |e: serde_json::Error| in_item(&e, index, start_line);
        let value = serde_json::from_slice(&bytes).map_err(at)?;
        Ok(Element::Whole { value, bytes: bytes.len() })
    }

    /// An element over the cap: read through and checked, its head kept.
    fn too_large(
        &mut self,
        index: usize,
        start_line: usize,
        scan: Scan,
        done: bool,
        first: Vec<u8>,
    ) -> Result<Element, FileError> {
        let head = Head::of(&first);
        let rest = Rest { src: self, scan, done };
        let mut de = serde_json::Deserializer::from_reader(first.as_slice().chain(rest));
        let checked = <IgnoredAny as serde::Deserialize>::deserialize(&mut de).and_then(|_| de.end());
        // A cut-short file shows as the end of the element: the bytes ran out first.
        match checked {
            Ok(()) => Ok(Element::TooLarge(head)),
            Err(e) if e.is_eof() || e.is_io() => Err(ends_early(self.line)),
            Err(e) => Err(in_item(&e, index, start_line)),
        }
    }
}

/// Where in the file a parse error of an element is.
fn in_item(e: &serde_json::Error, index: usize, start_line: usize) -> FileError {
    if e.is_eof() {
        return FileError::Syntax(format!("it ends early (truncated?) in item {index}"));
    }
    FileError::Syntax(format!("{e} of item {index} (which starts at line {start_line})"))
}

/// The rest of an element over the cap, as bytes for its check: up to its end, no further.
struct Rest<'a, R> {
    src: &'a mut Source<R>,
    scan: Scan,
    done: bool,
}

impl<R: BufRead> Read for Rest<'_, R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.done || out.is_empty() {
            return Ok(0);
        }
        let buf = self.src.reader.fill_buf()?;
        if buf.is_empty() {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the file ends in an item"));
        }
        let (taken, done) = self.scan.feed(&buf[..buf.len().min(out.len())]);
        out[..taken].copy_from_slice(&buf[..taken]);
        self.src.line += buf[..taken].iter().filter(|b| **b == b'\n').count();
        self.src.reader.consume(taken);
        self.done = done;
        Ok(taken)
    }
}

/// Finds where a JSON value ends, byte by byte: brackets outside strings, strings with
/// their escapes, and a bare number or word at its first other byte. Whether the bytes
/// are JSON is for the parser after it.
#[derive(Default)]
struct Scan {
    started: bool,
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// A bare number, `true`, `false` or `null`.
    bare: bool,
}

impl Scan {
    /// Takes bytes of the value from `buf`: how many are the value's, and whether it ended.
    fn feed(&mut self, buf: &[u8]) -> (usize, bool) {
        for (i, &b) in buf.iter().enumerate() {
            if !self.started {
                self.started = true;
                match b {
                    b'{' | b'[' => self.depth = 1,
                    b'"' => self.in_string = true,
                    _ => self.bare = true,
                }
                continue;
            }
            if self.bare {
                if !(b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.')) {
                    return (i, true);
                }
                continue;
            }
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                    if self.depth == 0 {
                        return (i + 1, true);
                    }
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return (i + 1, true);
                    }
                }
                _ => {}
            }
        }
        (buf.len(), false)
    }
}

impl Head {
    /// What `first` (an element's first bytes, cut anywhere) names.
    fn of(first: &[u8]) -> Head {
        let mut head = Head::default();
        let mut de = serde_json::Deserializer::from_slice(first);
        // It fails where the bytes are cut; what came before stays.
        let _ = serde::Deserializer::deserialize_map(&mut de, HeadVisitor(&mut head));
        head
    }

    /// A string it names under `key`.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.skeleton.get(key).and_then(Value::as_str)
    }
}

struct HeadVisitor<'a>(&'a mut Head);

impl<'de> Visitor<'de> for HeadVisitor<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<String>()? {
            if self.0.skeleton.len() >= MAX_HEAD_KEYS {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            // Stand-ins of the shapes the format is told by, kept though the value is cut.
            let stand_in = match key.as_str() {
                "mapping" => Value::Object(Map::new()),
                "conversations" | "messages" => Value::Array(Vec::new()),
                _ => Value::Null,
            };
            let labels = matches!(key.as_str(), "title" | "id" | "conversation_id" | "format");
            self.0.skeleton.insert(key.clone(), stand_in);
            if labels {
                let value = match map.next_value::<Value>()? {
                    Value::String(s) if s.len() <= MAX_HEAD_STRING => Value::String(s),
                    Value::Number(n) => Value::String(n.to_string()),
                    _ => Value::Null,
                };
                self.0.skeleton.insert(key, value);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::ControlFlow;

    /// An element read: its value, or (over the cap) its head.
    type Read = Result<Value, Map<String, Value>>;

    fn read(text: &str, max: usize) -> Result<Vec<Read>, FileError> {
        let mut out = Vec::new();
        // A small buffer: elements and strings cross its edges.
        let reader = std::io::BufReader::with_capacity(7, text.as_bytes());
        each(reader, max, |e| {
            out.push(match e {
                Element::Whole { value, .. } => Ok(value),
                Element::TooLarge(head) => Err(head.skeleton),
            });
            Ok(ControlFlow::Continue(()))
        })?;
        Ok(out)
    }

    #[test]
    fn elements_end_where_their_json_does() {
        let text = r#"[{"a": "}\"]{", "b": [1, {"c": null}]}, [], "x,]", 12.5e3 , true]"#;
        let out = read(text, 1 << 20).unwrap();
        let values: Vec<Value> = out.into_iter().map(Result::unwrap).collect();
        assert_eq!(values, serde_json::from_str::<Vec<Value>>(text).unwrap());
        let lines = "{\"a\": 1}\n{\"b\": \"\\\\\"}{\"c\": 3}\n\n";
        assert_eq!(read(lines, 1 << 20).unwrap().len(), 3);
    }

    #[test]
    fn what_is_not_json_fails_whole_wherever_it_is() {
        let cases = [
            r#"[{"a": 1}"#,
            r#"[{"a": 1},"#,
            r#"[{"a": 1}, ]"#,
            r#"[{"a": 1} {"b": 2}]"#,
            r#"[{"a": 1}] x"#,
            r#"[{"a": 1]}"#,
            r#"[{"a": tru}]"#,
            "{\"a\": 1}\n{\"b\":",
            "{\"a\": 1}\n{\"b\": 2}}",
        ];
        for text in cases {
            for max in [1 << 20, 4] {
                assert!(matches!(read(text, max), Err(FileError::Syntax(_))), "{text} ({max})");
            }
        }
        assert!(matches!(read("[]", 10), Err(FileError::Empty)));
        assert!(matches!(read(" \n", 10), Err(FileError::Empty)));
        assert!(matches!(read("\"x\"", 10), Err(FileError::Shape(_))));
        let err = read("[{\"a\": 1},\n{\"b\": 2,\n\"c\" 3}]", 1 << 20).unwrap_err();
        assert!(err.to_string().contains("item 2 (which starts at line 2)"), "{err}");
    }

    #[test]
    fn an_element_over_the_cap_is_its_head() {
        let big = "é".repeat(1000);
        let text = format!(
            r#"[{{"title": "T", "mapping": {{"n": "{big}"}}, "id": 7, "conversation_id": "c", "x": [1]}}, {{"a": 1}}]"#
        );
        let out = read(&text, 100).unwrap();
        let head = out[0].as_ref().unwrap_err();
        // Only what its first bytes hold: the title and the mapping's key, not the ids after.
        assert_eq!(Value::Object(head.clone()), serde_json::json!({"title": "T", "mapping": {}}));
        assert_eq!(out[1], Ok(serde_json::json!({"a": 1})));
        let out = read(&text, 3000).unwrap();
        assert!(out[0].is_ok());
    }
}
