//! Blocks taken out of the store: victims evicted to make room for a write, and blocks
//! dropped because they failed a check. Each is removed from the index, then recorded
//! removed, then its hole punched (or its object's files deleted).

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use larder_engine::align_up;
use larder_object::ObjectId;
use larder_stats::add;
use rustix::fs::FallocateFlags;
use tokio::sync::OnceCell;

use crate::files::{ObjectFiles, open_object_files};
use crate::format::Entry;
use crate::held_dir::Names;
use crate::index::{Removal, State};
use crate::{BlockStore, StoreError, blocking, io_error};

/// A block chosen for eviction, to be recorded removed and punched outside the lock.
pub(crate) struct Victim {
    id: ObjectId,
    index: u32,
    files: Arc<OnceCell<Arc<ObjectFiles>>>,
    /// The object has no block left and is deleted with its files.
    delete_object: bool,
    /// The kernel reads the data file itself (a passthrough lease): the block is recorded
    /// removed but its bytes stay, since a hole would read as zeros in the files already open.
    /// A new fill of the block writes over them; the object's eviction frees them.
    keep_bytes: bool,
}

impl BlockStore {
    /// Chooses victims until `alloc` more bytes fit within capacity and free space, and
    /// reserves them. `id` is the object being written, whose files must not be deleted.
    pub(crate) fn reserve(
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
        let for_free_space = over_free_space > over_capacity;
        if need > state.policy.bytes() {
            let reason = if for_free_space {
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
                keep_bytes: false,
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
            let why = if for_free_space {
                Removal::EvictedForFreeSpace
            } else {
                Removal::EvictedForCapacity
            };
            state.removed.note((victim.id, victim.index), why);
            victims.push(victim);
        }
        state.reserved += alloc;
        Ok(victims)
    }

    /// Records victims removed and frees their space: whole files for objects left empty,
    /// punched holes otherwise.
    pub(crate) async fn drop_victims(&self, victims: Vec<Victim>) {
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
                let rec_path = held.path(&names.rec);
                (&files.record)
                    .write_all(&Entry::Removed { index: victim.index }.encode())
                    .map_err(io_error("append", &rec_path))?;
                if !victim.keep_bytes {
                    punch_block(&files, victim.index, block_size, &held.path(&names.data))?;
                }
            }
            Ok(())
        })
        .await;
        if let Err(error) = result {
            tracing::warn!(%error, "could not free an evicted block's space");
        }
    }

    /// Drops one block (found corrupt, or failing the origin check) for reason `why`, if it is
    /// still the generation that was read.
    pub(crate) async fn remove_block(&self, id: ObjectId, index: u32, generation: u64, why: Removal) {
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
            state.removed.note((id, index), why);
            Victim {
                id,
                index,
                files: object.files.clone(),
                delete_object: false,
                keep_bytes: object.leases > 0,
            }
        };
        self.drop_victims(vec![victim]).await;
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
            self.remove_block(id, index, generation, Removal::DigestMismatch)
                .await;
        }
    }
}

/// Punches block `index`'s hole (once it is recorded removed).
fn punch_block(files: &ObjectFiles, index: u32, block_size: u64, data_path: &Path) -> Result<(), StoreError> {
    let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
    rustix::fs::fallocate(&*files.data, flags, u64::from(index) * block_size, block_size).map_err(|e| {
        StoreError::Io {
            op: "punch",
            path: data_path.to_owned(),
            source: e.into(),
        }
    })
}
