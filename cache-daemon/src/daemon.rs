//! `larder daemon`: validate the config, open the cache, mount, serve until SIGTERM/SIGINT,
//! then stop: cancel the prefetch and seal jobs (no new fills), detach the mount (it leaves the
//! namespace at once) and serve the files still open under it until they close,
//! `mount.shutdown_grace` passes or a second signal comes, abandon the origin requests still
//! in flight, wait for the cache writes of blocks already received, exit.
//!
//! The Prometheus endpoint ([`crate::metrics`]) listens from the moment the node's read side
//! is built ([`crate::node`]: the block store open, the origins and peers set up) until the
//! daemon exits, after the grace period in which open files are still served; an address it
//! cannot bind stops the daemon from starting. Its `/readyz` says "mounting" until the mount
//! is up, then ready while the cache dir is the daemon's own and its disk works, and
//! "stopping" from SIGTERM on.
//!
//! The scrub of files handed to the kernel and the recheck of a failing disk run in the
//! background ([`crate::scrub`]).
//!
//! With `registry.containerd_hosts_dir`, a `hosts.toml` per upstream is written there once the
//! mirror listens and removed at SIGTERM (or when the start fails after it), so that containerd
//! pulls through the mirror exactly while it serves ([`crate::containerd`]). A file that cannot
//! be written is said in the log and costs that registry its mirror only: the daemon mounts
//! and serves.
//!
//! With `warm.plan`, the plan is prefetched once the mount is up and the Node labelled while it
//! is complete ([`crate::warm`]); a plan file that cannot be read stops the daemon from starting.
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
use larder_control_api::{Plan, Settings};
use larder_engine as engine;
use larder_fuse_mount::{Detached, MountOptions, detach};
use larder_http as http;
use larder_origin::OriginError;
use larder_origin::environment::Environment;
use larder_peer_proto::tls::TlsError;
use larder_peers::PeerSetupError;
use larder_peers::members::Membership;
use larder_read_path::Cache;
use larder_registry::{self as registry, Mirror};
use larder_stats::Stats;
use larder_store::{BlockStore, StoreError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::containerd::MirrorHostsFiles;
use crate::control::{self, Control};
use crate::kube::{KubeError, NodeClient};
use crate::metrics::{self, FuseLatencies, Phase, Snapshot};
use crate::node::Node;
use crate::prefetch::Jobs;
use crate::process::ProcessStats;
use crate::seal::Sealer;
use crate::warm::Warm;

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
    /// Rack peers cannot start (no usable cluster key).
    #[error(transparent)]
    Peer(#[from] PeerSetupError),
    /// The peer TLS files cannot be used.
    #[error("rack peer TLS (peer.tls_cert, peer.tls_key, peer.tls_ca): {0}")]
    PeerTls(#[from] TlsError),
    /// The peer listener cannot be bound.
    #[error("cannot listen for rack peers on {address} (peer.listen): {source}")]
    PeerListen {
        /// The configured address.
        address: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// The registry mirror cannot be set up (its credentials file).
    #[error("registry mirror: {0}")]
    Registry(#[from] larder_registry::SetupError),
    /// The registry mirror's listener cannot be bound.
    #[error("cannot listen for registry pulls on {address} (registry.listen; \"off\" disables it): {source}")]
    RegistryListen {
        /// The configured address.
        address: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// The warm plan cannot be read.
    #[error("warm plan {path} (warm.plan): {reason}")]
    WarmPlan {
        /// The plan file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The Kubernetes API client for warm-node labels cannot be set up.
    #[error(transparent)]
    Kube(#[from] KubeError),
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
    // Before anything that a hangup's default action (exit) would leave behind.
    ignore_hangups().map_err(|source| DaemonError::Io {
        what: "handling SIGHUP",
        source,
    })?;
    let config = args.config.load()?;
    raise_open_files_limit();
    let daemon = Daemon::start(&config).await?;
    wait_for_signal().await.map_err(|source| DaemonError::Io {
        what: "waiting for signals",
        source,
    })?;
    daemon.shutdown().await
}

/// The running daemon: every part [`Daemon::shutdown`] stops, in the order it stops them. A
/// start that fails part-way drops what it had started (the hosts files are removed, the
/// tasks' listeners close with the runtime).
struct Daemon {
    /// containerd's hosts files pointing at the mirror, removed first at shutdown.
    hosts_files: Option<MirrorHostsFiles>,
    /// What `/readyz` says.
    phase: Arc<Phase>,
    /// Stops the HTTP servers but the metrics one, the members' DNS resolution and hellos,
    /// the warm-node tasks, the scrub.
    stop: CancellationToken,
    control: ControlServer,
    jobs: Arc<Jobs>,
    /// The members' DNS resolution and hellos, the warm-node tasks, the scrub.
    background: TaskTracker,
    sealer: Arc<Sealer>,
    mounted: larder_fuse_mount::Mounted,
    grace: Duration,
    cache: Cache,
    /// The peer and registry listeners, which end with `stop`.
    listeners: Vec<JoinHandle<()>>,
    /// The metrics and health listener and its own stop: it answers (`/readyz` "stopping")
    /// until the mount has served its last open file.
    metrics: Option<(JoinHandle<()>, CancellationToken)>,
}

/// The control API's listener and its sampling task.
struct ControlServer {
    task: JoinHandle<()>,
    sample: JoinHandle<()>,
    socket: PathBuf,
}

impl ControlServer {
    /// Binds the control socket and serves `control` on it until `stop`.
    fn start(control: Arc<Control>, socket: &Path, stop: CancellationToken) -> Result<Self, DaemonError> {
        let listener = control::bind(socket).map_err(|source| DaemonError::ControlSocket {
            path: socket.to_owned(),
            source,
        })?;
        let task = tokio::spawn(http::serve(
            listener,
            control::service(control.clone()),
            control::LIMITS,
            stop,
        ));
        let sample = tokio::spawn(control.sample());
        Ok(Self {
            task,
            sample,
            socket: socket.to_owned(),
        })
    }

    /// Waits for the listener to end (its stop token cancelled) and removes the socket.
    async fn shutdown(self) {
        self.sample.abort();
        let _ = self.task.await;
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Daemon {
    /// Opens the cache, starts every listener and mounts: the daemon serves once this returns.
    async fn start(config: &Config) -> Result<Self, DaemonError> {
        let mountpoint = prepare_mountpoint(&config.mount.path)?;
        let fuse_latency = Arc::new(FuseLatencies::default());
        let engine =
            engine::build(config.cache.io_engine, config.cache.io_queue_depth).map_err(|source| {
                DaemonError::Io {
                    what: "starting the I/O engine",
                    source,
                }
            })?;
        let stop = CancellationToken::new();
        let background = TaskTracker::new();
        let node = Node::open(
            config,
            engine,
            &Environment::process(),
            std::convert::identity,
            &background,
            &stop,
        )
        .await?;
        let (stats, cache) = (node.stats.clone(), node.cache.clone());
        let membership = node.peers.members.clone();
        let phase = Arc::new(Phase::default());
        let mut listeners = Vec::new();
        // Health answers for as long as the daemon serves anything: through the grace period.
        let metrics_stop = CancellationToken::new();
        let metrics = match config.metrics.listen {
            Some(address) => Some(
                serve_metrics(
                    address,
                    (&stats, &fuse_latency),
                    cache.store(),
                    membership.clone(),
                    phase.clone(),
                    metrics_stop.clone(),
                )
                .await?,
            ),
            None => None,
        };
        background.spawn(crate::scrub::run(
            cache.store().clone(),
            config.cache.scrub_rate.as_u64(),
            config.cache.disk_recheck,
            stop.clone(),
        ));
        let warm = match &config.warm.plan {
            Some(path) => Some((
                read_plan(path)?,
                NodeClient::new(&config.warm, &node.peers.hello.node)?,
            )),
            None => None,
        };
        let origins = node.origins();
        let mirror = match config.registry.listen.filter(|_| config.registry.enabled()) {
            Some(address) => Some((
                address,
                Mirror::new(
                    &config.registry,
                    &config.origin,
                    cache.clone(),
                    &config.cache.dir,
                    &stats,
                )?,
            )),
            None => None,
        };
        if let Some(address) = config.peer.listen {
            // Members ask for image content by the registry's origin, as for any source.
            let registries = mirror.iter().flat_map(|(_, mirror)| mirror.origins());
            let by_name = origins.iter().cloned().chain(registries).collect();
            listeners.push(
                node.peers
                    .serve(address, &cache, by_name, &stats, stop.clone())
                    .await?,
            );
        }
        let mut jobs = Jobs::new(cache.clone(), origins.clone(), mountpoint.clone(), stats.clone());
        // Removed when dropped: at shutdown, or on any error from here on.
        let mut hosts_files = None;
        if let Some((address, mirror)) = mirror {
            jobs = jobs.with_mirror(mirror.clone());
            let (task, bound) = serve_registry(address, mirror, stop.clone()).await?;
            listeners.push(task);
            if let Some(dir) = &config.registry.containerd_hosts_dir {
                hosts_files = MirrorHostsFiles::write(dir, &config.registry.upstreams, bound);
            }
        }
        let jobs = Arc::new(jobs);
        let sealer = Arc::new(Sealer::new(
            origins,
            mountpoint.clone(),
            config.cache.block_size.as_u64(),
            config.origin.part_size.as_u64(),
            node.manifests.clone(),
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
            sealer.clone(),
            stats.clone(),
            cache.store().clone(),
            settings,
            membership,
        ));
        let control = ControlServer::start(control, &config.control.socket, stop.clone())?;
        let passthrough = config.cache.passthrough;
        let namespace = Arc::new(node.namespace(passthrough));
        let fuse_latency = fuse_latency.clone();
        let options = MountOptions {
            deadline: config.origin.read_deadline + Duration::from_secs(5),
            passthrough,
            observer: Some(Arc::new(move |op, elapsed, outcome| {
                fuse_latency.observe(op, elapsed, outcome)
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
        phase.serving();
        if let Some((plan, client)) = warm {
            let name = config.warm.plan_name().unwrap_or_default();
            Warm::new(jobs.clone(), plan, &name, config.warm.check_interval, client)
                .spawn(&background, stop.clone());
        }
        tracing::info!(
            mount = %mountpoint.display(),
            cache = %config.cache.dir.display(),
            capacity = %config.cache.capacity,
            sources = config.sources.len(),
            control = %config.control.socket.display(),
            "larder is serving"
        );
        Ok(Self {
            hosts_files,
            phase,
            stop,
            control,
            jobs,
            background,
            sealer,
            mounted,
            grace: config.mount.shutdown_grace,
            cache,
            listeners,
            metrics: metrics.map(|task| (task, metrics_stop)),
        })
    }

    /// Stops in order: containerd is pointed back at the registries, `/readyz` says stopping,
    /// the listeners and background tasks stop, the prefetch and seal jobs are cancelled, the
    /// mount is detached and serves its open files for the grace period (or until a second
    /// signal), the fills still in flight are abandoned and the cache writes of blocks already
    /// received are waited for.
    async fn shutdown(self) -> Result<(), DaemonError> {
        // containerd pulls straight from the registries from now on, not from a mirror that stops.
        drop(self.hosts_files);
        tracing::info!("stopping: cancelling prefetch and seal jobs");
        self.phase.stopping();
        self.stop.cancel();
        self.control.shutdown().await;
        self.jobs.shutdown().await;
        self.background.close();
        self.background.wait().await;
        self.sealer.shutdown().await;
        let grace = self.grace;
        tracing::info!(
            grace = %humantime::format_duration(grace),
            "detaching the mount: files still open under it are served until they close, for at most the grace period"
        );
        let detached = tokio::select! {
            // Detach first, whatever else is ready.
            biased;
            detached = self.mounted.detach(grace) => detached,
            // A second SIGTERM or Ctrl-C ends the grace period.
            signal = wait_for_signal() => signal.map(|()| Detached::GraceExpired),
        };
        if let Ok(Detached::GraceExpired) = detached {
            tracing::warn!(
                grace = %humantime::format_duration(grace),
                "files were still open under the mount at the end of the grace period (or a second signal): their reads fail from now on"
            );
        }
        self.cache.stop_fills();
        self.cache.flush().await;
        for task in self.listeners {
            let _ = task.await;
        }
        if let Some((task, stop)) = self.metrics {
            stop.cancel();
            let _ = task.await;
        }
        detached.map(drop).map_err(|source| DaemonError::Io {
            what: "detaching the mount",
            source,
        })
    }
}

/// Raises the soft limit of open files to the hard one, as the daemon holds a descriptor per
/// cached object's files, per connection of its listeners and per answer it refuses; the soft
/// limit some systems start a process with (1,024) is far below what a node serves.
fn raise_open_files_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let Some(hard) = limit.maximum
        && limit.current.is_some_and(|soft| soft < hard)
    {
        let raised = rustix::process::Rlimit {
            current: Some(hard),
            ..limit
        };
        if let Err(error) = setrlimit(Resource::Nofile, raised) {
            tracing::warn!(%error, soft = ?limit.current, "cannot raise the open files limit");
        }
    }
}

/// Binds the metrics listener and serves it (the layers' `stats` and the mount's `fuse`
/// latencies, the health checks, ready as `phase` and the store say) on a task of its own
/// until `stop`.
async fn serve_metrics(
    address: SocketAddr,
    (stats, fuse): (&Arc<Stats>, &Arc<FuseLatencies>),
    store: &Arc<BlockStore>,
    membership: Option<Membership>,
    phase: Arc<Phase>,
    stop: CancellationToken,
) -> Result<JoinHandle<()>, DaemonError> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|source| DaemonError::MetricsListen { address, source })?;
    let bound = listener.local_addr().unwrap_or(address);
    tracing::info!(address = %bound, "serving metrics at /metrics, health at /healthz and /readyz");
    let ready = {
        let (store, phase) = (store.clone(), phase.clone());
        move || phase.readiness(store.usage().dir_lost, store.disk_failure())
    };
    let (stats, fuse, store) = (stats.clone(), fuse.clone(), store.clone());
    let snapshot = move || {
        let usage = store.usage();
        Snapshot {
            stats: stats.snapshot(),
            fuse: fuse.snapshot(),
            members: membership.as_ref().map(Membership::states).unwrap_or_default(),
            ready: phase.readiness(usage.dir_lost, store.disk_failure()).is_ok(),
            usage,
            process: ProcessStats::of_self(),
        }
    };
    Ok(tokio::spawn(http::serve(
        listener,
        metrics::service(snapshot, ready),
        metrics::LIMITS,
        stop,
    )))
}

/// Binds the registry mirror's listener and serves it on a task of its own until `stop`; the
/// task and the address bound.
async fn serve_registry(
    address: SocketAddr,
    mirror: Arc<Mirror>,
    stop: CancellationToken,
) -> Result<(JoinHandle<()>, SocketAddr), DaemonError> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|source| DaemonError::RegistryListen { address, source })?;
    let bound = listener.local_addr().unwrap_or(address);
    let upstreams: Vec<&str> = mirror.upstreams().map(|(host, _)| host).collect();
    tracing::info!(address = %bound, ?upstreams, "serving the registry mirror");
    let task = tokio::spawn(http::serve(
        listener,
        registry::server::service(mirror),
        registry::server::LIMITS,
        stop,
    ));
    Ok((task, bound))
}

/// The plan file `warm.plan` names.
fn read_plan(path: &Path) -> Result<Plan, DaemonError> {
    let problem = |reason: String| DaemonError::WarmPlan {
        path: path.to_owned(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| problem(e.to_string()))?;
    let plan: Plan = toml::from_str(&text).map_err(|e| problem(e.to_string()))?;
    if plan.targets.is_empty() && plan.images.is_empty() {
        return Err(problem("no targets and no images".into()));
    }
    Ok(plan)
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

/// SIGHUP reloads nothing: the config is read once, at start, and what it sets (mount, cache,
/// sources, peers) cannot change under open files. Each one is logged and otherwise ignored,
/// so that a closed terminal or a supervisor's reload does not take the mount down, until the
/// process exits.
fn ignore_hangups() -> io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            tracing::warn!(
                "SIGHUP: nothing is reloaded (the config is read at start; restart the daemon to \
                 apply a change); still serving"
            );
        }
    });
    Ok(())
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
