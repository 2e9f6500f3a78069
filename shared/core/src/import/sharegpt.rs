//! ShareGPT-style conversations: `{id?, title?, conversations: [{from, value}]}` (or
//! `messages: [{role, content}]`), as a JSON array or JSON lines. One linear session each.

use serde_json::Value;

use super::chatgpt::content_id;
use super::{
    answer_payload, skip, title_from, user_payload, Conversation, PlannedEvent, PlannedSession, Rejected,
};
use crate::events::{EventKind, Imported};

const SOURCE: &str = "sharegpt";
/// Most messages one conversation may have.
const MAX_MESSAGES: usize = 100_000;

/// The `index`-th (from 1) conversation of the file as its session.
pub fn conversation(v: &Value, index: usize) -> Result<Conversation, Rejected> {
    let title = v.get("title").and_then(Value::as_str).map(str::to_owned);
    let id = match v.get("id") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => content_id(v),
    };
    let reject = |reason: String| Rejected::new(title.as_deref(), &id, reason);
    let Some(turns) = v.get("conversations").or_else(|| v.get("messages")).and_then(Value::as_array) else {
        return Err(reject(format!("item {index} has no `conversations` list")));
    };
    if turns.len() > MAX_MESSAGES {
        return Err(reject(format!("it has more than {MAX_MESSAGES} messages")));
    }
    let mut events = Vec::new();
    let (mut skipped, mut skipped_unlisted) = (Vec::new(), 0);
    for (i, turn) in turns.iter().enumerate() {
        let role = turn.get("from").or_else(|| turn.get("role")).and_then(Value::as_str).unwrap_or("");
        let text = match turn.get("value").or_else(|| turn.get("content")) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
            _ => return Err(reject(format!("message {} has no text (`value`)", i + 1))),
        };
        let imported = Imported { source: SOURCE.to_owned(), id: i.to_string(), created_at: None };
        let (kind, payload) = match role {
            "human" | "user" => (EventKind::UserMessage, user_payload(text, imported)),
            "gpt" | "assistant" | "chatgpt" | "bard" | "bing" | "model" => {
                (EventKind::AssistantTurn, answer_payload(Vec::new(), text, None, imported))
            }
            "system" => {
                let what = format!("a system message (message {})", i + 1);
                skip(&mut skipped, &mut skipped_unlisted, what, "system prompts are not imported");
                continue;
            }
            other => {
                let shown: String = other.chars().take(40).collect();
                let what = format!("a message from {shown:?} (message {})", i + 1);
                skip(&mut skipped, &mut skipped_unlisted, what, "only human and gpt messages are imported");
                continue;
            }
        };
        let seq = events.len() as i64 + 2;
        events.push(PlannedEvent { source_id: i.to_string(), seq, kind, payload, refers: None });
    }
    if events.is_empty() {
        return Err(reject("it has no human or gpt messages".into()));
    }
    let title = title.or_else(|| {
        events
            .iter()
            .find(|e| e.kind == EventKind::UserMessage)
            .and_then(|e| e.payload.value().get("text").and_then(Value::as_str).and_then(title_from))
    });
    let session = PlannedSession {
        key: "main".into(),
        title: title.clone(),
        fork: None,
        events,
        archived: false,
        metadata: None,
        deleted: false,
    };
    Ok(Conversation {
        format: super::Format::ShareGpt,
        source_id: id,
        title,
        sessions: vec![session],
        skipped,
        skipped_unlisted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn turns_become_messages_and_answers() {
        let v = json!({"conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "Olá, where is Évora?"},
            {"from": "gpt", "value": "In Alentejo."},
        ]});
        let c = conversation(&v, 1).unwrap();
        assert_eq!(c.title.as_deref(), Some("Olá, where is Évora?"));
        assert_eq!(c.source_id.len(), 32, "an id from the content");
        let s = &c.sessions[0];
        assert_eq!(
            s.events.iter().map(|e| (e.seq, e.kind)).collect::<Vec<_>>(),
            [(2, EventKind::UserMessage), (3, EventKind::AssistantTurn)]
        );
        let answer = s.events[1].payload.value();
        assert_eq!(answer["llm"]["message"]["content"], "In Alentejo.");
        assert_eq!(answer["imported"], json!({"source": "sharegpt", "id": "2"}));
        assert_eq!(c.skipped.len(), 1);
        assert_eq!(conversation(&v, 1).unwrap(), c, "the same content, the same ids");
        assert!(conversation(&json!({"conversations": [{"from": "human"}]}), 3).is_err());
        assert!(conversation(&json!({"conversations": []}), 3).is_err());
    }
}
