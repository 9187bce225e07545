//! What the mirror knows of tags and content beyond the blocks: which digest a tag named when
//! last resolved, and each digest's size (and a manifest's media type). The block store keys
//! content by (digest, size), so a blob can be found without its upstream only if its size is
//! known here; a tag can be served while its upstream is down only from here.
//!
//! It also keeps, for content whose digest was checked, one BLAKE3 over its blocks' BLAKE3 as
//! they were when the check passed (32 bytes, whatever the content's size): after a restart,
//! content whose blocks the store still records with those hashes (every block sent is
//! checked against them) needs no second SHA-256 pass.
//!
//! Kept in one small JSON file in the cache dir (`registry-index.json`), written whole
//! (a temporary file renamed over it) after each change, read at start; a file that cannot be
//! read is logged and started over (the content stays cached; only what names it is lost).
//! Bounded: past [`MAX_TAGS`] the oldest tag is forgotten, past [`MAX_CONTENTS`] the entries of
//! content no tag names go first.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::reference::Digest;

/// The index file's name in the cache dir.
pub(crate) const INDEX_FILE: &str = "registry-index.json";

/// Most tags remembered.
const MAX_TAGS: usize = 4096;

/// Most digests remembered.
const MAX_CONTENTS: usize = 65536;

/// The format written; another is started over.
const FORMAT: u32 = 1;

/// A tag's last resolution.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TagEntry {
    /// The manifest it named.
    pub digest: Digest,
    /// When, in seconds since the epoch.
    pub resolved: u64,
}

/// What is known of a digest's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ContentEntry {
    /// Its size in bytes.
    pub size: u64,
    /// A manifest's media type; `None` for a blob.
    pub media_type: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Saved {
    format: u32,
    tags: BTreeMap<String, TagEntry>,
    contents: BTreeMap<Digest, ContentEntry>,
    /// The block size and the [`fingerprint`] of the blocks of content whose digest was
    /// checked.
    #[serde(default)]
    verified: BTreeMap<Digest, (u64, String)>,
    /// When each tag was resolved by this process, on the monotonic clock: a tag's age within
    /// a run never follows the wall clock (set back, it would make every tag fresh again).
    #[serde(skip)]
    resolved_here: HashMap<String, Instant>,
}

/// The mirror's index, shared.
#[derive(Debug)]
pub(crate) struct Index {
    path: PathBuf,
    state: Mutex<Saved>,
    /// Held while the file is written, so two writes never interleave.
    writing: tokio::sync::Mutex<()>,
}

impl Index {
    /// Reads the index in `cache_dir`, or starts an empty one.
    pub(crate) fn open(cache_dir: &Path) -> Arc<Self> {
        let path = cache_dir.join(INDEX_FILE);
        let saved = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Saved>(&bytes) {
                Ok(saved) if saved.format == FORMAT => saved,
                Ok(_) => {
                    tracing::warn!(path = %path.display(), "registry index of another format: starting over");
                    Saved::default()
                }
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "registry index unreadable: starting over");
                    Saved::default()
                }
            },
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Saved::default(),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "registry index unreadable: starting over");
                Saved::default()
            }
        };
        Arc::new(Self {
            path,
            state: Mutex::new(saved),
            writing: tokio::sync::Mutex::new(()),
        })
    }

    /// The last resolution of tag `key`, and how long ago it was: by the monotonic clock if
    /// this process resolved it, else by the wall clock, where a resolution that seems to lie
    /// in the future (the clock was set back since) is taken as too old to trust.
    pub(crate) fn tag(&self, key: &str) -> Option<(TagEntry, Duration)> {
        let state = self.state.lock();
        let entry = state.tags.get(key)?.clone();
        let age = match state.resolved_here.get(key) {
            Some(resolved) => resolved.elapsed(),
            None => {
                let resolved = UNIX_EPOCH + Duration::from_secs(entry.resolved);
                SystemTime::now()
                    .duration_since(resolved)
                    .unwrap_or(Duration::MAX)
            }
        };
        Some((entry, age))
    }

    /// What is known of `digest`.
    pub(crate) fn content(&self, digest: &Digest) -> Option<ContentEntry> {
        self.state.lock().contents.get(digest).cloned()
    }

    /// Records that tag `key` names `digest` now, and what that content is.
    pub(crate) async fn resolved(&self, key: &str, digest: &Digest, content: ContentEntry) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        {
            let mut state = self.state.lock();
            let entry = TagEntry {
                digest: digest.clone(),
                resolved: now,
            };
            state.tags.insert(key.to_owned(), entry);
            state.resolved_here.insert(key.to_owned(), Instant::now());
            if state.tags.len() > MAX_TAGS
                && let Some(oldest) = state
                    .tags
                    .iter()
                    .min_by_key(|(_, entry)| entry.resolved)
                    .map(|(key, _)| key.clone())
            {
                state.tags.remove(&oldest);
                state.resolved_here.remove(&oldest);
            }
            if !state.verified.contains_key(digest) {
                insert_content(&mut state, digest, content);
            }
        }
        self.save().await;
    }

    /// Records what each digest's content is said to be (by a HEAD, or a manifest naming it);
    /// the file is written once, and only if one is new. A size is a claim until the content
    /// is checked against its digest: what was checked is never replaced by a claim.
    pub(crate) async fn learned(&self, contents: impl IntoIterator<Item = (Digest, ContentEntry)>) {
        let new = {
            let mut state = self.state.lock();
            let mut new = false;
            for (digest, content) in contents {
                if state.contents.get(&digest) != Some(&content) && !state.verified.contains_key(&digest) {
                    insert_content(&mut state, &digest, content);
                    new = true;
                }
            }
            new
        };
        if new {
            self.save().await;
        }
    }

    /// Forgets what `digest`'s content was said to be, unless it was checked: the content could
    /// not be fetched or checked at that size, so the size may be what was wrong, and the next
    /// request asks the upstream again.
    pub(crate) async fn forget_claim(&self, digest: &Digest) {
        let forgotten = {
            let mut state = self.state.lock();
            !state.verified.contains_key(digest) && state.contents.remove(digest).is_some()
        };
        if forgotten {
            self.save().await;
        }
    }

    /// Whether `digest`'s content, in blocks of `block_size` hashing to `hashes`, is as it
    /// was when its digest was last checked.
    pub(crate) fn verified(&self, digest: &Digest, block_size: u64, hashes: &[[u8; 32]]) -> bool {
        let state = self.state.lock();
        state.verified.get(digest).is_some_and(|(size, recorded)| {
            *size == block_size && *recorded == hex::encode(fingerprint(hashes))
        })
    }

    /// Whether `digest`'s content was checked against it (at the size the index holds).
    pub(crate) fn is_verified(&self, digest: &Digest) -> bool {
        self.state.lock().verified.contains_key(digest)
    }

    /// Records that `digest`'s content, in blocks of `block_size`, checked out with `hashes`.
    pub(crate) async fn record_verified(&self, digest: &Digest, block_size: u64, hashes: &[[u8; 32]]) {
        {
            let mut state = self.state.lock();
            if state.verified.len() >= MAX_CONTENTS {
                state.verified.clear();
            }
            let recorded = (block_size, hex::encode(fingerprint(hashes)));
            state.verified.insert(digest.clone(), recorded);
        }
        self.save().await;
    }

    /// Forgets that `digest`'s content was checked: a block of it no longer hashes as it did.
    pub(crate) async fn forget_verified(&self, digest: &Digest) {
        let known = self.state.lock().verified.remove(digest).is_some();
        if known {
            self.save().await;
        }
    }

    /// Writes the index whole: a temporary file, renamed over the last.
    async fn save(&self) {
        let _writing = self.writing.lock().await;
        let bytes = {
            let mut state = self.state.lock();
            state.format = FORMAT;
            serde_json::to_vec(&*state)
        };
        let Ok(bytes) = bytes else {
            return;
        };
        let path = self.path.clone();
        let written = tokio::task::spawn_blocking(move || {
            let temporary = path.with_extension("json.tmp");
            // Like every file of the cache dir, readable by root only.
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&temporary)?
                .write_all(&bytes)?;
            std::fs::rename(&temporary, &path)
        })
        .await;
        match written {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(path = %self.path.display(), %error, "registry index not written");
            }
            Err(error) => tracing::warn!(%error, "registry index not written"),
        }
    }
}

/// One BLAKE3 over the blocks' BLAKE3, in order.
fn fingerprint(hashes: &[[u8; 32]]) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new();
    for hash in hashes {
        hasher.update(hash);
    }
    *hasher.finalize().as_bytes()
}

/// Adds `digest` to the contents, forgetting others past the bound: first those no tag names.
fn insert_content(state: &mut Saved, digest: &Digest, content: ContentEntry) {
    state.contents.insert(digest.clone(), content);
    if state.contents.len() <= MAX_CONTENTS {
        return;
    }
    let named: BTreeSet<&Digest> = state.tags.values().map(|entry| &entry.digest).collect();
    let victim = state
        .contents
        .keys()
        .find(|d| *d != digest && !named.contains(d))
        .or_else(|| state.contents.keys().find(|d| *d != digest))
        .cloned();
    if let Some(victim) = victim {
        state.contents.remove(&victim);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        format!("sha256:{}", hex::encode([n; 32])).parse().unwrap()
    }

    #[tokio::test]
    async fn tags_and_contents_survive_a_reopen_and_a_bad_file_starts_over() {
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open(dir.path());
        let manifest = ContentEntry {
            size: 512,
            media_type: Some("application/vnd.oci.image.index.v1+json".into()),
        };
        index.resolved("r/a:v1", &digest(1), manifest.clone()).await;
        let blob = ContentEntry {
            size: 9,
            media_type: None,
        };
        index.learned([(digest(2), blob)]).await;
        let again = Index::open(dir.path());
        assert_eq!(again.tag("r/a:v1").map(|(e, _)| e.digest), Some(digest(1)));
        assert_eq!(again.content(&digest(1)), Some(manifest));
        assert_eq!(again.content(&digest(2)).map(|c| c.size), Some(9));
        let blocks = [[7; 32], [8; 32]];
        index.record_verified(&digest(2), 4 << 20, &blocks).await;
        let again = Index::open(dir.path());
        assert!(again.verified(&digest(2), 4 << 20, &blocks));
        assert!(
            !again.verified(&digest(2), 4 << 20, &[[7; 32], [9; 32]]),
            "another block"
        );
        assert!(
            !again.verified(&digest(2), 8 << 20, &blocks),
            "another block size"
        );
        again.forget_verified(&digest(2)).await;
        assert!(!Index::open(dir.path()).verified(&digest(2), 4 << 20, &blocks));
        std::fs::write(dir.path().join(INDEX_FILE), b"{not json").unwrap();
        let fresh = Index::open(dir.path());
        assert!(fresh.tag("r/a:v1").is_none());
    }

    /// The file is root's only, like the cache's other files (also one made 0644 before).
    #[tokio::test]
    async fn the_index_file_is_readable_by_its_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(INDEX_FILE);
        std::fs::write(&path, b"{}").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let index = Index::open(dir.path());
        index.learned([(digest(1), blob(3))]).await;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }

    /// A tag resolved before a restart, at a time the wall clock has since been set back
    /// past, is stale, not fresh; one resolved in this run ages on the monotonic clock.
    #[tokio::test]
    async fn a_clock_set_back_does_not_make_a_tag_fresh() {
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open(dir.path());
        index.resolved("r/a:v1", &digest(1), blob(9)).await;
        let (_, age) = index.tag("r/a:v1").unwrap();
        assert!(age < Duration::from_secs(5), "{age:?}");
        // The file says it was resolved an hour from now: the clock went back an hour.
        let text = std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap();
        let mut saved: serde_json::Value = serde_json::from_str(&text).unwrap();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
        saved["tags"]["r/a:v1"]["resolved"] = (now + 3600).into();
        std::fs::write(dir.path().join(INDEX_FILE), saved.to_string()).unwrap();
        let (_, age) = Index::open(dir.path()).tag("r/a:v1").unwrap();
        assert!(age > Duration::from_secs(24 * 3600), "{age:?}");
    }

    fn blob(size: u64) -> ContentEntry {
        ContentEntry {
            size,
            media_type: None,
        }
    }

    /// A manifest elsewhere naming checked content with another size does not change it; a
    /// size that could not be fetched is forgotten, also in the file.
    #[tokio::test]
    async fn a_claimed_size_never_replaces_a_checked_one_and_a_failed_claim_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open(dir.path());
        index.learned([(digest(3), blob(100))]).await;
        index.record_verified(&digest(3), 4 << 20, &[[1; 32]]).await;
        index.learned([(digest(3), blob(101))]).await;
        index.forget_claim(&digest(3)).await;
        assert_eq!(Index::open(dir.path()).content(&digest(3)), Some(blob(100)));

        index.learned([(digest(4), blob(5))]).await;
        index.learned([(digest(4), blob(6))]).await;
        assert_eq!(
            index.content(&digest(4)),
            Some(blob(6)),
            "a claim replaces a claim"
        );
        index.forget_claim(&digest(4)).await;
        assert_eq!(index.content(&digest(4)), None);
        assert_eq!(Index::open(dir.path()).content(&digest(4)), None);
    }
}
