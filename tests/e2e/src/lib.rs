//! turnlog's end-to-end harness, shared by the suites in `tests/` here, the process suites
//! of `services/turnlog/tests` and the benchmarks:
//! - [`rig::Rig`]: a test environment with the writer in-process, the mock model, workers
//!   spawned and stopped one by one, and turns simulated on the bus;
//! - [`api::Api`]: an HTTP client over the in-process stack `turnlog dev` runs
//!   ([`turnlog_dev::Stack`], started by [`serve`]);
//! - [`config`]: every service config the suites build, in one place;
//! - [`mcp`]: the MCP servers the tool suites run (DESIGN §14);
//! - [`history`]: a synthetic history of append requests (the ops suite, the rebuild bench).

// The harness's helpers are test code too; a failed unwrap there is a failed test.
#![allow(clippy::unwrap_used)]

pub mod api;
pub mod config;
pub mod history;
pub mod mcp;
pub mod rig;
pub mod s3;

use std::time::Duration;

use anyhow::Context as _;
use turnlog_dev::{ServiceConfigs, Stack};

/// Starts `configs` as one in-process stack, its ingress on a free port of 127.0.0.1, and
/// waits up to `within` until the ingress is ready.
pub async fn serve(configs: ServiceConfigs, within: Duration) -> anyhow::Result<Stack> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding 127.0.0.1:0")?;
    let mut stack = Stack::start(configs, listener).await?;
    match tokio::time::timeout(within, stack.ready()).await {
        Ok(Ok(())) => Ok(stack),
        Ok(Err(service)) => anyhow::bail!("the {service} service stopped before the ingress was ready"),
        Err(_) => anyhow::bail!("the ingress was not ready within {within:?}"),
    }
}
