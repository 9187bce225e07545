//! Reads past the mount's deadline, through a real mount: the kernel's readahead that times
//! out is retried by the kernel when a reader comes to its range, so that first timeout is
//! nobody's error (debug, counted as [`Outcome::FirstReadTimeout`]); a timeout of a range that
//! timed out before is the read a reader waits on (a warning). Needs root (mount).

use std::ffi::OsStr;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use larder_fuse_mount::{
    Attr, DirEntry, FileTree, FsError, FsErrorKind, FsStats, MountOptions, NodeKind, Opened, Operation,
    Outcome, ROOT_INO,
};

const FILE_INO: u64 = 2;
const SIZE: u64 = 8 << 20;

/// Byte `i` of the file.
fn byte(i: u64) -> u8 {
    (i % 251) as u8
}

/// One file, `f`; a read hangs unless `answers` says it may be answered.
struct SlowTree {
    /// Ranges read so far.
    seen: Mutex<Vec<Range<u64>>>,
    /// Whether a read of a range is answered, given whether an earlier read overlapped it.
    answers: fn(seen_before: bool, range: &Range<u64>) -> bool,
}

impl FileTree for SlowTree {
    async fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, FsError> {
        if parent == ROOT_INO && name == "f" {
            return self.getattr(FILE_INO).await;
        }
        Err(FsErrorKind::NotFound.into())
    }

    fn forget(&self, _ino: u64, _count: u64) {}

    async fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        let (kind, size) = match ino {
            ROOT_INO => (NodeKind::Directory, 0),
            FILE_INO => (NodeKind::File, SIZE),
            _ => return Err(FsErrorKind::NotFound.into()),
        };
        Ok(Attr {
            ino,
            kind,
            size,
            mtime: SystemTime::UNIX_EPOCH,
        })
    }

    async fn opendir(&self, _ino: u64) -> Result<u64, FsError> {
        Ok(1)
    }

    async fn readdir(&self, _fh: u64, _offset: u64) -> Result<Vec<DirEntry>, FsError> {
        Ok(Vec::new())
    }

    async fn releasedir(&self, _fh: u64) {}

    async fn open(&self, _ino: u64) -> Result<Opened, FsError> {
        Ok(Opened {
            fh: 7,
            keep_cache: false,
            backing: None,
        })
    }

    async fn read(&self, _fh: u64, offset: u64, size: u32) -> Result<Bytes, FsError> {
        let range = offset..(offset + u64::from(size)).min(SIZE);
        let seen_before = {
            let mut seen = self.seen.lock().expect("lock");
            let before = seen.iter().any(|r| r.start < range.end && range.start < r.end);
            seen.push(range.clone());
            before
        };
        if !(self.answers)(seen_before, &range) {
            std::future::pending::<()>().await;
        }
        Ok(range.map(byte).collect())
    }

    async fn release(&self, _fh: u64) {}

    async fn statfs(&self) -> Result<FsStats, FsError> {
        Ok(FsStats { total: 0, free: 0 })
    }
}

/// Mounts `tree` with a one-second deadline, reads 4 KiB at 4 MiB from it, and gives the
/// read's result and the outcomes of the reads the observer saw.
async fn read_through(tree: SlowTree) -> (std::io::Result<Vec<u8>>, Vec<Outcome>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let seen = outcomes.clone();
    let options = MountOptions {
        deadline: Duration::from_secs(1),
        allow_other: false,
        passthrough: false,
        observer: Some(Arc::new(move |op, _elapsed, outcome| {
            if op == Operation::Read {
                seen.lock().expect("lock").push(outcome);
            }
        })),
        ..MountOptions::default()
    };
    let mounted = larder_fuse_mount::mount(
        Arc::new(tree),
        dir.path(),
        &options,
        tokio::runtime::Handle::current(),
    )
    .expect("mount (needs root)");
    let path = dir.path().join("f");
    let read = tokio::task::spawn_blocking(move || {
        let file = std::fs::File::open(path)?;
        let mut buf = vec![0; 4096];
        file.read_exact_at(&mut buf, 4 << 20).map(|()| buf)
    });
    let read = tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("the read hangs")
        .expect("join");
    mounted.unmount().expect("unmount");
    let outcomes = outcomes.lock().expect("lock").clone();
    (read, outcomes)
}

/// What the mount logs at warning level, as text: the test's own subscriber writes here.
static WARNINGS: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Warnings;

impl std::io::Write for Warnings {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        WARNINGS.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The warnings logged since the last call.
fn take_warnings() -> String {
    String::from_utf8_lossy(&std::mem::take(&mut *WARNINGS.lock().expect("lock"))).into_owned()
}

/// Reads past the deadline behind a slow tree. First, the first read of every range hangs (the
/// origin behind the kernel's readahead is slow) and the kernel's second read of the range the
/// reader wants is answered: the reader gets its bytes, every timeout is a first one, and none
/// is logged as a warning (before, each was). Then every read from 4 MiB on hangs: the reader
/// gets an error, and the kernel's second read, the one the reader waited on, is a warning.
#[tokio::test(flavor = "multi_thread")]
async fn read_timeouts_are_warnings_only_when_a_reader_gets_them() {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(|| Warnings)
        .init();

    let tree = SlowTree {
        seen: Mutex::default(),
        answers: |seen_before, _| seen_before,
    };
    let (read, outcomes) = read_through(tree).await;
    let bytes = read.expect("the reader's read");
    assert!(
        bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| b == byte((4 << 20) + i as u64))
    );
    let warnings = take_warnings();
    assert!(!warnings.contains("request failed"), "{warnings}");
    let firsts = outcomes
        .iter()
        .filter(|o| **o == Outcome::FirstReadTimeout)
        .count();
    assert!(
        firsts >= 1,
        "no read timed out: the test proves nothing ({outcomes:?})"
    );

    let tree = SlowTree {
        seen: Mutex::default(),
        answers: |_, range| range.end <= 4 << 20,
    };
    let (read, outcomes) = read_through(tree).await;
    read.expect_err("a read of a range that never answers");
    assert!(outcomes.contains(&Outcome::FirstReadTimeout), "{outcomes:?}");
    let warnings = take_warnings();
    assert!(
        warnings.contains("request failed") && warnings.contains("errno=110"),
        "the reader's own timeout was not a warning: {warnings}"
    );
}
