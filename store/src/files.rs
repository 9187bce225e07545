//! An object's files: the data file (blocks at their natural offsets), the record and the
//! values file, opened once per object (created afresh for one not on disk), and their paths.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use larder_object::{ObjectId, ObjectVersion};
use rustix::fs::OFlags;
use tokio::sync::OnceCell;

use crate::format::RecordHeader;
use crate::held_dir::{self, HeldDir, Names};
use crate::{BlockStore, StoreError, blocking, io_error};

#[derive(Debug)]
pub(crate) struct ObjectFiles {
    pub(crate) data: Arc<File>,
    pub(crate) record: File,
    /// The tree of each block (see larder-block-tree), at fixed slots; read through the engine.
    pub(crate) values: Arc<File>,
}

impl BlockStore {
    /// Opens (once) the object's files; `create` makes fresh ones for an object not on disk.
    pub(crate) async fn files(
        &self,
        version: &ObjectVersion,
        cell: &OnceCell<Arc<ObjectFiles>>,
        create: bool,
    ) -> Result<Arc<ObjectFiles>, StoreError> {
        let id = version.id();
        let fresh = create && !self.state.lock().objects.get(&id).is_some_and(|o| o.on_disk);
        let header = RecordHeader {
            block_size: self.block_size as u32,
            object_size: version.size,
            object_id: id,
            identity: version.identity(),
        };
        self.object_files(id, cell, fresh.then_some(header)).await
    }

    /// Opens (once) the files of object `id`; with a header, creates them afresh.
    pub(crate) async fn object_files(
        &self,
        id: ObjectId,
        cell: &OnceCell<Arc<ObjectFiles>>,
        fresh: Option<RecordHeader>,
    ) -> Result<Arc<ObjectFiles>, StoreError> {
        let held = self.held.clone();
        cell.get_or_try_init(|| async move {
            blocking(move || open_object_files(&held, &Names::of(id), fresh).map(Arc::new)).await
        })
        .await
        .cloned()
    }
}

/// The data and record files of object `id` in the cache dir `cache_dir`.
pub fn object_paths(cache_dir: &Path, id: ObjectId) -> (PathBuf, PathBuf) {
    let names = Names::of(id);
    let objects = cache_dir.join(held_dir::OBJECTS_DIR);
    (objects.join(names.data), objects.join(names.rec))
}

/// Opens an object's data and record files; with a header, creates them afresh.
pub(crate) fn open_object_files(
    held: &HeldDir,
    names: &Names,
    fresh: Option<RecordHeader>,
) -> Result<ObjectFiles, StoreError> {
    let create = fresh.is_some();
    let data = held.open(names, &names.data, OFlags::RDWR | OFlags::DIRECT, create)?;
    let record = held.open(names, &names.rec, OFlags::WRONLY | OFlags::APPEND, create)?;
    // Made for objects cached before values were kept, too: their blocks get values as they
    // are read.
    let values = held.open(names, &names.values, OFlags::RDWR, true)?;
    if let Some(header) = fresh {
        let values_path = held.path(&names.values);
        values.set_len(0).map_err(io_error("truncate", &values_path))?;
        let (data_path, rec_path) = (held.path(&names.data), held.path(&names.rec));
        record.set_len(0).map_err(io_error("truncate", &rec_path))?;
        data.set_len(0).map_err(io_error("truncate", &data_path))?;
        data.set_len(header.object_size)
            .map_err(io_error("size", &data_path))?;
        (&record)
            .write_all(&header.encode())
            .map_err(io_error("write", &rec_path))?;
    }
    Ok(ObjectFiles {
        data: Arc::new(data),
        record,
        values: Arc::new(values),
    })
}
