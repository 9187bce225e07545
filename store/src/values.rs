//! The values file of an object: each block's BLAKE3 tree (see larder-block-tree) at a fixed
//! slot, written with the block and read to check part of it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use larder_block_tree::{CV_LEN, GROUP, Tree};
use larder_engine::AlignedBuf;

use crate::files::ObjectFiles;
use crate::{BlockStore, StoreError, io_error};

/// The extension of an object's file of block trees: named for the group size
/// ([`larder_block_tree::GROUP`]), so that values of another size are never read as these.
pub const VALUES_EXTENSION: &str = "values16k";

impl BlockStore {
    /// The stored tree of block `index` (`count` values), if there is one.
    pub(crate) async fn stored_values(
        &self,
        files: &ObjectFiles,
        index: u32,
        count: usize,
    ) -> Option<Vec<[u8; CV_LEN]>> {
        if count == 0 {
            return None;
        }
        let slot = AlignedBuf::new(count * CV_LEN);
        let read = self
            .engine
            .read(files.values.clone(), self.values_slot(index), slot);
        values_read(read.await, count)
    }

    /// Where block `index`'s tree starts in the values file: every block has room for a full
    /// block's tree (2 values a group, 2 fewer used: 16 KiB a 4 MiB block).
    pub(crate) fn values_slot(&self, index: u32) -> u64 {
        u64::from(index) * 2 * (self.block_size / GROUP as u64) * CV_LEN as u64
    }
}

/// The `count` values of a block's tree out of the read of its slot in the values file:
/// `None` if the read failed or was short, or the slot was never written (a hole reads as
/// zeros).
pub(crate) fn values_read((buf, result): larder_engine::IoResult, count: usize) -> Option<Vec<[u8; CV_LEN]>> {
    let len = count * CV_LEN;
    if result.ok()? < len {
        return None;
    }
    let values = buf.as_ref()[..len].as_chunks::<CV_LEN>().0.to_vec();
    values.iter().any(|v| v != &[0; CV_LEN]).then_some(values)
}

/// Writes the tree of a block of `len` bytes into its slot of the values file.
pub(crate) fn write_values(
    file: &File,
    slot: u64,
    tree: &Tree,
    len: usize,
    path: &Path,
) -> Result<(), StoreError> {
    file.write_all_at(tree.nodes(len).as_flattened(), slot)
        .map_err(io_error("write", path))
}
