//! The client for the OpenAI-compatible model gateway: streamed answers for turns, one-shot
//! completions for the workers (distillation, memory, summaries, titles), and the models'
//! context windows that size the compaction budget. Failures are values, never panics.

mod json;
mod stream;
mod windows;
mod wire;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Mutex;

use turnlog_core::message::ChatMessage;
use turnlog_core::request_body::{RequestBody, RequestParams, ResponseFormat, StreamOptions};

use crate::secret::Secret;
pub use crate::secret::{gateway_host, redacted_url};

pub use json::{ask_for_json, JsonAnswerError};
pub use stream::{
    ChatStream, StreamItem, ToolCallDelta, ToolCalls, MAX_TOOL_ARGUMENTS_BYTES, MAX_TOOL_CALLS,
};
pub use windows::{parse_model_windows, ModelWindowsError, MODELS_CACHE_TTL};
pub use wire::Usage;

/// Turns an image reference (`id`, `mime`) into a `data:` URL, or `None` when the image is
/// gone; called only while a request is built, so image bytes never sit in the log.
pub type ImageResolver = Arc<dyn Fn(&str, &str) -> Option<String> + Send + Sync>;

/// How much of a provider's error body an error keeps: enough for the message, not a page.
const ERROR_BODY_LIMIT: usize = 2_000;

/// The gateway's address and key are [`Secret`]s: a `{:?}` shows neither the key nor the
/// credentials a gateway URL can carry.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Base URL ending in `/v1` (`TURNLOG_LLM_URL`).
    pub base_url: Secret,
    pub api_key: Option<Secret>,
    /// `TURNLOG_UPSTREAM_TIMEOUT`: the longest wait for the first byte of an answer and
    /// for any later byte of a streamed one.
    pub timeout: Duration,
    /// `TURNLOG_MODEL_WINDOWS`: context windows that win over what `/models` reports.
    pub windows_override: HashMap<String, u32>,
}

/// One chat completion request, in turnlog's terms; the wire format is built from it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<u32>,
    pub reasoning_effort: Option<String>,
    pub temperature: Option<f64>,
    /// Ask for a JSON object (`response_format: {"type": "json_object"}`).
    pub response_format_json: bool,
}

impl ChatRequest {
    /// The body fields besides the model and the messages: streamed answers ask for their
    /// usage; `images` says whether image references are resolved to data URLs.
    pub fn params(&self, stream: bool, images: bool) -> RequestParams {
        RequestParams {
            stream,
            stream_options: stream.then_some(StreamOptions { include_usage: true }),
            max_tokens: self.max_tokens,
            reasoning_effort: self.reasoning_effort.clone(),
            temperature: self.temperature,
            response_format: self.response_format_json.then(ResponseFormat::json_object),
            images,
            ..RequestParams::default()
        }
    }
}

/// A whole non-streamed answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Completion {
    pub text: String,
    pub reasoning: String,
    pub usage: Option<Usage>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutPhase {
    /// Nothing arrived after the request was sent.
    FirstByte,
    /// A streamed answer went quiet between two chunks.
    Idle,
    /// A non-streamed answer was not complete in time.
    Total,
}

impl fmt::Display for TimeoutPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::FirstByte => "waiting for the first byte",
            Self::Idle => "waiting for the next chunk",
            Self::Total => "waiting for the whole answer",
        })
    }
}

/// Every way a call to the model can fail. Cloneable so a finished stream can repeat
/// its error to a caller that asks again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    /// The provider answered with a non-success status; `body` is its error body, truncated.
    #[error("upstream answered HTTP {status}: {body}")]
    Status { status: u16, body: String },
    /// The request never got an answer: bad URL, refused connection, TLS, reset.
    #[error("cannot reach upstream: {0}")]
    Connect(String),
    /// The answer stopped before `[DONE]`: the connection closed or broke mid-stream.
    #[error("upstream stream ended without [DONE]: {0}")]
    Incomplete(String),
    #[error("upstream timed out after {after:?} {phase}")]
    Timeout { phase: TimeoutPhase, after: Duration },
    /// A chunk or body that is not the JSON an OpenAI-compatible server sends.
    #[error("malformed upstream response: {0}")]
    Malformed(String),
    /// The provider reported an error inside a stream that had started fine.
    #[error("upstream reported an error mid-stream: {0}")]
    Provider(String),
}

impl UpstreamError {
    /// What a client, the log and later model requests are told: the kind of failure and
    /// the status code, never the provider's body or an address (`Display` has those, for
    /// the operator's log only).
    pub fn public_message(&self) -> String {
        match self {
            Self::Status { status, .. } => format!("the model gateway answered {status}"),
            Self::Connect(_) => "the model gateway could not be reached".into(),
            Self::Incomplete(_) => "the model gateway's answer broke off before it was complete".into(),
            Self::Timeout { phase, after } => format!("the model gateway timed out after {after:?} {phase}"),
            Self::Malformed(_) => "the model gateway sent an answer that could not be read".into(),
            Self::Provider(_) => "the model gateway reported an error mid-answer".into(),
        }
    }
}

/// The gateway's answer to a forwarded request, as it came.
pub struct Forwarded {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: futures::stream::BoxStream<'static, Result<bytes::Bytes, std::io::Error>>,
}

#[derive(Clone)]
pub struct UpstreamClient {
    http: reqwest::Client,
    config: Arc<UpstreamConfig>,
    images: Option<ImageResolver>,
    windows: Arc<Mutex<Option<windows::Snapshot>>>,
}

impl UpstreamClient {
    pub fn new(config: UpstreamConfig) -> Result<Self, UpstreamError> {
        // No reqwest timeouts: each call wraps itself in the deadline that fits it (first
        // byte, idle gap, whole answer), so a timeout always reports which one passed.
        let http = reqwest::Client::builder().build().map_err(|e| UpstreamError::Connect(error_chain(&e)))?;
        Ok(Self { http, config: Arc::new(config), images: None, windows: Arc::default() })
    }

    pub fn with_image_resolver(mut self, resolver: ImageResolver) -> Self {
        self.images = Some(resolver);
        self
    }

    pub fn config(&self) -> &UpstreamConfig {
        &self.config
    }

    /// What turns image references into data URLs while a request is built, if anything.
    pub fn image_resolver(&self) -> Option<&ImageResolver> {
        self.images.as_ref()
    }

    /// Sends a streaming request and returns once the provider has answered with a success
    /// status; the answer is then read from the returned stream.
    #[tracing::instrument(skip_all, fields(model = %request.model), err(level = "warn"))]
    pub async fn stream(&self, request: &ChatRequest) -> Result<ChatStream, UpstreamError> {
        self.stream_body(&wire::request_body(request, true, self.images.as_ref())).await
    }

    /// Sends `body`, exactly these bytes, as a streaming request (a turn builds its body
    /// itself, to record its hash); returns as [`UpstreamClient::stream`] does.
    pub async fn stream_body(&self, body: &RequestBody) -> Result<ChatStream, UpstreamError> {
        let timeout = self.config.timeout;
        let response = tokio::time::timeout(timeout, self.post(body).send())
            .await
            .map_err(|_| UpstreamError::Timeout { phase: TimeoutPhase::FirstByte, after: timeout })?
            .map_err(send_error)?;
        let response = check_status(response, timeout).await?;
        Ok(ChatStream::new(response, timeout))
    }

    /// A non-streamed answer, for workers that need the whole text at once; `deadline`
    /// bounds the call from sending to the last byte.
    #[tracing::instrument(skip_all, fields(model = %request.model), err(level = "warn"))]
    pub async fn complete(
        &self,
        request: &ChatRequest,
        deadline: Duration,
    ) -> Result<Completion, UpstreamError> {
        let body = wire::request_body(request, false, self.images.as_ref());
        let call = async {
            let response = self.post(&body).send().await.map_err(send_error)?;
            let response = check_status(response, deadline).await?;
            let bytes = response.bytes().await.map_err(|e| UpstreamError::Incomplete(error_chain(&e)))?;
            wire::parse_completion(&bytes)
        };
        tokio::time::timeout(deadline, call)
            .await
            .map_err(|_| UpstreamError::Timeout { phase: TimeoutPhase::Total, after: deadline })?
    }

    /// The model's context window: `TURNLOG_MODEL_WINDOWS` first, else what `/models` lists
    /// (fetched at most once per [`MODELS_CACHE_TTL`]). `None` when unknown or the listing
    /// failed; a turn then uses the fallback budget rather than failing.
    pub async fn context_window(&self, model: &str) -> Option<u32> {
        if let Some(window) = self.config.windows_override.get(model) {
            return Some(*window);
        }
        self.with_listing(|s| s.window(model)).await
    }

    /// The gateway's `/models` entries as it lists them (cached like the windows); None
    /// when the listing failed.
    pub async fn models(&self) -> Option<Vec<serde_json::Value>> {
        self.with_listing(|s| s.models().map(<[_]>::to_vec)).await
    }

    /// `f` of the `/models` listing, fetched at most once per [`MODELS_CACHE_TTL`].
    async fn with_listing<T>(&self, f: impl FnOnce(&windows::Snapshot) -> Option<T>) -> Option<T> {
        let mut cached = self.windows.lock().await;
        let fresh = cached.as_ref().is_some_and(|s| s.is_fresh(std::time::Instant::now()));
        if !fresh {
            // A failed listing is cached too, so a gateway without `/models` costs one
            // request per TTL rather than one per turn.
            let listing = self
                .fetch_listing()
                .await
                .inspect_err(
                    |e| tracing::warn!(error = %e, "cannot list upstream models; context windows unknown"),
                )
                .ok();
            *cached = Some(windows::Snapshot::new(listing, std::time::Instant::now()));
        }
        cached.as_ref().and_then(f)
    }

    async fn fetch_listing(&self) -> Result<windows::Listing, UpstreamError> {
        let timeout = self.config.timeout;
        let call = async {
            let mut get = self.http.get(self.url("models"));
            if let Some(key) = &self.config.api_key {
                get = get.bearer_auth(key.expose());
            }
            let response = check_status(get.send().await.map_err(send_error)?, timeout).await?;
            let bytes = response.bytes().await.map_err(|e| UpstreamError::Incomplete(error_chain(&e)))?;
            windows::parse_listing(&bytes)
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| UpstreamError::Timeout { phase: TimeoutPhase::Total, after: timeout })?
    }

    /// A client's own request body POSTed to `chat/completions` and answered as the
    /// gateway answers it — status, content type and body untouched (the stateless
    /// pass-through of DESIGN §13). Only reaching the gateway is bounded by the timeout.
    pub async fn forward(&self, body: bytes::Bytes) -> Result<Forwarded, UpstreamError> {
        let mut post = self
            .http
            .post(self.url("chat/completions"))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(key) = &self.config.api_key {
            post = post.bearer_auth(key.expose());
        }
        let response = tokio::time::timeout(self.config.timeout, post.send())
            .await
            .map_err(|_| UpstreamError::Timeout { phase: TimeoutPhase::Total, after: self.config.timeout })?
            .map_err(send_error)?;
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Ok(Forwarded {
            status: response.status().as_u16(),
            content_type,
            body: response.bytes_stream().map(|r| r.map_err(std::io::Error::other)).boxed(),
        })
    }

    /// A POST of exactly `body`'s bytes: what its hash was taken of is what is sent.
    fn post(&self, body: &RequestBody) -> reqwest::RequestBuilder {
        let mut post = self
            .http
            .post(self.url("chat/completions"))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.bytes.clone());
        if let Some(key) = &self.config.api_key {
            post = post.bearer_auth(key.expose());
        }
        post
    }

    fn url(&self, path: &str) -> String {
        format!("{}/{path}", self.config.base_url.expose().trim_end_matches('/'))
    }
}

fn send_error(e: reqwest::Error) -> UpstreamError {
    UpstreamError::Connect(error_chain(&e))
}

/// Passes a success response through; turns any other into `Status` with the start of the
/// provider's error body (read for at most `timeout`, since the body may never end).
async fn check_status(
    response: reqwest::Response,
    timeout: Duration,
) -> Result<reqwest::Response, UpstreamError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    let read = async {
        while let Some(Ok(chunk)) = chunks.next().await {
            body.extend_from_slice(&chunk);
            if body.len() >= ERROR_BODY_LIMIT {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(timeout, read).await;
    Err(UpstreamError::Status {
        status: status.as_u16(),
        body: truncate(String::from_utf8_lossy(&body).trim(), ERROR_BODY_LIMIT),
    })
}

/// `text` cut to at most `limit` bytes on a character boundary.
fn truncate(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_owned();
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// reqwest's own message is often just "error sending request"; the cause is in the chain.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_keeps_char_boundaries() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("ééé", 3), "é…");
    }

    fn config() -> UpstreamConfig {
        UpstreamConfig {
            base_url: "http://x/v1".into(),
            api_key: Some("sk-secret".into()),
            timeout: Duration::from_secs(1),
            windows_override: HashMap::new(),
        }
    }

    #[test]
    fn debug_hides_the_api_key() {
        assert!(!format!("{:?}", config()).contains("sk-secret"));
        let with_userinfo = UpstreamConfig { base_url: "https://user:pw@gw/v1".into(), ..config() };
        assert!(!format!("{with_userinfo:?}").contains("pw"));
    }

    #[test]
    fn public_messages_carry_the_status_but_no_body_or_address() {
        let body = r#"{"error":{"message":"key sk-live-123 rejected by http://10.1.2.3/internal"}}"#;
        let errors = [
            UpstreamError::Status { status: 502, body: body.into() },
            UpstreamError::Connect("error sending request for url (http://10.1.2.3/v1)".into()),
            UpstreamError::Incomplete("http://10.1.2.3 reset".into()),
            UpstreamError::Malformed(body.into()),
            UpstreamError::Provider(body.into()),
            UpstreamError::Timeout { phase: TimeoutPhase::Idle, after: Duration::from_secs(9) },
        ];
        for e in &errors {
            let public = e.public_message();
            assert!(!public.contains("10.1.2.3") && !public.contains("sk-live"), "{public}");
        }
        assert_eq!(errors[0].public_message(), "the model gateway answered 502");
    }

    #[test]
    fn calls_can_run_on_spawned_tasks() {
        fn send<T: Send>(_: &T) {}
        fn shared<T: Send + Sync + Clone>(_: &T) {}
        let client = UpstreamClient::new(config()).unwrap();
        shared(&client);
        let request = ChatRequest::default();
        send(&client.stream(&request));
        send(&client.complete(&request, Duration::from_secs(1)));
        send(&client.context_window("m"));
    }
}
