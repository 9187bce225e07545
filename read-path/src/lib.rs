//! The read path below a file handle: a block of a pinned object version comes from the first
//! tier that has it.
//!
//! 1. NVMe (the [`BlockStore`]) → serve. A lookup says hit, miss, lost race (evicted while
//!    read: look again, a bounded number of times) or error (the disk failed or the block was
//!    corrupt: the store dropped it, and the read goes on to the next tier at once).
//! 2. Join the fill in flight for the block, if there is one (single-flight).
//! 3. Otherwise start a fill ([`fill`]): a run from this block to the end of its origin part
//!    (stopping at blocks already present or in flight), fetched from the [`fill::BlockSource`]s
//!    in order (the rack peer that owns the run, when there is a peer tier; then the origin), run as its own
//!    task so it survives the cancellation of any reader.
//! 4. Each block goes to its waiters as soon as its last byte arrives, then is written to the
//!    block store in the background. A block stays joinable until its write has finished, so
//!    no reader refetches a block that is on its way to disk. A failed write is counted and
//!    logged; it never fails a read.
//!
//! [`Reader`] (one per file handle) adds the sequential detector ([`readahead`]) and holds the
//! blocks around its position.
//!
//! A block whose fill failed fails again at once, with the same error, for
//! [`FAILED_FILL_MEMORY`]: the kernel retries the failed page of a buffered read right away,
//! and a new fill would make the read wait a second read deadline.
//!
//! Lock order, where two are held at once: a reader's state → [`Cache`]'s held-blocks map or
//! its in-flight map → its failed-fills map or the block store's state. None is held across an
//! `.await`.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod budget;
pub mod fill;
pub mod model;
mod origin_check;
pub mod readahead;
mod reader;
mod sharing;
pub mod slots;

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use larder_config::{ByteSize, OriginConfig};
use larder_object::{ObjectId, ObjectVersion};
use larder_origin::{Origin, OriginError};
use larder_stats::{ReadLatencies, ReadStats, Stats, add};
use larder_store::{BlockStore, Hit, Lookup, Removal, StoreError, Written};
use tokio::runtime::Handle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;

use budget::{Charge, MemoryBudget};
use fill::{FillFor, Fills, MEMORY_PATIENCE, OriginSource, PeerTier};
use origin_check::OriginChecks;
pub use origin_check::{Checked, OriginCheckError};
pub use reader::Reader;
use sharing::Sharing;
use slots::Slots;

/// Why a read failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// The origin could not supply a missing block; shared by every waiter of the fill.
    #[error(transparent)]
    Origin(Arc<OriginError>),
    /// The fill was dropped before it finished (the daemon is shutting down).
    #[error("the fill was abandoned before it finished")]
    Abandoned,
    /// No rack peer supplied the run (this node owns it, or the owner failed): the peer
    /// tier's error. Only ever a source's error on the way to the next one: the origin comes
    /// after the peers.
    #[error("no rack peer supplied the blocks: {0}")]
    Peer(Arc<dyn std::error::Error + Send + Sync>),
    /// The run's owner did not answer, or stopped sending, within its deadline: it may only be
    /// slow (and already filling the run), so the origin supplies one block and the owner is
    /// asked again for the rest. Only ever a source's error on the way to the next one.
    #[error("the rack peer that owns the blocks was late: {0}")]
    PeerLate(Arc<dyn std::error::Error + Send + Sync>),
    /// The block was fetched but is not in the cache. Only [`Cache::fill`] reports it; reads
    /// are served anyway.
    #[error("the block was fetched but could not be stored in the cache: {0}")]
    NotStored(Arc<Unstored>),
}

/// Why a fetched block is not in the cache.
#[derive(Debug, thiserror::Error)]
pub enum Unstored {
    /// Its write failed: no space that is not pinned, the cache dir gone, or a disk error.
    #[error(transparent)]
    Write(StoreError),
    /// It was written, and taken out again before its waiter looked, for the reason the store
    /// recorded.
    #[error("it was taken out of the cache as soon as it was written: {0}")]
    Removed(Removal),
    /// It was written (or found present), and is gone with no removal the store remembers.
    #[error("it was not in the cache once written, and the cache recorded no removal of it")]
    Lost,
}

/// What a cache fetches ahead of its readers is at most its capacity divided by this (and at
/// least one block): the readahead window, a fill's run (the origin part) and the memory budget.
/// Blocks fetched ahead must still be in the cache when their reader gets to them, or a cold
/// read larger than the cache costs the origin its bytes several times over; the kernel's own
/// readahead (16 MiB of requests at once) comes on top (a quarter still cost up to 1.11×).
const AHEAD_SHARE_OF_CAPACITY: u64 = 8;

/// How long a block whose fill failed keeps failing with the same error, without a new fill:
/// the kernel retries a failed page of a buffered read at once, and must get the failure then,
/// not a second full read deadline.
pub const FAILED_FILL_MEMORY: Duration = Duration::from_secs(3);

/// Disk lookups of one block that may find it evicted or replaced while being read before the
/// read goes to a fill instead.
const LOOKUP_ATTEMPTS: u32 = 3;

/// What a fill hands its waiters: a block's bytes, and the tier they came from.
type FillResult = Result<Block, ReadError>;
type SharedFill = Shared<BoxFuture<'static, FillResult>>;
type SharedBlock = Shared<BoxFuture<'static, Result<Block, ReadError>>>;

/// Where bytes came from, for the bytes-served counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The node's block store.
    Nvme,
    /// The object store.
    Origin,
    /// A rack peer (its NVMe, or its own fill from the object store).
    Peer,
}

/// Bytes of one block (the whole block, or the part a read wanted), where they start in the
/// object, and their source.
#[derive(Debug, Clone)]
struct Block {
    bytes: Bytes,
    start: u64,
    source: Source,
    /// For a block read from disk that this process fetched: when and from where (a reader
    /// that opened its file before counts its bytes as fetched for it, not as a hit).
    written: Option<Written>,
    /// The whole block's BLAKE3 (also when `bytes` are a part of it): hashed as its bytes
    /// arrived, or the recorded one they were checked against on disk.
    hash: [u8; 32],
}
type BlockKey = (ObjectId, u32);

impl Block {
    /// Bytes `part` of this whole block.
    fn part(&self, part: &Range<usize>) -> Self {
        Self {
            bytes: self.bytes.slice(part.clone()),
            start: self.start + part.start as u64,
            source: self.source,
            written: self.written,
            hash: self.hash,
        }
    }
}

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

    /// The version's id.
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// The origin it comes from.
    pub fn origin(&self) -> &Arc<Origin> {
        &self.origin
    }
}

/// The block cache's read API. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Cache {
    inner: Arc<Inner>,
}

/// The cache's state, each concern's in a part of its own that its module owns.
#[derive(Debug)]
struct Inner {
    store: Arc<BlockStore>,
    /// The block bytes in memory: fills, blocks waiting for their write, blocks held.
    budget: Arc<MemoryBudget>,
    part_blocks: u32,
    readahead: Range<u64>,
    stats: Arc<ReadStats>,
    /// How long fills take.
    latency: Arc<ReadLatencies>,
    /// The runtime the cache was made in, and its tasks on it.
    runtime: Handle,
    tasks: TaskTracker,
    /// Cancelled at shutdown: fetches in flight stop, fills end abandoned.
    stop: CancellationToken,
    /// Fills, the blocks in flight, and what happened to blocks' fills and writes lately
    /// ([`fill`]).
    fills: Fills,
    /// What readers share: blocks held, blocks kept for their reader, runs ([`sharing`]).
    sharing: Sharing,
    /// Origin checks of objects completed with blocks from peers ([`origin_check`]).
    checks: OriginChecks,
    /// Safetensors files being loaded ([`model`]).
    models: model::Models,
}

impl Cache {
    /// A cache over `store`, fetching with the origin settings of `config`, asking `peers`
    /// (the rack peer tier, if any) before the origin, keeping about `memory_limit` bytes of
    /// blocks in memory at most (see [`budget`]). Called within a Tokio runtime: its fills
    /// run there, also those a read answered on a thread of its own starts.
    pub fn new(
        store: Arc<BlockStore>,
        config: &OriginConfig,
        memory_limit: ByteSize,
        stats: &Stats,
        peers: Option<PeerTier>,
    ) -> Self {
        let block_size = store.block_size();
        let ahead = (store.capacity() / AHEAD_SHARE_OF_CAPACITY).max(block_size);
        let part_blocks = (config.part_size.as_u64().min(ahead) / block_size).max(1) as u32;
        let readahead_max = config.readahead_max.as_u64().min(ahead);
        // Blocks in memory are mostly blocks fetched ahead, which must still be on disk when
        // their reader gets to them: a small cache gets a smaller budget (two parts at least).
        let part_bytes = u64::from(part_blocks) * block_size;
        let memory_limit = memory_limit.as_u64().min(ahead.max(2 * part_bytes));
        // The readahead fetches no further than what can be kept in memory for its reader
        // (see [`Sharing::keep`]): a block fetched further ahead would be read back from disk.
        let readahead_max = readahead_max.min(memory_limit / 2).max(block_size);
        let slots = Slots::new(config.concurrency, config.read_deadline / 4, stats.read.clone());
        let origin = OriginSource::new(slots);
        let (peer_source, members) = peers.map(|p| (p.source, p.members)).unzip();
        Self {
            inner: Arc::new(Inner {
                store,
                budget: MemoryBudget::new(memory_limit, stats.read.clone()),
                part_blocks,
                readahead: config.readahead_min.as_u64().min(readahead_max)..readahead_max,
                stats: stats.read.clone(),
                latency: stats.read_latency.clone(),
                runtime: Handle::current(),
                tasks: TaskTracker::new(),
                stop: CancellationToken::new(),
                fills: Fills::new(peer_source.into_iter().chain([Arc::new(origin) as _]).collect()),
                sharing: Sharing::new(),
                checks: OriginChecks::new(members),
                models: model::Models::default(),
            }),
        }
    }

    /// The block store underneath.
    pub fn store(&self) -> &Arc<BlockStore> {
        &self.inner.store
    }

    /// The memory budget of its blocks.
    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.inner.budget
    }

    /// Blocks in one origin part.
    pub fn part_blocks(&self) -> u32 {
        self.inner.part_blocks
    }

    /// Blocks with a fill or a cache write in flight.
    pub fn in_flight(&self) -> usize {
        self.fills().count()
    }

    /// Stops every fetch of a fill, now and from now on: their waiters get
    /// [`ReadError::Abandoned`]; blocks already received are still written (shutdown).
    pub fn stop_fills(&self) {
        self.inner.stop.cancel();
    }

    /// The counters of the read path.
    fn stats(&self) -> &ReadStats {
        &self.inner.stats
    }

    /// How long fills take.
    fn latency(&self) -> &ReadLatencies {
        &self.inner.latency
    }

    /// The bounds of a reader's readahead window.
    fn readahead(&self) -> Range<u64> {
        self.inner.readahead.clone()
    }

    /// Its fills ([`fill`]).
    fn fills(&self) -> &Fills {
        &self.inner.fills
    }

    /// What its readers share ([`sharing`]).
    fn sharing(&self) -> &Sharing {
        &self.inner.sharing
    }

    /// Its origin checks ([`origin_check`]).
    fn checks(&self) -> &OriginChecks {
        &self.inner.checks
    }

    /// Completes once [`Cache::stop_fills`] is called.
    fn stopped(&self) -> WaitForCancellationFuture<'_> {
        self.inner.stop.cancelled()
    }

    /// Runs `task` on the cache's runtime, whatever thread asks (a FUSE thread answering a
    /// read may start fills), tracked for [`Cache::flush`].
    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.inner.tasks.spawn_on(task, &self.inner.runtime);
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

    /// Block `index`, fetched by a task of its own so that it proceeds whether or not anyone
    /// is polling yet; the result can be awaited by several callers. While any reader holds
    /// it, other readers of the version get the same block rather than a read of their own.
    fn spawn_block(&self, object: &Arc<OpenObject>, index: u32) -> SharedBlock {
        self.sharing().held_or((object.id, index), || {
            let (cache, object) = (self.clone(), object.clone());
            let runtime = &self.inner.runtime;
            runtime
                .spawn(async move { cache.block(&object, index, None, FillFor::Node).await })
                .map(|joined| joined.unwrap_or(Err(ReadError::Abandoned)))
                .boxed()
                .shared()
        })
    }

    /// Starts fills for the missing blocks of `range` without waiting for them, as far as
    /// they fit the memory budget.
    pub fn prefetch(&self, object: &Arc<OpenObject>, range: Range<u64>) {
        let end = object.version.size.min(range.end);
        if range.start >= end {
            return;
        }
        let block_size = self.inner.store.block_size();
        let blocks = (range.start / block_size) as u32..((end - 1) / block_size) as u32 + 1;
        self.prefetch_blocks(object, blocks);
    }

    /// Starts fills for the missing blocks of `blocks`, as far as they fit the memory budget;
    /// the first block not started for want of room (`blocks.end` when all were).
    fn prefetch_blocks(&self, object: &Arc<OpenObject>, blocks: Range<u32>) -> u32 {
        let block_size = self.inner.store.block_size();
        let mut index = blocks.start;
        let mut inflight = self.fills().lock();
        while index < blocks.end {
            if inflight.contains_key(&(object.id, index))
                || self.inner.store.contains(object.id, index)
                || self.fills().failed_lately((object.id, index)).is_some()
            {
                index += 1;
                continue;
            }
            let Some(charge) = self.inner.budget.try_charge(block_size) else {
                add(
                    &self.inner.stats.readahead_held_back,
                    u64::from(blocks.end - index),
                );
                return index;
            };
            let started = self.start_fill(object, index, &mut inflight, FillFor::Node, Some(charge));
            add(&self.inner.stats.readahead_blocks, started.len() as u64);
            index = started.end;
        }
        blocks.end
    }

    /// Keeps `block`, fetched ahead of any reader, for the reader to come, within half the
    /// memory budget (see [`Sharing::keep`]).
    fn keep(&self, key: BlockKey, block: &Block) {
        self.sharing().keep(key, block, self.keep_room());
    }

    /// The bytes of blocks kept for their reader at most: half the memory budget.
    fn keep_room(&self) -> u64 {
        self.inner.budget.limit() / 2
    }

    /// Bytes `part` (all with `None`) of block `key`, if it was kept for its reader (see
    /// [`Sharing::take_kept`]).
    fn take_kept(&self, key: BlockKey, part: Option<&Range<usize>>) -> Option<Block> {
        let block = self.sharing().take_kept(key, part)?;
        // Its first use, for the eviction policy: it was never read from disk.
        self.inner.store.note_served(key.0, key.1);
        add(&self.inner.stats.lookup_hit, 1);
        Some(match part {
            None => block,
            Some(part) => block.part(part),
        })
    }

    /// Whether a block held ahead of a reader fits the memory budget now (counted as held
    /// back if not).
    fn room_to_hold(&self) -> bool {
        let fits = self.inner.budget.room_for(self.inner.store.block_size());
        if !fits {
            add(&self.inner.stats.readahead_held_back, 1);
        }
        fits
    }

    /// Makes sure block `index` is in the block store and verified: a block present but not
    /// yet checked by this process is read back and checked; a missing one (or one that fails
    /// the check) is fetched, or its fill in flight joined, and waited for until its write has
    /// landed. No bytes count as served: this is the prefetch path. Returns the bytes and the
    /// BLAKE3 of a block it fetched (or whose fill in flight it joined), `None` for one the
    /// store had: a caller that needs them takes them here rather than reading them back
    /// from disk. The bytes hold their share of the memory budget until dropped.
    pub async fn fill(
        &self,
        object: &Arc<OpenObject>,
        index: u32,
    ) -> Result<Option<(Bytes, [u8; 32])>, ReadError> {
        match self.fill_started(object, index, false).await? {
            Some(fill) => self.fill_written(object, index, fill).await,
            None => Ok(None),
        }
    }

    /// The first half of [`Cache::fill`]: the fill of block `index` joined or started (once the
    /// budget has room; if `waited_for`, after [`MEMORY_PATIENCE`] at most, as for a reader),
    /// or `None` when the store has the block.
    async fn fill_started(
        &self,
        object: &Arc<OpenObject>,
        index: u32,
        waited_for: bool,
    ) -> Result<Option<SharedFill>, ReadError> {
        let inner = &self.inner;
        let key = (object.id, index);
        if inner.store.contains(object.id, index) && !inner.store.verified(object.id, index) {
            match inner.store.read_block(&object.version, object.id, index).await {
                Ok(Lookup::Hit(..)) => return Ok(None),
                Ok(Lookup::Miss | Lookup::LostRace) => {}
                Err(error) => self.dropped(&error),
            }
        }
        // A job's fill waits for room in the memory budget before it starts; nobody is waiting
        // for its blocks (unless `waited_for`).
        let mut charge: Option<Charge> = None;
        loop {
            {
                let mut inflight = self.fills().lock();
                match inflight.get(&key) {
                    Some(fill) => return Ok(Some(fill.clone())),
                    None if inner.store.contains(object.id, index) => return Ok(None),
                    None => {
                        if let Some(error) = self.fills().failed_lately(key) {
                            return Err(error);
                        }
                        if let Some(charge) = charge.take() {
                            self.start_fill(object, index, &mut inflight, FillFor::Job, Some(charge));
                            return inflight.get(&key).cloned().ok_or(ReadError::Abandoned).map(Some);
                        }
                    }
                }
            }
            let block_size = inner.store.block_size();
            charge = Some(if waited_for {
                inner.budget.charge_soon(block_size, MEMORY_PATIENCE).await
            } else {
                inner.budget.charge_when_room(block_size).await
            });
        }
    }

    /// The second half of [`Cache::fill`]: the bytes of `fill`, once block `index` is written.
    async fn fill_written(
        &self,
        object: &Arc<OpenObject>,
        index: u32,
        fill: SharedFill,
    ) -> Result<Option<(Bytes, [u8; 32])>, ReadError> {
        let inner = &self.inner;
        let key = (object.id, index);
        let block = fill.await?;
        loop {
            let written = self.fills().next_write_end();
            tokio::pin!(written);
            // Registered before the checks, so a write ending between them still wakes us.
            written.as_mut().enable();
            if inner.store.contains(object.id, index) {
                return Ok(Some((block.bytes, block.hash)));
            }
            if !self.fills().in_flight(key) {
                let why = self.fills().unstored(key).unwrap_or_else(|| {
                    let removed = inner.store.removed_lately(object.id, index);
                    Arc::new(removed.map_or(Unstored::Lost, Unstored::Removed))
                });
                return Err(ReadError::NotStored(why));
            }
            written.await;
        }
    }

    /// Fills every missing block of `objects`, `parts_at_once` origin parts at a time, the
    /// blocks of a part in order (the first missing block's fill covers the rest of the part,
    /// and the blocks after it join that fill as soon as it starts, so that each block's bytes
    /// are had even when it is written before its turn). `each` hears every block's result
    /// (the block fetched, or `None`, as [`Cache::fill`] says), in order, and answers whether
    /// to go on with its part: a failed fill usually fails the rest of its part too.
    pub async fn fill_objects(
        &self,
        objects: Vec<Arc<OpenObject>>,
        parts_at_once: usize,
        each: impl Fn(&OpenObject, u32, Result<Option<(Bytes, [u8; 32])>, ReadError>) -> bool,
    ) {
        let ready = |_| std::future::ready(());
        self.fill_parts(objects, parts_at_once, ready, false, each).await;
    }

    /// [`Cache::fill_objects`], each part started only once `before` its blocks returns: a
    /// caller consuming the blocks as they come keeps the fetch from running ahead of it. Its
    /// blocks are waited for: a fill waits for room in the memory budget no longer than a
    /// reader's does (the caller may hold blocks of its own in the budget meanwhile).
    pub async fn fill_objects_paced<Before: Future<Output = ()>>(
        &self,
        objects: Vec<Arc<OpenObject>>,
        parts_at_once: usize,
        before: impl Fn(Range<u32>) -> Before,
        each: impl Fn(&OpenObject, u32, Result<Option<(Bytes, [u8; 32])>, ReadError>) -> bool,
    ) {
        self.fill_parts(objects, parts_at_once, before, true, each).await;
    }

    /// The loop of [`Cache::fill_objects`] and [`Cache::fill_objects_paced`].
    async fn fill_parts<Before: Future<Output = ()>>(
        &self,
        objects: Vec<Arc<OpenObject>>,
        parts_at_once: usize,
        before: impl Fn(Range<u32>) -> Before,
        waited_for: bool,
        each: impl Fn(&OpenObject, u32, Result<Option<(Bytes, [u8; 32])>, ReadError>) -> bool,
    ) {
        let block_size = self.inner.store.block_size();
        let part_blocks = self.part_blocks();
        let parts = objects.into_iter().flat_map(|object| {
            let count = object.version.size.div_ceil(block_size) as u32;
            (0..count)
                .step_by(part_blocks as usize)
                .map(move |first| (object.clone(), first..count.min(first + part_blocks)))
        });
        let (before, each) = (&before, &each);
        futures::stream::iter(parts)
            .map(|(object, blocks)| async move {
                before(blocks.clone()).await;
                let object = &object;
                let mut fills = futures::stream::FuturesOrdered::new();
                for index in blocks {
                    let started = self.fill_started(object, index, waited_for).await;
                    fills.push_back(async move {
                        let result = match started {
                            Ok(Some(fill)) => self.fill_written(object, index, fill).await,
                            Ok(None) => Ok(None),
                            Err(error) => Err(error),
                        };
                        (index, result)
                    });
                }
                while let Some((index, result)) = fills.next().await {
                    if !each(object, index, result) {
                        break;
                    }
                }
            })
            .buffer_unordered(parts_at_once)
            .for_each(|()| futures::future::ready(()))
            .await;
    }

    /// Looks block `index` up on disk: bytes `part` of it (the whole block with `None`), or
    /// `None` when the disk does not have it. A block evicted while being read is looked up
    /// again, a bounded number of times; a disk error or a corrupt block (which the store has
    /// dropped) is counted and logged here, and is a miss.
    async fn lookup(&self, object: &OpenObject, index: u32, part: Option<Range<usize>>) -> Option<Block> {
        let store = &self.inner.store;
        let whole = 0..store.block_len(object.version.size, index) as usize;
        let range = part.unwrap_or(whole);
        let started = Instant::now();
        for _ in 0..LOOKUP_ATTEMPTS {
            match store.read(&object.version, object.id, index, range.clone()).await {
                Ok(Lookup::Hit(hit)) => return Some(self.disk_hit(hit, index, range.start, started)),
                Ok(Lookup::Miss) => return None,
                Ok(Lookup::LostRace) => continue,
                Err(error) => {
                    self.dropped(&error);
                    return None;
                }
            }
        }
        None
    }

    /// Bytes `part` of block `index` from disk, read and checked on the calling thread (see
    /// [`BlockStore::read_now`]), or `None`.
    fn lookup_now(&self, object: &OpenObject, index: u32, part: Range<usize>) -> Option<Block> {
        if let Some(block) = self.take_kept((object.id, index), Some(&part)) {
            return Some(block);
        }
        let started = Instant::now();
        let store = &self.inner.store;
        let hit = store.read_now(object.id, object.version.size, index, part.clone())?;
        Some(self.disk_hit(hit, index, part.start, started))
    }

    /// Bytes of block `index` from `offset` in it, read from disk since `started`: counted,
    /// and charged to the budget (read for a reader waiting now, or held ahead if it fitted).
    fn disk_hit(&self, hit: Hit, index: u32, offset: usize, started: Instant) -> Block {
        let Hit { bytes, written, hash } = hit;
        let stats = &self.inner.stats;
        self.inner.latency.fill_nvme.observe(started.elapsed());
        add(&stats.lookup_hit, 1);
        let charge = self.inner.budget.charge(bytes.len() as u64);
        Block {
            bytes: budget::charged(bytes, Arc::new(charge)),
            start: self.block_start(index) + offset as u64,
            source: Source::Nvme,
            written,
            hash,
        }
    }

    /// Counts and logs a block the store dropped because its read failed: a miss, never a
    /// failed read.
    fn dropped(&self, error: &StoreError) {
        let stats = &self.inner.stats;
        match error {
            StoreError::Corrupt { .. } => add(&stats.lookup_corrupt, 1),
            StoreError::Io { .. }
            | StoreError::Locked(_)
            | StoreError::NoSpace { .. }
            | StoreError::DirLost(_) => add(&stats.cache_read_errors, 1),
        }
        tracing::warn!(%error, "cached block dropped; fetching it again");
    }

    /// The whole of block `index` for a rack peer that asked this node for it: from disk, a
    /// fill in flight, or a new fill from this node's origin, or with `relay` (a member of
    /// this node's rack asked) from the run's fleet owner first; with its BLAKE3 (hashed as it
    /// arrived, or the recorded hash it was checked against on disk). Nothing counts as served
    /// here; the peer listener counts what it sends.
    pub async fn block_for_peer(
        &self,
        object: &Arc<OpenObject>,
        index: u32,
        relay: bool,
    ) -> Result<(Bytes, [u8; 32]), ReadError> {
        let block = self.block(object, index, None, FillFor::Peer { relay }).await?;
        Ok((block.bytes, block.hash))
    }

    /// Bytes `part` of block `index` (the whole block with `None`): from disk, else from a
    /// fill in flight or a new one for `fill_for` (which always fetch the whole block).
    async fn block(
        &self,
        object: &Arc<OpenObject>,
        index: u32,
        part: Option<Range<usize>>,
        fill_for: FillFor,
    ) -> Result<Block, ReadError> {
        let stats = &self.inner.stats;
        let key = (object.id, index);
        let mut attempts = 0;
        if let Some(block) = self.take_kept(key, part.as_ref()) {
            return Ok(block);
        }
        let fill = loop {
            if let Some(block) = self.lookup(object, index, part.clone()).await {
                return Ok(block);
            }
            attempts += 1;
            let mut inflight = self.fills().lock();
            if let Some(fill) = inflight.get(&key) {
                add(&stats.lookup_joined, 1);
                break fill.clone();
            }
            // Written since the lookup: read it from disk rather than fetch it again, unless
            // the disk keeps losing it.
            if attempts < LOOKUP_ATTEMPTS && self.inner.store.contains(object.id, index) {
                continue;
            }
            if let Some(error) = self.fills().failed_lately(key) {
                return Err(error);
            }
            add(&stats.lookup_miss, 1);
            // A reader waits for this block: charged now if it fits, else once it fits, or
            // after MEMORY_PATIENCE whatever the budget says.
            let charge = self.inner.budget.try_charge(self.inner.store.block_size());
            self.start_fill(object, index, &mut inflight, fill_for, charge);
            break inflight.get(&key).cloned().ok_or(ReadError::Abandoned)?;
        };
        fill.await
    }
}
