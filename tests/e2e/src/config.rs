//! Every service config the end-to-end suites and the benchmarks build, in one place: on a
//! test environment's database and bus prefix (one partition), with settings that keep
//! tests quick. A suite starts from these and changes the fields it is about.

use std::time::Duration;

use turnlog_compactor::CompactorConfig;
use turnlog_dev::{ServiceConfigs, Worker};
use turnlog_distiller::DistillerConfig;
use turnlog_ingress::IngressConfig;
use turnlog_memory::MemoryConfig;
use turnlog_runtime::settings::Backbone;
use turnlog_runtime::turn_worker::TurnWorkerConfig;
use turnlog_runtime::upstream::UpstreamConfig;
use turnlog_runtime::worker::ConsumerSettings;
use turnlog_testkit::TestEnv;
use turnlog_writer::WriterConfig;

/// Consumer settings that keep retries and redeliveries quick in tests.
pub fn fast_consumer() -> ConsumerSettings {
    ConsumerSettings {
        concurrency: 4,
        max_deliver: 3,
        ack_wait: Duration::from_secs(3),
        retry_backoff: vec![Duration::from_millis(100)],
        replay: None,
    }
}

/// The model gateway at `base_url` (the mock's), with a 10 s timeout and no window overrides.
pub fn upstream_at(base_url: &str) -> UpstreamConfig {
    UpstreamConfig {
        base_url: base_url.into(),
        api_key: None,
        timeout: Duration::from_secs(10),
        windows_override: Default::default(),
    }
}

pub fn backbone(env: &TestEnv) -> Backbone {
    env.backbone()
}

pub fn writer(env: &TestEnv) -> WriterConfig {
    WriterConfig { backbone: backbone(env) }
}

/// The ingress's defaults (no tokens, no gateway) on the environment.
pub fn ingress(env: &TestEnv) -> IngressConfig {
    IngressConfig::new(backbone(env))
}

/// The distiller with `mock-mini` at `base_url` and [`fast_consumer`].
pub fn distiller(env: &TestEnv, base_url: &str) -> DistillerConfig {
    turn_worker(env, base_url)
}

/// Memory extraction with `mock-mini` at `base_url` and [`fast_consumer`].
pub fn memory(env: &TestEnv, base_url: &str) -> MemoryConfig {
    turn_worker(env, base_url)
}

/// A turn worker's config (the distiller's and memory extraction's are one type).
fn turn_worker(env: &TestEnv, base_url: &str) -> TurnWorkerConfig {
    TurnWorkerConfig {
        backbone: backbone(env),
        upstream: upstream_at(base_url),
        mini_model: "mock-mini".into(),
        consumer: fast_consumer(),
        call_deadline: Duration::from_secs(10),
        append_timeout: Duration::from_secs(10),
    }
}

/// The compactor for turns of `model`, summarising with `mock-summary` at `base_url`, the
/// default budget and [`fast_consumer`].
pub fn compactor(env: &TestEnv, base_url: &str, model: &str) -> CompactorConfig {
    CompactorConfig {
        backbone: backbone(env),
        upstream: upstream_at(base_url),
        model: model.into(),
        summary_model: "mock-summary".into(),
        context_budget: turnlog_core::budget::DEFAULT_BUDGET,
        consumer: fast_consumer(),
        facts_wait: Duration::from_secs(2),
        summary_deadline: Duration::from_secs(10),
        append_timeout: Duration::from_secs(10),
        tool_history: Default::default(),
    }
}

/// The writer and the ingress (no tokens, no gateway), no workers.
pub fn stack(env: &TestEnv) -> ServiceConfigs {
    ServiceConfigs { writer: Some(writer(env)), ingress: ingress(env), workers: Vec::new(), tools: None }
}

/// [`stack`] chatting with `model` through `upstream` (its window overrides apply to the
/// ingress too), with the compactor for that model on the same gateway.
pub fn chat_stack(env: &TestEnv, upstream: UpstreamConfig, model: &str) -> ServiceConfigs {
    let mut configs = stack(env);
    let mut compactor = compactor(env, upstream.base_url.expose(), model);
    compactor.upstream = upstream.clone();
    configs.workers.push(Worker::Compactor(compactor));
    configs.ingress.model = model.into();
    configs.ingress.model_windows = upstream.windows_override.clone();
    configs.ingress.upstream = Some(upstream);
    configs
}
