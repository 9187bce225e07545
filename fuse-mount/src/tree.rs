//! The file tree a mount serves: a narrow async trait with plain values.

use std::ffi::{OsStr, OsString};
use std::future::Future;
use std::time::SystemTime;

use bytes::Bytes;

use crate::FsError;

/// The inode number of the mount's root directory.
pub const ROOT_INO: u64 = 1;

/// A directory or a regular file: the only kinds a read-only object-store tree has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    /// A directory (a source, or a common prefix of keys).
    Directory,
    /// A regular file (an object).
    File,
}

/// Attributes of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    /// Inode number, stable for the life of the mount.
    pub ino: u64,
    /// Kind.
    pub kind: NodeKind,
    /// Size in bytes (0 for directories).
    pub size: u64,
    /// Last modification time.
    pub mtime: SystemTime,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Inode number of the entry.
    pub ino: u64,
    /// Kind.
    pub kind: NodeKind,
    /// Name within the directory.
    pub name: OsString,
}

/// What `open` returns.
#[derive(Debug)]
pub struct Opened {
    /// The handle later reads and the release carry.
    pub fh: u64,
    /// The version opened is the one whose pages the kernel may already hold: keep them.
    pub keep_cache: bool,
    /// A local file with exactly the file's bytes: the kernel may read it directly (FUSE
    /// passthrough) instead of sending reads. The tree must keep those bytes in place until
    /// the handle's release; reads may still come if the kernel cannot pass through.
    pub backing: Option<std::fs::File>,
}

/// What `statfs` reports, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsStats {
    /// Capacity.
    pub total: u64,
    /// Capacity not in use.
    pub free: u64,
}

/// A read-only file tree served by a mount. Every method is called on the tokio runtime the
/// mount was given, under the mount's deadline; a method that does not finish in time is
/// abandoned and the kernel gets `ETIMEDOUT`.
pub trait FileTree: Send + Sync + 'static {
    /// The entry `name` of directory `parent`. Each success is one more reference the kernel
    /// holds on the entry's inode, until [`forget`](Self::forget) gives them back.
    fn lookup(&self, parent: u64, name: &OsStr) -> impl Future<Output = Result<Attr, FsError>> + Send;

    /// The kernel dropped `count` references to `ino`; at zero the inode may be forgotten.
    fn forget(&self, ino: u64, count: u64);

    /// Attributes of a node.
    fn getattr(&self, ino: u64) -> impl Future<Output = Result<Attr, FsError>> + Send;

    /// Opens a directory for listing; the handle is passed to `readdir`.
    fn opendir(&self, ino: u64) -> impl Future<Output = Result<u64, FsError>> + Send;

    /// Entries of an open directory from position `offset` on (without `.` and `..`); an
    /// empty page ends the listing. A page may be shorter than the rest of the directory.
    fn readdir(&self, fh: u64, offset: u64) -> impl Future<Output = Result<Vec<DirEntry>, FsError>> + Send;

    /// Forgets a directory handle.
    fn releasedir(&self, fh: u64) -> impl Future<Output = ()> + Send;

    /// Opens a file for reading, pinning the version it reads.
    fn open(&self, ino: u64) -> impl Future<Output = Result<Opened, FsError>> + Send;

    /// The kernel took handle `fh` in passthrough: it reads the backing file `open` offered
    /// and sends no reads for it. Called at most once per handle, after `open` and before the
    /// kernel has the handle; an offer the adapter could not use (the file is open through the
    /// daemon already) is never told. Does nothing by default.
    fn passed_through(&self, fh: u64) {
        let _ = fh;
    }

    /// The read `read` would answer, answered at once on the FUSE thread that received it,
    /// when the tree has the bytes at hand (a small read of cached data): no hop to the
    /// runtime. `None` (the default) sends the read to [`read`](Self::read); so does any
    /// failure, which `read` then reports.
    fn read_now(&self, fh: u64, offset: u64, size: u32) -> Option<Bytes> {
        let _ = (fh, offset, size);
        None
    }

    /// Up to `size` bytes at `offset` of an open file; short only at its end.
    fn read(&self, fh: u64, offset: u64, size: u32) -> impl Future<Output = Result<Bytes, FsError>> + Send;

    /// Forgets a handle.
    fn release(&self, fh: u64) -> impl Future<Output = ()> + Send;

    /// Space figures for `df`.
    fn statfs(&self) -> impl Future<Output = Result<FsStats, FsError>> + Send;
}
