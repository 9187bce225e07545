//! The Prometheus endpoint: [`render`] of a [`Snapshot`] (the daemon's counters, the block
//! store's usage and the rack's members) in the text exposition format (version 0.0.4), and
//! the [`service`] answering `GET /metrics`, served by [`larder_http::serve`] under
//! [`LIMITS`].
//!
//! The same listener answers the health checks of an orchestrator (Kubernetes probes):
//! `/healthz` is 200 whenever the process answers at all (alive), and `/readyz` is 200 only
//! while the daemon serves: the mount is up and the cache dir is its own ([`Phase`] and the
//! store's `dir_lost`); otherwise 503 with a one-line reason in plain text.
//!
//! The endpoint is given a function that takes a snapshot, not the parts of the daemon it
//! reads. Every metric name, its type, unit and labels are written out in [`render`], in one
//! place; `docs/METRICS.md` describes each. Labels only take values from small closed sets
//! (sources, lookup results, request kinds, peer results and member states, FUSE operations),
//! never keys, paths, member ids or addresses.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hyper::header::{ALLOW, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use larder_control_api::FailureCause;
use larder_fuse_mount::{Operation, Outcome};
use larder_http::{self as http, Body, Limits};
use larder_peers::members::{MemberHealth, MemberState};
use larder_stats::{Histogram, HistogramSnapshot, StatsSnapshot};
use larder_store::Usage;

use crate::process::ProcessStats;

/// The limits of the metrics listener: scrapes are small and quick; a client (an IP address)
/// holds at most 16 connections, and idle ones make room for a scrape.
pub const LIMITS: Limits = Limits {
    max_connections: 64,
    max_per_client: 16,
    read_timeout: Duration::from_secs(2),
    request_deadline: Duration::from_secs(10),
    max_body: 64 << 10,
    // Idle connections must never keep a scrape out.
    fresh_grace: Duration::ZERO,
};

/// What one scrape shows, read when the scrape arrives.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The layers' counters and histograms.
    pub stats: StatsSnapshot,
    /// How long the mount's FUSE requests took.
    pub fuse: FuseSnapshot,
    /// The block store's usage.
    pub usage: Usage,
    /// The rack's members, this node included; empty when peers are off.
    pub members: Vec<MemberState>,
    /// Whether `/readyz` would answer 200.
    pub ready: bool,
    /// The process's own figures; `None` where `/proc` cannot be read.
    pub process: Option<ProcessStats>,
}

/// How long FUSE requests take, by operation: the histograms the mount's observer
/// (`MountOptions::observer`) records into. They are the binary's, not `larder-stats`', because
/// the operations are the FUSE adapter's and the stats crate depends on no layer.
#[derive(Debug, Default)]
pub struct FuseLatencies {
    requests: [Histogram; Operation::ALL.len()],
    /// Reads past the mount's deadline that no reader saw (see [`Outcome::FirstReadTimeout`]).
    readahead_timeouts: AtomicU64,
}

impl FuseLatencies {
    /// Records one request of kind `op`, from its arrival to its reply, and how it ended.
    pub fn observe(&self, op: Operation, elapsed: Duration, outcome: Outcome) {
        self.requests[op as usize].observe(elapsed);
        if outcome == Outcome::FirstReadTimeout {
            self.readahead_timeouts.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Reads every operation's histogram.
    pub fn snapshot(&self) -> FuseSnapshot {
        FuseSnapshot {
            requests: std::array::from_fn(|i| self.requests[i].snapshot()),
            readahead_timeouts: self.readahead_timeouts.load(Ordering::Relaxed),
        }
    }
}

/// A copy of [`FuseLatencies`] at one instant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FuseSnapshot {
    requests: [HistogramSnapshot; Operation::ALL.len()],
    /// Reads past the mount's deadline that no reader saw.
    pub readahead_timeouts: u64,
}

impl FuseSnapshot {
    /// The requests of kind `op`.
    pub fn get(&self, op: Operation) -> &HistogramSnapshot {
        &self.requests[op as usize]
    }
}

/// Where the daemon is in its life, for `/readyz`: it starts mounting, the
/// daemon moves it to serving once the mount is up and to stopping on SIGTERM.
#[derive(Debug, Default)]
pub struct Phase(AtomicU8);

impl Phase {
    const MOUNTING: u8 = 0;
    const SERVING: u8 = 1;
    const STOPPING: u8 = 2;

    /// The mount is up: ready, unless the cache dir is lost.
    pub fn serving(&self) {
        self.0.store(Self::SERVING, Ordering::Relaxed);
    }

    /// The daemon is stopping: never ready again.
    pub fn stopping(&self) {
        self.0.store(Self::STOPPING, Ordering::Relaxed);
    }

    /// Whether the daemon is ready, given whether its cache dir is lost and why its disk fails
    /// (if it does); why not when it is not.
    pub fn readiness(&self, dir_lost: bool, disk_failure: Option<String>) -> Result<(), String> {
        match self.0.load(Ordering::Relaxed) {
            Self::MOUNTING => Err("mounting".into()),
            Self::STOPPING => Err("stopping".into()),
            _ if dir_lost => Err("the cache dir was lost (deleted or replaced): restart the daemon".into()),
            _ => match disk_failure {
                Some(error) => Err(format!(
                    "the cache disk fails ({error}); reads go to the origin: check the disk, or \
                     restart the daemon on another"
                )),
                None => Ok(()),
            },
        }
    }
}

/// The version and commit of this binary, as `larder_build_info` labels them.
const BUILD: [(&str, &str); 2] = [
    ("version", env!("CARGO_PKG_VERSION")),
    ("revision", env!("LARDER_REVISION")),
];

/// Renders every metric in the Prometheus text format, version 0.0.4.
pub fn render(snapshot: &Snapshot) -> String {
    let mut out = Exposition::default();
    let Snapshot {
        stats: s,
        fuse,
        usage,
        members,
        ready,
        process,
    } = snapshot;

    out.family(
        "larder_build_info",
        "gauge",
        "Always 1; its labels say which Larder this is: the version and the commit it was built from.",
    );
    let labels: Vec<String> = BUILD.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    let _ = writeln!(out.text, "larder_build_info{{{}}} 1", labels.join(","));
    out.gauge(
        "larder_ready",
        "1 while the daemon is ready (what /readyz answers 200 for): mounted, its cache dir its own, its disk not failing.",
        u64::from(*ready),
    );
    if let Some(process) = process {
        process_families(&mut out, process);
    }

    out.family(
        "larder_read_bytes_total",
        "counter",
        "Bytes handed to readers through the daemon, by where they came from: nvme (on this node before the read), origin, peer (a block fetched ahead of its reader counts where it was fetched from).",
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
    out.sample(
        "larder_read_bytes_total",
        Some(("source", "peer")),
        s.served_peer_bytes,
    );

    out.family(
        "larder_block_lookups_total",
        "counter",
        "Block lookups of reads through the daemon by result: hit (in the block store), miss (nothing was fetching it: this read started its fill), joined (a fill was already fetching it: readahead, an earlier block of the same part, another reader or a prefetch), corrupt (checksum mismatch on disk, refetched).",
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
        "larder_readahead_blocks_total",
        "Blocks whose fill the readahead started before a read asked for them (a read of such a block then counts as joined, or as a hit once written).",
        s.readahead_blocks,
    );
    out.counter(
        "larder_readahead_held_back_blocks_total",
        "Blocks the readahead (or a fill past the block a reader asked for) did not fetch because they did not fit the memory budget.",
        s.readahead_held_back,
    );
    out.gauge(
        "larder_memory_used_bytes",
        "Block bytes in memory: being fetched, waiting for their cache write, read from disk or held by readers.",
        s.memory_used_bytes,
    );
    out.gauge(
        "larder_memory_limit_bytes",
        "The memory budget for block bytes (cache.memory_limit); blocks readers wait for may pass it.",
        s.memory_limit_bytes,
    );
    out.counter(
        "larder_memory_waits_total",
        "Times a prefetch job waited for room in the memory budget, or a fill for the cache writes to catch up.",
        s.memory_waits,
    );
    out.counter(
        "larder_passthrough_opens_total",
        "Opens of complete files handed to the kernel (FUSE passthrough); their reads never reach the daemon.",
        s.passthrough_opens,
    );
    out.counter(
        "larder_passthrough_open_bytes_total",
        "Sizes of the files opened in passthrough, summed: an upper bound on the bytes read from the cache that way.",
        s.passthrough_open_bytes,
    );
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
        "larder_cache_pinned_bytes",
        "Bytes of the cached blocks of pinned objects (each rounded up to 4 KiB): room eviction cannot make.",
        usage.pinned_bytes,
    );
    out.gauge(
        "larder_cache_blocks",
        "Blocks in the block store.",
        usage.blocks as u64,
    );
    out.gauge(
        "larder_cache_dir_lost",
        "1 when the cache dir was deleted or replaced under the daemon, which then caches nothing until restarted.",
        u64::from(usage.dir_lost),
    );
    out.gauge(
        "larder_cache_disk_failing",
        "1 while the cache disk fails (an I/O error reading, writing or scrubbing a block, or probing a file before passthrough), until a block write succeeds again or the disk answers a recheck (cache.disk_recheck after its last error): no file is handed to the kernel, reads go through the daemon and to the origin.",
        u64::from(usage.disk_failing),
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
        "larder_cache_scrubbed_bytes_total",
        "Bytes of blocks of files handed to the kernel that the scrub read back and found sound.",
        s.scrubbed_bytes,
    );
    out.family(
        "larder_cache_scrub_dropped_blocks_total",
        "counter",
        "Blocks the scrub dropped (fetched again when read), by what it found: an I/O error of the cache disk, or bytes that do not match their BLAKE3.",
    );
    for (reason, n) in [
        ("io_error", s.scrub_read_errors),
        ("corrupt", s.scrub_corrupt_blocks),
    ] {
        out.sample(
            "larder_cache_scrub_dropped_blocks_total",
            Some(("reason", reason)),
            n,
        );
    }
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
        ("put", s.origin_put_requests),
    ] {
        out.sample("larder_origin_requests_total", Some(("kind", kind)), n);
    }
    out.gauge(
        "larder_origin_fill_slots",
        "Origin fills (ranged GETs of a part) this node allows at once now: at most origin.concurrency, halved when requests starve (slower than a quarter of the read deadline, or failing), one more after each fast one.",
        s.origin_slots,
    );
    out.gauge(
        "larder_origin_fills_peak",
        "The most origin fills in flight at once since start.",
        s.origin_fills_peak,
    );
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

    out.family(
        "larder_peer_requests_total",
        "counter",
        "Run requests to rack peers by result: hit (the peer had the blocks), filled (the peer fetched them from its origin or joined its fill), miss (no peer to ask, or it declined at once), refused (its circuit was open, or the connection was refused), timeout (no first byte, or a stall, past the deadline), unauthorized (401, or an answer whose tags failed), bad_data (a block that did not match its hash or the sealed manifest).",
    );
    for (result, n) in [
        ("hit", s.peer_requests_hit),
        ("filled", s.peer_requests_filled),
        ("miss", s.peer_requests_miss),
        ("refused", s.peer_requests_refused),
        ("timeout", s.peer_requests_timeout),
        ("unauthorized", s.peer_requests_unauthorized),
        ("bad_data", s.peer_requests_bad_data),
    ] {
        out.sample("larder_peer_requests_total", Some(("result", result)), n);
    }
    out.counter(
        "larder_peer_fetched_bytes_total",
        "Block bytes received from rack peers and checked: bytes the origin did not have to send.",
        s.peer_fetched_bytes,
    );
    out.counter(
        "larder_peer_fetched_across_racks_bytes_total",
        "The part of those bytes received from members of other racks (the run's fleet owner): what crossed the spine.",
        s.peer_fetched_across_racks_bytes,
    );
    out.counter(
        "larder_peer_origin_check_read_bytes_total",
        "Bytes the origin checks read back from the cache: every block of an object checked against an MD5 ETag, and for a CRC only blocks whose CRCs were not kept as they arrived.",
        s.origin_check_read_bytes,
    );
    out.counter(
        "larder_peer_hedged_blocks_total",
        "Blocks fetched from the origin because the run's owner was late (no answer, or a stall, within its deadline); the owner was then asked again for the rest.",
        s.peer_hedged_blocks,
    );
    out.counter(
        "larder_peer_sent_bytes_total",
        "Block bytes this node sent to rack peers.",
        s.peer_sent_bytes,
    );
    out.counter(
        "larder_peer_refused_requests_total",
        "Requests from rack peers that this node refused (bad or missing MAC, stale, replayed, malformed).",
        s.peer_served_refused,
    );
    out.family(
        "larder_peer_origin_checks_total",
        "counter",
        "Objects completed in the cache with blocks from rack peers, checked against the strongest checksum the origin publishes, by result: match (the MD5 ETag, or every peer block compared with the origin's), crc_only (only a CRC was published and it matched: stops corruption, not a member choosing its bytes), mismatch (the peers' blocks were dropped and their members left out), unchecked (the origin publishes no checksum this node can check).",
    );
    for (result, n) in [
        ("match", s.origin_checks_match),
        ("crc_only", s.origin_checks_crc_only),
        ("mismatch", s.origin_checks_mismatch),
        ("unchecked", s.origin_checks_unchecked),
    ] {
        out.sample("larder_peer_origin_checks_total", Some(("result", result)), n);
    }
    out.family(
        "larder_registry_requests_total",
        "counter",
        "Requests to the registry mirror by kind: manifest, blob, refused (not the pull API, or a registry not configured upstream).",
    );
    for (kind, n) in [
        ("manifest", s.registry_manifest_requests),
        ("blob", s.registry_blob_requests),
        ("refused", s.registry_refused),
    ] {
        out.sample("larder_registry_requests_total", Some(("kind", kind)), n);
    }
    out.counter(
        "larder_registry_sent_bytes_total",
        "Bytes of verified manifests and blobs the registry mirror sent (what upstreams sent is in larder_origin_bytes_total).",
        s.registry_sent_bytes,
    );
    out.counter(
        "larder_registry_digest_checks_total",
        "Checks of manifests and blobs against their digest: a SHA-256 pass over the content read from the cache. Content checked before a restart is not checked again while its blocks hash as they did.",
        s.registry_digest_checks,
    );
    out.counter(
        "larder_registry_digest_mismatches_total",
        "Manifests and blobs whose upstream bytes did not match their digest: dropped from the cache, never served.",
        s.registry_digest_mismatches,
    );
    out.counter(
        "larder_registry_stale_tags_total",
        "Tags served as last resolved because their upstream could not be reached.",
        s.registry_stale_tags,
    );
    out.family(
        "larder_peer_members",
        "gauge",
        "Members of the rack by state as this node sees them: self (this node), up (the last request succeeded), down (failed, left out until its retry time), unknown (not asked since it joined or since its retry time). All zero when peers are off.",
    );
    for (state, name) in [
        (MemberHealth::This, "self"),
        (MemberHealth::Up, "up"),
        (MemberHealth::Down, "down"),
        (MemberHealth::Unknown, "unknown"),
    ] {
        let n = members.iter().filter(|m| m.state == state).count();
        out.sample("larder_peer_members", Some(("state", name)), n);
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
    out.gauge(
        "larder_prefetch_jobs_running",
        "Prefetch jobs filling now.",
        s.prefetch_jobs_running,
    );
    out.family(
        "larder_prefetch_jobs_total",
        "counter",
        "Prefetch jobs that ended, by state: done (every block cached), failed (objects not cached), cancelled (cancelled, or the daemon stopped).",
    );
    for (state, n) in [
        ("done", s.prefetch_jobs_done),
        ("failed", s.prefetch_jobs_failed),
        ("cancelled", s.prefetch_jobs_cancelled),
    ] {
        out.sample("larder_prefetch_jobs_total", Some(("state", state)), n);
    }
    out.family(
        "larder_prefetch_failed_objects_total",
        "counter",
        "Objects of ended prefetch jobs that were not cached, by cause: not_found, permission, version_changed, transient (the origin kept failing), not_stored (cache write failed or no room), origin_check (peers' blocks failed the origin's checksum), digest_mismatch and registry (images), abandoned (the daemon stopped), bad_key (a listed key that cannot be a path, skipped), other.",
    );
    for (cause, n) in FailureCause::ALL.iter().zip(s.prefetch_failed) {
        let label = Some(("cause", cause.name()));
        out.sample("larder_prefetch_failed_objects_total", label, n);
    }

    out.histograms(
        "larder_fill_duration_seconds",
        "Time to get one fill: a block read from the block store (nvme), a ranged GET of up to one part from the origin, waiting for an origin slot included (origin), or a run of blocks from a rack peer, from the request to its last block, complete runs only (peer).",
        "source",
        &[
            ("nvme", &s.fill_nvme),
            ("origin", &s.fill_origin),
            ("peer", &s.fill_peer),
        ],
    );
    out.counter(
        "larder_fuse_readahead_timeouts_total",
        "Reads past the mount's deadline on a range of their handle that had not timed out before: the kernel's readahead behind a slow origin, which the kernel reads again when a reader comes to it. No reader saw these errors; they are logged at debug.",
        fuse.readahead_timeouts,
    );
    let fuse: Vec<_> = Operation::ALL
        .iter()
        .map(|&op| (op.name(), fuse.get(op)))
        .collect();
    out.histograms(
        "larder_fuse_request_duration_seconds",
        "FUSE requests from arrival to reply, by operation.",
        "op",
        &fuse,
    );
    out.text
}

/// The `process_*` family every Prometheus exporter writes, with the names and units its
/// client libraries use.
fn process_families(out: &mut Exposition, process: &ProcessStats) {
    let families: [(&str, &str, &str, f64); 6] = [
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            process.resident_bytes as f64,
        ),
        (
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            process.virtual_bytes as f64,
        ),
        (
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            process.cpu.as_secs_f64(),
        ),
        (
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            process.open_fds as f64,
        ),
        (
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors (the soft limit).",
            process.max_fds as f64,
        ),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since the Unix epoch in seconds.",
            process.start_time_seconds,
        ),
    ];
    for (name, kind, help, value) in families {
        out.family(name, kind, help);
        out.sample(name, None, value);
    }
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

/// The service of the metrics listener: `GET /metrics` (and `HEAD`) with a fresh [`Snapshot`],
/// `/healthz` (always 200) and `/readyz` (200, or 503 with the reason `ready` gives); other
/// paths get 404, other methods 405.
pub fn service(
    snapshot: impl Fn() -> Snapshot + Send + Sync + 'static,
    ready: impl Fn() -> Result<(), String> + Send + Sync + 'static,
) -> impl http::Service {
    move |request: Request<Bytes>| std::future::ready(answer(&request, &snapshot, &ready))
}

fn answer(
    request: &Request<Bytes>,
    snapshot: impl Fn() -> Snapshot,
    ready: impl Fn() -> Result<(), String>,
) -> Response<Body> {
    let path = request.uri().path();
    if !["/metrics", "/healthz", "/readyz"].contains(&path) {
        return plain(
            StatusCode::NOT_FOUND,
            "not found: metrics are at /metrics, health at /healthz and /readyz\n",
        );
    }
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match path {
        "/healthz" => plain(StatusCode::OK, "ok\n"),
        "/readyz" => match ready() {
            Ok(()) => plain(StatusCode::OK, "ready\n"),
            Err(reason) => http::full(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain; charset=utf-8",
                format!("not ready: {reason}\n"),
            ),
        },
        _ => http::full(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            render(&snapshot()),
        ),
    }
}

fn plain(status: StatusCode, body: &'static str) -> Response<Body> {
    http::full(status, "text/plain; charset=utf-8", body)
}
#[cfg(test)]
mod tests {
    use larder_stats::Stats;

    use super::*;

    fn usage() -> Usage {
        Usage {
            used: 8 << 20,
            reserved: 4 << 20,
            capacity: 1 << 30,
            objects: 2,
            blocks: 3,
            pinned: 1,
            pinned_bytes: 4 << 20,
            disk_failing: false,
            dir_lost: false,
        }
    }

    fn snapshot(stats: &Stats, members: &[MemberState]) -> Snapshot {
        Snapshot {
            stats: stats.snapshot(),
            fuse: FuseSnapshot::default(),
            usage: usage(),
            members: members.to_vec(),
            ready: true,
            process: Some(ProcessStats {
                resident_bytes: 5 << 20,
                virtual_bytes: 9 << 20,
                cpu: Duration::from_millis(1500),
                open_fds: 12,
                max_fds: 1024,
                start_time_seconds: 1.7e9,
            }),
        }
    }

    fn member(id: &str, state: MemberHealth) -> MemberState {
        MemberState {
            id: id.into(),
            rack: "r1".into(),
            address: "127.0.0.9:7000".into(),
            state,
            retry_in_seconds: None,
            failures: 0,
            received_bytes: 0,
            note: None,
        }
    }

    #[test]
    fn render_writes_every_family_with_help_type_and_values() {
        let stats = Stats::default();
        larder_stats::add(&stats.read.served_nvme_bytes, 10);
        larder_stats::add(&stats.read.served_origin_bytes, 32);
        larder_stats::add(&stats.read.lookup_joined, 4);
        larder_stats::add(&stats.origin.origin_errors_version_changed, 5);
        larder_stats::add(&stats.jobs.prefetch_done_bytes, 6);
        larder_stats::add(&stats.mount.passthrough_opens, 2);
        larder_stats::add(&stats.mount.passthrough_open_bytes, 7);
        larder_stats::add(&stats.read.served_peer_bytes, 9);
        larder_stats::add(&stats.peer.peer_requests_bad_data, 3);
        larder_stats::add(&stats.peer.peer_fetched_bytes, 11);
        larder_stats::add(&stats.peer.peer_sent_bytes, 12);
        larder_stats::add(&stats.peer.peer_served_refused, 13);
        larder_stats::add(&stats.read.origin_checks_mismatch, 14);
        stats.read_latency.fill_origin.observe(Duration::from_millis(20));
        stats.peer_latency.fill_peer.observe(Duration::from_millis(3));
        let fuse = FuseLatencies::default();
        fuse.observe(Operation::Readdir, Duration::from_micros(300), Outcome::Replied);
        let members = [
            member("a", MemberHealth::This),
            member("b", MemberHealth::Up),
            member("c", MemberHealth::Down),
            member("d", MemberHealth::Down),
        ];
        larder_stats::add(&stats.jobs.prefetch_jobs_running, 1);
        larder_stats::add(&stats.jobs.prefetch_jobs_failed, 2);
        larder_stats::add(&stats.prefetch_failed[1], 3);
        let text = render(&Snapshot {
            fuse: fuse.snapshot(),
            ..snapshot(&stats, &members)
        });

        for line in [
            "# TYPE larder_read_bytes_total counter",
            "larder_read_bytes_total{source=\"nvme\"} 10",
            "larder_read_bytes_total{source=\"origin\"} 32",
            "larder_read_bytes_total{source=\"peer\"} 9",
            "# TYPE larder_peer_requests_total counter",
            "larder_peer_requests_total{result=\"bad_data\"} 3",
            "larder_peer_requests_total{result=\"hit\"} 0",
            "larder_peer_requests_total{result=\"filled\"} 0",
            "larder_peer_requests_total{result=\"miss\"} 0",
            "larder_peer_requests_total{result=\"refused\"} 0",
            "larder_peer_requests_total{result=\"timeout\"} 0",
            "larder_peer_requests_total{result=\"unauthorized\"} 0",
            "larder_peer_fetched_bytes_total 11",
            "larder_peer_sent_bytes_total 12",
            "larder_peer_refused_requests_total 13",
            "# TYPE larder_peer_origin_checks_total counter",
            "larder_peer_origin_checks_total{result=\"mismatch\"} 14",
            "larder_peer_origin_checks_total{result=\"match\"} 0",
            "larder_peer_origin_checks_total{result=\"crc_only\"} 0",
            "larder_peer_origin_checks_total{result=\"unchecked\"} 0",
            "# TYPE larder_peer_members gauge",
            "larder_peer_members{state=\"self\"} 1",
            "larder_peer_members{state=\"up\"} 1",
            "larder_peer_members{state=\"down\"} 2",
            "larder_peer_members{state=\"unknown\"} 0",
            "larder_fill_duration_seconds_bucket{source=\"peer\",le=\"0.005\"} 1",
            "larder_fill_duration_seconds_count{source=\"peer\"} 1",
            "larder_block_lookups_total{result=\"joined\"} 4",
            "larder_block_lookups_total{result=\"hit\"} 0",
            "larder_origin_errors_total{kind=\"version_changed\"} 5",
            "larder_prefetch_done_bytes_total 6",
            "larder_passthrough_opens_total 2",
            "larder_passthrough_open_bytes_total 7",
            "larder_readahead_blocks_total 0",
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
            &format!(
                "larder_build_info{{version=\"{}\",revision=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION"),
                env!("LARDER_REVISION")
            ),
            "larder_ready 1",
            "larder_cache_pinned_bytes 4194304",
            "larder_prefetch_jobs_running 1",
            "larder_prefetch_jobs_total{state=\"failed\"} 2",
            "larder_prefetch_jobs_total{state=\"done\"} 0",
            "larder_prefetch_failed_objects_total{cause=\"permission\"} 3",
            "larder_prefetch_failed_objects_total{cause=\"not_found\"} 0",
            "# TYPE process_cpu_seconds_total counter",
            "process_cpu_seconds_total 1.5",
            "process_resident_memory_bytes 5242880",
            "process_open_fds 12",
            "process_max_fds 1024",
            "process_start_time_seconds 1700000000",
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
        assert!(
            families
                .iter()
                .all(|f| f.starts_with("larder_") || f.starts_with("process_"))
        );
        let unique: std::collections::HashSet<_> = families.iter().collect();
        assert_eq!(unique.len(), families.len(), "a family is written twice");
        assert_eq!(families.len(), 62);
        // No label value names a member.
        assert!(!text.contains("\"b\"") && !text.contains("127.0.0."), "{text}");
    }

    #[test]
    fn readyz_follows_the_phase_the_cache_dir_and_its_disk_and_healthz_is_always_ok() {
        let phase = std::sync::Arc::new(Phase::default());
        let lost = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let failing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let get = |path: &str| {
            let request = Request::get(path).body(Bytes::new()).unwrap();
            let (phase, lost, failing) = (phase.clone(), lost.clone(), failing.clone());
            let snapshot = || snapshot(&Stats::default(), &[]);
            let response = answer(&request, snapshot, move || {
                let failure =
                    (failing.load(Ordering::Relaxed)).then(|| "read: Input/output error".to_owned());
                phase.readiness(lost.load(Ordering::Relaxed), failure)
            });
            let status = response.status();
            let body = futures::executor::block_on(http_body_util::BodyExt::collect(response.into_body()))
                .unwrap()
                .to_bytes();
            (status, String::from_utf8(body.to_vec()).unwrap())
        };
        assert_eq!(get("/healthz"), (StatusCode::OK, "ok\n".into()));
        assert_eq!(
            get("/readyz"),
            (StatusCode::SERVICE_UNAVAILABLE, "not ready: mounting\n".into())
        );
        phase.serving();
        assert_eq!(get("/readyz"), (StatusCode::OK, "ready\n".into()));
        lost.store(true, Ordering::Relaxed);
        let (status, body) = get("/readyz");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.starts_with("not ready: the cache dir was lost"), "{body}");
        lost.store(false, Ordering::Relaxed);
        failing.store(true, Ordering::Relaxed);
        let (status, body) = get("/readyz");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body.starts_with("not ready: the cache disk fails (read: Input/output error)"),
            "{body}"
        );
        failing.store(false, Ordering::Relaxed);
        phase.stopping();
        assert_eq!(
            get("/readyz"),
            (StatusCode::SERVICE_UNAVAILABLE, "not ready: stopping\n".into())
        );
        assert_eq!(get("/healthz"), (StatusCode::OK, "ok\n".into()));
        assert_eq!(get("/metrics").0, StatusCode::OK);
        assert_eq!(get("/readyz/x").0, StatusCode::NOT_FOUND);
    }

    #[test]
    fn render_of_an_idle_daemon_is_all_zeros_but_the_gauges() {
        let idle = Snapshot {
            process: None,
            ..snapshot(&Stats::default(), &[])
        };
        let text = render(&idle);
        assert!(!text.contains("process_"), "{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            let gauge = ["larder_cache_", "larder_build_info", "larder_ready"]
                .iter()
                .any(|g| line.starts_with(g));
            if !gauge || line.contains("_total") {
                assert_eq!(value, "0", "{line}");
            }
        }
    }
}
