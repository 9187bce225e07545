//! A node's read side over a real S3 server, built by the daemon's own [`Node::open`], with
//! fault injectors around the origin's store and the block store's I/O engine: the fixture
//! of the cache engine's integration tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::ffi::OsStr;

use bytes::Bytes;
use larder_cache_daemon::namespace::Namespace;
use larder_cache_daemon::node::Node;
use larder_config::{ByteSize, CacheConfig, Config, IoEngineKind, OriginConfig, SourceConfig};
use larder_engine as engine;
use larder_engine::fault::FaultyEngine;
use larder_fuse_mount::{FileTree, FsError, FsErrorKind, ROOT_INO};
use larder_origin::environment::Environment;
use larder_origin::{Origin, OriginError};
use larder_read_path::{Cache, OpenObject};
use larder_stats::Stats;
use larder_store as store;
use parking_lot::Mutex;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

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
            // Reads of complete files go through the daemon, as when the kernel cannot pass
            // them through: what these tests look at (passthrough has tests of its own).
            passthrough: false,
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

/// A node's read side over the server, built as the daemon builds it ([`Node::open`]: the
/// origin from the source's URL with its paged listings, the peer tier when members are
/// configured), with a [`FaultStore`] around the origin's store and a [`FaultyEngine`] under
/// the block store; files are opened and read through the namespace the mount serves, one
/// reader per open file.
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
    /// The node: its peers, to serve other fixtures.
    pub node: Node,
    /// The file tree the mount would serve.
    pub namespace: Arc<Namespace>,
    /// Stops the members' hellos and the peer listener.
    stop: CancellationToken,
    /// Cancels `stop` when the fixture is dropped.
    _stopped: DropGuard,
}

impl CacheFixture {
    /// Opens a cache on `config.cache.dir` over `server`.
    pub async fn open(server: Arc<S3Server>, config: Config) -> anyhow::Result<Self> {
        let endpoint = server.endpoint();
        Self::open_at(server, &endpoint, config).await
    }

    /// Like [`CacheFixture::open`], with the origin reached at `endpoint` (for example an
    /// address where nothing answers).
    pub async fn open_at(server: Arc<S3Server>, endpoint: &str, config: Config) -> anyhow::Result<Self> {
        config.validate()?;
        let env: Environment = [
            ("AWS_ENDPOINT_URL", endpoint),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", crate::ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", crate::SECRET_KEY),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect();
        let disk = FaultyEngine::new(engine::build(
            config.cache.io_engine,
            config.cache.io_queue_depth,
        )?);
        let faults = Mutex::new(None);
        let around = |origin: Origin| {
            origin.around(|store| {
                let wrapped = FaultStore::new(store);
                *faults.lock() = Some(wrapped.clone());
                wrapped
            })
        };
        let stop = CancellationToken::new();
        let node = Node::open(&config, disk.clone(), &env, around, &TaskTracker::new(), &stop).await?;
        let faults = faults
            .into_inner()
            .ok_or_else(|| anyhow::anyhow!("the source's origin has no store to wrap"))?;
        let origin = node.sources[0].1.origin.clone();
        Ok(Self {
            server,
            faults,
            origin,
            cache: node.cache.clone(),
            disk,
            stats: node.stats.clone(),
            namespace: Arc::new(node.namespace(config.cache.passthrough)),
            node,
            config,
            _stopped: stop.clone().drop_guard(),
            stop,
        })
    }

    /// Serves this node's blocks to rack members at `peer.listen` until the fixture is
    /// dropped, as the daemon does.
    pub async fn serve_peers(&self) -> anyhow::Result<()> {
        let address = self
            .config
            .peer
            .listen
            .ok_or_else(|| anyhow::anyhow!("peer.listen is not set"))?;
        let origins = self.node.origins().into_iter().collect();
        self.node
            .peers
            .serve(address, &self.cache, origins, &self.stats, self.stop.clone())
            .await?;
        Ok(())
    }

    /// The names a directory of the source lists, read as the kernel reads a directory:
    /// `readdir` from each offset on until an empty answer.
    pub async fn list(&self, dir: &str) -> Result<Vec<String>, FsError> {
        let mut ino = ROOT_INO;
        for name in dir.split('/').filter(|name| !name.is_empty()) {
            ino = self.namespace.lookup(ino, OsStr::new(name)).await?.ino;
        }
        let fh = self.namespace.opendir(ino).await?;
        let mut names = Vec::new();
        loop {
            let entries = self.namespace.readdir(fh, names.len() as u64).await?;
            if entries.is_empty() {
                break;
            }
            names.extend(entries.into_iter().map(|e| e.name.to_string_lossy().into_owned()));
        }
        self.namespace.releasedir(fh).await;
        Ok(names)
    }

    /// Waits for background writes, drops the cache (releasing the cache dir) and opens a new
    /// one on the same dir: a daemon restart.
    pub async fn restart(self) -> anyhow::Result<Self> {
        self.cache.flush().await;
        let Self {
            server,
            config,
            cache,
            node,
            namespace,
            ..
        } = self;
        drop((cache, node, namespace));
        Self::open(server, config).await
    }

    /// Pins the current version of `key` with a HEAD of its own, to look at it (its id, size,
    /// files); reads go through [`CacheFixture::open_file`].
    pub async fn open_object(&self, key: &str) -> anyhow::Result<Arc<OpenObject>> {
        let version = self.origin.head(key).await?;
        Ok(OpenObject::new(self.origin.clone(), version))
    }

    /// Opens `key` as a process opens a file under the mount: a lookup of each name on its
    /// path, then an open, which pins the version.
    pub async fn open_file(&self, key: &str) -> Result<File, FsError> {
        let (mut ino, mut size) = (ROOT_INO, 0);
        for name in key.split('/') {
            let attr = self.namespace.lookup(ino, OsStr::new(name)).await?;
            (ino, size) = (attr.ino, attr.size);
        }
        let opened = self.namespace.open(ino).await?;
        // The kernel reads a file it is offered straight from the cache's data file.
        if opened.backing.is_some() {
            self.namespace.passed_through(opened.fh);
        }
        Ok(File {
            namespace: self.namespace.clone(),
            fh: opened.fh,
            backing: opened.backing,
            size,
        })
    }

    /// Reads `len` bytes at `offset` of an object as one read on a file of its own, opened,
    /// read once and closed.
    pub async fn read(&self, object: &OpenObject, offset: u64, len: usize) -> Result<Bytes, FsError> {
        self.open_file(&object.version().key)
            .await?
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

    /// Reads a whole object in 1 MiB requests through one open file (readahead on).
    pub async fn read_all(&self, object: &OpenObject) -> Result<Vec<u8>, FsError> {
        self.open_file(&object.version().key).await?.read_all().await
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

/// A file open on a fixture's namespace: one handle, one reader, closed when dropped. A file
/// the namespace offered for passthrough is read from the data file it gave, as the kernel
/// reads it.
#[derive(Debug)]
pub struct File {
    namespace: Arc<Namespace>,
    fh: u64,
    backing: Option<std::fs::File>,
    /// The size the lookup gave: where the kernel stops reading a file passed through.
    size: u64,
}

impl File {
    /// Reads `len` bytes at `offset` (fewer at the end of the file).
    pub async fn read(&self, offset: u64, len: usize) -> Result<Bytes, FsError> {
        if let Some(backing) = &self.backing {
            let len = len.min(self.size.saturating_sub(offset) as usize);
            let mut bytes = vec![0; len];
            let mut read = 0;
            while read < len {
                match std::os::unix::fs::FileExt::read_at(backing, &mut bytes[read..], offset + read as u64) {
                    Ok(0) => break,
                    Ok(n) => read += n,
                    Err(error) => return Err(FsError::new(FsErrorKind::Io, error)),
                }
            }
            bytes.truncate(read);
            return Ok(Bytes::from(bytes));
        }
        let len = u32::try_from(len).expect("a read of less than 4 GiB, as the kernel sends");
        self.namespace.read(self.fh, offset, len).await
    }

    /// Whether the namespace offered the file for passthrough: the kernel would read the data
    /// file itself.
    pub fn passed_through(&self) -> bool {
        self.backing.is_some()
    }

    /// Reads `len` bytes at `offset` if they can be answered at once, as on a FUSE thread
    /// (blocks in memory, or small reads of verified blocks on disk); `None` sends the read
    /// on to [`File::read`].
    pub fn read_now(&self, offset: u64, len: usize) -> Option<Bytes> {
        let len = u32::try_from(len).ok().filter(|_| self.backing.is_none())?;
        self.namespace.read_now(self.fh, offset, len)
    }

    /// Reads the whole file in 1 MiB requests.
    pub async fn read_all(&self) -> Result<Vec<u8>, FsError> {
        let mut out = Vec::new();
        loop {
            let bytes = self.read(out.len() as u64, 1 << 20).await?;
            if bytes.is_empty() {
                return Ok(out);
            }
            out.extend_from_slice(&bytes);
        }
    }
}

impl Drop for File {
    fn drop(&mut self) {
        // The release only forgets the handle; it awaits nothing.
        futures::executor::block_on(self.namespace.release(self.fh));
    }
}

/// The origin's error behind a read's failure, if the origin failed it.
pub fn origin_error(error: &FsError) -> Option<&OriginError> {
    std::error::Error::source(error)?
        .downcast_ref::<Arc<OriginError>>()
        .map(|origin| &**origin)
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
