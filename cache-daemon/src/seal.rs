//! Seal jobs (`larder seal`): every object the targets name is pinned to its current version
//! (a HEAD), read whole from the origin, hashed block by block at the daemon's block size, and
//! its [`Manifest`] written into the source at [`manifest_key`].
//!
//! The bytes are read from the origin itself, with `If-Match` on the pinned version, never
//! from the block cache: once blocks can come from rack peers, a cached block is only as
//! trusted as the peer that sent it, and a manifest made from it would vouch for a peer's
//! bytes. So sealing does not warm the cache either.
//!
//! A job reads at most [`SEAL_OBJECTS`] objects at a time, [`SEAL_PARTS`] origin parts of each
//! (so at most 8 ranged GETs in flight, beside the readers' own, outside their concurrency
//! limit), and names at most [`MAX_SEAL_OBJECTS`] objects, which keeps its report small.
//!
//! Sealing is idempotent: an unchanged object gets the same manifest, byte for byte. An
//! object replaced while it is read fails (its version changed) and is left for a rerun. A key
//! under a target that cannot be a path is listed as failed, never read.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use larder_control_api::{JobState, SealReport, SealState, SealedObject};
use larder_object::ObjectVersion;
use larder_origin::{Origin, OriginError};
use larder_peers::manifest::{BlockHasher, Manifest, ManifestError, Manifests, manifest_key};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::prefetch::{History, MAX_KEY_LEN, PrefetchError, Resolved, Targets, UNPARSABLE_KEY};

/// Objects a seal job reads at a time.
pub const SEAL_OBJECTS: usize = 2;

/// Origin parts of one object a seal job reads at a time.
pub const SEAL_PARTS: usize = 4;

/// Most objects one seal job takes.
pub const MAX_SEAL_OBJECTS: usize = 10_000;

/// Why a seal job could not start.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// A target is wrong, names nothing, or could not be listed: as for a prefetch.
    #[error(transparent)]
    Target(#[from] PrefetchError),
    /// The targets name more objects than one job takes.
    #[error(
        "the targets name {objects} objects, more than the {max} one seal job takes: seal narrower \
         prefixes"
    )]
    TooManyObjects {
        /// Objects named.
        objects: usize,
        /// The limit.
        max: usize,
    },
}

/// Why one object could not be sealed.
#[derive(Debug, thiserror::Error)]
pub enum ObjectSealError {
    /// The origin gives no version to pin.
    #[error("the origin gives it no ETag and no version id: there is no version to seal")]
    Unversioned,
    /// Its manifest's key would be too long for the store.
    #[error("its manifest's key {manifest:?} would be longer than {MAX_KEY_LEN} bytes")]
    KeyTooLong {
        /// The manifest's key.
        manifest: String,
    },
    /// Reading it or writing its manifest failed (or it changed while it was read).
    #[error(transparent)]
    Origin(#[from] OriginError),
    /// The hashes do not make a manifest (a bug: the parts read do not cover the object).
    #[error(transparent)]
    Manifest(#[from] ManifestError),
}

#[derive(Debug)]
struct SealJob {
    id: u64,
    targets: Vec<String>,
    planned: u64,
    hashed: AtomicU64,
    started: Instant,
    outcome: Mutex<(JobState, Option<Duration>)>,
    /// One per object, in key order.
    objects: Mutex<Vec<SealedObject>>,
    cancel: CancellationToken,
}

impl SealJob {
    fn report(&self) -> SealReport {
        let (state, took) = *self.outcome.lock();
        SealReport {
            id: self.id,
            state,
            targets: self.targets.clone(),
            planned_bytes: self.planned,
            hashed_bytes: self.hashed.load(Ordering::Relaxed),
            elapsed_seconds: took.unwrap_or_else(|| self.started.elapsed()).as_secs_f64(),
            objects: self.objects.lock().clone(),
        }
    }
}

/// The daemon's seal jobs.
#[derive(Debug)]
pub struct Sealer {
    targets: Targets,
    manifests: Manifests,
    block_size: u64,
    /// Blocks in one origin part read.
    part_blocks: u64,
    /// Every running job and the last [`crate::prefetch::KEEP_FINISHED_JOBS`] finished.
    jobs: Mutex<History<SealJob>>,
    next: AtomicU64,
    /// Parent of every job's token: cancelled at shutdown.
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl Sealer {
    /// Seal jobs over `sources` (targets may also be paths under `mount`), hashing blocks of
    /// `block_size` bytes read in parts of `part_size`; `manifests` forgets what it knew of each
    /// object sealed.
    pub fn new(
        sources: Vec<(String, Arc<Origin>)>,
        mount: PathBuf,
        block_size: u64,
        part_size: u64,
        manifests: Manifests,
    ) -> Self {
        Self {
            targets: Targets::new(sources, mount, None),
            manifests,
            block_size,
            part_blocks: (part_size / block_size.max(1)).max(1),
            jobs: Mutex::new(History::default()),
            next: AtomicU64::new(1),
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
        }
    }

    /// The manifest loader this sealer keeps up to date.
    pub fn manifests(&self) -> &Manifests {
        &self.manifests
    }

    /// Resolves the targets (a HEAD of every object pins its version) and starts sealing them
    /// in the background. Fails before reading anything when a target is wrong or names too
    /// many objects.
    pub async fn start(self: &Arc<Self>, targets: Vec<String>) -> Result<SealReport, SealError> {
        if targets.is_empty() {
            return Err(PrefetchError::BadTarget {
                target: String::new(),
                reason: "no targets given".into(),
            }
            .into());
        }
        let Resolved {
            objects: mut plan,
            unparsable_keys,
        } = self.targets.plan(&targets, None).await?;
        if plan.len() > MAX_SEAL_OBJECTS {
            return Err(SealError::TooManyObjects {
                objects: plan.len(),
                max: MAX_SEAL_OBJECTS,
            });
        }
        plan.sort_by(|(_, a), (_, b)| a.key.cmp(&b.key));
        // The plan's objects first: a seal task finds its object by its index in the plan.
        let skipped = unparsable_keys.into_iter().map(|key| SealedObject {
            manifest: manifest_key(&key),
            key,
            size: 0,
            state: SealState::Failed,
            error: Some(UNPARSABLE_KEY.to_owned()),
        });
        let objects = plan
            .iter()
            .map(|(_, version)| SealedObject {
                key: version.key.clone(),
                size: version.size,
                state: SealState::Pending,
                manifest: manifest_key(&version.key),
                error: None,
            })
            .chain(skipped)
            .collect();
        let job = Arc::new(SealJob {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            targets,
            planned: plan.iter().map(|(_, v)| v.size).sum(),
            hashed: AtomicU64::new(0),
            started: Instant::now(),
            outcome: Mutex::new((JobState::Running, None)),
            objects: Mutex::new(objects),
            cancel: self.shutdown.child_token(),
        });
        self.jobs.lock().jobs.insert(job.id, job.clone());
        tracing::info!(
            job = job.id,
            objects = plan.len(),
            planned = job.planned,
            "seal started"
        );
        let report = job.report();
        let sealer = self.clone();
        self.tasks.spawn(async move { sealer.run(job, plan).await });
        Ok(report)
    }

    async fn run(&self, job: Arc<SealJob>, plan: Vec<(Arc<Origin>, ObjectVersion)>) {
        let seals = futures::stream::iter(plan.into_iter().enumerate())
            .map(|(index, (origin, version))| {
                let job = &job;
                async move {
                    let result = self.seal(&origin, &version, job).await;
                    let mut objects = job.objects.lock();
                    let Some(object) = objects.get_mut(index) else {
                        return;
                    };
                    match result {
                        Ok(()) => object.state = SealState::Sealed,
                        Err(error) => {
                            tracing::warn!(job = job.id, source = origin.name(), key = version.key, %error, "cannot seal the object");
                            object.state = SealState::Failed;
                            object.error = Some(error.to_string());
                        }
                    }
                }
            })
            .buffer_unordered(SEAL_OBJECTS)
            .for_each(|()| futures::future::ready(()));
        let state = tokio::select! {
            biased;
            () = job.cancel.cancelled() => JobState::Cancelled,
            () = seals => {
                let objects = job.objects.lock();
                if objects.iter().all(|o| o.state == SealState::Sealed) { JobState::Done } else { JobState::Failed }
            }
        };
        *job.outcome.lock() = (state, Some(job.started.elapsed()));
        self.jobs.lock().finished(job.id);
        let report = job.report();
        let sealed = report
            .objects
            .iter()
            .filter(|o| o.state == SealState::Sealed)
            .count();
        tracing::info!(
            job = job.id,
            ?state,
            sealed,
            objects = report.objects.len(),
            seconds = report.elapsed_seconds,
            "seal ended"
        );
    }

    /// Reads `version` of an object of `origin` whole, hashes its blocks and writes its
    /// manifest.
    async fn seal(
        &self,
        origin: &Origin,
        version: &ObjectVersion,
        job: &SealJob,
    ) -> Result<(), ObjectSealError> {
        if version.etag.is_none() && version.version.is_none() {
            return Err(ObjectSealError::Unversioned);
        }
        let key = manifest_key(&version.key);
        if key.len() > MAX_KEY_LEN {
            return Err(ObjectSealError::KeyTooLong { manifest: key });
        }
        let hashes: Vec<Vec<[u8; 32]>> = futures::stream::iter(self.parts(version.size))
            .map(|range| async move {
                let len = range.end - range.start;
                let mut hasher = BlockHasher::new(self.block_size);
                let started = tokio::time::Instant::now();
                origin
                    .read_range(version, range, started, &mut |bytes: Bytes| hasher.update(&bytes))
                    .await?;
                job.hashed.fetch_add(len, Ordering::Relaxed);
                Ok::<_, OriginError>(hasher.finish())
            })
            .buffered(SEAL_PARTS)
            .try_collect()
            .await?;
        let manifest = Manifest::new(version, self.block_size, hashes.concat())?;
        origin.put(&key, Bytes::from(manifest.to_json())).await?;
        self.manifests.forget(version.id());
        Ok(())
    }

    /// The origin parts of an object of `size` bytes: whole blocks, the last part up to the end.
    fn parts(&self, size: u64) -> impl Iterator<Item = Range<u64>> + use<> {
        let part = self.part_blocks * self.block_size;
        (0..size.div_ceil(part)).map(move |i| i * part..((i + 1) * part).min(size))
    }

    /// A job's progress.
    pub fn report(&self, id: u64) -> Option<SealReport> {
        self.jobs.lock().jobs.get(&id).map(|job| job.report())
    }

    /// Cancels every job and waits until their tasks have ended. Manifests already written
    /// stay; the objects not sealed yet stay pending in the report.
    pub async fn shutdown(&self) {
        self.shutdown.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}
