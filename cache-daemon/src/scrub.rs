//! The store's health work, scheduled: the scrub of the files handed to the kernel at
//! `cache.scrub_rate`, one pass after another (larder-store's `scrub.rs` says what a pass
//! reads and what it does with what it finds), and the recheck of a failing disk once it has
//! been quiet for `cache.disk_recheck`. Both end with the daemon's stop token.

use std::sync::Arc;
use std::time::Duration;

use larder_store::{BlockStore, ScrubPass, Scrubbed};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often a failing disk is looked at, and how long the scrub waits when it has nothing to
/// read.
const TICK: Duration = Duration::from_secs(1);

/// Runs the scrub at `rate` bytes per second (none with 0) and the disk's recheck after
/// `recheck` of quiet, until `stop`.
pub async fn run(store: Arc<BlockStore>, rate: u64, recheck: Duration, stop: CancellationToken) {
    let rechecks = async {
        loop {
            store.recheck_disk(recheck).await;
            tokio::time::sleep(TICK).await;
        }
    };
    let scrub = async {
        if rate == 0 {
            return std::future::pending().await;
        }
        loop {
            if !scrub_pass(&store, rate).await {
                tokio::time::sleep(TICK).await;
            }
        }
    };
    tokio::select! {
        () = stop.cancelled() => {}
        () = rechecks => {}
        () = scrub => {}
    }
}

/// One pass of the scrub, paced to `rate` bytes per second; false if it found nothing to read.
async fn scrub_pass(store: &BlockStore, rate: u64) -> bool {
    let mut pass = ScrubPass::default();
    let mut read_any = false;
    let mut next = Instant::now();
    while let Some((id, blocks)) = store.scrub_next(&mut pass) {
        for index in blocks {
            let bytes = match store.scrub_block(id, index).await {
                Scrubbed::Sound(bytes) | Scrubbed::Dropped(bytes) => bytes,
                Scrubbed::Gone => continue,
            };
            read_any = true;
            // A pass that fell behind (the disk slower than the rate) does not catch up in a burst.
            next = (next + Duration::from_secs_f64(bytes as f64 / rate as f64)).max(Instant::now());
            tokio::time::sleep_until(next).await;
        }
    }
    read_any
}
