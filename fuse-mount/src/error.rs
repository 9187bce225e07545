//! The errors a file tree returns, and the single mapping to errno.

/// Why a file-system operation failed, in terms the kernel understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsError {
    /// No such file or directory.
    NotFound,
    /// The origin denied access.
    PermissionDenied,
    /// The object changed since this handle opened it.
    Stale,
    /// The data could not be fetched (origin down, retries exhausted, deadline passed).
    Io,
    /// The mount is read-only.
    ReadOnly,
    /// A directory operation on a file.
    NotADirectory,
    /// A file operation on a directory.
    IsADirectory,
    /// A file handle this tree never gave out (or already released).
    BadHandle,
    /// A name that cannot exist here (too long, or not a single path component).
    InvalidName,
    /// The operation ran past its deadline.
    TimedOut,
}

impl FsError {
    /// The errno the kernel gets. Exhaustive: a new error must choose its errno here.
    pub fn errno(self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::PermissionDenied => libc::EACCES,
            FsError::Stale => libc::ESTALE,
            FsError::Io => libc::EIO,
            FsError::ReadOnly => libc::EROFS,
            FsError::NotADirectory => libc::ENOTDIR,
            FsError::IsADirectory => libc::EISDIR,
            FsError::BadHandle => libc::EBADF,
            FsError::InvalidName => libc::ENAMETOOLONG,
            FsError::TimedOut => libc::ETIMEDOUT,
        }
    }
}

impl std::fmt::Display for FsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.errno()))
    }
}

impl std::error::Error for FsError {}
