//! turnlog's mock model: a deterministic OpenAI-compatible server that the tests and
//! `turnlog dev` (when no `TURNLOG_LLM_URL` is set) talk to instead of a real provider.
//!
//! # Endpoints
//! - `POST /v1/chat/completions`, streaming (`"stream": true`) or not. A stream is shaped
//!   like OpenAI's: a role chunk, `reasoning_content` deltas, `content` deltas, a chunk with
//!   `finish_reason`, a usage chunk with empty `choices` (when
//!   `stream_options.include_usage`), then `data: [DONE]`. An answer that would pass the
//!   request's `max_tokens` is cut there with `finish_reason: "length"`.
//! - `GET /v1/models`: the configured models, each with its `context_window`.
//! - `GET /mock/requests`: every request received, in order, as [`LoggedRequest`]s;
//!   `DELETE /mock/requests` clears that log.
//!
//! # Chat replies and knobs
//! A chat reply is pseudo-random words seeded by the last user message, so the same request
//! always gets the same reply. The server's [`Knobs`] (in [`MockConfig::defaults`]) are
//! overridden per request by directives in the last user message, e.g.
//! `[mock words=200 breaks=2 delay_ms=5 reasoning=3 fail_after=10 stall_after=4 no_done
//! status=503 hang]`: reply length in words, line breaks between the words instead of
//! spaces, a pause before each delta, reasoning deltas, dropping the connection after N
//! deltas, going silent after N deltas, no `[DONE]`, an HTTP error with an OpenAI-style
//! body, never answering. Directives never appear in the reply. An unknown directive, or
//! `words` above 50,000 or `reasoning` above 10,000, is answered 400; no more words or
//! reasoning steps are built than the request's `max_tokens` lets through.
//!
//! `[mock tool=NAME:ARGS steps=N]` makes the model call tools (DESIGN §14): each step
//! asks for every `tool=` given (ARGS, a JSON object, is the call's arguments text; the
//! call ids derive from the request) with `finish_reason: "tool_calls"`, until the
//! request carries N steps' worth of `tool` messages after its last user message; then it
//! answers as usual.
//!
//! A chat request's `response_format` shapes the reply (structured outputs): with
//! `json_schema`, the reply is an instance of the schema (every property, the first of
//! each `enum` / `anyOf` choice, `$ref`s into `$defs` followed, integers 42 or their
//! `minimum`, strings the reply's words); with `json_object`, `{"answer": reply}`.
//!
//! # Worker answers
//! A system message containing a marker selects what turnlog's workers need. The
//! conversation is the text of the non-system messages (`[mock ...]` directives removed);
//! a sentence ends at `.`, `!` or `?` followed by a space, or at a line end. A *name* is a
//! capitalized word that does not start its sentence (not "I"); a *number* is any digit.
//! Worker requests ignore directives in the conversation, which may quote a chat turn's,
//! and use only the server's defaults.
//! - `[turnlog:distill]` → a TurnMemory object: `{"files_changed": [paths: words with a
//!   `/` or a source-file extension], "failures": [{"what": sentence mentioning an error or
//!   failure, "why": the text after "because ", else "not stated"}], "key_findings":
//!   [sentences with a name or a number]}`; empty arrays when nothing matches.
//! - `[turnlog:memory]` → `{"memories": [{"text": sentence}]}`: the sentences of the
//!   *user* messages with a name, a number, or a month or weekday name.
//! - `[turnlog:summarize]` → plain text: every sentence with a name or a number, in order,
//!   while the summary stays within half the request's `max_tokens` (default 3,000), counted
//!   with `turnlog_core::tokens::count`; the first sentences when none qualifies (empty
//!   only when not one sentence fits).
//! - `[turnlog:title]` → the first six words of the first user message.
//!
//! # Prompt cache
//! Like a provider's, across all requests: the request's messages (role, newline, content,
//! newline, in order) are tokenized with o200k_base; `usage.prompt_tokens` is that count and
//! `usage.prompt_tokens_details.cached_tokens` is the longest prefix, at a 128-token step
//! from 1,024 on, that an earlier request shared byte for byte (0 below 1,024).

mod answers;
mod directives;
mod prompt_cache;
mod respond;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt as _;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use answers::{Task, WireMessage};
pub use directives::Knobs;
use prompt_cache::PromptCache;

/// Image data URLs make chat bodies large; a real provider takes tens of MiB.
const BODY_LIMIT: usize = 32 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MockModel {
    pub id: String,
    pub context_window: u32,
}

impl MockModel {
    pub fn new(id: impl Into<String>, context_window: u32) -> Self {
        Self { id: id.into(), context_window }
    }
}

#[derive(Clone)]
pub struct MockConfig {
    /// What `/v1/models` lists. Requests may name any model; these only set windows.
    pub models: Vec<MockModel>,
    /// Knobs for every request, before its directives.
    pub defaults: Knobs,
    /// Where the server records requests; keep a clone to read it.
    pub log: RequestLog,
    /// Faults to inject into the next chat answers; keep a clone to arm them.
    pub faults: Faults,
}

/// Chat answers still to break (dropped after three deltas), whatever the request says:
/// how a test makes a first attempt fail and its retry (the same request) succeed.
#[derive(Clone, Default)]
pub struct Faults(Arc<std::sync::atomic::AtomicUsize>);

impl Faults {
    pub fn break_next_chats(&self, n: usize) {
        self.0.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    fn take(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            // `mock-small`'s window makes a few turns overflow the budget, for compaction.
            models: vec![MockModel::new("mock", 128_000), MockModel::new("mock-small", 6_700)],
            defaults: Knobs::default(),
            log: RequestLog::default(),
            faults: Faults::default(),
        }
    }
}

/// One request as the mock received it, with what it billed for the prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoggedRequest {
    pub method: String,
    pub path: String,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// The JSON body (`null` for a GET; a string when the body was not JSON).
    pub body: Value,
    /// The body exactly as received (as text, lossily for bytes that are not UTF-8): what
    /// a test compares with the hash a turn recorded of what it sent.
    #[serde(default)]
    pub raw: String,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    /// When the request arrived, in microseconds since the Unix epoch (for latency
    /// benchmarks on the same machine).
    pub received_at_us: u64,
}

/// The server's request log, shared between the server and whoever holds a clone.
#[derive(Clone, Default)]
pub struct RequestLog(Arc<Mutex<Vec<LoggedRequest>>>);

impl RequestLog {
    pub fn entries(&self) -> Vec<LoggedRequest> {
        self.lock().clone()
    }

    /// How many requests were made to `path` (e.g. `/v1/models`).
    pub fn count(&self, path: &str) -> usize {
        self.lock().iter().filter(|r| r.path == path).count()
    }

    pub fn clear(&self) {
        self.lock().clear();
    }

    fn push(&self, request: LoggedRequest) {
        self.lock().push(request);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<LoggedRequest>> {
        // A panic while holding the lock cannot leave a Vec of plain records half-written.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Mock {
    models: Vec<MockModel>,
    defaults: Knobs,
    log: RequestLog,
    faults: Faults,
    cache: Mutex<PromptCache>,
    shutdown: CancellationToken,
}

/// Serves the mock on `listener` until `shutdown` is cancelled; hung and stalled answers
/// end then too.
pub async fn run(
    listener: TcpListener,
    config: MockConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mock = Arc::new(Mock {
        models: config.models,
        defaults: config.defaults,
        log: config.log,
        faults: config.faults,
        cache: Mutex::default(),
        shutdown: shutdown.clone(),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/mock/requests", get(list_requests).delete(clear_requests))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(mock);
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "mock model listening");
    }
    // Streamed deltas are small writes: no Nagle delay, as a real provider's edge behaves.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .context("mock model server failed")
}

/// A mock running in the background on a free loopback port, for tests; dropping it stops
/// the server.
pub struct MockHandle {
    addr: SocketAddr,
    log: RequestLog,
    faults: Faults,
    shutdown: CancellationToken,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl MockHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL a client is configured with (`http://127.0.0.1:port/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn log(&self) -> &RequestLog {
        &self.log
    }

    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Stops the server and waits for it to finish.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        match self.task.take() {
            Some(task) => task.await.context("mock model task panicked")?,
            None => Ok(()),
        }
    }
}

impl Drop for MockHandle {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub async fn spawn(config: MockConfig) -> anyhow::Result<MockHandle> {
    let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the mock model")?;
    let addr = listener.local_addr()?;
    let (log, faults) = (config.log.clone(), config.faults.clone());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(run(listener, config, shutdown.clone()));
    Ok(MockHandle { addr, log, faults, shutdown, task: Some(task) })
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default = "default_model")]
    model: String,
    messages: Vec<WireMessage>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    response_format: Option<Value>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

fn default_model() -> String {
    "mock".to_owned()
}

const CHAT_PATH: &str = "/v1/chat/completions";

async fn chat(State(mock): State<Arc<Mock>>, headers: HeaderMap, body: Bytes) -> Response {
    let received_at_us = respond::unix_us();
    let raw = String::from_utf8_lossy(&body).into_owned();
    let entry = |logged_body| LoggedRequest {
        received_at_us,
        raw: raw.clone(),
        ..logged("POST", CHAT_PATH, &headers, logged_body)
    };
    let raw: Value = match serde_json::from_slice(&body) {
        Ok(raw) => raw,
        Err(e) => {
            mock.log.push(entry(String::from_utf8_lossy(&body).into()));
            return respond::error(400, &format!("body is not JSON: {e}"));
        }
    };
    let request: ChatBody = match serde_json::from_value(raw.clone()) {
        Ok(request) => request,
        Err(e) => {
            mock.log.push(entry(raw));
            return respond::error(400, &format!("not a chat completion request: {e}"));
        }
    };
    let prompt = mock.cache.lock().unwrap_or_else(PoisonError::into_inner).observe(&request.messages);
    mock.log.push(LoggedRequest {
        prompt_tokens: prompt.prompt_tokens,
        cached_tokens: prompt.cached_tokens,
        ..entry(raw)
    });

    let task = answers::task(&request.messages);
    let knobs = if task == Task::Chat {
        match mock.defaults.clone().with_directives(&answers::last_user_text(&request.messages)) {
            Ok(knobs) if mock.faults.take() => Knobs { fail_after: Some(3), ..knobs },
            Ok(knobs) => knobs,
            Err(e) => return respond::error(400, &e),
        }
    } else {
        mock.defaults.clone()
    };
    if knobs.hang {
        mock.shutdown.cancelled().await;
        return respond::error(503, "mock server shutting down");
    }
    if let Some(status) = knobs.status {
        return respond::error(status, &format!("mock failure with HTTP {status}"));
    }

    let max_tokens = request.max_tokens.or(request.max_completion_tokens);
    let knobs = knobs.within(max_tokens);
    let text = if knobs.stamp && task == Task::Chat {
        respond::STAMP.repeat(knobs.words)
    } else {
        answers::answer_text(task, &request.messages, knobs.words, max_tokens)
    };
    let text = if task == Task::Chat && knobs.breaks > 0 {
        text.replace(' ', &"\n".repeat(knobs.breaks))
    } else {
        text
    };
    // Structured outputs: the chat reply in the format asked for.
    let formatted = request.response_format.as_ref().filter(|_| task == Task::Chat);
    let text = formatted.and_then(|f| answers::formatted(f, &text)).unwrap_or(text);
    let answer = respond::Answer::new(
        format!("chatcmpl-mock-{:016x}", answers::fnv1a(&body)),
        request.model,
        answers::reasoning_steps(knobs.reasoning),
        &text,
        max_tokens,
        prompt,
    );
    // A tool-calling model asks again until it has `steps` steps' results.
    let results = answers::tool_results_since_the_question(&request.messages);
    let answer = if task == Task::Chat && !knobs.tools.is_empty() && results < knobs.steps * knobs.tools.len()
    {
        let step = results / knobs.tools.len();
        let calls = knobs
            .tools
            .iter()
            .enumerate()
            .map(|(i, (name, args))| {
                (
                    format!("call_{:012x}_{step}_{i}", answers::fnv1a(&body) & 0xffff_ffff_ffff),
                    name.clone(),
                    args.clone(),
                )
            })
            .collect();
        answer.asking(calls)
    } else {
        answer
    };
    if request.stream {
        let include_usage = request.stream_options.is_some_and(|o| o.include_usage);
        respond::streamed(answer, knobs, include_usage, mock.shutdown.clone())
    } else {
        respond::whole(answer, knobs, mock.shutdown.clone()).await
    }
}

async fn models(State(mock): State<Arc<Mock>>, headers: HeaderMap) -> Json<Value> {
    mock.log.push(logged("GET", "/v1/models", &headers, Value::Null));
    let data: Vec<Value> = mock
        .models
        .iter()
        .map(|m| {
            json!({
                "id": m.id,
                "object": "model",
                "created": 0,
                "owned_by": "turnlog-mock",
                "context_window": m.context_window,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn list_requests(State(mock): State<Arc<Mock>>) -> Json<Vec<LoggedRequest>> {
    Json(mock.log.entries())
}

async fn clear_requests(State(mock): State<Arc<Mock>>) -> impl IntoResponse {
    mock.log.clear();
    StatusCode::NO_CONTENT
}

fn logged(method: &str, path: &str, headers: &HeaderMap, body: Value) -> LoggedRequest {
    let authorization = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_owned);
    LoggedRequest {
        method: method.to_owned(),
        path: path.to_owned(),
        authorization,
        body,
        raw: String::new(),
        prompt_tokens: 0,
        cached_tokens: 0,
        received_at_us: respond::unix_us(),
    }
}
