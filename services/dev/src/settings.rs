//! The settings every subcommand shares — clap flags, each also an environment variable —
//! and the one place they become each service's typed config, so `turnlog <service>` and
//! `turnlog dev` build their services the same way and a setting means the same everywhere.

use std::time::Duration;

use turnlog_runtime::config::parse_duration;

/// How long a worker waits for the writer to apply its append.
const WORKER_APPEND_TIMEOUT: Duration = Duration::from_secs(15);

/// Where the log and the bus are: shared by every subcommand that reaches them.
#[derive(clap::Args, Clone)]
pub struct Backbone {
    /// Postgres, e.g. postgres://user:password@host:5432/turnlog.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// NATS with JetStream.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    #[command(flatten)]
    pub bus: BusArgs,
    #[command(flatten)]
    pub reads: ReadArgs,
}

/// How the services that only read Postgres (the ingress and the workers) bound their
/// queries. The writer's commits and `turnlog rebuild` / `verify` are not bounded.
#[derive(clap::Args, Clone)]
pub struct ReadArgs {
    /// Longest run of one read query (e.g. 5s, 800ms): past it Postgres cancels the query,
    /// a client gets 503 with Retry-After and a worker retries the event later.
    #[arg(long, env = "TURNLOG_STATEMENT_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub statement_timeout: Duration,
}

/// How the bus is laid out on the NATS server.
#[derive(clap::Args, Clone)]
pub struct BusArgs {
    /// Prefix of every stream and subject name, so deployments can share a NATS server.
    #[arg(long, env = "TURNLOG_BUS_PREFIX", default_value = "turnlog")]
    pub bus_prefix: String,
    /// Writer partitions (a stable hash of the session id); fixed for a deployment.
    #[arg(long, env = "TURNLOG_PARTITIONS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub partitions: u32,
    /// How long TURNLOG_APPEND keeps requests (e.g. 30d); unlimited by default, so the
    /// database can be rebuilt from it.
    #[arg(long, env = "TURNLOG_APPEND_MAX_AGE", value_parser = parse_duration)]
    pub append_max_age: Option<Duration>,
}

/// The model gateway and the models the workers call.
#[derive(clap::Args, Clone)]
pub struct WorkerModels {
    /// Base URL of the OpenAI-compatible gateway, ending in /v1.
    #[arg(long, env = "TURNLOG_LLM_URL")]
    pub llm_url: String,
    #[arg(long, env = "TURNLOG_LLM_API_KEY", hide_env_values = true)]
    pub llm_api_key: Option<String>,
    /// The chat model: its window sizes the compaction budget when a turn names none.
    #[arg(long, env = "TURNLOG_MODEL")]
    pub model: String,
    #[command(flatten)]
    pub tasks: TaskModels,
    /// Context windows that win over the gateway's /models: `model=tokens,...`.
    #[arg(long, env = "TURNLOG_MODEL_WINDOWS", default_value = "")]
    pub model_windows: String,
    /// The compaction budget when the model's window is unknown.
    #[arg(long, env = "TURNLOG_CONTEXT_BUDGET", default_value_t = turnlog_core::budget::DEFAULT_BUDGET)]
    pub context_budget: u32,
    /// Deadline of one worker model call (e.g. 120s).
    #[arg(long, env = "TURNLOG_UPSTREAM_TIMEOUT", default_value = "120s", value_parser = parse_duration)]
    pub upstream_timeout: Duration,
}

/// The models of the workers' own calls, when they differ from the chat model.
#[derive(clap::Args, Clone)]
pub struct TaskModels {
    /// Distillation, memory extraction and titles (default: TURNLOG_MODEL).
    #[arg(long, env = "TURNLOG_MINI_MODEL")]
    pub mini_model: Option<String>,
    /// Compaction summaries (default: TURNLOG_MODEL).
    #[arg(long, env = "TURNLOG_SUMMARY_MODEL")]
    pub summary_model: Option<String>,
}

impl WorkerModels {
    /// The workers' models on the gateway the ingress is given, so `turnlog dev` configures
    /// the gateway once for every service.
    pub fn from_ingress(args: &turnlog_ingress::IngressArgs, llm_url: String, tasks: TaskModels) -> Self {
        Self {
            llm_url,
            llm_api_key: args.llm_api_key.clone(),
            model: args.model.clone(),
            tasks,
            model_windows: args.model_windows.clone(),
            context_budget: args.context_budget,
            upstream_timeout: args.upstream_timeout,
        }
    }

    fn upstream(&self) -> anyhow::Result<turnlog_runtime::upstream::UpstreamConfig> {
        let windows_override = turnlog_runtime::upstream::parse_model_windows(&self.model_windows)
            .map_err(|e| anyhow::anyhow!("TURNLOG_MODEL_WINDOWS: {e}"))?;
        anyhow::ensure!(!self.llm_url.trim().is_empty(), "TURNLOG_LLM_URL is empty");
        anyhow::ensure!(!self.model.trim().is_empty(), "TURNLOG_MODEL must name a model");
        Ok(turnlog_runtime::upstream::UpstreamConfig {
            base_url: self.llm_url.clone(),
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

/// How a worker consumes the committed-event feed.
#[derive(clap::Args, Clone)]
pub struct WorkerTuning {
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

impl WorkerTuning {
    fn settings(&self) -> turnlog_runtime::worker::ConsumerSettings {
        turnlog_runtime::worker::ConsumerSettings {
            concurrency: usize::try_from(self.worker_concurrency).unwrap_or(1),
            max_deliver: self.worker_max_deliver,
            ack_wait: self.worker_ack_wait,
            retry_backoff: self.worker_retry_backoff.clone(),
            replay: None,
        }
    }
}

/// The compactor's own settings.
#[derive(clap::Args, Clone)]
pub struct CompactorArgs {
    /// Longest wait for the extracted facts of the turns a summary replaces.
    #[arg(long, env = "TURNLOG_FACTS_WAIT", default_value = "5s", value_parser = parse_duration)]
    pub facts_wait: Duration,
}

impl Backbone {
    pub fn writer(&self) -> turnlog_writer::WriterConfig {
        turnlog_writer::WriterConfig {
            database_url: self.database_url.clone(),
            nats_url: self.nats_url.clone(),
            bus_prefix: self.bus.bus_prefix.clone(),
            partitions: self.bus.partitions,
            append_max_age: self.bus.append_max_age,
        }
    }

    pub fn ingress(
        &self,
        args: turnlog_ingress::IngressArgs,
    ) -> anyhow::Result<turnlog_ingress::IngressConfig> {
        let backbone = turnlog_ingress::Backbone {
            database_url: self.database_url.clone(),
            nats_url: self.nats_url.clone(),
            bus_prefix: self.bus.bus_prefix.clone(),
            partitions: self.bus.partitions,
            append_max_age: self.bus.append_max_age,
        };
        let mut config = turnlog_ingress::IngressConfig::from_args(backbone, args)?;
        config.statement_timeout = self.reads.statement_timeout;
        Ok(config)
    }

    pub fn distiller(
        &self,
        models: &WorkerModels,
        tuning: &WorkerTuning,
    ) -> anyhow::Result<turnlog_distiller::DistillerConfig> {
        Ok(turnlog_distiller::DistillerConfig {
            upstream: models.upstream()?,
            mini_model: models.mini_model(),
            consumer: tuning.settings(),
            call_deadline: models.upstream_timeout,
            append_timeout: WORKER_APPEND_TIMEOUT,
            statement_timeout: self.reads.statement_timeout,
            database_url: self.database_url.clone(),
            nats_url: self.nats_url.clone(),
            bus_prefix: self.bus.bus_prefix.clone(),
            partitions: self.bus.partitions,
        })
    }

    pub fn memory(
        &self,
        models: &WorkerModels,
        tuning: &WorkerTuning,
    ) -> anyhow::Result<turnlog_memory::MemoryConfig> {
        Ok(turnlog_memory::MemoryConfig {
            upstream: models.upstream()?,
            mini_model: models.mini_model(),
            consumer: tuning.settings(),
            call_deadline: models.upstream_timeout,
            append_timeout: WORKER_APPEND_TIMEOUT,
            statement_timeout: self.reads.statement_timeout,
            database_url: self.database_url.clone(),
            nats_url: self.nats_url.clone(),
            bus_prefix: self.bus.bus_prefix.clone(),
            partitions: self.bus.partitions,
        })
    }

    pub fn compactor(
        &self,
        models: &WorkerModels,
        tuning: &WorkerTuning,
        compactor: &CompactorArgs,
    ) -> anyhow::Result<turnlog_compactor::CompactorConfig> {
        Ok(turnlog_compactor::CompactorConfig {
            upstream: models.upstream()?,
            summary_model: models.summary_model(),
            model: models.model.clone(),
            context_budget: models.context_budget,
            consumer: tuning.settings(),
            facts_wait: compactor.facts_wait,
            summary_deadline: models.upstream_timeout,
            append_timeout: WORKER_APPEND_TIMEOUT,
            statement_timeout: self.reads.statement_timeout,
            database_url: self.database_url.clone(),
            nats_url: self.nats_url.clone(),
            bus_prefix: self.bus.bus_prefix.clone(),
            partitions: self.bus.partitions,
        })
    }
}

/// Parses the command line and environment into `P`, or exits: clap's own message, plus
/// (clap names only the flag, `--partitions <PARTITIONS>`) which environment variable
/// carried a bad value, when one did.
pub fn parse_or_exit<P: clap::Parser>() -> P {
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
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(clap::Subcommand)]
    enum Sub {
        Writer {
            #[command(flatten)]
            backbone: Backbone,
        },
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

    /// A worker's flags: where the log is, its models and tuning.
    #[derive(Parser)]
    struct Worker {
        #[command(flatten)]
        backbone: Backbone,
        #[command(flatten)]
        models: WorkerModels,
        #[command(flatten)]
        tuning: WorkerTuning,
        #[command(flatten)]
        compactor: CompactorArgs,
    }

    #[derive(Parser)]
    struct Ingress {
        #[command(flatten)]
        args: turnlog_ingress::IngressArgs,
    }

    #[test]
    fn the_statement_timeout_reaches_every_reading_service() {
        let worker = ["t", "--database-url", "x", "--llm-url", "http://m/v1", "--model", "m"];
        let ingress = || Ingress::try_parse_from(["t"]).unwrap().args;
        let default = Worker::try_parse_from(worker).unwrap();
        assert_eq!(default.backbone.reads.statement_timeout, Duration::from_secs(5));
        let set = Worker::try_parse_from(worker.into_iter().chain(["--statement-timeout", "750ms"])).unwrap();
        let (b, m, t) = (&set.backbone, &set.models, &set.tuning);
        let expected = Duration::from_millis(750);
        assert_eq!(b.ingress(ingress()).unwrap().statement_timeout, expected);
        assert_eq!(b.distiller(m, t).unwrap().statement_timeout, expected);
        assert_eq!(b.memory(m, t).unwrap().statement_timeout, expected);
        assert_eq!(b.compactor(m, t, &set.compactor).unwrap().statement_timeout, expected);
        let command = <Worker as clap::CommandFactory>::command();
        assert_eq!(env_of(&command, "statement-timeout").as_deref(), Some("TURNLOG_STATEMENT_TIMEOUT"));
        assert!(Worker::try_parse_from(worker.into_iter().chain(["--statement-timeout", "0s"])).is_err());
    }
}
