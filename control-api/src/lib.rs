//! The control API's wire types: what `larder prefetch`, `unpin` and `status` send to the
//! daemon's control socket and what it answers, as JSON. The server (the daemon's `control`
//! module) and the client (its `cli` module) both use them; this crate depends on no other
//! crate of the daemon.
//!
//! | request | answer |
//! |---|---|
//! | `GET /v1/status` | [`Status`] |
//! | `POST /v1/prefetch` [`TargetsRequest`] | 202 and the job's [`JobReport`] |
//! | `GET /v1/jobs` | the [`JobReport`] of every running job and the last 100 finished |
//! | `GET /v1/jobs/{id}` | the job's [`JobReport`] |
//! | `DELETE /v1/jobs/{id}` | cancels the job; its [`JobReport`] |
//! | `POST /v1/unpin` [`TargetsRequest`] | [`Unpinned`] |
//! | `POST /v1/seal` [`SealRequest`] | 202 and the seal job's [`SealReport`] |
//! | `GET /v1/seal/{id}` | the seal job's [`SealReport`] |
//!
//! Errors are [`ErrorBody`] with 400 (malformed request, bad target), 404 (no such job or
//! target), 405, 408 (the body came too slowly), 413 (body over 1 MiB), 502 (the origin
//! failed), 503 (no answer in time), 507 (the plan does not fit).

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

use serde::{Deserialize, Serialize};

/// `GET`: the daemon's [`Status`].
pub const STATUS: &str = "/v1/status";
/// `POST`: start a prefetch job.
pub const PREFETCH: &str = "/v1/prefetch";
/// `POST`: unpin targets.
pub const UNPIN: &str = "/v1/unpin";
/// `GET`: every job.
pub const JOBS: &str = "/v1/jobs";
/// `POST`: start a seal job.
pub const SEAL: &str = "/v1/seal";

/// The path of seal job `id`: `GET` its report.
pub fn seal_job(id: u64) -> String {
    format!("{SEAL}/{id}")
}

/// The path of job `id`: `GET` its report, `DELETE` to cancel it.
pub fn job(id: u64) -> String {
    format!("{JOBS}/{id}")
}

/// A body of `POST /v1/prefetch` or `POST /v1/unpin`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetsRequest {
    /// Paths under the mount, `SOURCE:PREFIX`, URLs of configured sources, or
    /// `image:REGISTRY/REPOSITORY[:TAG|@DIGEST]`.
    pub targets: Vec<String>,
    /// Keep the objects in the cache until unpinned (prefetch only).
    #[serde(default)]
    pub pin: bool,
    /// The platform of image targets, `os/architecture[/variant]`; default the node's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
}

/// A plan file, in TOML: what `larder prefetch --plan FILE` sends and what the daemon keeps
/// warm (`warm.plan`).
///
/// ```toml
/// targets = ["models:llama-70b/", "datasets:shards/"]
/// images = ["nvcr.io/nvidia/pytorch:24.05-py3"]  # optional: pulled through the registry mirror
/// platform = "linux/amd64"  # optional, default the node's
/// pin = true   # optional, default false
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Paths under the mount, `SOURCE:PREFIX`, or URLs of configured sources.
    #[serde(default)]
    pub targets: Vec<String>,
    /// Container images, `REGISTRY/REPOSITORY[:TAG|@DIGEST]`.
    #[serde(default)]
    pub images: Vec<String>,
    /// The platform of the images; default the node's.
    #[serde(default)]
    pub platform: Option<String>,
    /// Keep the objects in the cache until unpinned.
    #[serde(default)]
    pub pin: bool,
}

impl Plan {
    /// Every target of the plan, its images as `image:` targets.
    pub fn all_targets(&self) -> Vec<String> {
        let images = self.images.iter().map(|image| format!("image:{image}"));
        self.targets.iter().cloned().chain(images).collect()
    }
}

/// A body of `POST /v1/seal`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealRequest {
    /// `SOURCE:PREFIX`, paths under the mount, or URLs of configured sources: every object
    /// under them is sealed.
    pub targets: Vec<String>,
}

/// Where the sealing of one object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SealState {
    /// Not sealed yet.
    Pending,
    /// Its manifest is written.
    Sealed,
    /// Not sealed: see the error.
    Failed,
}

/// One object of a seal job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SealedObject {
    /// The object's key, relative to its source.
    pub key: String,
    /// Its size in bytes.
    pub size: u64,
    /// Where its sealing is.
    pub state: SealState,
    /// The key of its manifest, relative to the source.
    pub manifest: String,
    /// Why it failed.
    pub error: Option<String>,
}

/// A seal job's progress.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SealReport {
    /// The job's number.
    pub id: u64,
    /// Where it is: `done` only when every object is sealed.
    pub state: JobState,
    /// The targets as given.
    pub targets: Vec<String>,
    /// Bytes of every object.
    pub planned_bytes: u64,
    /// Bytes read and hashed so far.
    pub hashed_bytes: u64,
    /// Seconds since it started (until it ended).
    pub elapsed_seconds: f64,
    /// Every object, in key order.
    pub objects: Vec<SealedObject>,
}

/// What `POST /v1/unpin` answers.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Unpinned {
    /// Objects unpinned.
    pub unpinned: usize,
}

/// What every error answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for a person.
    pub error: String,
}

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Filling.
    Running,
    /// Every block of every object is cached.
    Done,
    /// Finished with errors: some blocks are not cached.
    Failed,
    /// Stopped by a cancel request or by the daemon's shutdown.
    Cancelled,
}

/// Prefetch jobs since the daemon started, by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobCounts {
    /// Filling now.
    pub running: usize,
    /// Ended with every block cached.
    pub done: usize,
    /// Ended with errors.
    pub failed: usize,
    /// Stopped before the end.
    pub cancelled: usize,
}

/// Why an object of a prefetch job is not cached: the closed set that status and metrics
/// count failures by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCause {
    /// The object is gone from its source.
    NotFound,
    /// The source refused the daemon's credentials or denied access.
    Permission,
    /// The object changed since the job planned it: run the job again for the new version.
    VersionChanged,
    /// The source kept failing (5xx, resets, timeouts) past the retries or deadlines.
    Transient,
    /// Fetched, but not stored: a cache write failed, or no room could be made.
    NotStored,
    /// Blocks from rack peers did not match the origin's checksum (dropped), or the check
    /// could not finish.
    OriginCheck,
    /// An image's content did not match its digest.
    DigestMismatch,
    /// The registry upstream failed, refused or sent a manifest the mirror cannot read.
    Registry,
    /// The daemon stopped before the object was filled.
    Abandoned,
    /// The key cannot be a path (an empty segment, `.` or `..`, a control character such as a
    /// newline): listed under a target, skipped, never read, as the mount leaves it out.
    BadKey,
    /// Anything else the source answered (a malformed request, a misconfigured source).
    Other,
}

impl FailureCause {
    /// Every cause, in the order status and metrics list them.
    pub const ALL: [Self; 11] = [
        Self::NotFound,
        Self::Permission,
        Self::VersionChanged,
        Self::Transient,
        Self::NotStored,
        Self::OriginCheck,
        Self::DigestMismatch,
        Self::Registry,
        Self::Abandoned,
        Self::BadKey,
        Self::Other,
    ];

    /// Its name in JSON and in metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::NotFound => "not_found",
            Self::Permission => "permission",
            Self::VersionChanged => "version_changed",
            Self::Transient => "transient",
            Self::NotStored => "not_stored",
            Self::OriginCheck => "origin_check",
            Self::DigestMismatch => "digest_mismatch",
            Self::Registry => "registry",
            Self::Abandoned => "abandoned",
            Self::BadKey => "bad_key",
            Self::Other => "other",
        }
    }
}

/// An object of a job that is not cached, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectFailure {
    /// The object's key in its source.
    pub key: String,
    /// Why, for counting.
    pub cause: FailureCause,
    /// Why, for a person.
    pub error: String,
}

impl std::fmt::Display for ObjectFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", printable_key(&self.key), self.error)
    }
}

/// `key` as printed in a line of text: with its control characters (a newline, a tab, an
/// escape) escaped as Rust writes them (`\n`), so that no key can break a line or speak to a
/// terminal; any other key as it is.
pub fn printable_key(key: &str) -> std::borrow::Cow<'_, str> {
    if key.chars().any(char::is_control) {
        key.escape_debug().to_string().into()
    } else {
        key.into()
    }
}

/// A job's progress.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobReport {
    /// The job's number.
    pub id: u64,
    /// Where it is.
    pub state: JobState,
    /// The targets as given.
    pub targets: Vec<String>,
    /// Whether its objects are pinned.
    pub pin: bool,
    /// Objects in the plan.
    pub objects: usize,
    /// Bytes of every object of the plan.
    pub planned_bytes: u64,
    /// Bytes cached so far, including those that already were.
    pub done_bytes: u64,
    /// Bytes this job fetched from origins.
    pub fetched_bytes: u64,
    /// Seconds since it started (until it ended).
    pub elapsed_seconds: f64,
    /// The objects that failed, the first error of each (at most 20 objects).
    pub errors: Vec<ObjectFailure>,
    /// Objects done whose blocks from rack peers were checked against the origin's CRC only:
    /// no corruption, but no proof against a member that lies (seal them for that).
    #[serde(default)]
    pub crc_only_objects: usize,
    /// Objects done with blocks from rack peers that the origin gives nothing to check
    /// against.
    #[serde(default)]
    pub unchecked_objects: usize,
}

/// What readers got, and from where, over some time.
///
/// Reads of files opened in FUSE passthrough go from the kernel to the cache disk and never
/// reach the daemon: what it counts of them is the opens and the size of each file opened, an
/// upper bound on the bytes read that way (a reader may read only part of a file).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Served {
    /// Bytes read through the daemon from the NVMe block store.
    pub nvme_bytes: u64,
    /// Bytes read through the daemon from origins.
    pub origin_bytes: u64,
    /// Bytes read through the daemon that rack peers sent.
    #[serde(default)]
    pub peer_bytes: u64,
    /// Opens of complete files handed to the kernel (FUSE passthrough).
    pub passthrough_opens: u64,
    /// Sizes of those files, summed: an upper bound on the bytes read through passthrough.
    pub passthrough_bytes: u64,
    /// Bytes that were on this node when they were read (`nvme + passthrough`) over all
    /// bytes (`nvme + passthrough + peer + origin`); `None` before any byte was served or file
    /// opened. A block fetched ahead of its reader counts where it was fetched from, not as a
    /// hit, even when the reader gets it from disk.
    pub hit_rate: Option<f64>,
    /// Bytes rack peers sent over all bytes: the rack's share, beside the hit rate (the origin
    /// sent the rest).
    #[serde(default)]
    pub peer_share: Option<f64>,
}

impl Served {
    /// The figures with their hit rate.
    pub fn new(
        nvme_bytes: u64,
        origin_bytes: u64,
        peer_bytes: u64,
        passthrough_opens: u64,
        passthrough_bytes: u64,
    ) -> Self {
        let on_node = nvme_bytes + passthrough_bytes;
        let total = on_node + peer_bytes + origin_bytes;
        let share = |bytes: u64| (total > 0).then(|| bytes as f64 / total as f64);
        Self {
            nvme_bytes,
            origin_bytes,
            peer_bytes,
            passthrough_opens,
            passthrough_bytes,
            hit_rate: share(on_node),
            peer_share: share(peer_bytes),
        }
    }
}

/// Block lookups of reads through the daemon, by result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lookups {
    /// The block was in the block store.
    pub hit: u64,
    /// The block was not there and nothing was fetching it: this read started its fill.
    pub miss: u64,
    /// A fill was already fetching the block (started by the readahead, by a fill of an
    /// earlier block of the same origin part, by another reader or by a prefetch job): the
    /// read waited for it. A cold sequential read shows mostly these.
    pub joined: u64,
    /// The block on disk did not match its checksum: dropped and fetched again.
    pub corrupt: u64,
    /// Blocks whose fill the readahead started before a read asked for them.
    pub readahead: u64,
}

/// The configuration values `larder status` shows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    /// The mount point.
    pub mount: String,
    /// The cache directory.
    pub cache_dir: String,
    /// Block size in bytes.
    pub block_size: u64,
    /// Sources as `name = url`.
    pub sources: Vec<String>,
}

/// Origin errors by kind.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct OriginErrors {
    /// Not found.
    pub not_found: u64,
    /// Denied access.
    pub permission: u64,
    /// The object changed under an open handle.
    pub version_changed: u64,
    /// 5xx, resets, timeouts.
    pub transient: u64,
    /// Anything else.
    pub other: u64,
}

/// How a member of the rack is doing, as this node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberHealth {
    /// This node.
    #[serde(rename = "self")]
    This,
    /// The last request to it succeeded.
    Up,
    /// It failed: left out of ownership until its retry time.
    Down,
    /// Not asked yet, or its retry time came and it was not asked since.
    Unknown,
}

/// One member of the rack.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberState {
    /// Its node id.
    pub id: String,
    /// Its rack label.
    pub rack: String,
    /// `HOST:PORT` of its peer listener (empty for this node when it does not listen).
    pub address: String,
    /// How it is doing.
    pub state: MemberHealth,
    /// Seconds until it is asked again, when down.
    pub retry_in_seconds: Option<u64>,
    /// Failed requests in a row.
    pub failures: u32,
    /// Block bytes received from it and checked.
    pub received_bytes: u64,
    /// Why it is not asked as its place in the list would have it (its rack not known yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Bytes received from the peers of one rack.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RackBytes {
    /// The rack label (empty when the peers gave none).
    pub rack: String,
    /// Block bytes received from its members since start.
    pub bytes: u64,
}

/// Rack peers, when they are on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peers {
    /// This node's id.
    pub node_id: String,
    /// This node's rack label.
    pub rack: String,
    /// Every member, this node first.
    pub members: Vec<MemberState>,
    /// Bytes received from peers by their rack, since start.
    pub received_by_rack: Vec<RackBytes>,
}

/// What `GET /v1/status` answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    /// Seconds since the daemon started.
    pub uptime_seconds: u64,
    /// Capacity in bytes.
    pub capacity_bytes: u64,
    /// Bytes of cached blocks.
    pub used_bytes: u64,
    /// Objects with cached blocks.
    pub objects: usize,
    /// Objects pinned by prefetch jobs.
    pub pinned_objects: usize,
    /// Cached blocks.
    pub blocks: usize,
    /// The cache dir was deleted or replaced under the daemon, which gave it up: nothing is
    /// cached until a restart.
    #[serde(default)]
    pub cache_dir_lost: bool,
    /// Why the cache disk is taken to be failing, if it is: no file is handed to the kernel
    /// and reads go to the origin until a block write succeeds again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_disk_failing: Option<String>,
    /// Origin fills allowed at once now (adapted to the bandwidth they get).
    #[serde(default)]
    pub origin_fill_slots: u64,
    /// The most origin fills in flight at once since start.
    #[serde(default)]
    pub origin_fills_peak: u64,
    /// Served since start.
    pub served: Served,
    /// Served over the last five minutes (or since start, if shorter).
    pub served_recent: Served,
    /// Block lookups since start.
    pub lookups: Lookups,
    /// Blocks evicted since start.
    pub evicted_blocks: u64,
    /// Bytes evicted since start.
    pub evicted_bytes: u64,
    /// Origin requests since start: ranged GETs, HEADs, LISTs.
    pub origin_requests: u64,
    /// Origin errors since start, by kind.
    pub origin_errors: OriginErrors,
    /// Cache writes that failed or were skipped for lack of space.
    pub cache_write_failures: u64,
    /// Prefetch jobs since start, by state.
    #[serde(default)]
    pub job_counts: JobCounts,
    /// Objects of prefetch jobs that failed since start, by cause (every cause listed).
    #[serde(default)]
    pub failed_objects: std::collections::BTreeMap<FailureCause, u64>,
    /// Every running prefetch job and the last 100 finished, oldest first.
    pub jobs: Vec<JobReport>,
    /// Rack peers; `None` when they are off.
    #[serde(default)]
    pub peers: Option<Peers>,
    /// Key settings.
    pub settings: Settings,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_causes_are_named_alike_in_json_and_labels() {
        for cause in FailureCause::ALL {
            let json = serde_json::to_string(&cause).unwrap();
            assert_eq!(json, format!("\"{}\"", cause.name()));
            assert_eq!(serde_json::from_str::<FailureCause>(&json).unwrap(), cause);
        }
    }

    #[test]
    fn keys_with_control_characters_print_escaped_and_others_as_they_are() {
        assert_eq!(printable_key("odd/line\nbreak\t.bin"), "odd/line\\nbreak\\t.bin");
        for key in ["a\\b \"q\".bin", "ünïcødé.bin"] {
            assert_eq!(printable_key(key), key);
        }
    }

    #[test]
    fn the_hit_rate_counts_passthrough_as_served_from_the_cache() {
        assert_eq!(Served::new(0, 0, 0, 0, 0).hit_rate, None);
        assert_eq!(Served::new(0, 0, 0, 1, 100).hit_rate, Some(1.0));
        assert_eq!(Served::new(10, 30, 0, 0, 0).hit_rate, Some(0.25));
        assert_eq!(Served::new(10, 50, 0, 2, 40).hit_rate, Some(0.5));
    }

    #[test]
    fn bytes_from_rack_peers_are_the_racks_share_not_hits() {
        let from_peers = Served::new(0, 0, 100, 0, 0);
        assert_eq!(
            (from_peers.hit_rate, from_peers.peer_share),
            (Some(0.0), Some(1.0))
        );
        let mixed = Served::new(10, 60, 30, 0, 0);
        assert_eq!((mixed.hit_rate, mixed.peer_share), (Some(0.1), Some(0.3)));
        let with_passthrough = Served::new(10, 50, 30, 1, 10);
        assert_eq!(with_passthrough.hit_rate, Some(0.2));
        assert_eq!(Served::new(0, 0, 0, 0, 0).peer_share, None);
    }

    #[test]
    fn member_states_are_written_in_snake_case_with_self_for_this_node() {
        let text = serde_json::to_string(&[
            MemberHealth::This,
            MemberHealth::Up,
            MemberHealth::Down,
            MemberHealth::Unknown,
        ])
        .unwrap();
        assert_eq!(text, r#"["self","up","down","unknown"]"#);
    }

    #[test]
    fn a_targets_request_rejects_unknown_fields_and_defaults_pin() {
        let request: TargetsRequest = serde_json::from_str(r#"{"targets": ["m:a"]}"#).unwrap();
        assert!(!request.pin);
        assert!(serde_json::from_str::<TargetsRequest>(r#"{"targets": [], "pinned": true}"#).is_err());
    }
}
