//! `larder-bench mount`: Larder, rclone and s3fs-fuse through real kernel mounts of one
//! bucket on loopback (SeaweedFS over S3; `--origin gcs|azure` for the emulators of GCS and
//! Azure, read by Larder alone), each workload against its limit, in interleaved rounds.
//!
//! All systems, and the raw download, reach the store through one `RecordingProxy`; the
//! stretch of its log that a workload adds gives the origin requests and bytes it cost. Within
//! a round each workload runs for the limit first, then Larder, rclone and s3fs, so ratios
//! are taken between runs minutes apart at most. One limit is measured inside Larder's run:
//! that of the second warm read, Larder's own data file read right after it.

pub(crate) mod measure;
pub(crate) mod origin;
pub(crate) mod report;
pub(crate) mod run_log;
pub(crate) mod systems;
pub(crate) mod workloads;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use larder_config::OriginConfig;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt};
use tokio::runtime::Handle;

use crate::MountArgs;
use crate::common::{drop_page_cache, publish, raw_download};
use measure::Cost;
use origin::Origin;
pub(crate) use origin::OriginKind;
use run_log::RunLog;
use systems::{Setup, System, WarmRun};
use workloads::Work;

const BUCKET: &str = "larder-bench";
/// The large file, at the root of every mount.
const BIG_KEY: &str = "model.safetensors";
/// The directory of the small files.
const SMALL_DIR: &str = "small";
/// The directory of the files of the many-readers workload, one per reader.
const MANY_DIR: &str = "many";
/// Random reads: (request size, requests) of the two random workloads.
const RANDOM_SMALL: (u64, u64) = (4 << 10, 1024);
const RANDOM_LARGE: (u64, u64) = (1 << 20, 128);
/// Uploads of the small files in flight.
const UPLOADS: usize = 16;
/// Uploads of the many readers' files in flight (each a multipart upload holding its parts).
const MANY_UPLOADS: usize = 4;

/// What is measured; each has a limit measured in the same round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Workload {
    Cold,
    Warm,
    WarmAgain,
    PageCache,
    Mmap,
    Random4k,
    Random1m,
    SmallFiles,
    Readers,
    ManyFiles,
}

impl Workload {
    pub(crate) const ALL: [Workload; 10] = [
        Workload::Cold,
        Workload::Warm,
        Workload::WarmAgain,
        Workload::PageCache,
        Workload::Mmap,
        Workload::Random4k,
        Workload::Random1m,
        Workload::SmallFiles,
        Workload::Readers,
        Workload::ManyFiles,
    ];
}

/// One system's figures for one workload in one round.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) work: Work,
    pub(crate) cost: Cost,
}

/// Every figure of one round.
pub(crate) type Round = BTreeMap<(Workload, System), Sample>;

/// Workload results of one run, each with the system it measured, or why the run failed.
/// Larder's warm run also measures a limit: its own data file, read with the same history.
type Outcome = anyhow::Result<Vec<(Workload, System, Sample)>>;

/// The running origin and what every workload needs.
struct Bench<'a> {
    args: &'a MountArgs,
    runtime: &'a Handle,
    origin: Origin,
    /// A client of the bucket through the proxy, for the limits.
    client: Arc<dyn ObjectStore>,
    setups: Vec<Setup>,
    /// A local copy of the large file.
    local: PathBuf,
    seed: u64,
}

pub(crate) fn run(args: MountArgs, runtime: &Handle) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rounds > 0 && args.readers > 0,
        "--rounds and --readers must be positive"
    );
    anyhow::ensure!(args.size.as_u64() >= 1 << 20, "--size must be at least 1MiB");
    std::fs::create_dir_all(&args.work_dir)?;
    // Everything below goes when the run ends (mounts are stopped before).
    let work = tempfile::Builder::new()
        .prefix("mount-")
        .tempdir_in(&args.work_dir)?;
    let mut log = RunLog::start();
    let origin = runtime.block_on(Origin::start(args.origin, &args.systems.weed, BUCKET))?;
    log.progress(&format!("{} is up", origin.name()));
    let setups = systems::setups(&args.systems, origin.is_s3(), work.path())?;
    let seed = larder_tests::seed(BIG_KEY, 0);
    runtime.block_on(upload(&args, &origin))?;
    log.progress(&format!(
        "uploaded {}, {} small files and {} files of {}",
        args.size, args.small_files, args.many_files, args.many_size
    ));
    let local = work.path().join("local").join(BIG_KEY);
    write_local_copy(&local, seed, args.size.as_u64())?;
    log.progress("wrote the local copy");
    let client = origin.client(BUCKET)?;
    let bench = Bench {
        args: &args,
        runtime,
        origin,
        client,
        setups,
        local,
        seed,
    };
    let dropped = drop_page_cache();
    let rounds = log.rounds(args.rounds, |number, log| bench.round(number, log));
    let report = report::render(&report::Context {
        args: &args,
        rounds: &rounds,
        run: report::Run::new(&bench.setups, &log, dropped, bench.origin.name()),
    });
    publish(&report, args.out.as_deref())?;
    log.finish()
}

/// The key of small file `i`.
fn small_key(i: usize) -> String {
    format!("{SMALL_DIR}/file-{i:05}")
}

/// The key of the many readers' file `i`.
fn many_key(i: usize) -> String {
    format!("{MANY_DIR}/file-{i:05}")
}

/// Puts the large object, the small ones and the many readers' files into the bucket (not
/// through the proxy).
async fn upload(args: &MountArgs, origin: &Origin) -> anyhow::Result<()> {
    origin.put(BIG_KEY, args.size.as_u64()).await?;
    let size = args.small_size.as_u64();
    futures::stream::iter(0..args.small_files)
        .map(|i| {
            let key = small_key(i);
            async move { origin.put(&key, size).await }
        })
        .buffer_unordered(UPLOADS)
        .try_for_each(|()| async { Ok(()) })
        .await?;
    let size = args.many_size.as_u64();
    futures::stream::iter(0..args.many_files)
        .map(|i| async move { origin.put(&many_key(i), size).await })
        .buffer_unordered(MANY_UPLOADS)
        .try_for_each(|()| async { Ok(()) })
        .await?;
    Ok(())
}

/// Writes the large object's bytes to `path`: the limit for reads from a local disk.
fn write_local_copy(path: &Path, seed: u64, size: u64) -> anyhow::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(path.parent().context("no parent")?)?;
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut offset = 0;
    while offset < size {
        let len = (size - offset).min(8 << 20);
        file.write_all(&larder_tests::content(seed, offset, len as usize))?;
        offset += len;
    }
    file.into_inner()?.sync_all()?;
    Ok(())
}

impl Bench<'_> {
    fn size(&self) -> u64 {
        self.args.size.as_u64()
    }

    /// The size of the object a request path (`/bucket/key`) names; None for listings.
    fn size_of(&self, path: &str) -> Option<u64> {
        let key = self.origin.key_of(path, BUCKET)?;
        if key == BIG_KEY {
            Some(self.size())
        } else if key.starts_with(&format!("{SMALL_DIR}/")) {
            Some(self.args.small_size.as_u64())
        } else if key.starts_with(&format!("{MANY_DIR}/")) {
            Some(self.args.many_size.as_u64())
        } else {
            None
        }
    }

    /// Runs `work` and measures what it cost the process `pid` (if any) and the origin.
    fn measure(
        &self,
        pid: Option<u32>,
        work: impl FnOnce() -> anyhow::Result<Work>,
    ) -> anyhow::Result<Sample> {
        let (work, cost) = measure::measure(&self.origin, pid, |path| self.size_of(path), work)?;
        Ok(Sample { work, cost })
    }

    /// One round: every workload, for the limit and then each system.
    fn round(&self, number: usize, log: &mut RunLog) -> Round {
        let mut round = Round::new();
        // `run` names whose run the outcome is, for a failure.
        let mut record = |run: System, outcome: Outcome| {
            for (workload, system, sample) in log
                .outcome(number, run, &self.setups, outcome)
                .unwrap_or_default()
            {
                log.progress(&format!(
                    "round {}: {} {}: {:.0} {}",
                    number + 1,
                    system.name(),
                    workload.name(),
                    sample.throughput(workload),
                    workload.unit()
                ));
                round.insert((workload, system), sample);
            }
        };
        record(System::Limit, self.limit_cold(Workload::Cold, 1));
        for setup in &self.setups {
            record(setup.system, self.cold(setup));
        }
        record(System::Limit, self.warm(None, number as u64));
        for setup in &self.setups {
            record(setup.system, self.warm(Some(setup), number as u64));
        }
        record(System::Limit, self.limit_small_files());
        for setup in &self.setups {
            record(setup.system, self.small_files(setup));
        }
        record(
            System::Limit,
            self.limit_cold(Workload::Readers, self.args.readers),
        );
        for setup in &self.setups {
            record(setup.system, self.readers(setup));
        }
        if self.args.many_files > 0 {
            record(System::Limit, self.limit_many_files());
            for setup in &self.setups {
                record(setup.system, self.many_files(setup));
            }
        }
        round
    }

    /// The limit of a cold read: a raw parallel download with Larder's origin settings, its
    /// bytes counted once per reader (all readers could be served from one download).
    fn limit_cold(&self, workload: Workload, readers: usize) -> Outcome {
        let origin = OriginConfig::default();
        let sample = self.measure(None, || {
            let elapsed = self.runtime.block_on(raw_download(
                &self.client,
                BIG_KEY,
                self.size(),
                origin.part_size.as_u64(),
                origin.concurrency,
            ))?;
            Ok(Work {
                elapsed,
                bytes: self.size() * readers as u64,
                ops: self.size().div_ceil(origin.part_size.as_u64()),
                reader_cpu: None,
                latency: None,
            })
        })?;
        Ok(vec![(workload, System::Limit, sample)])
    }

    fn cold(&self, setup: &Setup) -> Outcome {
        let mount = setup.start_cold(&self.origin)?;
        let path = setup.mount_dir().join(BIG_KEY);
        let sample = self.measure(mount.pid(), || workloads::sequential(&path, self.size()))?;
        workloads::check_content(&path, self.seed, self.size())?;
        // The warm read restarts the system on this cache: let it record what it holds.
        setup.settle(BIG_KEY, self.size())?;
        mount.stop()?;
        Ok(vec![(Workload::Cold, setup.system, sample)])
    }

    /// Random, warm, page-cache and mmap reads: of the system restarted on the cache its cold
    /// read filled, or (`None`) of the local copy. The random reads come first, while Larder
    /// has checked none of the blocks since its start; the first whole read checks them all,
    /// so the second one is passed through.
    ///
    /// The second whole read has no local-copy limit: a file last read with O_DIRECT (as the
    /// daemon reads its data file on the first warm read) reads slower buffered than one last
    /// read buffered. Its limit is Larder's data file itself, read right after it.
    fn warm(&self, setup: Option<&Setup>, seed: u64) -> Outcome {
        let run = WarmRun::start(setup, &self.origin)?;
        let (pid, system) = (run.pid(), run.system);
        let path = setup.map_or(self.local.clone(), |s| s.mount_dir().join(BIG_KEY));
        let size = self.size();
        let mut samples = Vec::new();
        for (workload, (len, count)) in [
            (Workload::Random4k, RANDOM_SMALL),
            (Workload::Random1m, RANDOM_LARGE),
        ] {
            drop_page_cache();
            let sample = self.measure(pid, || workloads::random(&path, size, len, count, seed))?;
            samples.push((workload, system, sample));
        }
        drop_page_cache();
        samples.push((
            Workload::Warm,
            system,
            self.measure(pid, || workloads::sequential(&path, size))?,
        ));
        if let Some(setup) = setup {
            drop_page_cache();
            samples.push((
                Workload::WarmAgain,
                system,
                self.measure(pid, || workloads::sequential(&path, size))?,
            ));
            if system == System::Larder {
                let data = setup.larder_data_file()?;
                drop_page_cache();
                samples.push((
                    Workload::WarmAgain,
                    System::Limit,
                    self.measure(None, || workloads::sequential(&data, size))?,
                ));
            }
        }
        samples.push((
            Workload::PageCache,
            system,
            self.measure(pid, || workloads::sequential(&path, size))?,
        ));
        drop_page_cache();
        samples.push((
            Workload::Mmap,
            system,
            self.measure(pid, || workloads::mapped(&path, size))?,
        ));
        run.stop()?;
        Ok(samples)
    }

    /// The limit of the small files: a listing, then a GET of each, `readers` at a time.
    fn limit_small_files(&self) -> Outcome {
        let sample = self.measure(None, || {
            let started = Instant::now();
            let bytes = self.runtime.block_on(async {
                let prefix = StorePath::from(SMALL_DIR);
                let listed: Vec<_> = self.client.list(Some(&prefix)).try_collect().await?;
                anyhow::ensure!(listed.len() == self.args.small_files, "listed {}", listed.len());
                let sizes: Vec<usize> = futures::stream::iter(listed)
                    .map(|meta| async move {
                        Ok::<_, object_store::Error>(
                            self.client.get(&meta.location).await?.bytes().await?.len(),
                        )
                    })
                    .buffer_unordered(self.args.readers)
                    .try_collect()
                    .await?;
                Ok(sizes.iter().sum::<usize>() as u64)
            })?;
            Ok(Work {
                elapsed: started.elapsed(),
                bytes,
                ops: self.args.small_files as u64,
                reader_cpu: None,
                latency: None,
            })
        })?;
        Ok(vec![(Workload::SmallFiles, System::Limit, sample)])
    }

    fn small_files(&self, setup: &Setup) -> Outcome {
        let mount = setup.start_cold(&self.origin)?;
        let dir = setup.mount_dir().join(SMALL_DIR);
        let sample = self.measure(mount.pid(), || {
            workloads::small_files(
                &dir,
                self.args.small_files,
                self.args.small_size.as_u64(),
                self.args.readers,
            )
        })?;
        mount.stop()?;
        Ok(vec![(Workload::SmallFiles, setup.system, sample)])
    }

    fn readers(&self, setup: &Setup) -> Outcome {
        let mount = setup.start_cold(&self.origin)?;
        let path = setup.mount_dir().join(BIG_KEY);
        let sample = self.measure(mount.pid(), || {
            workloads::concurrent(&path, self.size(), self.args.readers)
        })?;
        mount.stop()?;
        Ok(vec![(Workload::Readers, setup.system, sample)])
    }

    /// The limit of the many readers: a GET of each whole object, all at once, each body
    /// counted as it arrives and not kept.
    fn limit_many_files(&self) -> Outcome {
        let files = self.args.many_files;
        let sample = self.measure(None, || {
            let started = Instant::now();
            let bytes = self.runtime.block_on(async {
                let sizes: Vec<u64> = futures::stream::iter(0..files)
                    .map(|i| async move {
                        let body = self.client.get(&StorePath::from(many_key(i))).await?;
                        body.into_stream()
                            .try_fold(0, |n, chunk| async move { Ok(n + chunk.len() as u64) })
                            .await
                    })
                    .buffer_unordered(files)
                    .try_collect()
                    .await?;
                anyhow::Ok(sizes.iter().sum::<u64>())
            })?;
            let expected = files as u64 * self.args.many_size.as_u64();
            anyhow::ensure!(bytes == expected, "downloaded {bytes} of {expected} bytes");
            Ok(Work {
                elapsed: started.elapsed(),
                bytes,
                ops: files as u64,
                reader_cpu: None,
                latency: None,
            })
        })?;
        Ok(vec![(Workload::ManyFiles, System::Limit, sample)])
    }

    fn many_files(&self, setup: &Setup) -> Outcome {
        let mount = setup.start_cold(&self.origin)?;
        let paths: Vec<PathBuf> = (0..self.args.many_files)
            .map(|i| setup.mount_dir().join(many_key(i)))
            .collect();
        let size = self.args.many_size.as_u64();
        let sample = self.measure(mount.pid(), || workloads::many_files(&paths, size))?;
        for (i, path) in paths.iter().enumerate() {
            workloads::check_content(path, larder_tests::seed(&many_key(i), 0), size)?;
        }
        mount.stop()?;
        Ok(vec![(Workload::ManyFiles, setup.system, sample)])
    }
}
