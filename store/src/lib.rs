//! The NVMe block store: blocks of object versions in sparse data files, a crash-safe record
//! of which blocks are present, capacity accounting and eviction.
//!
//! Layout under the cache dir (`0700` dirs, `0600` files, names are hashes, never keys):
//!
//! ```text
//! <cache dir>/lock                                   flock: one daemon per cache dir
//!                                                    (see held_dir.rs for a dir deleted under it)
//! <cache dir>/v1/objects/<id[0..2]>/<id>.data        blocks at their natural offsets
//! <cache dir>/v1/objects/<id[0..2]>/<id>.rec         header + append-only entries (format.rs)
//! <cache dir>/v1/objects/<id[0..2]>/<id>.values16k   each block's tree of 16 KiB groups (larder-block-tree)
//! ```
//!
//! The values file's name says the group size its values are for. The release before kept
//! values of 64 KiB groups in `<id>.values`: its files are removed at start like any other
//! unknown file, and a block's values are written again by the first read of part of it
//! (which checks the block whole).
//!
//! Invariants:
//! - A block is recorded present only after its bytes are written; a block is removed from the
//!   index and recorded removed before its hole is punched.
//! - Bytes in use (present blocks plus reservations, each rounded up to 4 KiB) never exceed the
//!   capacity, and a write never takes the filesystem below its minimum free fraction: space is
//!   reserved, and victims evicted, before a byte is written.
//! - A block read from disk is served only if the groups read, merged with the stored values
//!   of the subtrees beside them, give the BLAKE3 in the record (unless verification is off),
//!   and it was not evicted while being read. A block's tree is written before its `present`
//!   entry; a missing one costs a whole-block check, which writes it.
//!
//! Modules, one concern each (`impl BlockStore` is spread over them):
//! - `index.rs`: the in-memory index under the store's lock, and the questions asked of it;
//! - `read.rs`, `write.rs`: reads of blocks (checked) and writes (room reserved first);
//! - `evict.rs`: blocks taken out, by eviction or because they failed a check;
//! - `hold.rs`: pins, leases and holds, which keep blocks from eviction;
//! - `unsettled.rs`: blocks awaiting a check from outside the store;
//! - `files.rs`, `values.rs`, `replay.rs`: an object's files, its blocks' trees, and the
//!   records replayed at start (their format in `format.rs`);
//! - `held_dir.rs`: the cache dir; `policy.rs`: the eviction policy;
//! - `health.rs`: a failing disk and a lost cache dir; `scrub.rs`: every block read back and
//!   checked at a pace, so faults under files handed to the kernel are seen;
//! - `verified.rs`: [`VerifiedBlock`].

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod evict;
mod files;
pub mod format;
mod health;
mod held_dir;
mod hold;
mod index;
mod policy;
mod read;
mod replay;
mod scrub;
mod unsettled;
mod values;
mod verified;
mod write;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
pub use larder_block_tree::{GroupCheck, GroupHasher};
use larder_config::CacheConfig;
use larder_engine::IoEngine;
use larder_object::ObjectId;
use larder_stats::StoreStats;
use parking_lot::Mutex;

pub use files::object_paths;
use held_dir::HeldDir;
pub use hold::{BlockHold, Lease};
use index::State;
pub use index::{Removal, Usage};
pub use read::READ_NOW_MAX;
pub use scrub::{ScrubPass, Scrubbed};
pub use unsettled::UnsettledBlock;
pub use values::VALUES_EXTENSION;
pub use verified::{HashMismatch, VerifiedBlock};

/// Errors of the block store. None of them ever fails a read: the fill path counts them and
/// serves from the network.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// Another process holds the cache dir.
    #[error("cache dir {0} is in use by another larder process")]
    Locked(PathBuf),
    /// The cache dir was deleted or replaced while the daemon ran: it writes nothing more.
    #[error("cache dir {0} was deleted or replaced under the daemon; restart it to cache again")]
    DirLost(PathBuf),
    /// No room could be made without evicting pinned or in-use blocks.
    #[error("no room for a {bytes}-byte block: {reason}")]
    NoSpace {
        /// The block's size on disk.
        bytes: u64,
        /// What is short: the capacity or the file system's free space.
        reason: &'static str,
    },
    /// A block read back from disk was short or did not match its recorded BLAKE3.
    #[error("block {index} of object {id} on disk is {reason}")]
    Corrupt {
        /// The object.
        id: ObjectId,
        /// The block.
        index: u32,
        /// What was wrong with it.
        reason: &'static str,
    },
}

/// What a lookup of a block on disk found, when the disk answered.
#[derive(Debug)]
pub enum Lookup {
    /// The bytes asked for.
    Hit(Hit),
    /// The block is not in the store.
    Miss,
    /// The block was evicted or replaced while it was being read: look again.
    LostRace,
}

/// Bytes read from a block on disk.
#[derive(Debug, Clone)]
pub struct Hit {
    /// The bytes asked for, checked (or trusted: see [`BlockStore::read`]).
    pub bytes: Bytes,
    /// When and from where this process fetched the block, if it did.
    pub written: Option<Written>,
    /// The whole block's recorded BLAKE3, which the bytes were checked against: a caller
    /// that needs the block's hash takes it here rather than hashing the bytes again.
    pub hash: [u8; 32],
}

fn io_error<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Where a block this process fetched came from. The hit rate counts bytes by where they
/// came from when they were fetched for a read: a block fetched after a file was opened
/// (readahead, most often) is the origin's (or a member's) bytes to that open, not a hit,
/// though it is read from disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetched {
    /// From the object store.
    Origin,
    /// From a rack member.
    Peer,
}

/// When (the store's generation, see [`BlockStore::generation`]) and from where this process
/// fetched a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The generation the block was stored with.
    pub generation: u64,
    /// Where it came from.
    pub from: Fetched,
}

/// The block store. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct BlockStore {
    held: Arc<HeldDir>,
    engine: Arc<dyn IoEngine>,
    block_size: u64,
    capacity: u64,
    min_free_fraction: f64,
    verify: bool,
    state: Mutex<State>,
    stats: Arc<StoreStats>,
}

impl BlockStore {
    /// Opens (or creates) the store in `config.dir` and replays its records. Reads only the
    /// records, never the data files.
    pub async fn open(
        config: &CacheConfig,
        engine: Arc<dyn IoEngine>,
        stats: Arc<StoreStats>,
    ) -> Result<Self, StoreError> {
        let config = config.clone();
        let opened = tokio::task::spawn_blocking(move || Self::open_blocking(&config, engine, stats)).await;
        opened.unwrap_or_else(|e| {
            Err(StoreError::Io {
                op: "open",
                path: PathBuf::new(),
                source: io::Error::other(e),
            })
        })
    }

    fn open_blocking(
        config: &CacheConfig,
        engine: Arc<dyn IoEngine>,
        stats: Arc<StoreStats>,
    ) -> Result<Self, StoreError> {
        let store = Self {
            held: Arc::new(HeldDir::lock(&config.dir)?),
            engine,
            block_size: config.block_size.as_u64(),
            capacity: config.capacity.as_u64(),
            min_free_fraction: config.min_free_fraction,
            verify: config.verify_on_read,
            // The protected segment may hold 80% of the capacity.
            state: Mutex::new(State::new(config.capacity.as_u64() / 5 * 4)),
            stats,
        };
        store.replay_all()?;
        Ok(store)
    }

    /// The configured block size.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// The configured capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Length of block `index` of an object of `size` bytes.
    pub fn block_len(&self, size: u64, index: u32) -> u64 {
        let start = u64::from(index) * self.block_size;
        size.saturating_sub(start).min(self.block_size)
    }
}

/// Runs blocking filesystem work off the async workers.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| {
        Err(StoreError::Io {
            op: "run",
            path: PathBuf::new(),
            source: io::Error::other(e),
        })
    })
}
