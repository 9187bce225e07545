//! Writes of blocks: room reserved (victims chosen) first, then the bytes, the block's tree
//! and its entry in the record, then the index.

use std::io::Write;
use std::sync::Arc;

use larder_engine::align_up;
use larder_object::ObjectVersion;
use larder_stats::add;
use tokio::sync::OnceCell;

use crate::files::ObjectFiles;
use crate::format::Entry;
use crate::held_dir::Names;
use crate::index::{BlockMeta, ObjectState};
use crate::values::write_values;
use crate::{BlockStore, Fetched, StoreError, VerifiedBlock, blocking, io_error};

impl BlockStore {
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
        match self.held.intact() {
            Ok(true) => {}
            Ok(false) => self.give_up(),
            Err(source) => {
                let error = StoreError::Io {
                    op: "stat",
                    path: self.held.lock_path(),
                    source,
                };
                self.disk_failed(&error);
                return Err(error);
            }
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
            // The dir was given up while the block was written: it is not in the store.
            None if state.dir_lost => {
                return written.and(Err(StoreError::DirLost(self.held.dir().to_owned())));
            }
            // Writers keep their object's entry (see `ObjectState::writers`).
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
}
