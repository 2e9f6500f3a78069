//! turnlog's writer: the only process that writes Postgres. Per partition it holds an
//! advisory lock (partitions are spread over the writers running, see `share`; one that
//! dies leaves its partitions to the others), reads TURNLOG_APPEND strictly in
//! stream order from its recorded position, applies each batch and its new position in
//! one transaction, then answers the producers, publishes the committed events and
//! advances `published_seq`. A crash anywhere applies nothing twice and skips nothing.
//! `rebuild` runs the same apply code in an apply-only mode into an empty database.

mod apply;
mod bulk;
mod commit;
mod gin;
mod metrics;
mod partition;
mod publisher;
mod purger;
mod read_ahead;
mod rebuild;
mod search;
mod share;
mod store;

use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use turnlog_runtime::settings::Backbone;

use partition::partition_writer;

pub use apply::{apply_batch, Incoming};
pub use rebuild::{rebuild, RebuildProgress, RebuildSummary};
pub use share::holders;

/// Header marking an APPEND message as an operator's redrive of a dead letter (its value is
/// the dead letter's TURNLOG_DEAD sequence): the one case where a request id seen before
/// is applied again, if its recorded outcome was a dead-letter rejection.
pub const REDRIVE_HEADER: &str = "Turnlog-Redrive";

/// Most requests applied in one transaction.
pub const MAX_BATCH: usize = 500;

#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// Its statement timeout does not apply: the writer's commits are not bounded.
    pub backbone: Backbone,
}

/// Runs a writer for every partition until `shutdown`; recovers by itself from lost
/// connections to NATS or Postgres.
pub async fn run(config: WriterConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let backbone = &config.backbone;
    let pool = backbone.connect_db(4 + backbone.partitions).await.context("connecting to Postgres")?;
    let bus = backbone.connect_bus().await?;
    bus.ensure_topology(backbone.append_max_age).await?;
    turnlog_core::tokens::warm_up();

    let pending = Arc::new(gin::PendingRows::default());
    let share = Arc::new(share::Share::default());
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(gin::merge_pending_lists(pool.clone(), pending.clone(), shutdown.clone()));
    let url = backbone.database_url.expose().to_owned();
    tasks.spawn(share::run(url, backbone.partitions, share.clone(), shutdown.clone()));
    let telemetry = turnlog_runtime::telemetry::registry();
    telemetry.export("writer", |out| metrics::metrics().render(out));
    // Ready: a member of the writers (so Postgres answers) and connected to NATS.
    let (joined, client) = (share.clone(), bus.client.clone());
    telemetry.ready_when("writer", move || {
        joined.joined() && client.connection_state() == async_nats::connection::State::Connected
    });
    for partition in 0..backbone.partitions {
        let (pool, bus, url, shutdown, pending, share) = (
            pool.clone(),
            bus.clone(),
            backbone.database_url.clone(),
            shutdown.clone(),
            pending.clone(),
            share.clone(),
        );
        tasks.spawn(
            async move { partition_writer(partition, pool, bus, url, pending, share, shutdown).await },
        );
    }
    while let Some(res) = tasks.join_next().await {
        res.context("partition writer panicked")?;
    }
    Ok(())
}
