//! The chat clients. Each keeps its own sessions and, alternating ingress copies, sends
//! messages and reads the turn streams to `end`; some leave early and re-attach, some stop
//! their turn, some ask the model to fail or hang, some retry, some make mistakes that must
//! be answered 4xx. Everything a client sees acknowledged is recorded for the checker.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource as _;
use futures::{Stream, StreamExt as _};
use serde_json::{json, Value};
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{append_and_wait, AppendRequest};
use uuid::Uuid;

use super::cluster::{owner, Cluster};
use super::report::ViolationKind;
use super::{lock, now_s, rel, Counters, Rng, Shared};

/// A send (with its resends) or a retry gives up after this.
const SEND_DEADLINE: Duration = Duration::from_secs(120);
/// Longest wait for response headers.
const HEADERS_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest silence inside a turn stream before the client counts it as broken: above the
/// ingress's worst quiet spell (a 5 s model timeout, then up to 15 s storing the outcome
/// while the writer is away).
const IDLE: Duration = Duration::from_secs(40);
/// A client starts a new session after this many turns.
const TURNS_PER_SESSION: usize = 40;

/// Why a client ran a turn; the checker judges some outcomes by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Purpose {
    #[default]
    Chat,
    /// Leaves after a few deltas, then re-attaches through the other copy.
    Leave,
    /// Stops the turn after a few deltas (through either copy).
    Stop,
    /// The message asks the mock to fail, hang or stall: the turn must not complete.
    ModelFault,
    /// `POST /retry` after a turn that did not complete.
    Retry,
    /// A recovery probe of the fault schedule.
    Probe,
}

/// One turn as a client saw it (a send with its resends, or a retry).
#[derive(Debug, Clone, Default)]
pub(crate) struct TurnRecord {
    pub client: usize,
    pub purpose: Purpose,
    pub session: Option<Uuid>,
    /// The message sent (empty for a retry: it runs the session's last message).
    pub text: String,
    pub started: f64,
    pub user_seq: Option<i64>,
    pub acked_at: f64,
    /// The answer text received, and when it reached each length (Unix seconds).
    pub received: String,
    pub marks: Vec<(f64, usize)>,
    pub deltas: usize,
    pub last_id: u64,
    pub end: Option<Value>,
    pub end_at: f64,
    /// The `end` came from the log (a resend after the turn was over), not from the turn.
    pub end_from_log: bool,
    /// The stream broke and the turn could not be found running: the fault cut it.
    pub cut_at: Option<f64>,
    /// When the stream last broke (not counting leaving on purpose).
    pub broke_at: Option<f64>,
    /// Why the stream broke, and what re-attaching found (for the report).
    pub cut_reason: String,
    /// Event ids skipped a number: the stream lost events.
    pub id_gap: bool,
    /// What a stream sent after its `end` (event names), and whether it then stayed open:
    /// `end` must be the last event, exactly once, and the stream must close after it.
    pub after_end: Vec<String>,
    pub open_after_end: bool,
    pub gave_up: bool,
}

impl TurnRecord {
    fn new(client: usize, purpose: Purpose, session: Option<Uuid>, text: &str) -> TurnRecord {
        TurnRecord { client, purpose, session, text: text.to_owned(), started: now_s(), ..Default::default() }
    }

    pub(crate) fn status(&self) -> Option<&str> {
        self.end.as_ref().and_then(|e| e.get("status")).and_then(Value::as_str)
    }

    /// Whether a user would press "retry": the turn did not complete.
    fn unfinished(&self) -> bool {
        self.cut_at.is_some() || self.gave_up || matches!(self.status(), Some("interrupted" | "failed"))
    }
}

type Events = Pin<
    Box<
        dyn Stream<
                Item = Result<
                    eventsource_stream::Event,
                    eventsource_stream::EventStreamError<reqwest::Error>,
                >,
            > + Send,
    >,
>;

fn events(resp: reqwest::Response) -> Events {
    Box::pin(resp.bytes_stream().eventsource())
}

enum Follow {
    Ended,
    Broken,
    Paused,
}

/// Reads turn events into `rec` until `end`, a break (closed, error or silence), or — with
/// `pause_at` — that many deltas.
async fn follow(events: &mut Events, rec: &mut TurnRecord, pause_at: Option<usize>) -> Follow {
    loop {
        if pause_at.is_some_and(|n| rec.deltas >= n) {
            return Follow::Paused;
        }
        let e = match tokio::time::timeout(IDLE, events.next()).await {
            Ok(Some(Ok(e))) => e,
            Ok(Some(Err(e))) => return broke(rec, &format!("stream error at {:.1}s: {e}", rel(now_s()))),
            Ok(None) => return broke(rec, &format!("stream closed without `end` at {:.1}s", rel(now_s()))),
            Err(_) => return broke(rec, &format!("silent for {IDLE:?} at {:.1}s", rel(now_s()))),
        };
        if let Ok(id) = e.id.trim().parse::<u64>() {
            if id != rec.last_id + 1 {
                rec.id_gap = true;
            }
            rec.last_id = id;
        }
        let data: Value = serde_json::from_str(&e.data).unwrap_or(Value::Null);
        match e.event.as_str() {
            "meta" => {
                if rec.user_seq.is_none() {
                    rec.acked_at = now_s();
                }
                rec.user_seq = data.get("user_seq").and_then(Value::as_i64).or(rec.user_seq);
            }
            "delta" => {
                rec.received.push_str(data.get("text").and_then(Value::as_str).unwrap_or_default());
                rec.deltas += 1;
                rec.marks.push((now_s(), rec.received.len()));
            }
            "end" => {
                rec.end_from_log = data.get("duration_ms").is_none();
                rec.end = Some(data);
                rec.end_at = now_s();
                read_past_end(events, rec).await;
                return Follow::Ended;
            }
            _ => {}
        }
    }
}

/// How long a stream may stay open after its `end`.
const CLOSE_AFTER_END: Duration = Duration::from_secs(5);

/// Reads on after `end` to the stream's close, recording anything more that arrives (a
/// second `end` included) and a stream that does not close.
async fn read_past_end(events: &mut Events, rec: &mut TurnRecord) {
    loop {
        match tokio::time::timeout(CLOSE_AFTER_END, events.next()).await {
            Ok(Some(Ok(e))) => rec.after_end.push(e.event),
            Ok(Some(Err(_)) | None) => return,
            Err(_) => {
                rec.open_after_end = true;
                return;
            }
        }
    }
}

fn broke(rec: &mut TurnRecord, what: &str) -> Follow {
    rec.broke_at = Some(now_s());
    note(rec, what);
    Follow::Broken
}

fn note(rec: &mut TurnRecord, what: &str) {
    if !rec.cut_reason.is_empty() {
        rec.cut_reason.push_str("; ");
    }
    rec.cut_reason.push_str(what);
}

enum Posted {
    /// No response: refused, reset or timed out.
    Failed,
    Status(u16, String),
    /// 200: the turn stream, and `X-Session-Id`.
    Stream(Events, Option<Uuid>),
}

async fn post(http: &reqwest::Client, url: &str, body: Option<&Value>, key: Option<&str>) -> Posted {
    let mut req = http.post(url);
    if let Some(b) = body {
        req = req.json(b);
    }
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    match tokio::time::timeout(HEADERS_TIMEOUT, req.send()).await {
        Ok(Ok(resp)) if resp.status().as_u16() == 200 => {
            let session =
                resp.headers().get("x-session-id").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
            Posted::Stream(events(resp), session)
        }
        Ok(Ok(resp)) => {
            let status = resp.status().as_u16();
            let body = tokio::time::timeout(Duration::from_secs(5), resp.text())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            Posted::Status(status, body)
        }
        _ => Posted::Failed,
    }
}

/// One chat client.
pub(crate) struct Client {
    id: usize,
    rng: Rng,
    http: reqwest::Client,
    ingress: Vec<String>,
    next: usize,
    shared: Arc<Shared>,
    session: Option<Uuid>,
    turns_in_session: usize,
    n: usize,
    last_completed: bool,
}

impl Client {
    pub(super) fn new(id: usize, cluster: &Cluster, shared: &Arc<Shared>) -> Client {
        Client {
            id,
            rng: Rng::new(shared.config.seed ^ (id as u64).wrapping_mul(0x9e37_79b9)),
            http: cluster.http.clone(),
            ingress: cluster.ingress.clone(),
            next: id % 2,
            shared: Arc::clone(shared),
            session: None,
            turns_in_session: 0,
            n: 0,
            last_completed: false,
        }
    }

    /// Sends, leaves, stops, retries and errs until `stop_at`, then returns after the
    /// operation in hand (each bounded by its own deadline).
    pub(super) async fn run(mut self, stop_at: Instant) {
        // Clients start spread over a second, not in one burst.
        tokio::time::sleep(Duration::from_millis(self.rng.range(0, 1000))).await;
        while Instant::now() < stop_at {
            self.n += 1;
            let roll = self.rng.range(0, 100);
            if roll < 7 {
                self.mistake().await;
            } else {
                let purpose = match roll {
                    7..=17 => Purpose::ModelFault,
                    18..=29 => Purpose::Leave,
                    30..=39 => Purpose::Stop,
                    _ => Purpose::Chat,
                };
                let rec = self.turn(purpose).await;
                let retry = rec.unfinished() && (purpose != Purpose::ModelFault || self.rng.percent(50));
                self.last_completed = rec.status() == Some("completed");
                self.keep(rec);
                if retry {
                    if let Some(rec) = self.retry().await {
                        self.last_completed = rec.status() == Some("completed");
                        self.keep(rec);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(self.rng.range(100, 600))).await;
        }
    }

    /// The next ingress copy: clients alternate between them.
    fn pick(&mut self) -> usize {
        self.next = (self.next + 1) % self.ingress.len();
        self.next
    }

    fn keep(&self, rec: TurnRecord) {
        keep(&self.shared, rec);
    }

    fn compose(&mut self, purpose: Purpose) -> (String, Option<usize>) {
        const SENTENCES: [&str; 5] = [
            "Remind Petra that room {a} opens at {b} on Friday.",
            "Jonas moved the launch to March {a}, after {b} reviews.",
            "Ask Amira about invoice {a} before {b} o'clock.",
            "Oskar owes {a} euros since week {b}.",
            "Lena booked {a} seats for the {b} train.",
        ];
        const MODEL_FAULTS: [&str; 6] = [
            "[mock fail_after=4 words=60 delay_ms=20]",
            "[mock status=500]",
            "[mock status=429]",
            "[mock hang]",
            "[mock stall_after=3 words=60 delay_ms=20]",
            "[mock no_done words=30 delay_ms=10]",
        ];
        let sentence = self
            .rng
            .pick(&SENTENCES)
            .replace("{a}", &self.rng.range(2, 999).to_string())
            .replace("{b}", &self.rng.range(2, 24).to_string());
        let (directive, pause) = match purpose {
            Purpose::Leave => (format!("[mock words={} delay_ms=25]", self.rng.range(80, 140)), Some(4)),
            Purpose::Stop => (format!("[mock words={} delay_ms=25]", self.rng.range(120, 200)), Some(5)),
            Purpose::ModelFault => ((*self.rng.pick(&MODEL_FAULTS)).to_owned(), None),
            _ => {
                (format!("[mock words={} delay_ms={}]", self.rng.range(20, 90), self.rng.range(10, 30)), None)
            }
        };
        (format!("c{} m{}: {sentence} {directive}", self.id, self.n), pause)
    }

    async fn turn(&mut self, purpose: Purpose) -> TurnRecord {
        if self.turns_in_session >= TURNS_PER_SESSION {
            self.session = None;
        }
        let (text, pause) = self.compose(purpose);
        if purpose == Purpose::ModelFault {
            Counters::add(&self.shared.counters.model_faults);
        }
        let rec = self.send(&text, purpose, pause).await;
        if rec.session.is_some() && self.session.is_none() {
            self.session = rec.session;
            self.turns_in_session = 0;
        }
        self.turns_in_session += 1;
        rec
    }

    /// Sends a message (to the client's session, or to a new one through `/v1/chat`) and
    /// follows its turn to `end`, resending with the same `Idempotency-Key` after a refused
    /// connection, a 503 or a 409, and re-attaching through the other copy after a break.
    async fn send(&mut self, text: &str, purpose: Purpose, pause_at: Option<usize>) -> TurnRecord {
        let key = Uuid::new_v4().to_string();
        let mut rec = TurnRecord::new(self.id, purpose, self.session, text);
        if let Some(s) = rec.session {
            lock(&self.shared.sent).push((s, text.to_owned()));
        }
        let deadline = Instant::now() + SEND_DEADLINE;
        let mut which = self.pick();
        let mut attempt = 0;
        loop {
            if Instant::now() > deadline {
                rec.gave_up = true;
                Counters::add(&self.shared.counters.gave_up);
                return rec;
            }
            attempt += 1;
            if attempt > 1 {
                Counters::add(&self.shared.counters.resends);
            }
            let base = &self.ingress[which];
            let (url, body) = match rec.session {
                Some(s) => (format!("{base}/v1/sessions/{s}/messages"), json!({ "text": text })),
                None => (format!("{base}/v1/chat"), json!({ "text": text })),
            };
            match post(&self.http, &url, Some(&body), Some(&key)).await {
                Posted::Failed => {
                    which = (which + 1) % self.ingress.len();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Posted::Status(503, _) => {
                    self.note_503();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                // The lease is still held by this session's previous turn (a killed copy's
                // lease expires by itself).
                Posted::Status(409, _) => tokio::time::sleep(Duration::from_millis(500)).await,
                Posted::Status(status, body) if status >= 500 => {
                    self.shared.violation(
                        ViolationKind::Http5xx,
                        format!("client {} send answered {status}: {}", self.id, clip(&body)),
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Posted::Status(status, body) => {
                    self.shared.violation(
                        ViolationKind::Other,
                        format!("client {} well-formed send answered {status}: {}", self.id, clip(&body)),
                    );
                    return rec;
                }
                Posted::Stream(mut stream, session) => {
                    if rec.session.is_none() {
                        if let Some(s) = session {
                            rec.session = Some(s);
                            lock(&self.shared.sent).push((s, text.to_owned()));
                            lock(&self.shared.sessions).push(s);
                        }
                    }
                    // A resend may follow the turn from its first event again.
                    if rec.user_seq.is_none() {
                        rec.received.clear();
                        rec.marks.clear();
                        rec.deltas = 0;
                    }
                    rec.last_id = 0;
                    let mut outcome = follow(&mut stream, &mut rec, pause_at).await;
                    if let Follow::Paused = outcome {
                        outcome = match purpose {
                            Purpose::Stop => {
                                self.stop(rec.session).await;
                                follow(&mut stream, &mut rec, None).await
                            }
                            _ => {
                                // Leave: the connection closes; the turn goes on without us.
                                drop(stream);
                                note(&mut rec, &format!("left at {:.1}s", rel(now_s())));
                                Counters::add(&self.shared.counters.left_early);
                                tokio::time::sleep(Duration::from_millis(self.rng.range(200, 1500))).await;
                                Follow::Broken
                            }
                        };
                    }
                    if let Follow::Ended = outcome {
                        return rec;
                    }
                    let other = (which + 1) % self.ingress.len();
                    if self.reattach(&mut rec, other).await {
                        return rec;
                    }
                    if rec.user_seq.is_some() {
                        rec.cut_at = Some(now_s());
                        self.learn_from_log(&mut rec, &key, other).await;
                        return rec;
                    }
                    // Broken before `meta`: resend; the key makes it the same turn.
                }
            }
        }
    }

    /// Re-attaches to the turn in flight (after `last_id`), trying both copies; true when it
    /// was followed to its `end`, false when no copy runs it any more.
    async fn reattach(&mut self, rec: &mut TurnRecord, first: usize) -> bool {
        let Some(session) = rec.session else { return false };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut which = first;
        while Instant::now() < deadline {
            let mut req = self.http.get(format!("{}/v1/sessions/{session}/stream", self.ingress[which]));
            if rec.last_id > 0 {
                req = req.header("last-event-id", rec.last_id.to_string());
            }
            match tokio::time::timeout(HEADERS_TIMEOUT, req.send()).await {
                Ok(Ok(resp)) => match resp.status().as_u16() {
                    200 => {
                        Counters::add(&self.shared.counters.reattached);
                        let mut stream = events(resp);
                        if let Follow::Ended = follow(&mut stream, rec, None).await {
                            return true;
                        }
                        which = (which + 1) % self.ingress.len();
                    }
                    204 => {
                        note(rec, &format!("re-attach via #{which}: 204 at {:.1}s", rel(now_s())));
                        return false;
                    }
                    503 => {
                        self.note_503();
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    status => {
                        let kind = if status >= 500 { ViolationKind::Http5xx } else { ViolationKind::Other };
                        self.shared
                            .violation(kind, format!("client {} re-attach answered {status}", self.id));
                        return false;
                    }
                },
                _ => {
                    which = (which + 1) % self.ingress.len();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            }
        }
        false
    }

    /// After a cut: resends the message once (same key) to hear how the turn ended, as a
    /// client reconnecting would. The log's answer is kept beside what the client received.
    async fn learn_from_log(&mut self, rec: &mut TurnRecord, key: &str, which: usize) {
        let Some(session) = rec.session else { return };
        let url = format!("{}/v1/sessions/{session}/messages", self.ingress[which]);
        let body = json!({ "text": rec.text });
        if let Posted::Stream(mut stream, _) = post(&self.http, &url, Some(&body), Some(key)).await {
            let mut heard = TurnRecord::new(self.id, rec.purpose, rec.session, &rec.text);
            if let Follow::Ended = follow(&mut stream, &mut heard, None).await {
                if heard.end_from_log {
                    rec.end = heard.end;
                    rec.end_at = heard.end_at;
                    rec.end_from_log = true;
                } else {
                    // The turn was running after all: this is its whole stream.
                    heard.acked_at = rec.acked_at;
                    heard.started = rec.started;
                    *rec = heard;
                }
            }
        }
    }

    /// Stops the client's turn through a random copy.
    async fn stop(&mut self, session: Option<Uuid>) {
        let Some(session) = session else { return };
        let which = self.pick();
        let url = format!("{}/v1/sessions/{session}/stop", self.ingress[which]);
        match post(&self.http, &url, None, None).await {
            Posted::Status(202 | 409, _) | Posted::Failed => {}
            Posted::Status(503, _) => self.note_503(),
            Posted::Status(status, body) => {
                let kind = if status >= 500 { ViolationKind::Http5xx } else { ViolationKind::Other };
                self.shared
                    .violation(kind, format!("client {} stop answered {status}: {}", self.id, clip(&body)));
            }
            Posted::Stream(..) => {}
        }
    }

    /// `POST /retry` until the turn runs (a dead copy's lease expires by itself) or there is
    /// nothing to retry.
    async fn retry(&mut self) -> Option<TurnRecord> {
        let session = self.session?;
        Counters::add(&self.shared.counters.retries);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut which = self.pick();
        while Instant::now() < deadline {
            let url = format!("{}/v1/sessions/{session}/retry", self.ingress[which]);
            match post(&self.http, &url, None, None).await {
                Posted::Failed => {
                    which = (which + 1) % self.ingress.len();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Posted::Status(503, _) => {
                    self.note_503();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Posted::Status(409, body) if body.contains("nothing to retry") => return None,
                Posted::Status(409, _) => tokio::time::sleep(Duration::from_secs(1)).await,
                Posted::Status(status, body) => {
                    let kind = if status >= 500 { ViolationKind::Http5xx } else { ViolationKind::Other };
                    self.shared.violation(
                        kind,
                        format!("client {} retry answered {status}: {}", self.id, clip(&body)),
                    );
                    return None;
                }
                Posted::Stream(mut stream, _) => {
                    let mut rec = TurnRecord::new(self.id, Purpose::Retry, Some(session), "");
                    if let Follow::Ended = follow(&mut stream, &mut rec, None).await {
                        return Some(rec);
                    }
                    if !self.reattach(&mut rec, (which + 1) % self.ingress.len()).await {
                        rec.cut_at = Some(now_s());
                    }
                    return Some(rec);
                }
            }
        }
        None
    }

    fn note_503(&self) {
        let c = &self.shared.counters;
        Counters::add(&c.unavailable_503);
        if !self.shared.disturbed.load(std::sync::atomic::Ordering::Relaxed) {
            Counters::add(&c.unavailable_503_calm);
        }
    }

    /// A client mistake: must be a 4xx. A 503 is accepted only for a request that needs
    /// Postgres or NATS to be judged, and only while a fault is being injected or healed.
    pub(crate) async fn mistake(&mut self) {
        Counters::add(&self.shared.counters.mistakes);
        let which = self.pick();
        let base = self.ingress[which].clone();
        let own = self.session.unwrap_or_else(Uuid::now_v7);
        let stranger = Uuid::now_v7();
        let messages = format!("{base}/v1/sessions/{own}/messages");
        let choice = self.rng.range(0, 14);
        let http = &self.http;
        let (what, needs_backbone, req) = match choice {
            0 => (
                "malformed JSON",
                false,
                http.post(&messages).header("content-type", "application/json").body("{\"text\": "),
            ),
            1 => ("unknown field", false, http.post(&messages).json(&json!({"text": "hi", "bogus": 1}))),
            2 => ("empty text", false, http.post(&messages).json(&json!({"text": ""}))),
            3 => ("NUL in text", false, http.post(&messages).json(&json!({"text": "a\u{0}b"}))),
            4 => (
                "body over 1 MiB",
                false,
                http.post(&messages).json(&json!({"text": "x".repeat(1024 * 1024 + 100)})),
            ),
            5 => (
                "bad session id",
                false,
                http.post(format!("{base}/v1/sessions/not-a-uuid/messages")).json(&json!({"text": "hi"})),
            ),
            6 => (
                "unknown session",
                true,
                http.post(format!("{base}/v1/sessions/{stranger}/messages")).json(&json!({"text": "hi"})),
            ),
            7 => (
                "bad Last-Event-ID",
                true,
                http.get(format!("{base}/v1/sessions/{own}/stream")).header("last-event-id", "abc"),
            ),
            8 if self.last_completed => {
                ("retry after a completed turn", true, http.post(format!("{base}/v1/sessions/{own}/retry")))
            }
            9 => ("empty patch", true, http.patch(format!("{base}/v1/sessions/{own}")).json(&json!({}))),
            10 => ("limit=0", true, http.get(format!("{base}/v1/sessions?limit=0"))),
            11 => (
                "chat to an unknown session",
                true,
                http.post(format!("{base}/v1/chat")).json(&json!({"session_id": stranger, "text": "hi"})),
            ),
            12 => ("stop with no turn running", true, http.post(format!("{base}/v1/sessions/{own}/stop"))),
            _ => ("wrong method", false, http.delete(&messages)),
        };
        let status = match tokio::time::timeout(Duration::from_secs(15), req.send()).await {
            Ok(Ok(resp)) => resp.status().as_u16(),
            // A copy being killed refuses connections; that is not an answer.
            _ => return,
        };
        let disturbed = self.shared.disturbed.load(std::sync::atomic::Ordering::Relaxed);
        match status {
            400..=499 => {}
            503 if needs_backbone && disturbed => Counters::add(&self.shared.counters.mistakes_503),
            _ => {
                let kind = if status >= 500 { ViolationKind::Http5xx } else { ViolationKind::Other };
                self.shared
                    .violation(kind, format!("client mistake `{what}` answered {status} (must be 4xx)"));
            }
        }
    }
}

/// Counts a finished turn and hands it to the checker.
pub(crate) fn keep(shared: &Shared, rec: TurnRecord) {
    let c = &shared.counters;
    Counters::add(&c.turns);
    match (rec.cut_at.is_some(), rec.status()) {
        (true, _) => Counters::add(&c.cut),
        (false, Some("completed")) => Counters::add(&c.completed),
        (false, Some("interrupted")) => Counters::add(&c.interrupted),
        (false, Some("stopped")) => Counters::add(&c.stopped),
        (false, Some(_)) => Counters::add(&c.failed),
        (false, None) => {}
    }
    lock(&shared.records).push(rec);
}

/// One probe turn through ingress copy `which` on `session`: true when it completed and
/// its answer was stored. The turn is recorded like any client's.
pub(crate) async fn probe_turn(
    cluster: &Cluster,
    shared: &Shared,
    which: usize,
    session: Uuid,
    text: &str,
) -> Option<i64> {
    let url = format!("{}/v1/sessions/{session}/messages", cluster.ingress[which]);
    let body = json!({ "text": text });
    let key = Uuid::new_v4().to_string();
    let Posted::Stream(mut stream, _) = post(&cluster.http, &url, Some(&body), Some(&key)).await else {
        return None;
    };
    let mut rec = TurnRecord::new(usize::MAX, Purpose::Probe, Some(session), text);
    lock(&shared.sent).push((session, text.to_owned()));
    let ended = matches!(
        tokio::time::timeout(Duration::from_secs(20), follow(&mut stream, &mut rec, None)).await,
        Ok(Follow::Ended)
    );
    if !ended && rec.user_seq.is_some() {
        rec.cut_at = Some(now_s());
    }
    let seq = (rec.status() == Some("completed"))
        .then(|| rec.end.as_ref().and_then(|e| e.get("assistant_seq")).and_then(Value::as_i64))
        .flatten();
    if rec.user_seq.is_some() {
        keep(shared, rec);
    }
    seq
}

/// Deltas of a victim turn read before its copy may be killed: 100 deltas at 25 ms each
/// is 2.5 s of streaming, past the first checkpoint.
const VICTIM_DELTAS: usize = 100;

/// A long turn through ingress copy `which` on a fresh session, started right before that
/// copy is killed so the kill surely cuts a turn that has streamed past a checkpoint (the
/// checker then holds it to the 2 s bound). Returns once it has streamed 2.5 s, with a task
/// that follows it to the cut and records it like any client's turn; None when it could not
/// be started.
pub(crate) async fn victim_turn(
    cluster: &Cluster,
    shared: &Arc<Shared>,
    which: usize,
) -> Option<tokio::task::JoinHandle<()>> {
    let session = SessionId::new();
    let create = AppendRequest::create(session, &owner(), Some("victim".to_owned()));
    let created = append_and_wait(&cluster.bus, &cluster.env.pool, &create, Duration::from_secs(10)).await;
    if !created.is_ok_and(|o| o.is_applied()) {
        return None;
    }
    let text = "a long answer for the kill [mock words=2000 delay_ms=25]";
    let url = format!("{}/v1/sessions/{}/messages", cluster.ingress[which], session.0);
    let Posted::Stream(mut stream, _) = post(&cluster.http, &url, Some(&json!({ "text": text })), None).await
    else {
        return None;
    };
    let mut rec = TurnRecord::new(usize::MAX, Purpose::Probe, Some(session.0), text);
    lock(&shared.sent).push((session.0, text.to_owned()));
    let paused =
        tokio::time::timeout(Duration::from_secs(20), follow(&mut stream, &mut rec, Some(VICTIM_DELTAS)));
    if !matches!(paused.await, Ok(Follow::Paused)) {
        return None;
    }
    let shared = Arc::clone(shared);
    Some(tokio::spawn(async move {
        let ended = matches!(
            tokio::time::timeout(Duration::from_secs(30), follow(&mut stream, &mut rec, None)).await,
            Ok(Follow::Ended)
        );
        if !ended {
            rec.cut_at = Some(now_s());
        }
        keep(&shared, rec);
    }))
}

fn clip(s: &str) -> String {
    s.chars().take(200).collect()
}
