//! A finished turn as the workers read it (question, answer, tools run), clipped for the
//! mini model, and finding the JSON object in a model's answer.

use serde_json::Value;

use crate::events::{BlockType, Event, EventBody, ToolExecution};

/// Longest piece of one part of a turn (question, answer, tool log) a worker sends the
/// mini model; longer ones keep their head and tail, where the substance usually is.
const MAX_PART_CHARS: usize = 16_000;

/// A finished turn as the workers read it: the question, the answer the user saw, and the
/// tools run on the way.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnMaterial {
    pub question: String,
    pub answer: String,
    /// One line per tool execution, in order: name, status, arguments, output.
    pub tools: Vec<String>,
}

impl TurnMaterial {
    /// From the turn's events (`turnlog_runtime::read::turn_events`); None when the turn at `turn_seq` is not among them (its
    /// session was deleted).
    pub fn from_events(events: &[Event], turn_seq: i64) -> Option<Self> {
        let turn = events.iter().find_map(|e| match &e.body {
            EventBody::AssistantTurn(t) if e.seq == turn_seq => Some(t),
            _ => None,
        })?;
        let mut material = TurnMaterial::default();
        for e in events {
            match &e.body {
                EventBody::UserMessage(m) => {
                    let mut q = m.text.clone();
                    for d in &m.documents {
                        q.push_str(&format!("\n[attached document {} ({})]", d.id, d.mime));
                    }
                    for i in &m.images {
                        q.push_str(&format!("\n[attached image {} ({})]", i.id, i.mime));
                    }
                    material.question = clip(&q);
                }
                EventBody::ToolExecution(t) => material.tools.push(tool_line(t)),
                _ => {}
            }
        }
        let mut answer = String::new();
        for block in &turn.ui.blocks {
            let text = block.text.clone().or_else(|| block.meta.as_ref().map(|m| m.to_string()));
            match (block.kind, text) {
                (BlockType::Text, Some(t)) => answer.push_str(&t),
                (BlockType::ToolCall, Some(t)) => answer.push_str(&format!("\n[tool call] {t}\n")),
                _ => {}
            }
        }
        if answer.trim().is_empty() {
            answer = turn.llm.message.content.as_ref().map(|c| c.text()).unwrap_or_default();
        }
        material.answer = clip(&answer);
        Some(material)
    }

    /// The turn as one plain-text document for the mini model.
    pub fn render(&self) -> String {
        let mut out = format!("the user asked:\n{}\n", self.question.trim());
        if !self.tools.is_empty() {
            out.push_str("\ntools run during the turn:\n");
            for t in &self.tools {
                out.push_str(&format!("- {t}\n"));
            }
        }
        out.push_str(&format!("\nthe assistant answered:\n{}\n", self.answer.trim()));
        out
    }
}

/// A tool's execution as one line (DESIGN §14: the distiller's raw material): its name and
/// status, its arguments as `key: value` pairs (a path reads as itself), and what it gave
/// back — an error's message too, which is why it failed.
fn tool_line(t: &ToolExecution) -> String {
    let mut line = format!("{} ({})", t.name, t.status);
    if let Some(args) = &t.args {
        let text = match args {
            Value::Object(fields) => fields
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) => format!("{k}: {s}"),
                    other => format!("{k}: {other}"),
                })
                .collect::<Vec<_>>()
                .join(", "),
            other => other.to_string(),
        };
        if !text.is_empty() {
            line.push_str(&format!(" with {}", clip_to(&text, 400)));
        }
    }
    if let Some(result) = t.output.as_deref().or(t.result_digest.as_deref()).filter(|r| !r.trim().is_empty())
    {
        let label = if t.is_error == Some(true) || t.status != "ok" { "error" } else { "result" };
        line.push_str(&format!(" → {label}: {}", clip_to(result.trim(), 800)));
    }
    line
}

fn clip(text: &str) -> String {
    clip_to(text, MAX_PART_CHARS)
}

/// `text` cut to about `limit` characters, keeping its head and tail.
fn clip_to(text: &str, limit: usize) -> String {
    let count = text.chars().count();
    if count <= limit {
        return text.to_owned();
    }
    let half = limit / 2;
    let head: String = text.chars().take(half).collect();
    let tail: String = text.chars().skip(count - half).collect();
    format!("{head}\n[… {} characters left out …]\n{tail}", count - 2 * half)
}

/// The JSON object in a model's answer: the whole answer, or the part between its first
/// `{` and last `}` (models like to wrap JSON in a code fence or a sentence).
pub fn json_object(text: &str) -> Option<&str> {
    let start = text.find('{')?;
    let end = text.rfind('}')?;
    (start < end).then(|| &text[start..=end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_found_inside_fences_and_prose() {
        assert_eq!(json_object("```json\n{\"a\": 1}\n```"), Some("{\"a\": 1}"));
        assert_eq!(json_object("Here: {\"a\": {\"b\": 2}} done"), Some("{\"a\": {\"b\": 2}}"));
        assert_eq!(json_object("no json"), None);
        assert_eq!(json_object("} {"), None);
    }

    #[test]
    fn a_multi_step_turn_reads_as_its_question_its_tools_in_order_and_its_answer() {
        let mut log = crate::log_builder::LogBuilder::new();
        log.user("Fix the build for Ingrid.");
        log.tool_step("", "c1", "write_file", r#"{"path":"src/main.rs","content":"fn main() {}"}"#);
        let mut written = ToolExecution {
            call_id: "c1".into(),
            name: "write_file".into(),
            args: Some(serde_json::json!({"path": "src/main.rs", "content": "fn main() {}"})),
            output: Some("wrote 12 bytes".into()),
            status: "ok".into(),
            ..Default::default()
        };
        log.push(EventBody::ToolExecution(written.clone()));
        written.name = "run_tests".into();
        written.args = Some(serde_json::json!({}));
        written.output = Some("cargo test failed because the linker ran out of memory\n(exit 101)".into());
        written.is_error = Some(true);
        written.status = "error".into();
        log.push(EventBody::ToolExecution(written));
        let answer = log.assistant("The build works again.");
        let m = TurnMaterial::from_events(&log.events, answer).unwrap();
        assert_eq!(
            m.tools,
            [
                "write_file (ok) with content: fn main() {}, path: src/main.rs → result: wrote 12 bytes",
                "run_tests (error) → error: cargo test failed because the linker ran out of memory\n(exit 101)",
            ]
        );
        assert_eq!(m.question, "Fix the build for Ingrid.");
        assert_eq!(m.answer, "The build works again.");
        assert!(m.render().contains("tools run during the turn:\n- write_file (ok)"));
    }

    #[test]
    fn long_parts_keep_head_and_tail() {
        let text = format!("{}{}", "a".repeat(50), "b".repeat(50));
        let clipped = clip_to(&text, 20);
        assert!(clipped.starts_with("aaaaaaaaaa\n") && clipped.ends_with("\nbbbbbbbbbb"), "{clipped}");
        assert!(clipped.contains("80 characters left out"));
        assert_eq!(clip_to("short", 20), "short");
    }
}
