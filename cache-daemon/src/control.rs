//! The control API's server: HTTP/JSON on a Unix socket (mode 0600) for `larder prefetch`,
//! `unpin`, `seal` and `status`, served by [`larder_http::serve`] under [`LIMITS`]. The routes and
//! their bodies are in [`larder_control_api`].

use std::collections::VecDeque;
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use larder_config::Redacted;
use larder_control_api::{
    FailureCause, Lookups, OriginErrors, Peers, SealRequest, Served, Settings, Status, TargetsRequest,
    Unpinned,
};
use larder_http::{self as http, Body, Limits};
use larder_peers::members::Membership;
use larder_registry::MirrorError;
use larder_stats::{Stats, StatsSnapshot};
use larder_store::BlockStore;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::net::UnixListener;

use crate::prefetch::{Jobs, PrefetchError};
use crate::seal::{SealError, Sealer};

/// The limits of the control socket. Its one client is this node (the socket is 0600); starting
/// a prefetch lists and HEADs every object of the plan before it answers, hence the long
/// deadline; idle connections are cut after 2 s and make room for new ones.
pub const LIMITS: Limits = Limits {
    max_connections: 64,
    max_per_client: 64,
    read_timeout: Duration::from_secs(2),
    request_deadline: Duration::from_secs(600),
    max_body: 1 << 20,
    // Idle connections must never keep `larder status` out.
    fresh_grace: Duration::ZERO,
};

/// How often the counters are sampled for the windowed hit rate.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// The window of the recent hit rate.
const RECENT: Duration = Duration::from_secs(300);

/// What was served between two snapshots.
fn served_between(old: &StatsSnapshot, new: &StatsSnapshot) -> Served {
    Served::new(
        new.served_nvme_bytes - old.served_nvme_bytes,
        new.served_origin_bytes - old.served_origin_bytes,
        new.served_peer_bytes - old.served_peer_bytes,
        new.passthrough_opens - old.passthrough_opens,
        new.passthrough_open_bytes - old.passthrough_open_bytes,
    )
}

/// What the control API serves from.
#[derive(Debug)]
pub struct Control {
    jobs: Arc<Jobs>,
    sealer: Arc<Sealer>,
    stats: Arc<Stats>,
    store: Arc<BlockStore>,
    settings: Settings,
    membership: Option<Membership>,
    started: Instant,
    samples: Mutex<VecDeque<(Instant, StatsSnapshot)>>,
}

impl Control {
    /// The API over the daemon's parts; `membership` is `None` when rack peers are off.
    pub fn new(
        jobs: Arc<Jobs>,
        sealer: Arc<Sealer>,
        stats: Arc<Stats>,
        store: Arc<BlockStore>,
        settings: Settings,
        membership: Option<Membership>,
    ) -> Self {
        let first = (Instant::now(), StatsSnapshot::default());
        Self {
            jobs,
            sealer,
            stats,
            store,
            settings,
            membership,
            started: Instant::now(),
            samples: Mutex::new(VecDeque::from([first])),
        }
    }

    /// Samples the counters every 10 seconds, for the recent hit rate. Runs until dropped.
    pub async fn sample(self: Arc<Self>) {
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        loop {
            tick.tick().await;
            let mut samples = self.samples.lock();
            samples.push_back((Instant::now(), self.stats.snapshot()));
            // Keep the newest sample at least RECENT old, and nothing older.
            while samples.len() > 1 && samples[1].0.elapsed() >= RECENT {
                samples.pop_front();
            }
        }
    }

    /// The daemon's status now.
    pub fn status(&self) -> Status {
        let now = self.stats.snapshot();
        let usage = self.store.usage();
        let oldest = self
            .samples
            .lock()
            .front()
            .map_or_else(StatsSnapshot::default, |(_, s)| *s);
        Status {
            uptime_seconds: self.started.elapsed().as_secs(),
            capacity_bytes: usage.capacity,
            used_bytes: usage.used,
            objects: usage.objects,
            pinned_objects: usage.pinned,
            blocks: usage.blocks,
            cache_dir_lost: usage.dir_lost,
            cache_disk_failing: self.store.disk_failure(),
            origin_fill_slots: now.origin_slots,
            origin_fills_peak: now.origin_fills_peak,
            served: served_between(&StatsSnapshot::default(), &now),
            served_recent: served_between(&oldest, &now),
            lookups: Lookups {
                hit: now.lookup_hit,
                miss: now.lookup_miss,
                joined: now.lookup_joined,
                corrupt: now.lookup_corrupt,
                readahead: now.readahead_blocks,
            },
            evicted_blocks: now.evicted_blocks,
            evicted_bytes: now.evicted_bytes,
            origin_requests: now.origin_get_requests
                + now.origin_head_requests
                + now.origin_list_requests
                + now.origin_put_requests,
            origin_errors: OriginErrors {
                not_found: now.origin_errors_not_found,
                permission: now.origin_errors_permission,
                version_changed: now.origin_errors_version_changed,
                transient: now.origin_errors_transient,
                other: now.origin_errors_other,
            },
            cache_write_failures: now.cache_write_failures + now.cache_writes_skipped,
            job_counts: self.jobs.counts(),
            failed_objects: FailureCause::ALL.into_iter().zip(now.prefetch_failed).collect(),
            jobs: self.jobs.reports(),
            peers: self.membership.as_ref().map(|m| Peers {
                node_id: m.self_id().to_owned(),
                rack: m.self_rack().to_owned(),
                members: m.states(),
                received_by_rack: m.received_by_rack(),
            }),
            settings: self.settings.clone(),
        }
    }

    async fn handle(&self, request: Request<Bytes>) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let path: Vec<&str> = parts.uri.path().trim_matches('/').split('/').collect();
        match (&parts.method, path.as_slice()) {
            (&Method::GET, ["v1", "status"]) => json(StatusCode::OK, &self.status()),
            (&Method::GET, ["v1", "jobs"]) => json(StatusCode::OK, &self.jobs.reports()),
            (method, ["v1", "jobs", id]) => {
                let Ok(id) = id.parse::<u64>() else {
                    return error(StatusCode::BAD_REQUEST, format!("{id:?} is not a job number"));
                };
                let report = match *method {
                    Method::GET => self.jobs.report(id),
                    Method::DELETE => self.jobs.cancel(id),
                    _ => return error(StatusCode::METHOD_NOT_ALLOWED, "use GET or DELETE".into()),
                };
                match report {
                    Some(report) => json(StatusCode::OK, &report),
                    None => error(StatusCode::NOT_FOUND, format!("no job {id}")),
                }
            }
            (&Method::POST, ["v1", action @ ("prefetch" | "unpin")]) => {
                let request: TargetsRequest = match serde_json::from_slice(&body) {
                    Ok(request) => request,
                    Err(e) => return error(StatusCode::BAD_REQUEST, format!("malformed JSON: {e}")),
                };
                if *action == "prefetch" {
                    match self
                        .jobs
                        .start(request.targets, request.pin, request.platform.as_deref())
                        .await
                    {
                        Ok(report) => json(StatusCode::ACCEPTED, &report),
                        Err(e) => prefetch_error(&e),
                    }
                } else {
                    match self
                        .jobs
                        .unpin(&request.targets, request.platform.as_deref())
                        .await
                    {
                        Ok(unpinned) => json(StatusCode::OK, &Unpinned { unpinned }),
                        Err(e) => prefetch_error(&e),
                    }
                }
            }
            (&Method::POST, ["v1", "seal"]) => {
                let request: SealRequest = match serde_json::from_slice(&body) {
                    Ok(request) => request,
                    Err(e) => return error(StatusCode::BAD_REQUEST, format!("malformed JSON: {e}")),
                };
                match self.sealer.start(request.targets).await {
                    Ok(report) => json(StatusCode::ACCEPTED, &report),
                    Err(SealError::Target(e)) => prefetch_error(&e),
                    Err(e @ SealError::TooManyObjects { .. }) => {
                        error(StatusCode::BAD_REQUEST, e.to_string())
                    }
                }
            }
            (&Method::GET, ["v1", "seal", id]) => {
                let Ok(id) = id.parse::<u64>() else {
                    return error(StatusCode::BAD_REQUEST, format!("{id:?} is not a job number"));
                };
                match self.sealer.report(id) {
                    Some(report) => json(StatusCode::OK, &report),
                    None => error(StatusCode::NOT_FOUND, format!("no seal job {id}")),
                }
            }
            (_, ["v1", "seal", _]) => error(StatusCode::METHOD_NOT_ALLOWED, "use GET".into()),
            (_, ["v1", "status" | "jobs" | "prefetch" | "unpin" | "seal"]) => error(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{} is not allowed here", parts.method),
            ),
            _ => error(
                StatusCode::NOT_FOUND,
                format!("no such endpoint: {}", parts.uri.path()),
            ),
        }
    }
}

/// The service answering the control API, for [`larder_http::serve`].
pub fn service(control: Arc<Control>) -> impl http::Service {
    move |request: Request<Bytes>| {
        let control = control.clone();
        async move { control.handle(request).await }
    }
}

// Every answer hides the secrets of the URLs in it: the sources' own are shown redacted
// already, but an origin's error quotes the URL of the request that failed.

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    let body = serde_json::to_string_pretty(value).unwrap_or_default();
    http::full(status, "application/json", Redacted(&body).to_string())
}

fn error(status: StatusCode, message: String) -> Response<Body> {
    http::error(status, &Redacted(&message).to_string())
}

fn prefetch_error(e: &PrefetchError) -> Response<Body> {
    let status = match e {
        PrefetchError::BadTarget { .. } => StatusCode::BAD_REQUEST,
        PrefetchError::NotFound { .. } => StatusCode::NOT_FOUND,
        PrefetchError::TooLarge { .. } => StatusCode::INSUFFICIENT_STORAGE,
        PrefetchError::Origin(_) => StatusCode::BAD_GATEWAY,
        PrefetchError::Image {
            source: MirrorError::Upstream(upstream),
            ..
        } if upstream.is_not_found() => StatusCode::NOT_FOUND,
        PrefetchError::Image { .. } => StatusCode::BAD_GATEWAY,
    };
    error(status, e.to_string())
}

/// Binds the control socket at `path`, mode 0600. A socket nobody answers on (left by a killed
/// daemon) is replaced; a live one is an error, and so is anything else at `path` (a regular
/// file, a directory, a symlink): it is left as it is.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another daemon is listening on this control socket",
                ));
            }
            std::fs::remove_file(path)?;
        }
        Ok(meta) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "a {} is there, not a socket; it is left as it is: remove it or choose another path",
                    file_kind(meta.file_type())
                ),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// What a file that is not a socket is, in words.
fn file_kind(kind: std::fs::FileType) -> &'static str {
    if kind.is_symlink() {
        "symlink"
    } else if kind.is_dir() {
        "directory"
    } else if kind.is_file() {
        "regular file"
    } else {
        "file"
    }
}
