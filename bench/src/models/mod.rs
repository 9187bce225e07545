//! `larder-bench models`: the loaders inference engines run, with the real `safetensors`
//! library, on a generated transformer-shaped model, through Larder, rclone and s3fs-fuse
//! (mounted as `larder-bench mount` mounts them), each cold, warm after a restart, and again.
//!
//! The Python script `bench/models/loaders.py` writes the model (one file, and the same
//! tensors in 8 shards with their index) into the work dir, which is uploaded to SeaweedFS and
//! kept as the local copy. Every load is measured against a reference in the same round: a
//! cold load against the raw parallel download of the model's files, a warm one against the
//! same loader on the local copy with the page cache dropped. Within a round each loader runs
//! cold for the reference and every system, then warm likewise.

mod loaders;
mod report;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use larder_config::OriginConfig;
use object_store::ObjectStore;
use tokio::runtime::Handle;

use crate::ModelsArgs;
use crate::common::{drop_page_cache, publish, raw_download_all};
use crate::mount::OriginKind;
use crate::mount::Sample;
use crate::mount::measure::measure;
use crate::mount::origin::Origin;
use crate::mount::report::Run;
use crate::mount::run_log::RunLog;
use crate::mount::systems::{self, Setup, System, WarmRun};
use crate::mount::workloads::Work;
use loaders::{Loader, Model, Python};

const BUCKET: &str = "larder-bench";

/// When a load runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    /// Cache wiped, page cache dropped, mount started.
    Cold,
    /// The mount restarted on the cache the cold load filled, page cache dropped.
    Warm,
    /// Page cache dropped, the same mount: for Larder, passed through to its data file.
    Again,
}

impl Phase {
    pub(crate) const ALL: [Phase; 3] = [Phase::Cold, Phase::Warm, Phase::Again];

    /// Its name in the report's tables.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Phase::Cold => "cold",
            Phase::Warm => "warm, first load",
            Phase::Again => "warm, again",
        }
    }
}

/// Every figure of one round.
pub(crate) type Round = BTreeMap<(Loader, Phase, System), Sample>;

/// Samples of one run of a loader on one system (or a reference), or why it failed.
type Outcome = anyhow::Result<Vec<(Phase, System, Sample)>>;

/// The running origin and what every load needs.
struct Bench<'a> {
    runtime: &'a Handle,
    origin: Origin,
    /// A client of the bucket through the proxy, for the downloads.
    client: Arc<dyn ObjectStore>,
    setups: Vec<Setup>,
    python: Python,
    /// The generated models (the local copy); the bucket holds the same tree.
    local: PathBuf,
    /// Every file of the models: its key and size.
    files: BTreeMap<String, u64>,
    shape: loaders::Shape,
}

pub(crate) fn run(args: ModelsArgs, runtime: &Handle) -> anyhow::Result<()> {
    anyhow::ensure!(args.rounds > 0, "--rounds must be positive");
    anyhow::ensure!(args.size.as_u64() >= 1 << 20, "--size must be at least 1MiB");
    let python = Python::new(args.python.clone())?;
    std::fs::create_dir_all(&args.work_dir)?;
    // Everything below goes when the run ends (mounts are stopped before).
    let work = tempfile::Builder::new()
        .prefix("models-")
        .tempdir_in(&args.work_dir)?;
    let mut log = RunLog::start();
    let origin = runtime.block_on(Origin::start(OriginKind::S3, &args.systems.weed, BUCKET))?;
    let setups = systems::setups(&args.systems, true, work.path())?;
    let local = work.path().join("local");
    let shape = python.generate(&local, args.size.as_u64())?;
    log.progress(&format!(
        "generated a model of {} tensors in {} layers ({} bytes of tensors), in one file and in 8 shards",
        shape.tensors, shape.layers, shape.tensor_bytes
    ));
    let files = runtime.block_on(upload(&origin, &local))?;
    log.progress("uploaded it");
    let client = origin.client(BUCKET)?;
    let bench = Bench {
        runtime,
        origin,
        client,
        setups,
        python,
        local,
        files,
        shape,
    };
    let dropped = drop_page_cache();
    let rounds = log.rounds(args.rounds, |number, log| bench.round(number, log));
    let report = report::render(&report::Context {
        args: &args,
        shape: &bench.shape,
        model_bytes: Model::ALL.map(|model| (model, bench.model_bytes(model))),
        safetensors: bench.python.safetensors_version(),
        rounds: &rounds,
        run: Run::new(&bench.setups, &log, dropped, bench.origin.name()),
    });
    publish(&report, args.out.as_deref())?;
    log.finish()
}

/// Uploads every file of the models under `local` to the same key (`single/…`,
/// `sharded/…`), not through the proxy; returns each key with its size.
async fn upload(origin: &Origin, local: &Path) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut files = BTreeMap::new();
    for model in Model::ALL {
        for entry in std::fs::read_dir(local.join(model.dir()))? {
            let entry = entry?;
            let name = entry.file_name();
            let key = format!("{}/{}", model.dir(), name.to_string_lossy());
            origin.put_file(&key, &entry.path()).await?;
            files.insert(key, entry.metadata()?.len());
        }
    }
    Ok(files)
}

impl Bench<'_> {
    /// The keys and sizes of `model`'s files.
    fn files_of(&self, model: Model) -> impl Iterator<Item = (&str, u64)> {
        let prefix = format!("{}/", model.dir());
        self.files
            .iter()
            .filter(move |(key, _)| key.starts_with(&prefix))
            .map(|(key, &size)| (key.as_str(), size))
    }

    /// The bytes of `model`'s files: what a load of it reads, and the GiB its figures are per.
    fn model_bytes(&self, model: Model) -> u64 {
        self.files_of(model).map(|(_, size)| size).sum()
    }

    /// Runs `work` and measures what it cost the process `pid` (if any) and the origin.
    fn measure(
        &self,
        pid: Option<u32>,
        work: impl FnOnce() -> anyhow::Result<Work>,
    ) -> anyhow::Result<Sample> {
        let size_of = |path: &str| self.files.get(self.origin.key_of(path, BUCKET)?).copied();
        let (work, cost) = measure(&self.origin, pid, size_of, work)?;
        Ok(Sample { work, cost })
    }

    /// Loads the model `loader` reads from the tree at `root` and checks that it loaded every
    /// tensor: all of each, or each rank its part.
    fn load(&self, loader: Loader, root: &Path) -> anyhow::Result<Work> {
        let loaded = self.python.load(loader, root)?;
        anyhow::ensure!(
            loaded.tensors == self.shape.tensors,
            "{} loaded {} of {} tensors",
            loader.name(),
            loaded.tensors,
            self.shape.tensors
        );
        // Ranks each load the whole of every 1-D tensor, so their parts add up to more.
        anyhow::ensure!(
            loaded.bytes >= self.shape.tensor_bytes,
            "{} loaded {} of {} bytes of tensors",
            loader.name(),
            loaded.bytes,
            self.shape.tensor_bytes
        );
        Ok(Work {
            elapsed: loaded.elapsed,
            bytes: self.model_bytes(loader.model()),
            ops: loaded.tensors,
            reader_cpu: Some(loaded.cpu),
            latency: None,
        })
    }

    /// One round: each loader cold, for the reference and then each system, then warm likewise.
    fn round(&self, number: usize, log: &mut RunLog) -> Round {
        let mut round = Round::new();
        for loader in Loader::ALL {
            // `run` names whose run the outcome is, for a failure.
            let mut record = |run: System, outcome: Outcome| {
                for (phase, system, sample) in log
                    .outcome(number, run, &self.setups, outcome)
                    .unwrap_or_default()
                {
                    log.progress(&format!(
                        "round {}: {} {}, {}: {:.2} s",
                        number + 1,
                        system.name(),
                        loader.name(),
                        phase.name(),
                        sample.work.elapsed.as_secs_f64()
                    ));
                    round.insert((loader, phase, system), sample);
                }
            };
            record(System::Limit, self.download(loader));
            for setup in &self.setups {
                record(setup.system, self.cold(setup, loader));
            }
            record(System::Limit, self.warm(None, loader));
            for setup in &self.setups {
                record(setup.system, self.warm(Some(setup), loader));
            }
        }
        round
    }

    /// The reference of a cold load: a raw parallel download of the model's files with
    /// Larder's origin settings.
    fn download(&self, loader: Loader) -> Outcome {
        let model = loader.model();
        let objects: Vec<(&str, u64)> = self.files_of(model).collect();
        let origin = OriginConfig::default();
        let part = origin.part_size.as_u64();
        let sample = self.measure(None, || {
            let elapsed =
                self.runtime
                    .block_on(raw_download_all(&self.client, &objects, part, origin.concurrency))?;
            Ok(Work {
                elapsed,
                bytes: self.model_bytes(model),
                ops: objects.iter().map(|&(_, size)| size.div_ceil(part)).sum(),
                reader_cpu: None,
                latency: None,
            })
        })?;
        Ok(vec![(Phase::Cold, System::Limit, sample)])
    }

    /// A cold load through `setup`'s fresh mount, then a check of every byte of the model
    /// through it against the local copy.
    fn cold(&self, setup: &Setup, loader: Loader) -> Outcome {
        let mount = setup.start_cold(&self.origin)?;
        let root = setup.mount_dir();
        let sample = self.measure(mount.pid(), || self.load(loader, &root))?;
        let model = loader.model();
        self.python.check(model, &root, &self.local)?;
        // The warm load restarts the system on this cache: let it record what it holds.
        for (key, size) in self.files_of(model) {
            setup.settle(key, size)?;
        }
        mount.stop()?;
        Ok(vec![(Phase::Cold, setup.system, sample)])
    }

    /// Two loads, each after dropping the page cache: of the system restarted on the cache
    /// its cold load filled (the first load after the start, then the load again), or (`None`)
    /// of the local copy, their reference.
    fn warm(&self, setup: Option<&Setup>, loader: Loader) -> Outcome {
        let run = WarmRun::start(setup, &self.origin)?;
        let root = setup.map_or(self.local.clone(), Setup::mount_dir);
        let mut samples = Vec::new();
        for phase in [Phase::Warm, Phase::Again] {
            drop_page_cache();
            let sample = self.measure(run.pid(), || self.load(loader, &root))?;
            samples.push((phase, run.system, sample));
        }
        run.stop()?;
        Ok(samples)
    }
}
