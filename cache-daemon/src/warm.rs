//! Warm-node labels: the daemon keeps a plan (`warm.plan`) in its cache and tells Kubernetes,
//! with the label `larder.dev/warm-<plan>=true` on its own Node, while every block of it is
//! cached and verified, so schedulers and autoscalers can prefer warm nodes.
//!
//! Two tasks. The checker prefetches the plan at start and waits for the job; then, every
//! `warm.check_interval`, it asks [`Jobs::check`] (a listing and a HEAD per object, no block
//! read: an evicted block or a new version of an object makes the plan incomplete) and, when
//! the plan is incomplete, prefetches it again at the next check. A prefetch that leaves the
//! plan incomplete (origin errors, no room) makes the next wait twice as long, up to an hour;
//! with the cache dir lost there is no prefetch at all. When the plan pins, versions it no
//! longer names (replaced or deleted objects) are unpinned. What it finds goes into a
//! `watch` channel. The labeller patches the Node whenever that differs from what the API
//! server last accepted, retrying with a backoff (doubling from 500 ms up to the check
//! interval) for as long as the API server does not answer: the label converges on the last
//! state found, and nothing here stops the daemon.
//!
//! Decisions: the label means "this running daemon verified the plan": at start it is removed
//! (the daemon has verified nothing yet) and set once the start-up prefetch has read every block
//! back; on SIGTERM it is removed (the mount is going away), with one try of at most 2 s. A
//! check that cannot reach the origin changes nothing (unknown is not incomplete). A daemon
//! killed with SIGKILL leaves the label until it starts again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use larder_control_api::{JobState, Plan};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::kube::NodeClient;
use crate::prefetch::{Jobs, PlanCheck};

/// The prefix of every warm-node label; the plan's name follows it.
pub const LABEL_PREFIX: &str = "larder.dev/warm-";

/// The first pause after a failed patch; it doubles up to the check interval.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);

/// How often a running prefetch job is looked at.
const JOB_POLL: Duration = Duration::from_millis(200);

/// The longest wait between two prefetches of a plan that they leave incomplete.
const MAX_REFILL_PAUSE: Duration = Duration::from_secs(3600);

/// How long the removal of the label at shutdown may take.
const STOP_PATCH: Duration = Duration::from_secs(2);

/// A plan kept warm, and the Node told about it.
#[derive(Debug)]
pub struct Warm {
    jobs: Arc<Jobs>,
    plan: Plan,
    label: String,
    interval: Duration,
    client: NodeClient,
}

impl Warm {
    /// Keeps `plan`, named `name`, warm through `jobs`, labelling the Node of `client` every
    /// `interval` at most.
    pub fn new(jobs: Arc<Jobs>, plan: Plan, name: &str, interval: Duration, client: NodeClient) -> Self {
        Self {
            jobs,
            plan,
            label: format!("{LABEL_PREFIX}{name}"),
            interval,
            client,
        }
    }

    /// Starts the checker and the labeller on `tasks`; both end when `stop` is cancelled, the
    /// labeller after removing the label if it had set it.
    pub fn spawn(self, tasks: &TaskTracker, stop: CancellationToken) {
        let this = Arc::new(self);
        // At start the plan counts as not warm: a label left by an earlier run goes.
        let (found, wanted) = watch::channel(false);
        tasks.spawn(this.clone().check(found, stop.clone()));
        tasks.spawn(this.label(wanted, stop));
    }

    /// Prefetches the plan, then checks it every interval, prefetching again when it is
    /// incomplete; sends what each check finds.
    async fn check(self: Arc<Self>, found: watch::Sender<bool>, stop: CancellationToken) {
        // When the plan is to be prefetched next (`None`: it is complete, or cannot be cached).
        let mut refill_at = Some(Instant::now());
        // How long after a prefetch that left the plan incomplete the next one waits.
        let mut pause = self.interval;
        // The versions the last check found, pinned when the plan pins.
        let mut versions = Vec::new();
        loop {
            let refilled = refill_at.is_some_and(|at| Instant::now() >= at);
            if refilled {
                self.prefetch(&stop).await;
                if stop.is_cancelled() {
                    return;
                }
            }
            match self
                .jobs
                .check(&self.plan.all_targets(), self.plan.platform.as_deref())
                .await
            {
                Ok(PlanCheck {
                    complete,
                    versions: now,
                }) => {
                    if found.send_replace(complete) != complete {
                        tracing::info!(label = %self.label, complete, "the warm plan's state changed");
                    }
                    if complete {
                        refill_at = None;
                        pause = self.interval;
                    } else if self.jobs.cache_dir_lost() {
                        // Nothing can be cached again until the daemon restarts.
                        refill_at = None;
                    } else if refilled {
                        // The prefetch did not complete it (errors, no room): the next one
                        // waits longer, so a node that cannot hold the plan does not fetch it
                        // from the origin again and again.
                        tracing::warn!(
                            label = %self.label,
                            retry_in = %humantime::format_duration(pause),
                            "the warm plan is still incomplete after a prefetch"
                        );
                        refill_at = Some(Instant::now() + pause);
                        pause = (pause * 2).min(MAX_REFILL_PAUSE.max(self.interval));
                    } else if refill_at.is_none() {
                        // It was complete: a block was evicted or an object changed.
                        refill_at = Some(Instant::now());
                    }
                    if self.plan.pin {
                        // A version the plan no longer names (an object replaced or deleted)
                        // is not kept from eviction any longer.
                        let gone: Vec<_> = versions.into_iter().filter(|v| !now.contains(v)).collect();
                        self.jobs.unpin_versions(&gone);
                    }
                    versions = now;
                }
                Err(error) => {
                    tracing::warn!(label = %self.label, %error, "cannot check the warm plan; the label stays as it is");
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }

    /// Runs one prefetch job of the plan to its end (or until `stop`).
    async fn prefetch(&self, stop: &CancellationToken) {
        let job = match self
            .jobs
            .start(
                self.plan.all_targets(),
                self.plan.pin,
                self.plan.platform.as_deref(),
            )
            .await
        {
            Ok(job) => job,
            Err(error) => {
                tracing::warn!(label = %self.label, %error, "cannot prefetch the warm plan");
                return;
            }
        };
        loop {
            match self.jobs.report(job.id) {
                Some(report) if report.state == JobState::Running => {}
                _ => return,
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(JOB_POLL) => {}
            }
        }
    }

    /// Patches the Node whenever what the checker found differs from what the API server last
    /// accepted, retrying failures with a backoff; at `stop`, removes a label it had set.
    async fn label(self: Arc<Self>, mut wanted: watch::Receiver<bool>, stop: CancellationToken) {
        let mut applied: Option<bool> = None;
        let mut backoff = FIRST_BACKOFF;
        let mut failing = false;
        loop {
            let want = *wanted.borrow_and_update();
            if applied != Some(want) {
                match self.patch(want).await {
                    Ok(()) => {
                        applied = Some(want);
                        backoff = FIRST_BACKOFF;
                        if failing {
                            tracing::info!(
                                node = self.client.node(),
                                "the Kubernetes API server answers again"
                            );
                            failing = false;
                        }
                        tracing::info!(node = self.client.node(), label = %self.label, warm = want, "node label updated");
                    }
                    Err(error) => {
                        // Once per outage at warn; the retries at debug.
                        if failing {
                            tracing::debug!(%error, "patching the node label failed again");
                        } else {
                            tracing::warn!(
                                %error,
                                label = %self.label,
                                "cannot patch the node label; retrying until the API server accepts it"
                            );
                            failing = true;
                        }
                        let pause = jittered(backoff);
                        backoff = (backoff * 2).min(self.interval.max(FIRST_BACKOFF));
                        tokio::select! {
                            () = stop.cancelled() => break,
                            () = tokio::time::sleep(pause) => continue,
                        }
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => break,
                changed = wanted.changed() => if changed.is_err() { break },
            }
        }
        if applied != Some(false) {
            match tokio::time::timeout(STOP_PATCH, self.patch(false)).await {
                Ok(Ok(())) => {
                    tracing::info!(node = self.client.node(), label = %self.label, "node label removed at shutdown")
                }
                Ok(Err(error)) => tracing::warn!(%error, "cannot remove the node label at shutdown"),
                Err(_) => tracing::warn!("cannot remove the node label at shutdown: no answer in time"),
            }
        }
    }

    async fn patch(&self, warm: bool) -> Result<(), crate::kube::KubeError> {
        self.client.set_label(&self.label, warm.then_some("true")).await
    }
}

/// `pause` scaled by a random factor in [0.5, 1], so that the nodes of a cluster that lost
/// its API server at once do not all come back in step.
fn jittered(pause: Duration) -> Duration {
    pause.mul_f64(rand::random_range(0.5..=1.0))
}
