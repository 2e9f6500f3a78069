//! The HTTP harness: one in-process stack per test (the ingress on 127.0.0.1:0, the writer
//! or deliberately none, workers when a suite asks) over the testkit's fresh database and
//! bus prefix, and a small HTTP client.

use std::time::Duration;

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use reqwest::Method;
use serde_json::Value;
use turnlog_core::events::EventBody;
use turnlog_core::ids::{Owner, SessionId};
use turnlog_dev::{ServiceConfigs, Stack};
use turnlog_ingress::turn::TurnLimits;
use turnlog_ingress::ApiTokens;
use turnlog_runtime::bus::{append_and_wait, AppendRequest, Bus, OutcomeStatus};
use turnlog_testkit::{test_env, TestEnv};
use uuid::Uuid;

use crate::config;

pub const ALICE: &str = "alice-token-0001";
pub const BOB: &str = "bob-token-000002";
pub const TOKENS: &str = "alice:alice-token-0001,bob:bob-token-000002";
pub const WAIT: Duration = Duration::from_secs(15);

pub struct Options {
    pub tokens: Option<&'static str>,
    pub writer: bool,
    pub append_timeout: Duration,
    pub llm_url: Option<String>,
    pub system_prompt: String,
    /// How long a turn waits for a compactor (none runs in these tests).
    pub compact_timeout: Duration,
    /// Extra context windows (`TURNLOG_MODEL_WINDOWS`).
    pub model_windows: Vec<(&'static str, u32)>,
    /// `TURNLOG_ALLOWED_MODELS` (None: any model).
    pub allowed_models: Option<Vec<String>>,
    /// `TURNLOG_MAX_TURNS_PER_OWNER` and `TURNLOG_MAX_TURNS`.
    pub turn_limits: TurnLimits,
    /// `TURNLOG_STATEMENT_TIMEOUT`.
    pub statement_timeout: Duration,
    /// `TURNLOG_PARTITIONS` of the writer, the ingress and the harness's own bus.
    pub partitions: u32,
    /// `TURNLOG_FILES_URL` (None: a directory of the test's own under the temp directory).
    pub files_url: Option<String>,
    /// `TURNLOG_VISION_MODELS` (None: every model).
    pub vision_models: Option<Vec<String>>,
    /// Sweep deleted files this often, without the delay (None: the defaults).
    pub file_sweep_every: Option<Duration>,
    /// `TURNLOG_IMPORT_MAX_BYTES` (None: the default).
    pub import_max_bytes: Option<usize>,
    /// `TURNLOG_CATEGORY_MODELS`.
    pub category_models: Vec<(&'static str, &'static str)>,
    /// Changes the ingress's config last (settings without a field here).
    pub ingress: Option<fn(&mut turnlog_ingress::IngressConfig)>,
    /// The tools worker's servers file (TOML text): the worker runs when set (DESIGN §14).
    pub mcp_servers: Option<String>,
    /// `TURNLOG_TOOL_TIMEOUT` of the ingress and the tools worker.
    pub tool_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            tokens: Some(TOKENS),
            writer: true,
            append_timeout: Duration::from_secs(10),
            llm_url: None,
            system_prompt: String::new(),
            compact_timeout: Duration::from_millis(300),
            model_windows: Vec::new(),
            allowed_models: None,
            turn_limits: TurnLimits::default(),
            statement_timeout: turnlog_runtime::db::DEFAULT_STATEMENT_TIMEOUT,
            partitions: 1,
            files_url: None,
            vision_models: None,
            file_sweep_every: None,
            import_max_bytes: None,
            category_models: Vec::new(),
            ingress: None,
            mcp_servers: None,
            tool_timeout: Duration::from_secs(60),
        }
    }
}

pub struct Api {
    pub env: TestEnv,
    pub base: String,
    pub bus: Bus,
    http: reqwest::Client,
    /// Dropped with the harness, which stops every service at once.
    stack: Stack,
}

pub enum Body {
    None,
    Json(Value),
    Raw(Vec<u8>),
}

#[derive(Debug, Clone)]
pub struct SseEvent {
    pub id: u64,
    pub event: String,
    pub data: Value,
}

#[derive(Debug)]
pub struct TurnReply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub events: Vec<SseEvent>,
    /// The error body when the route answered JSON instead of a stream.
    pub json: Value,
}

impl TurnReply {
    /// The `end` event (asserting there is exactly one, and it is last).
    #[track_caller]
    pub fn end(&self) -> &Value {
        let ends: Vec<_> = self.events.iter().filter(|e| e.event == "end").collect();
        assert_eq!(ends.len(), 1, "exactly one end: {:?}", self.events);
        assert_eq!(self.events.last().map(|e| e.event.as_str()), Some("end"), "end comes last");
        &ends[0].data
    }

    /// Concatenated delta text.
    pub fn text(&self) -> String {
        self.events.iter().filter(|e| e.event == "delta").filter_map(|e| e.data["text"].as_str()).collect()
    }

    /// Asserts the error shape (the route answered JSON) and returns the code.
    #[track_caller]
    pub fn error_code(&self) -> &str {
        error_code(self.status, &self.json)
    }
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub text: String,
    /// The body as JSON, or Null when it is not JSON.
    pub json: Value,
}

impl Reply {
    /// Asserts the error shape and returns the code.
    #[track_caller]
    pub fn error_code(&self) -> &str {
        error_code(self.status, &self.json)
    }
}

/// The code of an error body `{error: {code, message}}`, asserting that shape.
#[track_caller]
fn error_code(status: u16, json: &Value) -> &str {
    let code = json["error"]["code"].as_str();
    let message = json["error"]["message"].as_str();
    assert!(
        code.is_some() && message.is_some_and(|m| !m.is_empty()),
        "not the error shape (status {status}): {json}"
    );
    code.unwrap_or_default()
}

impl Api {
    pub async fn start() -> Self {
        Self::with(Options::default()).await
    }

    pub async fn with(opts: Options) -> Self {
        let mut env = test_env().await;
        env.partitions = opts.partitions;
        let configs = Self::configs(&env, opts);
        Self::on(env, configs).await
    }

    /// The services [`Api::with`] runs on `env` (to start them again after a stop).
    pub fn configs(env: &TestEnv, opts: Options) -> ServiceConfigs {
        let mut configs = config::stack(env);
        configs.tools = opts.mcp_servers.as_deref().map(|text| turnlog_tools::ToolsConfig {
            timeout: opts.tool_timeout,
            ..turnlog_tools::ToolsConfig::parse(config::backbone(env), text).unwrap()
        });
        configs.ingress.tool_timeout = opts.tool_timeout;
        if !opts.writer {
            configs.writer = None;
        }
        let config = &mut configs.ingress;
        if let Some(spec) = opts.tokens {
            config.tokens = ApiTokens::parse(spec).unwrap();
        }
        config.append_timeout = opts.append_timeout;
        config.system_prompt = opts.system_prompt;
        config.compact_timeout = opts.compact_timeout;
        config.allowed_models = opts.allowed_models;
        config.turn_limits = opts.turn_limits;
        config.vision_models = opts.vision_models;
        if let Some(every) = opts.file_sweep_every {
            (config.file_sweep_delay, config.file_sweep_every) = (Duration::ZERO, every);
        }
        config.files_url = Some(opts.files_url.unwrap_or_else(|| {
            let dir = std::env::temp_dir().join("turnlog-test-files").join(&env.bus_prefix);
            format!("file://{}", dir.display())
        }));
        config.category_models =
            opts.category_models.iter().map(|(c, m)| (c.to_string(), m.to_string())).collect();
        if let Some(max) = opts.import_max_bytes {
            config.import_max_bytes = max;
        }
        config.backbone.statement_timeout = opts.statement_timeout;
        config.model_windows = opts.model_windows.iter().map(|(m, w)| (m.to_string(), *w)).collect();
        config.upstream = opts.llm_url.map(|base_url| turnlog_runtime::upstream::UpstreamConfig {
            timeout: Duration::from_secs(5),
            windows_override: config.model_windows.clone(),
            ..config::upstream_at(&base_url)
        });
        if let Some(change) = opts.ingress {
            change(&mut configs.ingress);
        }
        configs
    }

    /// The harness over a stack of the caller's `configs` on `env`.
    pub async fn on(env: TestEnv, configs: ServiceConfigs) -> Self {
        let partitions = configs.ingress.backbone.partitions;
        let stack = crate::serve(configs, WAIT).await.unwrap_or_else(|e| panic!("{e:#}"));
        let base = stack.base_url().to_owned();
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
        let bus = Bus::connect(&env.nats_url, &env.bus_prefix, partitions).await.unwrap();
        Self { env, base, bus, http, stack }
    }

    /// Stops the services in order (each must end cleanly) and hands back the environment.
    pub async fn stop(self) -> TestEnv {
        self.stack.stop().await.unwrap_or_else(|e| panic!("{e:#}"));
        self.env
    }

    pub async fn call(&self, method: Method, path: &str, token: Option<&str>, body: Body) -> Reply {
        let mut req = self.request(method, path);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req = match body {
            Body::None => req,
            Body::Json(v) => req.json(&v),
            Body::Raw(bytes) => req.header("content-type", "application/json").body(bytes),
        };
        self.send(req).await
    }

    /// A request to `path`, for tests that set its headers themselves.
    pub fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.base))
    }

    /// Sends `req` and reads the whole answer.
    pub async fn send(&self, req: reqwest::RequestBuilder) -> Reply {
        let resp = req.send().await.unwrap_or_else(|e| panic!("{e:#}"));
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Reply { status, headers, text, json }
    }

    /// POSTs (or GETs, without a body) a turn route and reads its event stream to the end.
    pub async fn turn(
        &self,
        method: Method,
        path: &str,
        token: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> TurnReply {
        let mut req = self.request(method, path).bearer_auth(token);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap_or_else(|e| panic!("{path}: {e:#}"));
        let status = resp.status().as_u16();
        let response_headers = resp.headers().clone();
        if !resp
            .headers()
            .get("content-type")
            .is_some_and(|c| c.to_str().unwrap_or("").starts_with("text/event-stream"))
        {
            let text = resp.text().await.unwrap();
            return TurnReply {
                status,
                headers: response_headers,
                events: vec![],
                json: serde_json::from_str(&text).unwrap_or(Value::Null),
            };
        }
        let mut events = Vec::new();
        let mut stream = resp.bytes_stream().eventsource();
        while let Some(e) = stream.next().await {
            let e = e.unwrap();
            events.push(SseEvent {
                id: e.id.parse().unwrap(),
                event: e.event,
                data: serde_json::from_str(&e.data).unwrap(),
            });
        }
        TurnReply { status, headers: response_headers, events, json: Value::Null }
    }

    /// `text` sent to session `id` as `token` (`POST /v1/sessions/{id}/messages`), its
    /// stream read to the end.
    pub async fn message(&self, id: impl std::fmt::Display, token: &str, text: &str) -> TurnReply {
        let body = serde_json::json!({ "text": text });
        self.turn(Method::POST, &format!("/v1/sessions/{id}/messages"), token, Some(body), &[]).await
    }

    /// The raw response of [`Api::message`], for tests that read part of it.
    pub async fn message_request(
        &self,
        id: impl std::fmt::Display,
        token: &str,
        text: &str,
    ) -> reqwest::Response {
        let path = format!("/v1/sessions/{id}/messages");
        let req =
            self.request(Method::POST, &path).bearer_auth(token).json(&serde_json::json!({ "text": text }));
        req.send().await.unwrap_or_else(|e| panic!("{path}: {e:#}"))
    }

    /// Uploads `bytes` as file `name` (`POST /v1/files`, multipart field `file`).
    pub async fn upload(&self, token: &str, name: &str, bytes: &[u8]) -> Reply {
        let boundary = "turnlog-test-boundary-7d3f";
        let mut body = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .into_bytes();
        body.extend_from_slice(bytes);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let req = self
            .request(Method::POST, "/v1/files")
            .bearer_auth(token)
            .header("content-type", format!("multipart/form-data; boundary={boundary}"))
            .body(body);
        self.send(req).await
    }

    /// Imports `bytes` as an export file (`POST /v1/import`, multipart field `file`, with the
    /// field `format` when given).
    pub async fn import(&self, token: &str, format: Option<&str>, bytes: &[u8]) -> Reply {
        let boundary = "turnlog-test-boundary-9a1c";
        let mut body = Vec::new();
        if let Some(f) = format {
            body.extend_from_slice(
                format!("--{boundary}\r\nContent-Disposition: form-data; name=\"format\"\r\n\r\n{f}\r\n")
                    .as_bytes(),
            );
        }
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"export.json\"\r\n\
                 Content-Type: application/json\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let req = self
            .request(Method::POST, "/v1/import")
            .bearer_auth(token)
            .header("content-type", format!("multipart/form-data; boundary={boundary}"))
            .body(body);
        self.send(req).await
    }

    /// Alice's `decision` on permission request `permission` of session `id`.
    pub async fn decide(&self, id: SessionId, permission: &str, decision: &str) -> Reply {
        let path = format!("/v1/sessions/{id}/permissions/{permission}");
        self.call(Method::POST, &path, Some(ALICE), Body::Json(serde_json::json!({ "decision": decision })))
            .await
    }

    pub async fn get(&self, path: &str, token: &str) -> Reply {
        self.call(Method::GET, path, Some(token), Body::None).await
    }

    /// Creates a session through the API and returns its id.
    pub async fn create(&self, token: &str, title: Option<&str>) -> SessionId {
        let body = match title {
            Some(t) => serde_json::json!({ "title": t }),
            None => serde_json::json!({}),
        };
        let r = self.call(Method::POST, "/v1/sessions", Some(token), Body::Json(body)).await;
        assert_eq!(r.status, 201, "{}", r.text);
        r.json["id"].as_str().unwrap().parse().unwrap()
    }

    /// Appends an event as a producer would (the tool runner, the workers).
    pub async fn append(&self, session: SessionId, owner: &str, body: &EventBody) -> i64 {
        let req = AppendRequest::append(session, &Owner::parse(owner).unwrap(), Uuid::now_v7(), body);
        let outcome = append_and_wait(&self.bus, &self.env.pool, &req, WAIT).await.unwrap();
        assert_eq!(outcome.status, OutcomeStatus::Committed, "{outcome:?}");
        outcome.seq.unwrap()
    }

    /// Messages in TURNLOG_DEAD: requests the writer could not apply.
    pub async fn dead_letters(&self) -> u64 {
        let stream = self.bus.js.get_stream(self.bus.names.dead_stream()).await.unwrap();
        stream.get_info().await.unwrap().state.messages
    }

    /// Rows in the tables only the writer writes, and messages sent to it.
    pub async fn written(&self) -> (i64, i64, i64, u64) {
        let count = |table: &'static str| async move {
            let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
                .fetch_one(&self.env.pool)
                .await
                .unwrap();
            n
        };
        let stream = self.bus.js.get_stream(self.bus.names.append_stream()).await.unwrap();
        let sent = stream.get_info().await.unwrap().state.messages;
        (count("sessions").await, count("session_events").await, count("request_outcomes").await, sent)
    }
}
