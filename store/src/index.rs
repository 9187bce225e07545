//! The index: what the store holds, in memory, under one lock. Each object's state (its
//! blocks with their hash, generation and checks; its pin, leases and writers), the eviction
//! policy, the totals kept as they change, and the questions callers ask of it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use larder_object::ObjectId;
use tokio::sync::OnceCell;

use crate::files::ObjectFiles;
use crate::policy::Slru;
use crate::{BlockStore, Fetched};

/// Space use, for status and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Bytes of present blocks (each rounded up to 4 KiB).
    pub used: u64,
    /// Bytes reserved by writes in progress.
    pub reserved: u64,
    /// The configured capacity.
    pub capacity: u64,
    /// Objects with at least one block (or pinned).
    pub objects: usize,
    /// Blocks present.
    pub blocks: usize,
    /// Objects pinned (by prefetch jobs).
    pub pinned: usize,
    /// Bytes of the present blocks of pinned objects (each rounded up to 4 KiB).
    pub pinned_bytes: u64,
    /// The cache dir was deleted or replaced under the daemon, which gave it up.
    pub dir_lost: bool,
    /// The cache disk is taken to be failing (an I/O error of a block read or write, or of
    /// the probe before passthrough, or of the scrub; [`BlockStore::disk_failure`] says which),
    /// until a block write succeeds again or the disk answers a recheck
    /// ([`BlockStore::recheck_disk`]).
    pub disk_failing: bool,
}

pub(crate) type BlockKey = (ObjectId, u32);

#[derive(Debug, Clone)]
pub(crate) struct BlockMeta {
    pub(crate) hash: [u8; 32],
    /// Changes every time the block is (re)inserted, so a reader can tell whether the block it
    /// read is still the one in the index.
    pub(crate) generation: u64,
    /// Written by this process, or read back and checked since it started: what passthrough
    /// (which bypasses the checks on read) requires of every block of a file.
    pub(crate) verified: bool,
    /// Served to a reader since it was fetched (from memory before it was written, or from
    /// disk): a disk read then counts as a use again. A block fetched ahead and not yet read is
    /// not: its first disk read is its first use, and keeps it in probation.
    pub(crate) served: bool,
    /// Where this process fetched the block from (none for a replayed one).
    pub(crate) fetched: Option<Fetched>,
    /// Written awaiting a check from outside the store (the read path's origin check of blocks
    /// from rack members) until [`BlockStore::settle`]: passthrough does not hand the kernel a
    /// file holding such a block. Recorded, so a restart keeps it awaiting. Who supplied the
    /// block is not the store's business.
    pub(crate) unsettled: bool,
}

#[derive(Debug)]
pub(crate) struct ObjectState {
    pub(crate) size: u64,
    pub(crate) files: Arc<OnceCell<Arc<ObjectFiles>>>,
    /// True when the files on disk belong to this state (replayed at start or created by it).
    pub(crate) on_disk: bool,
    pub(crate) blocks: HashMap<u32, BlockMeta>,
    pub(crate) pinned: bool,
    /// Open passthrough handles: the kernel reads the data file itself, so no block may go.
    pub(crate) leases: u32,
    /// Writes holding a reservation on this object: it is not deleted while any is running.
    pub(crate) writers: u32,
    /// Handed to the kernel (passthrough) since start: the scrub reads it back (scrub.rs).
    pub(crate) handed: bool,
}

impl ObjectState {
    /// An object with nothing on disk yet.
    pub(crate) fn new(size: u64) -> Self {
        Self {
            size,
            files: Arc::default(),
            on_disk: false,
            blocks: HashMap::new(),
            pinned: false,
            leases: 0,
            writers: 0,
            handed: false,
        }
    }

    /// Pinned or leased: its blocks are kept out of the eviction policy.
    pub(crate) fn protected(&self) -> bool {
        self.pinned || self.leases > 0
    }
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) objects: HashMap<ObjectId, ObjectState>,
    /// Unpinned present blocks and their sizes, in eviction order; not those held.
    pub(crate) policy: Slru<BlockKey>,
    /// Blocks held by readers reading them in pieces, and how many holds each has: present
    /// or not yet, they stay out of the policy until the last hold goes.
    pub(crate) held: HashMap<BlockKey, u32>,
    pub(crate) used: u64,
    pub(crate) reserved: u64,
    pub(crate) next_generation: u64,
    /// Present blocks, and pinned objects, kept as they change so that [`BlockStore::usage`]
    /// (every scrape) does not walk the objects.
    pub(crate) blocks: usize,
    pub(crate) pinned: usize,
    /// Bytes of the present blocks of pinned objects.
    pub(crate) pinned_bytes: u64,
    /// The cache dir is gone: the index is empty and stays so (see [`BlockStore::give_up`]).
    pub(crate) dir_lost: bool,
    /// See [`BlockStore::disk_failure`].
    pub(crate) disk_failing: Option<String>,
    /// When the disk last failed an operation (see [`BlockStore::recheck_disk`]).
    pub(crate) disk_failed_at: Option<std::time::Instant>,
    /// For [`BlockStore::removed_lately`].
    pub(crate) removed: Removals,
}

/// How many removals [`State::removed`] keeps: enough to cover the few milliseconds between a
/// block's write and its waiter's look, even while a full cache evicts a block per write.
const REMOVALS_KEPT: usize = 1024;

/// Why a block was taken out of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Removal {
    /// Evicted to make room within the cache's capacity.
    #[error("evicted to make room within the cache's capacity")]
    EvictedForCapacity,
    /// Evicted to keep the free space `cache.min_free_fraction` asks of the file system.
    #[error("evicted to keep the free space cache.min_free_fraction asks of the cache's file system")]
    EvictedForFreeSpace,
    /// Read back with a disk error.
    #[error("dropped after the disk failed to read it back")]
    DiskError,
    /// Read back short or not matching its recorded BLAKE3.
    #[error("dropped after it was read back corrupt")]
    Corrupt,
    /// Supplied by a rack member and not the origin's bytes (the origin check).
    #[error("dropped by the origin check: a rack member's block that is not the origin's")]
    OriginMismatch,
    /// Its object's content failed the digest that names it.
    #[error("dropped with its object, whose content failed the digest that names it")]
    DigestMismatch,
}

impl Removal {
    /// Why a block read back with `error` is dropped.
    pub(crate) fn of(error: &crate::StoreError) -> Self {
        match error {
            crate::StoreError::Corrupt { .. } => Self::Corrupt,
            _ => Self::DiskError,
        }
    }
}

/// The last [`REMOVALS_KEPT`] blocks taken out of the store, and why.
#[derive(Debug, Default)]
pub(crate) struct Removals(VecDeque<(BlockKey, Removal)>);

impl Removals {
    /// Notes that `key` was taken out for reason `why`.
    pub(crate) fn note(&mut self, key: BlockKey, why: Removal) {
        if self.0.len() == REMOVALS_KEPT {
            self.0.pop_front();
        }
        self.0.push_back((key, why));
    }

    /// Why `key` was last taken out, if that is among the removals kept.
    fn of(&self, key: BlockKey) -> Option<Removal> {
        self.0.iter().rev().find(|(k, _)| *k == key).map(|&(_, why)| why)
    }
}

impl State {
    pub(crate) fn new(protected_limit: u64) -> Self {
        Self {
            objects: HashMap::new(),
            policy: Slru::new(protected_limit),
            held: HashMap::new(),
            used: 0,
            reserved: 0,
            next_generation: 0,
            blocks: 0,
            pinned: 0,
            pinned_bytes: 0,
            dir_lost: false,
            disk_failing: None,
            disk_failed_at: None,
            removed: Removals::default(),
        }
    }
}

impl BlockStore {
    /// Why block `index` of `id` was last taken out of the store, if it was among the last
    /// removals: for a waiter that finds a block gone right after its write.
    pub fn removed_lately(&self, id: ObjectId, index: u32) -> Option<Removal> {
        self.state.lock().removed.of((id, index))
    }

    /// Whether block `index` of `id` is present.
    pub fn contains(&self, id: ObjectId, index: u32) -> bool {
        self.state
            .lock()
            .objects
            .get(&id)
            .is_some_and(|o| o.blocks.contains_key(&index))
    }

    /// Whether block `index` is present and verified in this process (always true of a
    /// present block when verification is off).
    pub fn verified(&self, id: ObjectId, index: u32) -> bool {
        let state = self.state.lock();
        let meta = state.objects.get(&id).and_then(|o| o.blocks.get(&index));
        meta.is_some_and(|m| self.trusted(m))
    }

    /// Whether a block may be served without hashing it: checked in this process, or
    /// verification is off.
    pub(crate) fn trusted(&self, meta: &BlockMeta) -> bool {
        meta.verified || !self.verify
    }

    /// Current space use.
    pub fn usage(&self) -> Usage {
        let state = self.state.lock();
        Usage {
            used: state.used,
            reserved: state.reserved,
            capacity: self.capacity,
            objects: state.objects.len(),
            blocks: state.blocks,
            pinned: state.pinned,
            pinned_bytes: state.pinned_bytes,
            dir_lost: state.dir_lost,
            disk_failing: state.disk_failing.is_some(),
        }
    }

    /// The generation the next block stored gets: blocks read later with a greater one were
    /// stored after this call.
    pub fn generation(&self) -> u64 {
        self.state.lock().next_generation
    }

    /// The recorded BLAKE3 of block `index` of `id`, if present.
    pub fn block_hash(&self, id: ObjectId, index: u32) -> Option<[u8; 32]> {
        let state = self.state.lock();
        Some(state.objects.get(&id)?.blocks.get(&index)?.hash)
    }

    /// The recorded BLAKE3 of blocks `0..count` of object `id`, if every one is present.
    pub fn block_hashes(&self, id: ObjectId, count: u32) -> Option<Vec<[u8; 32]>> {
        let state = self.state.lock();
        let blocks = &state.objects.get(&id)?.blocks;
        (0..count).map(|index| Some(blocks.get(&index)?.hash)).collect()
    }
}

/// Records a use of a block for the eviction policy: a hit if it was served since it was
/// fetched, else its first use (a block fetched ahead is not promoted by its first read).
pub(crate) fn used(policy: &mut Slru<BlockKey>, key: BlockKey, meta: &mut BlockMeta) {
    if std::mem::replace(&mut meta.served, true) {
        policy.touch(&key);
    } else {
        policy.refresh(&key);
    }
}
