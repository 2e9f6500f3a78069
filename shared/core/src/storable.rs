//! What the log can store (DESIGN §2): the one check every text and payload passes before
//! it is appended — by the ingress's routes (a 400 before anything is written) and by an
//! import's check pass (the conversation is refused before its first append). The writer
//! dead-letters whatever still reaches it that the database refuses (`unstorable`), so
//! these rules are what keeps a client's mistake a 4xx rather than a dead letter.

use chrono::{DateTime, Datelike as _, Utc};
use serde_json::Value;

use crate::events::EventKind;

/// Longest message text (a user message, a memory), in bytes (UTF-8).
pub const MAX_TEXT_BYTES: usize = 256 * 1024;
/// Longest id an event carries (`attempt_id`, a permission's `id`, an import's source id),
/// in bytes: ids are indexed, and an index row holds at most about 2.7 KB.
pub const MAX_ID_BYTES: usize = 256;
/// The years a timestamp in an event may name: four-digit ones, which Postgres and every
/// client's date parser hold.
pub const YEARS: std::ops::RangeInclusive<i32> = 1..=9999;

/// Why `text` (named `field`) cannot be stored as a message's text, if it cannot: it holds
/// U+0000 (Postgres stores no NUL in text or jsonb) or is over [`MAX_TEXT_BYTES`].
pub fn text_problem(field: &str, text: &str) -> Option<String> {
    if text.contains('\0') {
        return Some(format!("{field} must not contain NUL characters"));
    }
    (text.len() > MAX_TEXT_BYTES)
        .then(|| format!("{field} is {} bytes; the limit is {MAX_TEXT_BYTES}", text.len()))
}

/// Why the `payload` of an event of `kind` cannot be stored, if it cannot: NUL anywhere, a
/// message or memory text over [`MAX_TEXT_BYTES`], an id (a top-level `id` or `…_id`, an
/// import's) over [`MAX_ID_BYTES`], a timestamp outside [`YEARS`].
pub fn payload_problem(kind: EventKind, payload: &Value) -> Option<String> {
    if has_nul(payload) {
        return Some(format!("the {kind} must not contain NUL characters"));
    }
    let fields = payload.as_object()?;
    let imported = fields.get("imported").and_then(Value::as_object);
    let ids = fields
        .iter()
        .filter(|(k, _)| *k == "id" || k.ends_with("_id"))
        .chain(imported.into_iter().flatten().filter(|(k, _)| *k == "id"));
    for (name, value) in ids {
        let Some(id) = value.as_str() else { continue };
        if id.len() > MAX_ID_BYTES {
            return Some(format!("{name} is {} bytes; an id is at most {MAX_ID_BYTES}", id.len()));
        }
    }
    if let Some(at) = imported.and_then(|i| i.get("created_at")).and_then(Value::as_str) {
        if let Some(why) = time_problem("imported.created_at", at) {
            return Some(why);
        }
    }
    let texts: Vec<&str> = match kind {
        EventKind::UserMessage => fields.get("text").and_then(Value::as_str).into_iter().collect(),
        EventKind::MemoryExtracted => fields
            .get("memories")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|m| m.get("text").and_then(Value::as_str))
            .collect(),
        _ => Vec::new(),
    };
    texts.into_iter().find_map(|t| text_problem(&format!("the {kind}'s text"), t))
}

/// Why the timestamp `at` (named `field`) cannot be stored: a year outside [`YEARS`].
pub fn time_problem(field: &str, at: &str) -> Option<String> {
    let year = at.parse::<DateTime<Utc>>().ok()?.year();
    (!YEARS.contains(&year)).then(|| {
        format!("{field} names the year {year}; timestamps must be within {}-{}", YEARS.start(), YEARS.end())
    })
}

/// Whether `v` holds U+0000 anywhere, keys included.
pub fn has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(has_nul),
        Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nul_anywhere_long_ids_far_times_and_long_texts_are_refused() {
        let ok = |kind, v: Value| assert_eq!(payload_problem(kind, &v), None, "{v}");
        let bad = |kind, v: Value, says: &str| {
            let why = payload_problem(kind, &v).unwrap_or_else(|| panic!("{v} passed"));
            assert!(why.contains(says), "{why}");
        };
        ok(
            EventKind::UserMessage,
            json!({"text": "hi", "imported": {"id": "m1", "created_at": "2023-03-01T10:00:00Z"}}),
        );
        bad(EventKind::UserMessage, json!({"text": "a\u{0}b"}), "NUL");
        bad(EventKind::UserMessage, json!({"text": "x", "meta": {"k\u{0}": 1}}), "NUL");
        bad(EventKind::UserMessage, json!({"text": "x".repeat(MAX_TEXT_BYTES + 1)}), "limit is 262144");
        ok(EventKind::UserMessage, json!({"text": "x".repeat(MAX_TEXT_BYTES)}));
        bad(
            EventKind::AssistantTurn,
            json!({"attempt_id": "a".repeat(MAX_ID_BYTES + 1)}),
            "attempt_id is 257",
        );
        ok(EventKind::AssistantTurn, json!({"attempt_id": "a".repeat(MAX_ID_BYTES)}));
        bad(EventKind::PermissionRequest, json!({"id": "p".repeat(8000)}), "id is 8000");
        bad(EventKind::UserMessage, json!({"text": "x", "imported": {"id": "i".repeat(300)}}), "id is 300");
        bad(
            EventKind::UserMessage,
            json!({"text": "x", "imported": {"id": "m", "created_at": "-20000-01-01T00:00:00Z"}}),
            "year -20000",
        );
        bad(
            EventKind::AssistantTurn,
            json!({"imported": {"id": "m", "created_at": "+10000-01-01T00:00:00Z"}}),
            "year 10000",
        );
        bad(
            EventKind::MemoryExtracted,
            json!({"turn_seq": 2, "memories": [{"id": "x", "text": "y".repeat(MAX_TEXT_BYTES + 1)}]}),
            "text is",
        );
        // An answer's text is bounded by the event's size alone.
        ok(
            EventKind::AssistantTurn,
            json!({"ui": {"blocks": [{"type": "text", "text": "x".repeat(MAX_TEXT_BYTES + 1)}]}}),
        );
    }
}
