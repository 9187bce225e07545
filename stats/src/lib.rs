//! Counters kept by the daemon, one set per layer: the block store's ([`StoreStats`]), the
//! origins' ([`OriginStats`]), the read path's ([`ReadStats`]), the peer tier's
//! ([`PeerStats`]), the mount's ([`MountStats`]), the prefetch jobs' ([`JobStats`]) and the
//! registry mirror's ([`RegistryStats`]); and the latency histograms of the layers that time
//! what they do: the read path's fills ([`ReadLatencies`]) and the peer tier's runs
//! ([`PeerLatencies`]). Each layer is handed its own part of the [`Stats`] the binary makes,
//! and counts only there; the metrics endpoint and `larder status` read the whole as one
//! [`StatsSnapshot`]; tests assert on them. [`Histogram`] is here for any layer to keep: the
//! binary keeps its own of FUSE requests, whose operations this crate does not know.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod said;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use larder_control_api::FailureCause;

macro_rules! counters {
    ($(
        $(#[doc = $layer_doc:literal])*
        $field:ident: $layer:ident {
            $( $(#[doc = $doc:literal])* $name:ident ),* $(,)?
        }
    )*) => {
        $(
            $(#[doc = $layer_doc])*
            #[derive(Debug, Default)]
            pub struct $layer {
                $( $(#[doc = $doc])* pub $name: AtomicU64, )*
            }
        )*

        /// Every layer's counters and latency histograms: the binary makes one and hands each
        /// layer its own part.
        #[derive(Debug, Default)]
        pub struct Stats {
            $( #[doc = concat!("See [`", stringify!($layer), "`].")] pub $field: Arc<$layer>, )*
            /// Objects of prefetch jobs that failed, by cause (indexed as [`FailureCause::ALL`]).
            pub prefetch_failed: [AtomicU64; FailureCause::ALL.len()],
            /// The read path's latency histograms.
            pub read_latency: Arc<ReadLatencies>,
            /// The peer tier's latency histograms.
            pub peer_latency: Arc<PeerLatencies>,
        }

        /// A copy of every layer's counters at one instant, side by side, as the metrics
        /// endpoint and `larder status` render them.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct StatsSnapshot {
            $( $( $(#[doc = $doc])* pub $name: u64, )* )*
            /// Objects of prefetch jobs that failed, by cause (indexed as [`FailureCause::ALL`]).
            pub prefetch_failed: [u64; FailureCause::ALL.len()],
            /// See [`ReadLatencies::fill_nvme`].
            pub fill_nvme: HistogramSnapshot,
            /// See [`ReadLatencies::fill_origin`].
            pub fill_origin: HistogramSnapshot,
            /// See [`PeerLatencies::fill_peer`].
            pub fill_peer: HistogramSnapshot,
        }

        impl Stats {
            /// Reads every counter and histogram.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot {
                    $( $( $name: self.$field.$name.load(Ordering::Relaxed), )* )*
                    prefetch_failed: std::array::from_fn(|i| self.prefetch_failed[i].load(Ordering::Relaxed)),
                    fill_nvme: self.read_latency.fill_nvme.snapshot(),
                    fill_origin: self.read_latency.fill_origin.snapshot(),
                    fill_peer: self.peer_latency.fill_peer.snapshot(),
                }
            }
        }
    };
}

counters! {
    /// The block store's: what it wrote, evicted and scrubbed.
    store: StoreStats {
        /// Block bytes written to the block store.
        cache_write_bytes,
        /// Blocks evicted to make room.
        evicted_blocks,
        /// Bytes evicted to make room.
        evicted_bytes,
        /// Bytes the scrub read back and found sound.
        scrubbed_bytes,
        /// Blocks the scrub dropped because their read failed with an I/O error.
        scrub_read_errors,
        /// Blocks the scrub dropped because their bytes did not match their BLAKE3.
        scrub_corrupt_blocks,
    }
    /// The origins' (the registry's upstreams count here too): requests, bytes, errors.
    origin: OriginStats {
        /// Ranged GETs sent to origins (every attempt).
        origin_get_requests,
        /// HEAD requests sent to origins.
        origin_head_requests,
        /// LIST requests sent to origins.
        origin_list_requests,
        /// PUT requests sent to origins (seal manifests).
        origin_put_requests,
        /// Attempts that were retries of an earlier one.
        origin_retries,
        /// Body bytes received from origins.
        origin_bytes,
        /// Origin answers: not found.
        origin_errors_not_found,
        /// Origin answers: permission denied or unauthenticated.
        origin_errors_permission,
        /// Origin answers: the pinned version changed.
        origin_errors_version_changed,
        /// Transient failures (5xx, resets, timeouts, short bodies), retried or not.
        origin_errors_transient,
        /// Other origin errors (bad request, unsupported operation).
        origin_errors_other,
    }
    /// The read path's: bytes served by source, lookups, fills, the memory budget, the origin check of blocks from rack peers, cache writes that failed.
    read: ReadStats {
        /// The origin's fill slots now (a gauge; see `cache/slots.rs`).
        origin_slots,
        /// The most origin fills in flight at once since start (a gauge).
        origin_fills_peak,
        /// Bytes handed to readers that came from the NVMe block store.
        served_nvme_bytes,
        /// Bytes handed to readers that came from the origin (including joined in-flight fills).
        served_origin_bytes,
        /// Bytes handed to readers that came from a rack peer (including joined in-flight fills).
        served_peer_bytes,
        /// Blocks taken from the origin because the run's owner was late, before the owner was
        /// asked again for the rest of the run.
        peer_hedged_blocks,
        /// Objects completed with blocks from rack peers whose origin MD5 (ETag) matched, or whose
        /// blocks were each compared with the origin's.
        origin_checks_match,
        /// Objects completed with blocks from rack peers whose origin CRC matched, the origin
        /// publishing nothing stronger: no accident, but a member could have chosen the bytes.
        origin_checks_crc_only,
        /// Objects completed with blocks from rack peers whose origin checksum did not match:
        /// those blocks were dropped.
        origin_checks_mismatch,
        /// Objects completed with blocks from rack peers with no origin checksum to check.
        origin_checks_unchecked,
        /// Bytes the origin checks read back from the cache.
        origin_check_read_bytes,
        /// Block lookups answered by the block store.
        lookup_hit,
        /// Block lookups that started a fill.
        lookup_miss,
        /// Block lookups that joined a fill already in flight (started by the readahead, by a fill
        /// of an earlier block of the same part, by another reader or by a prefetch job).
        lookup_joined,
        /// Blocks read from disk whose BLAKE3 did not match the record: dropped and refetched.
        lookup_corrupt,
        /// Block reads from disk that failed with an I/O error: treated as misses.
        cache_read_errors,
        /// Blocks whose fill the readahead started before a read asked for them.
        readahead_blocks,
        /// Blocks the readahead (or a fill's run past the block asked for) did not fetch because
        /// they did not fit the memory budget.
        readahead_held_back,
        /// Block bytes in memory, charged to the memory budget (a gauge).
        memory_used_bytes,
        /// The memory budget, `cache.memory_limit` (a gauge).
        memory_limit_bytes,
        /// Times a prefetch job waited for room in the memory budget, or a fill for the cache
        /// writes to catch up.
        memory_waits,
        /// Block writes that failed (disk full, I/O error); the read was still served.
        cache_write_failures,
        /// Block writes skipped because no space could be freed (everything pinned or in use).
        cache_writes_skipped,
    }
    /// The rack peer tier's: runs asked of members and answered to them.
    peer: PeerStats {
        /// Block bytes received from rack peers and checked: bytes the origin did not have to send.
        peer_fetched_bytes,
        /// The part of them received from members of other racks: across the spine.
        peer_fetched_across_racks_bytes,
        /// Block bytes this node sent to rack peers.
        peer_sent_bytes,
        /// Run requests to peers answered with blocks the peer had cached.
        peer_requests_hit,
        /// Run requests to peers answered with blocks the peer filled from its origin (or joined).
        peer_requests_filled,
        /// Run requests to peers that had no owner to ask or that the owner declined (404/503).
        peer_requests_miss,
        /// Run requests not sent because the member's circuit was open, or refused at connect.
        peer_requests_refused,
        /// Run requests whose answer did not start or stalled past its deadline.
        peer_requests_timeout,
        /// Run requests the peer refused as unauthenticated (401), or answers whose tags failed.
        peer_requests_unauthorized,
        /// Answers with a block whose bytes did not match its hash or the sealed manifest.
        peer_requests_bad_data,
        /// Requests from peers that this node refused (bad MAC, stale, replayed, malformed).
        peer_served_refused,
    }
    /// The mount's: files handed to the kernel.
    mount: MountStats {
        /// Opens of complete files handed to the kernel (FUSE passthrough): their reads never
        /// reach the daemon.
        passthrough_opens,
        /// Sizes of the files opened in passthrough, summed: an upper bound on the bytes read
        /// that way.
        passthrough_open_bytes,
    }
    /// The prefetch jobs'.
    jobs: JobStats {
        /// Bytes that prefetch jobs set out to bring into the cache.
        prefetch_planned_bytes,
        /// Bytes that prefetch jobs have brought into the cache (or found there).
        prefetch_done_bytes,
        /// Prefetch jobs filling now (a gauge).
        prefetch_jobs_running,
        /// Prefetch jobs that ended with every block cached.
        prefetch_jobs_done,
        /// Prefetch jobs that ended with objects not cached.
        prefetch_jobs_failed,
        /// Prefetch jobs stopped before the end (cancelled, or the daemon stopped).
        prefetch_jobs_cancelled,
    }
    /// The registry mirror's.
    registry: RegistryStats {
        /// Manifest requests to the registry mirror.
        registry_manifest_requests,
        /// Blob requests to the registry mirror.
        registry_blob_requests,
        /// Registry mirror requests refused: not the pull API's grammar, or a registry that is not
        /// configured upstream.
        registry_refused,
        /// Bytes of verified manifests and blobs the registry mirror sent.
        registry_sent_bytes,
        /// Checks of content against its digest (a SHA-256 pass over it, read from the cache).
        registry_digest_checks,
        /// Content whose upstream bytes did not match its digest (dropped, fetched again).
        registry_digest_mismatches,
        /// Tags served as last resolved because their upstream could not be reached.
        registry_stale_tags,
    }
}

/// Upper bounds of the histogram buckets: in nanoseconds, and as Prometheus writes them in
/// seconds (`le`). From 100µs to 30s in steps of 1, 2.5, 5; anything slower lands in `+Inf`.
const BUCKETS: [(u64, &str); 17] = [
    (100_000, "0.0001"),
    (250_000, "0.00025"),
    (500_000, "0.0005"),
    (1_000_000, "0.001"),
    (2_500_000, "0.0025"),
    (5_000_000, "0.005"),
    (10_000_000, "0.01"),
    (25_000_000, "0.025"),
    (50_000_000, "0.05"),
    (100_000_000, "0.1"),
    (250_000_000, "0.25"),
    (500_000_000, "0.5"),
    (1_000_000_000, "1"),
    (2_500_000_000, "2.5"),
    (5_000_000_000, "5"),
    (10_000_000_000, "10"),
    (30_000_000_000, "30"),
];

/// The bucket counts plus one for what is slower than the last bound.
const SLOTS: usize = BUCKETS.len() + 1;

/// A latency histogram with fixed buckets (`BUCKETS`), updated with relaxed atomics only.
///
/// Each observation goes to exactly one slot; the total count is the sum of the slots, so a
/// scrape's `_count` always equals its `+Inf` bucket. The sum is kept in nanoseconds.
#[derive(Debug, Default)]
pub struct Histogram {
    slots: [AtomicU64; SLOTS],
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// Records one duration.
    pub fn observe(&self, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        // The first bucket whose bound is at least `nanos`: Prometheus buckets are `<= le`.
        let slot = BUCKETS.partition_point(|&(bound, _)| bound < nanos);
        self.slots[slot].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Reads the histogram.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            slots: std::array::from_fn(|i| self.slots[i].load(Ordering::Relaxed)),
            sum_nanos: self.sum_nanos.load(Ordering::Relaxed),
        }
    }
}

/// A copy of a [`Histogram`] at one instant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HistogramSnapshot {
    slots: [u64; SLOTS],
    sum_nanos: u64,
}

impl HistogramSnapshot {
    /// Observations recorded.
    pub fn count(&self) -> u64 {
        self.slots.iter().sum()
    }

    /// Sum of the observed durations.
    pub fn sum(&self) -> Duration {
        Duration::from_nanos(self.sum_nanos)
    }

    /// `(le, observations <= le)` for every finite bucket, in increasing order.
    pub fn cumulative(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        BUCKETS.iter().zip(&self.slots).scan(0, |total, (&(_, le), &n)| {
            *total += n;
            Some((le, *total))
        })
    }
}

/// The read path's latency histograms: how long its fills take.
#[derive(Debug, Default)]
pub struct ReadLatencies {
    /// One block read from the block store, on a hit.
    pub fill_nvme: Histogram,
    /// One origin fill (a ranged GET of up to a part), from its start (waiting for an origin
    /// slot included) to its last block; successful fills only.
    pub fill_origin: Histogram,
}

/// The rack peer tier's latency histograms.
#[derive(Debug, Default)]
pub struct PeerLatencies {
    /// One run fetched from a rack peer, from the request to its last block; complete runs
    /// only.
    pub fill_peer: Histogram,
}

/// Adds `n` to a counter.
pub fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_that_holds_them() {
        let histogram = Histogram::default();
        for micros in [0, 100, 101, 999, 1_000, 30_000_000, 30_000_001, u64::MAX / 1000] {
            histogram.observe(Duration::from_micros(micros));
        }
        histogram.observe(Duration::MAX);
        let snapshot = histogram.snapshot();
        assert_eq!(snapshot.count(), 9);
        let cumulative: Vec<_> = snapshot.cumulative().collect();
        assert_eq!(cumulative[0], ("0.0001", 2), "0 and exactly 100µs are <= 0.0001");
        assert_eq!(cumulative[1], ("0.00025", 3));
        assert_eq!(cumulative[3], ("0.001", 5), "999µs and 1ms are <= 0.001");
        assert_eq!(
            *cumulative.last().unwrap(),
            ("30", 6),
            "30s is in the last bucket"
        );
        // The bounds are increasing and their text is the same number of seconds.
        for pair in BUCKETS.windows(2) {
            assert!(pair[0].0 < pair[1].0);
        }
        for (nanos, le) in BUCKETS {
            assert_eq!(le.parse::<f64>().unwrap(), nanos as f64 / 1e9);
        }
    }

    #[test]
    fn the_sum_is_kept_in_nanoseconds() {
        let histogram = Histogram::default();
        histogram.observe(Duration::from_nanos(1));
        histogram.observe(Duration::from_millis(1500));
        assert_eq!(histogram.snapshot().sum(), Duration::from_nanos(1_500_000_001));
    }

    #[test]
    fn concurrent_observers_lose_nothing() {
        let histogram = Histogram::default();
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let histogram = &histogram;
                scope.spawn(move || {
                    for i in 0..10_000u64 {
                        histogram.observe(Duration::from_micros(t * 1000 + i % 7));
                    }
                });
            }
        });
        let snapshot = histogram.snapshot();
        assert_eq!(snapshot.count(), 40_000);
        let expected: u64 = (0..4u64)
            .map(|t| (0..10_000u64).map(|i| (t * 1000 + i % 7) * 1000).sum::<u64>())
            .sum();
        assert_eq!(snapshot.sum(), Duration::from_nanos(expected));
    }
}
