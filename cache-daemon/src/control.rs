//! The control API: HTTP/JSON on a Unix socket (mode 0600) for `larder prefetch` and
//! `larder status`.
//!
//! | request | answer |
//! |---|---|
//! | `GET /v1/status` | [`Status`] |
//! | `POST /v1/prefetch` `{"targets": [..], "pin": false}` | 202 and the job's [`JobReport`] |
//! | `GET /v1/jobs` | every job's report |
//! | `GET /v1/jobs/{id}` | the job's report |
//! | `DELETE /v1/jobs/{id}` | cancels the job; its report |
//! | `POST /v1/unpin` `{"targets": [..]}` | `{"unpinned": n}` |
//!
//! Errors are `{"error": "..."}` with 400 (malformed request, bad target), 404 (no such job or
//! target), 405, 413 (body over 1 MiB), 502 (the origin failed), 507 (the plan does not fit).
//! A connection's failure is logged and never reaches the daemon.

use std::collections::VecDeque;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::net::UnixListener;

use crate::prefetch::{JobReport, Jobs, PrefetchError};
use crate::stats::{Stats, StatsSnapshot};
use crate::store::BlockStore;

/// Largest request body accepted.
const MAX_BODY: usize = 1 << 20;

/// How often the counters are sampled for the windowed hit rate.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// The window of the recent hit rate.
const RECENT: Duration = Duration::from_secs(300);

/// A body of `POST /v1/prefetch` or `POST /v1/unpin`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TargetsRequest {
    targets: Vec<String>,
    #[serde(default)]
    pin: bool,
}

/// Bytes served, by where they came from.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Served {
    /// From the NVMe block store.
    pub nvme_bytes: u64,
    /// From origins.
    pub origin_bytes: u64,
    /// `nvme / (nvme + origin)`; `None` before any byte was served.
    pub hit_rate: Option<f64>,
}

impl Served {
    fn between(old: &StatsSnapshot, new: &StatsSnapshot) -> Self {
        let nvme = new.served_nvme_bytes - old.served_nvme_bytes;
        let origin = new.served_origin_bytes - old.served_origin_bytes;
        Self {
            nvme_bytes: nvme,
            origin_bytes: origin,
            hit_rate: (nvme + origin > 0).then(|| nvme as f64 / (nvme + origin) as f64),
        }
    }
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
    /// Served since start.
    pub served: Served,
    /// Served over the last five minutes (or since start, if shorter).
    pub served_recent: Served,
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
    /// Prefetch jobs.
    pub jobs: Vec<JobReport>,
    /// Key settings.
    pub settings: Settings,
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

/// What the control API serves from.
#[derive(Debug)]
pub struct Control {
    jobs: Arc<Jobs>,
    stats: Arc<Stats>,
    store: Arc<BlockStore>,
    settings: Settings,
    started: Instant,
    samples: Mutex<VecDeque<(Instant, StatsSnapshot)>>,
}

impl Control {
    /// The API over the daemon's parts.
    pub fn new(jobs: Arc<Jobs>, stats: Arc<Stats>, store: Arc<BlockStore>, settings: Settings) -> Self {
        let first = (Instant::now(), StatsSnapshot::default());
        Self {
            jobs,
            stats,
            store,
            settings,
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
            served: Served::between(&StatsSnapshot::default(), &now),
            served_recent: Served::between(&oldest, &now),
            evicted_blocks: now.evicted_blocks,
            evicted_bytes: now.evicted_bytes,
            origin_requests: now.origin_get_requests + now.origin_head_requests + now.origin_list_requests,
            origin_errors: OriginErrors {
                not_found: now.origin_errors_not_found,
                permission: now.origin_errors_permission,
                version_changed: now.origin_errors_version_changed,
                transient: now.origin_errors_transient,
                other: now.origin_errors_other,
            },
            cache_write_failures: now.cache_write_failures + now.cache_writes_skipped,
            jobs: self.jobs.reports(),
            settings: self.settings.clone(),
        }
    }

    async fn handle(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
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
                let request = match read_json::<TargetsRequest>(body).await {
                    Ok(request) => request,
                    Err(response) => return response,
                };
                if *action == "prefetch" {
                    match self.jobs.start(request.targets, request.pin).await {
                        Ok(report) => json(StatusCode::ACCEPTED, &report),
                        Err(e) => prefetch_error(&e),
                    }
                } else {
                    match self.jobs.unpin(&request.targets).await {
                        Ok(n) => json(StatusCode::OK, &serde_json::json!({ "unpinned": n })),
                        Err(e) => prefetch_error(&e),
                    }
                }
            }
            (_, ["v1", "status" | "jobs" | "prefetch" | "unpin"]) => error(
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

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response<Full<Bytes>> {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn error(status: StatusCode, message: String) -> Response<Full<Bytes>> {
    json(status, &serde_json::json!({ "error": message }))
}

fn prefetch_error(e: &PrefetchError) -> Response<Full<Bytes>> {
    let status = match e {
        PrefetchError::BadTarget { .. } => StatusCode::BAD_REQUEST,
        PrefetchError::NotFound { .. } => StatusCode::NOT_FOUND,
        PrefetchError::TooLarge { .. } => StatusCode::INSUFFICIENT_STORAGE,
        PrefetchError::Origin(_) => StatusCode::BAD_GATEWAY,
    };
    error(status, e.to_string())
}

async fn read_json<T: serde::de::DeserializeOwned>(body: Incoming) -> Result<T, Response<Full<Bytes>>> {
    let bytes = match Limited::new(body, MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is over {MAX_BODY} bytes"),
            ));
        }
        Err(e) => return Err(error(StatusCode::BAD_REQUEST, format!("reading the body: {e}"))),
    };
    serde_json::from_slice(&bytes).map_err(|e| error(StatusCode::BAD_REQUEST, format!("malformed JSON: {e}")))
}

/// Binds the control socket at `path`, mode 0600. A socket file nobody listens on (left by a
/// killed daemon) is replaced; a live one is an error.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "another daemon is listening on this control socket",
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Serves the API on `listener` until the task is dropped.
pub async fn serve(listener: UnixListener, control: Arc<Control>) {
    loop {
        let socket = match listener.accept().await {
            Ok((socket, _)) => socket,
            Err(error) => {
                tracing::warn!(%error, "control socket accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let control = control.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let control = control.clone();
                async move { Ok::<_, std::convert::Infallible>(control.handle(request).await) }
            });
            if let Err(error) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(socket), service)
                .await
            {
                tracing::debug!(%error, "control connection failed");
            }
        });
    }
}

/// Sends one request to the control socket at `socket` and returns the status and the JSON
/// body.
pub async fn call(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> anyhow::Result<(StatusCode, serde_json::Value)> {
    use anyhow::Context;
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("connecting to the daemon's control socket {}", socket.display()))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "larder")
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    let bytes = response.into_body().collect().await?.to_bytes();
    let value = serde_json::from_slice(&bytes)
        .with_context(|| format!("the daemon answered {status} with a body that is not JSON"))?;
    Ok((status, value))
}
