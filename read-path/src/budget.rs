//! One memory budget for the block bytes the cache keeps in memory (`cache.memory_limit`):
//! blocks being fetched, blocks waiting for their cache write, blocks read from disk, and
//! every block a reader or a reply still holds.
//!
//! A [`Charge`] is taken before a block's memory is, and travels with its bytes: it is
//! returned when the last reference to them goes (the fill, the write, the reader's hold and
//! the FUSE reply each hold one), so the figure never falls below what memory holds. A fill
//! is charged for all the blocks of its run when it starts.
//!
//! Modelled on mountpoint-s3's memory limiter: memory a reader waits for now is always
//! charged, even over the limit (making a reader wait for memory that other readers hold
//! could deadlock them); memory for later — readahead, blocks held ahead of a reader or read
//! whole for the next reads inside them, the rest of an origin part after the block asked for
//! — is charged only if it fits, else not fetched (the window is smaller, not the memory
//! larger); prefetch jobs wait until it fits. And a fill waits while the blocks waiting for
//! their cache write alone pass the limit: a disk slower than the origin holds fills back
//! instead of piling blocks up (the writes never wait for readers, so this wait always ends).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use larder_stats::ReadStats;

/// The budget. `used` is the stats' gauge itself, so metrics show the live figure.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    stats: Arc<ReadStats>,
    /// Charged bytes of blocks waiting for their cache write.
    writing: AtomicU64,
    /// The most bytes charged at once.
    peak: AtomicU64,
    /// Woken whenever a charge is returned.
    released: tokio::sync::Notify,
}

/// Bytes charged to a budget, returned when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes, publishing its use in `stats`.
    pub fn new(limit: u64, stats: Arc<ReadStats>) -> Arc<Self> {
        stats.memory_limit_bytes.store(limit, Ordering::Relaxed);
        Arc::new(Self {
            limit,
            stats,
            writing: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            released: tokio::sync::Notify::new(),
        })
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes charged now.
    pub fn used(&self) -> u64 {
        self.stats.memory_used_bytes.load(Ordering::Relaxed)
    }

    /// The most bytes charged at once since the start.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Whether `bytes` fit under the limit now.
    pub fn room_for(&self, bytes: u64) -> bool {
        self.used() + bytes <= self.limit
    }

    /// Charges `bytes` whatever is charged already: for memory a reader waits for now.
    pub fn charge(self: &Arc<Self>, bytes: u64) -> Charge {
        let used = self.stats.memory_used_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.peak.fetch_max(used + bytes, Ordering::Relaxed);
        Charge {
            budget: self.clone(),
            bytes,
        }
    }

    /// Charges `bytes` if they fit under the limit (or nothing is charged: one oversized
    /// request is never refused forever).
    pub fn try_charge(self: &Arc<Self>, bytes: u64) -> Option<Charge> {
        let used = &self.stats.memory_used_bytes;
        let before = used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                (now == 0 || now + bytes <= self.limit).then_some(now + bytes)
            })
            .ok()?;
        self.peak.fetch_max(before + bytes, Ordering::Relaxed);
        Some(Charge {
            budget: self.clone(),
            bytes,
        })
    }

    /// Waits until `bytes` fit, then charges them: for prefetch jobs, which nobody waits for
    /// block by block.
    pub async fn charge_when_room(self: &Arc<Self>, bytes: u64) -> Charge {
        self.wait_for(|| self.try_charge(bytes)).await
    }

    /// Waits until `bytes` fit, at most `patience`, then charges them, fitting or not: for a
    /// block a reader waits for. The wait keeps many readers of cold files within the budget;
    /// its bound means readers never deadlock on memory other waiting readers hold.
    pub async fn charge_soon(self: &Arc<Self>, bytes: u64, patience: Duration) -> Charge {
        let room = tokio::time::timeout(patience, self.charge_when_room(bytes)).await;
        room.unwrap_or_else(|_| self.charge(bytes))
    }

    /// Waits while the blocks waiting for their cache write pass the limit.
    pub async fn writes_below_limit(&self) {
        let below = || (self.writing.load(Ordering::Relaxed) < self.limit).then_some(());
        self.wait_for(below).await;
    }

    /// Waits until `ready` gives a value, trying it again whenever a charge is returned;
    /// counts one wait if it had to.
    async fn wait_for<T>(&self, mut ready: impl FnMut() -> Option<T>) -> T {
        let mut waited = false;
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Registered before the try, so a charge returned in between still wakes us.
            released.as_mut().enable();
            if let Some(value) = ready() {
                return value;
            }
            if !std::mem::replace(&mut waited, true) {
                larder_stats::add(&self.stats.memory_waits, 1);
            }
            released.await;
        }
    }
}

impl Charge {
    /// The bytes charged.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Moves `bytes` of this charge (all it has, at most) into a charge of their own.
    pub fn split(&mut self, bytes: u64) -> Charge {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        Charge {
            budget: self.budget.clone(),
            bytes,
        }
    }

    /// Adds `other` to this charge.
    pub fn merge(&mut self, mut other: Charge) {
        self.bytes += std::mem::take(&mut other.bytes);
    }

    /// Counts this charge as waiting for its cache write until the guard is dropped.
    pub fn writing(self: &Arc<Self>) -> Writing {
        self.budget.writing.fetch_add(self.bytes, Ordering::Relaxed);
        Writing(self.clone())
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let used = &self.budget.stats.memory_used_bytes;
            used.fetch_sub(self.bytes, Ordering::Relaxed);
            self.budget.released.notify_waiters();
        }
    }
}

/// A charge counted as waiting for its cache write; see [`Charge::writing`].
#[derive(Debug)]
pub struct Writing(Arc<Charge>);

impl Drop for Writing {
    fn drop(&mut self) {
        let budget = &self.0.budget;
        budget.writing.fetch_sub(self.0.bytes, Ordering::Relaxed);
        budget.released.notify_waiters();
    }
}

/// `bytes` holding `charge` until their last reference goes.
pub fn charged(bytes: Bytes, charge: Arc<Charge>) -> Bytes {
    Bytes::from_owner(Charged {
        bytes,
        _charge: charge,
    })
}

struct Charged {
    bytes: Bytes,
    _charge: Arc<Charge>,
}

impl AsRef<[u8]> for Charged {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: u64) -> Arc<MemoryBudget> {
        MemoryBudget::new(limit, Arc::new(ReadStats::default()))
    }

    #[test]
    fn charges_are_returned_when_their_bytes_go() {
        let budget = budget(10);
        let charge = Arc::new(budget.charge(6));
        let bytes = charged(Bytes::from_static(b"abcdef"), charge.clone());
        let slice = bytes.slice(1..3);
        drop((charge, bytes));
        assert_eq!(budget.used(), 6, "a slice still holds the bytes");
        drop(slice);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn what_is_for_later_is_charged_only_if_it_fits() {
        let budget = budget(10);
        let now = budget.charge(8);
        assert!(budget.try_charge(3).is_none());
        let later = budget.try_charge(2).expect("fits");
        let over = budget.charge(5);
        assert_eq!(
            budget.used(),
            15,
            "what a reader waits for is charged over the limit"
        );
        assert_eq!(budget.peak(), 15);
        drop((now, later, over));
        assert!(
            budget.try_charge(11).is_some(),
            "an oversized charge fits an empty budget"
        );
    }

    #[test]
    fn split_and_merged_charges_return_exactly_what_was_taken() {
        let budget = budget(100);
        let mut run = budget.charge(40);
        let block = run.split(10);
        run.merge(budget.charge(5));
        assert_eq!((run.bytes(), block.bytes()), (35, 10));
        let rest = run.split(1000);
        assert_eq!((run.bytes(), rest.bytes()), (0, 35));
        drop((run, block));
        assert_eq!(budget.used(), 35);
        drop(rest);
        assert_eq!(budget.used(), 0);
    }

    /// Returns once every other task of the test's runtime waits: with the clock paused, a
    /// timer fires only when no task can make progress.
    async fn others_wait() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_job_waits_for_room_and_gets_it_when_a_charge_goes() {
        let budget = budget(10);
        let held = budget.charge(8);
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.charge_when_room(5).await.bytes() }
        });
        others_wait().await;
        assert!(!waiting.is_finished(), "it must wait while 8 of 10 are charged");
        drop(held);
        assert_eq!(waiting.await.unwrap(), 5);
        assert_eq!(budget.stats.memory_waits.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_waits_for_room_at_most_its_patience() {
        let budget = budget(10);
        let held = budget.charge(8);
        let patience = Duration::from_secs(1);
        let soon = |budget: &Arc<MemoryBudget>| {
            let budget = budget.clone();
            tokio::spawn(async move { budget.charge_soon(5, patience).await })
        };
        let waiting = soon(&budget);
        tokio::time::sleep(patience / 2).await;
        assert!(!waiting.is_finished(), "it must wait while 8 of 10 are charged");
        drop(held);
        let got = waiting.await.unwrap();
        assert_eq!((got.bytes(), budget.used()), (5, 5));

        let held = budget.charge(5);
        let started = tokio::time::Instant::now();
        let over = soon(&budget).await.unwrap();
        assert_eq!(started.elapsed(), patience, "charged when its patience ran out");
        assert_eq!(budget.used(), 15);
        drop((got, held, over));
    }

    #[tokio::test(start_paused = true)]
    async fn fills_wait_while_the_writes_alone_pass_the_limit() {
        let budget = budget(10);
        let block = Arc::new(budget.charge(10));
        let writing = block.writing();
        let fill = tokio::spawn({
            let budget = budget.clone();
            async move { budget.writes_below_limit().await }
        });
        others_wait().await;
        assert!(!fill.is_finished());
        drop(writing);
        fill.await.unwrap();
    }
}
