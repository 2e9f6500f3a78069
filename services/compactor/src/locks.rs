//! One compaction at a time per session within this process, so the post-turn check and a
//! pre-send request for the same session queue instead of racing to summarize the same
//! span; across processes the append's `expect` condition decides.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::OwnedMutexGuard;
use turnlog_core::ids::SessionId;

#[derive(Default)]
pub(crate) struct SessionLocks {
    held: Mutex<HashMap<SessionId, Arc<tokio::sync::Mutex<()>>>>,
}

/// Holds a session's lock; dropping it releases the lock and forgets the session once
/// nobody else waits for it, so the map stays as small as the work in hand.
pub(crate) struct SessionGuard<'a> {
    locks: &'a SessionLocks,
    session: SessionId,
    guard: Option<OwnedMutexGuard<()>>,
}

impl SessionLocks {
    pub(crate) async fn lock(&self, session: SessionId) -> SessionGuard<'_> {
        let mutex = self.map().entry(session).or_default().clone();
        let guard = mutex.lock_owned().await;
        SessionGuard { locks: self, session, guard: Some(guard) }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Arc<tokio::sync::Mutex<()>>>> {
        // The map holds only handles; a panic elsewhere cannot leave it inconsistent.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map().len()
    }
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = self.locks.map();
        // Every handle is cloned from the map under this same lock, so a count of one means
        // no other task holds or waits for this session's lock.
        if map.get(&self.session).is_some_and(|m| Arc::strong_count(m) == 1) {
            map.remove(&self.session);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_holder_per_session_and_the_map_empties() {
        let locks = Arc::new(SessionLocks::default());
        let (a, b) = (SessionId::new(), SessionId::new());
        let first = locks.lock(a).await;
        // Another session is not blocked.
        let other = tokio::time::timeout(Duration::from_millis(100), locks.lock(b)).await;
        assert!(other.is_ok());
        drop(other);
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _g = locks.lock(a).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "a second holder of the same session must wait");
        drop(first);
        waiter.await.unwrap();
        assert_eq!(locks.len(), 0);
    }
}
