//! The io_uring engine: one dedicated thread owns a ring and keeps up to `queue_depth`
//! operations in flight.
//!
//! Callers hand operations over a channel and ring an eventfd; the thread keeps a read of that
//! eventfd armed on the ring, so a single `submit_and_wait` wakes for either a completion or new
//! work. Short transfers are resubmitted from where they stopped.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::mpsc;

use futures::FutureExt;
use futures::future::BoxFuture;
use io_uring::{IoUring, opcode, types};
use tokio::sync::oneshot;

use super::{AlignedBuf, IoEngine, IoResult, write_zero};

/// `user_data` of the eventfd read; operations use their slot index.
const WAKE: u64 = u64::MAX;

/// What an operation transfers and whom it answers: a read owns its buffer and gives it
/// back; a write shares its buffer read-only with whoever else holds it.
enum Transfer {
    Read {
        buf: AlignedBuf,
        reply: oneshot::Sender<IoResult>,
    },
    Write {
        buf: Arc<AlignedBuf>,
        reply: oneshot::Sender<io::Result<usize>>,
    },
}

struct Op {
    transfer: Transfer,
    file: Arc<File>,
    offset: u64,
    /// Bytes to transfer in all: the capacity for a read, the padded length for a write.
    target: usize,
    done: usize,
}

impl Op {
    fn is_read(&self) -> bool {
        matches!(self.transfer, Transfer::Read { .. })
    }

    fn finish(self, result: io::Result<()>) {
        let done = self.done;
        // The caller may have gone away; then nobody wants the result.
        match self.transfer {
            Transfer::Read { mut buf, reply } => {
                let result = result.map(|()| {
                    buf.set_len(done);
                    done
                });
                let _ = reply.send((buf, result));
            }
            Transfer::Write { reply, .. } => {
                let _ = reply.send(result.map(|()| done));
            }
        }
    }

    fn entry(&mut self, slot: usize) -> io_uring::squeue::Entry {
        let fd = types::Fd(self.file.as_raw_fd());
        let remaining = u32::try_from(self.target - self.done).unwrap_or(u32::MAX);
        let offset = self.offset + self.done as u64;
        let entry = match &mut self.transfer {
            Transfer::Read { buf, .. } => {
                // SAFETY: `done < target <= capacity`, so the pointer stays inside the buffer,
                // which the operation keeps alive until its completion.
                let ptr = unsafe { buf.as_mut_ptr().add(self.done) };
                opcode::Read::new(fd, ptr, remaining).offset(offset).build()
            }
            Transfer::Write { buf, .. } => {
                // SAFETY: as above; the kernel only reads a write's buffer.
                let ptr = unsafe { buf.as_ptr().add(self.done) };
                opcode::Write::new(fd, ptr, remaining).offset(offset).build()
            }
        };
        entry.user_data(slot as u64)
    }
}

/// io_uring on a dedicated thread. Dropping the engine lets the thread finish what is in flight
/// and exit.
#[derive(Debug)]
pub struct UringEngine {
    tx: mpsc::Sender<Op>,
    wake: Arc<OwnedFd>,
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op")
            .field("read", &self.is_read())
            .field("offset", &self.offset)
            .field("target", &self.target)
            .field("done", &self.done)
            .finish()
    }
}

impl UringEngine {
    /// Creates the ring and starts its thread.
    pub fn start(queue_depth: u32) -> io::Result<Self> {
        let depth = queue_depth.max(1);
        let ring = IoUring::new((depth + 1).next_power_of_two())?;
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let (tx, rx) = mpsc::channel();
        let thread_wake = wake.clone();
        std::thread::Builder::new()
            .name("larder-uring".into())
            .spawn(move || Worker::new(ring, rx, thread_wake, depth as usize).run())?;
        Ok(Self { tx, wake })
    }

    fn submit(&self, op: Op) {
        if op.target == 0 {
            op.finish(Ok(()));
        } else if let Err(mpsc::SendError(op)) = self.tx.send(op) {
            op.finish(Err(io::Error::other("the io_uring thread has stopped")));
        } else {
            ring_eventfd(self.wake.as_raw_fd());
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // The sender drops after this; the wake-up lets the thread notice the disconnection.
        ring_eventfd(self.wake.as_raw_fd());
    }
}

fn ring_eventfd(fd: RawFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live local array to an eventfd we own. A failure can only
    // be an overflowing counter, which still leaves the eventfd readable: nothing to do.
    let _ = unsafe { libc::write(fd, one.as_ptr().cast(), one.len()) };
}

fn dropped() -> io::Error {
    io::Error::other("the io_uring thread dropped a request")
}

impl IoEngine for UringEngine {
    fn read(&self, file: Arc<File>, offset: u64, buf: AlignedBuf) -> BoxFuture<'static, IoResult> {
        let (reply, rx) = oneshot::channel();
        let target = buf.capacity();
        self.submit(Op {
            transfer: Transfer::Read { buf, reply },
            file,
            offset,
            target,
            done: 0,
        });
        async move { rx.await.unwrap_or_else(|_| (AlignedBuf::new(0), Err(dropped()))) }.boxed()
    }

    fn write(
        &self,
        file: Arc<File>,
        offset: u64,
        buf: Arc<AlignedBuf>,
    ) -> BoxFuture<'static, io::Result<usize>> {
        let (reply, rx) = oneshot::channel();
        let target = buf.padded_len();
        self.submit(Op {
            transfer: Transfer::Write { buf, reply },
            file,
            offset,
            target,
            done: 0,
        });
        async move { rx.await.unwrap_or_else(|_| Err(dropped())) }.boxed()
    }
}

struct Worker {
    ring: IoUring,
    rx: mpsc::Receiver<Op>,
    wake: Arc<OwnedFd>,
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    depth: usize,
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
    queue: VecDeque<Op>,
}

impl Worker {
    fn new(ring: IoUring, rx: mpsc::Receiver<Op>, wake: Arc<OwnedFd>, depth: usize) -> Self {
        Self {
            ring,
            rx,
            wake,
            wake_buf: Box::new([0; 8]),
            wake_armed: false,
            depth,
            slots: Vec::new(),
            free: Vec::new(),
            queue: VecDeque::new(),
        }
    }

    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn run(mut self) {
        let mut connected = true;
        loop {
            loop {
                match self.rx.try_recv() {
                    Ok(op) => self.queue.push_back(op),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        connected = false;
                        break;
                    }
                }
            }
            if !connected && self.queue.is_empty() && self.in_flight() == 0 {
                return;
            }
            if connected && !self.wake_armed {
                let entry =
                    opcode::Read::new(types::Fd(self.wake.as_raw_fd()), self.wake_buf.as_mut_ptr(), 8)
                        .build()
                        .user_data(WAKE);
                // SAFETY: `wake_buf` is boxed and lives as long as the ring (both in `self`).
                if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                    self.wake_armed = true;
                }
            }
            while self.in_flight() < self.depth {
                let Some(op) = self.queue.pop_front() else { break };
                self.start(op);
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    self.fail_all(&e);
                    return;
                }
            }
            let completions: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result()))
                .collect();
            for (user_data, result) in completions {
                if user_data == WAKE {
                    self.wake_armed = false;
                } else {
                    self.complete(user_data as usize, result);
                }
            }
        }
    }

    fn start(&mut self, mut op: Op) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        let entry = op.entry(slot);
        // SAFETY: the buffer and file stay alive in `slots[slot]` until the completion arrives.
        // The ring has room: it holds more entries than `depth` operations plus the wake read.
        match unsafe { self.ring.submission().push(&entry) } {
            Ok(()) => self.slots[slot] = Some(op),
            Err(_) => {
                self.free.push(slot);
                self.queue.push_front(op);
            }
        }
    }

    fn complete(&mut self, slot: usize, result: i32) {
        let Some(mut op) = self.slots.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.free.push(slot);
        if result < 0 {
            let errno = -result;
            if errno == libc::EINTR || errno == libc::EAGAIN {
                self.queue.push_front(op);
            } else {
                op.finish(Err(io::Error::from_raw_os_error(errno)));
            }
            return;
        }
        let n = result as usize;
        match (op.is_read(), n) {
            (true, 0) => op.finish(Ok(())),
            (false, 0) => op.finish(Err(write_zero())),
            _ => {
                op.done += n;
                if op.done >= op.target {
                    op.finish(Ok(()));
                } else {
                    self.queue.push_front(op);
                }
            }
        }
    }

    fn fail_all(&mut self, error: &io::Error) {
        tracing::error!(%error, "io_uring wait failed; failing every queued request");
        // In-flight buffers may still be in the kernel's hands: leak them rather than free them.
        for op in self.slots.drain(..).flatten() {
            std::mem::forget(op);
        }
        for op in self.queue.drain(..) {
            op.finish(Err(io::Error::new(error.kind(), error.to_string())));
        }
    }
}
