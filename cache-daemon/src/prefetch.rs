//! Prefetch jobs: targets resolved to object versions, the plan checked against the cache's
//! capacity before anything is fetched, objects pinned on request, and every missing block
//! filled through the same fill path as reads (single-flight, verification, capacity rules).
//!
//! Background priority: a job keeps at most [`PREFETCH_PARTS`] origin parts in flight (the
//! blocks of one part are filled in order, so a part is one origin request at a time, whether
//! it is a quarter of a large object or a whole small one), while demand reads may use the
//! whole origin concurrency; a job never waits for a reader, readers only share the origin
//! permits with at most that many of its parts.
//!
//! Every job's cancellation token is a child of the [`Jobs`]' own: [`Jobs::shutdown`] cancels
//! them all (a cancelled job starts no more fills and ends `cancelled`) and waits for their
//! tasks, which the daemon does on SIGTERM before it unmounts.
//!
//! Seal manifests (`.larder-seal/` at a source's root, see [`larder_peers::manifest`]) are never part
//! of a plan, whatever the target names. Nor is a key under a target that cannot be a path (a
//! newline in it, say): the mount leaves it out, and a job skips it and reports it among its
//! failures ([`FailureCause::BadKey`]), so one odd key costs itself alone.
//!
//! A job is idempotent: blocks already cached count as done at once, so a second run of the
//! same targets finishes without an origin request, and a run after a crash fetches only what
//! is missing.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
pub use larder_control_api::{FailureCause, JobCounts, JobReport, JobState, ObjectFailure};
use larder_object::ObjectVersion;
use larder_origin::{Origin, OriginError};
use larder_peers::manifest::is_seal_key;
use larder_read_path::model::is_model_file;
use larder_read_path::{Cache, Checked, OpenObject, OriginCheckError, ReadError};
use larder_registry::reference::ImageRef;
use larder_registry::{Mirror, MirrorError, node_platform};
use larder_stats::{Stats, add};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Origin parts a job keeps in flight.
pub const PREFETCH_PARTS: u32 = 4;

/// Finished jobs kept for `GET /v1/jobs` and status, newest first to stay; running jobs are
/// always kept.
pub const KEEP_FINISHED_JOBS: usize = 100;

/// HEAD requests in flight while a job is planned.
const HEADS_IN_FLIGHT: usize = 32;

/// Most failed objects a job's report lists (all are counted).
const MAX_ERRORS: usize = 20;

/// The longest key a target may name, in bytes (S3's limit).
pub(crate) const MAX_KEY_LEN: usize = 1024;

/// The longest target, in bytes (a path's limit, `PATH_MAX`).
const MAX_TARGET_LEN: usize = 4096;

/// Why a prefetch could not start.
#[derive(Debug, thiserror::Error)]
pub enum PrefetchError {
    /// A target is not a path under the mount, a `source:prefix` or a source URL.
    #[error("target {target:?}: {reason}")]
    BadTarget {
        /// The target as given.
        target: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Nothing exists at a target.
    #[error("target {target:?}: no object and no prefix of that name in source {source_name}")]
    NotFound {
        /// The target as given.
        target: String,
        /// The source it names.
        source_name: String,
    },
    /// The plan cannot fit in the cache.
    #[error(
        "the plan needs {planned} bytes ({objects} objects) but the cache holds {capacity} bytes; \
         nothing was fetched"
    )]
    TooLarge {
        /// Bytes of every object of the plan.
        planned: u64,
        /// Objects in the plan.
        objects: usize,
        /// The cache's capacity.
        capacity: u64,
    },
    /// Listing or a HEAD failed.
    #[error(transparent)]
    Origin(#[from] Box<OriginError>),
    /// An image target could not be resolved through the registry mirror.
    #[error("target {target:?}: {source}")]
    Image {
        /// The target as given.
        target: String,
        /// Why.
        source: MirrorError,
    },
}

#[derive(Debug)]
struct Job {
    id: u64,
    targets: Vec<String>,
    pin: bool,
    objects: usize,
    planned: u64,
    done: AtomicU64,
    fetched: AtomicU64,
    started: Instant,
    outcome: Mutex<(JobState, Option<Duration>)>,
    /// The objects that failed by key: the first error of each.
    failures: Mutex<BTreeMap<String, ObjectFailure>>,
    /// Objects whose blocks from rack peers were checked weakly: against a CRC only, and not
    /// at all.
    weakly_checked: Mutex<(usize, usize)>,
    cancel: CancellationToken,
}

impl Job {
    fn report(&self) -> JobReport {
        let (state, took) = *self.outcome.lock();
        let (crc_only_objects, unchecked_objects) = *self.weakly_checked.lock();
        JobReport {
            id: self.id,
            state,
            targets: self.targets.clone(),
            pin: self.pin,
            objects: self.objects,
            planned_bytes: self.planned,
            done_bytes: self.done.load(Ordering::Relaxed),
            fetched_bytes: self.fetched.load(Ordering::Relaxed),
            elapsed_seconds: took.unwrap_or_else(|| self.started.elapsed()).as_secs_f64(),
            errors: self.failures.lock().values().take(MAX_ERRORS).cloned().collect(),
            crc_only_objects,
            unchecked_objects,
        }
    }

    fn finish(&self, state: JobState) {
        *self.outcome.lock() = (state, Some(self.started.elapsed()));
    }

    /// Records that object `key` failed for `cause` (`error` says how): its first error only.
    fn error(&self, key: &str, cause: FailureCause, error: &dyn std::fmt::Display) {
        self.failures
            .lock()
            .entry(key.to_owned())
            .or_insert_with(|| ObjectFailure {
                key: key.to_owned(),
                cause,
                error: error.to_string(),
            });
    }

    /// Records that object `key` failed its origin check. Blocks the check dropped replace an
    /// error its fills gave: the check may drop a member's block while a fill still waits to
    /// see it stored, and only the check says why it went.
    fn check_failed(&self, key: &str, error: &OriginCheckError) {
        if *error == OriginCheckError::Dropped {
            self.failures.lock().remove(key);
        }
        self.error(key, FailureCause::OriginCheck, error);
    }

    fn failed(&self) -> bool {
        !self.failures.lock().is_empty()
    }
}

/// Why a fill's `error` left an object uncached.
fn read_cause(error: &ReadError) -> FailureCause {
    match error {
        ReadError::Origin(error) => origin_cause(error),
        ReadError::NotStored(_) => FailureCause::NotStored,
        ReadError::Abandoned => FailureCause::Abandoned,
        // Only ever on the way to the origin; counted where they end if they do.
        ReadError::Peer(_) | ReadError::PeerLate(_) => FailureCause::Other,
    }
}

/// Why the origin's `error` left an object uncached.
fn origin_cause(error: &OriginError) -> FailureCause {
    match error {
        OriginError::NotFound { .. } => FailureCause::NotFound,
        OriginError::PermissionDenied { .. } => FailureCause::Permission,
        OriginError::VersionChanged { .. } => FailureCause::VersionChanged,
        OriginError::RetriesExhausted { .. } | OriginError::DeadlineExceeded { .. } => {
            FailureCause::Transient
        }
        OriginError::Rejected { .. } | OriginError::NotSupported { .. } | OriginError::Config { .. } => {
            FailureCause::Other
        }
    }
}

/// Why the registry mirror's `error` left an image's content uncached.
fn mirror_cause(error: &MirrorError) -> FailureCause {
    match error {
        MirrorError::Fill { source, .. } => read_cause(source),
        MirrorError::DigestMismatch(_) => FailureCause::DigestMismatch,
        _ => FailureCause::Registry,
    }
}

/// The jobs of one kind (prefetch, seal) the daemon remembers: every running one and the last
/// [`KEEP_FINISHED_JOBS`] finished, by number.
#[derive(Debug)]
pub(crate) struct History<J> {
    pub(crate) jobs: BTreeMap<u64, Arc<J>>,
    /// Finished jobs still in `jobs`, in the order they finished.
    finished: VecDeque<u64>,
}

impl<J> Default for History<J> {
    fn default() -> Self {
        Self {
            jobs: BTreeMap::new(),
            finished: VecDeque::new(),
        }
    }
}

impl<J> History<J> {
    /// Job `id` ended: the oldest finished job is forgotten past the bound.
    pub(crate) fn finished(&mut self, id: u64) {
        self.finished.push_back(id);
        while self.finished.len() > KEEP_FINISHED_JOBS {
            if let Some(old) = self.finished.pop_front() {
                self.jobs.remove(&old);
            }
        }
    }
}

/// What targets (of a prefetch, an unpin or a seal) can name: the configured sources, and
/// paths under the mount.
#[derive(Debug)]
pub(crate) struct Targets {
    sources: Vec<(String, Arc<Origin>)>,
    mount: PathBuf,
    mirror: Option<Arc<Mirror>>,
}

/// What targets name.
#[derive(Debug, Default)]
pub(crate) struct Resolved {
    /// Every object, each once.
    pub(crate) objects: Vec<(Arc<Origin>, ObjectVersion)>,
    /// The keys listed under the targets that cannot be paths: in no plan.
    pub(crate) unparsable_keys: Vec<String>,
}

/// What a job says of a key that cannot be a path.
pub(crate) const UNPARSABLE_KEY: &str =
    "the key cannot be a path (an empty segment, `.` or `..`, a control character): skipped";

/// The prefix of a target that names a container image: `image:REGISTRY/REPOSITORY[:TAG]`.
pub const IMAGE_PREFIX: &str = "image:";

impl Targets {
    /// Targets naming `sources` (name, origin), paths under `mount`, or images pulled through
    /// `mirror`.
    pub(crate) fn new(
        sources: Vec<(String, Arc<Origin>)>,
        mount: PathBuf,
        mirror: Option<Arc<Mirror>>,
    ) -> Self {
        Self {
            sources,
            mount,
            mirror,
        }
    }

    /// The image `target` names, if it is an image target, with the mirror that pulls it.
    fn image(&self, target: &str) -> Result<Option<(ImageRef, &Arc<Mirror>)>, PrefetchError> {
        let Some(text) = target.strip_prefix(IMAGE_PREFIX) else {
            return Ok(None);
        };
        let bad = |reason: String| PrefetchError::BadTarget {
            target: target.to_owned(),
            reason,
        };
        let image: ImageRef = text.parse().map_err(bad)?;
        let mirror = self
            .mirror
            .as_ref()
            .ok_or_else(|| bad("the registry mirror is off: configure registry.upstreams".into()))?;
        if !mirror.knows(&image.host) {
            return Err(bad(format!(
                "registry {:?} is not configured upstream (registry.upstreams)",
                image.host
            )));
        }
        Ok(Some((image, mirror)))
    }

    /// The source and the path relative to it that `target` names.
    fn parse(&self, target: &str) -> Result<(usize, String), PrefetchError> {
        let bad = |reason: &str| PrefetchError::BadTarget {
            target: target.to_owned(),
            reason: reason.to_owned(),
        };
        let by_name = |name: &str| {
            self.sources
                .iter()
                .position(|(n, _)| n == name)
                .ok_or_else(|| bad(&format!("no source is named {name:?}")))
        };
        if target.is_empty() {
            return Err(bad(
                "empty; expected a path under the mount, SOURCE:PREFIX, or the URL of a configured source",
            ));
        }
        if target.len() > MAX_TARGET_LEN {
            return Err(bad(&format!("longer than {MAX_TARGET_LEN} bytes")));
        }
        if target.contains('\0') {
            return Err(bad("contains a NUL byte"));
        }
        let (source, path) = if target.starts_with('/') {
            let relative = Path::new(target)
                .strip_prefix(&self.mount)
                .map_err(|_| bad(&format!("not under the mount {}", self.mount.display())))?;
            let mut parts = Vec::new();
            for component in relative.components() {
                match component {
                    Component::Normal(part) => parts.push(part.to_str().ok_or_else(|| bad("not UTF-8"))?),
                    Component::CurDir => {}
                    _ => return Err(bad("`..` is not allowed")),
                }
            }
            if self.sources.len() == 1 {
                (0, parts.join("/"))
            } else {
                let (&name, rest) = parts
                    .split_first()
                    .ok_or_else(|| bad("names the mount's root; name a source directory under it"))?;
                (by_name(name)?, rest.join("/"))
            }
        } else if target.contains("://") {
            let source = self
                .sources
                .iter()
                .position(|(_, origin)| {
                    let url = origin.url().as_str().trim_end_matches('/');
                    target == url || target.strip_prefix(url).is_some_and(|rest| rest.starts_with('/'))
                })
                .ok_or_else(|| bad("no configured source has this URL"))?;
            let url = self.sources[source].1.url().as_str().trim_end_matches('/');
            (source, target[url.len()..].to_owned())
        } else if let Some((name, path)) = target.split_once(':') {
            (by_name(name)?, path.to_owned())
        } else {
            return Err(bad(
                "expected a path under the mount, SOURCE:PREFIX, or the URL of a configured source",
            ));
        };
        let key = path.trim_matches('/');
        if key.len() > MAX_KEY_LEN {
            return Err(bad(&format!("the key is longer than {MAX_KEY_LEN} bytes")));
        }
        // The rule the origin applies to every key (no empty, `.` or `..` segment, no control
        // character), checked before any request.
        if !key.is_empty() {
            object_store::path::Path::parse(key).map_err(|e| bad(&e.to_string()))?;
        }
        Ok((source, key.to_owned()))
    }

    /// Every object a target names: everything under it as a prefix, else the object itself;
    /// never a seal manifest (a key under [`SEAL_DIR`](larder_peers::manifest::SEAL_DIR)); and
    /// the keys under it that cannot be paths.
    async fn resolve(&self, target: &str) -> Result<Resolved, PrefetchError> {
        let (source, path) = self.parse(target)?;
        let (name, origin) = &self.sources[source];
        let listed = origin.list_all(&path).await.map_err(Box::new)?;
        let unparsable_keys: Vec<String> = listed
            .unparsable_keys
            .into_iter()
            .filter(|key| !is_seal_key(key))
            .collect();
        let mut keys: Vec<String> = listed
            .versions
            .into_iter()
            .map(|v| v.key)
            .filter(|key| !is_seal_key(key))
            .collect();
        // Not a prefix: then perhaps an object.
        if keys.is_empty() && unparsable_keys.is_empty() && !path.is_empty() && !is_seal_key(&path) {
            keys.push(path.clone());
        }
        let mut found = head_all(origin, keys).await?;
        // A model's index alone: the shards it names come with it.
        if let [index] = &found[..]
            && index.key == path
            && is_model_index(&path)
        {
            let shards = shards_of(origin, &path, target).await?;
            let named = shards.len();
            found.extend(head_all(origin, shards.clone()).await?);
            if found.len() != named + 1 {
                let missing = shards
                    .iter()
                    .find(|shard| !found.iter().any(|v| &v.key == *shard));
                return Err(PrefetchError::BadTarget {
                    target: target.to_owned(),
                    reason: format!(
                        "the model index names {}, which is not in source {name}",
                        missing.map_or("a shard", String::as_str)
                    ),
                });
            }
        }
        if found.is_empty() && unparsable_keys.is_empty() {
            return Err(PrefetchError::NotFound {
                target: target.to_owned(),
                source_name: name.clone(),
            });
        }
        Ok(Resolved {
            objects: found.into_iter().map(|v| (origin.clone(), v)).collect(),
            unparsable_keys,
        })
    }

    /// Every object the targets name, each once; images for `platform` (this node's when
    /// `None`). Every target is checked before any is resolved, so a wrong one costs no
    /// origin request.
    pub(crate) async fn plan(
        &self,
        targets: &[String],
        platform: Option<&str>,
    ) -> Result<Resolved, PrefetchError> {
        for target in targets {
            if self.image(target)?.is_none() {
                self.parse(target)?;
            }
        }
        let platform = platform.map_or_else(node_platform, str::to_owned);
        let mut plan = BTreeMap::new();
        let mut unparsable_keys = Vec::new();
        for target in targets {
            let found = match self.image(target)? {
                Some((image, mirror)) => {
                    mirror
                        .image_plan(&image, &platform)
                        .await
                        .map_err(|source| PrefetchError::Image {
                            target: target.clone(),
                            source,
                        })?
                }
                None => {
                    let resolved = self.resolve(target).await?;
                    unparsable_keys.extend(resolved.unparsable_keys);
                    resolved.objects
                }
            };
            for (origin, version) in found {
                plan.insert(version.id(), (origin, version));
            }
        }
        unparsable_keys.sort();
        unparsable_keys.dedup();
        // In the order loaders read them: the small files (configs, a model's index) first,
        // then the safetensors shards by name.
        let mut objects: Vec<_> = plan.into_values().collect();
        objects.sort_by_cached_key(|(origin, version)| {
            (
                is_model_file(&version.key),
                origin.name().to_owned(),
                version.key.clone(),
            )
        });
        Ok(Resolved {
            objects,
            unparsable_keys,
        })
    }
}

/// The current version of each of `keys` that exists, by a HEAD each: the version a HEAD
/// gives is the one an open pins (a listing may lack the ETag or the version id), so it is the
/// one to fill.
async fn head_all(origin: &Origin, keys: Vec<String>) -> Result<Vec<ObjectVersion>, PrefetchError> {
    let heads = futures::stream::iter(keys)
        .map(|key| async move { origin.head(&key).await })
        .buffer_unordered(HEADS_IN_FLIGHT)
        .collect::<Vec<_>>()
        .await;
    let mut found = Vec::with_capacity(heads.len());
    for head in heads {
        match head {
            Ok(version) => found.push(version),
            // Deleted since the listing, or never there.
            Err(OriginError::NotFound { .. }) => {}
            Err(error) => return Err(Box::new(error).into()),
        }
    }
    Ok(found)
}

/// The largest model index read: one of 100,000 tensors is a few MiB.
const MAX_MODEL_INDEX: u64 = 16 << 20;

/// Whether `key` is a sharded safetensors model's index (`model.safetensors.index.json`).
fn is_model_index(key: &str) -> bool {
    key.ends_with(".safetensors.index.json")
}

/// The shards the model index at `key` names (its `weight_map`'s values), as keys beside it,
/// in name order. `target` names the index, for errors.
async fn shards_of(origin: &Origin, key: &str, target: &str) -> Result<Vec<String>, PrefetchError> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let bad = |reason: String| PrefetchError::BadTarget {
        target: target.to_owned(),
        reason,
    };
    let bytes = origin
        .get_at_most(key, MAX_MODEL_INDEX)
        .await
        .map_err(Box::new)?
        .ok_or_else(|| bad(format!("the model index is over {MAX_MODEL_INDEX} bytes")))?;
    let index: Index = serde_json::from_slice(&bytes).map_err(|e| {
        bad(format!(
            "the model index has no weight map of tensors to files: {e}"
        ))
    })?;
    let dir = key.rsplit_once('/').map(|(dir, _)| dir);
    let mut shards: Vec<String> = index.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    shards
        .into_iter()
        .map(|shard| {
            let beside = !shard.starts_with('/') && shard.split('/').all(|s| !matches!(s, "" | "." | ".."));
            if !beside {
                return Err(bad(format!(
                    "the model index names {shard:?}, which is not a file beside it"
                )));
            }
            Ok(dir.map_or_else(|| shard.clone(), |dir| format!("{dir}/{shard}")))
        })
        .collect()
}

/// What [`Jobs::check`] found of a plan.
#[derive(Debug, Clone)]
pub struct PlanCheck {
    /// Every block of every object is cached and verified.
    pub complete: bool,
    /// The object versions the plan names now.
    pub versions: Vec<ObjectVersion>,
}

/// The daemon's prefetch jobs.
#[derive(Debug)]
pub struct Jobs {
    cache: Cache,
    targets: Targets,
    stats: Arc<Stats>,
    jobs: Mutex<History<Job>>,
    next: AtomicU64,
    /// Parent of every job's token: cancelled at shutdown.
    shutdown: CancellationToken,
    /// The jobs' tasks.
    tasks: TaskTracker,
}

impl Jobs {
    /// Jobs over `sources`, filling `cache`; `mount` is where the daemon's tree is mounted, so
    /// targets can be paths under it.
    pub fn new(cache: Cache, sources: Vec<(String, Arc<Origin>)>, mount: PathBuf, stats: Arc<Stats>) -> Self {
        Self {
            cache,
            targets: Targets::new(sources, mount, None),
            stats,
            jobs: Mutex::new(History::default()),
            next: AtomicU64::new(1),
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
        }
    }

    /// Lets targets name container images (`image:REF`), pulled through `mirror`.
    pub fn with_mirror(mut self, mirror: Arc<Mirror>) -> Self {
        self.targets.mirror = Some(mirror);
        self
    }

    /// Cancels every job, running or yet to start, and waits until their tasks have ended.
    /// Fills a job had started are the cache's to finish or abandon.
    pub async fn shutdown(&self) {
        self.shutdown.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// Plans a job and starts it in the background; image targets are for `platform` (this
    /// node's when `None`). Fails before fetching anything when a target is wrong or the plan
    /// cannot fit in the cache.
    pub async fn start(
        self: &Arc<Self>,
        targets: Vec<String>,
        pin: bool,
        platform: Option<&str>,
    ) -> Result<JobReport, PrefetchError> {
        if targets.is_empty() {
            return Err(PrefetchError::BadTarget {
                target: String::new(),
                reason: "no targets given".into(),
            });
        }
        let Resolved {
            objects: plan,
            unparsable_keys,
        } = self.targets.plan(&targets, platform).await?;
        let planned: u64 = plan.iter().map(|(_, v)| v.size).sum();
        let capacity = self.cache.store().usage().capacity;
        if planned > capacity {
            return Err(PrefetchError::TooLarge {
                planned,
                objects: plan.len(),
                capacity,
            });
        }
        let job = Arc::new(Job {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            targets,
            pin,
            objects: plan.len(),
            planned,
            done: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            started: Instant::now(),
            outcome: Mutex::new((JobState::Running, None)),
            failures: Mutex::default(),
            weakly_checked: Mutex::default(),
            cancel: self.shutdown.child_token(),
        });
        for key in &unparsable_keys {
            job.error(key, FailureCause::BadKey, &UNPARSABLE_KEY);
        }
        self.jobs.lock().jobs.insert(job.id, job.clone());
        add(&self.stats.jobs.prefetch_planned_bytes, planned);
        add(&self.stats.jobs.prefetch_jobs_running, 1);
        tracing::info!(
            job = job.id,
            objects = job.objects,
            planned,
            pin,
            "prefetch started"
        );
        let jobs = self.clone();
        let report = job.report();
        self.tasks.spawn(async move { jobs.run(job, plan).await });
        Ok(report)
    }

    async fn run(&self, job: Arc<Job>, plan: Vec<(Arc<Origin>, ObjectVersion)>) {
        let store = self.cache.store().clone();
        if job.pin {
            for (_, version) in &plan {
                store.set_pinned(version, true);
            }
        }
        let objects: Vec<Arc<OpenObject>> = plan
            .into_iter()
            .map(|(origin, version)| OpenObject::new(origin, version))
            .collect();
        // Every safetensors header first (in the first block), as a loader opens every shard
        // before it reads one; a header's failure is the object's, said with its fill below.
        let headers = objects
            .iter()
            .filter(|object| is_model_file(&object.version().key));
        let headers =
            futures::stream::iter(headers).for_each_concurrent(PREFETCH_PARTS as usize, |object| async {
                let _ = self.cache.fill(object, 0).await;
            });
        let fills = self.cache.fill_objects(
            objects.clone(),
            PREFETCH_PARTS as usize,
            |object, index, result| self.record(&job, object, index, result.map(|fetched| fetched.is_some())),
        );
        // An object filled with blocks from rack peers is done once its origin check passed.
        let fills = async {
            headers.await;
            fills.await;
            for object in &objects {
                match self.cache.origin_checked(object).await {
                    Err(error) => job.check_failed(&object.version().key, &error),
                    Ok(Checked::CrcOnly) => job.weakly_checked.lock().0 += 1,
                    Ok(Checked::Unchecked) => job.weakly_checked.lock().1 += 1,
                    Ok(Checked::Origin) => {}
                }
                if let Some(mirror) = &self.targets.mirror
                    && let Err(error) = mirror.check_prefetched(object).await
                {
                    job.error(&object.version().key, mirror_cause(&error), &error);
                }
            }
        };
        let state = tokio::select! {
            biased;
            () = job.cancel.cancelled() => JobState::Cancelled,
            () = fills => if job.failed() { JobState::Failed } else { JobState::Done },
        };
        job.finish(state);
        self.jobs.lock().finished(job.id);
        let stats = &self.stats;
        stats.jobs.prefetch_jobs_running.fetch_sub(1, Ordering::Relaxed);
        add(
            match state {
                JobState::Failed => &stats.jobs.prefetch_jobs_failed,
                JobState::Cancelled => &stats.jobs.prefetch_jobs_cancelled,
                JobState::Done | JobState::Running => &stats.jobs.prefetch_jobs_done,
            },
            1,
        );
        for failure in job.failures.lock().values() {
            let cause = FailureCause::ALL.iter().position(|&c| c == failure.cause);
            add(&stats.prefetch_failed[cause.unwrap_or_default()], 1);
        }
        let report = job.report();
        tracing::info!(
            job = job.id,
            ?state,
            done = report.done_bytes,
            fetched = report.fetched_bytes,
            seconds = report.elapsed_seconds,
            "prefetch ended"
        );
    }

    /// Counts the outcome of one block's fill in its job's progress; returns whether it
    /// succeeded.
    fn record(&self, job: &Job, object: &OpenObject, index: u32, result: Result<bool, ReadError>) -> bool {
        let len = self.cache.store().block_len(object.version().size, index);
        match result {
            Ok(fetched) => {
                job.done.fetch_add(len, Ordering::Relaxed);
                add(&self.stats.jobs.prefetch_done_bytes, len);
                if fetched {
                    job.fetched.fetch_add(len, Ordering::Relaxed);
                }
                true
            }
            Err(error) => {
                job.error(&object.version().key, read_cause(&error), &error);
                false
            }
        }
    }

    /// A job's progress.
    pub fn report(&self, id: u64) -> Option<JobReport> {
        self.jobs.lock().jobs.get(&id).map(|job| job.report())
    }

    /// The progress of every running job and of the last [`KEEP_FINISHED_JOBS`] finished,
    /// oldest first.
    pub fn reports(&self) -> Vec<JobReport> {
        self.jobs.lock().jobs.values().map(|job| job.report()).collect()
    }

    /// Jobs since start by state, forgotten ones included.
    pub fn counts(&self) -> JobCounts {
        let count = |counter: &AtomicU64| counter.load(Ordering::Relaxed) as usize;
        let stats = &self.stats;
        JobCounts {
            running: count(&stats.jobs.prefetch_jobs_running),
            done: count(&stats.jobs.prefetch_jobs_done),
            failed: count(&stats.jobs.prefetch_jobs_failed),
            cancelled: count(&stats.jobs.prefetch_jobs_cancelled),
        }
    }

    /// Stops a job; blocks already cached stay.
    pub fn cancel(&self, id: u64) -> Option<JobReport> {
        let job = self.jobs.lock().jobs.get(&id).cloned()?;
        job.cancel.cancel();
        Some(job.report())
    }

    /// Checks the objects the targets name now (a listing and a HEAD per object: a new version
    /// is a new object): their versions, and whether every block of each is in the cache and
    /// verified in this process. Reads no block, but an image's manifests (for `platform`).
    /// Keys that cannot be paths are no part of it: no read can ask for them.
    pub async fn check(
        &self,
        targets: &[String],
        platform: Option<&str>,
    ) -> Result<PlanCheck, PrefetchError> {
        let plan = self.targets.plan(targets, platform).await?.objects;
        let store = self.cache.store();
        let block_size = store.block_size();
        let complete = plan.iter().all(|(_, version)| {
            let id = version.id();
            (0..version.size.div_ceil(block_size) as u32).all(|index| store.verified(id, index))
        });
        Ok(PlanCheck {
            complete,
            versions: plan.into_iter().map(|(_, version)| version).collect(),
        })
    }

    /// Whether the cache dir was lost: nothing can be cached until the daemon restarts.
    pub fn cache_dir_lost(&self) -> bool {
        self.cache.store().usage().dir_lost
    }

    /// Unpins object versions a job pinned (versions a plan no longer names).
    pub fn unpin_versions(&self, versions: &[ObjectVersion]) {
        for version in versions {
            self.cache.store().set_pinned(version, false);
        }
    }

    /// Unpins every object the targets name (images for `platform`); returns how many.
    pub async fn unpin(&self, targets: &[String], platform: Option<&str>) -> Result<usize, PrefetchError> {
        let plan = self.targets.plan(targets, platform).await?.objects;
        for (_, version) in &plan {
            self.cache.store().set_pinned(version, false);
        }
        Ok(plan.len())
    }
}

#[cfg(test)]
mod tests {
    use larder_read_path::Unstored;
    use larder_store::Removal;

    use super::*;

    fn job() -> Job {
        Job {
            id: 1,
            targets: vec!["models:llama".into()],
            pin: false,
            objects: 2,
            planned: 0,
            done: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            started: Instant::now(),
            outcome: Mutex::new((JobState::Running, None)),
            failures: Mutex::default(),
            weakly_checked: Mutex::default(),
            cancel: CancellationToken::new(),
        }
    }

    /// A fill that saw its block go (the check dropped it) gives way to the check's verdict;
    /// an unfinished check does not hide the fill's error, which says more.
    #[test]
    fn the_origin_checks_verdict_replaces_a_fills_error_only_when_it_dropped_blocks() {
        let job = job();
        let gone = ReadError::NotStored(Arc::new(Unstored::Removed(Removal::EvictedForCapacity)));
        job.error("a", read_cause(&gone), &gone);
        job.error("b", read_cause(&gone), &gone);
        job.check_failed("a", &OriginCheckError::Dropped);
        job.check_failed("b", &OriginCheckError::Unfinished);
        let errors = job.report().errors;
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert_eq!(
            (errors[0].key.as_str(), errors[0].cause),
            ("a", FailureCause::OriginCheck)
        );
        assert!(errors[0].error.contains("origin's checksum"), "{errors:?}");
        assert_eq!(
            (errors[1].key.as_str(), errors[1].cause),
            ("b", FailureCause::NotStored)
        );
        assert!(errors[1].error.contains("evicted"), "{errors:?}");
    }

    #[test]
    fn a_report_lists_twenty_failed_objects_and_keeps_every_one() {
        let job = job();
        for n in 0..30 {
            job.error(&format!("k{n:02}"), FailureCause::Transient, &"reset");
        }
        let errors = job.report().errors;
        assert_eq!(errors.len(), MAX_ERRORS);
        assert_eq!(errors[0].to_string(), "k00: reset");
        assert_eq!(job.failures.lock().len(), 30);
    }
}
