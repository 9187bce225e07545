//! The file tree the mount serves: sources as directories, common prefixes of keys as
//! directories, objects as files, every read through the block cache.
//!
//! Names and keys. A name is looked up on its own: a HEAD of the key and a probe for keys
//! under `key/`, in parallel (a directory wins over an object of the same name). Directories
//! are listed page by page, as the kernel reads them, so a directory of 100,000 entries is
//! never held whole. What a name is (file with its version, directory, missing) and listing
//! pages are cached for the source's metadata TTL (forever for an immutable source; at most
//! [`MISSING_NAME_TTL`] for a missing name), in bounded caches. Keys that cannot be file names are
//! not shown and cannot be looked up: object_store refuses keys with empty, `.` or `..`
//! segments or control characters (a listing steps over them), names longer than 255 bytes
//! are skipped, and every key is parsed (never joined as text), so nothing outside a
//! source's prefix is reachable. Names that are not UTF-8 are not found (keys are UTF-8).
//! The directory of seal manifests at a source's root (`.larder-seal`, see
//! [`larder_peers::manifest`]) is neither listed nor found: it is Larder's, not the data's.
//!
//! Inodes. An inode number is a hash of the source and the path, so a listing can number its
//! entries without remembering them. The table keeps only the nodes the kernel holds, with
//! their lookup counts, and drops a node when the kernel forgets it.
//!
//! Versions. `open` pins the object's version: the one known if the origin gave it within the
//! TTL with an ETag (a HEAD, or a listing entry: after `ls`, opening a file costs no request
//! before its GET), else a HEAD.
//! Every read on that handle returns that version's bytes or `ESTALE` (the object replaced or
//! deleted at the origin). A read that finds the version gone also forgets what the name's
//! cached entry says, so the next lookup or open asks the origin (a new version, or
//! `ENOENT`) instead of trusting the entry until its TTL. The kernel keeps a file's page cache
//! across opens while the version stays the same.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures::future::Either;
use larder_fuse_mount::{
    Attr, DirEntry, FileTree, FsError, FsErrorKind, FsStats, NodeKind, Opened, ROOT_INO,
};
use larder_object::{ObjectId, ObjectVersion};
use larder_origin::{ListEntry, Origin, OriginError, PageToken};
use larder_peers::manifest::is_seal_key;
use larder_read_path::{Cache, OpenObject, ReadError, Reader};
use larder_stats::{MountStats, add};
use larder_store::Lease;
use object_store::path::PathPart;
use parking_lot::Mutex;

use crate::fs_error;

/// Longest name a directory entry may have.
const NAME_MAX: usize = 255;

/// Most entries one `readdir` call returns.
const READDIR_PAGE: usize = 512;

/// Names whose entry (file and version, directory, missing) is kept.
const CACHED_NAMES: u64 = 256 * 1024;

/// Listing entries kept in cached pages.
const CACHED_PAGE_ENTRIES: u64 = 256 * 1024;

/// Longest a missing name is trusted, even in an immutable source: objects do get added to
/// those, they only never change.
pub const MISSING_NAME_TTL: Duration = Duration::from_secs(30);

/// One configured source.
#[derive(Debug, Clone)]
pub struct ConfiguredSource {
    /// The origin.
    pub origin: Arc<Origin>,
    /// How long listings and versions are trusted; `None` for an immutable source.
    pub ttl: Option<Duration>,
}

/// What a name in a source is.
#[derive(Debug, Clone)]
enum Entry {
    Dir,
    /// An object's version, and when the origin gave it in a form an open can pin: a HEAD, or
    /// a listing entry with an ETag (`None` for a listing entry without one, as some stores
    /// list).
    File(ObjectVersion, Option<Instant>),
}

impl Entry {
    fn kind(&self) -> NodeKind {
        match self {
            Entry::Dir => NodeKind::Directory,
            Entry::File(..) => NodeKind::File,
        }
    }
}

/// A cached value and when it was fetched.
#[derive(Debug, Clone)]
struct Fetched<T> {
    at: Instant,
    value: T,
}

/// One page of a directory as the mount shows it: names and entries, in listing order.
#[derive(Debug)]
struct Page {
    children: Vec<(String, Entry)>,
    next: Option<PageToken>,
}

#[derive(Debug, Clone)]
struct Node {
    /// `None` for the root of a multi-source mount.
    source: Option<usize>,
    /// Path relative to the source: a prefix for a directory, a key for a file.
    path: String,
    kind: NodeKind,
    size: u64,
    mtime: SystemTime,
    version: Option<ObjectVersion>,
    /// When `version` was last given by the origin in a form an open can pin (see
    /// [`Entry::File`]).
    checked: Option<Instant>,
    /// The version of the last open, to tell the kernel whether its pages are still good.
    last_opened: Option<ObjectId>,
}

impl Node {
    fn attr(&self, ino: u64) -> Attr {
        Attr {
            ino,
            kind: self.kind,
            size: self.size,
            mtime: self.mtime,
        }
    }
}

/// The inode number of a path: a hash, with the top bit set so it never meets the root's.
fn ino_of(source: Option<usize>, path: &str) -> u64 {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&source.map_or(u64::MAX, |s| s as u64).to_le_bytes());
    hasher.update(path.as_bytes());
    let mut head = [0; 8];
    head.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    u64::from_le_bytes(head) | 1 << 63
}

/// The nodes the kernel holds references to, by inode number.
#[derive(Debug, Default)]
struct Inodes {
    by_ino: HashMap<u64, (Node, u64)>,
}

impl Inodes {
    /// Counts one more kernel reference to `node` and returns its inode number. A node already
    /// known keeps its pinned version unless `node` carries another.
    fn remember(&mut self, node: Node) -> u64 {
        let mut ino = ino_of(node.source, &node.path);
        loop {
            match self.by_ino.get_mut(&ino) {
                None => {
                    self.by_ino.insert(ino, (node, 1));
                    return ino;
                }
                Some((known, lookups)) if known.source == node.source && known.path == node.path => {
                    *lookups += 1;
                    known.kind = node.kind;
                    known.size = node.size;
                    known.mtime = node.mtime;
                    if node.version.as_ref().map(ObjectVersion::id)
                        != known.version.as_ref().map(ObjectVersion::id)
                    {
                        known.version = node.version;
                        known.checked = node.checked;
                    } else if node.checked > known.checked {
                        known.checked = node.checked;
                    }
                    return ino;
                }
                // Two paths with the same hash: the later one takes the next free number.
                Some(_) => ino = ino.wrapping_add(1) | 1 << 63,
            }
        }
    }

    /// Drops `count` references; the node goes with the last. The root stays.
    fn forget(&mut self, ino: u64, count: u64) {
        if ino == ROOT_INO {
            return;
        }
        if let Some((_, lookups)) = self.by_ino.get_mut(&ino) {
            *lookups = lookups.saturating_sub(count);
            if *lookups == 0 {
                self.by_ino.remove(&ino);
            }
        }
    }
}

/// An open directory: the page the kernel is reading and the position of its first entry.
#[derive(Debug)]
struct DirStream {
    dir: Node,
    base: u64,
    page: Option<Arc<Page>>,
}

/// The daemon's [`FileTree`].
#[derive(Debug)]
pub struct Namespace {
    sources: Vec<(String, ConfiguredSource)>,
    cache: Cache,
    inodes: Mutex<Inodes>,
    /// `(source, path)` → what it is, `None` if missing.
    names: moka::sync::Cache<(usize, String), Fetched<Option<Entry>>>,
    /// `(source, directory, start)` → a page of its listing.
    pages: moka::sync::Cache<(usize, String, Option<PageToken>), Fetched<Arc<Page>>>,
    dirs: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<DirStream>>>>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    /// Offer the kernel the data file of complete objects at open.
    passthrough: bool,
    /// Counts the opens handed to the kernel.
    stats: Arc<MountStats>,
    mounted_at: SystemTime,
}

/// An open file.
#[derive(Debug)]
struct Handle {
    reader: Arc<Reader>,
    /// The node it was opened on.
    ino: u64,
    source: usize,
    path: String,
    /// The size of the version it reads.
    size: u64,
    /// Held while the kernel may read the data file directly (passthrough).
    _lease: Option<Lease>,
}

/// The last segment of a path.
fn leaf(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// `name` inside directory `dir`.
fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

impl Namespace {
    /// A tree over `sources` (name, source), reading through `cache`. With one source, its
    /// contents are the root; with several, each is a directory of the root. With
    /// `passthrough`, opening a complete object offers the kernel its data file (counted in
    /// `stats`).
    pub fn new(
        sources: Vec<(String, ConfiguredSource)>,
        cache: Cache,
        passthrough: bool,
        stats: Arc<MountStats>,
    ) -> Self {
        let root_source = (sources.len() == 1).then_some(0);
        let mounted_at = SystemTime::now();
        let mut inodes = Inodes::default();
        let root = Self::dir_node(root_source, String::new(), mounted_at);
        inodes.by_ino.insert(ROOT_INO, (root, 1));
        Self {
            sources,
            cache,
            inodes: Mutex::new(inodes),
            names: moka::sync::Cache::new(CACHED_NAMES),
            pages: moka::sync::Cache::builder()
                .max_capacity(CACHED_PAGE_ENTRIES)
                .support_invalidation_closures()
                .weigher(|_, page: &Fetched<Arc<Page>>| {
                    u32::try_from(page.value.children.len() + 1).unwrap_or(u32::MAX)
                })
                .build(),
            dirs: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            passthrough,
            stats,
            mounted_at,
        }
    }

    /// A directory node; directories show the time the daemon mounted.
    fn dir_node(source: Option<usize>, path: String, mtime: SystemTime) -> Node {
        Node {
            source,
            path,
            kind: NodeKind::Directory,
            size: 0,
            mtime,
            version: None,
            checked: None,
            last_opened: None,
        }
    }

    fn entry_node(&self, source: usize, path: String, entry: Entry) -> Node {
        match entry {
            Entry::Dir => Self::dir_node(Some(source), path, self.mounted_at),
            Entry::File(version, checked) => Node {
                source: Some(source),
                path,
                kind: NodeKind::File,
                size: version.size,
                mtime: version.modified,
                version: Some(version),
                checked,
                last_opened: None,
            },
        }
    }

    fn node(&self, ino: u64) -> Result<Node, FsError> {
        self.inodes
            .lock()
            .by_ino
            .get(&ino)
            .map(|(node, _)| node.clone())
            .ok_or_else(|| FsErrorKind::NotFound.into())
    }

    fn fresh(&self, source: usize, since: Instant) -> bool {
        self.sources[source].1.ttl.is_none_or(|ttl| since.elapsed() < ttl)
    }

    fn remember_name(&self, source: usize, path: String, entry: Option<Entry>) {
        let value = Fetched {
            at: Instant::now(),
            value: entry,
        };
        self.names.insert((source, path), value);
    }

    /// What `path` is in `source`: from the cache while it is fresh, else a HEAD of the key and
    /// a probe for keys under it, in parallel.
    async fn resolve(&self, source: usize, path: String) -> Result<Option<Entry>, FsError> {
        let key = (source, path);
        if let Some(known) = self.names.get(&key) {
            let trusted = match known.value {
                Some(_) => self.fresh(source, known.at),
                None => known.at.elapsed() < MISSING_NAME_TTL && self.fresh(source, known.at),
            };
            if trusted {
                return Ok(known.value);
            }
        }
        let path = key.1;
        let origin = &self.sources[source].1.origin;
        // Both at once; a directory does not wait for its HEAD (some stores answer a HEAD of a
        // prefix slowly, or with a 5xx that would be retried).
        let (is_dir, head) = (Box::pin(origin.is_dir(&path)), Box::pin(origin.head(&path)));
        let (is_dir, head) = match futures::future::select(is_dir, head).await {
            Either::Left((Ok(true), _)) => (Ok(true), None),
            Either::Left((is_dir, head)) => (is_dir, Some(head.await)),
            Either::Right((head, is_dir)) => (is_dir.await, Some(head)),
        };
        let entry = match (is_dir, head) {
            (Ok(true), _) => Some(Entry::Dir),
            (Ok(false), Some(Ok(version))) => Some(Entry::File(version, Some(Instant::now()))),
            (Ok(false), Some(Err(OriginError::NotFound { .. })) | None) => None,
            (Err(error), _) | (_, Some(Err(error))) => return Err(fs_error::of_origin(error)),
        };
        self.remember_name(source, path, entry.clone());
        Ok(entry)
    }

    /// A page of the listing of `dir` from `from`, from the cache while it is fresh. Every
    /// entry on it is remembered for lookups.
    async fn page(&self, source: usize, dir: &str, from: Option<PageToken>) -> Result<Arc<Page>, FsError> {
        let key = (source, dir.to_owned(), from);
        if let Some(page) = self.pages.get(&key)
            && self.fresh(source, page.at)
        {
            return Ok(page.value);
        }
        let listing = self.sources[source]
            .1
            .origin
            .list_page(dir, key.2.as_ref())
            .await
            .map_err(fs_error::of_origin)?;
        let prefixes: HashSet<&str> = listing
            .entries
            .iter()
            .filter_map(|e| match e {
                ListEntry::Prefix(path) => Some(path.as_str()),
                ListEntry::Object(_) => None,
            })
            .collect();
        let mut children = Vec::with_capacity(listing.entries.len());
        for listed in &listing.entries {
            let (path, entry) = match listed {
                ListEntry::Prefix(path) => (path, Entry::Dir),
                ListEntry::Object(version) => {
                    let pinnable = version.etag.is_some().then(Instant::now);
                    (&version.key, Entry::File(version.clone(), pinnable))
                }
            };
            let name = leaf(path);
            // A "directory marker" object named like its own directory or a sibling prefix.
            let marker = path == dir || (entry.kind() == NodeKind::File && prefixes.contains(path.as_str()));
            if name.is_empty() || name.len() > NAME_MAX || marker || is_seal_key(path) {
                continue;
            }
            self.remember_name(source, path.clone(), Some(entry.clone()));
            children.push((name.to_owned(), entry));
        }
        let page = Arc::new(Page {
            children,
            next: listing.next,
        });
        let value = Fetched {
            at: Instant::now(),
            value: page.clone(),
        };
        self.pages.insert(key, value);
        Ok(page)
    }

    /// The origin no longer has the version handle `fh` pinned: it answered a read of it with
    /// 412 (replaced) or 404 (`deleted`). Forgets what the name's cached entry and node say, so
    /// the next lookup or open asks the origin instead of waiting for the TTL (at the cost of
    /// one HEAD, should they already know a newer version); for a delete, also the listing of
    /// the directory, so `ls` stops showing the name.
    fn forget_version(&self, fh: u64, deleted: bool) {
        let Some((ino, source, path)) = self
            .handles
            .lock()
            .get(&fh)
            .map(|h| (h.ino, h.source, h.path.clone()))
        else {
            return;
        };
        if let Some((node, _)) = self.inodes.lock().by_ino.get_mut(&ino) {
            node.checked = None;
        }
        let dir = path.rsplit_once('/').map_or("", |(dir, _)| dir).to_owned();
        // Once per delete, not once per failed read: the first drops the name.
        let known = self.names.remove(&(source, path));
        if deleted
            && matches!(
                known,
                Some(Fetched {
                    value: Some(Entry::File(..)),
                    ..
                })
            )
        {
            let listed = self
                .pages
                .invalidate_entries_if(move |(s, d, _), _| *s == source && *d == dir);
            if let Err(error) = listed {
                tracing::warn!(%error, "cannot drop the listing of a deleted object's directory");
            }
        }
    }

    /// The sources, as the root of a multi-source mount lists them.
    fn source_entries(&self) -> impl Iterator<Item = DirEntry> + '_ {
        self.sources.iter().enumerate().map(|(i, (name, _))| DirEntry {
            ino: ino_of(Some(i), ""),
            kind: NodeKind::Directory,
            name: name.into(),
        })
    }
}

impl FileTree for Namespace {
    async fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, FsError> {
        let name = name.to_str().ok_or(FsErrorKind::NotFound)?;
        if name.len() > NAME_MAX {
            return Err(FsErrorKind::InvalidName.into());
        }
        // A name no key can have (a control character) is simply not there.
        PathPart::parse(name).map_err(|_| FsErrorKind::NotFound)?;
        let dir = self.node(parent)?;
        if dir.kind != NodeKind::Directory {
            return Err(FsErrorKind::NotADirectory.into());
        }
        let node = match dir.source {
            None => {
                let source = self.sources.iter().position(|(n, _)| n == name);
                Self::dir_node(
                    Some(source.ok_or(FsErrorKind::NotFound)?),
                    String::new(),
                    self.mounted_at,
                )
            }
            Some(source) => {
                let path = join(&dir.path, name);
                if is_seal_key(&path) {
                    return Err(FsErrorKind::NotFound.into());
                }
                let entry = self
                    .resolve(source, path.clone())
                    .await?
                    .ok_or(FsErrorKind::NotFound)?;
                self.entry_node(source, path, entry)
            }
        };
        let ino = self.inodes.lock().remember(node.clone());
        Ok(node.attr(ino))
    }

    fn forget(&self, ino: u64, count: u64) {
        self.inodes.lock().forget(ino, count);
    }

    async fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        Ok(self.node(ino)?.attr(ino))
    }

    async fn opendir(&self, ino: u64) -> Result<u64, FsError> {
        let dir = self.node(ino)?;
        if dir.kind != NodeKind::Directory {
            return Err(FsErrorKind::NotADirectory.into());
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let stream = DirStream {
            dir,
            base: 0,
            page: None,
        };
        self.dirs
            .lock()
            .insert(fh, Arc::new(tokio::sync::Mutex::new(stream)));
        Ok(fh)
    }

    async fn readdir(&self, fh: u64, offset: u64) -> Result<Vec<DirEntry>, FsError> {
        let stream = self.dirs.lock().get(&fh).cloned().ok_or(FsErrorKind::BadHandle)?;
        let mut stream = stream.lock().await;
        let Some(source) = stream.dir.source else {
            return Ok(self.source_entries().skip(offset as usize).collect());
        };
        // Reading from the start again (rewinddir), or the first read.
        let mut page = match &stream.page {
            Some(page) if offset >= stream.base => page.clone(),
            _ => {
                let page = self.page(source, &stream.dir.path, None).await?;
                stream.base = 0;
                stream.page = Some(page.clone());
                page
            }
        };
        loop {
            let end = stream.base + page.children.len() as u64;
            if offset < end {
                let first = (offset - stream.base) as usize;
                return Ok(page.children[first..]
                    .iter()
                    // The kernel takes a few hundred entries per call.
                    .take(READDIR_PAGE)
                    .map(|(name, entry)| DirEntry {
                        ino: ino_of(Some(source), &join(&stream.dir.path, name)),
                        kind: entry.kind(),
                        name: name.into(),
                    })
                    .collect());
            }
            let Some(next) = page.next.clone() else {
                return Ok(Vec::new());
            };
            page = self.page(source, &stream.dir.path, Some(next)).await?;
            stream.base = end;
            stream.page = Some(page.clone());
        }
    }

    async fn releasedir(&self, fh: u64) {
        self.dirs.lock().remove(&fh);
    }

    async fn open(&self, ino: u64) -> Result<Opened, FsError> {
        let node = self.node(ino)?;
        let (Some(source), NodeKind::File) = (node.source, node.kind) else {
            return Err(FsErrorKind::IsADirectory.into());
        };
        let origin = self.sources[source].1.origin.clone();
        let (version, checked) = match (&node.version, node.checked) {
            (Some(version), Some(checked)) if self.fresh(source, checked) => (version.clone(), checked),
            _ => {
                let version = origin.head(&node.path).await.map_err(fs_error::of_origin)?;
                let checked = Instant::now();
                let entry = Entry::File(version.clone(), Some(checked));
                self.remember_name(source, node.path.clone(), Some(entry));
                (version, checked)
            }
        };
        // Pages the kernel kept may hold a rack member's bytes that the origin check dropped.
        let dropped = self.cache.take_origin_mismatch(version.id());
        let keep_cache = {
            let mut inodes = self.inodes.lock();
            let (node, _) = inodes.by_ino.get_mut(&ino).ok_or(FsErrorKind::NotFound)?;
            let keep = node.last_opened == Some(version.id()) && !dropped;
            node.last_opened = Some(version.id());
            node.size = version.size;
            node.mtime = version.modified;
            node.version = Some(version.clone());
            node.checked = Some(checked);
            keep
        };
        let leased = self
            .passthrough
            .then(|| self.cache.store().lease_complete(&version))
            .flatten();
        let (backing, lease) = leased.unzip();
        let size = version.size;
        let object = OpenObject::new(origin, version);
        // A file passed through is read by the kernel alone: there is nothing to load ahead.
        let load = backing
            .is_none()
            .then(|| self.cache.model_load(&object, &node.path))
            .flatten();
        let reader = Arc::new(Reader::new(self.cache.clone(), object).loading(load));
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let handle = Handle {
            reader,
            ino,
            source,
            path: node.path,
            size,
            _lease: lease,
        };
        self.handles.lock().insert(fh, handle);
        Ok(Opened {
            fh,
            keep_cache,
            backing,
        })
    }

    fn read_now(&self, fh: u64, offset: u64, size: u32) -> Option<Bytes> {
        let reader = self.handles.lock().get(&fh)?.reader.clone();
        reader.read_now(offset, size as usize)
    }

    async fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Bytes, FsError> {
        let reader = self
            .handles
            .lock()
            .get(&fh)
            .map(|h| h.reader.clone())
            .ok_or(FsErrorKind::BadHandle)?;
        let error = match reader.read(offset, size as usize).await {
            Ok(bytes) => return Ok(bytes),
            Err(error) => error,
        };
        if let ReadError::Origin(origin) = &error
            && let OriginError::VersionChanged { .. } | OriginError::NotFound { .. } = **origin
        {
            self.forget_version(fh, matches!(**origin, OriginError::NotFound { .. }));
        }
        Err(fs_error::of_read(error))
    }

    fn passed_through(&self, fh: u64) {
        // The reads of this handle go from the kernel to the data file: all the daemon sees
        // of them is this open.
        let Some(size) = self.handles.lock().get(&fh).map(|h| h.size) else {
            return;
        };
        add(&self.stats.passthrough_opens, 1);
        add(&self.stats.passthrough_open_bytes, size);
    }

    async fn release(&self, fh: u64) {
        self.handles.lock().remove(&fh);
    }

    async fn statfs(&self) -> Result<FsStats, FsError> {
        let usage = self.cache.store().usage();
        Ok(FsStats {
            total: usage.capacity,
            free: usage.capacity.saturating_sub(usage.used + usage.reserved),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str) -> Node {
        let mut node = Namespace::dir_node(Some(0), path.to_owned(), SystemTime::UNIX_EPOCH);
        node.kind = NodeKind::File;
        node
    }

    #[test]
    fn inode_numbers_are_stable_and_never_the_root() {
        assert_eq!(ino_of(Some(0), "a/b"), ino_of(Some(0), "a/b"));
        assert_ne!(ino_of(Some(0), "a/b"), ino_of(Some(1), "a/b"));
        assert_ne!(ino_of(None, ""), ino_of(Some(0), ""));
        assert!(ino_of(Some(0), "") > ROOT_INO);
    }

    #[test]
    fn a_node_lives_until_the_kernel_forgets_every_lookup() {
        let mut inodes = Inodes::default();
        let ino = inodes.remember(file("a/b"));
        assert_eq!(inodes.remember(file("a/b")), ino);
        assert_eq!(ino, ino_of(Some(0), "a/b"));
        inodes.forget(ino, 1);
        assert!(inodes.by_ino.contains_key(&ino));
        inodes.forget(ino, 1);
        assert!(!inodes.by_ino.contains_key(&ino));
        // Forgetting what is gone, or the root, changes nothing.
        inodes.forget(ino, 5);
        inodes.by_ino.insert(ROOT_INO, (file(""), 1));
        inodes.forget(ROOT_INO, 1);
        assert!(inodes.by_ino.contains_key(&ROOT_INO));
    }

    #[test]
    fn a_hash_collision_takes_the_next_number() {
        let mut inodes = Inodes::default();
        let taken = ino_of(Some(0), "b");
        inodes.by_ino.insert(taken, (file("a"), 1));
        let ino = inodes.remember(file("b"));
        assert_eq!(ino, taken + 1);
        assert_eq!(inodes.by_ino[&ino].0.path, "b");
    }
}
