//! Counters kept by the daemon: bytes served by source, lookups by result, origin requests and
//! errors, cache writes and evictions, prefetch progress; and latency histograms of fills and
//! FUSE requests. The metrics endpoint reads them; tests assert on them.

use std::sync::atomic::{AtomicU64, Ordering};

use larder_fuse_mount::Operation;

use crate::metrics::{Histogram, HistogramSnapshot};

macro_rules! counters {
    ($( $(#[doc = $doc:literal])* $name:ident ),* $(,)?) => {
        /// Live counters and histograms, shared by every part of the daemon.
        #[derive(Debug, Default)]
        pub struct Stats {
            $( $(#[doc = $doc])* pub $name: AtomicU64, )*
            /// Latency histograms.
            pub latency: Latencies,
        }

        /// A copy of [`Stats`] at one instant.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct StatsSnapshot {
            $( $(#[doc = $doc])* pub $name: u64, )*
            /// Latency histograms.
            pub latency: LatencySnapshot,
        }

        impl Stats {
            /// Reads every counter and histogram.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot {
                    $( $name: self.$name.load(Ordering::Relaxed), )*
                    latency: self.latency.snapshot(),
                }
            }
        }
    };
}

counters! {
    /// Bytes handed to readers that came from the NVMe block store.
    served_nvme_bytes,
    /// Bytes handed to readers that came from the origin (including joined in-flight fills).
    served_origin_bytes,
    /// Block lookups answered by the block store.
    lookup_hit,
    /// Block lookups that started a fill.
    lookup_miss,
    /// Block lookups that joined a fill already in flight.
    lookup_joined,
    /// Blocks read from disk whose BLAKE3 did not match the record: dropped and refetched.
    lookup_corrupt,
    /// Block reads from disk that failed with an I/O error: treated as misses.
    cache_read_errors,
    /// Ranged GETs sent to origins (every attempt).
    origin_get_requests,
    /// HEAD requests sent to origins.
    origin_head_requests,
    /// LIST requests sent to origins.
    origin_list_requests,
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
    /// Block bytes written to the block store.
    cache_write_bytes,
    /// Block writes that failed (disk full, I/O error); the read was still served.
    cache_write_failures,
    /// Block writes skipped because no space could be freed (everything pinned or in use).
    cache_writes_skipped,
    /// Blocks evicted to make room.
    evicted_blocks,
    /// Bytes evicted to make room.
    evicted_bytes,
    /// Bytes that prefetch jobs set out to bring into the cache.
    prefetch_planned_bytes,
    /// Bytes that prefetch jobs have brought into the cache (or found there).
    prefetch_done_bytes,
}

/// How long fills and FUSE requests take.
#[derive(Debug, Default)]
pub struct Latencies {
    /// One block read from the block store, on a hit.
    pub fill_nvme: Histogram,
    /// One origin fill (a ranged GET of up to a part), from its start (waiting for an origin
    /// slot included) to its last block; successful fills only.
    pub fill_origin: Histogram,
    /// FUSE requests from arrival to reply, indexed by `Operation as usize`.
    fuse: [Histogram; Operation::ALL.len()],
}

/// A copy of [`Latencies`] at one instant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LatencySnapshot {
    /// See [`Latencies::fill_nvme`].
    pub fill_nvme: HistogramSnapshot,
    /// See [`Latencies::fill_origin`].
    pub fill_origin: HistogramSnapshot,
    fuse: [HistogramSnapshot; Operation::ALL.len()],
}

impl Latencies {
    /// The histogram of FUSE requests of kind `op`.
    pub fn fuse(&self, op: Operation) -> &Histogram {
        &self.fuse[op as usize]
    }

    fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            fill_nvme: self.fill_nvme.snapshot(),
            fill_origin: self.fill_origin.snapshot(),
            fuse: std::array::from_fn(|i| self.fuse[i].snapshot()),
        }
    }
}

impl LatencySnapshot {
    /// FUSE requests of kind `op`.
    pub fn fuse(&self, op: Operation) -> &HistogramSnapshot {
        &self.fuse[op as usize]
    }
}

/// Adds `n` to a counter.
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}
