//! A decorator over any [`IoEngine`] that counts what passes through it and injects faults:
//! errors, short reads and latency on chosen requests (feature `test-util`). Tests wrap the
//! production engine in it, so faults are seen by the production read and write paths.

use std::fs::File;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;

use super::{AlignedBuf, IoEngine, IoResult};

/// Which kind of request a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Reads.
    Read,
    /// Writes.
    Write,
}

/// What happens to a request a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request fails with `EIO` and transfers nothing.
    Eio,
    /// A read returns only its first `n` bytes, as at the end of a truncated file.
    Short(usize),
    /// The request is held back this long, then runs.
    Delay(Duration),
}

#[derive(Debug, Clone, Copy)]
struct Rule {
    op: Op,
    fault: Fault,
    /// Requests it still applies to; `None` for every one.
    remaining: Option<u64>,
}

/// Counts of the requests that reached the engine (faulted ones included).
#[derive(Debug, Default)]
struct Counts {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
}

/// An [`IoEngine`] that forwards to another one, counting requests and applying the faults
/// set with [`FaultyEngine::inject`].
#[derive(Debug)]
pub struct FaultyEngine {
    inner: Arc<dyn IoEngine>,
    rules: Mutex<Vec<Rule>>,
    counts: Counts,
}

impl FaultyEngine {
    /// Wraps `inner`, with no faults.
    pub fn new(inner: Arc<dyn IoEngine>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            rules: Mutex::new(Vec::new()),
            counts: Counts::default(),
        })
    }

    /// Applies `fault` to the next `times` requests of kind `op` (every one with `None`),
    /// before any fault set earlier for that kind.
    pub fn inject(&self, op: Op, fault: Fault, times: Option<u64>) {
        self.rules.lock().insert(
            0,
            Rule {
                op,
                fault,
                remaining: times,
            },
        );
    }

    /// Removes every fault.
    pub fn clear(&self) {
        self.rules.lock().clear();
    }

    /// Reads requested so far.
    pub fn reads(&self) -> u64 {
        self.counts.reads.load(Ordering::Relaxed)
    }

    /// Bytes asked of the disk by reads so far (their buffers' capacities).
    pub fn read_bytes(&self) -> u64 {
        self.counts.read_bytes.load(Ordering::Relaxed)
    }

    /// Writes requested so far.
    pub fn writes(&self) -> u64 {
        self.counts.writes.load(Ordering::Relaxed)
    }

    /// The fault for the next request of kind `op`, using up one application of its rule.
    fn next_fault(&self, op: Op) -> Option<Fault> {
        let mut rules = self.rules.lock();
        let position = rules.iter().position(|rule| rule.op == op)?;
        let rule = &mut rules[position];
        let fault = rule.fault;
        if let Some(remaining) = &mut rule.remaining {
            *remaining -= 1;
            if *remaining == 0 {
                rules.remove(position);
            }
        }
        Some(fault)
    }
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl IoEngine for FaultyEngine {
    fn read(&self, file: Arc<File>, offset: u64, buf: AlignedBuf) -> BoxFuture<'static, IoResult> {
        self.counts.reads.fetch_add(1, Ordering::Relaxed);
        self.counts
            .read_bytes
            .fetch_add(buf.capacity() as u64, Ordering::Relaxed);
        let fault = self.next_fault(Op::Read);
        let read = self.inner.read(file, offset, buf);
        async move {
            match fault {
                None => read.await,
                Some(Fault::Eio) => {
                    let (buf, _) = read.await;
                    (buf, Err(eio()))
                }
                Some(Fault::Short(n)) => {
                    let (mut buf, result) = read.await;
                    let n = result.map(|done| done.min(n));
                    if let Ok(n) = n {
                        buf.set_len(n);
                    }
                    (buf, n)
                }
                Some(Fault::Delay(delay)) => {
                    tokio::time::sleep(delay).await;
                    read.await
                }
            }
        }
        .boxed()
    }

    fn write(
        &self,
        file: Arc<File>,
        offset: u64,
        buf: Arc<AlignedBuf>,
    ) -> BoxFuture<'static, io::Result<usize>> {
        self.counts.writes.fetch_add(1, Ordering::Relaxed);
        match self.next_fault(Op::Write) {
            Some(Fault::Eio) => async { Err(eio()) }.boxed(),
            Some(Fault::Delay(delay)) => {
                let write = self.inner.write(file, offset, buf);
                async move {
                    tokio::time::sleep(delay).await;
                    write.await
                }
                .boxed()
            }
            // A write either writes every byte or fails: a short write is an error.
            Some(Fault::Short(_)) => async { Err(super::write_zero()) }.boxed(),
            None => self.inner.write(file, offset, buf),
        }
    }
}
