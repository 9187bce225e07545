//! The fallback engine: `pread`/`pwrite` on tokio's blocking thread pool.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;

use super::{AlignedBuf, IoEngine, IoResult, write_zero};

/// `pread`/`pwrite` from tokio's blocking pool; for kernels or sandboxes without io_uring.
#[derive(Debug, Clone, Copy, Default)]
pub struct PsyncEngine;

/// Reads up to `buf.capacity()` bytes at `offset` into `buf` on the calling thread, as
/// [`IoEngine::read`] does.
pub fn read_at(file: &File, offset: u64, mut buf: AlignedBuf) -> IoResult {
    let capacity = buf.capacity();
    let mut done = 0;
    while done < capacity {
        match file.read_at(&mut buf.spare_mut()[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (buf, Err(e)),
        }
    }
    buf.set_len(done);
    (buf, Ok(done))
}

fn write_at(file: &File, offset: u64, buf: &AlignedBuf) -> io::Result<usize> {
    let data = buf.padded();
    let mut done = 0;
    while done < data.len() {
        match file.write_at(&data[done..], offset + done as u64) {
            Ok(0) => return Err(write_zero()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Runs `job` on the blocking pool; `lost` stands in for its result if the runtime drops it
/// (only when shutting down: these jobs do not panic).
fn on_blocking_pool<T: Send + 'static>(
    job: impl FnOnce() -> T + Send + 'static,
    lost: impl FnOnce(io::Error) -> T + Send + 'static,
) -> BoxFuture<'static, T> {
    async move {
        tokio::task::spawn_blocking(job)
            .await
            .unwrap_or_else(|e| lost(io::Error::other(e)))
    }
    .boxed()
}

impl IoEngine for PsyncEngine {
    fn read(&self, file: Arc<File>, offset: u64, buf: AlignedBuf) -> BoxFuture<'static, IoResult> {
        on_blocking_pool(
            move || read_at(&file, offset, buf),
            |e| (AlignedBuf::new(0), Err(e)),
        )
    }

    fn write(
        &self,
        file: Arc<File>,
        offset: u64,
        buf: Arc<AlignedBuf>,
    ) -> BoxFuture<'static, io::Result<usize>> {
        on_blocking_pool(move || write_at(&file, offset, &buf), Err)
    }
}
