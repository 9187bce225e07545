//! Reads of blocks from disk, each checked against the block's recorded BLAKE3 (whole, or
//! group by group with its stored tree), and the uses they record for the eviction policy.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use larder_block_tree::{self as tree, CV_LEN, GROUP};
use larder_engine::{ALIGN, AlignedBuf};
use larder_object::{ObjectId, ObjectVersion};
use tokio::sync::OnceCell;

use crate::files::ObjectFiles;
use crate::held_dir::Names;
use crate::index::{BlockMeta, used};
use crate::values::{values_read, write_values};
use crate::{BlockStore, Hit, Lookup, Removal, StoreError, VerifiedBlock, Written, blocking, io_error};

/// The largest read [`BlockStore::read_now`] serves on the calling thread: a few groups, read
/// and checked in tens of microseconds.
pub const READ_NOW_MAX: usize = 128 << 10;

impl BlockStore {
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
                self.remove_block(id, index, meta.generation, Removal::of(&error))
                    .await;
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
        let block = self.read_whole(&files, id, index, block_len, meta.hash).await?;
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

    /// Block `index` (`len` bytes) read whole from the data file and checked against `hash`.
    pub(crate) async fn read_whole(
        &self,
        files: &ObjectFiles,
        id: ObjectId,
        index: u32,
        len: usize,
        hash: [u8; 32],
    ) -> Result<VerifiedBlock, StoreError> {
        let buf = self.read_data(files, id, index, 0..len).await?;
        VerifiedBlock::verify(Arc::new(buf), hash).map_err(|_| StoreError::Corrupt {
            id,
            index,
            reason: "not what its record's BLAKE3 names",
        })
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
}
