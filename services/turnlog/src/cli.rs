//! The binary's command line: every subcommand's clap flags (each also an environment
//! variable) and the one place they become each service's plain config, so `turnlog
//! <service>` and `turnlog dev` build their services the same way and a setting means the
//! same everywhere.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand, ValueEnum as _};
use turnlog_core::budget::DEFAULT_BUDGET;
use turnlog_dev::Worker;
use turnlog_ingress::config::{DEFAULT_MAX_TURNS, DEFAULT_MAX_TURNS_PER_OWNER};
use turnlog_ingress::{ApiTokens, IngressConfig};
use turnlog_runtime::settings::{parse_duration, parse_replicas, Backbone, Secret};
use turnlog_runtime::upstream::{parse_model_windows, UpstreamConfig};

/// How long a worker waits for the writer to apply its append.
const WORKER_APPEND_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Parser)]
#[command(name = "turnlog", version, about = "Append-only chat sessions over HTTP/SSE")]
pub(crate) struct Cli {
    /// Log lines as readable text (`pretty`) or one JSON object each (`json`); RUST_LOG
    /// filters them (default `info`).
    #[arg(long, global = true, env = "TURNLOG_LOG_FORMAT", value_enum, default_value_t = LogFormat::Pretty)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum LogFormat {
    Pretty,
    Json,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Apply append requests to Postgres: the only process that writes it.
    Writer {
        #[command(flatten)]
        backbone: BackboneArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
    },
    /// Distill each finished turn into its turn_memory residue; title new sessions.
    Distiller {
        #[command(flatten)]
        worker: WorkerArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
    },
    /// Extract each finished turn's durable facts into memories.
    Memory {
        #[command(flatten)]
        worker: WorkerArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
    },
    /// Keep every session's next request within its token budget (post-turn and pre-send).
    Compactor {
        #[command(flatten)]
        worker: WorkerArgs,
        #[command(flatten)]
        compactor: CompactorArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
    },
    /// Run server tools (DESIGN §14): connect to the MCP servers TURNLOG_MCP_SERVERS names,
    /// offer their tools, and run the calls the turns send, each at most once.
    Tools {
        #[command(flatten)]
        backbone: BackboneArgs,
        #[command(flatten)]
        tools: ToolsArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
    },
    /// Serve the HTTP API: sessions, transcripts, context, memories.
    Ingress {
        #[command(flatten)]
        backbone: BackboneArgs,
        #[command(flatten)]
        args: Box<IngressArgs>,
    },
    /// Apply the database migrations and exit. With `--bus`, instead (the database is left
    /// alone, DATABASE_URL not needed): bring every stream and the lease bucket to
    /// TURNLOG_STREAM_REPLICAS replicas with a stream update (creating any that is missing)
    /// and print one line per stream, e.g. `TURNLOG_APPEND: replicas 1 → 3`.
    Migrate {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true, required_unless_present = "bus")]
        database_url: Option<Secret>,
        /// Migrate the NATS streams' replicas rather than the database.
        #[arg(long)]
        bus: bool,
        #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
        nats_url: String,
        #[command(flatten)]
        layout: BusArgs,
    },
    /// Run everything in one process for development: private Postgres and nats-server
    /// (unless DATABASE_URL / NATS_URL are set), the mock model (unless TURNLOG_LLM_URL is).
    Dev {
        #[command(flatten)]
        args: Box<DevArgs>,
    },
    /// Serve the deterministic OpenAI-compatible mock model.
    MockLlm {
        #[arg(long, env = "TURNLOG_MOCK_LISTEN", default_value = "127.0.0.1:8090")]
        listen: SocketAddr,
    },
    /// Run a worker again over past committed events, from a feed sequence or a time through
    /// the feed's end; idempotent, so it appends only what is missing.
    Replay {
        /// The worker whose handler runs again.
        #[arg(long, value_enum)]
        worker: WorkerKind,
        /// The TURNLOG_EVENTS sequence to start at.
        #[arg(long, required_unless_present = "since", conflicts_with = "since")]
        from_seq: Option<u64>,
        /// Start at this time: RFC 3339 (2026-05-01T12:00:00Z) or a duration ago (90m, 2d).
        #[arg(long, value_parser = turnlog_ops::parse_since)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Only this session's events.
        #[arg(long)]
        session: Option<turnlog_core::ids::SessionId>,
        #[command(flatten)]
        args: WorkerArgs,
        #[command(flatten)]
        compactor: CompactorArgs,
    },
    /// Rebuild the database from TURNLOG_APPEND into an empty one, with the writer's code.
    Rebuild {
        /// The empty database to rebuild into (never DATABASE_URL: name it on purpose).
        #[arg(long)]
        database_url: Secret,
        #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
        nats_url: String,
        #[command(flatten)]
        bus: BusArgs,
    },
    /// Compare two databases' sessions, events and memories; exit 0 only when identical
    /// (1 when they differ, 2 when they cannot be compared).
    Verify { url_a: String, url_b: String },
    /// Import conversations into an owner's sessions, through the writer: ChatGPT's
    /// conversations.json, ShareGPT JSON or JSON lines, or a turnlog export. Importing a file
    /// again adds nothing; running an interrupted import again completes it. Exits 1 when a
    /// conversation could not be imported.
    Import {
        /// The owner the sessions are created for.
        #[arg(long)]
        owner: String,
        /// chatgpt, sharegpt or turnlog; told from the file when absent.
        #[arg(long)]
        format: Option<String>,
        /// The export file.
        file: std::path::PathBuf,
        #[command(flatten)]
        backbone: BackboneArgs,
    },
    /// Read an HTML document on stdin and write its markdown to stdout: the ingress runs
    /// every HTML upload's conversion this way, in a process of its own.
    #[command(hide = true)]
    ConvertHtml,
    /// Write every session of an owner to stdout: turnlog (lossless JSON lines that
    /// `turnlog import` reads back), markdown, openai (a `{"messages": …}` line a session) or
    /// sharegpt (a JSON array).
    Export {
        #[arg(long)]
        owner: String,
        #[arg(long, default_value = "turnlog")]
        format: String,
        #[command(flatten)]
        backbone: BackboneArgs,
    },
    /// Inspect the dead letters (TURNLOG_DEAD) and redrive a writer's once its cause is fixed.
    Dead {
        #[command(subcommand)]
        command: DeadCommand,
        #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222", global = true)]
        nats_url: String,
        #[command(flatten)]
        bus: BusArgs,
    },
}

/// The workers (`turnlog_dev::Worker`), by the name of their subcommand.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum WorkerKind {
    Distiller,
    Memory,
    Compactor,
}

impl Command {
    /// The worker a worker's subcommand runs, and where it serves its metrics.
    pub(crate) fn worker(&self) -> Option<(anyhow::Result<Worker>, &MetricsArgs)> {
        match self {
            Command::Distiller { worker, metrics } => {
                Some((worker.distiller().map(Worker::Distiller), metrics))
            }
            Command::Memory { worker, metrics } => Some((worker.memory().map(Worker::Memory), metrics)),
            Command::Compactor { worker, compactor, metrics } => {
                Some((worker.compactor(compactor).map(Worker::Compactor), metrics))
            }
            _ => None,
        }
    }

    /// The name the process's spans carry (`service.name`), unless OTEL_SERVICE_NAME says.
    pub(crate) fn service_name(&self) -> &'static str {
        match self {
            Command::Writer { .. } => "turnlog-writer",
            Command::Distiller { .. } => "turnlog-distiller",
            Command::Memory { .. } => "turnlog-memory",
            Command::Compactor { .. } => "turnlog-compactor",
            Command::Tools { .. } => "turnlog-tools",
            Command::Ingress { .. } => "turnlog-ingress",
            Command::Dev { .. } => "turnlog-dev",
            _ => "turnlog",
        }
    }
}

/// Where a writer or worker serves its metrics.
#[derive(clap::Args, Clone)]
pub(crate) struct MetricsArgs {
    /// Serve Prometheus metrics (/metrics), /healthz and /readyz on this address, e.g.
    /// 0.0.0.0:9464. Unset: none (the ingress serves its own on its API port).
    #[arg(long, env = "TURNLOG_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

#[derive(Subcommand)]
pub(crate) enum DeadCommand {
    /// Every dead letter, oldest first: sequence, time, reason, session, detail.
    List,
    /// One dead letter whole, with how to redo it.
    Show { seq: u64 },
    /// Republish a writer's dead letter to TURNLOG_APPEND and wait for its outcome; it is
    /// applied once, however often it is redriven.
    Redrive {
        seq: u64,
        /// Asked for the outcome should the writer's reply be lost.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: Option<Secret>,
        #[arg(long, default_value = "15s", value_parser = parse_duration)]
        timeout: Duration,
    },
}

/// Where the log and the bus are: shared by every subcommand that reaches them.
#[derive(clap::Args, Clone)]
pub(crate) struct BackboneArgs {
    /// Postgres, e.g. postgres://user:password@host:5432/turnlog.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Secret,
    /// NATS with JetStream.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: Secret,
    #[command(flatten)]
    pub bus: BusArgs,
    #[command(flatten)]
    pub reads: ReadArgs,
}

/// How the services that only read Postgres (the ingress and the workers) bound their
/// queries. The writer's commits and `turnlog rebuild` / `verify` are not bounded.
#[derive(clap::Args, Clone)]
pub(crate) struct ReadArgs {
    /// Longest run of one read query (e.g. 5s, 800ms): past it Postgres cancels the query,
    /// a client gets 503 with Retry-After and a worker retries the event later.
    #[arg(long, env = "TURNLOG_STATEMENT_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub statement_timeout: Duration,
}

/// How the bus is laid out on the NATS server.
#[derive(clap::Args, Clone)]
pub(crate) struct BusArgs {
    /// Prefix of every stream and subject name, so deployments can share a NATS server.
    #[arg(long, env = "TURNLOG_BUS_PREFIX", default_value = "turnlog")]
    pub bus_prefix: String,
    /// Writer partitions (a stable hash of the session id); fixed for a deployment.
    #[arg(long, env = "TURNLOG_PARTITIONS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub partitions: u32,
    /// Replicas of every stream and the lease bucket (1, 3 or 5; 3 on a NATS cluster) when
    /// created; `turnlog migrate --bus` changes existing ones.
    #[arg(long, env = "TURNLOG_STREAM_REPLICAS", default_value_t = 1, value_parser = parse_replicas)]
    pub stream_replicas: usize,
    /// How long TURNLOG_APPEND keeps requests (e.g. 30d); unlimited by default, so the
    /// database can be rebuilt from it.
    #[arg(long, env = "TURNLOG_APPEND_MAX_AGE", value_parser = parse_duration)]
    pub append_max_age: Option<Duration>,
}

impl BusArgs {
    /// The bus at `nats_url` laid out by these flags (prefix, partitions, replicas), for the
    /// operator commands that take NATS_URL on its own.
    pub(crate) async fn connect(
        &self,
        nats_url: &str,
    ) -> Result<turnlog_runtime::bus::Bus, turnlog_runtime::bus::BusError> {
        Ok(turnlog_runtime::bus::Bus::connect(nats_url, &self.bus_prefix, self.partitions)
            .await?
            .with_replicas(self.stream_replicas))
    }
}

/// A worker's flags: where the log is, its models and its tuning.
#[derive(clap::Args, Clone)]
pub(crate) struct WorkerArgs {
    #[command(flatten)]
    pub backbone: BackboneArgs,
    #[command(flatten)]
    pub models: WorkerModels,
    #[command(flatten)]
    pub tuning: WorkerTuning,
}

/// The model gateway and the models the workers call.
#[derive(clap::Args, Clone)]
pub(crate) struct WorkerModels {
    /// Base URL of the OpenAI-compatible gateway, ending in /v1.
    #[arg(long, env = "TURNLOG_LLM_URL")]
    pub llm_url: String,
    #[arg(long, env = "TURNLOG_LLM_API_KEY", hide_env_values = true)]
    pub llm_api_key: Option<Secret>,
    /// The chat model: its window sizes the compaction budget when a turn names none.
    #[arg(long, env = "TURNLOG_MODEL")]
    pub model: String,
    #[command(flatten)]
    pub tasks: TaskModels,
    /// Context windows that win over the gateway's /models: `model=tokens,...`.
    #[arg(long, env = "TURNLOG_MODEL_WINDOWS", default_value = "")]
    pub model_windows: String,
    /// The compaction budget when the model's window is unknown.
    #[arg(long, env = "TURNLOG_CONTEXT_BUDGET", default_value_t = DEFAULT_BUDGET)]
    pub context_budget: u32,
    /// How long a turn's tool traffic stays in the model's history: `turn` (within its turn)
    /// or `keep` (until a compaction); the ingress's setting, which the compactor must share.
    #[arg(long, env = "TURNLOG_TOOL_HISTORY", default_value = "turn")]
    pub tool_history: turnlog_core::llm_context::ToolHistory,
    /// Deadline of one worker model call (e.g. 120s).
    #[arg(long, env = "TURNLOG_UPSTREAM_TIMEOUT", default_value = "120s", value_parser = parse_duration)]
    pub upstream_timeout: Duration,
}

/// The models of the workers' own calls, when they differ from the chat model.
#[derive(clap::Args, Clone)]
pub(crate) struct TaskModels {
    /// Distillation, memory extraction and titles (default: TURNLOG_MODEL).
    #[arg(long, env = "TURNLOG_MINI_MODEL")]
    pub mini_model: Option<String>,
    /// Compaction summaries (default: TURNLOG_MODEL).
    #[arg(long, env = "TURNLOG_SUMMARY_MODEL")]
    pub summary_model: Option<String>,
}

/// How a worker consumes the committed-event feed.
#[derive(clap::Args, Clone)]
pub(crate) struct WorkerTuning {
    /// Events one copy of the worker handles at once.
    #[arg(long, env = "TURNLOG_WORKER_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub worker_concurrency: u32,
    /// Deliveries of an event before it goes to the dead letters.
    #[arg(long, env = "TURNLOG_WORKER_MAX_DELIVER", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub worker_max_deliver: u32,
    /// How long an event may go unacknowledged before it is redelivered (workers report
    /// progress while they work, so this bounds only a dead copy's hold).
    #[arg(long, env = "TURNLOG_WORKER_ACK_WAIT", default_value = "60s", value_parser = parse_duration)]
    pub worker_ack_wait: Duration,
    /// Delays before each redelivery after a failure, the last repeating: `2s,10s,30s,60s`.
    #[arg(long, env = "TURNLOG_WORKER_RETRY_BACKOFF", default_value = "2s,10s,30s,60s", value_delimiter = ',', value_parser = parse_duration)]
    pub worker_retry_backoff: Vec<Duration>,
}

/// The compactor's own settings.
#[derive(clap::Args, Clone)]
pub(crate) struct CompactorArgs {
    /// Longest wait for the extracted facts of the turns a summary replaces.
    #[arg(long, env = "TURNLOG_FACTS_WAIT", default_value = "5s", value_parser = parse_duration)]
    pub facts_wait: Duration,
}

/// Flags of `turnlog tools` (and of `turnlog dev`, which runs it when servers are configured).
#[derive(clap::Args, Clone)]
pub(crate) struct ToolsArgs {
    /// The MCP servers file (TOML, DESIGN §14): `[[servers]]` with a label, `command` +
    /// `args` (stdio) or `url` (streamable HTTP), filters, owners and per-tool policies.
    #[arg(long = "mcp-servers", env = "TURNLOG_MCP_SERVERS")]
    pub mcp_servers: Option<PathBuf>,
    /// The longest a call may run (e.g. 60s); give the ingress the same.
    #[arg(long = "tool-timeout", env = "TURNLOG_TOOL_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub tool_timeout: Duration,
    /// Calls one copy runs at once.
    #[arg(long, env = "TURNLOG_TOOL_CONCURRENCY", default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
    pub tool_concurrency: usize,
    /// The bytes of a result's output the model is sent (longer is cut, with a note).
    #[arg(long = "tool-output-max", env = "TURNLOG_TOOL_OUTPUT_MAX", default_value_t = turnlog_tools::DEFAULT_OUTPUT_MAX, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(256..=1_048_576))]
    pub tool_output_max: usize,
}

impl ToolsArgs {
    /// The worker's config; None without a servers file. A bad file is an error naming its line.
    pub(crate) fn config(&self, backbone: Backbone) -> anyhow::Result<Option<turnlog_tools::ToolsConfig>> {
        let Some(file) = self.mcp_servers.clone().filter(|f| !f.as_os_str().is_empty()) else {
            return Ok(None);
        };
        let mut config = turnlog_tools::ToolsConfig::load(backbone, file)?;
        config.timeout = self.tool_timeout;
        config.concurrency = self.tool_concurrency;
        config.output_max = self.tool_output_max;
        Ok(Some(config))
    }
}

/// Flags of `turnlog ingress` beyond the backbone (database, NATS, bus prefix, partitions).
#[derive(clap::Args, Clone)]
pub(crate) struct IngressArgs {
    /// Address to serve HTTP on. Without API tokens only a loopback address is accepted.
    #[arg(long, env = "TURNLOG_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// `owner:token,...`; unset means no authentication (loopback only, owner `local`).
    #[arg(long, env = "TURNLOG_API_TOKENS", hide_env_values = true)]
    pub api_tokens: Option<Secret>,
    /// OpenAI-compatible base URL ending in `/v1`.
    #[arg(long, env = "TURNLOG_LLM_URL")]
    pub llm_url: Option<String>,
    #[arg(long, env = "TURNLOG_LLM_API_KEY", hide_env_values = true)]
    pub llm_api_key: Option<Secret>,
    /// The default model turns are sent to.
    #[arg(long, env = "TURNLOG_MODEL", default_value = "mock")]
    pub model: String,
    /// `model,...`: the models a client may ask for; unset or empty means any.
    #[arg(long, env = "TURNLOG_ALLOWED_MODELS")]
    pub allowed_models: Option<String>,
    /// `category=model,...`: the model a message's category picks when it names none.
    #[arg(long, env = "TURNLOG_CATEGORY_MODELS", default_value = "")]
    pub category_models: String,
    /// Header names, comma-separated, that name a session family on
    /// `POST /v1/chat/completions` (X-Session-Id always does).
    #[arg(long, env = "TURNLOG_COMPAT_SESSION_HEADERS", default_value = turnlog_ingress::config::DEFAULT_COMPAT_SESSION_HEADERS)]
    pub compat_session_headers: String,
    /// `model=tokens,...`: context windows that win over what the gateway lists.
    #[arg(long, env = "TURNLOG_MODEL_WINDOWS", default_value = "")]
    pub model_windows: String,
    /// Token budget of a request when the model's window is unknown.
    #[arg(long, env = "TURNLOG_CONTEXT_BUDGET", default_value_t = DEFAULT_BUDGET)]
    pub context_budget: u32,
    /// How long a turn's tool traffic stays in the model's history (DESIGN §14): `turn`
    /// (within its turn) or `keep` (until a compaction summarizes it).
    #[arg(long, env = "TURNLOG_TOOL_HISTORY", default_value = "turn")]
    pub tool_history: turnlog_core::llm_context::ToolHistory,
    #[arg(long, env = "TURNLOG_SYSTEM_PROMPT", default_value = "")]
    pub system_prompt: String,
    /// Longest wait for the model's first byte and between two streamed chunks (e.g. 90s).
    #[arg(long, env = "TURNLOG_UPSTREAM_TIMEOUT", default_value = "120s", value_parser = parse_duration)]
    pub upstream_timeout: Duration,
    /// How long a turn waits for the compactor's pre-send check (e.g. 30s).
    #[arg(long, env = "TURNLOG_COMPACT_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub compact_timeout: Duration,
    /// How long a write waits for the writer before a 503 (e.g. 15s on a NATS cluster, where
    /// a leader election pauses writes for 4–9 s).
    #[arg(long, env = "TURNLOG_APPEND_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub append_timeout: Duration,
    /// Turns one owner may run at once on this copy; more are refused with 429.
    #[arg(long, env = "TURNLOG_MAX_TURNS_PER_OWNER", default_value_t = DEFAULT_MAX_TURNS_PER_OWNER, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_turns_per_owner: u32,
    /// Turns this copy runs at once, all owners together; more are refused with 429.
    #[arg(long, env = "TURNLOG_MAX_TURNS", default_value_t = DEFAULT_MAX_TURNS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_turns: u32,
    /// Where uploaded files' bytes live: `file:///dir` or `s3://bucket/prefix` (with the usual
    /// AWS_* variables). Default: `files` under TURNLOG_DATA_DIR (`.turnlog/files`).
    #[arg(long, env = "TURNLOG_FILES_URL")]
    pub files_url: Option<String>,
    /// The largest upload, in bytes.
    #[arg(long, env = "TURNLOG_FILE_MAX_BYTES", default_value_t = turnlog_ingress::config::DEFAULT_FILE_MAX_BYTES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_073_741_824))]
    pub file_max_bytes: usize,
    /// `model,...`: the models sent images; unset or empty means every model. Others are
    /// sent a short note in each image's place.
    #[arg(long, env = "TURNLOG_VISION_MODELS")]
    pub vision_models: Option<String>,
    /// How long a deleted file's bytes are kept before they may be swept (e.g. 1h).
    #[arg(long, env = "TURNLOG_FILE_SWEEP_DELAY", default_value = "1h", value_parser = parse_duration)]
    pub file_sweep_delay: Duration,
    /// The largest file `POST /v1/import` takes, in bytes.
    #[arg(long, env = "TURNLOG_IMPORT_MAX_BYTES", default_value_t = turnlog_ingress::config::DEFAULT_IMPORT_MAX_BYTES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=17_179_869_184))]
    pub import_max_bytes: usize,
    /// The longest converting an uploaded document (HTML, PDF) may take (e.g. 30s).
    #[arg(long, env = "TURNLOG_CONVERT_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub convert_timeout: Duration,
    /// The longest an upload's body may send nothing (e.g. 30s); also the start it gets
    /// before TURNLOG_UPLOAD_MIN_RATE applies.
    #[arg(long, env = "TURNLOG_UPLOAD_READ_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub upload_read_timeout: Duration,
    /// The bytes a second an upload's body must average (after TURNLOG_UPLOAD_READ_TIMEOUT).
    #[arg(long, env = "TURNLOG_UPLOAD_MIN_RATE", default_value_t = turnlog_ingress::config::DEFAULT_UPLOAD_MIN_RATE, value_parser = clap::value_parser!(u64).range(1..))]
    pub upload_min_rate: u64,
    /// The model calls one turn may make (DESIGN §14); a turn whose last allowed call still
    /// asks for tools fails `too_many_steps`.
    #[arg(long, env = "TURNLOG_MAX_TOOL_STEPS", default_value_t = turnlog_ingress::config::DEFAULT_MAX_TOOL_STEPS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
    pub max_tool_steps: usize,
    /// The bytes of a tool's output the model is sent (longer is cut, with a note).
    #[arg(long, env = "TURNLOG_TOOL_OUTPUT_MAX", default_value_t = turnlog_ingress::config::DEFAULT_TOOL_OUTPUT_MAX, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(256..=1_048_576))]
    pub tool_output_max: usize,
    /// The longest a server tool's call may run (e.g. 60s); give the tools worker the same.
    #[arg(long, env = "TURNLOG_TOOL_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub tool_timeout: Duration,
    /// How long a live turn waits for a permission answer before it pauses (e.g. 2m).
    #[arg(long, env = "TURNLOG_PERMISSION_WAIT", default_value = "2m", value_parser = parse_duration)]
    pub permission_wait: Duration,
}

/// The flags of `turnlog dev`: where its private servers live, the servers to use instead,
/// and every service's settings.
#[derive(clap::Args, Clone)]
pub(crate) struct DevArgs {
    /// Where the private Postgres and nats-server keep their data and recorded ports.
    #[arg(long, env = "TURNLOG_DATA_DIR", default_value = ".turnlog")]
    pub data_dir: PathBuf,
    /// A Postgres to use instead of the private one.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<Secret>,
    /// A NATS server (JetStream on) to use instead of the private one.
    #[arg(long, env = "NATS_URL")]
    pub nats_url: Option<String>,
    #[command(flatten)]
    pub bus: BusArgs,
    #[command(flatten)]
    pub reads: ReadArgs,
    #[command(flatten)]
    pub ingress: IngressArgs,
    #[command(flatten)]
    pub tasks: TaskModels,
    #[command(flatten)]
    pub tuning: WorkerTuning,
    #[command(flatten)]
    pub compactor: CompactorArgs,
    /// TURNLOG_MCP_SERVERS: when set, the tools worker runs too.
    #[arg(long = "mcp-servers", env = "TURNLOG_MCP_SERVERS")]
    pub mcp_servers: Option<PathBuf>,
    /// Calls the tools worker runs at once.
    #[arg(long, env = "TURNLOG_TOOL_CONCURRENCY", default_value_t = 16)]
    pub tool_concurrency: usize,
}

impl BackboneArgs {
    pub(crate) fn backbone(&self) -> Backbone {
        Backbone {
            database_url: self.database_url.clone(),
            nats_url: self.nats_url.clone(),
            bus_prefix: self.bus.bus_prefix.clone(),
            partitions: self.bus.partitions,
            stream_replicas: self.bus.stream_replicas,
            append_max_age: self.bus.append_max_age,
            statement_timeout: self.reads.statement_timeout,
        }
    }

    pub(crate) fn writer(&self) -> turnlog_writer::WriterConfig {
        turnlog_writer::WriterConfig { backbone: self.backbone() }
    }

    pub(crate) fn ingress(&self, args: IngressArgs) -> anyhow::Result<IngressConfig> {
        ingress_config(self.backbone(), args)
    }
}

impl WorkerArgs {
    /// The worker `kind` on these flags (and the compactor's own).
    pub(crate) fn worker(&self, kind: WorkerKind, compactor: &CompactorArgs) -> anyhow::Result<Worker> {
        Ok(match kind {
            WorkerKind::Distiller => Worker::Distiller(self.distiller()?),
            WorkerKind::Memory => Worker::Memory(self.memory()?),
            WorkerKind::Compactor => Worker::Compactor(self.compactor(compactor)?),
        })
    }

    pub(crate) fn distiller(&self) -> anyhow::Result<turnlog_distiller::DistillerConfig> {
        self.turn_worker()
    }

    pub(crate) fn memory(&self) -> anyhow::Result<turnlog_memory::MemoryConfig> {
        self.turn_worker()
    }

    /// The distiller's and memory extraction's config.
    fn turn_worker(&self) -> anyhow::Result<turnlog_runtime::turn_worker::TurnWorkerConfig> {
        let models = &self.models;
        Ok(turnlog_runtime::turn_worker::TurnWorkerConfig {
            backbone: self.backbone.backbone(),
            upstream: models.upstream()?,
            mini_model: models.mini_model(),
            consumer: self.tuning.settings(),
            call_deadline: models.upstream_timeout,
            append_timeout: WORKER_APPEND_TIMEOUT,
        })
    }

    pub(crate) fn compactor(
        &self,
        compactor: &CompactorArgs,
    ) -> anyhow::Result<turnlog_compactor::CompactorConfig> {
        let models = &self.models;
        Ok(turnlog_compactor::CompactorConfig {
            backbone: self.backbone.backbone(),
            upstream: models.upstream()?,
            summary_model: models.summary_model(),
            model: models.model.clone(),
            context_budget: models.context_budget,
            consumer: self.tuning.settings(),
            facts_wait: compactor.facts_wait,
            summary_deadline: models.upstream_timeout,
            append_timeout: WORKER_APPEND_TIMEOUT,
            tool_history: models.tool_history,
        })
    }
}

impl WorkerModels {
    /// The workers' models on the gateway the ingress is given, so `turnlog dev` configures
    /// the gateway once for every service.
    pub(crate) fn from_ingress(args: &IngressArgs, llm_url: String, tasks: TaskModels) -> Self {
        Self {
            llm_url,
            llm_api_key: args.llm_api_key.clone(),
            model: args.model.clone(),
            tasks,
            model_windows: args.model_windows.clone(),
            context_budget: args.context_budget,
            tool_history: args.tool_history,
            upstream_timeout: args.upstream_timeout,
        }
    }

    fn upstream(&self) -> anyhow::Result<UpstreamConfig> {
        let windows_override = parse_model_windows(&self.model_windows)
            .map_err(|e| anyhow::anyhow!("TURNLOG_MODEL_WINDOWS: {e}"))?;
        anyhow::ensure!(!self.llm_url.trim().is_empty(), "TURNLOG_LLM_URL is empty");
        anyhow::ensure!(!self.model.trim().is_empty(), "TURNLOG_MODEL must name a model");
        Ok(UpstreamConfig {
            base_url: self.llm_url.clone().into(),
            api_key: self.llm_api_key.clone().filter(|k| !k.is_empty()),
            timeout: self.upstream_timeout,
            windows_override,
        })
    }

    fn mini_model(&self) -> String {
        self.tasks.mini_model.clone().unwrap_or_else(|| self.model.clone())
    }

    fn summary_model(&self) -> String {
        self.tasks.summary_model.clone().unwrap_or_else(|| self.model.clone())
    }
}

impl WorkerTuning {
    pub(crate) fn settings(&self) -> turnlog_runtime::worker::ConsumerSettings {
        turnlog_runtime::worker::ConsumerSettings {
            concurrency: usize::try_from(self.worker_concurrency).unwrap_or(1),
            max_deliver: self.worker_max_deliver,
            ack_wait: self.worker_ack_wait,
            retry_backoff: self.worker_retry_backoff.clone(),
            replay: None,
        }
    }
}

/// The ingress's flags as its validated config on `backbone`.
fn ingress_config(backbone: Backbone, args: IngressArgs) -> anyhow::Result<IngressConfig> {
    let tokens = match &args.api_tokens {
        Some(spec) => ApiTokens::parse(spec.expose()).context("TURNLOG_API_TOKENS")?,
        None => ApiTokens::default(),
    };
    let model_windows = parse_model_windows(&args.model_windows)
        .map_err(anyhow::Error::msg)
        .context("TURNLOG_MODEL_WINDOWS")?;
    let upstream = args.llm_url.filter(|u| !u.trim().is_empty()).map(|base_url| UpstreamConfig {
        base_url: base_url.into(),
        api_key: args.llm_api_key.filter(|k| !k.is_empty()),
        timeout: args.upstream_timeout,
        windows_override: model_windows.clone(),
    });
    if args.model.trim().is_empty() {
        bail!("TURNLOG_MODEL must name a model");
    }
    let allowed_models = args.allowed_models.as_deref().and_then(parse_allowed_models);
    if let Some(allowed) = &allowed_models {
        if !allowed.contains(&args.model) {
            bail!(
                "TURNLOG_MODEL {:?} is not in TURNLOG_ALLOWED_MODELS ({}): allow it, or choose one of those",
                args.model,
                allowed.join(", ")
            );
        }
    }
    let category_models =
        IngressConfig::parse_category_models(&args.category_models, allowed_models.as_deref())
            .context("TURNLOG_CATEGORY_MODELS")?;
    let config = IngressConfig {
        listen: args.listen,
        tokens,
        upstream,
        model_windows,
        model: args.model,
        allowed_models,
        category_models,
        context_budget: args.context_budget,
        system_prompt: args.system_prompt,
        compact_timeout: args.compact_timeout,
        append_timeout: args.append_timeout,
        turn_limits: turnlog_ingress::turn::TurnLimits {
            per_owner: args.max_turns_per_owner,
            total: args.max_turns,
        },
        compat_session_headers: turnlog_ingress::config::parse_session_headers(&args.compat_session_headers),
        files_url: Some(
            args.files_url
                .filter(|u| !u.trim().is_empty())
                .unwrap_or_else(|| format!("file://{DEFAULT_FILES_DIR}")),
        ),
        file_max_bytes: args.file_max_bytes,
        vision_models: args.vision_models.as_deref().and_then(parse_allowed_models),
        file_sweep_delay: args.file_sweep_delay,
        import_max_bytes: args.import_max_bytes,
        // HTML is converted by this binary's `convert-html`, in a process of its own.
        html_converter: std::env::current_exe().ok(),
        convert_timeout: args.convert_timeout,
        upload_read_timeout: args.upload_read_timeout,
        upload_min_rate: args.upload_min_rate,
        max_tool_steps: args.max_tool_steps,
        tool_output_max: args.tool_output_max,
        tool_history: args.tool_history,
        tool_timeout: args.tool_timeout,
        permission_wait: args.permission_wait,
        ..IngressConfig::new(backbone)
    };
    config.check_listen(args.listen)?;
    config.check_system_prompt()?;
    Ok(config)
}

/// Where `turnlog ingress` keeps uploaded files without TURNLOG_FILES_URL: where `turnlog
/// dev` keeps them with its default data directory.
const DEFAULT_FILES_DIR: &str = ".turnlog/files";

/// `TURNLOG_ALLOWED_MODELS`: names separated by commas, blanks ignored; None when it names
/// none (any model is allowed).
fn parse_allowed_models(spec: &str) -> Option<Vec<String>> {
    let models: Vec<String> =
        spec.split(',').map(str::trim).filter(|m| !m.is_empty()).map(str::to_owned).collect();
    (!models.is_empty()).then_some(models)
}

impl DevArgs {
    /// `turnlog dev`'s config, checked before anything starts: each service's config is
    /// built by the code that builds it for the other subcommands, against stand-in
    /// servers and gateway that `turnlog dev` replaces with the real ones.
    pub(crate) fn config(mut self) -> anyhow::Result<turnlog_dev::DevConfig> {
        // An empty variable (`DATABASE_URL=`) means "not set", as a shell user expects.
        self.database_url = self.database_url.filter(|u| !u.expose().trim().is_empty());
        self.nats_url = self.nats_url.filter(|u| !u.trim().is_empty());
        self.ingress.llm_url = self.ingress.llm_url.filter(|u| !u.trim().is_empty());
        let backbone = BackboneArgs {
            database_url: "postgres://stand-in".into(),
            nats_url: "nats://stand-in".into(),
            bus: self.bus.clone(),
            reads: self.reads.clone(),
        };
        let llm_url = "http://stand-in/v1";
        let mut ingress = self.ingress.clone();
        ingress.llm_url = Some(llm_url.to_owned());
        // Files live beside the private servers' data unless told otherwise.
        let data_dir = std::path::absolute(&self.data_dir).context("TURNLOG_DATA_DIR")?;
        if ingress.files_url.as_deref().is_none_or(|u| u.trim().is_empty()) {
            ingress.files_url = Some(format!("file://{}", data_dir.join("files").display()));
        }
        let models = WorkerModels::from_ingress(&ingress, llm_url.to_owned(), self.tasks.clone());
        let worker = WorkerArgs { backbone: backbone.clone(), models, tuning: self.tuning.clone() };
        let services = turnlog_dev::ServiceConfigs {
            writer: Some(backbone.writer()),
            ingress: backbone.ingress(ingress)?,
            workers: WorkerKind::value_variants()
                .iter()
                .map(|&kind| worker.worker(kind, &self.compactor))
                .collect::<anyhow::Result<_>>()?,
            tools: ToolsArgs {
                mcp_servers: self.mcp_servers.clone(),
                tool_timeout: self.ingress.tool_timeout,
                tool_concurrency: self.tool_concurrency,
                tool_output_max: self.ingress.tool_output_max,
            }
            .config(backbone.backbone())?,
        };
        Ok(turnlog_dev::DevConfig {
            data_dir,
            database_url: self.database_url,
            nats_url: self.nats_url,
            llm_url: self.ingress.llm_url,
            services,
        })
    }
}

/// Parses the command line and environment into `P`, or exits: clap's own message, plus
/// (clap names only the flag, `--partitions <PARTITIONS>`) which environment variable
/// carried a bad value, when one did.
pub(crate) fn parse_or_exit<P: clap::Parser>() -> P {
    match P::try_parse() {
        Ok(parsed) => parsed,
        Err(e) => {
            let note = env_source(&P::command(), &e);
            // Nothing more can be reported when stderr itself is gone.
            let _ = e.print();
            if let Some(var) = note {
                eprintln!("note: the value comes from the environment variable {var}");
            }
            std::process::exit(e.exit_code());
        }
    }
}

/// The environment variable that supplied the value `err` complains about, if any.
fn env_source(command: &clap::Command, err: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    let ContextValue::String(arg) = err.get(ContextKind::InvalidArg)? else {
        return None;
    };
    let ContextValue::String(value) = err.get(ContextKind::InvalidValue)? else {
        return None;
    };
    let long = arg.strip_prefix("--")?.split([' ', '=']).next()?;
    let var = env_of(command, long)?;
    // A list setting (`2s,0s`) is reported one bad element at a time.
    let set = std::env::var(&var).ok()?;
    set.contains(value.as_str()).then_some(var)
}

fn env_of(command: &clap::Command, long: &str) -> Option<String> {
    command
        .get_arguments()
        .find(|a| a.get_long() == Some(long))
        .and_then(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .or_else(|| command.get_subcommands().find_map(|s| env_of(s, long)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(clap::Subcommand)]
    enum Sub {
        Writer {
            #[command(flatten)]
            backbone: BackboneArgs,
        },
    }

    /// The settings table of docs/operating.md names every variable the binary reads and
    /// nothing else: each one clap reads (every flag of every subcommand), and the two read
    /// before clap (the log filter; OpenTelemetry's endpoint, whose row names the other
    /// standard OTEL_ variables).
    #[test]
    fn the_settings_table_names_every_setting_and_nothing_else() {
        fn read_by(command: &clap::Command, into: &mut std::collections::BTreeSet<String>) {
            into.extend(
                command.get_arguments().filter_map(|a| Some(a.get_env()?.to_string_lossy().into_owned())),
            );
            for sub in command.get_subcommands() {
                read_by(sub, into);
            }
        }
        let command = <super::Cli as clap::CommandFactory>::command();
        let mut read = std::collections::BTreeSet::new();
        read_by(&command, &mut read);
        read.extend(["RUST_LOG", "OTEL_EXPORTER_OTLP_ENDPOINT"].map(String::from));
        let doc = include_str!("../../../docs/operating.md");
        let table = &doc[doc.find("## Settings").unwrap()..doc.find("## Operating notes").unwrap()];
        let documented: std::collections::BTreeSet<String> = table
            .lines()
            .filter_map(|row| row.strip_prefix("| `")?.split('`').next())
            .map(String::from)
            .collect();
        assert_eq!(read, documented, "variables read (left) and the settings table's rows (right)");
    }

    #[test]
    fn a_bad_value_is_traced_to_its_variable() {
        let command = <Cli as clap::CommandFactory>::command();
        let err = match Cli::try_parse_from(["t", "writer", "--database-url", "x", "--partitions", "0"]) {
            Ok(_) => panic!("0 partitions accepted"),
            Err(e) => e,
        };
        // The value came from a flag, not the environment: no variable is named.
        assert_eq!(env_source(&command, &err), None);
        assert_eq!(env_of(&command, "partitions").as_deref(), Some("TURNLOG_PARTITIONS"));
        assert_eq!(env_of(&command, "no-such-flag"), None);
    }

    #[test]
    fn stream_replicas_are_one_three_or_five_and_reach_the_backbone() {
        let writer = |extra: &[&str]| {
            Cli::try_parse_from(
                ["t", "writer", "--database-url", "x"].into_iter().chain(extra.iter().copied()),
            )
        };
        let replicas = |extra: &[&str]| match writer(extra) {
            Ok(Cli { command: Sub::Writer { backbone } }) => backbone.backbone().stream_replicas,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(replicas(&[]), 1);
        assert_eq!(replicas(&["--stream-replicas", "3"]), 3);
        assert_eq!(replicas(&["--stream-replicas", "5"]), 5);
        for bad in ["0", "2", "4", "three"] {
            assert!(writer(&["--stream-replicas", bad]).is_err(), "{bad}");
        }
        let command = <Cli as clap::CommandFactory>::command();
        assert_eq!(env_of(&command, "stream-replicas").as_deref(), Some("TURNLOG_STREAM_REPLICAS"));
    }

    #[test]
    fn migrate_needs_a_database_unless_it_migrates_the_bus() {
        let parse = |args: &[&str]| super::Cli::try_parse_from(["turnlog", "migrate"].iter().chain(args));
        let database = |cli: super::Cli| match cli.command {
            super::Command::Migrate { database_url, bus, .. } => (database_url.is_some(), bus),
            _ => panic!("not migrate"),
        };
        // DATABASE_URL may be set in the environment running the tests.
        if std::env::var_os("DATABASE_URL").is_none() {
            assert!(parse(&[]).is_err(), "the database migration needs DATABASE_URL");
            assert_eq!(database(parse(&["--bus"]).unwrap()), (false, true));
        }
        assert_eq!(database(parse(&["--database-url", "postgres://x"]).unwrap()), (true, false));
    }

    /// A worker's flags: where the log is, its models and tuning.
    #[derive(Parser)]
    struct Worker {
        #[command(flatten)]
        worker: WorkerArgs,
        #[command(flatten)]
        compactor: CompactorArgs,
    }

    #[derive(Parser)]
    struct Ingress {
        #[command(flatten)]
        args: IngressArgs,
    }

    #[test]
    fn the_statement_timeout_reaches_every_reading_service() {
        let worker = ["t", "--database-url", "x", "--llm-url", "http://m/v1", "--model", "m"];
        let ingress = || Ingress::try_parse_from(["t"]).unwrap().args;
        let default = Worker::try_parse_from(worker).unwrap();
        assert_eq!(default.worker.backbone.reads.statement_timeout, Duration::from_secs(5));
        let set = Worker::try_parse_from(worker.into_iter().chain(["--statement-timeout", "750ms"])).unwrap();
        let (w, b) = (&set.worker, &set.worker.backbone);
        let expected = Duration::from_millis(750);
        assert_eq!(b.ingress(ingress()).unwrap().backbone.statement_timeout, expected);
        assert_eq!(w.distiller().unwrap().backbone.statement_timeout, expected);
        assert_eq!(w.memory().unwrap().backbone.statement_timeout, expected);
        assert_eq!(w.compactor(&set.compactor).unwrap().backbone.statement_timeout, expected);
        let command = <Worker as clap::CommandFactory>::command();
        assert_eq!(env_of(&command, "statement-timeout").as_deref(), Some("TURNLOG_STATEMENT_TIMEOUT"));
        assert!(Worker::try_parse_from(worker.into_iter().chain(["--statement-timeout", "0s"])).is_err());
    }

    fn backbone() -> Backbone {
        Backbone::new("", "", "turnlog")
    }

    /// The flags as `turnlog ingress` parses them (`TURNLOG_API_TOKENS` from the environment
    /// left out; the other settings' variables still count).
    fn args(flags: &[&str]) -> IngressArgs {
        let mut args =
            Ingress::try_parse_from(std::iter::once("ingress").chain(flags.iter().copied())).unwrap().args;
        args.api_tokens = None;
        args
    }

    #[test]
    fn allowed_models_limit_what_a_message_may_ask_for() {
        let any = ingress_config(backbone(), args(&["--allowed-models", " , "])).unwrap();
        assert!(any.allowed_models.is_none() && any.allows_model("whatever"));
        let flags = ["--model", "gpt-small", "--allowed-models", "gpt-small, gpt-large ,"];
        let c = ingress_config(backbone(), args(&flags)).unwrap();
        assert_eq!(c.allowed_models, Some(vec!["gpt-small".to_owned(), "gpt-large".to_owned()]));
        assert!(c.allows_model("gpt-large") && !c.allows_model("gpt") && !c.allows_model("mock"));
        // The default model must itself be allowed.
        let err = ingress_config(backbone(), args(&["--allowed-models", "gpt-small"])).unwrap_err();
        let err = format!("{err:#}");
        assert!(err.contains("TURNLOG_ALLOWED_MODELS") && err.contains("\"mock\""), "{err}");
    }

    #[test]
    fn secrets_parse_from_flags_and_never_print() {
        let set = Worker::try_parse_from([
            "t",
            "--database-url",
            "postgres://u:pw-1@db/turnlog",
            "--llm-url",
            "http://m/v1",
            "--model",
            "m",
            "--llm-api-key",
            "sk-live-1",
        ])
        .unwrap();
        let config = set.worker.distiller().unwrap();
        assert_eq!(config.backbone.database_url.expose(), "postgres://u:pw-1@db/turnlog");
        let shown = format!("{config:?}");
        assert!(
            !shown.contains("pw-1") && !shown.contains("sk-live-1") && shown.contains("db/turnlog"),
            "{shown}"
        );
    }
}
