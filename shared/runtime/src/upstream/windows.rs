//! Models' context windows: from the gateway's `/models` listing (each server names the
//! field differently) or from `TURNLOG_MODEL_WINDOWS`, and how long a listing is trusted.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::UpstreamError;

/// How long a `/models` listing (or a failure to get one) is reused.
pub const MODELS_CACHE_TTL: Duration = Duration::from_secs(30);

/// The window fields of a `/models` entry, in the order they are trusted: OpenAI-style
/// gateways, OpenRouter, vLLM, LiteLLM.
const WINDOW_FIELDS: [&str; 4] = ["context_window", "context_length", "max_model_len", "max_input_tokens"];

/// An entry of `TURNLOG_MODEL_WINDOWS` that is not `model=tokens`, named as it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelWindowsError {
    #[error("`{0}` is not model=tokens")]
    NotAPair(String),
    #[error("`{0}` names no model")]
    NoModel(String),
    #[error("`{entry}`: `{tokens}` is not a token count")]
    NotACount { entry: String, tokens: String },
    #[error("`{0}`: a context window cannot be 0")]
    Zero(String),
}

/// Parses `TURNLOG_MODEL_WINDOWS`: `model=tokens,...`, blanks ignored.
pub fn parse_model_windows(spec: &str) -> Result<HashMap<String, u32>, ModelWindowsError> {
    let mut windows = HashMap::new();
    for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        // Split at the last `=` so a model name may itself contain one.
        let Some((model, tokens)) = entry.rsplit_once('=') else {
            return Err(ModelWindowsError::NotAPair(entry.to_owned()));
        };
        let model = model.trim();
        if model.is_empty() {
            return Err(ModelWindowsError::NoModel(entry.to_owned()));
        }
        let tokens: u32 = tokens.trim().parse().map_err(|_| ModelWindowsError::NotACount {
            entry: entry.to_owned(),
            tokens: tokens.trim().to_owned(),
        })?;
        if tokens == 0 {
            return Err(ModelWindowsError::Zero(entry.to_owned()));
        }
        windows.insert(model.to_owned(), tokens);
    }
    Ok(windows)
}

/// A `/models` body (`{"data": [{"id", ...}]}`): its entries that name an id, and the
/// windows of those that give one.
pub(super) fn parse_listing(body: &[u8]) -> Result<Listing, UpstreamError> {
    let listing: Value =
        serde_json::from_slice(body).map_err(|e| UpstreamError::Malformed(format!("models listing: {e}")))?;
    let entries = listing
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(|| UpstreamError::Malformed("models listing without `data`".into()))?;
    let windows = entries
        .iter()
        .filter_map(|entry| {
            let id = entry.get("id")?.as_str()?;
            let window =
                WINDOW_FIELDS.iter().filter_map(|field| entry.get(field)?.as_u64()).find(|w| *w > 0)?;
            Some((id.to_owned(), u32::try_from(window).unwrap_or(u32::MAX)))
        })
        .collect();
    let models = entries.iter().filter(|e| e.get("id").and_then(Value::as_str).is_some()).cloned().collect();
    Ok(Listing { windows, models })
}

/// What a `/models` listing gives: context windows, and the entries as listed.
#[derive(Debug, Default)]
pub(super) struct Listing {
    pub(super) windows: HashMap<String, u32>,
    pub(super) models: Vec<Value>,
}

/// One listing (None when it failed) and when it was taken.
pub(super) struct Snapshot {
    listing: Option<Listing>,
    taken_at: Instant,
}

impl Snapshot {
    pub(super) fn new(listing: Option<Listing>, taken_at: Instant) -> Self {
        Self { listing, taken_at }
    }

    pub(super) fn models(&self) -> Option<&[Value]> {
        self.listing.as_ref().map(|l| l.models.as_slice())
    }

    pub(super) fn is_fresh(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.taken_at) < MODELS_CACHE_TTL
    }

    pub(super) fn window(&self, model: &str) -> Option<u32> {
        self.listing.as_ref()?.windows.get(model).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_model_windows() {
        let windows = parse_model_windows(" gpt-4o=128000, mock-small = 6700 ,,").unwrap();
        assert_eq!(windows.get("gpt-4o"), Some(&128_000));
        assert_eq!(windows.get("mock-small"), Some(&6_700));
        assert_eq!(parse_model_windows("").unwrap().len(), 0);
        assert_eq!(parse_model_windows("a=b=5").unwrap().get("a=b"), Some(&5));
    }

    #[test]
    fn rejects_bad_model_windows() {
        for bad in ["gpt-4o", "=100", "m=lots", "m=0", "m=-3", "m=99999999999"] {
            assert!(parse_model_windows(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn listing_takes_the_first_window_field_each_server_uses() {
        let body = br#"{"object":"list","data":[
            {"id":"openai-like","context_window":128000},
            {"id":"openrouter","context_length":200000,"top_provider":{}},
            {"id":"vllm","max_model_len":32768},
            {"id":"litellm","max_input_tokens":8192},
            {"id":"ollama","object":"model"},
            {"id":"zero","context_window":0,"max_model_len":4096}
        ]}"#;
        let listing = parse_listing(body).unwrap();
        assert_eq!(listing.models.len(), 6);
        let windows = listing.windows;
        assert_eq!(windows.get("openai-like"), Some(&128_000));
        assert_eq!(windows.get("openrouter"), Some(&200_000));
        assert_eq!(windows.get("vllm"), Some(&32_768));
        assert_eq!(windows.get("litellm"), Some(&8_192));
        assert_eq!(windows.get("ollama"), None);
        assert_eq!(windows.get("zero"), Some(&4_096));
        assert!(parse_listing(b"<html>").is_err());
    }

    #[test]
    fn snapshot_is_trusted_for_thirty_seconds() {
        let taken = Instant::now();
        let snapshot = Snapshot::new(None, taken);
        assert!(snapshot.is_fresh(taken + Duration::from_secs(29)));
        assert!(!snapshot.is_fresh(taken + Duration::from_secs(30)));
    }
}
