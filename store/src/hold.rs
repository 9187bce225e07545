//! What keeps blocks from eviction: pins (prefetch jobs), leases (a complete object's data
//! file handed to the kernel) and holds (a reader reading a block in pieces), and the one
//! rule for which blocks the eviction policy holds.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use larder_engine::align_up;
use larder_object::{ObjectId, ObjectVersion};
use rustix::fs::OFlags;

use crate::held_dir::Names;
use crate::index::{BlockKey, ObjectState, State, used};
use crate::{BlockStore, StoreError};

/// Bytes of a data file read before it is handed to the kernel (the first page, or the whole
/// file if it is smaller).
const PROBE_LEN: usize = 4096;

/// A hold on a complete object's blocks (see [`BlockStore::lease_complete`]).
#[derive(Debug)]
pub struct Lease {
    store: Arc<BlockStore>,
    id: ObjectId,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut guard = self.store.state.lock();
        let state = &mut *guard;
        if let Some(object) = state.objects.get_mut(&self.id) {
            let was = object.protected();
            object.leases -= 1;
            self.store.reprotect(state, self.id, was);
            // The kernel read the data file itself: a use of every block, unseen one by one.
            if let Some(object) = state.objects.get_mut(&self.id)
                && !object.protected()
            {
                for (&index, meta) in &mut object.blocks {
                    used(&mut state.policy, (self.id, index), meta);
                }
            }
        }
    }
}

/// A hold on one block (see [`BlockStore::hold`]).
#[derive(Debug)]
pub struct BlockHold {
    store: Arc<BlockStore>,
    key: BlockKey,
}

impl Drop for BlockHold {
    fn drop(&mut self) {
        let mut guard = self.store.state.lock();
        let state = &mut *guard;
        let Some(holds) = state.held.get_mut(&self.key) else {
            return;
        };
        *holds -= 1;
        if *holds > 0 {
            return;
        }
        state.held.remove(&self.key);
        self.store.admit(state, self.key);
    }
}

impl BlockStore {
    /// Pins or unpins an object version: pinned blocks are never evicted. Pinning an object
    /// with no block yet keeps the pin for the blocks to come.
    pub fn set_pinned(&self, version: &ObjectVersion, pinned: bool) {
        let id = version.id();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let object = state
            .objects
            .entry(id)
            .or_insert_with(|| ObjectState::new(version.size));
        let was = object.protected();
        if object.pinned != pinned {
            object.pinned = pinned;
            let bytes: u64 = object
                .blocks
                .keys()
                .map(|&index| align_up(self.block_len(object.size, index)))
                .sum();
            if pinned {
                state.pinned += 1;
                state.pinned_bytes += bytes;
            } else {
                state.pinned -= 1;
                state.pinned_bytes -= bytes;
            }
        }
        self.reprotect(state, id, was);
        if let Some(object) = state.objects.get(&id)
            && !object.protected()
            && object.blocks.is_empty()
            && object.writers == 0
            && !object.on_disk
        {
            state.objects.remove(&id);
        }
    }

    /// Moves an object's blocks out of the eviction policy, or back in, when whether it is
    /// protected changed from `was`.
    fn reprotect(&self, state: &mut State, id: ObjectId, was: bool) {
        let Some(object) = state.objects.get(&id) else {
            return;
        };
        if object.protected() == was {
            return;
        }
        let indexes: Vec<u32> = object.blocks.keys().copied().collect();
        for index in indexes {
            if was {
                self.admit(state, (id, index));
            } else {
                state.policy.remove(&(id, index));
            }
        }
    }

    /// Puts block `key` in the eviction policy if it may be evicted: present, its object
    /// neither pinned nor leased, and not held by a reader. The one rule for what the policy
    /// holds.
    pub(crate) fn admit(&self, state: &mut State, key: BlockKey) {
        let (id, index) = key;
        let Some(object) = state.objects.get(&id) else {
            return;
        };
        if object.protected() || state.held.contains_key(&key) || !object.blocks.contains_key(&index) {
            return;
        }
        let bytes = align_up(self.block_len(object.size, index));
        state.policy.insert(key, bytes);
    }

    /// Keeps block `index` of `id` from eviction until the hold is dropped: for a reader that
    /// reads the block in pieces from disk, so that a small cache does not evict it between
    /// them. The block need not be present yet; one written while held is evictable once the
    /// last hold goes. Dropping the object's version (replaced, deleted, or failing its origin
    /// check) still drops the block.
    pub fn hold(self: &Arc<Self>, id: ObjectId, index: u32) -> BlockHold {
        let key = (id, index);
        let mut state = self.state.lock();
        *state.held.entry(key).or_default() += 1;
        state.policy.remove(&key);
        BlockHold {
            store: self.clone(),
            key,
        }
    }

    /// The data file of `version` when every block of it is present and verified (see
    /// `BlockMeta::verified`), opened for plain reads, and a lease that keeps every block
    /// in place until it is dropped: what FUSE passthrough hands the kernel.
    pub fn lease_complete(self: &Arc<Self>, version: &ObjectVersion) -> Option<(File, Lease)> {
        let id = version.id();
        let count = version.size.div_ceil(self.block_size);
        {
            let mut guard = self.state.lock();
            let state = &mut *guard;
            let object = state.objects.get_mut(&id)?;
            // An unsettled block waits for its check: once the kernel reads the data
            // file itself, a block the check drops could not be taken back.
            let complete = object.blocks.len() as u64 == count
                && object
                    .blocks
                    .values()
                    .all(|meta| self.trusted(meta) && !meta.unsettled);
            if !complete || count == 0 || state.disk_failing.is_some() {
                return None;
            }
            let was = object.protected();
            object.leases += 1;
            object.handed = true;
            self.reprotect(state, id, was);
        }
        let lease = Lease {
            store: self.clone(),
            id,
        };
        let names = Names::of(id);
        let file = self.held.open(&names, &names.data, OFlags::RDONLY, false).ok()?;
        // The kernel's reads of the file never reach the daemon, which could not fall back to
        // the origin when they fail: a page read first, from the disk unless the page cache
        // holds it (~60 µs an open).
        let probe = &mut [0; PROBE_LEN][..version.size.min(PROBE_LEN as u64) as usize];
        if let Err(source) = file.read_exact_at(probe, 0) {
            self.disk_failed(&StoreError::Io {
                op: "probe",
                path: self.held.path(&names.data),
                source,
            });
            return None;
        }
        Some((file, lease))
    }
}
