//! The turn lease: one active turn per session across every ingress copy, held in the
//! TURNLOG_TURNS key-value bucket whose entries expire after ~10 s unless renewed, so a
//! dead holder's lease frees itself.

use async_nats::jetstream::kv::{self, CreateErrorKind, UpdateErrorKind};
use bytes::Bytes;

use crate::bus::{Bus, BusError};
use turnlog_core::ids::SessionId;

#[derive(Clone)]
pub struct TurnLeases {
    store: kv::Store,
}

/// A held lease: the revision the holder must present to renew or release it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub session: SessionId,
    pub revision: u64,
}

/// How long taking a lease keeps trying through a NATS leader election.
pub const ACQUIRE_WAIT: std::time::Duration = std::time::Duration::from_secs(12);
const RETRY_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

fn err(e: impl std::fmt::Display) -> BusError {
    BusError::JetStream(e.to_string())
}

impl TurnLeases {
    pub async fn open(bus: &Bus) -> Result<Self, BusError> {
        Ok(Self { store: bus.turn_leases().await? })
    }

    /// Takes the session's lease for `holder`; None when someone holds it.
    ///
    /// A create that finds no responder (a leader election on a NATS cluster, 4–9 s) is
    /// tried again for up to [`ACQUIRE_WAIT`]; the value names this attempt, so a create
    /// whose acknowledgement was lost is recognized as ours when tried again.
    pub async fn acquire(&self, session: SessionId, holder: &str) -> Result<Option<Lease>, BusError> {
        let key = session.to_string();
        let value = Bytes::from(format!("{holder} {}", uuid::Uuid::now_v7()));
        let deadline = tokio::time::Instant::now() + ACQUIRE_WAIT;
        let mut retried = false;
        loop {
            let error = match self.store.create(&key, value.clone()).await {
                Ok(revision) => return Ok(Some(Lease { session, revision })),
                Err(e) if e.kind() == CreateErrorKind::AlreadyExists => {
                    if retried {
                        match self.store.entry(&key).await {
                            Ok(Some(entry)) if entry.value == value => {
                                return Ok(Some(Lease { session, revision: entry.revision }))
                            }
                            Ok(_) => {}
                            Err(e) => return Err(err(e)),
                        }
                    }
                    return Ok(None);
                }
                Err(e) if e.kind() == CreateErrorKind::InvalidKey => return Err(err(e)),
                Err(e) => e,
            };
            if tokio::time::Instant::now() + RETRY_EVERY >= deadline {
                return Err(err(error));
            }
            if !retried {
                tracing::warn!(%session, error = %error, "turn lease not taken; trying again");
            }
            retried = true;
            tokio::time::sleep(RETRY_EVERY).await;
        }
    }

    /// Renews a held lease; None when it was lost (expired and taken, or released).
    pub async fn renew(&self, lease: Lease, holder: &str) -> Result<Option<Lease>, BusError> {
        let key = lease.session.to_string();
        match self.store.update(key, Bytes::from(holder.to_owned()), lease.revision).await {
            Ok(revision) => Ok(Some(Lease { revision, ..lease })),
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(err(e)),
        }
    }

    /// Releases a held lease (only if it is still this holder's revision).
    pub async fn release(&self, lease: Lease) -> Result<(), BusError> {
        self.store.delete_expect_revision(lease.session.to_string(), Some(lease.revision)).await.map_err(err)
    }

    /// Whether a turn is active on the session.
    pub async fn is_held(&self, session: SessionId) -> Result<bool, BusError> {
        Ok(self.store.get(session.to_string()).await.map_err(err)?.is_some())
    }
}
