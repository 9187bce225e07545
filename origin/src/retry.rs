//! Retries: the attempt limit and jittered backoff, the retry budget shared by a source's
//! requests, and the deadline of a whole operation, retries included.

use std::future::Future;
use std::time::Duration;

use larder_stats::add;
use parking_lot::Mutex;
use rand::Rng;
use tokio::time::Instant;

use crate::Origin;
use crate::error::{Failure, OriginError, TransientError};

/// Retry timing: attempt limit and jittered exponential backoff.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    pub(crate) max_attempts: u32,
    pub(crate) base: Duration,
    pub(crate) max: Duration,
}

impl Backoff {
    /// "Full jitter": a uniform delay up to `base * 2^retry`, capped at `max`.
    fn delay(&self, retry: u32) -> Duration {
        let ceiling = self.base.saturating_mul(1 << retry.min(16)).min(self.max);
        ceiling.mul_f64(rand::rng().random::<f64>())
    }
}

/// A token bucket that keeps retries to a fraction of requests, so a failing origin sees at
/// most `1 + ratio` times the normal load instead of `max_attempts` times.
///
/// Every first attempt deposits `ratio` tokens; every retry withdraws one. A trickle of
/// `MIN_PER_SEC` tokens a second lets an idle daemon retry its first requests.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    state: Mutex<(f64, Instant)>,
}

impl RetryBudget {
    const MIN_PER_SEC: f64 = 10.0;
    const CAP: f64 = 1000.0;

    /// A budget allowing `ratio` retries per request.
    pub fn new(ratio: f64) -> Self {
        Self {
            ratio,
            state: Mutex::new((Self::MIN_PER_SEC, Instant::now())),
        }
    }

    /// Called once per operation, before its first attempt.
    pub(crate) fn deposit(&self) {
        let mut state = self.state.lock();
        state.0 = (state.0 + self.ratio).min(Self::CAP);
    }

    /// Called before each retry: whether the budget allows it.
    fn withdraw(&self) -> bool {
        let mut state = self.state.lock();
        let now = Instant::now();
        let refill = now.duration_since(state.1).as_secs_f64() * Self::MIN_PER_SEC;
        *state = ((state.0 + refill).min(Self::CAP), now);
        if state.0 >= 1.0 {
            state.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

impl Origin {
    /// Runs a request-response operation with retries, under the deadline.
    pub(crate) async fn with_retries<T, F, Fut>(&self, key: &str, mut op: F) -> Result<T, OriginError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = object_store::Result<T>>,
    {
        self.budget.deposit();
        let attempts = async {
            let mut attempt = 0;
            loop {
                let failure = match tokio::time::timeout(self.request_timeout, op()).await {
                    Ok(Ok(value)) => return Ok(value),
                    Ok(Err(e)) => self.classify(key, e),
                    Err(_) => Failure::Transient(TransientError::Timeout(self.request_timeout)),
                };
                attempt = self.after_failure(key, attempt, failure).await?;
            }
        };
        self.within_deadline(key, attempts).await
    }

    async fn within_deadline<T>(
        &self,
        key: &str,
        work: impl Future<Output = Result<T, OriginError>>,
    ) -> Result<T, OriginError> {
        tokio::time::timeout(self.deadline, work)
            .await
            .unwrap_or_else(|_| Err(self.deadline_exceeded(key, 0)))
    }

    /// The deadline of a whole operation on `key` passed after `received` bytes of the body.
    pub fn deadline_exceeded(&self, key: &str, received: u64) -> OriginError {
        OriginError::DeadlineExceeded {
            source_name: self.name.clone(),
            key: key.to_owned(),
            deadline: self.deadline,
            received,
        }
    }

    /// Decides whether to try again after attempt number `attempt` (0-based) failed; sleeps the
    /// backoff and returns the next attempt's number, or the final error.
    pub(crate) async fn after_failure(
        &self,
        key: &str,
        attempt: u32,
        failure: Failure,
    ) -> Result<u32, OriginError> {
        let error = match failure {
            Failure::Final(error) => return Err(error),
            Failure::Transient(error) => {
                add(&self.stats.origin_errors_transient, 1);
                error
            }
        };
        let attempts = attempt + 1;
        if attempts >= self.backoff.max_attempts || !self.budget.withdraw() {
            return Err(OriginError::RetriesExhausted {
                source_name: self.name.clone(),
                key: key.to_owned(),
                attempts,
                source: error,
            });
        }
        let delay = self.backoff.delay(attempt);
        tracing::debug!(source = %self.name, key, attempt = attempts, ?delay, %error, "retrying origin request");
        add(&self.stats.origin_retries, 1);
        tokio::time::sleep(delay).await;
        Ok(attempts)
    }
}
