//! The bus's topology (DESIGN §6 "Scale-out"): the streams and buckets every service
//! creates or verifies at start (the log's three, the turn leases, the server tools'),
//! and `turnlog migrate --bus`, which changes their replicas.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use super::{js_err, Bus, BusError};

/// JetStream's dedup window on every stream; resending a request within it is a no-op
/// even before the writer sees it.
pub(crate) const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// The turn lease expires unless renewed within this.
pub(crate) const TURN_LEASE_TTL: Duration = Duration::from_secs(10);
/// A server tool call's claim is kept this long: far beyond any call's deadline.
const TOOL_CLAIM_TTL: Duration = Duration::from_secs(24 * 3600);
/// The streams' replica counts one can configure (`TURNLOG_STREAM_REPLICAS`): a JetStream
/// cluster needs an odd count to keep a majority.
pub const STREAM_REPLICAS: [usize; 3] = [1, 3, 5];

/// What a service logs when it finds a stream with fewer replicas than configured: it does
/// not change the stream itself (an operator's step, since it moves data across the cluster).
pub(crate) fn replicas_warning(stream: &str, have: usize, want: usize) -> String {
    format!(
        "stream {stream} has {have} replica(s) but TURNLOG_STREAM_REPLICAS is {want}; \
         run `turnlog migrate --bus` to change it"
    )
}

/// What `turnlog migrate --bus` did to one stream ([`Bus::migrate_replicas`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaChange {
    pub stream: String,
    /// None when the stream did not exist (then it was created with `after`).
    pub before: Option<usize>,
    pub after: usize,
}

impl std::fmt::Display for ReplicaChange {
    /// `TURNLOG_APPEND: replicas 1 → 3`, `… replicas 3 (unchanged)` or `… created with replicas 3`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.before {
            Some(before) if before == self.after => {
                write!(f, "{}: replicas {before} (unchanged)", self.stream)
            }
            Some(before) => write!(f, "{}: replicas {before} → {}", self.stream, self.after),
            None => write!(f, "{}: created with replicas {}", self.stream, self.after),
        }
    }
}

impl Bus {
    /// Creates the streams and the buckets with [`Bus::replicas`] replicas, or
    /// verifies that existing ones carry the expected subjects (and warns, naming `turnlog
    /// migrate --bus`, about one with fewer replicas). `append_max_age` None keeps appends
    /// forever (rebuildable).
    pub async fn ensure_topology(&self, append_max_age: Option<Duration>) -> Result<(), BusError> {
        for config in self.topology(append_max_age) {
            let (name, want) = (config.name.clone(), config.num_replicas);
            let have = self.ensure_stream(config).await?;
            if have < want {
                tracing::warn!(stream = %name, have, want, "{}", replicas_warning(&name, have, want));
            }
        }
        Ok(())
    }

    /// Every stream's config, in order: TURNLOG_APPEND, TURNLOG_EVENTS, TURNLOG_DEAD, the
    /// lease bucket's backing stream `KV_<bucket>`, then the server tools' (DESIGN §14):
    /// TURNLOG_TOOL_CALLS and the catalogue's and the claims' buckets.
    fn topology(&self, append_max_age: Option<Duration>) -> Vec<stream::Config> {
        let n = &self.names;
        let num_replicas = self.replicas;
        let log_stream = |name: String, subjects: Vec<String>, max_age: Duration| stream::Config {
            name,
            subjects,
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            duplicate_window: DUPLICATE_WINDOW,
            max_age,
            num_replicas,
            ..Default::default()
        };
        let p = n.prefix();
        // The KV buckets through their backing streams: on nats-server 2.9 async-nats'
        // create_key_value cannot parse the server's account reply.
        let bucket = |name: String, max_age: Duration, duplicate_window: Duration| stream::Config {
            subjects: vec![format!("$KV.{name}.>")],
            name: format!("KV_{name}"),
            max_messages_per_subject: 1,
            max_age,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: stream::DiscardPolicy::New,
            storage: stream::StorageType::File,
            duplicate_window,
            num_replicas,
            ..Default::default()
        };
        vec![
            log_stream(n.append_stream(), vec![format!("{p}.append.>")], append_max_age.unwrap_or_default()),
            log_stream(n.events_stream(), n.feed_subjects(), Duration::ZERO),
            log_stream(n.dead_stream(), vec![format!("{p}.dead.>")], Duration::ZERO),
            bucket(n.turns_bucket(), TURN_LEASE_TTL, Duration::from_secs(2)),
            stream::Config {
                retention: stream::RetentionPolicy::WorkQueue,
                ..log_stream(n.tool_calls_stream(), vec![format!("{p}.tools.call.*")], Duration::ZERO)
            },
            bucket(n.tool_catalog_bucket(), Duration::ZERO, DUPLICATE_WINDOW),
            bucket(n.tool_claims_bucket(), TOOL_CLAIM_TTL, DUPLICATE_WINDOW),
        ]
    }

    /// Creates the stream unless it exists, checks its subjects, and returns its replicas.
    async fn ensure_stream(&self, config: stream::Config) -> Result<usize, BusError> {
        let (name, expected) = (config.name.clone(), config.subjects.clone());
        // Services starting together race to create the streams; the loser's create fails
        // ("subjects overlap"), and a second look finds the winner's stream.
        let mut attempt = 0;
        let s = loop {
            match self.js.get_or_create_stream(config.clone()).await {
                Ok(s) => break s,
                Err(e) if attempt < 5 => {
                    tracing::debug!(stream = %name, error = %e, "stream create raced; retrying");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                // "replicas > 1 not supported in non-clustered mode", "insufficient resources".
                Err(e) if config.num_replicas > 1 => {
                    return Err(BusError::JetStream(format!(
                        "creating stream {name} with {} replicas (TURNLOG_STREAM_REPLICAS): {e}",
                        config.num_replicas
                    )))
                }
                Err(e) => return Err(js_err(e)),
            }
        };
        // The info the get or the create answered with: in a cluster a second STREAM.INFO
        // right after the create can find no stream yet (404) while its group forms.
        let info = s.cached_info();
        let found = info.config.subjects.clone();
        // A feed an earlier version made stores every kind; it works as it is (DESIGN §6).
        let earlier_feed = name == self.names.events_stream() && found == [self.names.every_kind_subject()];
        if found != expected && !earlier_feed {
            return Err(BusError::Mismatch { name, found, expected });
        }
        Ok(info.config.num_replicas.max(1))
    }

    /// `turnlog migrate --bus`: brings each stream of the topology to [`Bus::replicas`] with a
    /// stream update of its own config (the KV bucket's backing stream too: async-nats'
    /// `update_key_value` asks `query_account`, which fails on nats-server 2.9), creates
    /// any that is missing, and says what it did to each, in topology order.
    pub async fn migrate_replicas(
        &self,
        append_max_age: Option<Duration>,
    ) -> Result<Vec<ReplicaChange>, BusError> {
        let want = self.replicas;
        let mut changes = Vec::new();
        for config in self.topology(append_max_age) {
            let name = config.name.clone();
            let existing = match self.js.get_stream(&name).await {
                Ok(mut s) => Some(s.info().await.map_err(js_err)?.config.clone()),
                Err(e) => match e.kind() {
                    jetstream::context::GetStreamErrorKind::JetStream(j)
                        if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                    {
                        None
                    }
                    _ => return Err(BusError::JetStream(format!("{name}: {e}"))),
                },
            };
            let before = match existing {
                Some(mut current) => {
                    let have = current.num_replicas.max(1);
                    if have != want {
                        current.num_replicas = want;
                        self.js.update_stream(&current).await.map_err(|e| {
                            BusError::JetStream(format!("{name}: replicas {have} → {want}: {e}"))
                        })?;
                    }
                    Some(have)
                }
                None => {
                    self.ensure_stream(config).await?;
                    None
                }
            };
            changes.push(ReplicaChange { stream: name, before, after: want });
        }
        Ok(changes)
    }

    /// The turn-lease bucket (created by [`Bus::ensure_topology`]).
    pub async fn turn_leases(&self) -> Result<jetstream::kv::Store, BusError> {
        self.js.get_key_value(self.names.turns_bucket()).await.map_err(js_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_reports_name_the_stream_the_counts_and_the_command() {
        let change = |before, after| ReplicaChange { stream: "TURNLOG_APPEND".into(), before, after };
        assert_eq!(change(Some(1), 3).to_string(), "TURNLOG_APPEND: replicas 1 → 3");
        assert_eq!(change(Some(3), 1).to_string(), "TURNLOG_APPEND: replicas 3 → 1");
        assert_eq!(change(Some(3), 3).to_string(), "TURNLOG_APPEND: replicas 3 (unchanged)");
        assert_eq!(change(None, 3).to_string(), "TURNLOG_APPEND: created with replicas 3");
        let warning = replicas_warning("KV_TURNLOG_TURNS", 1, 3);
        assert_eq!(
            warning,
            "stream KV_TURNLOG_TURNS has 1 replica(s) but TURNLOG_STREAM_REPLICAS is 3; \
             run `turnlog migrate --bus` to change it"
        );
    }
}
