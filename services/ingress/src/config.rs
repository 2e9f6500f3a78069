//! The ingress's settings: the typed [`IngressConfig`] the binary's flags become (see
//! `turnlog`'s `cli.rs`). API tokens are secrets: they never reach a log or a `{:?}`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context as _};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;
use turnlog_core::audit::MAX_SYSTEM_PROMPT_BYTES;
use turnlog_core::budget::DEFAULT_BUDGET;
use turnlog_core::ids::Owner;
use turnlog_runtime::settings::{Backbone, Secret};
use turnlog_runtime::upstream::UpstreamConfig;

use crate::turn::TurnLimits;

/// How long a write may take through the bus and the writer before the client gets 503.
pub const DEFAULT_APPEND_TIMEOUT: Duration = Duration::from_secs(5);
/// After shutdown is asked for, how long open connections get to finish.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long a turn waits for the compactor before deciding by the model's window alone.
pub const DEFAULT_COMPACT_TIMEOUT: Duration = Duration::from_secs(30);
/// The owner every request runs as when no tokens are configured (loopback only).
pub const LOCAL_OWNER: &str = "local";
/// Turns one owner may run at once on one ingress copy.
pub const DEFAULT_MAX_TURNS_PER_OWNER: u32 = 8;
/// Turns one ingress copy runs at once, all owners together.
pub const DEFAULT_MAX_TURNS: u32 = 256;
/// The largest upload by default (`TURNLOG_FILE_MAX_BYTES`).
pub const DEFAULT_FILE_MAX_BYTES: usize = 20 * 1024 * 1024;
/// The largest import file, by default (256 MiB).
pub const DEFAULT_IMPORT_MAX_BYTES: usize = 256 * 1024 * 1024;
/// How long a deleted file's blobs stay by default (`TURNLOG_FILE_SWEEP_DELAY`).
pub const DEFAULT_FILE_SWEEP_DELAY: Duration = Duration::from_secs(3600);
/// How long converting one document may take by default (`TURNLOG_CONVERT_TIMEOUT`).
pub const DEFAULT_CONVERT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an upload's body may send nothing by default (`TURNLOG_UPLOAD_READ_TIMEOUT`).
pub const DEFAULT_UPLOAD_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// The slowest an upload's body may arrive on average by default, in bytes a second
/// (`TURNLOG_UPLOAD_MIN_RATE`): 20 MiB in under 22 minutes.
pub const DEFAULT_UPLOAD_MIN_RATE: u64 = 16 * 1024;
/// Most model calls one turn makes (DESIGN §14).
pub const DEFAULT_MAX_TOOL_STEPS: usize = 32;
/// Most bytes of a tool's output the model is sent (DESIGN §14).
pub const DEFAULT_TOOL_OUTPUT_MAX: usize = 32 * 1024;
/// Default `TURNLOG_TOOL_TIMEOUT`.
pub const DEFAULT_TOOL_TIMEOUT: Duration = Duration::from_secs(60);
/// Default `TURNLOG_PERMISSION_WAIT`.
pub const DEFAULT_PERMISSION_WAIT: Duration = Duration::from_secs(120);

/// The headers that name a session family on `POST /v1/chat/completions` by default: ours,
/// Open WebUI's chat id (sent with `ENABLE_FORWARD_USER_INFO_HEADERS=true`), and a common one.
pub const DEFAULT_COMPAT_SESSION_HEADERS: &str = "X-Session-Id,X-OpenWebUI-Chat-Id,X-Conversation-Id";

/// `TURNLOG_COMPAT_SESSION_HEADERS`: header names separated by commas, lowercased, blanks
/// ignored; `x-session-id` is always one of them.
pub fn parse_session_headers(spec: &str) -> Vec<String> {
    let mut names = vec!["x-session-id".to_owned()];
    for name in spec.split(',').map(|n| n.trim().to_ascii_lowercase()).filter(|n| !n.is_empty()) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// Everything the ingress runs with, validated.
#[derive(Debug, Clone)]
pub struct IngressConfig {
    pub backbone: Backbone,
    pub listen: SocketAddr,
    pub tokens: ApiTokens,
    /// None when no model gateway is configured (no windows from `/models`).
    pub upstream: Option<UpstreamConfig>,
    /// `TURNLOG_MODEL_WINDOWS`, also honoured without a gateway.
    pub model_windows: HashMap<String, u32>,
    pub model: String,
    /// `TURNLOG_ALLOWED_MODELS`: the models a message may name; None means any.
    pub allowed_models: Option<Vec<String>>,
    /// `TURNLOG_CATEGORY_MODELS`: the model a message's `category` picks when the message
    /// names none.
    pub category_models: HashMap<String, String>,
    pub context_budget: u32,
    pub system_prompt: String,
    /// Deadline of one write through `append_and_wait`.
    pub append_timeout: Duration,
    pub shutdown_grace: Duration,
    /// How long a turn waits for the compactor's pre-send answer.
    pub compact_timeout: Duration,
    /// The caps on concurrent turns of this copy (per owner, and in all).
    pub turn_limits: TurnLimits,
    /// `TURNLOG_COMPAT_SESSION_HEADERS`: the headers that name a session family on
    /// `POST /v1/chat/completions` (DESIGN §13), lowercase, `x-session-id` always among them.
    pub compat_session_headers: Vec<String>,
    /// `TURNLOG_FILES_URL`: the blob store of uploaded files (DESIGN §12); None turns the
    /// file routes off (503).
    pub files_url: Option<String>,
    /// `TURNLOG_FILE_MAX_BYTES`: the largest upload.
    pub file_max_bytes: usize,
    /// `TURNLOG_VISION_MODELS`: the models sent images; None means every model. Others get
    /// a short note in each image's place.
    pub vision_models: Option<Vec<String>>,
    /// How long a deleted file's blobs are kept before the sweep may remove them.
    pub file_sweep_delay: Duration,
    /// How often the sweep runs (tests shorten it).
    pub file_sweep_every: Duration,
    /// `TURNLOG_IMPORT_MAX_BYTES`: the largest file `POST /v1/import` takes.
    pub import_max_bytes: usize,
    /// The program HTML uploads are converted by, as `<program> convert-html` in a process
    /// of its own (the `turnlog` binary sets itself); None refuses HTML uploads (415).
    pub html_converter: Option<std::path::PathBuf>,
    /// `TURNLOG_CONVERT_TIMEOUT`: the longest a document's conversion (HTML, PDF) may take;
    /// its process is killed then.
    pub convert_timeout: Duration,
    /// `TURNLOG_UPLOAD_READ_TIMEOUT`: the longest an upload's body may send nothing, and
    /// the start it gets before [`IngressConfig::upload_min_rate`] applies.
    pub upload_read_timeout: Duration,
    /// `TURNLOG_UPLOAD_MIN_RATE`: the bytes a second an upload's body must average.
    pub upload_min_rate: u64,
    /// `TURNLOG_MAX_TOOL_STEPS`: the model calls one turn may make (DESIGN §14).
    pub max_tool_steps: usize,
    /// `TURNLOG_TOOL_OUTPUT_MAX`: the bytes of a tool's output the model is sent; longer
    /// is cut with a note.
    pub tool_output_max: usize,
    /// `TURNLOG_TOOL_HISTORY`: how long a turn's tool traffic stays in the model's history
    /// (DESIGN §14); the compactor must be given the same.
    pub tool_history: turnlog_core::llm_context::ToolHistory,
    /// `TURNLOG_TOOL_TIMEOUT`: the longest a server tool's call may run (DESIGN §14); the
    /// tools worker must be given the same.
    pub tool_timeout: Duration,
    /// `TURNLOG_PERMISSION_WAIT`: how long a live turn waits for a permission answer before
    /// it pauses (`requires_action`).
    pub permission_wait: Duration,
}

/// An entry of `TURNLOG_CATEGORY_MODELS` that is not `category=model` of an allowed model,
/// named as it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CategoryModelsError {
    #[error("`{0}` is not category=model")]
    NotAPair(String),
    #[error("`{0}` names no category or no model")]
    Missing(String),
    #[error("`{entry}`: {model:?} is not in TURNLOG_ALLOWED_MODELS")]
    NotAllowed { entry: String, model: String },
}

impl IngressConfig {
    /// Defaults for everything but where the log and the bus are: loopback, no tokens,
    /// no model gateway. Tests start from this and change what they need.
    pub fn new(backbone: Backbone) -> Self {
        Self {
            backbone,
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            tokens: ApiTokens::default(),
            upstream: None,
            model_windows: HashMap::new(),
            model: "mock".into(),
            allowed_models: None,
            category_models: HashMap::new(),
            context_budget: DEFAULT_BUDGET,
            system_prompt: String::new(),
            append_timeout: DEFAULT_APPEND_TIMEOUT,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            compact_timeout: DEFAULT_COMPACT_TIMEOUT,
            turn_limits: TurnLimits::default(),
            compat_session_headers: parse_session_headers(DEFAULT_COMPAT_SESSION_HEADERS),
            files_url: None,
            file_max_bytes: DEFAULT_FILE_MAX_BYTES,
            vision_models: None,
            file_sweep_delay: DEFAULT_FILE_SWEEP_DELAY,
            file_sweep_every: Duration::from_secs(600),
            import_max_bytes: DEFAULT_IMPORT_MAX_BYTES,
            html_converter: None,
            convert_timeout: DEFAULT_CONVERT_TIMEOUT,
            upload_read_timeout: DEFAULT_UPLOAD_READ_TIMEOUT,
            upload_min_rate: DEFAULT_UPLOAD_MIN_RATE,
            max_tool_steps: DEFAULT_MAX_TOOL_STEPS,
            tool_output_max: DEFAULT_TOOL_OUTPUT_MAX,
            tool_timeout: DEFAULT_TOOL_TIMEOUT,
            permission_wait: DEFAULT_PERMISSION_WAIT,
            tool_history: Default::default(),
        }
    }

    /// Whether `model` is sent images (every model when no list is configured).
    pub fn sees_images(&self, model: &str) -> bool {
        self.vision_models.as_ref().is_none_or(|models| models.iter().any(|m| m == model))
    }

    /// The model a turn of `message` goes to: the one it names, else its category's
    /// (`TURNLOG_CATEGORY_MODELS`), else `TURNLOG_MODEL`.
    pub fn model_for(&self, message: &turnlog_core::events::UserMessage) -> String {
        message
            .model_hint
            .clone()
            .or_else(|| message.category.as_ref().and_then(|c| self.category_models.get(c)).cloned())
            .unwrap_or_else(|| self.model.clone())
    }

    /// `TURNLOG_CATEGORY_MODELS` (`category=model,...`, blanks ignored), checked against
    /// the allowed models.
    pub fn parse_category_models(
        spec: &str,
        allowed: Option<&[String]>,
    ) -> Result<HashMap<String, String>, CategoryModelsError> {
        let mut models = HashMap::new();
        for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((category, model)) = entry.split_once('=') else {
                return Err(CategoryModelsError::NotAPair(entry.to_owned()));
            };
            let (category, model) = (category.trim(), model.trim());
            if category.is_empty() || model.is_empty() {
                return Err(CategoryModelsError::Missing(entry.to_owned()));
            }
            if allowed.is_some_and(|a| !a.iter().any(|m| m == model)) {
                return Err(CategoryModelsError::NotAllowed {
                    entry: entry.to_owned(),
                    model: model.to_owned(),
                });
            }
            models.insert(category.to_owned(), model.to_owned());
        }
        Ok(models)
    }

    /// Whether a message may ask for `model`: any model when no list is configured.
    pub fn allows_model(&self, model: &str) -> bool {
        self.allowed_models.as_ref().is_none_or(|allowed| allowed.iter().any(|m| m == model))
    }

    /// The system prompt rides along with the turns it was sent with (§11), so it is
    /// bounded: at most [`MAX_SYSTEM_PROMPT_BYTES`].
    pub fn check_system_prompt(&self) -> anyhow::Result<()> {
        let len = self.system_prompt.len();
        if len > MAX_SYSTEM_PROMPT_BYTES {
            bail!(
                "TURNLOG_SYSTEM_PROMPT takes {len} bytes; a system prompt may take at most \
                 {MAX_SYSTEM_PROMPT_BYTES} (32 KiB)"
            );
        }
        Ok(())
    }

    /// Without tokens anyone who can connect is the `local` owner, so only this machine may.
    pub fn check_listen(&self, addr: SocketAddr) -> anyhow::Result<()> {
        if self.tokens.is_empty() && !addr.ip().is_loopback() {
            bail!(
                "refusing to serve {addr} without TURNLOG_API_TOKENS: set tokens, or listen on a \
                 loopback address such as 127.0.0.1"
            );
        }
        Ok(())
    }
}

/// A bearer token as kept: its SHA-256, never the token, never printed. Presented tokens are
/// hashed too, so every comparison is of 32 bytes whatever the lengths, and the time taken
/// tells neither how much of a token was right nor how long the configured one is.
#[derive(Debug, Clone)]
struct TokenDigest(Secret<[u8; 32]>);

impl TokenDigest {
    fn of(token: &str) -> Self {
        Self(Secret::new(Sha256::digest(token.as_bytes()).into()))
    }

    /// Equality in constant time.
    fn matches(&self, other: &Self) -> bool {
        self.0.expose().ct_eq(other.0.expose()).into()
    }
}

/// `TURNLOG_API_TOKENS`: which owner each token stands for. Empty means local mode.
#[derive(Debug, Clone, Default)]
pub struct ApiTokens {
    entries: Vec<(Owner, TokenDigest)>,
}

impl ApiTokens {
    /// Parses `owner:token,...`. Blank entries are ignored; an owner may have several
    /// tokens, but a token may stand for one owner only.
    pub fn parse(spec: &str) -> anyhow::Result<Self> {
        let mut entries: Vec<(Owner, TokenDigest)> = Vec::new();
        for (i, entry) in spec.split(',').map(str::trim).enumerate().filter(|(_, e)| !e.is_empty()) {
            // The error names the entry's position, never its text: it holds a secret.
            let Some((owner, token)) = entry.split_once(':') else {
                bail!("entry {} is not owner:token", i + 1);
            };
            let owner = Owner::parse(owner.trim()).with_context(|| format!("entry {}", i + 1))?;
            let token = token.trim();
            if token.len() < 8 || !token.bytes().all(|b| b.is_ascii_graphic()) {
                bail!("entry {}: a token needs at least 8 printable characters without spaces", i + 1);
            }
            let digest = TokenDigest::of(token);
            if entries.iter().any(|(_, d)| d.matches(&digest)) {
                bail!("entry {}: the same token is given twice", i + 1);
            }
            entries.push((owner, digest));
        }
        Ok(Self { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The owner a presented token stands for. Every configured token's digest is compared
    /// with the presented one's, each in constant time.
    pub fn owner_of(&self, presented: &str) -> Option<&Owner> {
        let presented = TokenDigest::of(presented);
        let mut found = None;
        for (owner, digest) in &self.entries {
            if digest.matches(&presented) {
                found = Some(owner);
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use std::hint::black_box;
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_category_picks_the_model_unless_the_message_names_one() {
        let allowed = vec!["mock".to_owned(), "mock-large".to_owned()];
        let models = IngressConfig::parse_category_models(" code = mock-large ,, ", Some(&allowed)).unwrap();
        let mut config = IngressConfig::new(backbone());
        config.category_models = models;
        let message = |category: Option<&str>, model: Option<&str>| turnlog_core::events::UserMessage {
            category: category.map(Into::into),
            model_hint: model.map(Into::into),
            ..Default::default()
        };
        assert_eq!(config.model_for(&message(Some("code"), None)), "mock-large");
        assert_eq!(config.model_for(&message(Some("code"), Some("mock"))), "mock");
        assert_eq!(config.model_for(&message(Some("travel"), None)), "mock");
        assert_eq!(config.model_for(&message(None, None)), "mock");
        for bad in ["code", "=mock", "code=", "code=gpt-5"] {
            assert!(IngressConfig::parse_category_models(bad, Some(&allowed)).is_err(), "{bad}");
        }
        assert!(IngressConfig::parse_category_models("code=gpt-5", None).is_ok(), "any model without a list");
    }

    #[test]
    fn tokens_map_to_owners_and_never_print() {
        let t = ApiTokens::parse(" alice:secret-aaaa , bob:secret-bbbb,,").unwrap();
        assert_eq!(t.owner_of("secret-aaaa").map(Owner::as_str), Some("alice"));
        assert_eq!(t.owner_of("secret-bbbb").map(Owner::as_str), Some("bob"));
        assert!(t.owner_of("secret-aaa").is_none());
        assert!(t.owner_of("").is_none());
        assert!(!format!("{t:?}").contains("secret"));
    }

    /// Refusing a wrong token takes as long whether or not it has the configured token's
    /// length: a constant-time compare of the tokens themselves returns at once on unequal
    /// lengths, which tells the length. A long token makes that difference dominate.
    #[test]
    fn refusing_a_token_takes_as_long_whatever_its_length() {
        const LEN: usize = 64 * 1024;
        let tokens = ApiTokens::parse(&format!("alice:{}", "a".repeat(LEN))).unwrap();
        let (same_length, longer) = ("b".repeat(LEN), "b".repeat(LEN + 1));
        let time = |presented: &str| {
            let start = Instant::now();
            assert!(black_box(tokens.owner_of(black_box(presented))).is_none());
            start.elapsed().as_secs_f64()
        };
        // The fastest of many alternating runs: a busy machine only ever adds time.
        let (mut longer_time, mut same_time) = (f64::MAX, f64::MAX);
        for _ in 0..31 {
            longer_time = longer_time.min(time(&longer));
            same_time = same_time.min(time(&same_length));
        }
        let ratio = longer_time / same_time;
        assert!((0.5..2.0).contains(&ratio), "a longer token took {ratio:.4}× as long ({longer_time:.6} s)");
    }

    #[test]
    fn bad_token_specs_are_refused_without_echoing_them() {
        for spec in ["alice", "alice:short", "bad owner:longenough", "a:same-token,b:same-token"] {
            let err = format!("{:#}", ApiTokens::parse(spec).unwrap_err());
            assert!(!err.contains("longenough") && !err.contains("same-token"), "{err}");
        }
        assert!(ApiTokens::parse("").unwrap().is_empty());
    }

    fn backbone() -> Backbone {
        Backbone::new("", "", "turnlog")
    }

    #[test]
    fn a_system_prompt_over_32_kib_is_refused() {
        let mut c = IngressConfig::new(backbone());
        c.system_prompt = "x".repeat(MAX_SYSTEM_PROMPT_BYTES);
        assert!(c.check_system_prompt().is_ok());
        c.system_prompt.push('x');
        let err = c.check_system_prompt().unwrap_err().to_string();
        assert!(err.contains("TURNLOG_SYSTEM_PROMPT") && err.contains("32769"), "{err}");
    }

    #[test]
    fn no_tokens_means_loopback_only() {
        let mut c = IngressConfig::new(backbone());
        assert!(c.check_listen("127.0.0.1:1".parse().unwrap()).is_ok());
        assert!(c.check_listen("[::1]:1".parse().unwrap()).is_ok());
        assert!(c.check_listen("0.0.0.0:1".parse().unwrap()).is_err());
        c.tokens = ApiTokens::parse("alice:secret-aaaa").unwrap();
        assert!(c.check_listen("0.0.0.0:1".parse().unwrap()).is_ok());
    }
}
