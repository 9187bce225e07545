//! The scrub: the blocks of files handed to the kernel read back from disk and checked against
//! their recorded BLAKE3, one at a time, at a pace the caller sets (the daemon's
//! `cache.scrub_rate`).
//!
//! Passthrough hands the kernel an object's data file, whose reads then never reach the daemon:
//! a sector that fails or bytes that rot under such a file would be served (or fail) unseen,
//! where every read through the daemon is checked. The scrub is how the store sees them: a
//! block that fails its read or its check is dropped, as a failed read through the daemon
//! drops it, so the object is no longer complete and new opens go through the daemon, which
//! fetches the block again. A failed read also marks the disk failing (health.rs). Only objects
//! handed to the kernel since start are scrubbed (the others are checked on every read), those
//! open now first in every pass.

use std::collections::HashSet;

use larder_object::ObjectId;
use larder_stats::add;

use crate::{BlockStore, Removal, StoreError};

/// What the scrub of one block found.
#[derive(Debug)]
pub enum Scrubbed {
    /// Read back and checked: this many bytes read.
    Sound(u64),
    /// Gone (evicted or replaced) before or while it was read: nothing to say.
    Gone,
    /// The read (of this many bytes) failed or the bytes did not check: the block was dropped
    /// (the store logged why).
    Dropped(u64),
}

/// One pass of the scrub: the objects visited so far.
#[derive(Debug, Default)]
pub struct ScrubPass {
    visited: HashSet<ObjectId>,
}

impl BlockStore {
    /// The next object of `pass` and its present blocks: of the objects handed to the kernel
    /// since start, those open now first (their bytes reach readers unchecked); `None` once
    /// every one has been visited.
    pub fn scrub_next(&self, pass: &mut ScrubPass) -> Option<(ObjectId, Vec<u32>)> {
        let state = self.state.lock();
        let unvisited = state
            .objects
            .iter()
            .filter(|(id, object)| object.handed && !pass.visited.contains(id) && !object.blocks.is_empty());
        let (id, object) = unvisited.max_by_key(|(_, object)| object.leases > 0)?;
        pass.visited.insert(*id);
        let mut blocks: Vec<u32> = object.blocks.keys().copied().collect();
        blocks.sort_unstable();
        Some((*id, blocks))
    }

    /// Reads block `index` of `id` back whole, straight from the disk, and checks it against
    /// its recorded BLAKE3. One whose read fails or whose bytes do not check is dropped. Not a
    /// use for the eviction policy.
    pub async fn scrub_block(&self, id: ObjectId, index: u32) -> Scrubbed {
        let Some((meta, size, cell)) = ({
            let state = self.state.lock();
            state.objects.get(&id).and_then(|object| {
                let meta = object.blocks.get(&index)?.clone();
                Some((meta, object.size, object.files.clone()))
            })
        }) else {
            return Scrubbed::Gone;
        };
        let opened = self.object_files(id, &cell, None).await;
        let len = self.block_len(size, index) as usize;
        let checked = match opened {
            Ok(files) => self.read_whole(&files, id, index, len, meta.hash).await.map(drop),
            Err(error) => Err(error),
        };
        match checked {
            Ok(()) => {
                add(&self.stats.scrubbed_bytes, len as u64);
                Scrubbed::Sound(len as u64)
            }
            // Evicted or replaced while read (a punched hole reads as zeros): nothing to say.
            Err(_) if !self.is_generation(id, index, meta.generation) => Scrubbed::Gone,
            Err(error) => {
                match error {
                    StoreError::Corrupt { .. } => add(&self.stats.scrub_corrupt_blocks, 1),
                    _ => add(&self.stats.scrub_read_errors, 1),
                }
                tracing::warn!(%error, "the scrub dropped a block; it is fetched again when read");
                self.disk_failed(&error);
                self.remove_block(id, index, meta.generation, Removal::of(&error))
                    .await;
                Scrubbed::Dropped(len as u64)
            }
        }
    }

    /// Whether block `index` of `id` is present as generation `generation`.
    fn is_generation(&self, id: ObjectId, index: u32, generation: u64) -> bool {
        let state = self.state.lock();
        let meta = state.objects.get(&id).and_then(|o| o.blocks.get(&index));
        meta.is_some_and(|m| m.generation == generation)
    }
}
