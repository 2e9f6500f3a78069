//! The summary call: what the summarizer is told and shown, and which answers are refused
//! (empty or truncated ones are never stored).

use turnlog_core::compaction::CompactionPlan;
use turnlog_core::llm_context::{Source, SUMMARY_MARKER};
use turnlog_core::message::{ChatMessage, Content, ContentPart, Role};
use turnlog_runtime::upstream::{ChatRequest, Completion};

/// Selects the summary task (the mock model keys on it; a real model ignores it).
pub const SUMMARY_MARKER_TASK: &str = "[turnlog:summarize]";

const SUMMARY_PROMPT: &str = "[turnlog:summarize] You write the summary that replaces the earlier part of \
a conversation between a user and an assistant; the assistant will see only your summary of it from now on. \
Keep every name, date, number, commitment, decision and open question, exactly as stated. Fold any earlier \
summary in, losing none of its facts. Write compact plain prose in the conversation's language, with no \
preamble and no commentary.";

/// The most output a summary may take: 3,000 tokens, or a quarter of the budget when that
/// is less, so the summary leaves room for the conversation that follows it.
pub fn max_summary_tokens(budget: u32) -> u32 {
    (budget / 4).clamp(1, 3_000)
}

pub(crate) fn request(model: &str, plan: &CompactionPlan, budget: u32) -> ChatRequest {
    ChatRequest {
        model: model.to_owned(),
        messages: vec![
            ChatMessage::text(Role::System, SUMMARY_PROMPT),
            ChatMessage::text(Role::User, transcript(plan)),
        ],
        max_tokens: Some(max_summary_tokens(budget)),
        // Reasoning models otherwise spend the whole output cap thinking and answer empty.
        reasoning_effort: Some("low".to_owned()),
        ..ChatRequest::default()
    }
}

/// The span as one document: a real model asked to summarize a transcript summarizes it,
/// where the same messages sent as a conversation would be continued.
fn transcript(plan: &CompactionPlan) -> String {
    let mut out = String::from("the conversation so far, to summarize:\n");
    for m in &plan.span {
        let text = shown(&m.message);
        let (label, text) = match m.source {
            Source::Summary => {
                ("earlier summary", text.strip_prefix(SUMMARY_MARKER).unwrap_or(&text).trim().to_owned())
            }
            Source::User => ("user", text),
            // A step's tool calls as one line each (name only), never their arguments.
            Source::Assistant => {
                let calls = m.message.tool_calls.iter().map(|c| format!("\n[called the tool {}]", c.name));
                ("assistant", text + &calls.collect::<String>())
            }
            Source::LivePending => ("assistant (cut off)", text),
            Source::TurnMemory | Source::TurnFailed => ("note", text),
            // Never a raw output: a note of which tool answered, and how.
            Source::Tool => {
                let note = match plan.tool_results.iter().find(|(seq, _, _)| *seq == m.seq) {
                    Some((_, name, status)) => format!("[the tool {name} answered: {status}]"),
                    None => "[a tool's result came back here]".to_owned(),
                };
                ("note", note)
            }
        };
        out.push_str(&format!("\n[{label}]\n{}\n", text.trim()));
    }
    out
}

/// A message as the summarizer reads it: its text, and a short note where an image was
/// attached (never its id or bytes), so a summary can keep that a picture was shared.
fn shown(message: &ChatMessage) -> String {
    match &message.content {
        Content::Text(t) => t.clone(),
        Content::Parts(parts) => parts
            .iter()
            .map(|p| match p {
                ContentPart::Text { text } => text.clone(),
                ContentPart::ImageRef { mime, .. } => format!("[an image ({mime}) was attached here]"),
            })
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

/// Why a summary cannot be stored, or None when it can.
pub(crate) fn refusal(completion: &Completion) -> Option<&'static str> {
    if completion.finish_reason.as_deref() == Some("length") {
        Some("truncated at the output cap")
    } else if completion.text.trim().is_empty() {
        Some("empty")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnlog_core::llm_context::ProjectedMessage;

    #[test]
    fn output_cap_is_a_quarter_of_the_budget_up_to_3000() {
        assert_eq!(max_summary_tokens(4_000), 1_000);
        assert_eq!(max_summary_tokens(76_800), 3_000);
        assert_eq!(max_summary_tokens(2), 1);
    }

    #[test]
    fn empty_and_truncated_summaries_are_refused() {
        let ok = Completion {
            text: "Alice owes Bob 5 euros.".into(),
            finish_reason: Some("stop".into()),
            ..Default::default()
        };
        assert_eq!(refusal(&ok), None);
        assert!(refusal(&Completion { text: "  \n".into(), ..ok.clone() }).is_some());
        assert!(refusal(&Completion { finish_reason: Some("length".into()), ..ok }).is_some());
    }

    #[test]
    fn transcript_labels_each_message_and_unwraps_the_old_summary() {
        let plan = CompactionPlan {
            through_seq: 5,
            span: vec![
                ProjectedMessage {
                    seq: 2,
                    source: Source::Summary,
                    message: ChatMessage::text(Role::User, format!("{SUMMARY_MARKER}\nAlice is 30.")),
                },
                ProjectedMessage {
                    seq: 4,
                    source: Source::User,
                    message: ChatMessage::text(Role::User, "hi"),
                },
                ProjectedMessage {
                    seq: 5,
                    source: Source::Assistant,
                    message: ChatMessage {
                        tool_calls: vec![turnlog_core::events::ToolCall {
                            id: "c1".into(),
                            name: "read".into(),
                            arguments: r#"{"path":"secret.txt"}"#.into(),
                        }],
                        ..ChatMessage::text(Role::Assistant, "hello")
                    },
                },
                ProjectedMessage {
                    seq: 6,
                    source: Source::Tool,
                    message: ChatMessage {
                        tool_call_id: Some("c1".into()),
                        ..ChatMessage::text(Role::Tool, "the raw output")
                    },
                },
            ],
            turn_seqs: vec![5],
            expect_compacted_through: Some(2),
            tool_results: vec![(6, "read".into(), "error".into())],
        };
        let text = transcript(&plan);
        // A step's calls and results as one-line notes (name, status), never their
        // arguments or outputs.
        assert!(
            text.contains("[called the tool read]") && text.contains("[the tool read answered: error]"),
            "{text}"
        );
        assert!(!text.contains("secret.txt") && !text.contains("the raw output"), "{text}");
        assert!(text.contains("[earlier summary]\nAlice is 30.\n"), "{text}");
        assert!(!text.contains("image"));
        assert!(!text.contains(SUMMARY_MARKER));
        assert!(text.contains("[user]\nhi\n") && text.contains("[assistant]\nhello\n"));
        let req = request("m", &plan, 4_000);
        assert_eq!(req.max_tokens, Some(1_000));
        assert_eq!(req.reasoning_effort.as_deref(), Some("low"));
        assert!(req.messages[0].texts().any(|t| t.contains(SUMMARY_MARKER_TASK)));
    }

    #[test]
    fn an_attached_image_is_a_note_in_the_summary_input_never_its_id() {
        let with_image = ChatMessage::new(
            Role::User,
            Content::Parts(vec![
                ContentPart::Text { text: "what is on this receipt?".into() },
                ContentPart::ImageRef {
                    id: "file-7f3a".into(),
                    mime: "image/png".into(),
                    width: None,
                    height: None,
                },
            ]),
        );
        let plan = CompactionPlan {
            through_seq: 3,
            span: vec![ProjectedMessage { seq: 2, source: Source::User, message: with_image }],
            turn_seqs: vec![],
            expect_compacted_through: None,
            tool_results: vec![],
        };
        let text = transcript(&plan);
        assert!(
            text.contains("[user]\nwhat is on this receipt?\n[an image (image/png) was attached here]\n"),
            "{text}"
        );
        assert!(!text.contains("file-7f3a"));
    }
}
