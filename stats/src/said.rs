//! Warnings that would repeat for every block (a cache disk gone read-only fails each write):
//! said at most once per [`SAY_EVERY`], with how many went unsaid since; the counters count
//! every one.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// The least time between two warnings of one kind.
pub const SAY_EVERY: Duration = Duration::from_secs(60);

/// One kind of warning, throttled.
#[derive(Debug, Default)]
pub struct Throttled {
    /// When it was last said, and how many times it happened since.
    state: Mutex<Option<(Instant, u64)>>,
}

impl Throttled {
    /// It happened again: `Some(n)` if it is to be said now, `n` the times it went unsaid
    /// since it was last said; `None` if not.
    pub fn again(&self) -> Option<u64> {
        let now = Instant::now();
        let mut state = self.state.lock();
        match &mut *state {
            Some((said, unsaid)) if now.duration_since(*said) < SAY_EVERY => {
                *unsaid += 1;
                None
            }
            Some((said, unsaid)) => {
                let missed = std::mem::take(unsaid);
                *said = now;
                Some(missed)
            }
            None => {
                *state = Some((now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn said_once_a_minute_with_what_went_unsaid() {
        let warning = Throttled::default();
        assert_eq!(warning.again(), Some(0));
        for _ in 0..110 {
            assert_eq!(warning.again(), None);
        }
        tokio::time::advance(SAY_EVERY).await;
        assert_eq!(warning.again(), Some(110));
        assert_eq!(warning.again(), None);
    }
}
