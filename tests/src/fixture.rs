//! A block cache over a real S3 server with a fault-injecting origin: the fixture of the
//! cache engine's integration tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use larder_config::{ByteSize, CacheConfig, Config, IoEngineKind, OriginConfig, SourceConfig};
use larder_engine as engine;
use larder_engine::fault::FaultyEngine;
use larder_origin::Origin;
use larder_read_path::{Cache, OpenObject, ReadError, Reader};
use larder_stats::Stats;
use larder_store::{self as store, BlockStore};
use object_store::ObjectStore;

use crate::{FaultStore, S3Server};

/// A test configuration: a small cache in `dir`, fast retries, short deadlines.
pub fn test_config(dir: &Path, block_size: u64, engine: IoEngineKind, url: &str) -> Config {
    Config {
        cache: CacheConfig {
            dir: dir.to_owned(),
            capacity: ByteSize::gib(4),
            min_free_fraction: 0.0,
            block_size: ByteSize(block_size),
            io_engine: engine,
            // A small budget, so that the tests run the read path under it.
            memory_limit: ByteSize(16 * block_size),
            ..CacheConfig::default()
        },
        origin: OriginConfig {
            part_size: ByteSize(block_size * 4),
            backoff_base: std::time::Duration::from_millis(5),
            backoff_max: std::time::Duration::from_millis(50),
            request_timeout: std::time::Duration::from_secs(5),
            read_deadline: std::time::Duration::from_secs(20),
            ..OriginConfig::default()
        },
        sources: vec![SourceConfig::new("models", url)],
        ..Config::default()
    }
}

/// One cache (block store + fill path) over the server, through a [`FaultStore`].
#[derive(Debug)]
pub struct CacheFixture {
    /// The S3 bucket's server.
    pub server: Arc<S3Server>,
    /// The origin's store, for faults and the request log.
    pub faults: Arc<FaultStore>,
    /// The origin.
    pub origin: Arc<Origin>,
    /// The cache under test.
    pub cache: Cache,
    /// The block store's I/O engine (the configured one, wrapped): for disk faults and counts.
    pub disk: Arc<FaultyEngine>,
    /// Its counters.
    pub stats: Arc<Stats>,
    /// The configuration it runs with.
    pub config: Config,
}

impl CacheFixture {
    /// Opens a cache on `config.cache.dir` over `server`.
    pub async fn open(server: Arc<S3Server>, config: Config) -> anyhow::Result<Self> {
        let client = server.client()?;
        Self::open_with_client(server, client, config).await
    }

    /// Like [`CacheFixture::open`], with the origin reached through `client` (for example a
    /// client of an address where nothing answers).
    pub async fn open_with_client(
        server: Arc<S3Server>,
        client: Arc<dyn ObjectStore>,
        config: Config,
    ) -> anyhow::Result<Self> {
        config.validate()?;
        let stats = Arc::new(Stats::default());
        let faults = FaultStore::new(client);
        let origin = Arc::new(Origin::new(
            "models",
            &server.url(),
            faults.clone(),
            Default::default(),
            &config.origin,
            stats.origin.clone(),
        ));
        let disk = FaultyEngine::new(engine::build(
            config.cache.io_engine,
            config.cache.io_queue_depth,
        )?);
        let store = Arc::new(BlockStore::open(&config.cache, disk.clone(), stats.store.clone()).await?);
        let cache = Cache::new(store, &config.origin, config.cache.memory_limit, &stats, None);
        Ok(Self {
            server,
            faults,
            origin,
            cache,
            disk,
            stats,
            config,
        })
    }

    /// Waits for background writes, drops the cache (releasing the cache dir) and opens a new
    /// one on the same dir: a daemon restart.
    pub async fn restart(self) -> anyhow::Result<Self> {
        self.cache.flush().await;
        let Self {
            server,
            config,
            cache,
            ..
        } = self;
        drop(cache);
        Self::open(server, config).await
    }

    /// Pins the current version of `key`, as `open` does.
    pub async fn open_object(&self, key: &str) -> anyhow::Result<Arc<OpenObject>> {
        let version = self.origin.head(key).await?;
        Ok(OpenObject::new(self.origin.clone(), version))
    }

    /// Reads `len` bytes at `offset` of an open object through a reader of its own, as one
    /// read on a fresh file handle.
    pub async fn read(&self, object: &Arc<OpenObject>, offset: u64, len: usize) -> Result<Bytes, ReadError> {
        Reader::new(self.cache.clone(), object.clone())
            .read(offset, len)
            .await
    }

    /// Data files under the cache dir.
    pub fn data_files(&self) -> Vec<PathBuf> {
        files_with_extension(&self.config.cache.dir, "data")
    }

    /// The data file of an open object.
    pub fn data_file(&self, object: &OpenObject) -> PathBuf {
        store::object_paths(&self.config.cache.dir, object.version().id()).0
    }

    /// Reads a whole object in 1 MiB requests through a [`Reader`] (readahead on).
    pub async fn read_all(&self, object: &Arc<OpenObject>) -> Result<Vec<u8>, ReadError> {
        let reader = Reader::new(self.cache.clone(), object.clone());
        let mut out = Vec::with_capacity(object.version().size as usize);
        while (out.len() as u64) < object.version().size {
            out.extend_from_slice(&reader.read(out.len() as u64, 1 << 20).await?);
        }
        Ok(out)
    }

    /// How many times each block of `object` was requested from the origin, by GET ranges.
    pub fn block_fetch_counts(&self, object: &OpenObject) -> Vec<usize> {
        let block_size = self.config.cache.block_size.as_u64();
        let blocks = object.version().size.div_ceil(block_size) as usize;
        let mut counts = vec![0; blocks];
        for get in self.faults.gets() {
            if get.path != object.version().key {
                continue;
            }
            let Some(range) = get.range else { continue };
            let first = (range.start / block_size) as usize;
            let last = ((range.end - 1) / block_size) as usize;
            for count in &mut counts[first..=last.min(blocks - 1)] {
                *count += 1;
            }
        }
        counts
    }
}

/// Every file under `dir` (recursively) whose extension is `ext`.
pub fn files_with_extension(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == ext) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Bytes the files allocate on disk (holes excluded).
pub fn allocated_bytes(files: &[PathBuf]) -> u64 {
    use std::os::unix::fs::MetadataExt;
    files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}
