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

fn read_at(file: &File, offset: u64, mut buf: AlignedBuf) -> IoResult {
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

fn write_at(file: &File, offset: u64, mut buf: AlignedBuf) -> IoResult {
    let len = buf.len();
    let mut done = 0;
    while done < len {
        match file.write_at(&buf.spare_mut()[done..len], offset + done as u64) {
            Ok(0) => return (buf, Err(write_zero())),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (buf, Err(e)),
        }
    }
    (buf, Ok(done))
}

fn on_blocking_pool(job: impl FnOnce() -> IoResult + Send + 'static) -> BoxFuture<'static, IoResult> {
    async move {
        match tokio::task::spawn_blocking(job).await {
            Ok(result) => result,
            // The closure does not panic; a join error means the runtime is shutting down, and
            // the buffer went down with the task.
            Err(e) => (AlignedBuf::zeroed(0), Err(io::Error::other(e))),
        }
    }
    .boxed()
}

impl IoEngine for PsyncEngine {
    fn read(&self, file: Arc<File>, offset: u64, buf: AlignedBuf) -> BoxFuture<'static, IoResult> {
        on_blocking_pool(move || read_at(&file, offset, buf))
    }

    fn write(&self, file: Arc<File>, offset: u64, buf: AlignedBuf) -> BoxFuture<'static, IoResult> {
        on_blocking_pool(move || write_at(&file, offset, buf))
    }
}
