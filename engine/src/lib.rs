//! The I/O engine: positional reads and writes of aligned buffers on cache files.
//!
//! Two implementations share one trait: [`UringEngine`] (io_uring on a dedicated thread, the
//! default) and [`PsyncEngine`] (`pread`/`pwrite` on tokio's blocking pool, the fallback). Both
//! complete short transfers themselves: a read returns fewer bytes than asked only at end of file,
//! and a write either writes every byte or fails.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod buf;
#[cfg(feature = "test-util")]
pub mod fault;
mod psync;
mod uring;

use std::fs::File;
use std::io;
use std::sync::Arc;

use futures::future::BoxFuture;
use larder_config::IoEngineKind;

pub use buf::{ALIGN, AlignedBuf, align_up};
pub use psync::{PsyncEngine, read_at};
pub use uring::UringEngine;

/// What an I/O request gives back: its buffer, and the bytes transferred or the error.
pub type IoResult = (AlignedBuf, io::Result<usize>);

/// Positional I/O on open files with caller-owned aligned buffers.
pub trait IoEngine: Send + Sync + std::fmt::Debug + 'static {
    /// Reads up to `buf.capacity()` bytes at `offset` into `buf`; sets `buf.len()` to the bytes
    /// read, which is less than the capacity only at end of file.
    fn read(&self, file: Arc<File>, offset: u64, buf: AlignedBuf) -> BoxFuture<'static, IoResult>;

    /// Writes `buf.padded()` (its valid bytes and the zero padding to the next 4 KiB) at
    /// `offset`, all of it or an error. The buffer is only read, so it may be shared.
    fn write(
        &self,
        file: Arc<File>,
        offset: u64,
        buf: Arc<AlignedBuf>,
    ) -> BoxFuture<'static, io::Result<usize>>;
}

/// Builds the engine the config asks for.
pub fn build(kind: IoEngineKind, queue_depth: u32) -> io::Result<Arc<dyn IoEngine>> {
    Ok(match kind {
        IoEngineKind::Uring => Arc::new(UringEngine::start(queue_depth)?),
        IoEngineKind::Psync => Arc::new(PsyncEngine),
    })
}

/// The error a write reports when the kernel accepted zero bytes.
fn write_zero() -> io::Error {
    io::Error::new(io::ErrorKind::WriteZero, "the kernel wrote zero bytes")
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::OpenOptionsExt;

    use test_case::test_case;

    use super::*;

    fn engine(kind: IoEngineKind) -> Arc<dyn IoEngine> {
        build(kind, 8).expect("engine starts")
    }

    fn open_direct(path: &std::path::Path) -> Arc<File> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .expect("open");
        Arc::new(file)
    }

    #[test_case(IoEngineKind::Uring; "uring")]
    #[test_case(IoEngineKind::Psync; "psync")]
    #[tokio::test]
    async fn write_then_read_back(kind: IoEngineKind) {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = open_direct(&dir.path().join("f"));
        let engine = engine(kind);
        let data: Vec<u8> = (0..3 * ALIGN).map(|i| (i % 251) as u8).collect();
        let written = engine
            .write(file.clone(), ALIGN as u64, Arc::new(AlignedBuf::copy_from(&data)))
            .await;
        assert_eq!(written.expect("write"), data.len());

        let (buf, res) = engine
            .read(file.clone(), ALIGN as u64, AlignedBuf::new(data.len()))
            .await;
        assert_eq!(res.expect("read"), data.len());
        assert_eq!(buf.as_ref(), &data[..]);

        // Past the end of file a read is short, not an error.
        let (buf, res) = engine
            .read(file.clone(), 3 * ALIGN as u64, AlignedBuf::new(4 * ALIGN))
            .await;
        assert_eq!(res.expect("short read"), ALIGN);
        assert_eq!(buf.as_ref(), &data[2 * ALIGN..]);

        // A write of an unaligned length is padded with zeroes to 4 KiB.
        let written = engine
            .write(file.clone(), 0, Arc::new(AlignedBuf::copy_from(&[9; 100])))
            .await;
        assert_eq!(written.expect("padded write"), ALIGN);
        let (buf, _) = engine.read(file, 0, AlignedBuf::new(ALIGN)).await;
        assert!(buf.as_ref()[..100].iter().all(|&b| b == 9) && buf.as_ref()[100..].iter().all(|&b| b == 0));
    }

    #[test_case(IoEngineKind::Uring; "uring")]
    #[test_case(IoEngineKind::Psync; "psync")]
    #[tokio::test]
    async fn many_requests_in_flight(kind: IoEngineKind) {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = open_direct(&dir.path().join("f"));
        let engine = engine(kind);
        let writes = (0..64u8).map(|i| {
            let buf = Arc::new(AlignedBuf::copy_from(&[i; ALIGN]));
            engine.write(file.clone(), u64::from(i) * ALIGN as u64, buf)
        });
        for written in futures::future::join_all(writes).await {
            assert_eq!(written.expect("write"), ALIGN);
        }
        let reads =
            (0..64u8).map(|i| engine.read(file.clone(), u64::from(i) * ALIGN as u64, AlignedBuf::new(ALIGN)));
        for (i, (buf, res)) in futures::future::join_all(reads).await.into_iter().enumerate() {
            assert_eq!(res.expect("read"), ALIGN);
            assert!(buf.as_ref().iter().all(|&b| usize::from(b) == i));
        }
    }

    #[test_case(IoEngineKind::Uring; "uring")]
    #[test_case(IoEngineKind::Psync; "psync")]
    #[tokio::test]
    async fn errors_are_reported_and_buffers_come_back(kind: IoEngineKind) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").expect("write");
        // Opened read-only: a write must fail with EBADF, not hang or panic.
        let file = Arc::new(File::open(&path).expect("open"));
        let engine = engine(kind);
        let written = engine
            .write(file.clone(), 0, Arc::new(AlignedBuf::copy_from(&[1; ALIGN])))
            .await;
        assert_eq!(
            written.expect_err("write to a read-only fd").raw_os_error(),
            Some(libc::EBADF)
        );
        let (buf, res) = engine.read(file, 0, AlignedBuf::new(3 * ALIGN)).await;
        assert_eq!(res.expect("read of a one-byte file"), 1);
        assert_eq!((buf.len(), buf.capacity()), (1, 3 * ALIGN));
    }
}
