//! The engine benchmark: cold fill, prefetch, warm read and restart, in interleaved rounds.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use larder_cache_daemon::prefetch::{JobState, Jobs, PREFETCH_PARTS};
use larder_config::{ByteSize, CacheConfig, IoEngineKind, OriginConfig};
use larder_engine as engine;
use larder_object::ObjectVersion;
use larder_origin::Origin;
use larder_read_path::{Cache, OpenObject, Reader};
use larder_stats::{OriginStats, Stats, StoreStats};
use larder_store::format::{Entry, RecordHeader};
use larder_store::{self as store, BlockStore, Lookup};
use larder_tests::seaweed::Seaweed;
use object_store::ObjectStore;
use object_store::path::Path as StorePath;

use crate::EngineArgs;
use crate::common::{
    drop_page_cache, machine, peak_rss_mib, publish, raw_download, reset_peak_rss, summary,
    upload_with_retries,
};

const BUCKET: &str = "larder-bench";
const KEY: &str = "bench/model.safetensors";
const READ_SIZE: usize = 1 << 20;

fn cache_config(dir: &Path, args: &EngineArgs) -> CacheConfig {
    CacheConfig {
        dir: dir.to_owned(),
        capacity: ByteSize(args.size.as_u64() * 2),
        block_size: args.block_size,
        io_engine: IoEngineKind::Uring,
        ..CacheConfig::default()
    }
}

/// Starts a new peak-RSS measurement of this process; on failure the peak covers more.
fn reset_own_peak_rss() {
    reset_peak_rss(std::process::id());
}

/// Peak resident set size of this process since the last reset, in MiB (0 if unreadable).
fn own_peak_rss_mib() -> f64 {
    peak_rss_mib(std::process::id()).unwrap_or(0.0)
}

fn gib_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / (1u64 << 30) as f64
}

async fn open_cache(config: &CacheConfig, origin: &OriginConfig) -> anyhow::Result<Cache> {
    let stats = Arc::new(Stats::default());
    let engine = engine::build(config.io_engine, config.io_queue_depth)?;
    let store = Arc::new(BlockStore::open(config, engine, stats.store.clone()).await?);
    Ok(Cache::new(store, origin, config.memory_limit, &stats, None))
}

/// Reads the whole object through a reader in 1 MiB requests, as the FUSE layer will.
async fn read_through(cache: &Cache, object: &Arc<OpenObject>) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let reader = Reader::new(cache.clone(), object.clone());
    let mut offset = 0;
    while offset < object.version().size {
        offset += reader.read(offset, READ_SIZE).await?.len() as u64;
    }
    Ok(started.elapsed())
}

/// A prefetch job of the object into `cache`, from start to its last block written.
async fn prefetch_time(cache: &Cache, origin: &Arc<Origin>) -> anyhow::Result<Duration> {
    let sources = vec![("bench".to_owned(), origin.clone())];
    let jobs = Arc::new(Jobs::new(
        cache.clone(),
        sources,
        "/nowhere".into(),
        Arc::new(Stats::default()),
    ));
    let started = Instant::now();
    let id = jobs.start(vec![format!("bench:{KEY}")], false, None).await?.id;
    loop {
        let report = jobs.report(id).context("the job is gone")?;
        match report.state {
            JobState::Running => tokio::time::sleep(Duration::from_millis(2)).await,
            JobState::Done => return Ok(started.elapsed()),
            other => anyhow::bail!("the prefetch ended {other:?}: {:?}", report.errors),
        }
    }
}

/// The device's limit: the file read with O_DIRECT by `threads` threads, each taking every
/// `threads`-th chunk, as deep a queue as Larder's readahead keeps.
fn read_file_parallel(path: &Path, threads: u64, chunk: usize) -> anyhow::Result<Duration> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let file = Arc::new(file);
    let size = file.metadata()?.len();
    let started = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let file = file.clone();
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut buf = engine::AlignedBuf::new(chunk);
                let mut offset = t * chunk as u64;
                while offset < size {
                    file.read_at(buf.spare_mut(), offset)?;
                    offset += threads * chunk as u64;
                }
                Ok(())
            })
        })
        .collect();
    for worker in workers {
        worker
            .join()
            .map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
    }
    Ok(started.elapsed())
}

fn read_file(path: &Path) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut file = std::fs::File::open(path)?;
    let mut buf = vec![0u8; READ_SIZE];
    while file.read(&mut buf)? > 0 {}
    Ok(started.elapsed())
}

/// Writes a cache of `blocks` recorded blocks in objects of 1,000 blocks each, with sparse
/// data files whose holes hash like the recorded (all-zero) blocks.
fn synthesize_cache(dir: &Path, block_size: u64, blocks: u32) -> anyhow::Result<ObjectVersion> {
    let zero_hash = *blake3::hash(&vec![0u8; block_size as usize]).as_bytes();
    let per_object = 1000u32;
    let mut first = None;
    for object in 0..blocks.div_ceil(per_object) {
        let count = per_object.min(blocks - object * per_object);
        let version = ObjectVersion {
            origin_url: "s3://bench-restart".into(),
            key: format!("object-{object}"),
            etag: Some("\"synthetic\"".into()),
            version: None,
            size: u64::from(count) * block_size,
            modified: std::time::SystemTime::UNIX_EPOCH,
            content: None,
        };
        let (data, rec) = store::object_paths(dir, version.id());
        std::fs::create_dir_all(data.parent().context("no parent")?)?;
        std::fs::File::create(&data)?.set_len(version.size)?;
        let header = RecordHeader {
            block_size: block_size as u32,
            object_size: version.size,
            object_id: version.id(),
            identity: version.identity(),
        };
        let mut bytes = header.encode();
        for index in 0..count {
            bytes.extend_from_slice(
                &Entry::Present {
                    index,
                    hash: zero_hash,
                }
                .encode(),
            );
        }
        std::fs::write(rec, bytes)?;
        first.get_or_insert(version);
    }
    first.context("no blocks")
}

/// Time from opening the synthetic cache to its first verified hit.
async fn restart_time(config: &CacheConfig, version: &ObjectVersion) -> anyhow::Result<(Duration, usize)> {
    let started = Instant::now();
    let engine = engine::build(config.io_engine, config.io_queue_depth)?;
    let store = BlockStore::open(config, engine, Arc::new(StoreStats::default())).await?;
    let hit = store.read_block(version, version.id(), 0).await;
    let elapsed = started.elapsed();
    anyhow::ensure!(
        matches!(hit, Ok(Lookup::Hit(..))),
        "the synthetic cache did not serve its first block: {hit:?}"
    );
    Ok((elapsed, store.usage().blocks))
}

struct Round {
    raw: Duration,
    prefetch: Duration,
    cold: Duration,
    warm: Duration,
    direct: Duration,
    device: Duration,
    restart: Duration,
    /// Peak RSS (MiB) of the raw download, the cold read, the warm read.
    rss: [f64; 3],
}

pub(crate) async fn run(args: EngineArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.work_dir)?;
    let weed = Seaweed::start(&args.weed, BUCKET)?;
    let client: Arc<dyn ObjectStore> = larder_tests::s3_client(&weed.endpoint, BUCKET)?;
    let size = args.size.as_u64();
    upload_with_retries(client.as_ref(), KEY, size).await?;
    let origin_config = OriginConfig::default();
    let origin = Arc::new(Origin::new(
        "bench",
        &format!("s3://{BUCKET}"),
        client.clone(),
        StorePath::default(),
        &origin_config,
        Arc::new(OriginStats::default()),
    ));
    let object = OpenObject::new(origin.clone(), origin.head(KEY).await?);
    let restart_dir = tempfile::tempdir_in(&args.work_dir)?;
    let restart_config = cache_config(restart_dir.path(), &args);
    let restart_version =
        synthesize_cache(restart_dir.path(), args.block_size.as_u64(), args.restart_blocks)?;
    let dropped = drop_page_cache();

    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let cache_dir = tempfile::tempdir_in(&args.work_dir)?;
        let config = cache_config(cache_dir.path(), &args);
        reset_own_peak_rss();
        let raw = raw_download(
            &client,
            KEY,
            size,
            origin_config.part_size.as_u64(),
            origin_config.concurrency,
        )
        .await?;
        let raw_rss = own_peak_rss_mib();

        let prefetch_dir = tempfile::tempdir_in(&args.work_dir)?;
        let cache = open_cache(&cache_config(prefetch_dir.path(), &args), &origin_config).await?;
        let prefetch = prefetch_time(&cache, &origin).await?;
        drop(cache);
        drop(prefetch_dir);

        reset_own_peak_rss();
        let cache = open_cache(&config, &origin_config).await?;
        let cold = read_through(&cache, &object).await?;
        cache.flush().await;
        drop(cache);
        let cold_rss = own_peak_rss_mib();

        drop_page_cache();
        reset_own_peak_rss();
        let cache = open_cache(&config, &origin_config).await?;
        let warm = read_through(&cache, &object).await?;
        drop(cache);
        let warm_rss = own_peak_rss_mib();

        drop_page_cache();
        let (data_file, _) = store::object_paths(cache_dir.path(), object.version().id());
        let direct = read_file(&data_file)?;
        drop_page_cache();
        let device = read_file_parallel(&data_file, 8, args.block_size.as_u64() as usize)?;

        drop_page_cache();
        let (restart, blocks) = restart_time(&restart_config, &restart_version).await?;
        anyhow::ensure!(
            blocks == args.restart_blocks as usize,
            "restart saw {blocks} blocks"
        );
        eprintln!(
            "round {round}: raw {:.2} GiB/s, prefetch {:.2} GiB/s, cold {:.2} GiB/s, warm {:.2} GiB/s, direct {:.2} GiB/s, device {:.2} GiB/s, restart {:?}; peak RSS MiB raw {raw_rss:.0} cold {cold_rss:.0} warm {warm_rss:.0}",
            gib_per_s(size, raw),
            gib_per_s(size, prefetch),
            gib_per_s(size, cold),
            gib_per_s(size, warm),
            gib_per_s(size, direct),
            gib_per_s(size, device),
            restart
        );
        rounds.push(Round {
            raw,
            prefetch,
            cold,
            warm,
            direct,
            device,
            restart,
            rss: [raw_rss, cold_rss, warm_rss],
        });
    }
    let report = report(&args, &rounds, dropped);
    publish(&report, args.out.as_deref())?;
    Ok(())
}

fn report(args: &EngineArgs, rounds: &[Round], dropped: bool) -> String {
    let size = args.size.as_u64();
    let ratio = |f: &dyn Fn(&Round) -> f64| summary(rounds.iter().map(f).collect());
    let cold = ratio(&|r| r.raw.as_secs_f64() / r.cold.as_secs_f64());
    let prefetch = ratio(&|r| r.raw.as_secs_f64() / r.prefetch.as_secs_f64());
    let prefetch_abs = ratio(&|r| gib_per_s(size, r.prefetch));
    let warm = ratio(&|r| r.direct.as_secs_f64() / r.warm.as_secs_f64());
    let warm_device = ratio(&|r| r.device.as_secs_f64() / r.warm.as_secs_f64());
    let device_abs = ratio(&|r| gib_per_s(size, r.device));
    let cold_abs = ratio(&|r| gib_per_s(size, r.cold));
    let raw_abs = ratio(&|r| gib_per_s(size, r.raw));
    let warm_abs = ratio(&|r| gib_per_s(size, r.warm));
    let direct_abs = ratio(&|r| gib_per_s(size, r.direct));
    let restart = ratio(&|r| r.restart.as_secs_f64() * 1000.0);
    let fmt = |(m, lo, hi): (f64, f64, f64)| format!("{m:.2} ({lo:.2}–{hi:.2})");
    let rss = |i: usize| fmt(ratio(&|r| r.rss[i]));
    format!(
        "# Engine benchmark\n\n\
         {machine}\n\
         object {size_h}, block {block}, origin SeaweedFS on loopback (data on tmpfs), {rounds} rounds, \
         medians (min–max); page cache dropped between steps: {dropped}\n\n\
         | workload | Larder | reference | ratio |\n|---|---|---|---|\n\
         | cold sequential read (1 MiB reads) vs raw parallel download (16 × 16 MiB GETs) | {cold_abs} GiB/s | {raw_abs} GiB/s | {cold} |\n\
         | prefetch job into a cold cache ({parts} parts in flight, blocks written) vs raw parallel download | {prefetch_abs} GiB/s | {raw_abs} GiB/s | {prefetch} |\n\
         | warm read (restarted) vs reading the data file directly (buffered, 1 MiB reads) | {warm_abs} GiB/s | {direct_abs} GiB/s | {warm} |\n\
         | warm read (restarted) vs the device limit (8 threads of O_DIRECT block reads) | {warm_abs} GiB/s | {device_abs} GiB/s | {warm_device} |\n\
         | restart: open a cache of {blocks} blocks and serve the first hit | {restart} ms | — | — |\n\n\
         Peak RSS of the benchmark process (MiB): raw download {raw_rss}, cold read {cold_rss}, warm read {warm_rss}.\n",
        machine = machine(),
        size_h = args.size,
        block = args.block_size,
        rounds = rounds.len(),
        cold_abs = fmt(cold_abs),
        raw_abs = fmt(raw_abs),
        cold = fmt(cold),
        prefetch_abs = fmt(prefetch_abs),
        prefetch = fmt(prefetch),
        parts = PREFETCH_PARTS,
        warm_abs = fmt(warm_abs),
        direct_abs = fmt(direct_abs),
        warm = fmt(warm),
        device_abs = fmt(device_abs),
        warm_device = fmt(warm_device),
        restart = fmt(restart),
        blocks = args.restart_blocks,
        raw_rss = rss(0),
        cold_rss = rss(1),
        warm_rss = rss(2),
    )
}
