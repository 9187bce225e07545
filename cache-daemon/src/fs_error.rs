//! What the daemon's errors mean to a reader of the mount: the one mapping from the typed
//! errors of the read path to [`FsError`] (errno, log level, cause).
//!
//! Each `match` is exhaustive and has no `_` arm: a new error variant does not compile until it
//! has chosen its errno and level here. The adapter logs every failed request once, with the
//! operation and the node; the layers below return their errors without logging them.

use std::sync::Arc;

use larder_fuse_mount::{FsError, FsErrorKind};
use larder_origin::OriginError;
use larder_read_path::ReadError;
use tracing::Level;

/// What the origin was asked about when it failed.
#[derive(Debug, Clone, Copy)]
enum Asked {
    /// A name: a lookup, an open, a listing.
    Name,
    /// The bytes of the version a handle pinned at open.
    PinnedVersion,
}

/// The kind and level of an origin error.
fn classify(error: &OriginError, asked: Asked) -> (FsErrorKind, Level) {
    match error {
        OriginError::NotFound { .. } => match asked {
            Asked::Name => (FsErrorKind::NotFound, Level::DEBUG),
            // The version an open handle reads is gone: to its reader, as stale as one
            // replaced (the README's errno table).
            Asked::PinnedVersion => (FsErrorKind::Stale, Level::INFO),
        },
        // The origin warns once per source (see `Origin`); every denied request after that
        // is the same news.
        OriginError::PermissionDenied { .. } => (FsErrorKind::PermissionDenied, Level::DEBUG),
        OriginError::VersionChanged { .. } => (FsErrorKind::Stale, Level::INFO),
        OriginError::RetriesExhausted { .. } | OriginError::DeadlineExceeded { .. } => {
            (FsErrorKind::Io, Level::WARN)
        }
        // A key the store refuses, a source asked what it cannot do, or one that cannot be
        // built: not a passing fault.
        OriginError::Rejected { .. } | OriginError::NotSupported { .. } | OriginError::Config { .. } => {
            (FsErrorKind::Io, Level::ERROR)
        }
    }
}

/// An origin's error when asked about a name (a lookup, an open, a listing).
pub fn of_origin(error: OriginError) -> FsError {
    let (kind, level) = classify(&error, Asked::Name);
    FsError::new(kind, error).with_level(level)
}

/// An error of a read of an open handle's pinned version.
pub fn of_read(error: ReadError) -> FsError {
    match error {
        ReadError::Origin(origin) => {
            let (kind, level) = classify(&origin, Asked::PinnedVersion);
            FsError::new(kind, Arc::clone(&origin)).with_level(level)
        }
        error @ (ReadError::Abandoned | ReadError::Peer(_) | ReadError::PeerLate(_)) => {
            FsError::new(FsErrorKind::Io, error)
        }
        // Reads are served when a block cannot be stored; a fill job reports it itself.
        error @ ReadError::NotStored(_) => FsError::new(FsErrorKind::Io, error),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use larder_origin::TransientError;

    use super::*;

    fn store_error() -> object_store::Error {
        object_store::Error::Generic {
            store: "test",
            source: "HTTP 403 Forbidden".into(),
        }
    }

    /// One of every origin error, with the errno and level a reader's log gets.
    fn origin_errors() -> Vec<(OriginError, i32, Level)> {
        let (source_name, key) = ("models".to_owned(), "llama/model.bin".to_owned());
        vec![
            (
                OriginError::NotFound {
                    source_name: source_name.clone(),
                    key: key.clone(),
                },
                libc::ENOENT,
                Level::DEBUG,
            ),
            (
                OriginError::PermissionDenied {
                    source_name: source_name.clone(),
                    key: key.clone(),
                    source: store_error(),
                },
                libc::EACCES,
                Level::DEBUG,
            ),
            (
                OriginError::VersionChanged {
                    source_name: source_name.clone(),
                    key: key.clone(),
                    expected: Some("\"etag\"".into()),
                },
                libc::ESTALE,
                Level::INFO,
            ),
            (
                OriginError::RetriesExhausted {
                    source_name: source_name.clone(),
                    key: key.clone(),
                    attempts: 5,
                    source: TransientError::Timeout(Duration::from_secs(10)),
                },
                libc::EIO,
                Level::WARN,
            ),
            (
                OriginError::DeadlineExceeded {
                    source_name: source_name.clone(),
                    key: key.clone(),
                    deadline: Duration::from_secs(30),
                    received: 0,
                },
                libc::EIO,
                Level::WARN,
            ),
            (
                OriginError::Rejected {
                    source_name: source_name.clone(),
                    key: key.clone(),
                    source: store_error(),
                },
                libc::EIO,
                Level::ERROR,
            ),
            (
                OriginError::NotSupported {
                    source_name: source_name.clone(),
                    key: key.clone(),
                    operation: larder_origin::Operation::List,
                },
                libc::EIO,
                Level::ERROR,
            ),
            (
                OriginError::Config {
                    source_name,
                    url: "s3://bucket".into(),
                    message: "bad".into(),
                },
                libc::EIO,
                Level::ERROR,
            ),
        ]
    }

    #[test]
    fn origin_errors_map_to_errno_and_level_with_their_cause() {
        for (error, errno, level) in origin_errors() {
            let text = error.to_string();
            let mapped = of_origin(error);
            assert_eq!((mapped.errno(), mapped.level()), (errno, level), "{text}");
            assert!(
                mapped.cause_chain().starts_with(&text),
                "{}",
                mapped.cause_chain()
            );
        }
    }

    #[test]
    fn read_errors_map_like_their_origin_error_but_a_vanished_version_is_stale() {
        for (error, errno, level) in origin_errors() {
            let (errno, level) = match error {
                OriginError::NotFound { .. } => (libc::ESTALE, Level::INFO),
                _ => (errno, level),
            };
            let text = error.to_string();
            let mapped = of_read(ReadError::Origin(Arc::new(error)));
            assert_eq!((mapped.errno(), mapped.level()), (errno, level), "{text}");
            assert!(
                mapped.cause_chain().starts_with(&text),
                "{}",
                mapped.cause_chain()
            );
        }
        for error in [
            ReadError::Abandoned,
            ReadError::NotStored(Arc::new(larder_read_path::Unstored::Lost)),
        ] {
            let text = error.to_string();
            let mapped = of_read(error);
            assert_eq!(
                (mapped.errno(), mapped.level()),
                (libc::EIO, Level::WARN),
                "{text}"
            );
            assert_eq!(mapped.cause_chain(), text);
        }
    }
}
