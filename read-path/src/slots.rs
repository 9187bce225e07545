//! The origin's fill slots: how many ranged GETs this node keeps in flight to its origins,
//! adapted to the bandwidth each one gets.
//!
//! `origin.concurrency` is the most. When the link to the origin is shared by a whole
//! scale-up, as many requests as that split it into shares so thin that each takes longer than
//! a reader can wait (a 16 MiB part at 1.5 MB/s is 11 s), and the unluckiest starve. So the
//! number of slots follows the progress of the requests, as TCP's window follows its acks
//! (additive increase, multiplicative decrease): a request that took longer than [`Slots`]'
//! `slow` (a quarter of the read deadline) or failed halves the slots, at most once per `slow`
//! (the requests of one congested moment end close together: one cut for all of them); one
//! that took less than half of it adds a slot back. The link is as busy with fewer, longer
//! requests, and each of them gets bytes often enough.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use larder_stats::ReadStats;
use parking_lot::Mutex;
use tokio::sync::{AcquireError, Semaphore, SemaphorePermit};
use tokio::time::Instant;

/// The fewest slots the cuts leave.
pub const MIN_SLOTS: usize = 2;

/// The adaptive slots of one cache.
#[derive(Debug)]
pub struct Slots {
    permits: Semaphore,
    max: usize,
    /// A request that takes longer than this is starved.
    slow: Duration,
    state: Mutex<State>,
    /// Where the slots and the most requests in flight at once since start are shown.
    stats: Arc<ReadStats>,
}

#[derive(Debug)]
struct State {
    /// The slots now.
    limit: usize,
    /// Slots taken away while their permits were out: forgotten as they come back.
    owed: usize,
    /// Requests in flight.
    in_flight: usize,
    /// The last cut, so that one congested moment cuts once.
    last_cut: Option<Instant>,
}

/// A slot held by one request; given back when dropped.
#[derive(Debug)]
pub struct Slot<'a> {
    slots: &'a Slots,
    permit: Option<SemaphorePermit<'a>>,
    started: Instant,
}

impl Slots {
    /// At most `max` slots (at least 1), starting at `max`; a request slower than `slow`
    /// counts as starved. Shown in `stats`.
    pub fn new(max: usize, slow: Duration, stats: Arc<ReadStats>) -> Self {
        let max = max.max(1);
        stats.origin_slots.store(max as u64, Ordering::Relaxed);
        Self {
            permits: Semaphore::new(max),
            max,
            slow,
            state: Mutex::new(State {
                limit: max,
                owed: 0,
                in_flight: 0,
                last_cut: None,
            }),
            stats,
        }
    }

    /// A permit, when one is free: wrap it with [`Slots::slot`]. (The caller polls this one
    /// future throughout its wait, so that it keeps its place in the queue.)
    pub async fn permit(&self) -> Result<SemaphorePermit<'_>, AcquireError> {
        self.permits.acquire().await
    }

    /// The slot of a request that starts now with `permit`.
    pub fn slot<'a>(&'a self, permit: SemaphorePermit<'a>) -> Slot<'a> {
        let mut state = self.state.lock();
        state.in_flight += 1;
        (self.stats.origin_fills_peak).fetch_max(state.in_flight as u64, Ordering::Relaxed);
        Slot {
            slots: self,
            permit: Some(permit),
            started: Instant::now(),
        }
    }

    /// The slots now.
    pub fn limit(&self) -> usize {
        self.state.lock().limit
    }

    /// A request ended after `took`, `ok` or not: more slots, fewer, or as many.
    fn ended(&self, took: Duration, ok: bool) {
        let mut state = self.state.lock();
        let now = Instant::now();
        if !ok || took > self.slow {
            if state.limit <= MIN_SLOTS || state.last_cut.is_some_and(|at| now - at < self.slow) {
                return;
            }
            let cut = state.limit - (state.limit / 2).max(MIN_SLOTS);
            state.limit -= cut;
            state.last_cut = Some(now);
            // Free permits go now; those out go as they come back.
            let forgotten = self.permits.forget_permits(cut);
            state.owed += cut - forgotten;
            self.stats
                .origin_slots
                .store(state.limit as u64, Ordering::Relaxed);
            tracing::debug!(
                slots = state.limit,
                ?took,
                ok,
                "origin requests starve: fewer at once"
            );
        } else if took < self.slow / 2 && state.limit < self.max {
            state.limit += 1;
            self.stats
                .origin_slots
                .store(state.limit as u64, Ordering::Relaxed);
            if state.owed > 0 {
                state.owed -= 1;
            } else {
                self.permits.add_permits(1);
            }
        }
    }
}

impl Slot<'_> {
    /// The request ended, `ok` or not (dropping the slot without this counts for nothing).
    pub fn end(mut self, ok: bool) {
        self.slots.ended(self.started.elapsed(), ok);
        self.give_back();
    }

    fn give_back(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let mut state = self.slots.state.lock();
        state.in_flight -= 1;
        if state.owed > 0 {
            state.owed -= 1;
            permit.forget();
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.give_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOW: Duration = Duration::from_secs(4);

    /// Takes every free permit as a slot, runs them for `took`, ends them `ok`.
    async fn round(slots: &Slots, took: Duration, ok: bool) -> usize {
        let mut held = Vec::new();
        while let Ok(permit) = slots.permits.try_acquire() {
            held.push(slots.slot(permit));
        }
        let n = held.len();
        tokio::time::advance(took).await;
        for slot in held {
            slot.end(ok);
        }
        n
    }

    #[tokio::test(start_paused = true)]
    async fn starved_requests_halve_the_slots_once_a_moment_and_fast_ones_add_them_back() {
        let stats = Arc::new(ReadStats::default());
        let slots = Slots::new(16, SLOW, stats.clone());
        assert_eq!(round(&slots, Duration::from_secs(1), true).await, 16);
        // 16 slow requests ending together: one cut, to 8.
        assert_eq!(round(&slots, SLOW * 2, true).await, 16);
        assert_eq!(slots.limit(), 8);
        assert_eq!(round(&slots, SLOW * 2, true).await, 8);
        assert_eq!(slots.limit(), 4);
        // Failures cut too, never below the least.
        for _ in 0..4 {
            round(&slots, SLOW * 2, false).await;
        }
        assert_eq!(slots.limit(), MIN_SLOTS);
        assert_eq!(round(&slots, Duration::ZERO, true).await, MIN_SLOTS);
        // Fast requests add one slot each, up to the most.
        assert_eq!(slots.limit(), MIN_SLOTS * 2);
        for _ in 0..10 {
            round(&slots, Duration::from_secs(1), true).await;
        }
        assert_eq!(slots.limit(), 16);
        assert_eq!(round(&slots, Duration::ZERO, true).await, 16);
        assert_eq!(stats.origin_fills_peak.load(Ordering::Relaxed), 16);
        assert_eq!(stats.origin_slots.load(Ordering::Relaxed), 16);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cut_while_permits_are_out_takes_them_as_they_come_back() {
        let slots = Slots::new(8, SLOW, Arc::default());
        let mut held: Vec<Slot<'_>> = Vec::new();
        for _ in 0..8 {
            held.push(slots.slot(slots.permits.try_acquire().expect("free")));
        }
        tokio::time::advance(SLOW * 2).await;
        held.pop().expect("one").end(true);
        assert_eq!(slots.limit(), 4);
        // Dropped without an end (a cancelled fill): given back, and owed ones forgotten.
        held.clear();
        assert_eq!(slots.permits.available_permits(), 4);
    }
}
