//! The Prometheus endpoint: a lock-free [`Histogram`], [`render`] of the daemon's [`Stats`] and
//! block store [`Usage`] in the text exposition format (version 0.0.4), and [`serve`], a small
//! HTTP server answering `GET /metrics`.
//!
//! Every metric name, its type, unit and labels are written out in [`render`], in one place;
//! `docs/METRICS.md` describes each. Labels only take values from small closed sets (sources,
//! lookup results, request kinds, FUSE operations), never keys, paths or addresses.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use larder_fuse_mount::Operation;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::stats::{Stats, StatsSnapshot};
use crate::store::{BlockStore, Usage};

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

/// A latency histogram with fixed buckets ([`BUCKETS`]), updated with relaxed atomics only.
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
    fn cumulative(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        BUCKETS.iter().zip(&self.slots).scan(0, |total, (&(_, le), &n)| {
            *total += n;
            Some((le, *total))
        })
    }
}

/// Renders every metric in the Prometheus text format, version 0.0.4.
pub fn render(stats: &StatsSnapshot, usage: &Usage) -> String {
    let mut out = Exposition::default();
    let s = stats;

    out.family(
        "larder_read_bytes_total",
        "counter",
        "Bytes handed to readers, by where they came from.",
    );
    out.sample(
        "larder_read_bytes_total",
        Some(("source", "nvme")),
        s.served_nvme_bytes,
    );
    out.sample(
        "larder_read_bytes_total",
        Some(("source", "origin")),
        s.served_origin_bytes,
    );

    out.family(
        "larder_block_lookups_total",
        "counter",
        "Block lookups by result: hit (block store), miss (started a fill), joined (a fill in flight), corrupt (checksum mismatch on disk, refetched).",
    );
    for (result, n) in [
        ("hit", s.lookup_hit),
        ("miss", s.lookup_miss),
        ("joined", s.lookup_joined),
        ("corrupt", s.lookup_corrupt),
    ] {
        out.sample("larder_block_lookups_total", Some(("result", result)), n);
    }
    out.counter(
        "larder_cache_read_errors_total",
        "Block reads from disk that failed with an I/O error and were treated as misses.",
        s.cache_read_errors,
    );

    out.gauge(
        "larder_cache_bytes",
        "Bytes of blocks in the block store, each rounded up to 4 KiB.",
        usage.used,
    );
    out.gauge(
        "larder_cache_reserved_bytes",
        "Bytes reserved by block writes in progress.",
        usage.reserved,
    );
    out.gauge(
        "larder_cache_capacity_bytes",
        "The configured capacity of the block store.",
        usage.capacity,
    );
    out.gauge(
        "larder_cache_objects",
        "Object versions with at least one block in the block store (or pinned).",
        usage.objects as u64,
    );
    out.gauge(
        "larder_cache_pinned_objects",
        "Object versions pinned by prefetch jobs: never evicted until unpinned.",
        usage.pinned as u64,
    );
    out.gauge(
        "larder_cache_blocks",
        "Blocks in the block store.",
        usage.blocks as u64,
    );
    out.counter(
        "larder_cache_write_bytes_total",
        "Block bytes written to the block store.",
        s.cache_write_bytes,
    );
    out.counter(
        "larder_cache_write_failures_total",
        "Block writes that failed (I/O error, disk full); the read was served from memory.",
        s.cache_write_failures,
    );
    out.counter(
        "larder_cache_writes_skipped_total",
        "Block writes skipped because no space could be freed.",
        s.cache_writes_skipped,
    );
    out.counter(
        "larder_evictions_total",
        "Blocks evicted to make room.",
        s.evicted_blocks,
    );
    out.counter(
        "larder_evicted_bytes_total",
        "Bytes evicted to make room.",
        s.evicted_bytes,
    );

    out.family(
        "larder_origin_requests_total",
        "counter",
        "Requests sent to origins by kind, every attempt counted.",
    );
    for (kind, n) in [
        ("get", s.origin_get_requests),
        ("head", s.origin_head_requests),
        ("list", s.origin_list_requests),
    ] {
        out.sample("larder_origin_requests_total", Some(("kind", kind)), n);
    }
    out.counter(
        "larder_origin_retries_total",
        "Origin request attempts that retried an earlier one.",
        s.origin_retries,
    );
    out.counter(
        "larder_origin_bytes_total",
        "Body bytes received from origins.",
        s.origin_bytes,
    );
    out.family(
        "larder_origin_errors_total",
        "counter",
        "Failed origin requests by kind of error.",
    );
    for (kind, n) in [
        ("not_found", s.origin_errors_not_found),
        ("permission", s.origin_errors_permission),
        ("version_changed", s.origin_errors_version_changed),
        ("transient", s.origin_errors_transient),
        ("other", s.origin_errors_other),
    ] {
        out.sample("larder_origin_errors_total", Some(("kind", kind)), n);
    }

    out.counter(
        "larder_prefetch_planned_bytes_total",
        "Bytes prefetch jobs set out to bring into the cache.",
        s.prefetch_planned_bytes,
    );
    out.counter(
        "larder_prefetch_done_bytes_total",
        "Bytes prefetch jobs have brought into the cache or found there.",
        s.prefetch_done_bytes,
    );

    out.histograms(
        "larder_fill_duration_seconds",
        "Time to get one fill: a block read from the block store (nvme), or a ranged GET of up to one part from the origin, waiting for an origin slot included (origin).",
        "source",
        &[("nvme", &s.latency.fill_nvme), ("origin", &s.latency.fill_origin)],
    );
    let fuse: Vec<_> = Operation::ALL
        .iter()
        .map(|&op| (op.name(), s.latency.fuse(op)))
        .collect();
    out.histograms(
        "larder_fuse_request_duration_seconds",
        "FUSE requests from arrival to reply, by operation.",
        "op",
        &fuse,
    );
    out.text
}

/// The text of an exposition, written family by family.
#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, label: Option<(&str, &str)>, value: impl std::fmt::Display) {
        let _ = match label {
            Some((key, label)) => writeln!(self.text, "{name}{{{key}=\"{label}\"}} {value}"),
            None => writeln!(self.text, "{name} {value}"),
        };
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "counter", help);
        self.sample(name, None, value);
    }

    fn gauge(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "gauge", help);
        self.sample(name, None, value);
    }

    /// One histogram family with a series per value of `label`.
    fn histograms(&mut self, name: &str, help: &str, label: &str, series: &[(&str, &HistogramSnapshot)]) {
        self.family(name, "histogram", help);
        for &(value, histogram) in series {
            for (le, n) in histogram.cumulative() {
                let _ = writeln!(self.text, "{name}_bucket{{{label}=\"{value}\",le=\"{le}\"}} {n}");
            }
            let count = histogram.count();
            let _ = writeln!(
                self.text,
                "{name}_bucket{{{label}=\"{value}\",le=\"+Inf\"}} {count}"
            );
            let sum = histogram.sum().as_secs_f64();
            let _ = writeln!(self.text, "{name}_sum{{{label}=\"{value}\"}} {sum}");
            let _ = writeln!(self.text, "{name}_count{{{label}=\"{value}\"}} {count}");
        }
    }
}

/// Scrapes served at once; more wait for a slot.
const MAX_CONNECTIONS: usize = 16;
/// Longest a connection may stay open: a slow or idle client is cut off.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);

/// Serves `GET /metrics` on `listener` until the task is dropped. Other paths get 404 and
/// other methods 405. A failed connection is logged and dropped; nothing here stops the daemon.
pub async fn serve(listener: TcpListener, stats: Arc<Stats>, store: Arc<BlockStore>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (socket, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Usually out of file descriptors: wait rather than spin.
                tracing::warn!(%error, "metrics: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (stats, store) = (stats.clone(), store.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                std::future::ready(Ok::<_, Infallible>(answer(&request, &stats, &store)))
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .serve_connection(TokioIo::new(socket), service);
            match tokio::time::timeout(CONNECTION_DEADLINE, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::debug!(%error, %peer, "metrics: connection failed"),
                Err(_) => tracing::debug!(%peer, "metrics: connection cut off after its deadline"),
            }
        });
    }
}

fn answer(request: &Request<Incoming>, stats: &Stats, store: &BlockStore) -> Response<String> {
    if request.uri().path() != "/metrics" {
        return plain(
            StatusCode::NOT_FOUND,
            "not found: metrics are at /metrics\n".into(),
        );
    }
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n".into());
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let mut response = plain(StatusCode::OK, render(&stats.snapshot(), &store.usage()));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

fn plain(status: StatusCode, body: String) -> Response<String> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
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

    fn usage() -> Usage {
        Usage {
            used: 8 << 20,
            reserved: 4 << 20,
            capacity: 1 << 30,
            objects: 2,
            blocks: 3,
            pinned: 1,
        }
    }

    #[test]
    fn render_writes_every_family_with_help_type_and_values() {
        let stats = Stats::default();
        crate::stats::add(&stats.served_nvme_bytes, 10);
        crate::stats::add(&stats.served_origin_bytes, 32);
        crate::stats::add(&stats.lookup_joined, 4);
        crate::stats::add(&stats.origin_errors_version_changed, 5);
        crate::stats::add(&stats.prefetch_done_bytes, 6);
        stats.latency.fill_origin.observe(Duration::from_millis(20));
        stats
            .latency
            .fuse(Operation::Readdir)
            .observe(Duration::from_micros(300));
        let text = render(&stats.snapshot(), &usage());

        for line in [
            "# TYPE larder_read_bytes_total counter",
            "larder_read_bytes_total{source=\"nvme\"} 10",
            "larder_read_bytes_total{source=\"origin\"} 32",
            "larder_block_lookups_total{result=\"joined\"} 4",
            "larder_block_lookups_total{result=\"hit\"} 0",
            "larder_origin_errors_total{kind=\"version_changed\"} 5",
            "larder_prefetch_done_bytes_total 6",
            "larder_prefetch_planned_bytes_total 0",
            "# TYPE larder_cache_bytes gauge",
            "larder_cache_bytes 8388608",
            "larder_cache_reserved_bytes 4194304",
            "larder_cache_capacity_bytes 1073741824",
            "larder_cache_objects 2",
            "larder_cache_blocks 3",
            "larder_cache_pinned_objects 1",
            "# TYPE larder_fill_duration_seconds histogram",
            "larder_fill_duration_seconds_bucket{source=\"origin\",le=\"0.01\"} 0",
            "larder_fill_duration_seconds_bucket{source=\"origin\",le=\"0.025\"} 1",
            "larder_fill_duration_seconds_bucket{source=\"origin\",le=\"+Inf\"} 1",
            "larder_fill_duration_seconds_sum{source=\"origin\"} 0.02",
            "larder_fill_duration_seconds_count{source=\"origin\"} 1",
            "larder_fill_duration_seconds_count{source=\"nvme\"} 0",
            "larder_fuse_request_duration_seconds_bucket{op=\"readdir\",le=\"0.0005\"} 1",
            "larder_fuse_request_duration_seconds_count{op=\"statfs\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }

        // Every sample belongs to a family announced just before it with HELP and TYPE; names
        // follow the conventions: a unit suffix or `_total`, and a project prefix.
        let mut family = String::new();
        let mut families = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                family = rest.split(' ').next().unwrap().to_owned();
                families.push(family.clone());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert_eq!(name, family);
                assert!(["counter", "gauge", "histogram"].contains(&kind));
                assert_eq!(kind == "counter", name.ends_with("_total"), "{name}");
            } else {
                let name = line.split(['{', ' ']).next().unwrap();
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix).filter(|b| *b == family))
                    .unwrap_or(name);
                assert_eq!(base, family, "{line}");
                let value = line.rsplit(' ').next().unwrap();
                assert!(value.parse::<f64>().is_ok(), "{line}");
            }
        }
        assert!(families.iter().all(|f| f.starts_with("larder_")));
        let unique: std::collections::HashSet<_> = families.iter().collect();
        assert_eq!(unique.len(), families.len(), "a family is written twice");
        assert_eq!(families.len(), 22);
    }

    #[test]
    fn render_of_an_idle_daemon_is_all_zeros_but_the_gauges() {
        let text = render(&Stats::default().snapshot(), &usage());
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            if !line.starts_with("larder_cache_") || line.contains("_total") {
                assert_eq!(value, "0", "{line}");
            }
        }
    }
}
