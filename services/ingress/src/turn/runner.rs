//! Running one turn (DESIGN.md §5): with the lease held and the user message durable, ask
//! the compactor, build the request from the log, stream the answer while checkpointing
//! it every 2 s, and end with exactly one outcome event and exactly one `end`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument as _;
use turnlog_core::audit::{
    system_prompt_record, tools_record, turn_body_with, RecordedRequest, MAX_SYSTEM_PROMPT_BYTES,
};
use turnlog_core::budget::{budget_for, history_tokens_with, request_size};
use turnlog_core::events::*;
use turnlog_core::ids::{AttemptId, Owner, SessionId};
use turnlog_core::request::{reserve_tokens, Extras};
use turnlog_core::request_body::{RequestBody, RequestParams, ResolveImage, ResponseFormat, StreamOptions};
use turnlog_core::stream::{
    FailureCode, Meta, OutcomeEvent, Required, StreamError, Text, ToolCallEvent, ToolResultEvent, TurnEnd,
    TurnEvent, TurnStatus, STOPPED_BEFORE_TEXT,
};
use turnlog_runtime::bus::{
    append_and_wait, json_len, AppendError, AppendRequest, CompactReply, CompactRequest, CompactStatus,
    Outcome, MAX_EVENT_BYTES,
};
use turnlog_runtime::lease::Lease;
use turnlog_runtime::read;
use turnlog_runtime::upstream::{StreamItem, ToolCalls, UpstreamError};
use uuid::Uuid;

use super::{remote, ActiveTurn, TurnSlot};
use crate::Ingress;

/// The whole partial is checkpointed this often while an answer streams.
pub(super) const CHECKPOINT_EVERY: Duration = Duration::from_secs(2);
/// The lease is renewed this often (it expires after ~10 s).
const LEASE_RENEW_EVERY: Duration = Duration::from_secs(3);
/// Deadline of each durability write at the end of a turn (its own, not the request's).
const PERSIST_TIMEOUT: Duration = Duration::from_secs(15);
/// An answer's output cap: its text and reasoning should fit one event under the writer's
/// 768 KiB limit, with room for the UI blocks that repeat them.
const MAX_ANSWER_TOKENS: u32 = 32_000;
const MAX_ANSWER_BYTES: usize = 300 * 1024;
/// Most the answer's text may take as stored JSON, so that its `pending_state` (the text,
/// a few short fields and the attempt's recorded request, whose size is taken off this)
/// always fits the log, however much the text escapes. The `assistant_turn` holds the text
/// twice: when that does not fit, the pending is kept.
const MAX_PARTIAL_JSON_BYTES: usize = MAX_EVENT_BYTES - 4 * 1024;
/// How many recalled memories ride along with a turn.
const RECALLED_MEMORIES: i64 = 5;

/// What a turn starts from: the lease is held, the user message is durable, and the turn
/// has its slot under the caps (given back at its end, or whenever the task goes).
pub struct TurnStart {
    pub session: SessionId,
    pub owner: Owner,
    pub user_seq: i64,
    pub user_text: String,
    pub model: String,
    pub lease: Lease,
    pub slot: TurnSlot,
    pub options: TurnOptions,
    /// A continued turn's results just recorded (DESIGN §14): its stream tells them after
    /// its `meta`, before the next step.
    pub results: Vec<ToolResultEvent>,
    /// A continued turn: its last step's server calls are seen to (run, asked about) before
    /// the next step (DESIGN §14).
    pub continued: bool,
    /// The live tail as read before the user message, when it was: the request's is this
    /// and the events committed since.
    pub tail: Option<read::LiveTail>,
}

/// What a client may set for one turn's request (the OpenAI-compatible routes): recorded
/// with the request (§11), so an audit rebuilds it.
#[derive(Debug, Clone, Default)]
pub struct TurnOptions {
    /// The system prompt of this request instead of the configured one.
    pub system: Option<String>,
    /// An output cap below the ingress's own.
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Vec<String>>,
    pub reasoning_effort: Option<String>,
    /// Structured outputs: the format the answer must take.
    pub response_format: Option<ResponseFormat>,
    /// The client's function tools (DESIGN §14).
    pub tools: Option<ToolOffer>,
    /// The turn's extras when a later step runs: its first step's, so each step's request
    /// extends the previous one's (DESIGN §14). None: computed now.
    pub extras: Option<Extras>,
    /// The servers whose tools the turn's first step offers (DESIGN §14).
    pub server_tools: ServerTools,
    /// How long the turn waits for a permission answer before it pauses; None: the
    /// configured `TURNLOG_PERMISSION_WAIT` (a Responses turn pauses at once, §14).
    pub permission_wait: Option<std::time::Duration>,
}

/// Which servers' tools a turn offers beside the client's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ServerTools {
    /// Every server that serves the owner (native and Chat Completions turns).
    #[default]
    All,
    /// Those named (a Responses request's `mcp` tools), each with the tools it allows
    /// (None: all); none when empty (and for a later step, which offers what the first did).
    Named(Vec<NamedServer>),
}

/// A server a request names, and the tools of it the request allows (None: all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedServer {
    pub label: String,
    pub allowed_tools: Option<Vec<String>>,
}

impl TurnOptions {
    /// The options a turn's next step runs with: those its last step recorded (§11), so
    /// the next request extends that one — its system text, sampling, tools and extras.
    pub fn of_recorded(r: &RecordedRequest) -> Self {
        let p = &r.params;
        Self {
            system: r.system.text.clone(),
            max_tokens: p.max_tokens,
            temperature: p.temperature,
            top_p: p.top_p,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            seed: p.seed,
            stop: p.stop.clone(),
            reasoning_effort: p.reasoning_effort.clone(),
            response_format: p.response_format.clone(),
            tools: ToolOffer::recorded(p),
            extras: Some(r.extras.clone()),
            server_tools: ServerTools::Named(Vec::new()),
            permission_wait: None,
        }
    }
}

/// The tools a turn offers the model: Chat Completions' `tools` array as JSON text (the
/// client's, checked), `tool_choice` as JSON text, and `parallel_tool_calls`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolOffer {
    pub tools: String,
    pub tool_choice: Option<String>,
    pub parallel_tool_calls: Option<bool>,
}

impl ToolOffer {
    /// The offer a step's recorded request made: what the turn's next step offers again.
    pub fn recorded(params: &RequestParams) -> Option<Self> {
        Some(Self {
            tools: params.tools.clone()?,
            tool_choice: params.tool_choice.clone(),
            parallel_tool_calls: params.parallel_tool_calls,
        })
    }
}

/// Starts the turn's task and registers it; the returned handle is what clients follow.
pub fn start_turn(app: &Arc<Ingress>, start: TurnStart) -> Arc<ActiveTurn> {
    let turn = ActiveTurn::new(start.session, AttemptId::new());
    app.turns.insert(Arc::clone(&turn));
    app.metrics.turns_active(app.turns.active());
    let turn_tasks = app.turns.tasks.clone();
    let (app, t) = (Arc::clone(app), Arc::clone(&turn));
    // The turn's span is a child of the request that started it: one trace from the HTTP
    // request through the writer to the workers.
    let task = async move {
        let serving = remote::serve(&app, &t).await;
        run(&app, &t, start).await;
        if let Some(s) = serving {
            s.abort();
        }
        app.turns.remove(&t);
        app.metrics.turns_active(app.turns.active());
    };
    turn_tasks.spawn(task.instrument(tracing::Span::current()));
    turn
}

/// What a turn stores and tells its client: the stream's `error` if any, the outcome event,
/// the `end` status, and how the `end` names the event's seq.
type StoredOutcome = (Option<StreamError>, EventBody, TurnStatus, fn(i64) -> OutcomeEvent);

/// The longest prefix of `delta`, in whole characters, that takes at most `room` bytes and
/// at most `json_room` bytes as stored JSON; with its JSON length (without quotes).
fn fitting(delta: &str, room: usize, json_room: usize) -> (&str, usize) {
    let (mut json, mut buf) = (0usize, [0u8; 4]);
    for (i, c) in delta.char_indices() {
        let c_json = json_len(c.encode_utf8(&mut buf) as &str) - 2;
        if i + c.len_utf8() > room || json + c_json > json_room {
            return (&delta[..i], json);
        }
        json += c_json;
    }
    (delta, json)
}

/// Most an answer's text may take as stored JSON: [`MAX_PARTIAL_JSON_BYTES`] less what the
/// attempt's recorded request takes beside it in the same `pending_state`.
fn partial_json_cap(request: Option<&RecordedRequest>) -> usize {
    let request = request.map_or(0, |r| json_len(r) + json_len("request") + 2);
    MAX_PARTIAL_JSON_BYTES.saturating_sub(request)
}

/// How the answer stream ended.
enum Ending {
    Done { finish_reason: Option<String> },
    Stopped(PendingReason),
    Failed { code: FailureCode, message: String },
}

#[tracing::instrument(skip_all, fields(session_id = %start.session, attempt_id))]
async fn run(app: &Arc<Ingress>, turn: &Arc<ActiveTurn>, mut start: TurnStart) {
    let started = Instant::now();
    let tail = start.tail.take();
    let attempt_id = turn.attempt_id.clone();
    tracing::Span::current().record("attempt_id", attempt_id.as_str());
    let mut t = Turn {
        app,
        turn,
        start: &start,
        attempt_id,
        text: String::new(),
        text_json: 0,
        reasoning: String::new(),
        usage: None,
        request: None,
        request_checkpointed: false,
        tool_calls: ToolCalls::default(),
        steps_before: 0,
        options: start.options.clone(),
        server_names: Default::default(),
        tail,
    };
    let meta = Meta {
        session_id: Some(start.session),
        user_seq: Some(start.user_seq),
        attempt_id: Some(t.attempt_id.clone()),
        model: Some(start.model.clone()),
    };
    t.emit(TurnEvent::Meta(meta)).await;
    for r in &start.results {
        t.emit(TurnEvent::ToolResult(r.clone())).await;
    }

    // Renew the lease on its own timer for the whole turn; losing it stops the turn. The
    // latest revision is shared, because the release at the end must present it.
    let (current, latest) = tokio::sync::watch::channel(start.lease);
    let done = tokio_util::sync::CancellationToken::new();
    let renewing = {
        let (app, turn, holder, done) =
            (Arc::clone(app), Arc::clone(turn), app.instance_id.clone(), done.clone());
        tokio::spawn(async move {
            loop {
                // Never cut a renewal short: its new revision is what the release needs.
                tokio::select! {
                    _ = tokio::time::sleep(LEASE_RENEW_EVERY) => {}
                    _ = done.cancelled() => return,
                }
                let lease = *current.borrow();
                match app.leases.renew(lease, &holder).await {
                    Ok(Some(l)) => {
                        current.send_replace(l);
                    }
                    Ok(None) => {
                        tracing::warn!(session_id = %turn.session, "turn lease lost; stopping the turn");
                        turn.stop(PendingReason::Interrupted);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(session_id = %turn.session, error = %e, "turn lease renewal failed")
                    }
                }
            }
        }.in_current_span())
    };

    let end = t.steps(started).await;
    done.cancel();
    let _ = renewing.await;
    let lease = *latest.borrow();
    // Released only after the outcome is durable, so a second send sees the finished turn.
    if let Err(e) = app.leases.release(lease).await {
        tracing::debug!(error = %e, "turn lease not released (it expires by itself)");
    }
    start.slot.release();
    app.metrics.turn_finished(end.status.as_str());
    t.emit(TurnEvent::End(end)).await;
}

struct Turn<'a> {
    app: &'a Arc<Ingress>,
    turn: &'a Arc<ActiveTurn>,
    start: &'a TurnStart,
    attempt_id: AttemptId,
    text: String,
    /// `text`'s length as stored JSON, escapes included (without the quotes).
    text_json: usize,
    reasoning: String,
    usage: Option<turnlog_runtime::upstream::Usage>,
    /// What this attempt sent, once it was handed to the gateway (§11).
    request: Option<RecordedRequest>,
    /// Whether a checkpoint carrying `request` was published.
    request_checkpointed: bool,
    /// The tools this step asks for, as they stream (only when the turn offers tools).
    tool_calls: ToolCalls,
    /// The turn's steps that asked for tools before this one.
    steps_before: usize,
    /// What this step's request is built with: the start's, then, for later steps of the
    /// same task, with the first step's extras and tools.
    options: TurnOptions,
    /// The offered tools that are server tools (DESIGN §14).
    server_names: std::collections::HashSet<String>,
    /// The start's live tail, until the first request is built from it.
    tail: Option<read::LiveTail>,
}

impl Turn<'_> {
    async fn emit(&self, event: TurnEvent) {
        if let Some(e) = self.turn.emit(event) {
            remote::publish_live(self.app, self.start.session, &e).await;
        }
    }

    /// The turn's steps (DESIGN §14): each model call, stored; while a step's server calls
    /// all get results, the next step runs in this task. The turn's `end`.
    async fn steps(&mut self, started: Instant) -> TurnEnd {
        if self.start.continued {
            let end = TurnEnd {
                model: Some(self.start.model.clone()),
                ..TurnEnd::new(Some(self.start.session), TurnStatus::RequiresAction)
            };
            if let Some(end) = self.settle(end, started).await {
                return end;
            }
        }
        loop {
            let ending = self.stream_answer(started).await;
            let end = self.persist(ending, started).await;
            let asks_server = end.status == TurnStatus::RequiresAction
                && end.required.iter().any(|r| self.server_names.contains(&r.name));
            if !asks_server {
                return end;
            }
            if let Some(end) = self.settle(end, started).await {
                return end;
            }
        }
    }

    /// Waits for the latest step's server calls (the permission chain, the worker); None
    /// when the next step is to run (set up for it), else the turn's `end`.
    async fn settle(&mut self, mut end: TurnEnd, started: Instant) -> Option<TurnEnd> {
        use super::server::{settle, Settled};
        let wait = self.options.permission_wait.unwrap_or(self.app.config.permission_wait);
        let settled = settle(self.app, self.turn, &self.start.owner, wait).await;
        end.duration_ms = Some(started.elapsed().as_millis() as u64);
        match settled {
            Settled::Ready => {
                // The next step: after a step of this task, a new attempt with the first
                // step's extras (and tools); a continued turn's first step keeps the
                // attempt its `meta` named (the response's id).
                let Some(r) = &self.request else { return None };
                self.options.extras = Some(r.extras.clone());
                self.attempt_id = AttemptId::new();
                tracing::Span::current().record("attempt_id", self.attempt_id.as_str());
                self.text.clear();
                self.text_json = 0;
                self.reasoning.clear();
                self.usage = None;
                self.request = None;
                self.request_checkpointed = false;
                return None;
            }
            Settled::Paused(required) => end.required = required,
            Settled::Stopped => {
                end.status = match self.turn.stop_reason() {
                    PendingReason::Stopped => TurnStatus::Stopped,
                    PendingReason::Interrupted => TurnStatus::Interrupted,
                }
            }
            Settled::Failed(message) => {
                tracing::warn!(%message, "the turn's tools could not be seen to");
                self.emit(TurnEvent::Error(StreamError { code: FailureCode::Unavailable, message })).await;
                end.status = TurnStatus::Failed;
            }
        }
        Some(end)
    }

    /// Compaction check, request, and the relay of the answer with checkpoints.
    async fn stream_answer(&mut self, started: Instant) -> Ending {
        let Some(upstream) = self.app.upstream.clone() else {
            return Ending::Failed {
                code: FailureCode::UpstreamError,
                message: "no model gateway is configured".into(),
            };
        };
        let body = match self.build_request().await {
            Ok(body) => body,
            Err(ending) => return ending,
        };
        self.app.metrics.pre_upstream(self.start.slot.taken.elapsed());
        let mut stream = tokio::select! {
            s = upstream.stream_body(&body) => match s {
                Ok(s) => s,
                Err(e) => return self.upstream_failed(e),
            },
            _ = self.turn.stop.cancelled() => return Ending::Stopped(self.turn.stop_reason()),
        };
        let mut checkpoint =
            tokio::time::interval_at(tokio::time::Instant::now() + CHECKPOINT_EVERY, CHECKPOINT_EVERY);
        let mut checkpointed_len = 0usize;
        let mut finish_reason = None;
        loop {
            let item = tokio::select! {
                biased;
                _ = self.turn.stop.cancelled() => return Ending::Stopped(self.turn.stop_reason()),
                _ = checkpoint.tick() => {
                    if self.text.len() != checkpointed_len {
                        checkpointed_len = self.text.len();
                        self.checkpoint().await;
                    }
                    continue;
                }
                item = stream.next() => item,
            };
            match item {
                Ok(None) => return Ending::Done { finish_reason },
                Ok(Some(StreamItem::Text(delta))) => {
                    if !self.relay(&delta, false, started).await {
                        return Ending::Done { finish_reason: Some("length".into()) };
                    }
                }
                Ok(Some(StreamItem::Reasoning(delta))) => {
                    if !self.relay(&delta, true, started).await {
                        return Ending::Done { finish_reason: Some("length".into()) };
                    }
                }
                Ok(Some(StreamItem::Usage(u))) => self.usage = Some(u),
                Ok(Some(StreamItem::Finish(reason))) => finish_reason = Some(reason),
                // A call when the turn offers no tools is the model's own mistake: the turn
                // keeps its text.
                Ok(Some(StreamItem::ToolCall(c))) if self.options.tools.is_some() => {
                    if let Err(why) = self.tool_calls.add(c) {
                        return self.upstream_failed(UpstreamError::Malformed(why));
                    }
                }
                Ok(Some(StreamItem::ToolCall(_))) => {}
                Err(e) => return self.upstream_failed(e),
            }
        }
    }

    /// Keeps and relays what fits of a text (or reasoning) delta; false when the answer
    /// reached its cap and the rest was dropped (the answer then ends, as at `max_tokens`).
    async fn relay(&mut self, delta: &str, reasoning: bool, started: Instant) -> bool {
        if self.text.is_empty() && self.reasoning.is_empty() {
            self.app.metrics.first_delta(started.elapsed());
        }
        let room = MAX_ANSWER_BYTES.saturating_sub(self.text.len() + self.reasoning.len());
        // Only the text goes into the pending_state, so only its stored size is capped.
        let json_room = if reasoning {
            usize::MAX
        } else {
            partial_json_cap(self.request.as_ref()).saturating_sub(self.text_json)
        };
        let (kept, kept_json) = fitting(delta, room, json_room);
        if !kept.is_empty() {
            let text = Text { text: kept.to_owned() };
            let event = if reasoning {
                self.reasoning.push_str(kept);
                TurnEvent::Reasoning(text)
            } else {
                self.text.push_str(kept);
                self.text_json += kept_json;
                TurnEvent::Delta(text)
            };
            let t0 = Instant::now();
            self.emit(event).await;
            self.app.metrics.relayed(t0.elapsed());
        }
        kept.len() == delta.len()
    }

    /// The pre-send compaction check, then the request: stable system prompt, the
    /// history from the log, this turn's extras last — built as bytes by the same pure
    /// function an audit rebuilds it with, and recorded (`self.request`) before it is sent.
    async fn build_request(&mut self) -> Result<RequestBody, Ending> {
        let app = self.app;
        let kept = self.tail.take();
        let owner = &self.start.owner;
        // A turn's first step offers the servers' tools beside the client's (DESIGN §14);
        // later steps offer what the first did.
        let catalog = app.catalog.for_owner(app, owner).await;
        if self.options.extras.is_none() {
            let offered = super::server::offered(&catalog, &self.options.server_tools);
            self.options.tools = super::server::with_server_tools(self.options.tools.take(), &offered);
        }
        self.server_names = super::server::server_names(self.options.tools.as_ref(), &catalog);
        let options = &self.options;
        let system = options.system.as_ref().unwrap_or(&app.config.system_prompt);
        if system.len() > MAX_SYSTEM_PROMPT_BYTES {
            // Refused when the ingress starts; kept here so no turn can ever record one.
            let message = format!(
                "the configured system prompt takes {} bytes, over the limit of {MAX_SYSTEM_PROMPT_BYTES}",
                system.len()
            );
            return Err(Ending::Failed { code: FailureCode::Internal, message });
        }
        let t0 = Instant::now();
        // Recall needs only the user's text: it is read beside the live tail.
        let recall = async {
            let common = app.common_words.current(&app.pool);
            read::recall_relevant(&app.pool, owner, &self.start.user_text, RECALLED_MEMORIES, &common)
                .await
                .map(|ms| ms.into_iter().map(|m| m.text).collect())
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "memory recall failed; sending without");
                    Vec::new()
                })
        };
        let (extras, tail) = match &options.extras {
            Some(extras) => (extras.clone(), self.live_tail(kept).await),
            None => {
                let (memories, tail) = tokio::join!(recall, self.live_tail(kept));
                (
                    Extras { date: Some(chrono::Utc::now().format("%Y-%m-%d (%A)").to_string()), memories },
                    tail,
                )
            }
        };
        let reserve = reserve_tokens(system, &extras);
        let mut tail = tail?;
        self.steps_before = turnlog_core::stream::tool_steps(&tail.events);
        let window = app.context_window(&self.start.model).await;
        let budget = budget_for(window, app.config.context_budget);
        let history = app.config.tool_history;
        let mut size = request_size(history_tokens_with(&tail.counted, history), reserve);
        let read_tail = t0.elapsed();
        // The pre-send check (DESIGN §4): a request the ingress counts within the budget is
        // what the compactor would answer `not_needed` for, by the same count on the same
        // log, so it is asked only when the request is over.
        let compacted = size <= budget || {
            let compacted = self.ask_compactor(reserve).await;
            tail = self.live_tail(None).await?;
            size = request_size(history_tokens_with(&tail.counted, history), reserve);
            compacted
        };
        let checked = t0.elapsed();
        if !compacted {
            // Without the compactor's word, send only what the model can take at all.
            let whole_window = window.unwrap_or_else(|| app.config.context_budget.saturating_mul(100) / 60);
            if size > whole_window {
                return Err(Ending::Failed {
                    code: FailureCode::ContextOverflow,
                    message: format!("the request takes {size} tokens; the model's window is {whole_window}"),
                });
            }
        }
        let model = &self.start.model;
        // Images go as data URLs to a model that sees images, built now and never stored.
        let urls = match &app.files {
            Some(blobs) if app.config.sees_images(model) => {
                Some(crate::files::data_urls(blobs, owner, &tail.events).await.map_err(|_| {
                    Ending::Failed {
                        code: FailureCode::Unavailable,
                        message: "the file store could not be read; retry the turn".into(),
                    }
                })?)
            }
            _ => None,
        };
        let params = RequestParams {
            stream: true,
            stream_options: Some(StreamOptions { include_usage: true }),
            max_tokens: Some(options.max_tokens.map_or(MAX_ANSWER_TOKENS, |m| m.min(MAX_ANSWER_TOKENS))),
            temperature: options.temperature,
            top_p: options.top_p,
            presence_penalty: options.presence_penalty,
            frequency_penalty: options.frequency_penalty,
            seed: options.seed,
            stop: options.stop.clone(),
            reasoning_effort: options.reasoning_effort.clone(),
            response_format: options.response_format.clone(),
            tools: options.tools.as_ref().map(|t| t.tools.clone()),
            tool_choice: options.tools.as_ref().and_then(|t| t.tool_choice.clone()),
            parallel_tool_calls: options.tools.as_ref().and_then(|t| t.parallel_tool_calls),
            images: urls.is_some(),
        };
        let resolve = urls.as_ref().map(|urls| move |id: &str, _: &str| urls.get(id).cloned());
        let resolve = resolve.as_ref().map(|r| r as ResolveImage<'_>);
        let history = app.config.tool_history;
        let body = turn_body_with(&tail.events, history, system, model, &params, &extras, resolve);
        // Where the time before the model call goes, stage by stage (cumulative, µs).
        tracing::debug!(
            tokens = size,
            budget,
            bytes = body.bytes.len(),
            read_us = read_tail.as_micros() as u64,
            compactor_us = checked.as_micros() as u64,
            built_us = t0.elapsed().as_micros() as u64,
            "request built"
        );
        // The tools' text rides with the step only when the log cannot give it back.
        let (tools, tools_sha256) = tools_record(&tail.events, params.tools.as_deref());
        self.request = Some(RecordedRequest {
            through_seq: tail.events.last().map_or(0, |e| e.seq),
            model: model.clone(),
            params: RequestParams { tools, ..params },
            system: system_prompt_record(&tail.events, system),
            tools_sha256,
            tool_history: history,
            extras,
            tokens: size,
            body_sha256: body.sha256.clone(),
        });
        Ok(body)
    }

    /// The session's live tail (from `kept`, read earlier, and what came since, when given),
    /// or the turn's failure.
    async fn live_tail(&self, kept: Option<read::LiveTail>) -> Result<read::LiveTail, Ending> {
        let (pool, owner, session) = (&self.app.pool, &self.start.owner, self.start.session);
        let read = match kept {
            Some(tail) => read::live_tail_after(pool, owner, session, tail).await,
            None => read::live_tail(pool, owner, session).await,
        };
        match read {
            Ok(Some(tail)) => Ok(tail),
            Ok(None) => {
                Err(Ending::Failed { code: FailureCode::NotFound, message: "the session is gone".into() })
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the session's log");
                Err(Ending::Failed {
                    code: FailureCode::Unavailable,
                    message: "the session's log could not be read".into(),
                })
            }
        }
    }

    /// Asks the compactors (one queue group) to bring the session within budget, waiting
    /// up to the configured deadline. True when the request is known to fit.
    async fn ask_compactor(&self, reserve_tokens: u32) -> bool {
        let app = self.app;
        let req = CompactRequest {
            session_id: self.start.session,
            owner: self.start.owner.clone(),
            model: Some(self.start.model.clone()),
            reserve_tokens,
        };
        let Ok(body) = serde_json::to_vec(&req) else { return false };
        let subject = app.bus.names.compact_subject(self.start.session);
        let mut headers = async_nats::HeaderMap::new();
        if let Some(t) = turnlog_runtime::trace::current_traceparent() {
            headers.insert(turnlog_runtime::trace::TRACEPARENT, t.as_str());
        }
        let request = app.bus.client.request_with_headers(subject, headers, body.into());
        let asked = tokio::time::timeout(app.config.compact_timeout, request);
        match asked.await {
            Ok(Ok(msg)) => match serde_json::from_slice::<CompactReply>(&msg.payload) {
                Ok(r) => r.status != CompactStatus::Failed,
                Err(e) => {
                    tracing::warn!(error = %e, "unreadable compactor reply");
                    false
                }
            },
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "no compactor answered");
                false
            }
            Err(_) => {
                tracing::warn!(timeout = ?app.config.compact_timeout, "the compactor did not answer in time");
                false
            }
        }
    }

    /// A failed model call. The client, the log and later model requests get a short
    /// message with the status code; the provider's body and the gateway's address (which
    /// can name internal hosts) go to this process's log only.
    fn upstream_failed(&self, e: UpstreamError) -> Ending {
        let kind = match &e {
            UpstreamError::Status { status, .. } => status.to_string(),
            UpstreamError::Connect(_) => "connect".into(),
            UpstreamError::Incomplete(_) => "incomplete".into(),
            UpstreamError::Timeout { .. } => "timeout".into(),
            UpstreamError::Malformed(_) => "malformed".into(),
            UpstreamError::Provider(_) => "provider".into(),
        };
        self.app.metrics.upstream_error(kind);
        tracing::warn!(error = %e, "upstream failed");
        let code = match e {
            UpstreamError::Timeout { .. } => FailureCode::UpstreamTimeout,
            _ => FailureCode::UpstreamError,
        };
        Ending::Failed { code, message: e.public_message() }
    }

    /// A checkpoint of the whole partial: published and acknowledged by JetStream, not
    /// waited for (the next one, or the turn's end, supersedes it). The first one carries
    /// the attempt's request (each one does until one is published).
    async fn checkpoint(&mut self) {
        let request = if self.request_checkpointed { None } else { self.request.clone() };
        let body = EventBody::PendingState(PendingState {
            partial: self.text.clone(),
            attempt_id: Some(self.attempt_id.clone()),
            reason: None,
            request,
        });
        let req = AppendRequest::append(self.start.session, &self.start.owner, Uuid::now_v7(), &body);
        match self.app.bus.publish_append(&req, None).await {
            Ok(_) => {
                self.request_checkpointed = true;
                self.app.metrics.checkpoint();
            }
            Err(e) => tracing::warn!(error = %e, "checkpoint not published"),
        }
    }

    /// Stores the turn's outcome (answer, final partial, or failure) and returns the
    /// `end` event's data; emits `error` first when the turn did not complete.
    async fn persist(&mut self, ending: Ending, started: Instant) -> TurnEnd {
        let duration_ms = started.elapsed().as_millis() as u64;
        let mut end = TurnEnd {
            model: Some(self.start.model.clone()),
            duration_ms: Some(duration_ms),
            ..TurnEnd::new(Some(self.start.session), TurnStatus::Failed)
        };
        let usage = self.usage.map(|u| Usage {
            input_tokens: u64::from(u.prompt_tokens),
            output_tokens: u64::from(u.completion_tokens),
            cached_input_tokens: u.cached_tokens.map(u64::from),
        });
        end.usage = usage;
        if let Some(u) = usage {
            let model = &self.start.model;
            let config = &self.app.config;
            let known = *model == config.model
                || config.allowed_models.as_ref().is_some_and(|a| a.contains(model))
                || config.category_models.values().any(|m| m == model);
            let label = if known { model.clone() } else { "other".to_owned() };
            self.app.metrics.usage(
                label,
                u.input_tokens,
                u.cached_input_tokens.unwrap_or(0),
                u.output_tokens,
            );
        }
        let calls = std::mem::take(&mut self.tool_calls);
        let (failure, body, status, outcome): StoredOutcome = match ending {
            // A step that asks for tools (DESIGN §14): stored, and the turn pauses for
            // their results — unless it was the turn's last allowed model call.
            Ending::Done { finish_reason } if !calls.is_empty() => match calls.finish() {
                Err(why) => self
                    .failed(FailureCode::UpstreamError, format!("the model's answer was malformed: {why}")),
                Ok(_) if self.steps_before + 1 >= self.app.config.max_tool_steps => self.failed(
                    FailureCode::TooManySteps,
                    format!(
                        "the turn made {} model calls (TURNLOG_MAX_TOOL_STEPS) and the last still asked for tools",
                        self.app.config.max_tool_steps
                    ),
                ),
                Ok(calls) => {
                    end.finish_reason = Some(finish_reason.clone());
                    end.required = calls.iter().map(Required::tool).collect();
                    let mut step = self.answer(finish_reason, usage, duration_ms);
                    if let EventBody::AssistantTurn(t) = &mut step {
                        t.llm.message.content =
                            (!self.text.is_empty()).then(|| MessageContent::Text(self.text.clone()));
                        t.ui.blocks.retain(|b| {
                            b.kind != BlockType::Text || b.text.as_deref().is_some_and(|t| !t.is_empty())
                        });
                        let names = &self.server_names;
                        t.ui.blocks.extend(calls.iter().map(|c| Block {
                            kind: BlockType::ToolCall,
                            text: None,
                            meta: Some(serde_json::json!({"call_id": c.id, "name": c.name, "arguments": c.arguments, "source": source_of(names, &c.name)})),
                        }));
                        t.llm.message.tool_calls = calls;
                    }
                    let size = json_len(&step.to_payload());
                    if size <= MAX_EVENT_BYTES {
                        (None, step, TurnStatus::RequiresAction, OutcomeEvent::Answer)
                    } else {
                        end.required.clear();
                        let message = format!(
                            "the step takes {size} bytes as stored, over the log's limit of {MAX_EVENT_BYTES} per event"
                        );
                        self.failed(FailureCode::AnswerTooLarge, message)
                    }
                }
            },
            Ending::Done { finish_reason } => {
                end.finish_reason = Some(finish_reason.clone());
                let answer = self.answer(finish_reason, usage, duration_ms);
                let size = json_len(&answer.to_payload());
                if size <= MAX_EVENT_BYTES {
                    (None, answer, TurnStatus::Completed, OutcomeEvent::Answer)
                } else {
                    // The answer holds the text twice; its pending holds it once and always fits.
                    tracing::warn!(
                        size,
                        "the answer is too large for one event; keeping it as a pending_state"
                    );
                    let message = format!(
                        "the answer takes {size} bytes as stored, over the log's limit of {MAX_EVENT_BYTES} \
                         per event; it is kept as an interrupted partial"
                    );
                    self.failed(FailureCode::AnswerTooLarge, message)
                }
            }
            Ending::Stopped(reason) if !self.text.is_empty() => {
                let pending = PendingState {
                    partial: self.text.clone(),
                    attempt_id: Some(self.attempt_id.clone()),
                    reason: Some(reason),
                    request: self.request.clone(),
                };
                let status = match reason {
                    PendingReason::Stopped => TurnStatus::Stopped,
                    PendingReason::Interrupted => TurnStatus::Interrupted,
                };
                (None, EventBody::PendingState(pending), status, OutcomeEvent::Partial)
            }
            Ending::Stopped(reason) => {
                let (code, message, status) = match reason {
                    PendingReason::Stopped => {
                        (FailureCode::Stopped, STOPPED_BEFORE_TEXT, TurnStatus::Stopped)
                    }
                    PendingReason::Interrupted => {
                        (FailureCode::Interrupted, "interrupted before any text arrived", TurnStatus::Failed)
                    }
                };
                let failed = TurnFailed {
                    code: code.to_string(),
                    message: message.into(),
                    attempt_id: Some(self.attempt_id.clone()),
                    request: self.request.clone(),
                };
                (None, EventBody::TurnFailed(failed), status, OutcomeEvent::Failure)
            }
            Ending::Failed { code, message } => self.failed(code, message),
        };
        if let Some(failure) = failure {
            self.emit(TurnEvent::Error(failure)).await;
        }
        end.status = status;
        match self.store(&body).await {
            Ok(seq) => {
                end.outcome = Some(outcome(seq));
                for r in &end.required {
                    let call = ToolCallEvent {
                        call_id: r.call_id.clone(),
                        name: r.name.clone(),
                        arguments: r.arguments.clone(),
                        source: source_of(&self.server_names, &r.name),
                    };
                    self.emit(TurnEvent::ToolCall(call)).await;
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "the turn's outcome could not be stored");
                let error = StreamError {
                    code: FailureCode::Unavailable,
                    message: "the answer could not be stored".into(),
                };
                self.emit(TurnEvent::Error(error)).await;
                // Never `completed`, or paused, without the answer in the log.
                if matches!(status, TurnStatus::Completed | TurnStatus::RequiresAction) {
                    end.status = TurnStatus::Failed;
                    end.required.clear();
                }
            }
        }
        end
    }

    /// The whole answer as its `assistant_turn`.
    fn answer(&self, finish_reason: Option<String>, usage: Option<Usage>, duration_ms: u64) -> EventBody {
        let mut blocks = Vec::new();
        if !self.reasoning.is_empty() {
            blocks.push(Block { kind: BlockType::Reasoning, text: Some(self.reasoning.clone()), meta: None });
        }
        blocks.push(Block { kind: BlockType::Text, text: Some(self.text.clone()), meta: None });
        EventBody::AssistantTurn(AssistantTurn {
            ui: UiPart { blocks },
            llm: LlmPart {
                message: LlmMessage {
                    content: Some(MessageContent::Text(self.text.clone())),
                    ..Default::default()
                },
            },
            attempt_id: Some(self.attempt_id.clone()),
            provider: Some(self.app.provider_name()),
            model: Some(self.start.model.clone()),
            usage,
            duration_ms: Some(duration_ms),
            finish_reason,
            request: self.request.clone(),
            ..Default::default()
        })
    }

    /// A turn that did not complete: its text so far as the final `pending_state`, or
    /// `turn_failed` when there is none; the failure is also the stream's `error`.
    fn failed(&self, code: FailureCode, message: String) -> StoredOutcome {
        if !self.text.is_empty() {
            let pending = PendingState {
                partial: self.text.clone(),
                attempt_id: Some(self.attempt_id.clone()),
                reason: Some(PendingReason::Interrupted),
                request: self.request.clone(),
            };
            let error = StreamError { code, message };
            return (
                Some(error),
                EventBody::PendingState(pending),
                TurnStatus::Interrupted,
                OutcomeEvent::Partial,
            );
        }
        // Without a request (it failed before sending), the failure records none.
        let failed = TurnFailed {
            code: code.to_string(),
            message: message.clone(),
            attempt_id: Some(self.attempt_id.clone()),
            request: self.request.clone(),
        };
        (
            Some(StreamError { code, message }),
            EventBody::TurnFailed(failed),
            TurnStatus::Failed,
            OutcomeEvent::Failure,
        )
    }

    /// Appends the outcome, resending the same event id until the writer answers or the
    /// deadline passes.
    async fn store(&self, body: &EventBody) -> Result<i64, NotStored> {
        let app = self.app;
        let req = AppendRequest::append(self.start.session, &self.start.owner, Uuid::now_v7(), body);
        let deadline = Instant::now() + PERSIST_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match append_and_wait(&app.bus, &app.pool, &req, left.max(Duration::from_millis(100))).await {
                Ok(Outcome { seq: Some(seq), .. }) => return Ok(seq),
                Ok(o) => return Err(NotStored::Refused(o)),
                Err(e) if Instant::now() >= deadline => return Err(NotStored::Unavailable(e)),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

/// Who runs a call: `mcp:<label>` for a server tool, else `client`.
fn source_of(server_names: &std::collections::HashSet<String>, name: &str) -> String {
    match name.split_once(turnlog_runtime::tools::SEPARATOR) {
        Some((label, _)) if server_names.contains(name) => format!("mcp:{label}"),
        _ => "client".into(),
    }
}

/// Why a turn's outcome is not in the log.
#[derive(Debug, thiserror::Error)]
enum NotStored {
    #[error("the writer refused it: {0:?}")]
    Refused(Outcome),
    #[error(transparent)]
    Unavailable(AppendError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_are_cut_at_the_caps_on_character_boundaries() {
        assert_eq!(fitting("hello", 10, usize::MAX), ("hello", 5));
        assert_eq!(fitting("hello", 3, usize::MAX), ("hel", 3));
        assert_eq!(fitting("éé", 3, usize::MAX), ("é", 2));
        // As JSON a quote takes 2 bytes and a control character 6.
        assert_eq!(fitting("a\"b", 10, 3), ("a\"", 3));
        assert_eq!(fitting("\u{1}\u{1}", 10, 11), ("\u{1}", 6));
        assert_eq!(fitting("x", 0, 10), ("", 0));
    }

    /// The largest request an attempt can record: a system prompt at its limit, tools at
    /// theirs (JSON text, whose worst escaping is a quote's) and every recalled memory at
    /// its length, all of characters that escape the most.
    fn largest_request(c: char) -> RecordedRequest {
        let text = |n: usize| c.to_string().repeat(n / c.len_utf8());
        RecordedRequest {
            through_seq: i64::MAX,
            model: "m".repeat(256),
            params: RequestParams {
                stream: true,
                stream_options: Some(StreamOptions { include_usage: true }),
                max_tokens: Some(MAX_ANSWER_TOKENS),
                tools: Some("\"".repeat(super::super::tools::MAX_TOOLS_BYTES)),
                tool_choice: Some(format!(
                    r#"{{"type":"function","function":{{"name":"{}"}}}}"#,
                    "n".repeat(64)
                )),
                ..Default::default()
            },
            tools_sha256: Some("0".repeat(64)),
            tool_history: Default::default(),
            system: turnlog_core::audit::SystemPrompt {
                sha256: "0".repeat(64),
                text: Some(text(MAX_SYSTEM_PROMPT_BYTES)),
            },
            extras: Extras {
                date: Some("2026-11-29 (Wednesday)".into()),
                memories: vec![text(500); RECALLED_MEMORIES as usize],
            },
            tokens: u32::MAX,
            body_sha256: "0".repeat(64),
        }
    }

    #[test]
    fn a_partial_at_the_cap_fits_the_log_whatever_it_escapes() {
        for c in ['x', '"', '\u{1}'] {
            let request = largest_request(c);
            let cap = partial_json_cap(Some(&request));
            let long = c.to_string().repeat(cap);
            let (text, json) = fitting(&long, usize::MAX, cap);
            assert!(json <= cap && json + 6 > cap, "{c:?}: {json}");
            let pending = EventBody::PendingState(PendingState {
                partial: text.to_owned(),
                attempt_id: Some(AttemptId::new()),
                reason: Some(PendingReason::Interrupted),
                request: Some(request),
            });
            assert!(json_len(&pending.to_payload()) <= MAX_EVENT_BYTES, "{c:?}");
        }
        assert_eq!(partial_json_cap(None), MAX_PARTIAL_JSON_BYTES);
    }
}
