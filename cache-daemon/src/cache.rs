//! The fill path: serve a range of a pinned object version from the block store, filling
//! missing blocks from the origin.
//!
//! 1. NVMe hit → serve.
//! 2. Join the fill in flight for the block, if there is one (single-flight).
//! 3. Otherwise start a fill: one ranged GET from this block to the end of its origin part
//!    (stopping at blocks already present or in flight), run as its own task so it survives the
//!    cancellation of any reader, limited by the origin concurrency.
//! 4. Each block goes to its waiters as soon as its last byte arrives, then is written to the
//!    block store in the background. A block stays joinable until its write has finished, so
//!    no reader refetches a block that is on its way to disk. A failed write is counted and
//!    logged; it never fails a read.
//!
//! [`Reader`] adds a sequential detector per handle: while reads are sequential, a readahead
//! window grows from `readahead_min` to `readahead_max`, keeping many GETs in flight.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use futures::FutureExt;
use futures::future::{BoxFuture, Shared, WeakShared};
use larder_config::OriginConfig;
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::engine::AlignedBuf;
use crate::object::{ObjectId, ObjectVersion};
use crate::origin::{Origin, OriginError};
use crate::stats::{Stats, add};
use crate::store::{BlockStore, VerifiedBlock};

/// Why a read failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// The origin could not supply a missing block; shared by every waiter of the fill.
    #[error(transparent)]
    Origin(Arc<OriginError>),
    /// The fill was dropped before it finished (the daemon is shutting down).
    #[error("the fill was abandoned before it finished")]
    Abandoned,
    /// The block was fetched but could not be written to the cache (no space that is not
    /// pinned, or a disk error). Only [`Cache::fill`] reports it; reads are served anyway.
    #[error("the block was fetched but could not be stored in the cache")]
    NotStored,
}

/// Bytes fetched from origins and not yet on disk, at most (or two parts, if more).
const WRITE_BEHIND_BYTES: u64 = 512 << 20;

type FillResult = Result<Bytes, ReadError>;
type SharedFill = Shared<BoxFuture<'static, FillResult>>;
type SharedBlock = Shared<BoxFuture<'static, Result<Block, ReadError>>>;

/// Where a block came from, for the bytes-served counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Nvme,
    Origin,
}

/// Bytes of one block (the whole block, or the part a read wanted), where they start in the
/// object, and their source.
#[derive(Debug, Clone)]
struct Block {
    bytes: Bytes,
    start: u64,
    source: Source,
}
type BlockKey = (ObjectId, u32);

/// A pinned object version and the origin it comes from: what a file handle holds.
#[derive(Debug)]
pub struct OpenObject {
    origin: Arc<Origin>,
    version: ObjectVersion,
    id: ObjectId,
}

impl OpenObject {
    /// Pins `version` of an object of `origin`.
    pub fn new(origin: Arc<Origin>, version: ObjectVersion) -> Arc<Self> {
        let id = version.id();
        Arc::new(Self { origin, version, id })
    }

    /// The pinned version.
    pub fn version(&self) -> &ObjectVersion {
        &self.version
    }
}

/// The block cache's read API. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Cache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Arc<BlockStore>,
    inflight: Mutex<HashMap<BlockKey, SharedFill>>,
    origin_permits: Arc<Semaphore>,
    /// Blocks fetched but not yet written: bounds the memory a fast origin and a slow disk
    /// can pile up.
    write_permits: Arc<Semaphore>,
    part_blocks: u32,
    readahead: Range<u64>,
    stats: Arc<Stats>,
    tasks: TaskTracker,
    /// Cancelled at shutdown: origin requests in flight stop, fills end abandoned.
    stop: CancellationToken,
    /// Woken after each cache write ends, written or not.
    written: tokio::sync::Notify,
    /// Blocks some reader holds: another reader of the same version near the same place
    /// shares them instead of reading them again.
    held: Mutex<HeldBlocks>,
    /// Readers in a sequential run (a window open): they share [`BLOCKS_AHEAD`].
    runs: AtomicUsize,
}

/// Weak references to the blocks readers hold, swept of dead entries as the map grows.
#[derive(Debug)]
struct HeldBlocks {
    blocks: HashMap<BlockKey, WeakShared<BoxFuture<'static, Result<Block, ReadError>>>>,
    sweep_at: usize,
}

/// Size of the held-blocks map at which dead entries are first swept.
const HELD_SWEEP_MIN: usize = 1024;

impl Cache {
    /// A cache over `store`, fetching with the origin settings of `config`.
    pub fn new(store: Arc<BlockStore>, config: &OriginConfig, stats: Arc<Stats>) -> Self {
        let part_blocks = (config.part_size.as_u64() / store.block_size()).max(1) as u32;
        let write_behind = (WRITE_BEHIND_BYTES / store.block_size()).max(2 * u64::from(part_blocks));
        Self {
            inner: Arc::new(Inner {
                store,
                inflight: Mutex::new(HashMap::new()),
                origin_permits: Arc::new(Semaphore::new(config.concurrency.max(1))),
                write_permits: Arc::new(Semaphore::new(write_behind as usize)),
                part_blocks,
                readahead: config.readahead_min.as_u64()..config.readahead_max.as_u64(),
                stats,
                tasks: TaskTracker::new(),
                stop: CancellationToken::new(),
                written: tokio::sync::Notify::new(),
                held: Mutex::new(HeldBlocks {
                    blocks: HashMap::new(),
                    sweep_at: HELD_SWEEP_MIN,
                }),
                runs: AtomicUsize::new(0),
            }),
        }
    }

    /// The block store underneath.
    pub fn store(&self) -> &Arc<BlockStore> {
        &self.inner.store
    }

    /// Blocks in one origin part.
    pub fn part_blocks(&self) -> u32 {
        self.inner.part_blocks
    }

    /// Blocks with a fill or a cache write in flight.
    pub fn in_flight(&self) -> usize {
        self.inner.inflight.lock().len()
    }

    /// Stops every origin request of a fill, now and from now on: their waiters get
    /// [`ReadError::Abandoned`]; blocks already received are still written (shutdown).
    pub fn stop_fills(&self) {
        self.inner.stop.cancel();
    }

    /// Waits for every fill and cache write started so far (shutdown, tests).
    pub async fn flush(&self) {
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
        self.inner.tasks.reopen();
    }

    /// Where block `index` starts in its object.
    fn block_start(&self, index: u32) -> u64 {
        u64::from(index) * self.inner.store.block_size()
    }

    fn block_count(&self, object: &OpenObject) -> u32 {
        object.version.size.div_ceil(self.inner.store.block_size()) as u32
    }

    /// Reads up to `len` bytes at `offset` of the pinned version; short only at its end.
    pub async fn read(&self, object: &Arc<OpenObject>, offset: u64, len: usize) -> Result<Bytes, ReadError> {
        let Some(span) = Span::new(object, self.inner.store.block_size(), offset, len) else {
            return Ok(Bytes::new());
        };
        let blocks =
            futures::future::try_join_all(span.blocks().map(|index| self.block(object, index))).await?;
        Ok(span.assemble(&blocks, &self.inner.stats))
    }

    /// Block `index`, fetched by a task of its own so that it proceeds whether or not anyone
    /// is polling yet; the result can be awaited by several callers. While any reader holds
    /// it, other readers of the version get the same block rather than a read of their own.
    fn spawn_block(&self, object: &Arc<OpenObject>, index: u32) -> SharedBlock {
        let key = (object.id, index);
        let mut held = self.inner.held.lock();
        if let Some(block) = held
            .blocks
            .get(&key)
            .and_then(WeakShared::upgrade)
            .filter(|block| !matches!(block.peek(), Some(Err(_))))
        {
            return block;
        }
        let (cache, object) = (self.clone(), object.clone());
        let block = tokio::spawn(async move { cache.block(&object, index).await })
            .map(|joined| joined.unwrap_or(Err(ReadError::Abandoned)))
            .boxed()
            .shared();
        if held.blocks.len() >= held.sweep_at {
            held.blocks.retain(|_, weak| weak.upgrade().is_some());
            held.sweep_at = (2 * held.blocks.len()).max(HELD_SWEEP_MIN);
        }
        if let Some(weak) = block.downgrade() {
            held.blocks.insert(key, weak);
        }
        block
    }

    /// Bytes `range` of block `index`: only the pages holding them when the block is on disk
    /// and verified (a small random read costs a small disk read), else the whole block.
    async fn block_part(
        &self,
        object: &Arc<OpenObject>,
        index: u32,
        range: Range<usize>,
    ) -> Result<Block, ReadError> {
        let started = Instant::now();
        let part = self
            .inner
            .store
            .read_verified_part(&object.version, object.id, index, range.clone())
            .await;
        let Some(bytes) = part else {
            return self.block(object, index).await;
        };
        let stats = &self.inner.stats;
        stats.latency.fill_nvme.observe(started.elapsed());
        add(&stats.lookup_hit, 1);
        Ok(Block {
            bytes,
            start: self.block_start(index) + range.start as u64,
            source: Source::Nvme,
        })
    }

    /// Starts fills for the missing blocks of `range` without waiting for them.
    pub fn prefetch(&self, object: &Arc<OpenObject>, range: Range<u64>) {
        let end = object.version.size.min(range.end);
        if range.start >= end {
            return;
        }
        let block_size = self.inner.store.block_size();
        let last = ((end - 1) / block_size) as u32;
        let mut index = (range.start / block_size) as u32;
        let mut inflight = self.inner.inflight.lock();
        while index <= last {
            if inflight.contains_key(&(object.id, index)) || self.inner.store.contains(object.id, index) {
                index += 1;
            } else {
                index = self.start_fill(object, index, &mut inflight).end;
            }
        }
    }

    /// Makes sure block `index` is in the block store and verified: a block present but not
    /// yet checked by this process is read back and checked; a missing one (or one that fails
    /// the check) is fetched, or its fill in flight joined, and waited for until its write has
    /// landed. No bytes count as served: this is the prefetch path. Returns whether it was
    /// fetched.
    pub async fn fill(&self, object: &Arc<OpenObject>, index: u32) -> Result<bool, ReadError> {
        let inner = &self.inner;
        let key = (object.id, index);
        if inner.store.contains(object.id, index)
            && !inner.store.verified(object.id, index)
            && inner
                .store
                .read_block(&object.version, object.id, index)
                .await
                .is_some()
        {
            return Ok(false);
        }
        let fill = {
            let mut inflight = inner.inflight.lock();
            match inflight.get(&key) {
                Some(fill) => fill.clone(),
                None if inner.store.contains(object.id, index) => return Ok(false),
                None => {
                    self.start_fill(object, index, &mut inflight);
                    inflight.get(&key).cloned().ok_or(ReadError::Abandoned)?
                }
            }
        };
        fill.await?;
        loop {
            let written = inner.written.notified();
            tokio::pin!(written);
            // Registered before the checks, so a write ending between them still wakes us.
            written.as_mut().enable();
            if inner.store.contains(object.id, index) {
                return Ok(true);
            }
            if !inner.inflight.lock().contains_key(&key) {
                return Err(ReadError::NotStored);
            }
            written.await;
        }
    }

    /// One whole block, from disk, from a fill in flight, or from a new fill.
    async fn block(&self, object: &Arc<OpenObject>, index: u32) -> Result<Block, ReadError> {
        let stats = &self.inner.stats;
        let started = Instant::now();
        if let Some(bytes) = self
            .inner
            .store
            .read_block(&object.version, object.id, index)
            .await
        {
            stats.latency.fill_nvme.observe(started.elapsed());
            add(&stats.lookup_hit, 1);
            return Ok(Block {
                bytes,
                start: self.block_start(index),
                source: Source::Nvme,
            });
        }
        let fill = {
            let mut inflight = self.inner.inflight.lock();
            if let Some(fill) = inflight.get(&(object.id, index)) {
                add(&stats.lookup_joined, 1);
                Some(fill.clone())
            } else if self.inner.store.contains(object.id, index) {
                // Written between the disk lookup and now.
                None
            } else {
                add(&stats.lookup_miss, 1);
                self.start_fill(object, index, &mut inflight);
                inflight.get(&(object.id, index)).cloned()
            }
        };
        match fill {
            Some(fill) => Ok(Block {
                bytes: fill.await?,
                start: self.block_start(index),
                source: Source::Origin,
            }),
            None => Box::pin(self.block(object, index)).await,
        }
    }

    /// Registers and spawns a fill from block `first` to the end of its origin part, stopping
    /// before any block already present or in flight. Returns the blocks it covers.
    fn start_fill(
        &self,
        object: &Arc<OpenObject>,
        first: u32,
        inflight: &mut HashMap<BlockKey, SharedFill>,
    ) -> Range<u32> {
        let part_end =
            ((first / self.inner.part_blocks + 1) * self.inner.part_blocks).min(self.block_count(object));
        let mut end = first + 1;
        while end < part_end
            && !inflight.contains_key(&(object.id, end))
            && !self.inner.store.contains(object.id, end)
        {
            end += 1;
        }
        let mut senders = Vec::with_capacity((end - first) as usize);
        for index in first..end {
            let (tx, rx) = oneshot::channel::<FillResult>();
            let fill = rx
                .map(|r| r.unwrap_or(Err(ReadError::Abandoned)))
                .boxed()
                .shared();
            inflight.insert((object.id, index), fill);
            senders.push(tx);
        }
        let cache = self.clone();
        let object = object.clone();
        self.inner
            .tasks
            .spawn(async move { cache.run_fill(object, first, senders).await });
        first..end
    }

    /// The body of a fill task.
    async fn run_fill(self, object: Arc<OpenObject>, first: u32, senders: Vec<oneshot::Sender<FillResult>>) {
        let started = Instant::now();
        let store = &self.inner.store;
        let block_size = store.block_size();
        let size = object.version.size;
        let start = u64::from(first) * block_size;
        let end = size.min(start + senders.len() as u64 * block_size);
        let blocks = senders.len() as u32;
        let mut pending = senders.into_iter();
        let mut next = first;
        let mut buf: Option<AlignedBuf> = None;
        let permits = async {
            // Write-behind first, so a slow disk holds fills back instead of piling up memory.
            let writes = self
                .inner
                .write_permits
                .clone()
                .acquire_many_owned(blocks)
                .await?;
            let origin = self.inner.origin_permits.clone().acquire_owned().await?;
            Ok::<_, tokio::sync::AcquireError>((writes, origin))
        };
        let result = match permits.await {
            Err(_) => Err(ReadError::Abandoned),
            Ok((mut writes, _origin)) => {
                let mut sink = |mut chunk: Bytes| {
                    while !chunk.is_empty() {
                        let block_len = store.block_len(size, next) as usize;
                        let block = buf.get_or_insert_with(|| AlignedBuf::new(block_len));
                        let take = (block_len - block.len()).min(chunk.len());
                        block.extend_from_slice(&chunk.split_to(take));
                        if block.len() == block_len
                            && let Some(full) = buf.take()
                        {
                            let write = writes.split(1);
                            self.deliver(&object, next, Arc::new(full), pending.next(), write);
                            next += 1;
                        }
                    }
                };
                let read = object.origin.read_range(&object.version, start..end, &mut sink);
                tokio::select! {
                    biased;
                    () = self.inner.stop.cancelled() => Err(ReadError::Abandoned),
                    read = read => read.map_err(|e| {
                        tracing::warn!(error = %e, "origin fill failed");
                        ReadError::Origin(Arc::new(e))
                    }),
                }
            }
        };
        match result {
            Ok(_) => self.inner.stats.latency.fill_origin.observe(started.elapsed()),
            Err(error) => {
                let mut inflight = self.inner.inflight.lock();
                for (offset, tx) in pending.enumerate() {
                    inflight.remove(&(object.id, next + offset as u32));
                    let _ = tx.send(Err(error.clone()));
                }
            }
        }
    }

    /// Hands a completed block to its waiters, then writes it to disk in the background,
    /// holding `write_permit` (one block of the write-behind budget) until the write is done.
    fn deliver(
        &self,
        object: &Arc<OpenObject>,
        index: u32,
        buf: Arc<AlignedBuf>,
        tx: Option<oneshot::Sender<FillResult>>,
        write_permit: Option<OwnedSemaphorePermit>,
    ) {
        if let Some(tx) = tx {
            let _ = tx.send(Ok(AlignedBuf::shared_bytes(&buf)));
        }
        let cache = self.clone();
        let object = object.clone();
        self.inner.tasks.spawn(async move {
            let _write_permit = write_permit;
            let block = VerifiedBlock::new(buf);
            if let Err(error) = cache
                .inner
                .store
                .write_block(&object.version, index, &block)
                .await
            {
                let stats = &cache.inner.stats;
                match error {
                    crate::store::StoreError::NoSpace(_) => add(&stats.cache_writes_skipped, 1),
                    _ => {
                        add(&stats.cache_write_failures, 1);
                        tracing::warn!(%error, "cache write failed; the block was served from memory");
                    }
                }
            }
            cache.inner.inflight.lock().remove(&(object.id, index));
            cache.inner.written.notify_waiters();
        });
    }
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
    fn assemble(&self, blocks: &[Block], stats: &Stats) -> Bytes {
        let slice = |block: &Block| {
            let from = self.offset.saturating_sub(block.start) as usize;
            let to = ((self.end - block.start) as usize).min(block.bytes.len());
            let bytes = block.bytes.slice(from.min(to)..to);
            let counter = match block.source {
                Source::Nvme => &stats.served_nvme_bytes,
                Source::Origin => &stats.served_origin_bytes,
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

/// Whole blocks the sequential readers keep fetched ahead of themselves, in memory, shared
/// among them (at least one each): this is what keeps several disk reads in flight on a warm
/// read (cold blocks are covered by the fills the readahead window starts), without many
/// readers each holding as many.
const BLOCKS_AHEAD: u32 = 8;

/// Whole blocks a reader keeps behind its position, for reads that arrive a little out of
/// order.
const BLOCKS_BEHIND: u32 = 2;

/// How far from the end of the last read a read may start and still start a run: one
/// request of the kernel's readahead, which may overtake the one before it.
const RUN_START_SLACK: u64 = 1 << 20;

type BlockFuture = BoxFuture<'static, Result<Block, ReadError>>;

/// A reader of one open object (one file handle): detects sequential access, keeps a growing
/// readahead window of fills in flight ahead of it, and holds the blocks around its position so
/// that small reads inside one block cost one block read. A read that is not sequential reads
/// only the pages it wants of a block already verified.
///
/// Reads may come concurrently and slightly out of order (the kernel's readahead sends several
/// at once): a read within one window of the last position still counts as sequential, and the
/// reader's state is locked only to plan a read, never while waiting for blocks.
#[derive(Debug)]
pub struct Reader {
    cache: Cache,
    object: Arc<OpenObject>,
    state: Mutex<ReaderState>,
}

#[derive(Debug, Default)]
struct ReaderState {
    next_offset: u64,
    window: u64,
    prefetched_to: u64,
    blocks: BTreeMap<u32, SharedBlock>,
}

impl Drop for Reader {
    fn drop(&mut self) {
        if self.state.get_mut().window > 0 {
            self.cache.inner.runs.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Reader {
    /// A reader of `object` through `cache`.
    pub fn new(cache: Cache, object: Arc<OpenObject>) -> Self {
        Self {
            cache,
            object,
            state: Mutex::new(ReaderState::default()),
        }
    }

    /// Reads like [`Cache::read`], growing the readahead window while reads are sequential and
    /// dropping it on a jump.
    pub async fn read(&self, offset: u64, len: usize) -> Result<Bytes, ReadError> {
        let block_size = self.cache.inner.store.block_size();
        let Some(span) = Span::new(&self.object, block_size, offset, len) else {
            return Ok(Bytes::new());
        };
        let wanted = self.plan(&span);
        let result = futures::future::try_join_all(wanted).await;
        if result.is_err() {
            // Do not keep failures: the next read tries again.
            self.state
                .lock()
                .blocks
                .retain(|_, fill| !matches!(fill.peek(), Some(Err(_))));
        }
        Ok(span.assemble(&result?, &self.cache.inner.stats))
    }

    /// Updates the sequential detector, starts readahead, and returns what to wait for, one
    /// future per block of the read.
    fn plan(&self, span: &Span) -> Vec<BlockFuture> {
        let block_size = self.cache.inner.store.block_size();
        let readahead = &self.cache.inner.readahead;
        let mut guard = self.state.lock();
        let state = &mut *guard;
        // The kernel's own readahead sends several requests at once, a few MiB apart and not
        // always in order: a read within this distance of where the last one ended continues a
        // run. It does not grow with the window, or reads that jump around a file would keep
        // counting as a run once one had started; and a run starts only with a read next to
        // the last one, because starting one costs whole blocks read ahead.
        let was_in_run = state.window > 0;
        let slack = if was_in_run {
            2 * readahead.start
        } else {
            RUN_START_SLACK
        };
        if span.offset.abs_diff(state.next_offset) <= slack {
            state.window = (state.window * 2).clamp(readahead.start, readahead.end);
            state.next_offset = state.next_offset.max(span.end);
        } else {
            state.window = 0;
            state.prefetched_to = 0;
            state.next_offset = span.end;
        }
        let sequential = state.window > 0;
        let runs = &self.cache.inner.runs;
        if sequential && !was_in_run {
            runs.fetch_add(1, Ordering::Relaxed);
        } else if was_in_run && !sequential {
            runs.fetch_sub(1, Ordering::Relaxed);
        }
        if sequential {
            let ahead_end = span
                .end
                .saturating_add(state.window)
                .min(self.object.version.size);
            if ahead_end > state.prefetched_to.max(span.end) {
                self.cache
                    .prefetch(&self.object, state.prefetched_to.max(span.end)..ahead_end);
                state.prefetched_to = ahead_end;
            }
        }
        let blocks_ahead = if sequential {
            let share = BLOCKS_AHEAD / (runs.load(Ordering::Relaxed) as u32).max(1);
            (state.window / block_size).clamp(1, u64::from(share.max(1))) as u32
        } else {
            0
        };
        let block_count = self.cache.block_count(&self.object);
        // Keep what concurrent, slightly out-of-order reads around this one may still ask for.
        let low = span.first.saturating_sub(BLOCKS_BEHIND);
        let high = span.last.saturating_add(2 * BLOCKS_AHEAD);
        state.blocks.retain(|index, _| (low..=high).contains(index));
        let ahead = span.last + 1..=(span.last + blocks_ahead).min(block_count - 1);
        for index in ahead {
            state
                .blocks
                .entry(index)
                .or_insert_with(|| self.cache.spawn_block(&self.object, index));
        }
        let store = &self.cache.inner.store;
        span.blocks()
            .map(|index| {
                if let Some(block) = state.blocks.get(&index) {
                    return block.clone().boxed();
                }
                if !sequential && store.verified(self.object.id, index) {
                    let (cache, object) = (self.cache.clone(), self.object.clone());
                    let range = span.within(index, block_size);
                    return async move { cache.block_part(&object, index, range).await }.boxed();
                }
                state
                    .blocks
                    .entry(index)
                    .or_insert_with(|| self.cache.spawn_block(&self.object, index))
                    .clone()
                    .boxed()
            })
            .collect()
    }
}
