//! Fills: fetching a run of missing blocks from the tiers behind the block store, handing each
//! block to its waiters as it completes, and writing it to the store in the background.
//!
//! A run is registered in the in-flight map before its task starts, one shared future per
//! block, so every reader of a block in the run joins it (single-flight). The task asks each
//! [`BlockSource`] in turn for what is still missing of the run: a source that fails part-way
//! leaves the rest to the next one, from the first block it did not complete. The last
//! source's error is every remaining waiter's.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use larder_engine::AlignedBuf;
use larder_object::ObjectId;
use larder_object::crc::BlockCrcs;
use larder_origin::OriginError;
use larder_stats::ReadStats;
use larder_stats::said::Throttled;
use larder_store::{Fetched, GroupHasher, StoreError, VerifiedBlock};
use parking_lot::{Mutex, MutexGuard};
use tokio::sync::{Notify, futures::Notified, oneshot};

use super::budget::{Charge, charged};
use super::slots::Slots;
use super::{
    Block, BlockKey, Cache, FAILED_FILL_MEMORY, FillResult, OpenObject, ReadError, SharedFill, Source,
    Unstored,
};

/// A tier a missing run of blocks can be fetched from, after the block store: the rack peer
/// that owns the run, then the origin. Bytes go into the [`Run`], in order from the first byte
/// of `range`; an error says why the source could not supply the rest.
pub trait BlockSource: Send + Sync + std::fmt::Debug {
    /// What the bytes it supplies count as.
    fn kind(&self) -> Source;

    /// Whether it is asked for a fill for `fill_for` (every fill, unless it says otherwise).
    fn serves(&self, fill_for: FillFor) -> bool {
        let _ = fill_for;
        true
    }

    /// Fetches `range` (block-aligned at its start) of `object` into `run`.
    fn fetch<'a>(
        &'a self,
        object: &'a OpenObject,
        range: Range<u64>,
        run: &'a mut Run<'_>,
    ) -> BoxFuture<'a, Result<(), ReadError>>;
}

/// The rack peer tier of a cache: the source that asks the members, and the members, whose
/// circuit a block that fails the origin check opens.
#[derive(Debug)]
pub struct PeerTier {
    /// Asks the run's owner.
    pub source: Arc<dyn BlockSource>,
    /// The members it asks.
    pub members: Arc<dyn Members>,
}

/// What the read path tells the rack peer tier of its members, whom it knows only by id.
pub trait Members: Send + Sync + std::fmt::Debug {
    /// Blocks member `id` sent, and vouched for, proved not to be the origin's.
    fn sent_wrong_blocks(&self, id: &str);
}

/// A block pushed into a run that is not the block the run waits for next (or the run wants no
/// more): refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("block {index} is not the next of the run ({next})")]
pub struct NotNext {
    /// The block pushed.
    pub index: u32,
    /// The block the run waits for.
    pub next: u32,
}

/// Where a block pushed into a run came from, as the cache records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Provenance {
    /// The object store, fetched and hashed by this node.
    Origin,
    /// A rack member, whose bytes were checked against the hash it gave. `unchecked` names the
    /// member until the object's origin check vouches for the block (`None` when a sealed
    /// manifest already gave the same hash).
    Peer {
        /// The member to hold to account, until the origin check.
        unchecked: Option<Arc<str>>,
    },
}

/// Whom a fill is for. This node's readers and jobs are served by every tier; a rack peer's
/// request only by this node's origin, so that a run asked of its owner is never passed on
/// (no request loops between nodes whose member lists disagree for a moment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillFor {
    /// This node's readers.
    Node,
    /// This node's prefetch jobs: like `Node`, but no reader is expected to follow, so the
    /// blocks fetched are not kept in memory for one.
    Job,
    /// A rack peer that asked this node. With `relay`, a member of this node's rack, for
    /// which this node may ask the run's fleet owner (in another rack); without, a member of
    /// another rack: filled from the origin only, so that no request is passed on twice.
    Peer {
        /// Whether the peer tier may be asked.
        relay: bool,
    },
}

/// The object store, through the object's own origin: ranged GETs pinned to its version, as
/// many fills at a time as the adaptive [`Slots`] allow, each failing only once a whole read
/// deadline passes in which it received no byte. A fill waiting for a slot waits as long as the
/// fills ahead of it receive bytes, and fails once a whole read deadline passes in which none
/// did: a slow origin (a link shared by a whole scale-up) makes reads slow, a stalled one makes
/// them fail.
#[derive(Debug)]
pub struct OriginSource {
    slots: Slots,
    /// Chunks received by this tier's fills, all origins together.
    progress: AtomicU64,
}

impl OriginSource {
    /// An origin tier with fill slots `slots`.
    pub fn new(slots: Slots) -> Self {
        Self {
            slots,
            progress: AtomicU64::new(0),
        }
    }
}

impl BlockSource for OriginSource {
    fn kind(&self) -> Source {
        Source::Origin
    }

    fn fetch<'a>(
        &'a self,
        object: &'a OpenObject,
        range: Range<u64>,
        run: &'a mut Run<'_>,
    ) -> BoxFuture<'a, Result<(), ReadError>> {
        async move {
            // The read deadline counts from the wait for a slot, restarted whenever the fills
            // ahead are seen receiving bytes: a read behind stalled fills fails when its
            // deadline passes, not a deadline after they do; one behind fills that move waits
            // its turn. One acquire throughout, so that the fill keeps its place in the queue.
            let origin = &object.origin;
            let deadline = origin.read_deadline();
            let look = (deadline / 4).max(Duration::from_millis(10));
            let acquire = self.slots.permit();
            tokio::pin!(acquire);
            let now = tokio::time::Instant::now;
            let (mut started, mut seen) = (now(), self.progress.load(Ordering::Relaxed));
            let permit = loop {
                let waited = tokio::time::timeout(look, &mut acquire).await;
                let progress = self.progress.load(Ordering::Relaxed);
                if progress != seen {
                    (started, seen) = (now(), progress);
                }
                match waited {
                    Ok(permit) => break permit.map_err(|_| ReadError::Abandoned)?,
                    Err(_) if started.elapsed() >= deadline => {
                        let error = origin.deadline_exceeded(&object.version.key, 0);
                        return Err(ReadError::Origin(Arc::new(error)));
                    }
                    Err(_) => {}
                }
            };
            let slot = self.slots.slot(permit);
            let mut block = None;
            let mut sink = |chunk: Bytes| {
                self.progress.fetch_add(1, Ordering::Relaxed);
                assemble(run, &mut block, chunk);
            };
            let read = origin
                .read_range(&object.version, range, started, &mut sink)
                .await;
            // Only what congestion causes counts against the slots.
            let starved = matches!(
                read,
                Err(OriginError::DeadlineExceeded { .. } | OriginError::RetriesExhausted { .. })
            );
            slot.end(!starved);
            read.map_err(|e| ReadError::Origin(Arc::new(e)))
        }
        .boxed()
    }
}

/// Bytes this node fetched from the origin, in order from the start of the run's next block:
/// added to the block being assembled (`block`), each 16 KiB group hashed as it completes, and
/// each block they complete pushed into the run.
fn assemble(run: &mut Run<'_>, block: &mut Option<(AlignedBuf, GroupHasher)>, mut chunk: Bytes) {
    while !chunk.is_empty() && run.blocks_left() > 0 {
        let block_len = run.block_len(run.next_block());
        let (buf, groups) = block.get_or_insert_with(|| (AlignedBuf::new(block_len), GroupHasher::default()));
        let take = (block_len - buf.len()).min(chunk.len());
        buf.extend_from_slice(&chunk.split_to(take));
        groups.update(buf.as_ref());
        if buf.len() == block_len
            && let Some((full, groups)) = block.take()
        {
            let verified = VerifiedBlock::hashed_here(Arc::new(full), groups);
            let index = run.next_block();
            // The run's next block, made from its own bytes: never refused.
            let _ = run.push(index, verified, Provenance::Origin);
        }
    }
}

/// How long a fill for a waiting reader waits for room in the memory budget before it takes
/// its block's memory anyway: the bound that keeps readers from deadlocking on memory held by
/// other waiting readers, long enough for fills in flight to finish and return theirs.
pub(crate) const MEMORY_PATIENCE: Duration = Duration::from_secs(1);

/// The fill machinery of a cache: the tiers a missing run is fetched from, the blocks with a
/// fill or a cache write in flight, and what happened to blocks' fills and writes lately.
#[derive(Debug)]
pub(crate) struct Fills {
    /// The tiers a missing run is fetched from, in order.
    sources: Vec<Arc<dyn BlockSource>>,
    inflight: Mutex<HashMap<BlockKey, SharedFill>>,
    /// Blocks whose fill failed lately, with the error.
    failed: Lately<ReadError>,
    /// Blocks whose cache write failed lately, with why: what [`Cache::fill`] tells its job.
    unstored: Lately<Arc<Unstored>>,
    /// Woken after each cache write ends, written or not.
    written: Notify,
    /// A write skipped for lack of room has been logged.
    no_space_said: AtomicBool,
    /// Failed cache writes, said at most once a minute.
    write_failures_said: Throttled,
}

impl Fills {
    /// Fills from `sources`, in order.
    pub(crate) fn new(sources: Vec<Arc<dyn BlockSource>>) -> Self {
        Self {
            sources,
            inflight: Mutex::new(HashMap::new()),
            failed: Lately::default(),
            unstored: Lately::default(),
            written: Notify::new(),
            no_space_said: AtomicBool::new(false),
            write_failures_said: Throttled::default(),
        }
    }

    /// The in-flight map, locked: one shared future per block with a fill or a cache write in
    /// flight. A read that may start a fill holds it from its look to the fill's registration
    /// ([`Cache::start_fill`]).
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<BlockKey, SharedFill>> {
        self.inflight.lock()
    }

    /// Blocks with a fill or a cache write in flight.
    pub(crate) fn count(&self) -> usize {
        self.inflight.lock().len()
    }

    /// Whether block `key` has a fill or a cache write in flight.
    pub(crate) fn in_flight(&self, key: BlockKey) -> bool {
        self.inflight.lock().contains_key(&key)
    }

    /// Whether a reader waits for block `key` (the in-flight map holds one handle of its fill,
    /// each waiting reader another), rather than it being fetched ahead of any reader.
    fn awaited(&self, key: BlockKey) -> bool {
        self.inflight
            .lock()
            .get(&key)
            .and_then(Shared::strong_count)
            .is_some_and(|handles| handles > 1)
    }

    /// The sources asked for a fill for `fill_for`, in order.
    fn sources_for(&self, fill_for: FillFor) -> Vec<&Arc<dyn BlockSource>> {
        self.sources
            .iter()
            .filter(|source| source.serves(fill_for))
            .collect()
    }

    /// The error of the failed fill of `key`, if it failed less than [`FAILED_FILL_MEMORY`]
    /// ago: a read of it fails at once instead of starting another fill.
    pub(crate) fn failed_lately(&self, key: BlockKey) -> Option<ReadError> {
        self.failed.get(key)
    }

    /// Hands `error` to the `waiters` of the blocks of `object` from `next` on, which no
    /// source supplied, and takes the blocks out of the in-flight map; later reads get it too
    /// for a short while.
    fn fail(
        &self,
        object: ObjectId,
        next: u32,
        waiters: std::vec::IntoIter<oneshot::Sender<FillResult>>,
        error: &ReadError,
    ) {
        let mut inflight = self.inflight.lock();
        self.remember_failure(object, next..next + waiters.len() as u32, error);
        for (offset, tx) in waiters.enumerate() {
            inflight.remove(&(object, next + offset as u32));
            let _ = tx.send(Err(error.clone()));
        }
    }

    /// Remembers that the fills of `blocks` of `object` failed with `error` (an origin's error:
    /// an abandoned fill is not the block's fault), and forgets failures older than
    /// [`FAILED_FILL_MEMORY`].
    fn remember_failure(&self, object: ObjectId, blocks: Range<u32>, error: &ReadError) {
        if !matches!(error, ReadError::Origin(_)) || blocks.is_empty() {
            return;
        }
        let keys = blocks.map(|index| (object, index));
        self.failed.record(keys, error);
    }

    /// Counts and logs the failed cache write of `key` in `stats` (each kind of failure as
    /// often as it says), and remembers why, for a [`Cache::fill`] waiting for it.
    fn write_failed(&self, stats: &ReadStats, key: BlockKey, error: StoreError) {
        match &error {
            // Lasts until pins go or space is freed: said once, then only counted.
            StoreError::NoSpace { .. } => {
                larder_stats::add(&stats.cache_writes_skipped, 1);
                if !self.no_space_said.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %error,
                        "a block was served but not cached; later skips are only counted \
                         (larder_cache_writes_skipped_total)"
                    );
                }
            }
            // Said once, when the dir was found gone.
            StoreError::DirLost(_) => larder_stats::add(&stats.cache_writes_skipped, 1),
            // A failing disk fails every write: said once a minute, counted each time.
            _ => {
                larder_stats::add(&stats.cache_write_failures, 1);
                if let Some(unsaid) = self.write_failures_said.again() {
                    tracing::warn!(
                        %error,
                        unsaid,
                        "cache write failed; the block was served from memory (said at \
                         most once a minute, with the failures unsaid since; every one is \
                         counted in larder_cache_write_failures_total)"
                    );
                }
            }
        }
        self.remember_unstored(key, error);
    }

    /// Remembers why the cache write of `key` failed, for a [`Cache::fill`] waiting for it,
    /// and forgets reasons older than [`FAILED_FILL_MEMORY`] that nobody asked for.
    fn remember_unstored(&self, key: BlockKey, error: StoreError) {
        self.unstored.record([key], &Arc::new(Unstored::Write(error)));
    }

    /// Why the cache write of `key` failed, if it did lately: every waiter of the block is
    /// told, not only the first to ask (the reason is swept with the others once old).
    pub(crate) fn unstored(&self, key: BlockKey) -> Option<Arc<Unstored>> {
        self.unstored.get(key)
    }

    /// The cache write of `key` ended, written or not: the block leaves the in-flight map,
    /// and whoever waits for the end of a write is woken.
    fn write_ended(&self, key: BlockKey) {
        self.inflight.lock().remove(&key);
        self.written.notify_waiters();
    }

    /// Completes at the next end of a cache write (see [`Notify::notified`]).
    pub(crate) fn next_write_end(&self) -> Notified<'_> {
        self.written.notified()
    }
}

/// What happened to blocks lately: each entry is kept [`FAILED_FILL_MEMORY`], and entries
/// older than that are swept whenever new ones are recorded.
#[derive(Debug)]
struct Lately<T>(Mutex<HashMap<BlockKey, (T, Instant)>>);

impl<T> Default for Lately<T> {
    fn default() -> Self {
        Self(Mutex::new(HashMap::new()))
    }
}

impl<T: Clone> Lately<T> {
    /// Records `value` for each of `keys`.
    fn record(&self, keys: impl IntoIterator<Item = BlockKey>, value: &T) {
        let now = Instant::now();
        let mut map = self.0.lock();
        map.retain(|_, (_, at)| now.duration_since(*at) < FAILED_FILL_MEMORY);
        for key in keys {
            map.insert(key, (value.clone(), now));
        }
    }

    /// The value recorded for `key` less than [`FAILED_FILL_MEMORY`] ago.
    fn get(&self, key: BlockKey) -> Option<T> {
        let map = self.0.lock();
        let (value, at) = map.get(&key)?;
        (at.elapsed() < FAILED_FILL_MEMORY).then(|| value.clone())
    }
}

/// The blocks of a fill still to come: the waiters and memory charges of the blocks not yet
/// complete. Each tier pushes complete, verified blocks into it, in order.
#[derive(Debug)]
pub struct Run<'a> {
    cache: &'a Cache,
    object: &'a Arc<OpenObject>,
    /// The block the run waits for.
    next: u32,
    waiters: std::vec::IntoIter<oneshot::Sender<FillResult>>,
    /// Whom the fill is for.
    fill_for: FillFor,
    /// A block's worth of memory for each block not yet complete, taken when the fill was
    /// started (see [`Cache::start_fill`]): a fill never takes memory it was not admitted
    /// with.
    charge: Charge,
}

impl Run<'_> {
    /// Whom the fill is for.
    pub fn fill_for(&self) -> FillFor {
        self.fill_for
    }

    /// Block `index`, complete and verified, from the tier `provenance` says: accepted only if
    /// it is the block the run waits for next. It is handed to its waiter, then written.
    pub fn push(&mut self, index: u32, block: VerifiedBlock, provenance: Provenance) -> Result<(), NotNext> {
        if index != self.next || self.waiters.as_slice().is_empty() {
            return Err(NotNext {
                index,
                next: self.next,
            });
        }
        let (source, peer) = match provenance {
            Provenance::Origin => (Source::Origin, None),
            Provenance::Peer { unchecked } => (Source::Peer, unchecked),
        };
        self.deliver(block, source, peer);
        Ok(())
    }

    /// Hands the run's next block, now complete, to its waiter, then writes it to disk in the
    /// background. The block's memory charge goes with its bytes (to the waiters and the
    /// write), and counts as waiting for the write until the write is done. `peer`: the member
    /// that supplied it, when the origin check is still to vouch for it.
    fn deliver(&mut self, block: VerifiedBlock, source: Source, peer: Option<Arc<str>>) {
        let (cache, object, index) = (self.cache, self.object, self.next);
        let waiter = self.waiters.next();
        let charge = Arc::new(self.charge.split(cache.store().block_size()));
        let writing = charge.writing();
        self.next += 1;
        // Whether a reader is waiting for the block, or it was fetched ahead of any reader.
        let served = cache.fills().awaited((object.id, index));
        let fetched = Block {
            bytes: charged(block.bytes(), charge),
            start: cache.block_start(index),
            source,
            written: None,
            hash: block.hash(),
        };
        if !served && self.fill_for == FillFor::Node {
            cache.keep((object.id, index), &fetched);
        }
        let fetched_from = match source {
            Source::Peer => Fetched::Peer,
            Source::Origin | Source::Nvme => Fetched::Origin,
        };
        if let Some(tx) = waiter {
            let _ = tx.send(Ok(fetched));
        }
        let (cache, object) = (cache.clone(), object.clone());
        self.cache.spawn(async move {
            let _writing = writing;
            // Kept for the origin check of blocks from rack peers, which then combines them.
            let crcs = cache.checks().keeps_crcs().then(|| BlockCrcs::of(&block.bytes()));
            let unsettled = peer.is_some();
            let written = cache
                .store()
                .write_block(&object.version, index, &block, (served, fetched_from), unsettled)
                .await;
            let stored = written.is_ok();
            if stored {
                cache.note_written((object.id, index), block.hash(), peer, crcs);
            }
            if let Err(error) = written {
                cache
                    .fills()
                    .write_failed(cache.stats(), (object.id, index), error);
            }
            // Queued before the block leaves the in-flight map, so whoever waited for the write
            // finds the check queued.
            if stored {
                cache.queue_check(&object);
            }
            cache.fills().write_ended((object.id, index));
        });
    }

    /// The block the run waits for next.
    pub fn next_block(&self) -> u32 {
        self.next
    }

    /// Blocks of the run not yet supplied.
    pub fn blocks_left(&self) -> u32 {
        self.waiters.len() as u32
    }

    /// The cache's block size.
    pub fn block_size(&self) -> u64 {
        self.cache.store().block_size()
    }

    /// The length of block `index` of the run's object.
    pub fn block_len(&self, index: u32) -> usize {
        self.cache.store().block_len(self.object.version.size, index) as usize
    }

    /// Blocks in one origin part: the unit runs are owned by.
    pub fn part_blocks(&self) -> u32 {
        self.cache.part_blocks()
    }

    /// The bytes still missing, from the start of the first incomplete block.
    fn remaining(&self) -> Range<u64> {
        let block_size = self.cache.store().block_size();
        let start = u64::from(self.next) * block_size;
        let end = (start + self.waiters.len() as u64 * block_size).min(self.object.version.size);
        start..end
    }
}

impl Cache {
    /// Registers and spawns a fill from block `first` to the end of its origin part, stopping
    /// before any block already present or in flight, and where the memory budget stops it.
    /// `charge` is the first block's memory, taken by the caller as the budget allows (the
    /// readahead: if it fits; a job: once it fits; a reader waiting: if it fits, else `None`,
    /// and the fill task waits for room, a bounded time, before it fetches); each further block
    /// of the run is charged here only if it fits. Returns the blocks it covers.
    pub(crate) fn start_fill(
        &self,
        object: &Arc<OpenObject>,
        first: u32,
        inflight: &mut HashMap<BlockKey, SharedFill>,
        fill_for: FillFor,
        charge: Option<Charge>,
    ) -> Range<u32> {
        let wait_for_room = charge.is_none();
        let mut charge = charge.unwrap_or_else(|| self.budget().charge(0));
        let block_size = self.store().block_size();
        let part_blocks = self.part_blocks();
        let part_end = ((first / part_blocks + 1) * part_blocks).min(self.block_count(object));
        let mut end = first + 1;
        // A fill that waits for room for its first block takes no more.
        while !wait_for_room
            && end < part_end
            && !inflight.contains_key(&(object.id, end))
            && !self.store().contains(object.id, end)
        {
            let Some(more) = self.budget().try_charge(block_size) else {
                larder_stats::add(&self.stats().readahead_held_back, 1);
                break;
            };
            charge.merge(more);
            end += 1;
        }
        let mut waiters = Vec::with_capacity((end - first) as usize);
        for index in first..end {
            let (tx, rx) = oneshot::channel::<FillResult>();
            let fill = rx
                .map(|r| r.unwrap_or(Err(ReadError::Abandoned)))
                .boxed()
                .shared();
            inflight.insert((object.id, index), fill);
            waiters.push(tx);
        }
        let cache = self.clone();
        let object = object.clone();
        self.spawn(async move {
            let mut charge = charge;
            if wait_for_room {
                let budget = cache.budget();
                charge.merge(budget.charge_soon(block_size, MEMORY_PATIENCE).await);
            }
            cache.run_fill(object, first, waiters, fill_for, charge).await;
        });
        first..end
    }

    /// The body of a fill task: the run from each source in turn until it is complete.
    async fn run_fill(
        self,
        object: Arc<OpenObject>,
        first: u32,
        waiters: Vec<oneshot::Sender<FillResult>>,
        fill_for: FillFor,
        charge: Charge,
    ) {
        let started = Instant::now();
        // A slow disk holds fills back instead of piling up blocks waiting for their write.
        self.budget().writes_below_limit().await;
        let mut result = Err(ReadError::Abandoned);
        let (next, waiters) = {
            let mut run = Run {
                cache: &self,
                object: &object,
                next: first,
                waiters: waiters.into_iter(),
                fill_for,
                charge,
            };
            let sources = self.fills().sources_for(fill_for);
            let mut tier = 0;
            while let Some(source) = sources.get(tier) {
                let mut range = run.remaining();
                if range.is_empty() {
                    break;
                }
                // A tier that answered late (a rack peer's owner) is most likely slow, not
                // gone, and already filling the run: the next tier supplies one block, so the
                // reader moves on, and the late one is asked again for the rest, rather than
                // the whole run fetched a second time. Each late answer costs one block; an
                // owner late three times in a row has its circuit opened, and the run's next
                // candidate is asked instead.
                let hedge = matches!(result, Err(ReadError::PeerLate(_)))
                    && range.end - range.start > run.block_size();
                if hedge {
                    range.end = range.start + run.block_size();
                }
                result = tokio::select! {
                    biased;
                    () = self.stopped() => Err(ReadError::Abandoned),
                    fetched = source.fetch(&object, range, &mut run) => fetched,
                };
                // A failure is not logged here: a reader's error is logged once, where the mount
                // answers it; a job's, in the job's report.
                match (&result, hedge) {
                    (Ok(()), true) => {
                        larder_stats::add(&self.stats().peer_hedged_blocks, 1);
                        tier -= 1;
                    }
                    (Ok(()), false) => {
                        if source.kind() == Source::Origin {
                            self.latency().fill_origin.observe(started.elapsed());
                        }
                        break;
                    }
                    (Err(_), _) => tier += 1,
                }
            }
            (run.next, run.waiters)
        };
        // Blocks no source supplied: their waiters get the last error, and so do later reads
        // for a short while (then they try again).
        let error = result.err().unwrap_or(ReadError::Abandoned);
        self.fills().fail(object.id, next, waiters, &error);
    }
}
