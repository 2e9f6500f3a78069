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

fn err(e: impl std::fmt::Display) -> BusError {
    BusError::JetStream(e.to_string())
}

impl TurnLeases {
    pub async fn open(bus: &Bus) -> Result<Self, BusError> {
        Ok(Self { store: bus.turn_leases().await? })
    }

    /// Takes the session's lease for `holder`; None when someone holds it.
    pub async fn acquire(&self, session: SessionId, holder: &str) -> Result<Option<Lease>, BusError> {
        match self.store.create(session.to_string(), Bytes::from(holder.to_owned())).await {
            Ok(revision) => Ok(Some(Lease { session, revision })),
            Err(e) if e.kind() == CreateErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(err(e)),
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
