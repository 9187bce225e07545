//! What the readers of a cache share: the blocks some reader holds (another reader of the same
//! version near the same place takes them instead of reading them again), the blocks fetched
//! ahead of their reader and kept for it, and how many readers are in a sequential run.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, WeakShared};
use larder_object::ObjectId;
use parking_lot::Mutex;

use super::{Block, BlockKey, ReadError, SharedBlock};

/// How long a block fetched ahead is kept for its reader at most.
const KEPT_FOR: Duration = Duration::from_secs(5);

/// Size of the held-blocks map at which dead entries are first swept.
const HELD_SWEEP_MIN: usize = 1024;

/// The blocks and runs a cache's readers share.
#[derive(Debug)]
pub(crate) struct Sharing {
    /// Blocks some reader holds: another reader of the same version near the same place
    /// shares them instead of reading them again.
    held: Mutex<HeldBlocks>,
    /// Blocks fetched ahead of their reader, kept after their write for that reader.
    kept: Mutex<Kept>,
    /// Readers in a sequential run (a window open): they share [`crate::reader::BLOCKS_AHEAD`].
    runs: AtomicUsize,
}

/// Weak references to the blocks readers hold, swept of dead entries as the map grows.
#[derive(Debug)]
struct HeldBlocks {
    blocks: HashMap<BlockKey, WeakShared<BoxFuture<'static, Result<Block, ReadError>>>>,
    sweep_at: usize,
}

/// Blocks fetched ahead of any reader (by the readahead, or as the rest of a part), kept in
/// memory after their cache write until a reader takes them, within half the memory budget:
/// the reader the readahead fetched them for gets them without a disk read and a second hash
/// of all of the block (it was checked as it arrived, like any block a fill hands over).
/// Blocks kept longer than [`KEPT_FOR`] go (their reader went elsewhere); a block that finds
/// no room is not kept (it is the furthest ahead of its reader).
#[derive(Debug, Default)]
struct Kept {
    /// Objects under a model load ([`crate::model`]): their blocks kept are let go when the
    /// load finds every byte of them read, not when a read reaches their end.
    loading: HashSet<ObjectId>,
    /// Each block, and when it was kept.
    blocks: HashMap<BlockKey, (Block, Instant)>,
    /// Keys in the order they were kept; entries of blocks taken since are skipped.
    order: VecDeque<(BlockKey, Instant)>,
    bytes: u64,
}

impl Sharing {
    pub(crate) fn new() -> Self {
        Self {
            held: Mutex::new(HeldBlocks {
                blocks: HashMap::new(),
                sweep_at: HELD_SWEEP_MIN,
            }),
            kept: Mutex::new(Kept::default()),
            runs: AtomicUsize::new(0),
        }
    }

    /// The block `key` some reader holds (unless it failed), else the one `spawn` starts,
    /// held from now on: `spawn` runs under the held-blocks lock, so that two readers asking
    /// at once share one block.
    pub(crate) fn held_or(&self, key: BlockKey, spawn: impl FnOnce() -> SharedBlock) -> SharedBlock {
        let mut held = self.held.lock();
        if let Some(block) = held
            .blocks
            .get(&key)
            .and_then(WeakShared::upgrade)
            .filter(|block| !matches!(block.peek(), Some(Err(_))))
        {
            return block;
        }
        let block = spawn();
        if held.blocks.len() >= held.sweep_at {
            held.blocks.retain(|_, weak| weak.upgrade().is_some());
            held.sweep_at = (2 * held.blocks.len()).max(HELD_SWEEP_MIN);
        }
        if let Some(weak) = block.downgrade() {
            held.blocks.insert(key, weak);
        }
        block
    }

    /// Keeps `block`, fetched ahead of any reader, for the reader to come, if the blocks kept
    /// stay within `room` bytes (see [`Kept`]).
    pub(crate) fn keep(&self, key: BlockKey, block: &Block, room: u64) {
        let len = block.bytes.len() as u64;
        let now = Instant::now();
        let mut guard = self.kept.lock();
        let kept = &mut *guard;
        // Drops what was taken or kept too long, from the oldest.
        while let Some(&(oldest, at)) = kept.order.front() {
            let current = kept
                .blocks
                .get(&oldest)
                .is_some_and(|(_, kept_at)| *kept_at == at);
            if current && now.duration_since(at) < KEPT_FOR {
                break;
            }
            kept.order.pop_front();
            if current && let Some((gone, _)) = kept.blocks.remove(&oldest) {
                kept.bytes -= gone.bytes.len() as u64;
            }
        }
        if kept.bytes + len > room {
            return;
        }
        if let Some((old, _)) = kept.blocks.insert(key, (block.clone(), now)) {
            kept.bytes -= old.bytes.len() as u64;
        }
        kept.bytes += len;
        kept.order.push_back((key, now));
    }

    /// The whole block `key`, if it was kept for its reader, for a read of bytes `part` of it
    /// (all with `None`). A read that reaches the block's end takes it, so its memory goes
    /// once the reader is done with it; a read of a part before that leaves it for the reads
    /// that follow (a reader reading the block in pieces must not find the rest gone, and
    /// perhaps evicted from disk too).
    pub(crate) fn take_kept(&self, key: BlockKey, part: Option<&Range<usize>>) -> Option<Block> {
        let mut kept = self.kept.lock();
        let (block, _) = kept.blocks.get(&key)?;
        let len = block.bytes.len();
        let block = block.clone();
        if part.is_none_or(|part| part.end >= len) && !kept.loading.contains(&key.0) {
            kept.blocks.remove(&key);
            kept.bytes -= len as u64;
        }
        Some(block)
    }

    /// Whether object `id` is under a model load (see [`Kept::loading`]).
    pub(crate) fn set_loading(&self, id: ObjectId, loading: bool) {
        let mut kept = self.kept.lock();
        if loading {
            kept.loading.insert(id);
        } else {
            kept.loading.remove(&id);
        }
    }

    /// Lets block `key` go, if it is kept: every byte of it was read.
    pub(crate) fn release_kept(&self, key: BlockKey) {
        let mut kept = self.kept.lock();
        if let Some((gone, _)) = kept.blocks.remove(&key) {
            kept.bytes -= gone.bytes.len() as u64;
        }
    }

    /// Whether block `key` is kept for its reader.
    pub(crate) fn holds_kept(&self, key: BlockKey) -> bool {
        self.kept.lock().blocks.contains_key(&key)
    }

    /// Whether `len` bytes more would be kept within `room` (see [`Sharing::keep`]).
    pub(crate) fn kept_room(&self, len: u64, room: u64) -> bool {
        self.kept.lock().bytes + len <= room
    }

    /// A reader started a sequential run.
    pub(crate) fn run_started(&self) {
        self.runs.fetch_add(1, Ordering::Relaxed);
    }

    /// A reader's sequential run ended (or the reader went, in one).
    pub(crate) fn run_ended(&self) {
        self.runs.fetch_sub(1, Ordering::Relaxed);
    }

    /// Readers in a sequential run now.
    pub(crate) fn runs(&self) -> usize {
        self.runs.load(Ordering::Relaxed)
    }
}
