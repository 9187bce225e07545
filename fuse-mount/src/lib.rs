//! Larder's FUSE adapter.
//!
//! [`FileTree`] is the narrow, async, read-only file tree the mount serves, in plain typed
//! values; [`mount`] puts a tree on a mount point through `fuser`. Nothing of `fuser` leaves this
//! crate, and nothing of caches or object stores enters it. Errors become errno values in one
//! place, [`FsError::errno`].

mod adapter;
mod error;
mod tree;

pub use adapter::{MountOptions, Mounted, Observer, Operation, mount};
pub use error::FsError;
pub use tree::{Attr, DirEntry, FileTree, FsStats, NodeKind, Opened, ROOT_INO};
