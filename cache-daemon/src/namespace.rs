//! The file tree the mount serves: sources as directories, common prefixes of keys as
//! directories, objects as files, every read through the block cache.
//!
//! Names and keys. A directory's entries come from a delimited listing of its prefix. An entry
//! is shown under the last segment of its key; listings and attributes are cached for the
//! source's metadata TTL (forever for an immutable source). Keys that cannot be file names are
//! not shown and cannot be looked up: object_store refuses keys with empty, `.` or `..`
//! segments, names longer than 255 bytes are skipped, and every key is parsed (never joined as
//! text), so nothing outside a source's prefix is reachable. Names that are not UTF-8 are not
//! found (object keys are UTF-8).
//!
//! Versions. `open` pins the object's version: a HEAD if the one known is older than the TTL.
//! Every read on that handle returns that version's bytes or `ESTALE`. The kernel keeps a
//! file's page cache across opens while the version stays the same.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use larder_fuse_mount::{Attr, DirEntry, FileTree, FsError, FsStats, NodeKind, Opened, ROOT_INO};
use parking_lot::Mutex;

use crate::cache::{Cache, OpenObject, ReadError, Reader};
use crate::object::{ObjectId, ObjectVersion};
use crate::origin::{ListEntry, Origin, OriginError};

/// Longest name a directory entry may have.
const NAME_MAX: usize = 255;

/// Most entries one `readdir` call returns.
const READDIR_PAGE: usize = 512;

/// One configured source.
#[derive(Debug)]
pub struct Source {
    /// The origin.
    pub origin: Arc<Origin>,
    /// How long listings and versions are trusted; `None` for an immutable source.
    pub ttl: Option<Duration>,
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
    /// When `version` was last confirmed by a HEAD.
    checked: Option<Instant>,
    /// The version of the last open, to tell the kernel whether its pages are still good.
    last_opened: Option<ObjectId>,
}

#[derive(Debug, Default)]
struct Nodes {
    by_ino: HashMap<u64, Node>,
    by_path: HashMap<(Option<usize>, String), u64>,
    next: u64,
}

impl Nodes {
    /// The inode of `(source, path)`, created or refreshed from `node`.
    fn upsert(&mut self, node: Node) -> u64 {
        let key = (node.source, node.path.clone());
        if let Some(&ino) = self.by_path.get(&key) {
            if let Some(existing) = self.by_ino.get_mut(&ino) {
                existing.kind = node.kind;
                existing.size = node.size;
                existing.mtime = node.mtime;
                if node.version.as_ref().map(ObjectVersion::id)
                    != existing.version.as_ref().map(ObjectVersion::id)
                {
                    existing.version = node.version;
                    existing.checked = node.checked;
                }
            }
            return ino;
        }
        self.next += 1;
        let ino = self.next;
        self.by_ino.insert(ino, node);
        self.by_path.insert(key, ino);
        ino
    }
}

#[derive(Debug)]
struct Listing {
    fetched: Instant,
    entries: Arc<Vec<ListEntry>>,
}

/// The daemon's [`FileTree`].
#[derive(Debug)]
pub struct Namespace {
    sources: Vec<(String, Source)>,
    cache: Cache,
    nodes: Mutex<Nodes>,
    listings: Mutex<HashMap<(usize, String), Listing>>,
    handles: Mutex<HashMap<u64, Arc<Reader>>>,
    next_fh: AtomicU64,
    mounted_at: SystemTime,
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

/// What a daemon error means to a reader of the mount.
fn fs_error(error: &OriginError) -> FsError {
    match error {
        OriginError::NotFound { .. } => FsError::NotFound,
        OriginError::PermissionDenied { .. } => FsError::PermissionDenied,
        OriginError::VersionChanged { .. } => FsError::Stale,
        OriginError::RetriesExhausted { .. }
        | OriginError::DeadlineExceeded { .. }
        | OriginError::Rejected { .. }
        | OriginError::Config { .. } => FsError::Io,
    }
}

fn log_origin_error(error: OriginError) -> FsError {
    let mapped = fs_error(&error);
    if mapped == FsError::Io {
        tracing::warn!(%error, "origin request failed");
    }
    mapped
}

/// The last segment of a path.
fn leaf(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

impl Namespace {
    /// A tree over `sources` (name, source), reading through `cache`. With one source, its
    /// contents are the root; with several, each is a directory of the root.
    pub fn new(sources: Vec<(String, Source)>, cache: Cache) -> Self {
        let mut nodes = Nodes {
            next: ROOT_INO,
            ..Nodes::default()
        };
        let root_source = (sources.len() == 1).then_some(0);
        let mounted_at = SystemTime::now();
        let root = dir_node(root_source, String::new(), mounted_at);
        nodes.by_path.insert((root_source, String::new()), ROOT_INO);
        nodes.by_ino.insert(ROOT_INO, root);
        Self {
            sources,
            cache,
            nodes: Mutex::new(nodes),
            listings: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            mounted_at,
        }
    }

    fn node(&self, ino: u64) -> Result<Node, FsError> {
        self.nodes
            .lock()
            .by_ino
            .get(&ino)
            .cloned()
            .ok_or(FsError::NotFound)
    }

    fn fresh(&self, source: usize, since: Instant) -> bool {
        self.sources[source].1.ttl.is_none_or(|ttl| since.elapsed() < ttl)
    }

    /// The listing of a directory, from the cache while it is fresh.
    async fn list(&self, source: usize, path: &str) -> Result<Arc<Vec<ListEntry>>, FsError> {
        let key = (source, path.to_owned());
        if let Some(listing) = self.listings.lock().get(&key)
            && self.fresh(source, listing.fetched)
        {
            return Ok(listing.entries.clone());
        }
        let entries = Arc::new(
            self.sources[source]
                .1
                .origin
                .list(path)
                .await
                .map_err(log_origin_error)?,
        );
        self.listings.lock().insert(
            key,
            Listing {
                fetched: Instant::now(),
                entries: entries.clone(),
            },
        );
        Ok(entries)
    }

    /// The children of a directory node, as nodes (not yet numbered), in listing order.
    async fn children(&self, dir: &Node) -> Result<Vec<(String, Node)>, FsError> {
        let Some(source) = dir.source else {
            return Ok(self
                .sources
                .iter()
                .enumerate()
                .map(|(i, (name, _))| (name.clone(), self.dir_node(i, String::new())))
                .collect());
        };
        let listing = self.list(source, &dir.path).await?;
        let mut out: Vec<(String, Node)> = Vec::with_capacity(listing.len());
        let mut dirs = std::collections::HashSet::new();
        for entry in listing.iter() {
            let (path, node) = match entry {
                ListEntry::Prefix(path) => {
                    dirs.insert(path.clone());
                    (path.clone(), self.dir_node(source, path.clone()))
                }
                ListEntry::Object(version) => (version.key.clone(), self.file_node(source, version.clone())),
            };
            let name = leaf(&path);
            // A "directory marker" object named like its own directory or a sibling prefix.
            let marker = path == dir.path || (node.kind == NodeKind::File && dirs.contains(&path));
            if name.is_empty() || name.len() > NAME_MAX || marker {
                continue;
            }
            out.push((name.to_owned(), node));
        }
        Ok(out)
    }

    fn dir_node(&self, source: usize, path: String) -> Node {
        dir_node(Some(source), path, self.mounted_at)
    }

    fn file_node(&self, source: usize, version: ObjectVersion) -> Node {
        Node {
            source: Some(source),
            path: version.key.clone(),
            kind: NodeKind::File,
            size: version.size,
            mtime: version.modified,
            version: Some(version),
            checked: None,
            last_opened: None,
        }
    }

    fn attr(&self, ino: u64, node: &Node) -> Attr {
        Attr {
            ino,
            kind: node.kind,
            size: node.size,
            mtime: node.mtime,
        }
    }
}

impl FileTree for Namespace {
    async fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, FsError> {
        let name = name.to_str().ok_or(FsError::NotFound)?;
        if name.len() > NAME_MAX {
            return Err(FsError::InvalidName);
        }
        let dir = self.node(parent)?;
        if dir.kind != NodeKind::Directory {
            return Err(FsError::NotADirectory);
        }
        let children = self.children(&dir).await?;
        let (_, node) = children
            .into_iter()
            .find(|(n, _)| n == name)
            .ok_or(FsError::NotFound)?;
        let mut nodes = self.nodes.lock();
        let ino = nodes.upsert(node);
        let node = nodes.by_ino.get(&ino).ok_or(FsError::NotFound)?;
        Ok(self.attr(ino, node))
    }

    async fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        let node = self.node(ino)?;
        Ok(self.attr(ino, &node))
    }

    async fn readdir(&self, ino: u64, offset: u64) -> Result<Vec<DirEntry>, FsError> {
        let dir = self.node(ino)?;
        if dir.kind != NodeKind::Directory {
            return Err(FsError::NotADirectory);
        }
        let children = self.children(&dir).await?;
        let mut nodes = self.nodes.lock();
        Ok(children
            .into_iter()
            .skip(offset as usize)
            // The kernel takes a few hundred entries per call: number only those.
            .take(READDIR_PAGE)
            .map(|(name, node)| {
                let kind = node.kind;
                DirEntry {
                    ino: nodes.upsert(node),
                    kind,
                    name: name.into(),
                }
            })
            .collect())
    }

    async fn open(&self, ino: u64) -> Result<Opened, FsError> {
        let node = self.node(ino)?;
        let (Some(source), NodeKind::File) = (node.source, node.kind) else {
            return Err(FsError::IsADirectory);
        };
        let origin = self.sources[source].1.origin.clone();
        let version = match (&node.version, node.checked) {
            (Some(version), Some(checked)) if self.fresh(source, checked) => version.clone(),
            _ => origin.head(&node.path).await.map_err(log_origin_error)?,
        };
        let keep_cache = {
            let mut nodes = self.nodes.lock();
            let node = nodes.by_ino.get_mut(&ino).ok_or(FsError::NotFound)?;
            let keep = node.last_opened == Some(version.id());
            node.last_opened = Some(version.id());
            node.size = version.size;
            node.mtime = version.modified;
            node.version = Some(version.clone());
            node.checked = Some(Instant::now());
            keep
        };
        let reader = Reader::new(self.cache.clone(), OpenObject::new(origin, version));
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, Arc::new(reader));
        Ok(Opened { fh, keep_cache })
    }

    async fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Bytes, FsError> {
        let reader = self.handles.lock().get(&fh).cloned().ok_or(FsError::BadHandle)?;
        reader
            .read(offset, size as usize)
            .await
            .map_err(|error| match error {
                ReadError::Origin(error) => fs_error(&error),
                ReadError::Abandoned => FsError::Io,
            })
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
