//! Where the clients streaming a check are, so that the check keeps pace with them.
//!
//! A check fetches and hashes its content far faster than a puller takes it (loopback against
//! a puller that hashes and unpacks). Left alone it runs to the end at once, the blocks it
//! hashed leave its memory, and every block then goes to the client by a read back from the
//! cache disk, checked again. So the check hashes no block that would push out of its memory
//! one a streaming client still needs ([`Pace::until_kept`]), and fetches no further ahead
//! of its hashing than it holds: blocks go from the upstream to the client through memory.
//!
//! No client is made to wait for a slower one: a client waiting for a block not yet hashed
//! lets the check go on, and one that has taken no block for [`STALL`] holds nothing back.
//! A client left behind reads its blocks from the disk, as any reader does.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// A client that has taken no block for this long no longer holds a check back.
pub(crate) const STALL: Duration = Duration::from_secs(1);

/// The clients streaming one check's blocks, each at the block it takes next.
#[derive(Debug, Default)]
pub(crate) struct Pace {
    followers: Mutex<Followers>,
    moved: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Followers {
    next_id: u64,
    /// By client: the block it takes next, and since when.
    at: HashMap<u64, (u32, Instant)>,
}

/// One client's place among those streaming a check; gone when dropped.
#[derive(Debug)]
pub(crate) struct Place {
    pace: Arc<Pace>,
    id: u64,
}

impl Pace {
    /// A place for a client about to take block 0.
    pub(crate) fn join(self: &Arc<Self>) -> Place {
        let mut followers = self.followers.lock();
        let id = followers.next_id;
        followers.next_id += 1;
        followers.at.insert(id, (0, Instant::now()));
        Place {
            pace: self.clone(),
            id,
        }
    }

    /// Returns once the check may hash block `index`, keeping the last `kept` blocks hashed:
    /// every client that is neither stalled nor waiting for the check will still find its
    /// next block among them, or some client waits for `index` itself.
    pub(crate) async fn until_kept(&self, index: u32, kept: usize) {
        loop {
            let moved = self.moved.notified();
            tokio::pin!(moved);
            // Registered before the look, so a move between the two still wakes us.
            moved.as_mut().enable();
            let stalls = {
                let followers = self.followers.lock();
                if followers.at.values().any(|&(next, _)| next >= index) {
                    return;
                }
                let oldest_kept = u64::from(index) + 1;
                followers
                    .at
                    .values()
                    .filter(|&&(next, since)| {
                        u64::from(next) + (kept as u64) < oldest_kept && since.elapsed() < STALL
                    })
                    .map(|&(_, since)| since + STALL)
                    .min()
            };
            let Some(stalls) = stalls else { return };
            tokio::select! {
                () = moved => {}
                () = tokio::time::sleep_until(stalls) => {}
            }
        }
    }

    fn moved_to(&self, id: u64, next: u32) {
        if let Some(at) = self.followers.lock().at.get_mut(&id)
            && at.0 != next
        {
            *at = (next, Instant::now());
        }
        self.moved.notify_waiters();
    }
}

impl Place {
    /// The client takes block `next` next.
    pub(crate) fn at(&self, next: u32) {
        self.pace.moved_to(self.id, next);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.pace.followers.lock().at.remove(&self.id);
        self.pace.moved.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `until_kept(index, kept)` returns without time passing.
    async fn goes_on(pace: &Pace, index: u32, kept: usize) -> bool {
        tokio::time::timeout(Duration::from_millis(1), pace.until_kept(index, kept))
            .await
            .is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn nobody_following_holds_nothing_back() {
        let pace = Arc::new(Pace::default());
        assert!(goes_on(&pace, 1000, 4).await);
    }

    #[tokio::test(start_paused = true)]
    async fn the_check_keeps_the_slowest_clients_next_block() {
        let pace = Arc::new(Pace::default());
        let slow = pace.join();
        // Hashing block 3 keeps blocks 0..=3: block 0 is still there for the client.
        assert!(goes_on(&pace, 3, 4).await);
        // Hashing block 4 would push block 0 out.
        assert!(!goes_on(&pace, 4, 4).await);
        slow.at(1);
        assert!(goes_on(&pace, 4, 4).await);
        drop(slow);
        assert!(goes_on(&pace, 100, 4).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_waiting_for_the_check_is_not_held_back_by_a_slower_one() {
        let pace = Arc::new(Pace::default());
        let _slow = pace.join();
        let fast = pace.join();
        fast.at(8);
        assert!(goes_on(&pace, 8, 4).await);
        assert!(!goes_on(&pace, 9, 4).await, "the fast client has blocks to take");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_client_holds_the_check_back_no_longer_than_the_stall() {
        let pace = Arc::new(Pace::default());
        let stalled = pace.join();
        let started = Instant::now();
        pace.until_kept(10, 4).await;
        assert_eq!(started.elapsed(), STALL);
        // It moves again, and is waited for again.
        stalled.at(2);
        assert!(!goes_on(&pace, 10, 4).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_move_wakes_the_check() {
        let pace = Arc::new(Pace::default());
        let client = pace.join();
        let check = {
            let pace = pace.clone();
            tokio::spawn(async move { pace.until_kept(5, 4).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!check.is_finished());
        client.at(2);
        tokio::time::timeout(Duration::from_millis(1), check)
            .await
            .expect("woken by the move")
            .expect("check");
    }
}
