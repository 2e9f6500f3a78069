//! Spreading partitions over the live writers (DESIGN §6, Scale-out). Only about load:
//! the partition's advisory lock and the position's compare-and-set stay the one safety
//! mechanism, so a writer that takes a partition it should not have is merely unbalanced.
//!
//! Each writer process holds one *member* advisory lock (the lowest free of
//! [`MAX_WRITERS`]) on a connection of its own. `pg_locks` then lists the live writers,
//! and Postgres drops a dead one's locks — member and partitions — when its connection
//! goes. Every writer reads the list each [`SETTLE_TICK`] and works out the same shares:
//! with P partitions and W members, the member of rank r (by slot) takes P / W, plus one
//! when r < P mod W. A writer under its share takes free partitions; one over it hands the
//! highest-numbered of its partitions back (it stops after its current batch and releases
//! the lock), and a writer under its share takes it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use sqlx::{Connection as _, PgConnection};
use tokio_util::sync::CancellationToken;

/// Most writer processes on one database.
pub(crate) const MAX_WRITERS: i64 = 64;
/// Base of the member advisory-lock keys ("TLWM").
const MEMBER_BASE: i64 = 0x544C_574D_0000;
/// How often the members are counted and shares worked out.
pub(crate) const SETTLE_TICK: Duration = Duration::from_secs(1);

/// This process's view of its share, used by its partition tasks.
#[derive(Debug, Default)]
pub(crate) struct Share {
    state: Mutex<State>,
    /// Woken when the share changes (joining, a writer coming or going).
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct State {
    /// How many partitions this writer should hold; None until it has joined.
    target: Option<usize>,
    /// Partitions held (or being taken), each with the token that hands it back.
    held: BTreeMap<u32, CancellationToken>,
}

impl Share {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims room for `partition` when this writer is under its share: the caller then
    /// tries the partition's lock, and calls [`release`](Self::release) when it does not
    /// get it or stops serving. The token (a child of `shutdown`) is cancelled when the
    /// partition is to be handed back.
    pub(crate) fn claim(&self, partition: u32, shutdown: &CancellationToken) -> Option<CancellationToken> {
        let mut state = self.state();
        let target = state.target?;
        if state.held.len() >= target || state.held.contains_key(&partition) {
            return None;
        }
        let token = shutdown.child_token();
        state.held.insert(partition, token.clone());
        Some(token)
    }

    /// Resolves at the next change of the share. Enable it before trying
    /// [`claim`](Self::claim), so a change in between is not missed.
    pub(crate) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Whether this writer has joined the members (and so reached Postgres).
    pub(crate) fn joined(&self) -> bool {
        self.state().target.is_some()
    }

    fn leave(&self) {
        self.state().target = None;
    }

    /// Gives `partition`'s room back. It wakes no one: a task that fails to take a lock held
    /// elsewhere releases its room and would wake itself, again and again; the room is taken
    /// at the next poll.
    pub(crate) fn release(&self, partition: u32) {
        self.state().held.remove(&partition);
    }

    /// Sets the share; asks for the highest-numbered partitions held beyond it back, and
    /// returns those newly asked.
    fn set_target(&self, target: usize) -> Vec<u32> {
        let mut state = self.state();
        if state.target.replace(target) != Some(target) {
            self.changed.notify_waiters();
        }
        let excess = state.held.len().saturating_sub(target);
        let mut shed = Vec::new();
        for (p, token) in state.held.iter().rev().take(excess) {
            if !token.is_cancelled() {
                token.cancel();
                shed.push(*p);
            }
        }
        shed
    }
}

/// The share of the member of rank `rank` among `members`, of `partitions`.
pub(crate) fn target(partitions: u32, members: usize, rank: usize) -> usize {
    let (p, w) = (partitions as usize, members.max(1));
    p / w + usize::from(rank < p % w)
}

/// Joins as a member and keeps `share` up to date until `shutdown`; takes a member slot
/// again after losing its connection.
pub(crate) async fn run(url: String, partitions: u32, share: Arc<Share>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(200);
    while !shutdown.is_cancelled() {
        match membership(&url, partitions, &share, &shutdown).await {
            Ok(()) => return,
            Err(e) => {
                share.leave();
                tracing::warn!(error = format!("{e:#}"), "writer membership lost; joining again");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

async fn membership(
    url: &str,
    partitions: u32,
    share: &Share,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut conn = turnlog_runtime::db::connect_generic_plans(url, &application_name())
        .await
        .context("member connection")?;
    let slot = join(&mut conn).await?;
    let mut last: Option<(usize, usize)> = None;
    let mut tick = tokio::time::interval(SETTLE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let members = live_members(&mut conn).await?;
        // Our own lock is among them while the connection lives.
        let rank = members.iter().position(|m| *m == slot).context("this writer's member lock is gone")?;
        let want = target(partitions, members.len(), rank);
        let shed = share.set_target(want);
        if last != Some((members.len(), want)) {
            tracing::info!(
                member = slot,
                writers = members.len(),
                share = want,
                partitions,
                "writer joined; partition share worked out"
            );
            last = Some((members.len(), want));
        }
        if !shed.is_empty() {
            tracing::info!(partitions = ?shed, share = want, "handing partitions over to other writers");
        }
    }
}

/// Takes the lowest free member slot.
async fn join(conn: &mut PgConnection) -> anyhow::Result<i64> {
    for slot in 0..MAX_WRITERS {
        let (got,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
            .bind(MEMBER_BASE + slot)
            .fetch_one(&mut *conn)
            .await?;
        if got {
            return Ok(slot);
        }
    }
    anyhow::bail!("{MAX_WRITERS} writers already run on this database")
}

/// The member slots held on this database, in order.
async fn live_members(conn: &mut PgConnection) -> anyhow::Result<Vec<i64>> {
    let keys: Vec<i64> = sqlx::query_scalar(
        "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND (classid::bigint << 32) | objid::bigint BETWEEN $1 AND $2 \
         ORDER BY 1",
    )
    .bind(MEMBER_BASE)
    .bind(MEMBER_BASE + MAX_WRITERS - 1)
    .fetch_all(&mut *conn)
    .await?;
    conn.ping().await?;
    Ok(keys.into_iter().map(|k| k - MEMBER_BASE).collect())
}

/// Which writer holds each partition now: (partition, the holder's `application_name`),
/// by partition. A partition nobody holds is missing.
pub async fn holders(pool: &sqlx::PgPool, partitions: u32) -> Result<Vec<(u32, String)>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT (l.classid::bigint << 32) | l.objid::bigint, coalesce(a.application_name, '') \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND (l.classid::bigint << 32) | l.objid::bigint BETWEEN $1 AND $2 \
         ORDER BY 1",
    )
    .bind(crate::partition::LOCK_BASE)
    .bind(crate::partition::LOCK_BASE + i64::from(partitions) - 1)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|(key, name)| ((key - crate::partition::LOCK_BASE) as u32, name)).collect())
}

/// The `application_name` of a writer's connections: `pg_stat_activity` then tells which
/// process holds which partition (`turnlog status`, the tests).
pub(crate) fn application_name() -> String {
    format!("turnlog-writer pid={}", std::process::id())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_and_differ_by_at_most_one() {
        for partitions in 1..=16 {
            for members in 1..=6 {
                let shares: Vec<usize> = (0..members).map(|r| target(partitions, members, r)).collect();
                assert_eq!(shares.iter().sum::<usize>(), partitions as usize, "{partitions}/{members}");
                let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
                assert!(hi - lo <= 1, "{partitions}/{members}: {shares:?}");
            }
        }
    }

    #[test]
    fn a_writer_over_its_share_hands_back_its_highest_partitions() {
        let (share, shutdown) = (Share::default(), CancellationToken::new());
        assert!(share.claim(0, &shutdown).is_none(), "nothing before joining");
        share.set_target(4);
        let tokens: Vec<_> = (0..4).map(|p| share.claim(p, &shutdown).unwrap()).collect();
        assert!(share.claim(5, &shutdown).is_none(), "full");
        assert_eq!(share.set_target(2), vec![3, 2]);
        assert!(tokens[3].is_cancelled() && tokens[2].is_cancelled() && !tokens[1].is_cancelled());
        assert!(share.set_target(2).is_empty(), "asked once");
        share.release(3);
        share.release(2);
        assert!(share.claim(2, &shutdown).is_none(), "at its share again");
        shutdown.cancel();
        assert!(tokens[0].is_cancelled(), "shutdown stops every partition");
    }

    /// A partition task waiting for room wakes when the share changes (not only at its next
    /// poll), and not when nothing changed; nor when a partition is let go, which is what a
    /// task does when the lock is held elsewhere (waking itself, it would spin).
    #[tokio::test]
    async fn a_new_share_wakes_a_waiting_claim_and_a_release_does_not() {
        let (share, shutdown) = (Share::default(), CancellationToken::new());
        fn woken(waiting: std::pin::Pin<Box<tokio::sync::futures::Notified<'_>>>) -> bool {
            futures::FutureExt::now_or_never(waiting).is_some()
        }
        let mut waiting = Box::pin(share.changed());
        waiting.as_mut().enable();
        share.set_target(1);
        assert!(woken(waiting), "joining wakes");
        let _held = share.claim(0, &shutdown).unwrap();

        let mut waiting = Box::pin(share.changed());
        waiting.as_mut().enable();
        share.set_target(1);
        assert!(!woken(waiting), "the same share again is no change");

        let mut waiting = Box::pin(share.changed());
        waiting.as_mut().enable();
        share.release(0);
        assert!(!woken(waiting), "a partition let go wakes no one");
    }
}
