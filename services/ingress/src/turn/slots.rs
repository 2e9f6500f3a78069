//! The caps on concurrent turns of one ingress copy (DESIGN.md §7, Limits): one owner may
//! run `per_owner` turns at once here, everyone together `total`. A slot is taken before a
//! turn creates, leases or appends anything, and its guard gives it back on every path —
//! a refused start, the turn's end, a panic — so a slot can never leak.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use turnlog_core::ids::Owner;

use crate::config::{DEFAULT_MAX_TURNS, DEFAULT_MAX_TURNS_PER_OWNER};

/// How many turns may run at once on this copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnLimits {
    pub per_owner: u32,
    pub total: u32,
}

impl Default for TurnLimits {
    fn default() -> Self {
        Self { per_owner: DEFAULT_MAX_TURNS_PER_OWNER, total: DEFAULT_MAX_TURNS }
    }
}

/// Which cap a refused turn met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapReached {
    Owner(u32),
    Total(u32),
}

impl fmt::Display for CapReached {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Owner(n) => {
                write!(f, "too many turns at once: this owner's limit is {n}; retry when one ends")
            }
            Self::Total(n) => write!(f, "too many turns at once: this server's limit is {n}; retry shortly"),
        }
    }
}

/// Turns running on this copy, in all and by owner.
#[derive(Debug, Default)]
struct Counts {
    total: u32,
    by_owner: HashMap<Owner, u32>,
}

/// The slots of one copy; [`TurnSlot`]s point back to it.
#[derive(Debug, Default)]
pub(super) struct TurnSlots {
    counts: Arc<Mutex<Counts>>,
}

impl TurnSlots {
    /// A slot for one more turn of `owner`, unless a cap is reached.
    pub(super) fn take(&self, owner: &Owner, limits: TurnLimits) -> Result<TurnSlot, CapReached> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let mine = counts.by_owner.get(owner).copied().unwrap_or(0);
        if mine >= limits.per_owner {
            return Err(CapReached::Owner(limits.per_owner));
        }
        if counts.total >= limits.total {
            return Err(CapReached::Total(limits.total));
        }
        counts.total += 1;
        counts.by_owner.insert(owner.clone(), mine + 1);
        Ok(TurnSlot {
            counts: Arc::clone(&self.counts),
            owner: owner.clone(),
            released: AtomicBool::new(false),
            taken: std::time::Instant::now(),
        })
    }
}

/// One running turn's place under the caps; given back by [`TurnSlot::release`] or when
/// dropped, whichever comes first.
#[derive(Debug)]
pub struct TurnSlot {
    counts: Arc<Mutex<Counts>>,
    owner: Owner,
    released: AtomicBool,
    /// When the turn's request took it: the start of the time turnlog spends before the
    /// model call (`turnlog_turn_pre_upstream_seconds`).
    pub taken: std::time::Instant,
}

impl TurnSlot {
    /// Gives the slot back now (a turn does so before its `end`, so a client that sends
    /// again the moment it reads `end` finds the slot free). Later calls do nothing.
    pub fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.total = counts.total.saturating_sub(1);
        if let Some(n) = counts.by_owner.get_mut(&self.owner) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.by_owner.remove(&self.owner);
            }
        }
    }
}

impl Drop for TurnSlot {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(name: &str) -> Owner {
        Owner::parse(name).unwrap()
    }

    /// Turns holding a slot: in all, and of `owner`.
    fn running(slots: &TurnSlots, owner: &Owner) -> (u32, u32) {
        let counts = slots.counts.lock().unwrap();
        (counts.total, counts.by_owner.get(owner).copied().unwrap_or(0))
    }

    #[test]
    fn caps_per_owner_and_in_all_and_every_slot_comes_back() {
        let slots = TurnSlots::default();
        let limits = TurnLimits { per_owner: 2, total: 3 };
        let (alice, bob) = (owner("alice"), owner("bob"));
        let a1 = slots.take(&alice, limits).unwrap();
        let a2 = slots.take(&alice, limits).unwrap();
        assert_eq!(slots.take(&alice, limits).unwrap_err(), CapReached::Owner(2));
        let b1 = slots.take(&bob, limits).unwrap();
        assert_eq!(slots.take(&bob, limits).unwrap_err(), CapReached::Total(3));
        assert_eq!(running(&slots, &alice), (3, 2));

        a1.release();
        a1.release();
        assert_eq!(running(&slots, &alice), (2, 1), "a second release gives nothing back twice");
        drop(a1);
        assert_eq!(running(&slots, &alice), (2, 1), "dropping a released slot gives nothing back");
        drop((a2, b1));
        assert_eq!(running(&slots, &alice), (0, 0));
        assert!(slots.counts.lock().unwrap().by_owner.is_empty(), "no owner left behind");
    }
}
