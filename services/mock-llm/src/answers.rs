//! What the mock says: a deterministic chat reply, or the JSON and text turnlog's workers
//! ask for (recognized by a `[turnlog:...]` marker in a system message). Everything here
//! is a pure function of the request, so the same request always gets the same answer.

use serde::Deserialize;
use serde_json::{json, Value};
use turnlog_core::tokens;

use crate::directives::strip_directives;

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct WireMessage {
    pub role: String,
    #[serde(default)]
    pub content: Value,
}

impl WireMessage {
    /// The message's text: the string, or its text parts joined by newlines.
    pub(crate) fn text(&self) -> String {
        match &self.content {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Task {
    Chat,
    Distill,
    Memory,
    Summarize,
    Title,
}

const MARKERS: [(&str, Task); 4] = [
    ("[turnlog:distill]", Task::Distill),
    ("[turnlog:memory]", Task::Memory),
    ("[turnlog:summarize]", Task::Summarize),
    ("[turnlog:title]", Task::Title),
];

pub(crate) fn task(messages: &[WireMessage]) -> Task {
    let system: Vec<String> = messages.iter().filter(|m| m.role == "system").map(WireMessage::text).collect();
    MARKERS
        .iter()
        .find(|(marker, _)| system.iter().any(|s| s.contains(marker)))
        .map_or(Task::Chat, |(_, task)| *task)
}

/// The question being answered: the last user message that is not turnlog's per-turn
/// extras (which ride after the history) nor a turn's residue note (which lands after the
/// next question when the distiller finishes after it was asked).
pub(crate) fn last_user_text(messages: &[WireMessage]) -> String {
    messages
        .iter()
        .rev()
        .filter(|m| m.role == "user")
        .map(WireMessage::text)
        .find(|t| {
            !t.starts_with(turnlog_core::request::EXTRAS_MARKER)
                && !t.starts_with(turnlog_core::llm_context::TURN_MEMORY_MARKER)
        })
        .unwrap_or_default()
}

/// How many tool results (`tool` messages) follow the last user message.
pub(crate) fn tool_results_since_the_question(messages: &[WireMessage]) -> usize {
    messages.iter().rev().take_while(|m| m.role != "user").filter(|m| m.role == "tool").count()
}

/// Summaries are bounded by half of this when a request sets no `max_tokens`.
const DEFAULT_MAX_TOKENS: u32 = 3_000;

/// The answer's text for `task`; `words` and `max_tokens` matter only to some tasks.
pub(crate) fn answer_text(
    task: Task,
    messages: &[WireMessage],
    words: usize,
    max_tokens: Option<u32>,
) -> String {
    match task {
        Task::Chat => chat_reply(&strip_directives(&last_user_text(messages)), words),
        Task::Distill => distill(&conversation(messages, |_| true)).to_string(),
        Task::Memory => memories(&conversation(messages, |role| role == "user")).to_string(),
        Task::Summarize => {
            summarize(&conversation(messages, |_| true), max_tokens.unwrap_or(DEFAULT_MAX_TOKENS) / 2)
        }
        Task::Title => title(messages),
    }
}

/// `n` reasoning steps, numbered so a test can count them.
pub(crate) fn reasoning_steps(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("Step {i}: weighing the question. ")).collect()
}

/// Non-system text of the chosen roles, directives removed.
fn conversation(messages: &[WireMessage], keep: impl Fn(&str) -> bool) -> String {
    messages
        .iter()
        .filter(|m| m.role != "system" && keep(&m.role))
        .map(|m| strip_directives(&m.text()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A chat answer in the format a request's `response_format` asks for: for `json_schema`,
/// an instance of its schema (every property, the first of each choice, strings from the
/// reply's words); for `json_object`, the reply as `{"answer": …}`; otherwise None.
pub(crate) fn formatted(format: &Value, reply: &str) -> Option<String> {
    match format.get("type").and_then(Value::as_str)? {
        "json_schema" => {
            let schema = format.pointer("/json_schema/schema").cloned().unwrap_or_else(|| json!({}));
            Some(instance(&schema, &schema, reply, 0).to_string())
        }
        "json_object" => Some(json!({"answer": reply}).to_string()),
        _ => None,
    }
}

/// A value `schema` accepts (`root` resolves `$ref`s into `$defs`/`definitions`).
fn instance(schema: &Value, root: &Value, words: &str, depth: usize) -> Value {
    if depth > 16 {
        return Value::Null;
    }
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let target = r.strip_prefix('#').and_then(|p| root.pointer(p)).unwrap_or(&Value::Null);
        return instance(target, root, words, depth + 1);
    }
    if let Some(v) = schema.get("const") {
        return v.clone();
    }
    if let Some(first) = schema.get("enum").and_then(Value::as_array).and_then(|e| e.first()) {
        return first.clone();
    }
    for choice in ["anyOf", "oneOf", "allOf"] {
        if let Some(first) = schema.get(choice).and_then(Value::as_array).and_then(|c| c.first()) {
            return instance(first, root, words, depth + 1);
        }
    }
    let kind = match schema.get("type") {
        Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).find(|k| *k != "null"),
        Some(v) => v.as_str(),
        None if schema.get("properties").is_some() => Some("object"),
        None => None,
    };
    match kind {
        Some("object") => {
            let props = schema.get("properties").and_then(Value::as_object);
            let object = props
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.clone(), instance(v, root, words, depth + 1)))
                .collect::<serde_json::Map<_, _>>();
            Value::Object(object)
        }
        Some("array") => {
            let item = schema.get("items").cloned().unwrap_or_else(|| json!({"type": "string"}));
            json!([instance(&item, root, words, depth + 1)])
        }
        Some("integer") => json!(schema.get("minimum").and_then(Value::as_i64).unwrap_or(42).max(0)),
        Some("number") => json!(schema.get("minimum").and_then(Value::as_f64).unwrap_or(4.2)),
        Some("boolean") => json!(true),
        Some("null") => Value::Null,
        _ => json!(words),
    }
}

const VOCABULARY: [&str; 40] = [
    "the", "model", "answers", "with", "a", "steady", "stream", "of", "words", "that", "mean", "little",
    "but", "arrive", "in", "order", "every", "token", "is", "counted", "and", "kept", "log", "grows", "only",
    "forward", "while", "reader", "waits", "for", "next", "line", "quiet", "river", "carries", "stones",
    "past", "old", "mill", "today",
];

/// `words` pseudo-random words seeded by the user's message, in sentences of up to eight.
fn chat_reply(user_text: &str, words: usize) -> String {
    let mut rng = SplitMix(fnv1a(user_text.as_bytes()));
    let mut out = String::new();
    for i in 0..words {
        let word = VOCABULARY[(rng.next() % VOCABULARY.len() as u64) as usize];
        let starts_sentence = i % 8 == 0;
        if i > 0 {
            out.push(' ');
        }
        if starts_sentence {
            let mut chars = word.chars();
            out.extend(chars.next().map(|c| c.to_ascii_uppercase()));
            out.push_str(chars.as_str());
        } else {
            out.push_str(word);
        }
        if i % 8 == 7 || i + 1 == words {
            out.push('.');
        }
    }
    out
}

fn distill(text: &str) -> Value {
    let sentences = sentences(text);
    let key_findings: Vec<&str> =
        unique(sentences.iter().map(String::as_str).filter(|s| has_name(s) || has_number(s)))
            .take(8)
            .collect();
    let failures: Vec<Value> = unique(sentences.iter().map(String::as_str).filter(|s| mentions_failure(s)))
        .take(8)
        .map(|s| {
            let why = s.split_once("because ").map_or("not stated", |(_, why)| why);
            json!({"what": s, "why": why.trim_end_matches(['.', '!', '?'])})
        })
        .collect();
    let files_changed: Vec<&str> =
        unique(text.split_whitespace().map(trim_word).filter(|w| is_path(w))).take(20).collect();
    json!({"files_changed": files_changed, "failures": failures, "key_findings": key_findings})
}

fn memories(user_text: &str) -> Value {
    let sentences = sentences(user_text);
    let facts: Vec<Value> =
        unique(sentences.iter().map(String::as_str).filter(|s| has_name(s) || has_number(s) || has_date(s)))
            .take(10)
            .map(|s| json!({"text": s}))
            .collect();
    json!({"memories": facts})
}

/// Every sentence with a name or a number, in order, while the summary stays within
/// `bound` tokens; the first sentences when none qualifies. Empty only when not one sentence
/// fits, which a compactor must refuse, as it would a real model's empty answer.
fn summarize(text: &str, bound: u32) -> String {
    let sentences = sentences(text);
    let mut kept: Vec<&str> =
        unique(sentences.iter().map(String::as_str).filter(|s| has_name(s) || has_number(s))).collect();
    if kept.is_empty() {
        kept = unique(sentences.iter().map(String::as_str)).collect();
    }
    let mut summary = String::new();
    for sentence in kept {
        let candidate =
            if summary.is_empty() { sentence.to_owned() } else { format!("{summary} {sentence}") };
        if tokens::count(&candidate) > bound {
            break;
        }
        summary = candidate;
    }
    summary
}

fn title(messages: &[WireMessage]) -> String {
    let first = messages.iter().find(|m| m.role == "user").map(WireMessage::text).unwrap_or_default();
    let stripped = strip_directives(&first);
    let title = stripped.split_whitespace().take(6).collect::<Vec<_>>().join(" ");
    let title = title.trim_end_matches(|c: char| c.is_ascii_punctuation()).to_owned();
    if title.is_empty() {
        "New conversation".to_owned()
    } else {
        title
    }
}

/// Sentences of `text`: lines split after `.`, `!` or `?` followed by a space.
fn sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut start = 0;
        let mut chars = line.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            let at_break =
                matches!(c, '.' | '!' | '?') && chars.peek().is_none_or(|(_, next)| next.is_whitespace());
            if at_break {
                out.push(line[start..i + c.len_utf8()].trim().to_owned());
                start = i + c.len_utf8();
            }
        }
        out.push(line[start..].trim().to_owned());
    }
    out.retain(|s| !s.is_empty());
    out
}

fn unique<'a>(items: impl Iterator<Item = &'a str>) -> impl Iterator<Item = &'a str> {
    let mut seen = std::collections::HashSet::new();
    items.filter(move |s| seen.insert(*s))
}

fn trim_word(word: &str) -> &str {
    word.trim_matches(|c: char| matches!(c, ',' | ';' | ':' | '(' | ')' | '"' | '\'' | '`' | '[' | ']'))
        .trim_end_matches(['.', '!', '?'])
}

/// A capitalized word that does not start the sentence (and is not the pronoun "I").
fn has_name(sentence: &str) -> bool {
    sentence
        .split_whitespace()
        .skip(1)
        .map(trim_word)
        .any(|w| w.chars().next().is_some_and(char::is_uppercase) && w != "I" && !w.starts_with("I'"))
}

fn has_number(sentence: &str) -> bool {
    sentence.chars().any(|c| c.is_ascii_digit())
}

const DATE_WORDS: [&str; 19] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

fn has_date(sentence: &str) -> bool {
    sentence.split_whitespace().map(trim_word).any(|w| DATE_WORDS.contains(&w))
}

fn mentions_failure(sentence: &str) -> bool {
    let lower = sentence.to_lowercase();
    ["error", "fail", "panic", "exception", "traceback"].iter().any(|w| lower.contains(w))
}

const CODE_EXTENSIONS: [&str; 20] = [
    "rs", "py", "ts", "tsx", "js", "go", "java", "c", "h", "cpp", "md", "toml", "json", "yaml", "yml", "sql",
    "sh", "html", "css", "txt",
];

/// A word that names a file: has a `/` (not a URL) or ends in a known extension.
fn is_path(word: &str) -> bool {
    if word.contains("://") || !word.chars().any(char::is_alphanumeric) {
        return false;
    }
    let has_extension =
        word.rsplit_once('.').is_some_and(|(stem, ext)| !stem.is_empty() && CODE_EXTENSIONS.contains(&ext));
    (word.contains('/') && word.len() > 1) || has_extension
}

/// FNV-1a: a hash that, unlike std's, is promised to stay the same across Rust versions.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, text: &str) -> WireMessage {
        WireMessage { role: role.into(), content: json!(text) }
    }

    #[test]
    fn chat_reply_is_deterministic_and_sized() {
        let a = chat_reply("hello", 20);
        assert_eq!(a, chat_reply("hello", 20));
        assert_ne!(a, chat_reply("hello there", 20));
        assert_eq!(a.split_whitespace().count(), 20);
        assert!(a.ends_with('.'));
    }

    #[test]
    fn a_schema_gets_an_instance_of_itself() {
        let format = json!({"type": "json_schema", "json_schema": {"name": "P", "schema": {
            "type": "object",
            "properties": {
                "city": {"type": "string"}, "days": {"type": "integer", "minimum": 3},
                "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}},
                "mood": {"enum": ["calm", "wild"]}, "note": {"anyOf": [{"type": "null"}, {"type": "string"}]},
            },
            "$defs": {"Tag": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
        }}});
        let v: Value = serde_json::from_str(&formatted(&format, "Quiet river.").unwrap()).unwrap();
        assert_eq!(
            v,
            json!({"city": "Quiet river.", "days": 3, "tags": [{"ok": true}], "mood": "calm", "note": null})
        );
        let object: Value =
            serde_json::from_str(&formatted(&json!({"type": "json_object"}), "x").unwrap()).unwrap();
        assert_eq!(object, json!({"answer": "x"}));
        assert_eq!(formatted(&json!({"type": "text"}), "x"), None);
    }

    #[test]
    fn markers_pick_the_task() {
        let sys = |t: &str| vec![msg("system", t), msg("user", "x")];
        assert_eq!(task(&sys("plain")), Task::Chat);
        assert_eq!(task(&sys("You distill. [turnlog:distill]")), Task::Distill);
        assert_eq!(task(&sys("[turnlog:memory]")), Task::Memory);
        assert_eq!(task(&sys("[turnlog:summarize]")), Task::Summarize);
        assert_eq!(task(&sys("[turnlog:title]")), Task::Title);
        assert_eq!(task(&[msg("user", "[turnlog:title]")]), Task::Chat);
    }

    #[test]
    fn distill_finds_files_failures_and_findings() {
        let v = distill(
            "I edited src/main.rs and Cargo.toml. The build failed because the linker crashed. \
             We met Alice at 9. nothing else",
        );
        assert_eq!(v["files_changed"], json!(["src/main.rs", "Cargo.toml"]));
        assert_eq!(v["failures"][0]["why"], "the linker crashed");
        assert_eq!(v["key_findings"], json!(["I edited src/main.rs and Cargo.toml.", "We met Alice at 9."]));
        assert_eq!(
            distill("just words here"),
            json!({"files_changed": [], "failures": [], "key_findings": []})
        );
    }

    #[test]
    fn memories_come_from_user_sentences_with_names_dates_or_numbers() {
        let v = memories("My sister lives in Lyon. I like tea. Monday works. I have 2 cats.");
        let texts: Vec<&str> =
            v["memories"].as_array().unwrap().iter().map(|m| m["text"].as_str().unwrap()).collect();
        assert_eq!(texts, ["My sister lives in Lyon.", "Monday works.", "I have 2 cats."]);
    }

    #[test]
    fn summary_keeps_names_and_numbers_within_the_bound() {
        let s = summarize("We chose Postgres. it was fine. The budget is 40 dollars.", 100);
        assert_eq!(s, "We chose Postgres. The budget is 40 dollars.");
        let long: String = (0..200).map(|i| format!("Item {i} goes to Bob. ")).collect();
        let s = summarize(&long, 50);
        assert!(tokens::count(&s) <= 50 && !s.is_empty());
        assert_eq!(summarize("nothing here", 10), "nothing here");
    }

    #[test]
    fn title_is_the_first_words_of_the_first_user_message() {
        let m = [
            msg("system", "[turnlog:title]"),
            msg("user", "[mock words=1] Plan a trip to Rome next spring, please!"),
        ];
        assert_eq!(title(&m), "Plan a trip to Rome next");
        assert_eq!(title(&[msg("user", "   ")]), "New conversation");
    }
}
