//! The `fuser` adapter: each kernel request becomes a task on the given tokio runtime that calls
//! the [`FileTree`], under a deadline and a bound on requests in flight, and replies.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::future::Future;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, InitFlags, IoctlFlags,
    KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};
use tokio::runtime::Handle;
use tokio::sync::Semaphore;
use tracing::{Instrument, Level};

use crate::{Attr, FileTree, FsError, FsErrorKind, NodeKind};

/// The kinds of request the adapter passes to the tree, a closed set: what an [`Observer`] is
/// told about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// `lookup`: a name in a directory.
    Lookup,
    /// `getattr`: attributes of a node.
    Getattr,
    /// `opendir`.
    Opendir,
    /// `readdir`: one page of a listing.
    Readdir,
    /// `releasedir`.
    Releasedir,
    /// `open` of a file.
    Open,
    /// `read` of an open file.
    Read,
    /// `release` of an open file.
    Release,
    /// `statfs`.
    Statfs,
}

impl Operation {
    /// Every operation, in declaration order: `op as usize` indexes this array.
    pub const ALL: [Self; 9] = [
        Self::Lookup,
        Self::Getattr,
        Self::Opendir,
        Self::Readdir,
        Self::Releasedir,
        Self::Open,
        Self::Read,
        Self::Release,
        Self::Statfs,
    ];

    /// The lowercase name of the FUSE request, as in logs and metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Lookup => "lookup",
            Self::Getattr => "getattr",
            Self::Opendir => "opendir",
            Self::Readdir => "readdir",
            Self::Releasedir => "releasedir",
            Self::Open => "open",
            Self::Read => "read",
            Self::Release => "release",
            Self::Statfs => "statfs",
        }
    }
}

/// How a request ended, as the [`Observer`] is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Answered: with what was asked, or with an error other than the one below.
    Replied,
    /// A read that ran past the deadline on a range of its handle that had not timed out
    /// before. Most often the kernel's readahead: when a reader comes to such a range, the
    /// kernel reads it again with a request of its own, so no reader sees this error, and it
    /// is logged at debug. A timeout of a range that timed out before is that second read,
    /// whose error a reader gets: it is logged as a warning, and counted as [`Self::Replied`].
    FirstReadTimeout,
}

/// Called once per request with its operation, the time from its arrival to its reply
/// (waiting for a slot under `max_in_flight` included) and how it ended. Runs on the
/// request's task: keep it cheap.
pub type Observer = Arc<dyn Fn(Operation, Duration, Outcome) + Send + Sync>;

/// The ranges of each open handle whose reads ran past the deadline, the last
/// [`ReadTimeouts::KEPT`] of each, to tell a first timeout from the kernel's second read.
#[derive(Debug, Default)]
struct ReadTimeouts(Mutex<HashMap<u64, VecDeque<Range<u64>>>>);

impl ReadTimeouts {
    const KEPT: usize = 64;

    /// Records that a read of `range` of handle `fh` timed out; true if none of the ranges
    /// kept for it overlaps `range`.
    fn first(&self, fh: u64, range: Range<u64>) -> bool {
        let mut handles = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let ranges = handles.entry(fh).or_default();
        let first = !ranges.iter().any(|r| r.start < range.end && range.start < r.end);
        if ranges.len() == Self::KEPT {
            ranges.pop_front();
        }
        ranges.push_back(range);
        first
    }

    /// Forgets a released handle.
    fn forget(&self, fh: u64) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).remove(&fh);
    }
}

/// How a tree is mounted.
#[derive(Clone)]
pub struct MountOptions {
    /// Requests being served at once; more wait in line.
    pub max_in_flight: usize,
    /// Deadline of one request; keep it below the kernel's FUSE timeout.
    pub deadline: Duration,
    /// How long the kernel may cache attributes and names.
    pub attr_ttl: Duration,
    /// Kernel readahead for the mount, in KiB (the kernel starts at 128).
    pub read_ahead_kb: u32,
    /// Threads reading requests from /dev/fuse.
    pub threads: usize,
    /// Let users other than the daemon's read the mount (pods run as other users).
    pub allow_other: bool,
    /// Told the latency of every request, e.g. to feed a histogram. Default none.
    pub observer: Option<Observer>,
    /// Pass reads of handles opened with a backing file straight to that file (FUSE
    /// passthrough, Linux 6.9+, CAP_SYS_ADMIN). Default true; off or unsupported, the tree
    /// serves those reads itself.
    pub passthrough: bool,
}

impl std::fmt::Debug for MountOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountOptions")
            .field("max_in_flight", &self.max_in_flight)
            .field("deadline", &self.deadline)
            .field("attr_ttl", &self.attr_ttl)
            .field("read_ahead_kb", &self.read_ahead_kb)
            .field("threads", &self.threads)
            .field("allow_other", &self.allow_other)
            .field("passthrough", &self.passthrough)
            .field(
                "observer",
                &self.observer.as_ref().map(|_| "Fn(Operation, Duration, Outcome)"),
            )
            .finish()
    }
}

impl Default for MountOptions {
    fn default() -> Self {
        Self {
            max_in_flight: 256,
            deadline: Duration::from_secs(60),
            attr_ttl: Duration::from_secs(1),
            read_ahead_kb: 16 * 1024,
            threads: 2,
            allow_other: true,
            observer: None,
            passthrough: true,
        }
    }
}

/// Largest read the kernel sends: 1 MiB.
const MAX_REQUEST: u32 = 1 << 20;

struct Adapter<T> {
    tree: Arc<T>,
    runtime: Handle,
    permits: Arc<Semaphore>,
    options: MountOptions,
    /// Whether the kernel agreed to passthrough at init.
    passthrough: bool,
    backings: Arc<Mutex<Backings>>,
    /// Reads being answered on a FUSE thread ([`FileTree::read_now`]): at most all threads but
    /// one, so that one thread is always free to take the next request.
    reading_now: AtomicUsize,
    /// Reads that timed out, by handle (see [`Outcome::FirstReadTimeout`]).
    read_timeouts: Arc<ReadTimeouts>,
    /// Dropped with the adapter, when the session ends: wakes [`Mounted::detach`].
    _session: tokio::sync::oneshot::Sender<()>,
}

/// A backing file registered with the kernel for one inode.
struct Backing {
    id: BackingId,
    /// (device, inode) of the file, to tell whether a new handle has the same one.
    file: (u64, u64),
    handles: usize,
}

/// How a handle reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Through the daemon and the inode's page cache.
    Cached,
    /// From the backing file, by the kernel.
    Passthrough,
    /// Through the daemon without the page cache: only when the inode is in passthrough with
    /// another backing file (a new version opened while the old one is open).
    Direct,
}

/// The io mode of inodes with open handles. The kernel fails an open (EIO) that mixes cached
/// and passthrough handles on one inode, or two backing files: a passthrough open waits for
/// cached handles to close (it reads through the daemon until then), and a handle that cannot
/// share the inode's backing file reads without the page cache.
#[derive(Default)]
struct Backings {
    by_ino: HashMap<u64, Backing>,
    cached: HashMap<u64, usize>,
    handles: HashMap<u64, (u64, Mode)>,
}

impl Backings {
    /// Chooses how handle `fh` of `ino` reads, registers the backing file with the kernel if it
    /// is the inode's first, and counts the handle.
    fn open(&mut self, reply: &ReplyOpen, ino: u64, fh: u64, file: Option<&std::fs::File>) -> Mode {
        use std::os::unix::fs::MetadataExt;
        let identity = file.and_then(|f| f.metadata().ok()).map(|m| (m.dev(), m.ino()));
        let mode = match (self.by_ino.entry(ino), file, identity) {
            (Entry::Occupied(known), Some(_), Some(identity)) if known.get().file == identity => {
                known.into_mut().handles += 1;
                Mode::Passthrough
            }
            (Entry::Occupied(_), _, _) => Mode::Direct,
            (Entry::Vacant(slot), Some(file), Some(identity)) if !self.cached.contains_key(&ino) => {
                match reply.open_backing(file) {
                    Ok(id) => {
                        slot.insert(Backing {
                            id,
                            file: identity,
                            handles: 1,
                        });
                        Mode::Passthrough
                    }
                    Err(error) => {
                        tracing::warn!(%error, "the kernel refused a backing file; serving reads instead");
                        Mode::Cached
                    }
                }
            }
            (Entry::Vacant(_), _, _) => Mode::Cached,
        };
        if mode == Mode::Cached {
            *self.cached.entry(ino).or_default() += 1;
        }
        self.handles.insert(fh, (ino, mode));
        mode
    }

    /// Forgets a handle; a backing file goes with its inode's last passthrough handle.
    fn release(&mut self, fh: u64) {
        let Some((ino, mode)) = self.handles.remove(&fh) else {
            return;
        };
        match mode {
            Mode::Passthrough => {
                if let Entry::Occupied(mut backing) = self.by_ino.entry(ino) {
                    backing.get_mut().handles -= 1;
                    if backing.get().handles == 0 {
                        backing.remove();
                    }
                }
            }
            Mode::Cached => {
                if let Entry::Occupied(mut count) = self.cached.entry(ino) {
                    *count.get_mut() -= 1;
                    if *count.get() == 0 {
                        count.remove();
                    }
                }
            }
            Mode::Direct => {}
        }
    }
}

fn file_attr(attr: &Attr) -> FileAttr {
    let (kind, perm, nlink) = match attr.kind {
        NodeKind::Directory => (FileType::Directory, 0o555, 2),
        NodeKind::File => (FileType::RegularFile, 0o444, 1),
    };
    FileAttr {
        ino: INodeNo(attr.ino),
        size: attr.size,
        blocks: attr.size.div_ceil(512),
        atime: attr.mtime,
        mtime: attr.mtime,
        ctime: attr.mtime,
        crtime: attr.mtime,
        kind,
        perm,
        nlink,
        // SAFETY: getuid/getgid cannot fail and touch no memory.
        uid: unsafe { libc::getuid() },
        // SAFETY: as above.
        gid: unsafe { libc::getgid() },
        rdev: 0,
        blksize: MAX_REQUEST,
        flags: 0,
    }
}

fn errno(error: &FsError) -> Errno {
    Errno::from_i32(error.errno())
}

/// What a request was about, for its log line.
#[derive(Debug, Clone)]
struct Call {
    op: Operation,
    ino: u64,
    /// The handle, for requests on an open file or directory.
    fh: Option<u64>,
    /// The name looked up.
    name: Option<String>,
    /// The bytes a read asked for, and where the handle's timed-out reads are kept.
    read: Option<(Range<u64>, Arc<ReadTimeouts>)>,
}

impl Call {
    fn new(op: Operation, ino: u64) -> Self {
        Self {
            op,
            ino,
            fh: None,
            name: None,
            read: None,
        }
    }

    fn fh(mut self, fh: u64) -> Self {
        self.fh = Some(fh);
        self
    }

    fn name(mut self, name: &OsStr) -> Self {
        self.name = Some(name.to_string_lossy().into_owned());
        self
    }

    fn read(mut self, range: Range<u64>, timeouts: &Arc<ReadTimeouts>) -> Self {
        self.read = Some((range, timeouts.clone()));
        self
    }

    /// Logs a failed request: the one place a tree's error is logged, at its level (a read's
    /// first timeout of a range at debug: see [`Outcome::FirstReadTimeout`]), with the
    /// operation, the node and the whole cause chain.
    fn failed(&self, error: &FsError) -> Outcome {
        let first_timeout = match (&self.read, self.fh) {
            (Some((range, timeouts)), Some(fh)) if matches!(error.kind(), FsErrorKind::TimedOut) => {
                timeouts.first(fh, range.clone())
            }
            _ => false,
        };
        let (level, outcome) = if first_timeout {
            (Level::DEBUG, Outcome::FirstReadTimeout)
        } else {
            (error.level(), Outcome::Replied)
        };
        macro_rules! failed {
            ($level:expr) => {
                tracing::event!(
                    $level,
                    op = self.op.name(),
                    ino = self.ino,
                    fh = self.fh,
                    name = self.name.as_deref(),
                    errno = error.errno(),
                    error = %error,
                    cause = %error.cause_chain(),
                    "request failed"
                )
            };
        }
        match level {
            Level::ERROR => failed!(Level::ERROR),
            Level::WARN => failed!(Level::WARN),
            Level::INFO => failed!(Level::INFO),
            Level::DEBUG => failed!(Level::DEBUG),
            Level::TRACE => failed!(Level::TRACE),
        }
        outcome
    }
}

impl<T: FileTree> Adapter<T> {
    /// Runs `work` as a task under the in-flight bound and the deadline, logs its failure once,
    /// and hands its result to `respond`, which replies. Returns at once: the dispatch loop
    /// never waits.
    fn dispatch<V, W, F>(&self, call: Call, work: W, respond: F)
    where
        V: Send + 'static,
        W: Future<Output = Result<V, FsError>> + Send + 'static,
        F: FnOnce(Result<V, FsError>) + Send + 'static,
    {
        let arrived = Instant::now();
        let permits = self.permits.clone();
        let deadline = self.options.deadline;
        let observer = self.options.observer.clone();
        let span = tracing::debug_span!("fuse", op = call.op.name(), ino = call.ino);
        self.runtime.spawn(
            async move {
                let result = match permits.acquire_owned().await {
                    Ok(_permit) => tokio::time::timeout(deadline, work).await.unwrap_or_else(|_| {
                        Err(FsError::new(
                            FsErrorKind::TimedOut,
                            format!("no reply within the mount's deadline of {deadline:?}"),
                        ))
                    }),
                    Err(_) => Err(FsError::new(FsErrorKind::Io, "the mount is shutting down")),
                };
                let outcome = match &result {
                    Err(error) => call.failed(error),
                    Ok(_) => Outcome::Replied,
                };
                respond(result);
                if let Some(observe) = observer {
                    observe(call.op, arrived.elapsed(), outcome);
                }
            }
            .instrument(span),
        );
    }
}

impl<T: FileTree> Filesystem for Adapter<T> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        // The kernel derives max_pages (and so the largest read) from max_write.
        let _ = config.set_max_write(MAX_REQUEST);
        let _ = config.set_max_readahead(MAX_REQUEST);
        // Let the kernel keep more readahead requests in flight than its default of 12.
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        if self.options.passthrough {
            self.passthrough = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            if !self.passthrough {
                tracing::info!(
                    "the kernel does not offer FUSE passthrough; every read goes through the daemon"
                );
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let (tree, name, ttl) = (self.tree.clone(), name.to_owned(), self.options.attr_ttl);
        let call = Call::new(Operation::Lookup, parent.0).name(&name);
        self.dispatch(
            call,
            async move { tree.lookup(parent.0, &name).await },
            move |r| match r {
                Ok(attr) => reply.entry(&ttl, &file_attr(&attr), fuser::Generation(0)),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let (tree, ttl) = (self.tree.clone(), self.options.attr_ttl);
        self.dispatch(
            Call::new(Operation::Getattr, ino.0),
            async move { tree.getattr(ino.0).await },
            move |r| match r {
                Ok(attr) => reply.attr(&ttl, &file_attr(&attr)),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            let error = FsError::from(FsErrorKind::ReadOnly);
            Call::new(Operation::Open, ino.0).failed(&error);
            reply.error(errno(&error));
            return;
        }
        let (tree, backings, passthrough) = (self.tree.clone(), self.backings.clone(), self.passthrough);
        let told = tree.clone();
        let call = Call::new(Operation::Open, ino.0);
        let failed = call.clone();
        self.dispatch(call, async move { tree.open(ino.0).await }, move |r| match r {
            Ok(opened) => {
                let flags = if opened.keep_cache {
                    FopenFlags::FOPEN_KEEP_CACHE
                } else {
                    FopenFlags::empty()
                };
                let fh = FileHandle(opened.fh);
                if !passthrough {
                    reply.opened(fh, flags);
                    return;
                }
                let mut backings = backings.lock().unwrap_or_else(PoisonError::into_inner);
                match backings.open(&reply, ino.0, opened.fh, opened.backing.as_ref()) {
                    Mode::Cached => reply.opened(fh, flags),
                    Mode::Direct => reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO),
                    Mode::Passthrough => match backings.by_ino.get(&ino.0) {
                        // The kernel reads the backing file's page cache; asking it to
                        // keep the inode's own as well makes later passthrough opens of
                        // the inode fail (EIO), seen on 6.18.
                        Some(backing) => {
                            told.passed_through(opened.fh);
                            reply.opened_passthrough(fh, FopenFlags::empty(), &backing.id);
                        }
                        None => {
                            let error = FsError::new(FsErrorKind::Io, "the backing file was not registered");
                            failed.failed(&error);
                            reply.error(errno(&error));
                        }
                    },
                }
            }
            Err(e) => reply.error(errno(&e)),
        });
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let arrived = Instant::now();
        let free = self.options.threads.saturating_sub(1).max(1);
        let now = self.reading_now.fetch_add(1, Ordering::Relaxed) < free;
        let answered = now.then(|| self.tree.read_now(fh.0, offset, size)).flatten();
        self.reading_now.fetch_sub(1, Ordering::Relaxed);
        if let Some(bytes) = answered {
            reply.data(&bytes);
            if let Some(observe) = &self.options.observer {
                observe(Operation::Read, arrived.elapsed(), Outcome::Replied);
            }
            return;
        }
        let tree = self.tree.clone();
        let range = offset..offset + u64::from(size);
        self.dispatch(
            Call::new(Operation::Read, ino.0)
                .fh(fh.0)
                .read(range, &self.read_timeouts),
            async move { tree.read(fh.0, offset, size).await },
            move |r| match r {
                Ok(bytes) => reply.data(&bytes),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let (tree, backings) = (self.tree.clone(), self.backings.clone());
        self.read_timeouts.forget(fh.0);
        self.dispatch(
            Call::new(Operation::Release, ino.0).fh(fh.0),
            async move {
                tree.release(fh.0).await;
                Ok(())
            },
            move |_: Result<(), FsError>| {
                reply.ok();
                // Only now has the kernel let go of the handle's io mode: an open taking
                // another mode before this point would fail.
                backings
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .release(fh.0);
            },
        );
    }

    // fuser's default batch_forget calls this once per inode.
    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.tree.forget(ino.0, nlookup);
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let tree = self.tree.clone();
        self.dispatch(
            Call::new(Operation::Opendir, ino.0),
            async move { tree.opendir(ino.0).await },
            move |r| match r {
                Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn releasedir(&self, _req: &Request, ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        let tree = self.tree.clone();
        self.dispatch(
            Call::new(Operation::Releasedir, ino.0).fh(fh.0),
            async move {
                tree.releasedir(fh.0).await;
                Ok(())
            },
            move |_: Result<(), FsError>| reply.ok(),
        );
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let tree = self.tree.clone();
        // Offsets: 0 and 1 are "." and ".."; entry i of the tree is at i + 2.
        let work = async move {
            let mut entries = Vec::new();
            if offset == 0 {
                entries.push((ino.0, FileType::Directory, ".".into(), 1));
            }
            if offset <= 1 {
                entries.push((ino.0, FileType::Directory, "..".into(), 2));
            }
            let first = offset.saturating_sub(2);
            for (i, entry) in tree.readdir(fh.0, first).await?.into_iter().enumerate() {
                let kind = match entry.kind {
                    NodeKind::Directory => FileType::Directory,
                    NodeKind::File => FileType::RegularFile,
                };
                entries.push((entry.ino, kind, entry.name, first + i as u64 + 3));
            }
            Ok(entries)
        };
        self.dispatch(
            Call::new(Operation::Readdir, ino.0).fh(fh.0),
            work,
            move |r| match r {
                Ok(entries) => {
                    for (ino, kind, name, next) in entries {
                        if reply.add(INodeNo(ino), next, kind, &name) {
                            break;
                        }
                    }
                    reply.ok();
                }
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing is ever written: nothing to flush.
        reply.ok();
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: ReplyXattr) {
        reply.error(Errno::from_i32(libc::ENODATA));
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        // No extended attributes: an empty list.
        if size == 0 { reply.size(0) } else { reply.data(&[]) }
    }

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        // Files here are plain files: no ioctl applies (Python's open asks for TCGETS).
        reply.error(Errno::from_i32(libc::ENOTTY));
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let tree = self.tree.clone();
        self.dispatch(
            Call::new(Operation::Statfs, 0),
            async move { tree.statfs().await },
            move |r| match r {
                Ok(stats) => {
                    let block = u64::from(MAX_REQUEST);
                    let (total, free) = (stats.total / block, stats.free / block);
                    reply.statfs(total, free, free, 0, 0, MAX_REQUEST, 255, MAX_REQUEST);
                }
                Err(e) => reply.error(errno(&e)),
            },
        );
    }
}

/// A mounted tree. Unmounts when dropped; [`Mounted::unmount`] reports errors,
/// [`Mounted::detach`] lets the files open under it close first.
pub struct Mounted {
    session: fuser::BackgroundSession,
    mountpoint: PathBuf,
    /// Closed when the session ends.
    ended: tokio::sync::oneshot::Receiver<()>,
}

impl std::fmt::Debug for Mounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mounted")
            .field("mountpoint", &self.mountpoint)
            .finish_non_exhaustive()
    }
}

/// How [`Mounted::detach`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detached {
    /// The kernel let go of the file system: no file was open under it, or the last one
    /// closed within the grace period.
    Released,
    /// Files were still open when the grace period ran out. They fail (`ENOTCONN`) once the
    /// process closes `/dev/fuse`.
    GraceExpired,
}

impl Mounted {
    /// Unmounts and waits for the request loop to end.
    pub fn unmount(self) -> io::Result<()> {
        self.session.umount_and_join()
    }

    /// Detaches the mount lazily: the mount point stops resolving into it at once, while the
    /// files already open under it are still served, until the last one closes or `grace`
    /// passes. Requests must keep being served meanwhile (the runtime keeps running).
    pub async fn detach(self, grace: Duration) -> io::Result<Detached> {
        let Mounted {
            session,
            mountpoint,
            ended,
        } = self;
        detach(&mountpoint)?;
        // From here fuser must never unmount: its unmount on drop would take whatever is at
        // the mount point by then, perhaps the mount of the next daemon. The session's thread
        // ends by itself when the kernel lets go (or the process exits).
        std::mem::forget(session);
        Ok(match tokio::time::timeout(grace, ended).await {
            Ok(_) => Detached::Released,
            Err(_) => Detached::GraceExpired,
        })
    }
}

/// Detaches whatever is mounted at `path` (`umount2(MNT_DETACH)`): it leaves the namespace at
/// once and goes when nothing uses it any more.
pub fn detach(path: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: a valid NUL-terminated path; umount2 has no other preconditions.
    if unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Mounts `tree` read-only at `mountpoint`. Requests run on `runtime`.
pub fn mount<T: FileTree>(
    tree: Arc<T>,
    mountpoint: &Path,
    options: &MountOptions,
    runtime: Handle,
) -> io::Result<Mounted> {
    let (alive, ended) = tokio::sync::oneshot::channel();
    let adapter = Adapter {
        _session: alive,
        tree,
        runtime,
        permits: Arc::new(Semaphore::new(options.max_in_flight.max(1))),
        options: options.clone(),
        passthrough: false,
        backings: Arc::default(),
        reading_now: AtomicUsize::new(0),
        read_timeouts: Arc::default(),
    };
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        MountOption::RO,
        MountOption::FSName("larder".into()),
        MountOption::Subtype("larder".into()),
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::DefaultPermissions,
    ];
    if options.allow_other {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(options.threads.max(1));
    let session = fuser::spawn_mount(adapter, mountpoint, &config)?;
    let mounted = Mounted {
        session,
        mountpoint: mountpoint.to_owned(),
        ended,
    };
    if let Err(error) = raise_read_ahead(mountpoint, options.read_ahead_kb) {
        tracing::warn!(%error, "could not raise the mount's readahead");
    }
    Ok(mounted)
}

/// Writes the mount's readahead: the kernel caps it at 128 KiB when the mount starts.
fn raise_read_ahead(mountpoint: &Path, kb: u32) -> io::Result<()> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let target = mountpoint.canonicalize()?;
    let device = mountinfo
        .lines()
        .filter(|line| line.split(' ').nth(4).map(Path::new) == Some(target.as_path()))
        .filter_map(|line| line.split(' ').nth(2))
        .next_back()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "mount not in /proc/self/mountinfo"))?;
    std::fs::write(format!("/sys/class/bdi/{device}/read_ahead_kb"), kb.to_string())
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;

    #[test]
    fn attributes_are_read_only() {
        let now = SystemTime::now();
        let file = file_attr(&Attr {
            ino: 7,
            kind: NodeKind::File,
            size: 1000,
            mtime: now,
        });
        assert_eq!(
            (file.perm, file.kind, file.blocks, file.ino),
            (0o444, FileType::RegularFile, 2, INodeNo(7))
        );
        assert_eq!(file.mtime, now);
        let dir = file_attr(&Attr {
            ino: 1,
            kind: NodeKind::Directory,
            size: 0,
            mtime: now,
        });
        assert_eq!((dir.perm, dir.kind), (0o555, FileType::Directory));
    }

    #[test]
    fn operations_index_their_table_and_have_distinct_names() {
        for (index, op) in Operation::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, index);
        }
        let names: std::collections::HashSet<_> = Operation::ALL.iter().map(|op| op.name()).collect();
        assert_eq!(names.len(), Operation::ALL.len());
    }
}
