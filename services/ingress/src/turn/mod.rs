//! Turns: starting one (`start`: the checks, the caps, the lease and the durable user
//! message), running it (`runner`) and following it (`follow`). A turn runs in its own
//! task, detached from the HTTP request that started it (a closed client does not cancel
//! it); every event it emits is kept in order so any number of clients can follow it from
//! any point, on this copy directly and on other copies through core NATS (`remote`:
//! `live`, `turn` snapshots, `control` for stop). A turn that paused for client tools
//! continues with their results (`tools`, DESIGN §14).

mod follow;
mod remote;
mod runner;
pub mod server;
mod slots;
mod start;
mod tools;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use turnlog_core::events::PendingReason;
use turnlog_core::ids::{AttemptId, Owner, SessionId};

pub use follow::{attach, follow_local};
pub use remote::{remote_attempt, remote_stop, remote_stream};
pub use runner::{start_turn, NamedServer, ServerTools, ToolOffer, TurnOptions, TurnStart};
pub use slots::{CapReached, TurnLimits, TurnSlot};
pub use start::{
    begin_turn, chat_session, edit_fork, prepared, ready_for_turns, regenerate, regenerate_fork, retry_last,
    take_slot, NewMessage, MAX_NAME_CHARS,
};
pub use tools::{
    call_id_fits, cancel_waiting, continue_after_permission, continue_with_results, tool_offer, waiting,
    ToolResult, MAX_CALL_ID,
};
pub use turnlog_core::stream::{StreamEvent, TurnEvent};

/// A turn this copy runs: its events so far and the means to stop it.
pub struct ActiveTurn {
    pub session: SessionId,
    /// The attempt this turn runs (a response's id on the OpenAI-compatible routes).
    pub attempt_id: AttemptId,
    events: Mutex<Vec<Arc<StreamEvent>>>,
    /// Whether a copy has asked for this turn's events (a follower there): from then on its
    /// events also go out on the live subject. Set and read with `events` locked.
    followed: AtomicBool,
    /// The number of events emitted; followers wait on it.
    count: watch::Sender<u64>,
    stop: CancellationToken,
    stop_reason: Mutex<Option<PendingReason>>,
}

impl ActiveTurn {
    fn new(session: SessionId, attempt_id: AttemptId) -> Arc<Self> {
        Arc::new(Self {
            session,
            attempt_id,
            events: Mutex::new(Vec::new()),
            followed: AtomicBool::new(false),
            count: watch::Sender::new(0),
            stop: CancellationToken::new(),
            stop_reason: Mutex::new(None),
        })
    }

    /// Appends an event and wakes every follower; returns it when another copy follows the
    /// turn (for the live subject).
    fn emit(&self, event: TurnEvent) -> Option<Arc<StreamEvent>> {
        let mut events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        let e = Arc::new(StreamEvent { id: events.len() as u64 + 1, event });
        events.push(Arc::clone(&e));
        self.count.send_replace(e.id);
        self.followed.load(Ordering::Relaxed).then_some(e)
    }

    /// The events after `after`, for another copy's follower: every event emitted after
    /// these is published on the live subject (each is in the snapshot or published, or
    /// both: a follower skips what it has).
    pub fn followed_after(&self, after: u64) -> Vec<Arc<StreamEvent>> {
        let events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        self.followed.store(true, Ordering::Relaxed);
        events.iter().skip(usize::try_from(after).unwrap_or(usize::MAX)).cloned().collect()
    }

    /// Events with an id above `after`.
    pub fn events_after(&self, after: u64) -> Vec<Arc<StreamEvent>> {
        let events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        events.iter().skip(usize::try_from(after).unwrap_or(usize::MAX)).cloned().collect()
    }

    /// Whether the turn has emitted its `end` (nothing follows it).
    pub fn is_over(&self) -> bool {
        let events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        events.last().is_some_and(|e| e.is_end())
    }

    /// A receiver that changes whenever an event is emitted.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.count.subscribe()
    }

    /// Asks the turn to end now, keeping what it has (`stopped` by the user, or
    /// `interrupted` by a shutdown or a lost lease). The first reason wins.
    pub fn stop(&self, reason: PendingReason) {
        let mut r = self.stop_reason.lock().unwrap_or_else(PoisonError::into_inner);
        r.get_or_insert(reason);
        self.stop.cancel();
    }

    fn stop_reason(&self) -> PendingReason {
        self.stop_reason.lock().unwrap_or_else(PoisonError::into_inner).unwrap_or_default()
    }
}

/// The turns this copy runs, by session, and their slots under the caps.
#[derive(Default)]
pub struct TurnHub {
    turns: Mutex<HashMap<SessionId, Arc<ActiveTurn>>>,
    slots: slots::TurnSlots,
    tasks: TaskTracker,
    closing: CancellationToken,
}

impl TurnHub {
    /// A slot for one more turn of `owner`, taken before the turn creates, leases or
    /// appends anything; the turn holds it until it ends.
    pub fn take_slot(&self, owner: &Owner, limits: TurnLimits) -> Result<TurnSlot, CapReached> {
        self.slots.take(owner, limits)
    }

    pub fn get(&self, session: SessionId) -> Option<Arc<ActiveTurn>> {
        self.turns.lock().unwrap_or_else(PoisonError::into_inner).get(&session).cloned()
    }

    /// The turn of `attempt_id` if this copy runs it.
    pub fn by_attempt(&self, attempt_id: &AttemptId) -> Option<Arc<ActiveTurn>> {
        let turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        turns.values().find(|t| t.attempt_id == *attempt_id).cloned()
    }

    fn insert(&self, turn: Arc<ActiveTurn>) {
        self.turns.lock().unwrap_or_else(PoisonError::into_inner).insert(turn.session, turn);
    }

    /// Unregisters `turn` — only it: the session's next turn may already have taken its
    /// place (the lease and the slot are given back before the `end`).
    fn remove(&self, turn: &Arc<ActiveTurn>) {
        let mut turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        if turns.get(&turn.session).is_some_and(|t| Arc::ptr_eq(t, turn)) {
            turns.remove(&turn.session);
        }
    }

    pub fn active(&self) -> usize {
        self.turns.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether new turns are refused (the copy is shutting down).
    pub fn is_closing(&self) -> bool {
        self.closing.is_cancelled()
    }

    /// Shutdown: refuse new turns, checkpoint every turn in flight (each ends
    /// `interrupted` with its partial stored), and wait for them to finish writing.
    pub async fn close(&self) {
        self.closing.cancel();
        let turns: Vec<_> =
            self.turns.lock().unwrap_or_else(PoisonError::into_inner).values().cloned().collect();
        for t in &turns {
            t.stop(PendingReason::Interrupted);
        }
        self.tasks.close();
        self.tasks.wait().await;
    }
}
