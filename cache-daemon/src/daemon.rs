//! `larder daemon`: validate the config, open the cache, mount, serve until SIGTERM/SIGINT,
//! then stop: cancel the prefetch jobs (no new fills), detach the mount (it leaves the
//! namespace at once) and serve the files still open under it until they close,
//! `mount.shutdown_grace` passes or a second signal comes, abandon the origin requests still
//! in flight, wait for the cache writes of blocks already received, exit.
//!
//! The Prometheus endpoint ([`crate::metrics`]) listens from the moment the block store is open
//! until the daemon stops; an address it cannot bind stops the daemon from starting.
//!
//! Decisions: an unreachable origin does not stop the daemon from starting (the mount answers
//! with EIO until it comes back, and cached data is served meanwhile), but a `file://` source
//! whose directory is missing is refused by config validation; a stale mount left at the
//! mount point by a killed daemon is detached first; a live mount there is an error.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use larder_config::{Config, ConfigArgs, ConfigError};
use larder_fuse_mount::{Detached, MountOptions, detach};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::cache::Cache;
use crate::control::{self, Control};
use crate::control_api::Settings;
use crate::engine;
use crate::http;
use crate::members::Membership;
use crate::metrics::{self, Snapshot};
use crate::namespace::{Namespace, Source};
use crate::origin::{Origin, OriginError};
use crate::prefetch::Jobs;
use crate::stats::Stats;
use crate::store::{BlockStore, StoreError};

/// Arguments of `larder daemon`.
#[derive(Debug, Clone, clap::Args)]
pub struct DaemonArgs {
    /// Configuration: file, mount, cache, origin and sources.
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// Why the daemon could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A source cannot be built.
    #[error(transparent)]
    Origin(#[from] Box<OriginError>),
    /// The block store cannot be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The mount point is missing or not a directory.
    #[error("mount point {path}: {reason}")]
    MountPoint {
        /// The mount point.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Mounting failed.
    #[error("cannot mount at {path}: {source}{hint}")]
    Mount {
        /// The mount point.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
        /// What to do about it.
        hint: &'static str,
    },
    /// The control socket cannot be bound.
    #[error("control socket {path}: {source}")]
    ControlSocket {
        /// The socket's path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The metrics listener cannot be bound.
    #[error("cannot listen for metrics on {address} (metrics.listen; \"off\" disables it): {source}")]
    MetricsListen {
        /// The configured address.
        address: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// Something else the OS refused.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(args: DaemonArgs) -> Result<(), DaemonError> {
    let config = args.config.load()?;
    let control_socket = config.control.socket.clone();
    let mountpoint = prepare_mountpoint(&config.mount.path)?;
    let stats = Arc::new(Stats::default());
    let engine = engine::build(config.cache.io_engine, config.cache.io_queue_depth).map_err(|source| {
        DaemonError::Io {
            what: "starting the I/O engine",
            source,
        }
    })?;
    let store = Arc::new(BlockStore::open(&config.cache, engine, stats.clone()).await?);
    let membership = Membership::from_config(&config.peer);
    // Stops the HTTP servers.
    let stop = CancellationToken::new();
    let metrics_task = match config.metrics.listen {
        Some(address) => {
            Some(serve_metrics(address, &stats, &store, membership.clone(), stop.clone()).await?)
        }
        None => None,
    };
    let cache = Cache::new(store, &config.origin, stats.clone());
    let sources = sources(&config, &stats)?;
    let origins = sources
        .iter()
        .map(|(name, s)| (name.clone(), s.origin.clone()))
        .collect();
    let jobs = Arc::new(Jobs::new(
        cache.clone(),
        origins,
        mountpoint.clone(),
        stats.clone(),
    ));
    let settings = Settings {
        mount: mountpoint.display().to_string(),
        cache_dir: config.cache.dir.display().to_string(),
        block_size: config.cache.block_size.as_u64(),
        sources: config
            .sources
            .iter()
            .map(|s| format!("{} = {}", s.name, s.url))
            .collect(),
    };
    let control = Arc::new(Control::new(
        jobs.clone(),
        stats.clone(),
        cache.store().clone(),
        settings,
        membership,
    ));
    let listener = control::bind(&control_socket).map_err(|source| DaemonError::ControlSocket {
        path: control_socket.clone(),
        source,
    })?;
    let control_task = tokio::spawn(http::serve(
        listener,
        control::service(control.clone()),
        control::LIMITS,
        stop.clone(),
    ));
    let sample_task = tokio::spawn(control.sample());
    let passthrough = config.cache.passthrough;
    let namespace = Arc::new(Namespace::new(sources, cache.clone(), passthrough));
    let fuse_stats = stats.clone();
    let options = MountOptions {
        deadline: config.origin.read_deadline + Duration::from_secs(5),
        passthrough,
        observer: Some(Arc::new(move |op, elapsed| {
            fuse_stats.latency.fuse(op).observe(elapsed);
        })),
        ..MountOptions::default()
    };
    let mounted = larder_fuse_mount::mount(
        namespace,
        &mountpoint,
        &options,
        tokio::runtime::Handle::current(),
    )
    .map_err(|source| mount_error(&mountpoint, source))?;
    tracing::info!(
        mount = %mountpoint.display(),
        cache = %config.cache.dir.display(),
        capacity = %config.cache.capacity,
        sources = config.sources.len(),
        control = %control_socket.display(),
        "larder is serving"
    );

    wait_for_signal().await.map_err(|source| DaemonError::Io {
        what: "waiting for signals",
        source,
    })?;
    tracing::info!("stopping: cancelling prefetch jobs");
    stop.cancel();
    sample_task.abort();
    let _ = control_task.await;
    let _ = std::fs::remove_file(&control_socket);
    jobs.shutdown().await;
    let grace = config.mount.shutdown_grace;
    tracing::info!(
        grace = %humantime::format_duration(grace),
        "detaching the mount: files still open under it are served until they close, for at most the grace period"
    );
    let detached = tokio::select! {
        // Detach first, whatever else is ready.
        biased;
        detached = mounted.detach(grace) => detached,
        // A second SIGTERM or Ctrl-C ends the grace period.
        signal = wait_for_signal() => signal.map(|()| Detached::GraceExpired),
    };
    if let Ok(Detached::GraceExpired) = detached {
        tracing::warn!(
            grace = %humantime::format_duration(grace),
            "files were still open under the mount at the end of the grace period (or a second signal): their reads fail from now on"
        );
    }
    cache.stop_fills();
    cache.flush().await;
    if let Some(task) = metrics_task {
        let _ = task.await;
    }
    detached.map(drop).map_err(|source| DaemonError::Io {
        what: "detaching the mount",
        source,
    })
}

/// Binds the metrics listener and serves it on a task of its own until `stop`.
async fn serve_metrics(
    address: SocketAddr,
    stats: &Arc<Stats>,
    store: &Arc<BlockStore>,
    membership: Option<Membership>,
    stop: CancellationToken,
) -> Result<JoinHandle<()>, DaemonError> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|source| DaemonError::MetricsListen { address, source })?;
    let bound = listener.local_addr().unwrap_or(address);
    tracing::info!(address = %bound, "serving metrics at /metrics");
    let (stats, store) = (stats.clone(), store.clone());
    let snapshot = move || Snapshot {
        stats: stats.snapshot(),
        usage: store.usage(),
        members: membership.as_ref().map(Membership::states).unwrap_or_default(),
    };
    Ok(tokio::spawn(http::serve(
        listener,
        metrics::service(snapshot),
        metrics::LIMITS,
        stop,
    )))
}

fn sources(config: &Config, stats: &Arc<Stats>) -> Result<Vec<(String, Source)>, DaemonError> {
    config
        .sources
        .iter()
        .map(|source| {
            let origin = Origin::from_config(source, &config.origin, stats.clone()).map_err(Box::new)?;
            let origin = Arc::new(origin);
            let ttl = (!source.immutable).then_some(source.metadata_ttl);
            Ok((source.name.clone(), Source { origin, ttl }))
        })
        .collect()
}

/// Checks the mount point, detaching a stale FUSE mount a killed daemon left there.
fn prepare_mountpoint(path: &Path) -> Result<PathBuf, DaemonError> {
    let problem = |reason: String| DaemonError::MountPoint {
        path: path.to_owned(),
        reason,
    };
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(problem("not a directory".into())),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            tracing::warn!(mount = %path.display(), "detaching a stale mount left by a stopped daemon");
            detach(path)
                .map_err(|e| problem(format!("a stale mount is there and cannot be detached: {e}")))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(problem("does not exist".into())),
        Err(e) => return Err(problem(e.to_string())),
    }
    let canonical = path.canonicalize().map_err(|e| problem(e.to_string()))?;
    if is_mount_point(&canonical) {
        // Attributes of a dead FUSE mount may still come from the kernel's cache; statfs
        // always reaches the file system.
        match rustix::fs::statvfs(&canonical) {
            Err(e) if e.raw_os_error() == libc::ENOTCONN => {
                tracing::warn!(mount = %canonical.display(), "detaching a stale mount left by a stopped daemon");
                detach(&canonical)
                    .map_err(|e| problem(format!("a stale mount is there and cannot be detached: {e}")))?;
            }
            _ => return Err(problem("something is already mounted there".into())),
        }
    }
    Ok(canonical)
}

fn is_mount_point(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|line| line.split(' ').nth(4).map(Path::new) == Some(path))
}

fn mount_error(path: &Path, source: io::Error) -> DaemonError {
    let hint = match source.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => {
            " (mounting needs root or CAP_SYS_ADMIN, and access to /dev/fuse)"
        }
        Some(libc::ENOENT | libc::ENODEV) => " (is the fuse kernel module loaded and /dev/fuse present?)",
        _ => "",
    };
    DaemonError::Mount {
        path: path.to_owned(),
        source,
        hint,
    }
}

async fn wait_for_signal() -> io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
