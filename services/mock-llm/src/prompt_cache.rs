//! A provider-style prompt cache: it remembers token prefixes of every request it has seen
//! and reports how much of a new request's prefix is cached, in 128-token steps from 1,024
//! on, so tests can check that turnlog keeps the history a byte-stable prefix.

use std::collections::HashSet;

use turnlog_core::tokens;

use crate::answers::{fnv1a, WireMessage};

/// Shorter prefixes are never cached, as with OpenAI.
pub(crate) const MIN_CACHED: usize = 1_024;
/// Cached prefixes grow in steps of this many tokens.
pub(crate) const STEP: usize = 128;

#[derive(Default)]
pub(crate) struct PromptCache {
    /// Hashes of the token prefixes seen, one per step boundary.
    seen: HashSet<u64>,
}

/// What the mock bills a request: its prompt tokens and how many of them were cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PromptUsage {
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
}

impl PromptCache {
    /// Looks the request's prefixes up, then remembers them for later requests.
    pub(crate) fn observe(&mut self, messages: &[WireMessage]) -> PromptUsage {
        let tokens = tokens::encode(&canonical(messages));
        let mut hash = 0xcbf2_9ce4_8422_2325_u64;
        let mut boundaries = Vec::new();
        for (i, token) in tokens.iter().enumerate() {
            hash = token
                .to_le_bytes()
                .iter()
                .fold(hash, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
            let len = i + 1;
            if len >= MIN_CACHED && (len - MIN_CACHED).is_multiple_of(STEP) {
                boundaries.push((len, hash));
            }
        }
        let cached =
            boundaries.iter().rev().find(|(_, hash)| self.seen.contains(hash)).map_or(0, |(len, _)| *len);
        self.seen.extend(boundaries.iter().map(|(_, hash)| *hash));
        PromptUsage { prompt_tokens: to_u32(tokens.len()), cached_tokens: to_u32(cached) }
    }
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The request as the cache compares it: each message's role and content, in order. An
/// image counts by a hash of its URL, so a changed image breaks the prefix there.
fn canonical(messages: &[WireMessage]) -> String {
    let mut text = String::new();
    for message in messages {
        text.push_str(&message.role);
        text.push('\n');
        match &message.content {
            serde_json::Value::Array(parts) => {
                for part in parts {
                    if let Some(t) = part.get("text").and_then(serde_json::Value::as_str) {
                        text.push_str(t);
                    } else {
                        text.push_str(&format!("[part {:016x}]", fnv1a(part.to_string().as_bytes())));
                    }
                }
            }
            _ => text.push_str(&message.text()),
        }
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn user(text: &str) -> WireMessage {
        WireMessage { role: "user".into(), content: json!(text) }
    }

    #[test]
    fn caches_the_longest_seen_prefix_in_steps() {
        let mut cache = PromptCache::default();
        let long: String = (0..1500).map(|i| format!(" w{i}")).collect();
        let first = cache.observe(&[user(&long)]);
        assert_eq!(first.cached_tokens, 0);
        assert!(first.prompt_tokens > 1_400);

        let second = cache.observe(&[user(&long), user("and more")]);
        assert!(second.cached_tokens >= 1_024);
        assert_eq!((second.cached_tokens as usize - MIN_CACHED) % STEP, 0);
        assert!(second.cached_tokens <= first.prompt_tokens);

        let mut short = PromptCache::default();
        short.observe(&[user("tiny")]);
        assert_eq!(short.observe(&[user("tiny")]).cached_tokens, 0);
    }
}
