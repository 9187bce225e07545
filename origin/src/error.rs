//! Errors: what an origin request's failure is, sorted by what the caller does about it, and
//! how a store's error is classified as final or transient (retried).

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use larder_config::SourceUrl;
use larder_object::ObjectVersion;
use larder_stats::add;

use crate::Origin;

/// Why an origin request failed, sorted by what the caller does about it.
#[derive(Debug, thiserror::Error)]
pub enum OriginError {
    /// The object (or prefix) does not exist.
    #[error("{key:?} was not found in source {source_name}")]
    NotFound {
        /// Name of the source.
        source_name: String,
        /// Key relative to the source.
        key: String,
    },
    /// The origin refused our credentials or denied access.
    #[error("source {source_name} denied access to {key:?}: {source}")]
    PermissionDenied {
        /// Name of the source.
        source_name: String,
        /// Key relative to the source.
        key: String,
        /// What the store said.
        source: object_store::Error,
    },
    /// The object changed since the version was pinned.
    #[error("{key:?} in source {source_name} changed since it was opened ({})", gone(.expected))]
    VersionChanged {
        /// Name of the source.
        source_name: String,
        /// Key relative to the source.
        key: String,
        /// The pinned ETag, where the version has one.
        expected: Option<String>,
    },
    /// Transient failures persisted past the attempt limit or the retry budget.
    #[error("{key:?} in source {source_name}: gave up after {attempts} attempt(s): {source}")]
    RetriesExhausted {
        /// Name of the source.
        source_name: String,
        /// Key relative to the source.
        key: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        source: TransientError,
    },
    /// The whole operation, retries included, ran past its deadline.
    #[error("{key:?} in source {source_name}: {}", deadline_passed(*.deadline, *.received))]
    DeadlineExceeded {
        /// Name of the source.
        source_name: String,
        /// Key relative to the source.
        key: String,
        /// The deadline that passed.
        deadline: Duration,
        /// Bytes of the body that had arrived when it passed.
        received: u64,
    },
    /// A request the origin will never accept (invalid key, unsupported operation).
    #[error("{key:?} in source {source_name}: {source}")]
    Rejected {
        /// Name of the source.
        source_name: String,
        /// Key relative to the source.
        key: String,
        /// What the store said.
        source: object_store::Error,
    },
    /// The source can only be read (its origin is [`Origin::read_only`]) and was asked to list
    /// or write. No request was sent.
    #[error("source {source_name} cannot {operation} {key:?}: it can only read objects")]
    NotSupported {
        /// Name of the source.
        source_name: String,
        /// Key (or directory) relative to the source.
        key: String,
        /// What it was asked to do.
        operation: Operation,
    },
    /// The source cannot be built from its configuration.
    #[error("source {source_name} ({url}): {message}")]
    Config {
        /// Name of the source.
        source_name: String,
        /// The configured URL.
        url: SourceUrl,
        /// What is wrong.
        message: String,
    },
}

/// What an origin is asked to do beyond reading objects, which a read-only origin cannot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// List keys: a directory's level, everything under it, or whether anything is.
    List,
    /// Write an object of Larder's own (a sealed manifest).
    Write,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::List => "list",
            Self::Write => "write",
        })
    }
}

/// What is gone when a pinned version changed.
fn gone(etag: &Option<String>) -> String {
    match etag {
        Some(etag) => format!("ETag {etag} is gone"),
        None => "the version it was opened at is gone".to_owned(),
    }
}

/// What happened when the deadline of a whole operation passed.
fn deadline_passed(deadline: Duration, received: u64) -> String {
    if received == 0 {
        format!("no data within the {deadline:?} deadline of the whole request, retries included")
    } else {
        format!(
            "not complete within the {deadline:?} deadline of the whole request, retries included \
             ({received} bytes had arrived)"
        )
    }
}

/// A failure worth retrying.
#[derive(Debug, thiserror::Error)]
pub enum TransientError {
    /// A 5xx, a throttle, a reset connection: anything the store reports as generic.
    #[error(transparent)]
    Store(object_store::Error),
    /// No response (or no body progress) within the per-request deadline.
    #[error("nothing arrived for {0:?} (no response, or the body stalled)")]
    Timeout(Duration),
    /// The body ended before the requested range did.
    #[error("the body ended {missing} bytes short of the requested range")]
    ShortBody {
        /// Bytes that never came.
        missing: u64,
    },
}

/// How one failed attempt is classified.
pub(crate) enum Failure {
    Transient(TransientError),
    Final(OriginError),
}

/// The key in a listing that object_store could not turn into a path, if that is why it failed.
pub(crate) fn unparsable_key(error: &OriginError) -> Option<&str> {
    match error {
        OriginError::Rejected { source, .. } => bad_path(source),
        _ => None,
    }
}

/// The key of a store's error that says a listed key cannot be a path, if it is one.
pub(crate) fn bad_path(error: &object_store::Error) -> Option<&str> {
    use object_store::path::Error as PathError;
    match error {
        object_store::Error::InvalidPath {
            source: PathError::EmptySegment { path } | PathError::BadSegment { path, .. },
        } => Some(path),
        _ => None,
    }
}

/// The HTTP status of a generic store error, where it has one. object_store 0.14 types the
/// answers it understands to GETs and HEADs (`NotFound`, `PermissionDenied`, ...), but the
/// failures of its other requests (listings) are `Generic`, their status kept in its retry
/// error, whose module it does not export: the status is read from the one message that error
/// gives, `... status code: 403 Forbidden: <body>`. The conformance tests check a refused
/// listing against every emulator, so a change of that message shows there.
fn http_status(error: &object_store::Error) -> Option<u16> {
    const MARK: &str = "status code: ";
    let mut source: Option<&dyn std::error::Error> = Some(error);
    while let Some(e) = source {
        let text = e.to_string();
        if let Some(at) = text.find(MARK)
            && let Some(status) = text[at + MARK.len()..].get(..3).and_then(|s| s.parse().ok())
        {
            return Some(status);
        }
        source = e.source();
    }
    None
}

/// Whether an HTTP status says the request itself is refused, so that sending it again gets
/// the same: 4xx, but for a timeout (408) and throttling (429).
fn refused_as_sent(status: u16) -> bool {
    (400..500).contains(&status) && status != 408 && status != 429
}

impl Origin {
    pub(crate) fn version_changed(&self, version: &ObjectVersion) -> OriginError {
        add(&self.stats.origin_errors_version_changed, 1);
        OriginError::VersionChanged {
            source_name: self.name.clone(),
            key: version.key.clone(),
            expected: version.etag.clone(),
        }
    }

    /// Warns, once per source, that the origin denied access: without it a reader sees only
    /// `EACCES` (each denied request is also logged at debug where the mount answers it). The
    /// credentials themselves are never logged.
    fn denied(&self, key: &str) {
        if !self.denied_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                source = %self.name,
                key,
                "the origin denied access (HTTP 401/403): check the credentials it is given \
                 (AWS_*, GOOGLE_*, AZURE_*) and its access policy; reads of this source fail with \
                 EACCES meanwhile (logged once per source)"
            );
        }
    }

    pub(crate) fn classify(&self, key: &str, error: object_store::Error) -> Failure {
        let source_name = self.name.clone();
        let key = key.to_owned();
        let stats = &self.stats;
        // A generic error's status, read once (from its message: see `http_status`).
        let status = match &error {
            object_store::Error::Generic { .. } => http_status(&error),
            _ => None,
        };
        let denied = matches!(
            error,
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }
        ) || matches!(status, Some(401 | 403));
        match error {
            object_store::Error::NotFound { .. } => {
                add(&stats.origin_errors_not_found, 1);
                Failure::Final(OriginError::NotFound { source_name, key })
            }
            object_store::Error::Precondition { .. } | object_store::Error::NotModified { .. } => {
                add(&stats.origin_errors_version_changed, 1);
                Failure::Final(OriginError::VersionChanged {
                    source_name,
                    key,
                    expected: None,
                })
            }
            error if denied => {
                add(&stats.origin_errors_permission, 1);
                self.denied(&key);
                Failure::Final(OriginError::PermissionDenied {
                    source_name,
                    key,
                    source: error,
                })
            }
            error @ object_store::Error::Generic { .. } if status.is_some_and(refused_as_sent) => {
                add(&stats.origin_errors_other, 1);
                Failure::Final(OriginError::Rejected {
                    source_name,
                    key,
                    source: error,
                })
            }
            error @ (object_store::Error::Generic { .. } | object_store::Error::JoinError { .. }) => {
                Failure::Transient(TransientError::Store(error))
            }
            error => {
                add(&stats.origin_errors_other, 1);
                Failure::Final(OriginError::Rejected {
                    source_name,
                    key,
                    source: error,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_of_a_store_error_is_read_from_its_message() {
        let error = |text: &str| object_store::Error::Generic {
            store: "S3",
            source: text.to_owned().into(),
        };
        let status = |text: &str| http_status(&error(text));
        assert_eq!(
            status(
                "Error performing GET http://x/b/k in 1ms - Server returned non-2xx status code: 400 Bad Request: <Error>"
            ),
            Some(400)
        );
        assert_eq!(
            status(
                "Error performing GET http://x/b?list-type=2 in 1ms - Server returned non-2xx status code: 403 Forbidden: <Error>"
            ),
            Some(403)
        );
        // A body that says a status is not the answer's status.
        assert_eq!(status("error decoding response body: 403 Forbidden"), None);
        assert_eq!(status("error sending request: connection reset"), None);
        assert!(refused_as_sent(400) && refused_as_sent(404) && !refused_as_sent(429));
        assert!(!refused_as_sent(408) && !refused_as_sent(500) && !refused_as_sent(503));
    }

    #[test]
    fn a_changed_object_without_a_known_etag_reads_sensibly() {
        let changed = |expected: Option<&str>| {
            OriginError::VersionChanged {
                source_name: "models".into(),
                key: "a.bin".into(),
                expected: expected.map(str::to_owned),
            }
            .to_string()
        };
        assert_eq!(
            changed(None),
            "\"a.bin\" in source models changed since it was opened (the version it was opened at is gone)"
        );
        assert_eq!(
            changed(Some("\"e1\"")),
            "\"a.bin\" in source models changed since it was opened (ETag \"e1\" is gone)"
        );
    }

    #[test]
    fn a_deadline_that_passes_while_bytes_arrive_does_not_say_no_answer() {
        let passed = |received| {
            OriginError::DeadlineExceeded {
                source_name: "models".into(),
                key: "a.bin".into(),
                deadline: Duration::from_secs(30),
                received,
            }
            .to_string()
        };
        let flowing = passed(5 << 20);
        assert!(
            !flowing.contains("no answer") && !flowing.contains("no data"),
            "{flowing}"
        );
        assert!(
            flowing.contains("not complete within the 30s deadline of the whole request")
                && flowing.contains("5242880 bytes had arrived"),
            "{flowing}"
        );
        let silent = passed(0);
        assert!(silent.contains("no data within the 30s deadline"), "{silent}");
    }
}
