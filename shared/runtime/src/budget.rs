//! How many appends a background producer (an import) keeps in flight on one partition,
//! found from what its own appends take, so that it yields to live ones (issue 43).
//!
//! A live append waits behind whatever is queued ahead of it in its partition's stream and
//! in the writer's batch. A background producer cannot see live traffic, but it sees the
//! queue: its own round trips grow when the queue does, whatever fills it (live appends,
//! its own, a slow disk, busy cores). So it keeps the delay it adds small, as LEDBAT does
//! for background transfers (RFC 6817): the lowest round trip seen is the base; what a round
//! trip takes beyond it is queueing; the window grows while the queueing is under a target
//! and shrinks in proportion as it goes over, by at most one append a round trip either way.
//! The target is a share of the base, so a machine whose commits are slow (fsync) lets a
//! wider window through, where batching costs little, and a fast one a narrower.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::{AcquireError, Semaphore, SemaphorePermit};

/// The queueing an adaptive budget allows its appends, as a share of the base round trip.
pub const TARGET_SHARE: f64 = 0.5;

/// Queueing allowed however fast the base: below this, scheduling noise alone goes over.
const MIN_TARGET: Duration = Duration::from_micros(200);

/// How long a lowest round trip counts as the base: [`FLOORS`] periods of this length.
/// The base is kept long because a producer that runs alone finds only its own queue in
/// every round trip; a base that is too low only makes it yield more.
const FLOOR_PERIOD: Duration = Duration::from_secs(60);
const FLOORS: usize = 10;

/// A partition's window for one kind of background work, shared by every producer of it in
/// a process.
pub struct Budget {
    permits: Semaphore,
    window: Mutex<Window>,
}

struct Window {
    /// Appends allowed in flight; fractional, since it grows by parts of an append.
    limit: f64,
    /// Most it may grow to; equal to `limit` for a fixed budget.
    max: f64,
    /// The queueing allowed, as a share of the base; None for a fixed budget.
    target_share: Option<f64>,
    /// Permits the semaphore holds or has lent out: `limit` rounded down, reached by
    /// adding permits when it grows and by keeping returned ones when it shrinks.
    granted: usize,
    /// The lowest round trip in each of the last [`FLOORS`] periods, the newest first.
    floors: [Duration; FLOORS],
    period_started: Instant,
}

/// An append's place in a [`Budget`]: [`Slot::done`] when its outcome is known reports the
/// round trip; dropped without, it only frees the place.
pub struct Slot<'a> {
    budget: &'a Budget,
    permit: Option<SemaphorePermit<'a>>,
    started: Instant,
}

impl Budget {
    /// A window that starts at one append and moves with the round trips, up to `max`,
    /// allowing them [`TARGET_SHARE`] of the base as queueing.
    pub fn adaptive(max: usize) -> Self {
        Self::with(1, max, Some(TARGET_SHARE))
    }

    /// [`Budget::adaptive`] allowing `target_share` of the base (the benchmark compares),
    /// taken between 0 and 100 (a NaN as 0), so that scaling the base cannot panic.
    pub fn adaptive_to(max: usize, target_share: f64) -> Self {
        let share = if target_share.is_nan() { 0.0 } else { target_share.clamp(0.0, 100.0) };
        Self::with(1, max, Some(share))
    }

    /// A window of `n` appends that never moves (the benchmark compares with it).
    pub fn fixed(n: usize) -> Self {
        Self::with(n, n, None)
    }

    fn with(start: usize, max: usize, target_share: Option<f64>) -> Self {
        let (start, max) = (start.max(1), max.max(1));
        Self {
            permits: Semaphore::new(start),
            window: Mutex::new(Window {
                limit: start as f64,
                max: max as f64,
                target_share,
                granted: start,
                floors: [Duration::MAX; FLOORS],
                period_started: Instant::now(),
            }),
        }
    }

    /// Most appends this budget lets through at once.
    pub fn max(&self) -> usize {
        self.window().max as usize
    }

    /// Appends allowed in flight now.
    pub fn limit(&self) -> f64 {
        self.window().limit
    }

    /// Waits for a place; the round trip is timed from here.
    pub async fn slot(&self) -> Result<Slot<'_>, AcquireError> {
        let permit = self.permits.acquire().await?;
        Ok(Slot { budget: self, permit: Some(permit), started: Instant::now() })
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        // Nothing panics while the lock is held; a poisoned window is still a window.
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives a place back, keeping it instead when the window has shrunk below what is lent.
    fn give_back(&self, permit: SemaphorePermit<'_>, round_trip: Option<Duration>) {
        let mut window = self.window();
        if let Some(rtt) = round_trip {
            window.observe(rtt, Instant::now());
        }
        let want = window.limit as usize;
        if window.granted > want {
            permit.forget();
            window.granted -= 1;
        } else {
            drop(permit);
            if window.granted < want {
                self.permits.add_permits(want - window.granted);
                window.granted = want;
            }
        }
    }
}

impl Window {
    /// One round trip: the base follows the lowest, and the window moves toward keeping the
    /// queueing at the target.
    fn observe(&mut self, rtt: Duration, now: Instant) {
        let Some(share) = self.target_share else { return };
        if now.duration_since(self.period_started) >= FLOOR_PERIOD {
            self.floors.rotate_right(1);
            self.floors[0] = Duration::MAX;
            self.period_started = now;
        }
        self.floors[0] = self.floors[0].min(rtt);
        let base = self.floors.iter().copied().min().unwrap_or(rtt);
        let target = base.mul_f64(share).max(MIN_TARGET);
        let queued = rtt.saturating_sub(base);
        // From +1 (no queue) to -1 (twice the target or more), per round trip of the window.
        let off = ((target.as_secs_f64() - queued.as_secs_f64()) / target.as_secs_f64()).max(-1.0);
        self.limit = (self.limit + off / self.limit).clamp(1.0, self.max);
    }
}

impl Slot<'_> {
    /// The append's outcome is known: its round trip counts.
    pub fn done(mut self) {
        if let Some(permit) = self.permit.take() {
            self.budget.give_back(permit, Some(self.started.elapsed()));
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            self.budget.give_back(permit, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn window(max: usize) -> Window {
        let Budget { window, .. } = Budget::adaptive(max);
        window.into_inner().unwrap()
    }

    #[test]
    fn the_window_grows_while_round_trips_stay_at_the_base_and_stops_at_its_most() {
        let (mut w, now) = (window(8), Instant::now());
        for _ in 0..1_000 {
            w.observe(2 * MS, now);
        }
        assert_eq!(w.limit, 8.0);
    }

    #[test]
    fn the_window_settles_where_the_queueing_meets_the_target() {
        // A queue that grows by 0.5 ms an append in flight over a 2 ms base: the target
        // (half the base, 1 ms) is met at two appends in flight.
        let (mut w, now) = (window(16), Instant::now());
        w.observe(2 * MS, now);
        for _ in 0..2_000 {
            let rtt = 2 * MS + Duration::from_micros((w.limit * 500.0) as u64);
            w.observe(rtt, now);
        }
        assert!((1.8..=2.2).contains(&w.limit), "settled at {}", w.limit);
    }

    #[test]
    fn a_queue_that_others_fill_shrinks_the_window_to_one() {
        let (mut w, now) = (window(16), Instant::now());
        for _ in 0..1_000 {
            w.observe(2 * MS, now);
        }
        assert_eq!(w.limit, 16.0);
        // Live appends fill the queue: 20 ms round trips whatever the window.
        for _ in 0..200 {
            w.observe(20 * MS, now);
        }
        assert_eq!(w.limit, 1.0);
    }

    #[test]
    fn the_base_is_forgotten_after_its_periods() {
        let (mut w, mut now) = (window(16), Instant::now());
        w.observe(MS, now);
        // The machine becomes slower for good: 10 ms round trips at any window.
        for _ in 0..=FLOORS {
            now += FLOOR_PERIOD;
            for _ in 0..100 {
                w.observe(10 * MS, now);
            }
        }
        assert_eq!(w.floors.iter().min(), Some(&(10 * MS)));
        assert_eq!(w.limit, 16.0, "the window grows again once 10 ms is the base");
    }

    #[test]
    fn a_share_out_of_range_is_bounded_instead_of_panicking() {
        for share in [f64::NAN, -1.0, f64::INFINITY] {
            let budget = Budget::adaptive_to(4, share);
            for rtt in [MS, Duration::from_secs(3600), MS] {
                budget.window().observe(rtt, Instant::now());
            }
            assert!((1.0..=4.0).contains(&budget.limit()), "share {share}: {}", budget.limit());
        }
    }

    #[tokio::test]
    async fn a_shrinking_window_keeps_returned_places_and_a_growing_one_adds_them() {
        let budget = Budget::adaptive(4);
        budget.window().limit = 3.0;
        budget.give_back(budget.permits.acquire().await.unwrap(), None);
        assert_eq!((budget.permits.available_permits(), budget.window().granted), (3, 3));

        let held: Vec<_> = [budget.slot().await.unwrap(), budget.slot().await.unwrap()].into();
        budget.window().limit = 1.0;
        drop(held);
        assert_eq!((budget.permits.available_permits(), budget.window().granted), (1, 1));

        let fixed = Budget::fixed(2);
        let slot = fixed.slot().await.unwrap();
        fixed.window().observe(Duration::from_secs(5), Instant::now());
        slot.done();
        assert_eq!((fixed.limit(), fixed.permits.available_permits()), (2.0, 2));
    }
}
