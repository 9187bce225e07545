//! The errors a file tree returns: an errno, a log level and the cause.
//!
//! A tree turns its own typed errors into an [`FsError`] in one place (one exhaustive `match`,
//! no `_` arm), choosing the [`FsErrorKind`] (so the errno) and keeping the error as the cause.
//! The adapter logs each failed request once, at the error's level, with the operation, the
//! inode and the whole cause chain, and replies with the errno. Nothing below the boundary logs
//! the error again.

use std::error::Error;
use std::fmt;

use tracing::Level;

/// What a failed operation tells the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsErrorKind {
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

impl FsErrorKind {
    /// The errno the kernel gets. Exhaustive: a new kind must choose its errno here.
    pub const fn errno(self) -> i32 {
        match self {
            Self::NotFound => libc::ENOENT,
            Self::PermissionDenied => libc::EACCES,
            Self::Stale => libc::ESTALE,
            Self::Io => libc::EIO,
            Self::ReadOnly => libc::EROFS,
            Self::NotADirectory => libc::ENOTDIR,
            Self::IsADirectory => libc::EISDIR,
            Self::BadHandle => libc::EBADF,
            Self::InvalidName => libc::ENAMETOOLONG,
            Self::TimedOut => libc::ETIMEDOUT,
        }
    }

    /// The level a failure of this kind is logged at unless the tree says otherwise: what
    /// programs do every day (a missing name, a write to a read-only mount) at debug; an
    /// object that changed under a reader at info; data a reader did not get at warn.
    pub const fn level(self) -> Level {
        match self {
            Self::NotFound
            | Self::PermissionDenied
            | Self::ReadOnly
            | Self::NotADirectory
            | Self::IsADirectory
            | Self::InvalidName => Level::DEBUG,
            Self::Stale => Level::INFO,
            Self::Io | Self::BadHandle | Self::TimedOut => Level::WARN,
        }
    }
}

/// Why a file-system operation failed: its kind (the errno), the level to log it at, and the
/// error that caused it.
#[derive(Debug)]
pub struct FsError {
    kind: FsErrorKind,
    level: Level,
    source: Option<Box<dyn Error + Send + Sync + 'static>>,
}

impl FsError {
    /// A failure of `kind` caused by `source`, at the kind's level.
    pub fn new(kind: FsErrorKind, source: impl Into<Box<dyn Error + Send + Sync + 'static>>) -> Self {
        Self {
            kind,
            level: kind.level(),
            source: Some(source.into()),
        }
    }

    /// The same failure, logged at `level`.
    #[must_use]
    pub fn with_level(mut self, level: Level) -> Self {
        self.level = level;
        self
    }

    /// What kind of failure it is.
    pub fn kind(&self) -> FsErrorKind {
        self.kind
    }

    /// The errno the kernel gets.
    pub fn errno(&self) -> i32 {
        self.kind.errno()
    }

    /// The level it is logged at.
    pub fn level(&self) -> Level {
        self.level
    }

    /// The causes, outermost first, joined with ": "; a cause whose text its parent already
    /// shows (errors that print their source) is not repeated. Empty without a cause.
    pub fn cause_chain(&self) -> String {
        let mut text = String::new();
        let mut next: Option<&(dyn Error + 'static)> = self.source.as_deref().map(|e| e as _);
        while let Some(error) = next {
            let line = error.to_string();
            if !text.contains(&line) {
                if !text.is_empty() {
                    text.push_str(": ");
                }
                text.push_str(&line);
            }
            next = error.source();
        }
        text
    }
}

impl From<FsErrorKind> for FsError {
    /// A failure with no cause beyond its kind (a bad handle, a name too long).
    fn from(kind: FsErrorKind) -> Self {
        Self {
            kind,
            level: kind.level(),
            source: None,
        }
    }
}

impl fmt::Display for FsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.errno()))
    }
}

impl Error for FsError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as _)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_errno_and_level() {
        let expected = [
            (FsErrorKind::NotFound, libc::ENOENT, Level::DEBUG),
            (FsErrorKind::PermissionDenied, libc::EACCES, Level::DEBUG),
            (FsErrorKind::Stale, libc::ESTALE, Level::INFO),
            (FsErrorKind::Io, libc::EIO, Level::WARN),
            (FsErrorKind::ReadOnly, libc::EROFS, Level::DEBUG),
            (FsErrorKind::NotADirectory, libc::ENOTDIR, Level::DEBUG),
            (FsErrorKind::IsADirectory, libc::EISDIR, Level::DEBUG),
            (FsErrorKind::BadHandle, libc::EBADF, Level::WARN),
            (FsErrorKind::InvalidName, libc::ENAMETOOLONG, Level::DEBUG),
            (FsErrorKind::TimedOut, libc::ETIMEDOUT, Level::WARN),
        ];
        for (kind, errno, level) in expected {
            assert_eq!((kind.errno(), kind.level()), (errno, level), "{kind:?}");
            let error = FsError::from(kind);
            assert_eq!((error.errno(), error.level()), (errno, level), "{kind:?}");
        }
    }

    #[test]
    fn the_cause_chain_is_kept_without_repeats() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "fetching k: {}", self.0)
            }
        }
        impl Error for Outer {
            fn source(&self) -> Option<&(dyn Error + 'static)> {
                Some(&self.0)
            }
        }
        let error = FsError::new(FsErrorKind::Io, Outer(std::io::Error::other("reset")));
        assert_eq!(error.cause_chain(), "fetching k: reset");
        assert_eq!(error.errno(), libc::EIO);
        assert_eq!(
            error.to_string(),
            std::io::Error::from_raw_os_error(libc::EIO).to_string()
        );
        let quiet = FsError::new(FsErrorKind::Stale, "changed").with_level(Level::DEBUG);
        assert_eq!(
            (quiet.level(), quiet.cause_chain().as_str()),
            (Level::DEBUG, "changed")
        );
        assert_eq!(FsError::from(FsErrorKind::BadHandle).cause_chain(), "");
    }
}
