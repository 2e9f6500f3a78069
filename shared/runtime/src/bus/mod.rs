//! The bus contract (DESIGN.md §6): stream and subject names under `TURNLOG_BUS_PREFIX`,
//! the messages on them, the topology every service creates or verifies at start, the
//! turn-lease bucket, and `append_and_wait` — the one way any producer appends. Here: the
//! connection ([`Bus`]) and the re-exports that keep `bus::X` the one path to each part.

mod append;
mod names;
mod replies;
mod topology;
mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;

use turnlog_core::ids::SessionId;

pub use crate::outcome::{Outcome, OutcomeStatus, Refusal, SESSION_DELETED};
pub use append::{
    append_and_wait, append_headers, append_message, appends_confirmed, AppendError, CONFIRM_AFTER,
};
pub use names::{feed_token, on_feed, partition_of, BusNames, FEED_TOKENS};
pub use topology::{ReplicaChange, STREAM_REPLICAS};
pub use turnlog_core::limits::{
    json_len, metadata_error, MAX_EVENT_BYTES, MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE,
};
pub use turnlog_core::storable::has_nul;
pub use wire::{
    AppendOp, AppendRequest, CommittedEvent, CompactReply, CompactRequest, CompactStatus, DeadLetter, Expect,
    RequestKind, REPLY_HEADER,
};

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("invalid TURNLOG_BUS_PREFIX {0:?}: use 1-32 characters of a-z, 0-9, _ or -")]
    BadPrefix(String),
    #[error("cannot reach NATS at {url}: {source}")]
    Connect { url: String, source: async_nats::ConnectError },
    #[error("JetStream: {0}")]
    JetStream(String),
    #[error("stream {name} exists with subjects {found:?}, expected {expected:?}")]
    Mismatch { name: String, found: Vec<String>, expected: Vec<String> },
}

fn js_err(e: impl std::fmt::Display) -> BusError {
    BusError::JetStream(e.to_string())
}

/// A connection to the bus: core NATS, JetStream and the names.
#[derive(Clone)]
pub struct Bus {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub names: BusNames,
    pub partitions: u32,
    /// `TURNLOG_STREAM_REPLICAS`: the replicas [`Bus::ensure_topology`] creates streams and
    /// the lease bucket with (1 unless [`Bus::with_replicas`] says otherwise).
    pub replicas: usize,
    /// Counts reconnects after a lost connection (not the first connect).
    reconnects: tokio::sync::watch::Receiver<u64>,
    /// Where the writer's outcomes for this connection's appends arrive.
    replies: Arc<replies::Replies>,
}

impl Bus {
    /// Connects (retrying in the background after a disconnect, as async-nats does). `url`
    /// may list several servers of a cluster, comma-separated.
    pub async fn connect(url: &str, prefix: &str, partitions: u32) -> Result<Self, BusError> {
        let names = BusNames::new(prefix)?;
        let servers: Vec<&str> = url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
        let (reconnected, reconnects) = tokio::sync::watch::channel(0u64);
        let lost = Arc::new(AtomicBool::new(false));
        let client = async_nats::ConnectOptions::new()
            .event_callback(move |event| {
                match event {
                    async_nats::Event::Disconnected => lost.store(true, Ordering::Relaxed),
                    async_nats::Event::Connected if lost.swap(false, Ordering::Relaxed) => {
                        reconnected.send_modify(|n| *n += 1);
                    }
                    _ => {}
                }
                std::future::ready(())
            })
            .connection_timeout(Duration::from_secs(5))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connect(servers)
            .await
            .map_err(|source| BusError::Connect { url: url.to_owned(), source })?;
        // First contact: fail fast rather than hang when nothing listens.
        tokio::time::timeout(Duration::from_secs(10), client.flush())
            .await
            .map_err(|_| BusError::JetStream(format!("no answer from NATS at {url} within 10 s")))?
            .map_err(js_err)?;
        let js = jetstream::new(client.clone());
        let replies = Arc::new(replies::Replies::subscribe(&client).await.map_err(js_err)?);
        append::export_metrics();
        Ok(Self { client, js, names, partitions: partitions.max(1), replicas: 1, reconnects, replies })
    }

    /// The same bus, creating streams with `replicas` replicas (`TURNLOG_STREAM_REPLICAS`).
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Changes each time the client reconnects after losing its connection. A restarted
    /// nats-server has forgotten every ephemeral consumer; async-nats' ordered consumer
    /// notices only after about 15 s of retries, so readers watch this and start over.
    pub fn reconnects(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reconnects.clone()
    }

    pub fn partition_of(&self, session: SessionId) -> u32 {
        partition_of(session, self.partitions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_is_found_anywhere() {
        assert!(has_nul(&serde_json::json!({"a": ["x\0"]})));
        assert!(has_nul(&serde_json::json!({"a\0": 1})));
        assert!(!has_nul(&serde_json::json!({"a": ["x", 1, null]})));
    }
}
