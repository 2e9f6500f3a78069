//! The one list of workers: every service that consumes the committed-event feed is a
//! variant here. `turnlog <worker>`, `turnlog replay --worker`, `turnlog dev` and the test
//! stacks all start workers through it, so a new worker is its crate, a variant with its
//! arms below, its flags in the binary's `cli.rs`, and a compose service.

use tokio_util::sync::CancellationToken;
use turnlog_runtime::settings::Backbone;
use turnlog_runtime::upstream::UpstreamConfig;
use turnlog_runtime::worker::ConsumerSettings;

/// A worker with its config.
#[derive(Debug, Clone)]
pub enum Worker {
    Distiller(turnlog_distiller::DistillerConfig),
    Memory(turnlog_memory::MemoryConfig),
    Compactor(turnlog_compactor::CompactorConfig),
}

impl Worker {
    /// The subcommand, the `--worker` value of `turnlog replay`, and the task's name.
    pub fn name(&self) -> &'static str {
        match self {
            Worker::Distiller(_) => "distiller",
            Worker::Memory(_) => "memory",
            Worker::Compactor(_) => "compactor",
        }
    }

    /// Runs the worker until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        match self {
            Worker::Distiller(c) => turnlog_distiller::run(c, shutdown).await,
            Worker::Memory(c) => turnlog_memory::run(c, shutdown).await,
            Worker::Compactor(c) => turnlog_compactor::run(c, shutdown).await,
        }
    }

    /// How it consumes the feed (its tuning, or a replay's range).
    pub fn consumer_mut(&mut self) -> &mut ConsumerSettings {
        match self {
            Worker::Distiller(c) | Worker::Memory(c) => &mut c.consumer,
            Worker::Compactor(c) => &mut c.consumer,
        }
    }

    /// Where it finds the log and the bus, and the model gateway it calls.
    pub fn connections_mut(&mut self) -> (&mut Backbone, &mut UpstreamConfig) {
        match self {
            Worker::Distiller(c) | Worker::Memory(c) => (&mut c.backbone, &mut c.upstream),
            Worker::Compactor(c) => (&mut c.backbone, &mut c.upstream),
        }
    }
}
