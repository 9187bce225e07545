//! Replay at start: every record under the objects dir loaded into the index, damaged or
//! foreign ones dropped with their files, torn tails cut and long records compacted.

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use larder_engine::align_up;

use crate::format::{self, Entry};
use crate::held_dir::Names;
use crate::index::{BlockMeta, ObjectState, State};
use crate::{BlockStore, StoreError, VALUES_EXTENSION, io_error};

impl BlockStore {
    /// Loads every record under the objects dir into the index. Damaged or foreign records are
    /// deleted with their data files; leftover temporary files are removed. Runs right after
    /// the lock is taken, so it reads records by path.
    pub(crate) fn replay_all(&self) -> Result<(), StoreError> {
        let mut state = self.state.lock();
        let objects_path = self.held.objects_path();
        let fanouts = fs::read_dir(objects_path).map_err(io_error("list", objects_path))?;
        for fanout in fanouts.flatten() {
            let Ok(entries) = fs::read_dir(fanout.path()) else {
                continue;
            };
            let fanout = fanout.file_name().to_string_lossy().into_owned();
            for entry in entries.flatten() {
                let path = entry.path();
                let name = format!("{fanout}/{}", entry.file_name().to_string_lossy());
                match path.extension().and_then(|e| e.to_str()) {
                    Some("rec") => self.replay_one(&mut state, &name),
                    Some("data" | VALUES_EXTENSION) if !path.with_extension("rec").exists() => {
                        self.held.remove(&name)
                    }
                    Some("data" | VALUES_EXTENSION) => {}
                    _ => self.held.remove(&name),
                }
            }
        }
        Ok(())
    }

    /// Replays the record `rec` (a name under the objects dir).
    fn replay_one(&self, state: &mut State, rec: &str) {
        let names = Names::with_stem(rec.trim_end_matches(".rec"));
        let (rec_path, data_path) = (self.held.path(&names.rec), self.held.path(&names.data));
        let remove_all = || self.held.remove_all(&names);
        let replayed = fs::read(&rec_path)
            .map_err(|e| e.to_string())
            .and_then(|bytes| format::replay(&bytes).map_err(|e| e.to_string()));
        let replayed = match replayed {
            Ok(r) if u64::from(r.header.block_size) != self.block_size => {
                Err(format!("written with block size {}", r.header.block_size))
            }
            Ok(r)
                if rec_path.file_stem().and_then(|s| s.to_str())
                    != Some(r.header.object_id.to_hex().as_str()) =>
            {
                Err("its file name is not its object id".to_owned())
            }
            Ok(r) if !data_path.exists() => Err(format!("data file missing for {} blocks", r.blocks.len())),
            other => other,
        };
        let replayed = match replayed {
            Ok(replayed) => replayed,
            Err(reason) => {
                tracing::warn!(record = %rec_path.display(), %reason, "dropping an unreadable cache record");
                remove_all();
                return;
            }
        };
        if replayed.blocks.is_empty() {
            remove_all();
            return;
        }
        let compact = replayed.entries > 2 * replayed.blocks.len() + 16;
        if let Err(error) = rewrite_record_if(&rec_path, &replayed, compact) {
            tracing::warn!(record = %rec_path.display(), %error, "could not repair a cache record; dropping it");
            remove_all();
            return;
        }
        let id = replayed.header.object_id;
        let size = replayed.header.object_size;
        state.blocks += replayed.blocks.len();
        let mut blocks = HashMap::with_capacity(replayed.blocks.len());
        for (index, hash) in replayed.blocks {
            state.next_generation += 1;
            blocks.insert(
                index,
                BlockMeta {
                    hash,
                    generation: state.next_generation,
                    verified: false,
                    served: true,
                    fetched: None,
                    unsettled: replayed.unsettled.contains(&index),
                },
            );
            state.used += align_up(self.block_len(size, index));
            state
                .policy
                .insert((id, index), align_up(self.block_len(size, index)));
        }
        state.objects.insert(
            id,
            ObjectState {
                on_disk: true,
                blocks,
                ..ObjectState::new(size)
            },
        );
    }
}

/// Cuts a torn tail off a replayed record, or rewrites it without removed entries.
fn rewrite_record_if(rec_path: &Path, replayed: &format::Replayed, compact: bool) -> io::Result<()> {
    if compact {
        let mut bytes = replayed.header.encode();
        let mut blocks: Vec<_> = replayed.blocks.iter().collect();
        blocks.sort_unstable();
        for (&index, &hash) in blocks {
            let entry = if replayed.unsettled.contains(&index) {
                Entry::Unsettled { index, hash }
            } else {
                Entry::Present { index, hash }
            };
            bytes.extend_from_slice(&entry.encode());
        }
        let tmp = rec_path.with_extension("tmp");
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_data()?;
        return fs::rename(&tmp, rec_path);
    }
    let file = OpenOptions::new().write(true).open(rec_path)?;
    if file.metadata()?.len() > replayed.valid_len as u64 {
        file.set_len(replayed.valid_len as u64)?;
    }
    Ok(())
}
