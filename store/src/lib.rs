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

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod files;
pub mod format;
mod health;
mod held_dir;
mod hold;
mod index;
mod policy;
mod replay;
mod values;
mod verified;

use std::io::{self, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use larder_block_tree::{self as tree, CV_LEN, GROUP};
pub use larder_block_tree::{GroupCheck, GroupHasher};
use larder_config::CacheConfig;
use larder_engine::{ALIGN, AlignedBuf, IoEngine, align_up};
use larder_object::{ObjectId, ObjectVersion};
use larder_stats::{StoreStats, add};
use parking_lot::Mutex;
use rustix::fs::FallocateFlags;
use tokio::sync::OnceCell;

pub use files::object_paths;
use files::{ObjectFiles, open_object_files};
use format::Entry;
use held_dir::{HeldDir, Names};
pub use hold::{BlockHold, Lease};
pub use index::Usage;
use index::{BlockMeta, ObjectState, State, used};
pub use values::VALUES_EXTENSION;
use values::{values_read, write_values};
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

/// The largest read [`BlockStore::read_now`] serves on the calling thread: a few groups, read
/// and checked in tens of microseconds.
pub const READ_NOW_MAX: usize = 128 << 10;

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

/// A block written awaiting a check from outside the store (see [`BlockStore::unsettled`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsettledBlock {
    /// Its index in the object.
    pub index: u32,
    /// Its BLAKE3, as recorded.
    pub hash: [u8; 32],
    /// Which insertion of the block it is: a block replaced since is not this one.
    generation: u64,
}

/// A block chosen for eviction, to be recorded removed and punched outside the lock.
struct Victim {
    id: ObjectId,
    index: u32,
    files: Arc<OnceCell<Arc<ObjectFiles>>>,
    /// The object has no block left and is deleted with its files.
    delete_object: bool,
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

    /// Reads block `index` of `version` whole (see [`BlockStore::read`]).
    pub async fn read_block(
        &self,
        version: &ObjectVersion,
        id: ObjectId,
        index: u32,
    ) -> Result<Lookup, StoreError> {
        let len = self.block_len(version.size, index) as usize;
        self.read(version, id, index, 0..len).await
    }

    /// Reads bytes `range` of block `index` of `version` from disk, checked every time (unless
    /// verification is off, when only the 4 KiB pages that hold `range` are read): a read of
    /// the whole block against its recorded BLAKE3, a read of part of it group by group (the
    /// 16 KiB groups it touches, against the block's stored tree; see `read_checked`). Bytes
    /// changed on disk after an earlier check are never served through the daemon. A block
    /// checked whole is marked verified in this process, which is what passthrough asks of
    /// every block of a file.
    ///
    /// An error means the disk failed (`Io`) or gave bytes that are short or do not match the
    /// record (`Corrupt`); the block has then been dropped from the store, so the caller
    /// fetches it elsewhere and the next write replaces it.
    pub async fn read(
        &self,
        version: &ObjectVersion,
        id: ObjectId,
        index: u32,
        range: Range<usize>,
    ) -> Result<Lookup, StoreError> {
        let (meta, files) = {
            let state = self.state.lock();
            let Some(object) = state.objects.get(&id) else {
                return Ok(Lookup::Miss);
            };
            let Some(meta) = object.blocks.get(&index) else {
                return Ok(Lookup::Miss);
            };
            (meta.clone(), object.files.clone())
        };
        let read = self.read_checked(version, id, index, range, &meta, &files).await;
        let (bytes, checked_whole) = match read {
            Ok(read) => read,
            Err(error) => {
                self.disk_failed(&error);
                self.remove_block(id, index, meta.generation).await;
                return Err(error);
            }
        };
        match self.served(id, index, Some(meta.generation), checked_whole) {
            Some(written) => Ok(Lookup::Hit(Hit {
                bytes,
                written,
                hash: meta.hash,
            })),
            None => Ok(Lookup::LostRace),
        }
    }

    /// Bytes `range` of block `index`, read and checked on the calling thread, for a small
    /// read that should not wait for a thread hop: only a part of a block (at most
    /// [`READ_NOW_MAX`]) whose files are open and whose tree is stored, checked as
    /// [`BlockStore::read`] checks it. `None` for anything else, and for anything that went
    /// wrong (the block is gone, the disk failed, the bytes do not check): the caller then
    /// reads through [`BlockStore::read`], which reports and handles it.
    pub fn read_now(&self, id: ObjectId, size: u64, index: u32, range: Range<usize>) -> Option<Hit> {
        if range.len() > READ_NOW_MAX {
            return None;
        }
        let (meta, files) = {
            let state = self.state.lock();
            let object = state.objects.get(&id)?;
            (object.blocks.get(&index)?.clone(), object.files.get()?.clone())
        };
        let block_len = self.block_len(size, index) as usize;
        let groups = tree::groups_in(block_len);
        let Range { start: from, end: to } = tree::covering(&range, block_len);
        if !self.verify || groups == 0 || to - from >= block_len {
            return None;
        }
        let count = tree::nodes_in(block_len);
        let slot = AlignedBuf::new(count * CV_LEN);
        let read = larder_engine::read_at(&files.values, self.values_slot(index), slot);
        let stored = values_read(read, count)?;
        let offset = u64::from(index) * self.block_size + from as u64;
        let (buf, read) = larder_engine::read_at(&files.data, offset, AlignedBuf::new(to - from));
        if read.ok()? < to - from
            || !tree::check_groups(buf.as_ref(), from / GROUP, &stored, block_len, &meta.hash)
        {
            return None;
        }
        let written = self.served(id, index, Some(meta.generation), false)?;
        Some(Hit {
            bytes: Bytes::from_owner(buf).slice(range.start - from..range.end - from),
            written,
            hash: meta.hash,
        })
    }

    /// Records that block `index` was handed to a reader from memory, where it was kept since
    /// its fill: a use, for the eviction policy, as a read from disk would be.
    pub fn note_served(&self, id: ObjectId, index: u32) {
        self.served(id, index, None, false);
    }

    /// Records that block `index` of generation `generation` (any, with `None`) was read for a
    /// reader (checked whole, or not), and says when and where this process fetched it, if it
    /// did: `None` if it was evicted or replaced meanwhile.
    fn served(
        &self,
        id: ObjectId,
        index: u32,
        generation: Option<u64>,
        checked_whole: bool,
    ) -> Option<Option<Written>> {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let current = state
            .objects
            .get_mut(&id)
            .and_then(|o| o.blocks.get_mut(&index))
            .filter(|m| generation.is_none_or(|g| m.generation == g));
        let current = current?;
        current.verified |= checked_whole;
        let written = current.fetched.map(|from| Written {
            generation: current.generation,
            from,
        });
        // Only a read that served bytes counts as a use for the eviction policy.
        used(&mut state.policy, (id, index), current);
        Some(written)
    }

    /// The disk read of [`BlockStore::read`] and its check: bytes `range` of the block, and
    /// whether the whole block was checked. A read of the whole block is checked against the
    /// recorded root directly. A read of part of it reads and checks only the groups it
    /// touches, with the block's stored tree; without it (a block written before trees were
    /// kept, or whose tree was lost) the block is read and checked whole, and its tree stored
    /// for the next such read.
    async fn read_checked(
        &self,
        version: &ObjectVersion,
        id: ObjectId,
        index: u32,
        range: Range<usize>,
        meta: &BlockMeta,
        files: &OnceCell<Arc<ObjectFiles>>,
    ) -> Result<(Bytes, bool), StoreError> {
        let files = self.files(version, files, false).await?;
        let block_len = self.block_len(version.size, index) as usize;
        let corrupt = |reason| StoreError::Corrupt { id, index, reason };
        if !self.verify {
            let from = range.start / ALIGN * ALIGN;
            let buf = self.read_data(&files, id, index, from..range.end).await?;
            return Ok((
                Bytes::from_owner(buf).slice(range.start - from..range.end - from),
                false,
            ));
        }
        let groups = tree::groups_in(block_len);
        let Range { start: from, end: to } = tree::covering(&range, block_len);
        // Part of a block is checked by its groups; a whole block against the root directly,
        // with no values to read.
        let partial = groups > 0 && to - from < block_len;
        // The tree and the groups' bytes are read at once: one disk round trip.
        let values_and_data = if partial {
            let (values, data) = tokio::join!(
                self.stored_values(&files, index, tree::nodes_in(block_len)),
                self.read_data(&files, id, index, from..to)
            );
            values.map(|values| (values, data))
        } else {
            None
        };
        if let Some((stored, buf)) = values_and_data {
            let buf = buf?;
            if !tree::check_groups(buf.as_ref(), from / GROUP, &stored, block_len, &meta.hash) {
                return Err(corrupt("not what its record's BLAKE3 names"));
            }
            return Ok((
                Bytes::from_owner(buf).slice(range.start - from..range.end - from),
                false,
            ));
        }
        let buf = self.read_data(&files, id, index, 0..block_len).await?;
        let block = VerifiedBlock::verify(Arc::new(buf), meta.hash)
            .map_err(|_| corrupt("not what its record's BLAKE3 names"))?;
        // A part asked for without values: store them for the next such read.
        if partial {
            let (tree, slot) = (block.tree().clone(), self.values_slot(index));
            let path = self.held.path(&Names::of(id).values);
            let stored = blocking(move || write_values(&files.values, slot, &tree, block_len, &path)).await;
            if let Err(error) = stored {
                tracing::debug!(%error, "could not store a block's tree");
            }
        }
        Ok((block.bytes().slice(range), true))
    }

    /// Bytes `range` of block `index` from the data file, all of them or an error.
    async fn read_data(
        &self,
        files: &ObjectFiles,
        id: ObjectId,
        index: u32,
        range: Range<usize>,
    ) -> Result<AlignedBuf, StoreError> {
        let offset = u64::from(index) * self.block_size + range.start as u64;
        let (buf, result) = self
            .engine
            .read(files.data.clone(), offset, AlignedBuf::new(range.len()))
            .await;
        let done = result.map_err(io_error("read", &self.held.path(&Names::of(id).data)))?;
        if done < range.len() {
            return Err(StoreError::Corrupt {
                id,
                index,
                reason: "shorter than recorded",
            });
        }
        Ok(buf)
    }

    /// Stores block `index` of `version`. Reserves room first (evicting least recently used
    /// unpinned blocks), writes the bytes, then records them. `served`: a reader already had
    /// the bytes (a block fetched ahead has not been read yet). `fetched`: where they came
    /// from. `unsettled`: the block awaits a check from outside the store (see
    /// [`BlockStore::unsettled`]).
    pub async fn write_block(
        &self,
        version: &ObjectVersion,
        index: u32,
        block: &VerifiedBlock,
        (served, fetched): (bool, Fetched),
        unsettled: bool,
    ) -> Result<(), StoreError> {
        let id = version.id();
        let alloc = align_up(block.len() as u64);
        if !self.held.intact() {
            self.give_up();
        }
        let free = self.held.free_space();
        let (files_cell, victims) = {
            let mut guard = self.state.lock();
            let state = &mut *guard;
            if state.dir_lost {
                return Err(StoreError::DirLost(self.held.dir().to_owned()));
            }
            if state
                .objects
                .get(&id)
                .is_some_and(|o| o.blocks.contains_key(&index))
            {
                return Ok(());
            }
            let victims = self.reserve(state, alloc, free, id)?;
            let object = state
                .objects
                .entry(id)
                .or_insert_with(|| ObjectState::new(version.size));
            object.writers += 1;
            (object.files.clone(), victims)
        };
        self.drop_victims(victims).await;
        let written = self
            .write_and_record(version, &files_cell, index, block, unsettled)
            .await;
        match &written {
            Ok(()) => self.disk_works(),
            Err(error) => self.disk_failed(error),
        }
        let mut guard = self.state.lock();
        let state = &mut *guard;
        state.reserved -= alloc;
        let object = match state.objects.get_mut(&id) {
            Some(object) => object,
            None => return written,
        };
        object.writers -= 1;
        if written.is_ok() {
            object.on_disk = true;
            state.next_generation += 1;
            state.blocks += 1;
            object.blocks.insert(
                index,
                BlockMeta {
                    hash: block.hash(),
                    generation: state.next_generation,
                    verified: true,
                    served,
                    fetched: Some(fetched),
                    unsettled,
                },
            );
            state.used += alloc;
            if object.pinned {
                state.pinned_bytes += alloc;
            }
            self.admit(state, (id, index));
            add(&self.stats.cache_write_bytes, block.len() as u64);
        }
        written
    }

    async fn write_and_record(
        &self,
        version: &ObjectVersion,
        files: &OnceCell<Arc<ObjectFiles>>,
        index: u32,
        block: &VerifiedBlock,
        unsettled: bool,
    ) -> Result<(), StoreError> {
        let files = self.files(version, files, true).await?;
        let names = Names::of(version.id());
        let (data_path, rec_path) = (self.held.path(&names.data), self.held.path(&names.rec));
        let values_path = self.held.path(&names.values);
        let (tree, slot, len) = (block.tree().clone(), self.values_slot(index), block.len());
        let offset = u64::from(index) * self.block_size;
        let is_last = offset + block.len() as u64 >= version.size;
        let written = self
            .engine
            .write(files.data.clone(), offset, block.buf().clone())
            .await;
        written.map_err(io_error("write", &data_path))?;
        let hash = block.hash();
        let entry = if unsettled {
            Entry::Unsettled { index, hash }
        } else {
            Entry::Present { index, hash }
        }
        .encode();
        let size = version.size;
        blocking(move || {
            if is_last {
                // The padded write may have grown the file past the object's end.
                files
                    .data
                    .set_len(size)
                    .map_err(io_error("truncate", &data_path))?;
            }
            write_values(&files.values, slot, &tree, len, &values_path)?;
            (&files.record)
                .write_all(&entry)
                .map_err(io_error("append", &rec_path))
        })
        .await
    }

    /// Chooses victims until `alloc` more bytes fit within capacity and free space, and
    /// reserves them. `id` is the object being written, whose files must not be deleted.
    fn reserve(
        &self,
        state: &mut State,
        alloc: u64,
        free: Option<(u64, u64)>,
        id: ObjectId,
    ) -> Result<Vec<Victim>, StoreError> {
        let over_capacity = (state.used + state.reserved + alloc).saturating_sub(self.capacity);
        let over_free_space = free.map_or(0, |(available, total)| {
            let keep = (total as f64 * self.min_free_fraction) as u64;
            (keep + state.reserved + alloc).saturating_sub(available)
        });
        let mut need = over_capacity.max(over_free_space);
        if need > state.policy.bytes() {
            let reason = if over_free_space > over_capacity {
                "the cache file system has less free space than cache.min_free_fraction keeps, \
                 and evicting every unpinned block would not make enough"
            } else {
                "the rest of the cache is pinned or in use"
            };
            return Err(StoreError::NoSpace { bytes: alloc, reason });
        }
        let mut chosen = Vec::new();
        while need > 0 {
            let Some(((victim_id, index), bytes)) = state.policy.pop_victim() else {
                break;
            };
            need = need.saturating_sub(bytes);
            chosen.push(Victim {
                id: victim_id,
                index,
                files: Arc::default(),
                delete_object: false,
            });
        }
        let mut victims = Vec::with_capacity(chosen.len());
        for mut victim in chosen {
            let Some(object) = state.objects.get_mut(&victim.id) else {
                continue;
            };
            if object.blocks.remove(&victim.index).is_none() {
                continue;
            }
            state.blocks -= 1;
            let freed = align_up(self.block_len(object.size, victim.index));
            state.used -= freed;
            if object.pinned {
                state.pinned_bytes -= freed;
            }
            add(&self.stats.evicted_blocks, 1);
            add(&self.stats.evicted_bytes, freed);
            victim.files = object.files.clone();
            if object.blocks.is_empty() && object.writers == 0 && !object.protected() && victim.id != id {
                state.objects.remove(&victim.id);
                victim.delete_object = true;
            }
            victims.push(victim);
        }
        state.reserved += alloc;
        Ok(victims)
    }

    /// Records victims removed and frees their space: whole files for objects left empty,
    /// punched holes otherwise.
    async fn drop_victims(&self, victims: Vec<Victim>) {
        if victims.is_empty() {
            return;
        }
        let block_size = self.block_size;
        let held = self.held.clone();
        let result = blocking(move || {
            for victim in victims {
                let names = Names::of(victim.id);
                if victim.delete_object {
                    held.remove_all(&names);
                    continue;
                }
                let files = match victim.files.get() {
                    Some(files) => files.clone(),
                    // Replayed at start and not opened since.
                    None => Arc::new(open_object_files(&held, &names, None)?),
                };
                punch_block(&files, victim.index, block_size, &held.path(&names.rec))?;
            }
            Ok(())
        })
        .await;
        if let Err(error) = result {
            tracing::warn!(%error, "could not free an evicted block's space");
        }
    }

    /// Drops one block (found corrupt, or failing the origin check), if it is still the
    /// generation that was read.
    async fn remove_block(&self, id: ObjectId, index: u32, generation: u64) {
        let victim = {
            let mut guard = self.state.lock();
            let state = &mut *guard;
            let Some(object) = state.objects.get_mut(&id) else {
                return;
            };
            if object
                .blocks
                .get(&index)
                .is_none_or(|m| m.generation != generation)
            {
                return;
            }
            object.blocks.remove(&index);
            state.blocks -= 1;
            let freed = align_up(self.block_len(object.size, index));
            state.used -= freed;
            if object.pinned {
                state.pinned_bytes -= freed;
            }
            state.policy.remove(&(id, index));
            Victim {
                id,
                index,
                files: object.files.clone(),
                delete_object: false,
            }
        };
        self.drop_victims(vec![victim]).await;
    }

    /// The blocks of object `id` (of `size` bytes) written awaiting a check from outside the
    /// store and not settled yet, when every block of it is present and at least one is such;
    /// else `None`.
    pub fn unsettled(&self, id: ObjectId, size: u64) -> Option<Vec<UnsettledBlock>> {
        let count = size.div_ceil(self.block_size);
        let state = self.state.lock();
        let object = state.objects.get(&id)?;
        if object.blocks.len() as u64 != count {
            return None;
        }
        let blocks: Vec<UnsettledBlock> = object
            .blocks
            .iter()
            .filter(|(_, meta)| meta.unsettled)
            .map(|(&index, meta)| UnsettledBlock {
                index,
                hash: meta.hash,
                generation: meta.generation,
            })
            .collect();
        (!blocks.is_empty()).then_some(blocks)
    }

    /// No check waits for `blocks` of `id` (those still in place) any more: it passed, or
    /// there is nothing to check them against. Recorded, so that a restart does not check them
    /// again; if the record cannot be written they stay settled in memory only (and are
    /// checked again after a restart).
    pub async fn settle(&self, id: ObjectId, blocks: &[UnsettledBlock]) {
        let (files, settled) = {
            let mut state = self.state.lock();
            let Some(object) = state.objects.get_mut(&id) else {
                return;
            };
            let mut settled = Vec::new();
            for block in blocks {
                if let Some(meta) = object.blocks.get_mut(&block.index)
                    && meta.generation == block.generation
                {
                    meta.unsettled = false;
                    settled.push(block.index);
                }
            }
            (object.files.clone(), settled)
        };
        if settled.is_empty() {
            return;
        }
        let held = self.held.clone();
        let result = blocking(move || {
            let names = Names::of(id);
            let files = match files.get() {
                Some(files) => files.clone(),
                None => Arc::new(open_object_files(&held, &names, None)?),
            };
            let entries: Vec<u8> = settled
                .into_iter()
                .flat_map(|index| Entry::Settled { index }.encode())
                .collect();
            (&files.record)
                .write_all(&entries)
                .map_err(io_error("append", &held.path(&names.rec)))
        })
        .await;
        if let Err(error) = result {
            tracing::warn!(%error, "could not record blocks as checked; they are checked again after a restart");
        }
    }

    /// Drops `blocks` of `id` (those still in place) from the store: their check failed.
    pub async fn drop_unsettled(&self, id: ObjectId, blocks: &[UnsettledBlock]) {
        for block in blocks {
            self.remove_block(id, block.index, block.generation).await;
        }
    }

    /// Drops every block of object `id` present now: its content failed the digest that
    /// names it. Blocks written after this call stay.
    pub async fn drop_object(&self, id: ObjectId) {
        let blocks: Vec<(u32, u64)> = {
            let state = self.state.lock();
            let Some(object) = state.objects.get(&id) else {
                return;
            };
            object
                .blocks
                .iter()
                .map(|(&index, meta)| (index, meta.generation))
                .collect()
        };
        for (index, generation) in blocks {
            self.remove_block(id, index, generation).await;
        }
    }
}

/// Records block `index` removed, then punches its hole.
fn punch_block(files: &ObjectFiles, index: u32, block_size: u64, rec_path: &Path) -> Result<(), StoreError> {
    (&files.record)
        .write_all(&Entry::Removed { index }.encode())
        .map_err(io_error("append", rec_path))?;
    let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
    rustix::fs::fallocate(&*files.data, flags, u64::from(index) * block_size, block_size).map_err(|e| {
        StoreError::Io {
            op: "punch",
            path: rec_path.with_extension("data"),
            source: e.into(),
        }
    })
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
