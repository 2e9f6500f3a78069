//! Input rules every route shares, in one place: size limits (every event must stay under
//! the writer's 768 KiB), text Postgres can store (no NUL), the models a client may ask
//! for, and paging limits. A value that breaks one is the client's mistake: 400 (or 413
//! for sizes), never a 5xx.

use serde_json::Value;
use turnlog_core::audit::MAX_SYSTEM_PROMPT_BYTES;
use turnlog_core::events::EventKind;
use turnlog_core::request_body::ResponseFormat;
use turnlog_core::storable;
use turnlog_runtime::bus::{json_len, MAX_EVENT_BYTES};

use crate::config::IngressConfig;
use crate::error::ApiError;
use crate::turn::TurnOptions;

/// Largest request body.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// `POST /v1/chat/completions`' body: a chat front end resends its whole conversation.
pub const MAX_CHAT_BODY_BYTES: usize = 16 * 1024 * 1024;
pub use turnlog_core::events::MAX_TITLE_CHARS;
pub use turnlog_core::storable::MAX_TEXT_BYTES;
/// Most markdown a message's documents may carry together, in bytes.
pub const MAX_DOCUMENTS_BYTES: usize = 512 * 1024;
/// Longest search query, in characters.
pub const MAX_QUERY_CHARS: usize = 512;

/// Postgres cannot store U+0000 in `text` or `jsonb`; the writer would dead-letter it.
pub fn storable(field: &str, value: &str) -> Result<(), ApiError> {
    if value.contains('\0') {
        return Err(ApiError::bad_request(format!("{field} must not contain NUL characters")));
    }
    Ok(())
}

/// A session title: not blank, at most [`MAX_TITLE_CHARS`], storable. Kept as given.
pub fn title(value: String) -> Result<String, ApiError> {
    storable("title", &value)?;
    if value.trim().is_empty() {
        return Err(ApiError::bad_request("title must not be empty; leave it out instead"));
    }
    let chars = value.chars().count();
    if chars > MAX_TITLE_CHARS {
        return Err(ApiError::bad_request(format!(
            "title is {chars} characters; the limit is {MAX_TITLE_CHARS}"
        )));
    }
    Ok(value)
}

/// A message's text: not blank, at most [`MAX_TEXT_BYTES`], storable.
pub fn text(value: &str) -> Result<(), ApiError> {
    if let Some(why) = storable::text_problem("text", value) {
        return Err(ApiError::bad_request(why));
    }
    if value.trim().is_empty() {
        return Err(ApiError::bad_request("text must not be empty"));
    }
    Ok(())
}

/// An event about to be appended: within the log's size ([`event_size`]) and storable
/// (`turnlog_core::storable`: no NUL, texts, ids and timestamps within their limits).
pub fn event(kind: EventKind, payload: &Value) -> Result<(), ApiError> {
    event_size(kind, payload)?;
    match storable::payload_problem(kind, payload) {
        Some(why) => Err(ApiError::bad_request(why)),
        None => Ok(()),
    }
}

/// A turn's own options, checked before anything of the turn is written: its system text
/// (stored with the answer's audited request) at most [`MAX_SYSTEM_PROMPT_BYTES`], and no
/// NUL in it, a stop sequence or the reasoning effort.
pub fn turn_options(options: &TurnOptions) -> Result<(), ApiError> {
    if let Some(system) = &options.system {
        storable("the system text (instructions)", system)?;
        if system.len() > MAX_SYSTEM_PROMPT_BYTES {
            return Err(ApiError::bad_request(format!(
                "the system text (instructions) is {} bytes; the limit is {MAX_SYSTEM_PROMPT_BYTES}",
                system.len()
            )));
        }
    }
    for stop in options.stop.iter().flatten() {
        storable("stop", stop)?;
    }
    if let Some(effort) = &options.reasoning_effort {
        storable("reasoning_effort", effort)?;
    }
    if let Some(format) = &options.response_format {
        response_format(format)?;
    }
    Ok(())
}

/// Longest JSON schema of a structured output, in bytes.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// A structured output's format: `text`, `json_object`, or `json_schema` with a name of
/// 1-64 of `[A-Za-z0-9_-]` and a schema (a JSON object) of at most [`MAX_SCHEMA_BYTES`].
pub fn response_format(format: &ResponseFormat) -> Result<(), ApiError> {
    match (format.kind.as_str(), &format.json_schema) {
        ("text" | "json_object", None) => Ok(()),
        ("json_schema", Some(s)) => {
            let name_ok = (1..=64).contains(&s.name.len())
                && s.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !name_ok {
                return Err(ApiError::bad_request(
                    "a json_schema format's name is 1-64 letters, digits, underscores or dashes",
                ));
            }
            if let Some(d) = &s.description {
                storable("the json_schema format's description", d)?;
            }
            let schema = s.schema.as_deref().unwrap_or("{}");
            if schema.len() > MAX_SCHEMA_BYTES {
                return Err(ApiError::bad_request(format!(
                    "a json_schema format's schema is {} bytes; the limit is {MAX_SCHEMA_BYTES}",
                    schema.len()
                )));
            }
            storable("the json_schema format's schema", schema)?;
            match serde_json::from_str::<Value>(schema) {
                Ok(Value::Object(_)) => Ok(()),
                _ => Err(ApiError::bad_request("a json_schema format's schema must be a JSON object")),
            }
        }
        ("json_schema", None) => Err(ApiError::bad_request("a json_schema format needs its schema")),
        (kind, _) => Err(ApiError::bad_request(format!(
            "response format {kind:?} is not supported; use text, json_object or json_schema"
        ))),
    }
}

/// A message's documents: their markdown together at most [`MAX_DOCUMENTS_BYTES`].
pub fn documents<'a>(markdowns: impl IntoIterator<Item = &'a str>) -> Result<(), ApiError> {
    let mut total = 0usize;
    for md in markdowns {
        storable("document markdown", md)?;
        total = total.saturating_add(md.len());
    }
    if total > MAX_DOCUMENTS_BYTES {
        return Err(ApiError::bad_request(format!(
            "documents carry {total} bytes of markdown; the limit is {MAX_DOCUMENTS_BYTES}"
        )));
    }
    Ok(())
}

/// An event as the writer will measure it: its payload as JSON, escapes included, within
/// [`MAX_EVENT_BYTES`]. The limits above can add up past it (a text of quotes or control
/// characters takes two to six times its length as JSON, documents come on top), so every
/// append is sized here before it is sent: too large is a 413 that names the largest
/// fields, never a dead letter.
pub fn event_size(kind: EventKind, payload: &Value) -> Result<(), ApiError> {
    let size = json_len(payload);
    if size <= MAX_EVENT_BYTES {
        return Ok(());
    }
    let mut fields: Vec<(&str, usize)> = match payload {
        Value::Object(map) => map.iter().map(|(name, v)| (name.as_str(), json_len(v))).collect(),
        _ => Vec::new(),
    };
    fields.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
    let largest: Vec<String> = fields.iter().take(2).map(|(name, n)| format!("{name}: {n} bytes")).collect();
    Err(ApiError::PayloadTooLarge(format!(
        "the {kind} takes {size} bytes as stored ({}); an event may take at most {MAX_EVENT_BYTES} \
         (768 KiB). Text is stored as JSON, where a quote, backslash or line break takes 2 bytes \
         and another control character 6",
        largest.join(", ")
    )))
}

/// The model a message asks for: one of `TURNLOG_ALLOWED_MODELS` when that is set.
pub fn model(config: &IngressConfig, model: &str) -> Result<(), ApiError> {
    if config.allows_model(model) {
        return Ok(());
    }
    let allowed = config.allowed_models.as_deref().unwrap_or_default().join(", ");
    Err(ApiError::bad_request(format!("model {model:?} is not allowed; the allowed models are: {allowed}")))
}

/// A search query: blank means none.
pub fn search_query(q: Option<String>) -> Result<Option<String>, ApiError> {
    let Some(q) = q.filter(|q| !q.trim().is_empty()) else { return Ok(None) };
    storable("q", &q)?;
    if q.chars().count() > MAX_QUERY_CHARS {
        return Err(ApiError::bad_request(format!("q is limited to {MAX_QUERY_CHARS} characters")));
    }
    Ok(Some(q))
}

/// A page size: `default` when absent, else within `1..=max`.
pub fn limit(value: Option<i64>, default: i64, max: i64) -> Result<i64, ApiError> {
    match value {
        None => Ok(default),
        Some(n) if (1..=max).contains(&n) => Ok(n),
        Some(n) => Err(ApiError::bad_request(format!("limit must be between 1 and {max}, not {n}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_bad_request(r: Result<impl Sized, ApiError>) -> bool {
        matches!(r, Err(ApiError::BadRequest(_)))
    }

    #[test]
    fn titles() {
        assert_eq!(title("Trip plans".into()).ok().as_deref(), Some("Trip plans"));
        assert!(is_bad_request(title("".into())));
        assert!(is_bad_request(title("  \n".into())));
        assert!(is_bad_request(title("a\0b".into())));
        assert!(title("é".repeat(MAX_TITLE_CHARS)).is_ok());
        assert!(is_bad_request(title("é".repeat(MAX_TITLE_CHARS + 1))));
    }

    #[test]
    fn texts_and_documents() {
        assert!(text("hello").is_ok());
        assert!(is_bad_request(text("")));
        assert!(is_bad_request(text(" ")));
        assert!(is_bad_request(text("nul \0 here")));
        assert!(text(&"x".repeat(MAX_TEXT_BYTES)).is_ok());
        assert!(is_bad_request(text(&"x".repeat(MAX_TEXT_BYTES + 1))));
        let half = "y".repeat(MAX_DOCUMENTS_BYTES / 2);
        assert!(documents([half.as_str(), half.as_str()]).is_ok());
        assert!(is_bad_request(documents([half.as_str(), half.as_str(), "z"])));
    }

    #[test]
    fn events_are_sized_as_stored() {
        let plain = serde_json::json!({"text": "x".repeat(MAX_EVENT_BYTES - 20)});
        assert!(event_size(EventKind::UserMessage, &plain).is_ok());
        // A third of the limit in characters, but each is six bytes as JSON.
        let escaped = serde_json::json!({"text": "\u{1}".repeat(MAX_EVENT_BYTES / 3), "category": "c"});
        let Err(ApiError::PayloadTooLarge(message)) = event_size(EventKind::UserMessage, &escaped) else {
            panic!("an escape-heavy text over the limit is a 413");
        };
        assert!(message.contains("user_message") && message.contains("text: "), "{message}");
        assert!(message.contains(&MAX_EVENT_BYTES.to_string()), "{message}");
    }

    #[test]
    fn limits_and_queries() {
        assert_eq!(limit(None, 50, 200).ok(), Some(50));
        assert_eq!(limit(Some(200), 50, 200).ok(), Some(200));
        for bad in [0, -1, 201, 1000] {
            assert!(is_bad_request(limit(Some(bad), 50, 200)), "{bad}");
        }
        assert_eq!(search_query(Some("  ".into())).ok(), Some(None));
        assert!(is_bad_request(search_query(Some("a\0".into()))));
        assert!(is_bad_request(search_query(Some("q".repeat(MAX_QUERY_CHARS + 1)))));
    }
}
