//! A reader of one open object (one file handle): what a read waits for, given what the
//! sequential detector says of it.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::ops::Range;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::FutureExt;
use futures::future::BoxFuture;
use larder_stats::{ReadStats, add};
use larder_store::BlockHold;
use larder_store::Fetched;
use parking_lot::Mutex;

use super::fill::FillFor;
use super::model::ModelLoad;
use super::readahead::{Readahead, Step};
use super::{Block, Cache, OpenObject, ReadError, SharedBlock, Source};

/// Whole blocks the sequential readers keep fetched ahead of themselves, in memory, shared
/// among them (at least one each): this is what keeps several disk reads in flight on a warm
/// read (cold blocks are covered by the fills the readahead window starts), without many
/// readers each holding as many.
pub(crate) const BLOCKS_AHEAD: u32 = 8;

/// Whole blocks a reader keeps behind its position, for reads that arrive a little out of
/// order.
const BLOCKS_BEHIND: u32 = 2;

type BlockFuture = BoxFuture<'static, Result<Block, ReadError>>;

/// A reader of one open object: keeps a growing readahead window of fills in flight ahead of
/// it while reads are sequential, and holds the blocks around its position so that small
/// reads inside one block cost one block read, as far as the memory budget allows. A read that
/// is not sequential reads only the 16 KiB groups it wants of a block on disk; so does a
/// sequential one that finds the budget full, which then holds the block on disk instead (see
/// [`larder_store::BlockStore::hold`]), so that its next reads cannot find it evicted.
///
/// Reads may come concurrently and slightly out of order (the kernel's readahead sends several
/// at once); the reader's state is locked only to plan a read, never while waiting for blocks.
#[derive(Debug)]
pub struct Reader {
    cache: Cache,
    object: Arc<OpenObject>,
    /// The store's generation when the file was opened: blocks stored after it were fetched
    /// for this open (see [`Span::assemble`]).
    opened: u64,
    state: Mutex<ReaderState>,
    /// The model load the reader takes part in, for a safetensors file ([`crate::model`]).
    load: Option<Arc<ModelLoad>>,
}

#[derive(Debug)]
struct ReaderState {
    readahead: Readahead,
    blocks: BTreeMap<u32, SharedBlock>,
    /// Blocks read in pieces from disk, held there while the reader is in them.
    on_disk: BTreeMap<u32, BlockHold>,
}

impl Drop for Reader {
    fn drop(&mut self) {
        if self.state.get_mut().readahead.window() > 0 {
            self.cache.sharing().run_ended();
        }
    }
}

impl Reader {
    /// A reader of `object` through `cache`.
    pub fn new(cache: Cache, object: Arc<OpenObject>) -> Self {
        let readahead = Readahead::new(cache.readahead());
        Self {
            opened: cache.store().generation(),
            cache,
            object,
            state: Mutex::new(ReaderState {
                readahead,
                blocks: BTreeMap::new(),
                on_disk: BTreeMap::new(),
            }),
            load: None,
        }
    }

    /// The model load the reader takes part in, while it is one (its header held up).
    fn load(&self) -> Option<&Arc<ModelLoad>> {
        self.load.as_ref().filter(|load| load.active())
    }

    /// The reader, taking part in `load`: its reads tell the load how far the readers got.
    pub fn loading(mut self, load: Option<Arc<ModelLoad>>) -> Self {
        self.load = load;
        self
    }

    /// Reads up to `len` bytes at `offset` of the pinned version; short only at its end.
    pub async fn read(&self, offset: u64, len: usize) -> Result<Bytes, ReadError> {
        let block_size = self.cache.store().block_size();
        let Some(span) = Span::new(&self.object, block_size, offset, len) else {
            return Ok(Bytes::new());
        };
        let wanted = self.plan(&span);
        let result = futures::future::try_join_all(wanted).await;
        // After the read is served: a block read whole is let go from memory.
        if let (Some(load), Ok(_)) = (self.load(), &result) {
            load.note_read(span.offset..span.end);
        }
        if result.is_err() {
            // Do not keep failures: the next read tries again.
            self.state
                .lock()
                .blocks
                .retain(|_, fill| !matches!(fill.peek(), Some(Err(_))));
        }
        Ok(span.assemble(&result?, self.cache.stats(), self.opened))
    }

    /// Reads up to `len` bytes at `offset` on the calling thread, if that can be done at
    /// once: a small read inside one block that does not continue a sequential run, of a block
    /// held in memory or of groups on disk (see [`larder_store::BlockStore::read_now`]). The
    /// FUSE thread answers such reads itself, without a hop to the runtime and the I/O
    /// engine. `None`: read with [`Reader::read`].
    pub fn read_now(&self, offset: u64, len: usize) -> Option<Bytes> {
        let block_size = self.cache.store().block_size();
        let span = Span::new(&self.object, block_size, offset, len)?;
        if span.first != span.last || len > larder_store::READ_NOW_MAX {
            return None;
        }
        if self.load().is_some() {
            // Only what the load keeps: a part read from disk here would go unchecked whole.
            let part = span.within(span.first, block_size);
            let block = self.cache.take_kept((self.object.id, span.first), Some(&part))?;
            let bytes = span.assemble(&[block], self.cache.stats(), self.opened);
            if let Some(load) = self.load() {
                load.note_read(span.offset..span.end);
            }
            return Some(bytes);
        }
        let held = {
            let state = self.state.lock();
            if state.readahead.continues(offset) {
                return None;
            }
            let held = state
                .blocks
                .get(&span.first)
                .and_then(|block| block.peek().cloned());
            held.and_then(Result::ok)
        };
        let block = match held {
            Some(block) => block,
            None => {
                let part = span.within(span.first, block_size);
                self.cache.lookup_now(&self.object, span.first, part)?
            }
        };
        let bytes = span.assemble(&[block], self.cache.stats(), self.opened);
        if let Some(load) = self.load() {
            load.note_read(span.offset..span.end);
        }
        let step = self.step(&mut self.state.lock(), &span);
        self.act(&step);
        Some(bytes)
    }

    /// Feeds the sequential detector, starts readahead, and returns what to wait for, one
    /// future per block of the read. What to do is decided under the reader's lock; fills,
    /// block tasks and holds on disk are started after it is released, and what they give is
    /// kept under it again (a concurrent read of the handle that started the same block meanwhile
    /// got the same one: [`Cache::spawn_block`] shares it).
    fn plan(&self, span: &Span) -> Vec<BlockFuture> {
        let cache = &self.cache;
        let store = cache.store();
        let block_size = store.block_size();
        let loading = self.load().is_some();
        let (step, wants, ahead, left) = {
            let mut guard = self.state.lock();
            let state = &mut *guard;
            let step = self.step(state, span);
            let blocks_ahead = if step.sequential {
                let share = BLOCKS_AHEAD / (cache.sharing().runs() as u32).max(1);
                (state.readahead.window() / block_size).clamp(1, u64::from(share.max(1))) as u32
            } else {
                0
            };
            // Keep what concurrent, slightly out-of-order reads around this one may still ask
            // for. Blocks behind only while the budget has room for them.
            let behind = if cache.budget().room_for(block_size) {
                BLOCKS_BEHIND
            } else {
                0
            };
            let kept = span.first.saturating_sub(behind)..=span.last.saturating_add(2 * BLOCKS_AHEAD);
            state.blocks.retain(|index, _| kept.contains(index));
            // Holds are let go after the lock (a hold's end takes the store's lock).
            let left: Vec<BlockHold> = state
                .on_disk
                .extract_if(.., |index, _| !kept.contains(index))
                .map(|(_, hold)| hold)
                .collect();
            // The read's own blocks, whole in a run while the budget has room (the next reads
            // inside them need no disk read), then those ahead of it as far as the budget goes.
            // Without room, a run reads the part it wants and holds the block on disk.
            let wants: Vec<Want> = span
                .blocks()
                .map(|index| match state.blocks.get(&index) {
                    Some(block) => Want::Held(block.clone()),
                    // A model load reads ahead for its readers: a reader of it reads whole
                    // blocks, kept for the reads of their other parts, and nothing ahead.
                    None if loading => Want::Loaded(index),
                    None if !step.sequential || !cache.room_to_hold() => Want::Part {
                        index,
                        hold: step.sequential && !state.on_disk.contains_key(&index),
                    },
                    None => Want::Whole(index),
                })
                .collect();
            let last = (span.last + blocks_ahead).min(cache.block_count(&self.object) - 1);
            let ahead: Vec<u32> = (span.last + 1..=last)
                .filter(|index| !loading && !state.blocks.contains_key(index))
                .take_while(|_| cache.room_to_hold())
                .collect();
            (step, wants, ahead, left)
        };
        drop(left);
        self.act(&step);
        let whole = wants.iter().filter_map(|want| match want {
            Want::Whole(index) => Some(*index),
            _ => None,
        });
        let spawned: BTreeMap<u32, SharedBlock> = whole
            .chain(ahead)
            .map(|index| (index, cache.spawn_block(&self.object, index)))
            .collect();
        let holds: Vec<(u32, BlockHold)> = wants
            .iter()
            .filter_map(|want| match *want {
                Want::Part { index, hold: true } => Some((index, store.hold(self.object.id, index))),
                _ => None,
            })
            .collect();
        // A read whose blocks the reader held already takes the lock once.
        let unneeded: Vec<BlockHold> = if spawned.is_empty() && holds.is_empty() {
            Vec::new()
        } else {
            let mut state = self.state.lock();
            for (&index, block) in &spawned {
                state.blocks.entry(index).or_insert_with(|| block.clone());
            }
            holds
                .into_iter()
                .filter_map(|(index, hold)| match state.on_disk.entry(index) {
                    Entry::Vacant(entry) => {
                        entry.insert(hold);
                        None
                    }
                    Entry::Occupied(_) => Some(hold),
                })
                .collect()
        };
        drop(unneeded);
        wants
            .into_iter()
            .map(|want| match want {
                Want::Held(block) => block.boxed(),
                Want::Whole(index) => spawned[&index].clone().boxed(),
                Want::Loaded(index) => {
                    let (cache, object) = (cache.clone(), self.object.clone());
                    let part = span.within(index, block_size);
                    async move { cache.loaded_block(&object, index, part).await }.boxed()
                }
                Want::Part { index, .. } => {
                    let (cache, object) = (cache.clone(), self.object.clone());
                    let part = span.within(index, block_size);
                    async move { cache.block(&object, index, Some(part), FillFor::Node).await }.boxed()
                }
            })
            .collect()
    }

    /// Feeds the sequential detector with `span` and counts the runs it starts and ends:
    /// under the reader's lock.
    fn step(&self, state: &mut ReaderState, span: &Span) -> Step {
        let step = state
            .readahead
            .on_read(span.offset..span.end, self.object.version.size);
        let sharing = self.cache.sharing();
        if step.started {
            sharing.run_started();
        } else if step.ended {
            sharing.run_ended();
        }
        step
    }

    /// Starts the readahead `step` asks for: after the reader's lock is released.
    fn act(&self, step: &Step) {
        if let Some(ahead) = step.prefetch.clone() {
            self.cache.prefetch(&self.object, ahead);
        }
    }
}

/// What a read waits for, for one block: planned under the reader's lock, started after.
enum Want {
    /// A block the reader holds already.
    Held(SharedBlock),
    /// The whole block, kept by the reader.
    Whole(u32),
    /// Only the part the read covers; `hold`: hold the block on disk while the reader is in it.
    Part { index: u32, hold: bool },
    /// The part the read covers, of the whole block kept for the load's readers.
    Loaded(u32),
}

/// The blocks a read covers, and how to cut the read out of them.
struct Span {
    offset: u64,
    end: u64,
    first: u32,
    last: u32,
}

impl Span {
    /// `None` when the read is empty or starts at or past the end of the object.
    fn new(object: &OpenObject, block_size: u64, offset: u64, len: usize) -> Option<Self> {
        let end = object.version.size.min(offset.saturating_add(len as u64));
        (offset < end).then(|| Self {
            offset,
            end,
            first: (offset / block_size) as u32,
            last: ((end - 1) / block_size) as u32,
        })
    }

    fn blocks(&self) -> std::ops::RangeInclusive<u32> {
        self.first..=self.last
    }

    /// The part of block `index` (of `block_size` bytes) the read covers, as offsets within it.
    fn within(&self, index: u32, block_size: u64) -> Range<usize> {
        let block_start = u64::from(index) * block_size;
        let from = self.offset.saturating_sub(block_start);
        let to = (self.end - block_start).min(block_size);
        from as usize..to as usize
    }

    /// The requested bytes out of the blocks `first..=last`, each whole or the part the read
    /// covers (a slice when one block holds them all, one copy otherwise); counts the bytes
    /// served by source.
    ///
    /// A block read from disk that this process stored after the reader's file was opened (at
    /// the store's generation `opened`; readahead's, most often) counts where it was fetched
    /// from: only bytes on the node before the open are hits.
    fn assemble(&self, blocks: &[Block], stats: &ReadStats, opened: u64) -> Bytes {
        let slice = |block: &Block| {
            let from = self.offset.saturating_sub(block.start) as usize;
            let to = ((self.end - block.start) as usize).min(block.bytes.len());
            let bytes = block.bytes.slice(from.min(to)..to);
            let fetched = block.written.filter(|w| w.generation > opened).map(|w| w.from);
            let counter = match (block.source, fetched) {
                (_, Some(Fetched::Origin)) | (Source::Origin, None) => &stats.served_origin_bytes,
                (_, Some(Fetched::Peer)) | (Source::Peer, None) => &stats.served_peer_bytes,
                (Source::Nvme, None) => &stats.served_nvme_bytes,
            };
            add(counter, bytes.len() as u64);
            bytes
        };
        if let [block] = blocks {
            return slice(block);
        }
        let mut out = BytesMut::with_capacity((self.end - self.offset) as usize);
        for block in blocks {
            out.extend_from_slice(&slice(block));
        }
        out.freeze()
    }
}
