//! The size limits of what the bus carries and the log keeps (DESIGN §6): an event's
//! serialized size and a session's metadata. Pure rules, so the writer, a rebuild and every
//! producer apply the same ones; `turnlog_runtime::bus` re-exports them.

use serde::Serialize;
use serde_json::Value;

/// The writer refuses an event whose serialized payload is larger (a constant, not a
/// setting, so a rebuild applies the same rule). Producers measure with [`json_len`].
pub const MAX_EVENT_BYTES: usize = 768 * 1024;

/// Most metadata pairs a session keeps, and the longest key and value (OpenAI's limits).
pub const MAX_METADATA_PAIRS: usize = 16;
pub const MAX_METADATA_KEY: usize = 64;
pub const MAX_METADATA_VALUE: usize = 512;

/// Why `metadata` cannot be a session's metadata, if it cannot: an object of at most 16
/// string pairs, keys up to 64 characters, values up to 512, no NUL characters.
pub fn metadata_error(metadata: &Value) -> Option<String> {
    let Some(pairs) = metadata.as_object() else { return Some("metadata must be an object".into()) };
    if pairs.len() > MAX_METADATA_PAIRS {
        return Some(format!("metadata holds at most {MAX_METADATA_PAIRS} pairs"));
    }
    for (key, value) in pairs {
        // No message names a key: a client's key can be as long as its body.
        let Some(value) = value.as_str() else { return Some("metadata values must be strings".into()) };
        if key.chars().count() > MAX_METADATA_KEY || value.chars().count() > MAX_METADATA_VALUE {
            return Some(format!(
                "metadata keys take at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}"
            ));
        }
        if key.contains('\0') || value.contains('\0') {
            return Some("metadata must not contain NUL characters".into());
        }
    }
    None
}

/// The length of `value` serialized as JSON, escapes included (a quote or a line break
/// takes two bytes, another control character six), without building the text.
pub fn json_len(value: &(impl Serialize + ?Sized)) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Only a failing `Serialize` impl errs (never for JSON values and strings): too large.
    match serde_json::to_writer(&mut counter, value) {
        Ok(()) => counter.0,
        Err(_) => usize::MAX,
    }
}

/// `output` within `max` bytes (`TURNLOG_TOOL_OUTPUT_MAX`): cut at a character boundary,
/// then a line saying how many bytes were left out.
pub fn capped_output(output: &str, max: usize) -> String {
    if output.len() <= max {
        return output.to_owned();
    }
    let mut cut = max;
    while !output.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}\n[output cut: {} of {} bytes left out]", &output[..cut], output.len() - cut, output.len())
}

/// A tool output's one-line summary for the UI: its first line, at most 120 characters.
pub fn output_digest(output: &str) -> Option<String> {
    output.lines().next().map(|l| l.chars().take(120).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_len_counts_escapes() {
        for text in ["plain", "\"quoted\" \\ line\n", "\u{1}\u{1b}[0m", "é ✓"] {
            assert_eq!(json_len(text), serde_json::to_vec(text).unwrap().len(), "{text:?}");
        }
        assert_eq!(json_len("\u{1}"), 8, "a control character is six bytes, plus the quotes");
        let payload = serde_json::json!({"partial": "\"".repeat(1000), "n": [1, 2.5, null]});
        assert_eq!(json_len(&payload), serde_json::to_vec(&payload).unwrap().len());
        assert!(json_len(&payload) > 2000);
    }

    #[test]
    fn a_long_output_is_cut_at_a_character_boundary_with_a_note() {
        const MAX: usize = 1001;
        assert_eq!(capped_output("short", MAX), "short");
        let long = "é".repeat(MAX);
        let cut = capped_output(&long, MAX);
        let (kept, note) = cut.split_once("\n[output cut: ").unwrap();
        assert!(kept.len() <= MAX && kept.len() >= MAX - 1 && kept.chars().all(|c| c == 'é'));
        assert_eq!(note, format!("{} of {} bytes left out]", long.len() - kept.len(), long.len()));
    }
}
