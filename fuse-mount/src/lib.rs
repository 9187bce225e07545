//! Larder's FUSE adapter.
//!
//! [`FileTree`] is the narrow, async, read-only file tree the mount serves, in plain typed
//! values; [`mount`] puts a tree on a mount point through `fuser`. Nothing of `fuser` leaves this
//! crate, and nothing of caches or object stores enters it. A tree's errors are [`FsError`]s:
//! an errno ([`FsErrorKind`]), a log level and the cause, logged once by the adapter with the
//! operation and the node.

mod adapter;
mod error;
mod tree;

pub use adapter::{Detached, MountOptions, Mounted, Observer, Operation, Outcome, detach, mount};
pub use error::{FsError, FsErrorKind};
pub use tree::{Attr, DirEntry, FileTree, FsStats, NodeKind, Opened, ROOT_INO};
