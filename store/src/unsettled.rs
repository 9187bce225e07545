//! Unsettled blocks: written awaiting a check from outside the store (the read path's
//! origin check), then settled (recorded so) or dropped. The store never knows who supplied
//! them.

use std::io::Write;
use std::sync::Arc;

use larder_object::ObjectId;

use crate::files::open_object_files;
use crate::format::Entry;
use crate::held_dir::Names;
use crate::{BlockStore, Removal, blocking, io_error};

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

impl BlockStore {
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
            self.remove_block(id, block.index, block.generation, Removal::OriginMismatch)
                .await;
        }
    }
}
