//! The OCI registry mirror: the read-only pull API of the distribution spec, for containerd
//! and CRI-O, served from the block cache.
//!
//! - Manifests and blobs by digest are content addressed: an object whose identity is the
//!   digest and its size ([`Identity::Digest`](larder_object::Identity)), the same whichever
//!   repository or registry it is pulled through. It is filled like any object (through a
//!   read-only [`Origin`] over the upstream, [`upstream::UpstreamStore`]: single-flight,
//!   deadlines, write-behind, eviction) and checked against its digest before any byte of it is served:
//!   [`Mirror::verified`] fills it whole, hashes it from the cache, and keeps each block's
//!   BLAKE3; a blob that fails its digest is dropped from the cache, fetched once more, and
//!   fails if it fails again. Every block served is checked against the BLAKE3 kept, so a block
//!   refetched after an eviction cannot slip in unchecked.
//! - Tags resolve upstream (`HEAD`), and the answer is trusted for `registry.tag_ttl`. Past it,
//!   a tag whose upstream cannot be reached is served from the last answer, and the log says
//!   so; a tag the upstream says is gone is gone.
//! - Only configured upstreams are served: a request names its registry with containerd's
//!   `?ns=` parameter, or as the first component of the repository, or is for the only
//!   upstream configured. Anything else is refused: the mirror is not an open proxy.
//! - What names content (tags, and the size of each digest) is kept in the index (`index.rs`), so
//!   cached images pull while their upstream is down, after a restart too.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod reference;
pub mod server;

mod index;
mod pace;
pub mod upstream;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use larder_config::{OriginConfig, RegistryConfig};
use larder_object::{Identity, ObjectId, ObjectVersion};
use larder_origin::Origin;
use larder_read_path::budget::MemoryBudget;
use larder_read_path::{Cache, OpenObject, ReadError};
use larder_stats::{RegistryStats, Stats, add};
use parking_lot::Mutex;
use sha2::{Digest as _, Sha256};

use self::index::{ContentEntry, Index};
use self::pace::Pace;
use self::reference::{Digest, ImageRef, Reference};
use self::upstream::{Described, TagsPage, Upstream, UpstreamError, UpstreamStore};

/// The names of the upstreams' origins begin so: `registry:nvcr.io`.
pub const ORIGIN_PREFIX: &str = "registry:";

/// Verified objects whose block hashes are kept (32 bytes a block); past it they are forgotten
/// all at once and hashed again when next asked for.
const VERIFIED_KEPT: usize = 16384;

/// Origin parts of one blob filled at once when it is verified.
const PARTS_AT_ONCE: usize = 4;

/// The manifest types that list other manifests.
const INDEX_TYPES: [&str; 2] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// The `Accept` of a tag resolved for a client that takes no index: single manifests only.
const SINGLE_ACCEPT: &str =
    "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json";

/// Why the mirror could not serve a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MirrorError {
    /// The registry asked for is not an upstream.
    #[error("registry {0:?} is not configured upstream (registry.upstreams): the mirror serves only those")]
    NotConfigured(String),
    /// The request does not say which registry it is for, and several are configured.
    #[error(
        "say which registry with ?ns=HOST or a HOST/ first component of the name: several are configured"
    )]
    WhichRegistry,
    /// The upstream failed or refused.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The content is larger than the cache can hold beside its pinned objects: it is not
    /// fetched through the cache (the client can pull it from the registry itself).
    #[error(
        "{digest}: {size} bytes, more than the cache can hold ({room} bytes beside its pinned \
         objects); pull it from the registry directly"
    )]
    TooLarge {
        /// The content.
        digest: Digest,
        /// Its size, as the upstream or a manifest says.
        size: u64,
        /// What the cache can hold.
        room: u64,
    },
    /// The content could not be filled.
    #[error("{digest}: {source}")]
    Fill {
        /// The content.
        digest: Digest,
        /// Why.
        source: ReadError,
    },
    /// The content the upstream sent does not hash to its digest (twice): not served.
    #[error("{0}: the upstream's bytes do not match the digest (fetched twice); nothing was served or kept")]
    DigestMismatch(Digest),
    /// A manifest is not one the mirror can read, or names no image for the platform.
    #[error("{what}: {reason}")]
    Manifest {
        /// The manifest.
        what: String,
        /// What is wrong.
        reason: String,
    },
}

/// One upstream and the origin its content is filled through.
#[derive(Debug)]
struct Registry {
    upstream: Arc<Upstream>,
    origin: Arc<Origin>,
}

/// A verified object: the BLAKE3 of each of its blocks as hashed against the digest.
type Verified = Arc<[[u8; 32]]>;
type SharedCheck = Shared<BoxFuture<'static, Result<Verified, MirrorError>>>;

/// A check under way, and what stops it: the [`Waiters`] of those waiting for it, which stop
/// the check when the last of them goes.
#[derive(Debug)]
struct Check {
    result: SharedCheck,
    progress: tokio::sync::watch::Receiver<Progress>,
    pace: Arc<Pace>,
    waiters: std::sync::Weak<Waiters>,
}

/// How far a check has hashed its content, in order: the BLAKE3 of each block hashed so far
/// in this attempt (a second attempt, after a mismatch, starts again from none).
#[derive(Debug, Clone, Default)]
pub(crate) struct Progress {
    /// Which attempt: a block sent from another attempt's progress is not this one's.
    pub(crate) attempt: u32,
    /// Whether its blocks may go out before the verdict: only when the attempt found none of
    /// the content in the cache, so that every block is one it fetched itself. Blocks left by
    /// a check stopped before its verdict are never sent unchecked (they may be an upstream's
    /// tampered bytes, written after the check stopped).
    pub(crate) early: bool,
    /// The blocks' BLAKE3 so far.
    pub(crate) hashes: Vec<[u8; 32]>,
    /// The bytes of the last blocks hashed, by index (see [`HASHED_KEPT`]): a client following
    /// closely is sent the very bytes hashed rather than reading them back from the cache.
    pub(crate) recent: std::collections::VecDeque<(u32, Bytes)>,
}

/// Blocks a check keeps in memory after hashing them, for the clients streaming it, while the
/// memory budget has room for another block; [`HASHED_KEPT_TIGHT`] when it has not. A client
/// further behind reads its blocks back from the cache disk (and checks them again); the check
/// keeps pace with its clients (see [`pace`]), so a few are enough. With the blocks held ahead,
/// 48 MiB a check at the default block size: the four layers containerd may pull at once fit
/// the default memory budget (with 16 and 16, a cold pull read 84 % of its layers back from
/// the disk, having found the budget full).
const HASHED_KEPT: usize = 4;

/// Blocks a check keeps after hashing them when the memory budget is full.
const HASHED_KEPT_TIGHT: usize = 2;

/// Blocks a check holds that were fetched ahead of its hashing: two parts in flight at the
/// default part and block sizes, enough to keep up with a client on a fast link.
const HELD_AHEAD: usize = 8;

/// Blocks of a check fetched before it hashed them, by index, with their BLAKE3: at most
/// [`HELD_AHEAD`], and only while the memory budget has room for another block (a block not
/// held is read back from the disk when its turn comes).
#[derive(Debug)]
struct Ahead<'a> {
    held: Mutex<Held>,
    /// A block's fill has ended, or the fetch has failed.
    settled: tokio::sync::Notify,
    budget: &'a MemoryBudget,
    block_size: u64,
}

#[derive(Debug, Default)]
struct Held {
    /// By index, each block whose fill has ended: its bytes and BLAKE3 if held.
    blocks: BTreeMap<u32, Option<(Bytes, [u8; 32])>>,
    /// The fetch failed: blocks not settled yet never will be.
    failed: bool,
}

impl<'a> Ahead<'a> {
    fn new(budget: &'a MemoryBudget, block_size: u64) -> Self {
        Self {
            held: Mutex::default(),
            settled: tokio::sync::Notify::new(),
            budget,
            block_size,
        }
    }

    /// The fill of block `index` has ended, with its bytes if it fetched them: held if there
    /// is room.
    fn settle(&self, index: u32, block: Option<(Bytes, [u8; 32])>) {
        let mut held = self.held.lock();
        let room =
            held.blocks.values().flatten().count() < HELD_AHEAD && self.budget.room_for(self.block_size);
        held.blocks.insert(index, block.filter(|_| room));
        self.settled.notify_waiters();
    }

    fn fail(&self) {
        self.held.lock().failed = true;
        self.settled.notify_waiters();
    }

    /// Block `index` once its fill has ended, if it was held (else it is read from the cache,
    /// or fetched again if the fetch failed); blocks before it go too.
    async fn take(&self, index: u32) -> Option<(Bytes, [u8; 32])> {
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            // Registered before the look, so a block settled between the two still wakes us.
            settled.as_mut().enable();
            {
                let mut held = self.held.lock();
                if let Some(block) = held.blocks.remove(&index) {
                    held.blocks.retain(|&later, _| later > index);
                    return block;
                }
                if held.failed {
                    return None;
                }
            }
            settled.await;
        }
    }
}

/// The check of some content, for a request that follows it.
#[derive(Debug)]
pub(crate) enum Following {
    /// Verified already.
    Verified(Verified),
    /// Under way: its result, how far it has hashed, the clients streaming it, and this
    /// request's place among those waiting (dropped, it no longer keeps the check going).
    UnderWay {
        /// The check's result.
        result: SharedCheck,
        /// How far it has hashed.
        progress: tokio::sync::watch::Receiver<Progress>,
        /// Where the clients streaming its blocks are.
        pace: Arc<Pace>,
        /// Keeps the check going.
        waiting: Arc<Waiters>,
    },
}

/// Held by each request or job waiting for a check; the check's task is aborted when the last
/// is dropped: nobody wants the content any more, so its fetch stops.
#[derive(Debug)]
pub(crate) struct Waiters(tokio::task::AbortHandle);

impl Drop for Waiters {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The registry mirror.
#[derive(Debug)]
pub struct Mirror {
    registries: BTreeMap<String, Registry>,
    cache: Cache,
    index: Arc<Index>,
    tag_ttl: Duration,
    stats: Arc<RegistryStats>,
    verified: Mutex<HashMap<ObjectId, Verified>>,
    checks: Mutex<HashMap<ObjectId, Check>>,
}

/// What the configuration's credentials file holds: docker's `config.json`.
#[derive(Debug, Default, serde::Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: HashMap<String, DockerAuth>,
}

#[derive(Debug, serde::Deserialize)]
struct DockerAuth {
    auth: Option<String>,
}

/// Why the mirror cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The credentials file cannot be read.
    #[error("registry credentials {} (registry.credentials): {source}", path.display())]
    Credentials {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The credentials file is not a docker `config.json`.
    #[error("registry credentials {} (registry.credentials): not a docker config.json: {source}", path.display())]
    NotDockerConfig {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        source: serde_json::Error,
    },
    /// An upstream's URL does not parse.
    #[error("registry {host}: {url:?} is not a URL: {source}")]
    NotUrl {
        /// The upstream's name.
        host: String,
        /// Its URL as configured.
        url: String,
        /// What is wrong with it.
        source: url::ParseError,
    },
    /// An upstream's client cannot be made.
    #[error(transparent)]
    Upstream(#[from] upstream::SetupError),
}

impl Mirror {
    /// The mirror of `config`'s upstreams over `cache`, with its index in `cache_dir`.
    pub fn new(
        config: &RegistryConfig,
        origin: &OriginConfig,
        cache: Cache,
        cache_dir: &Path,
        stats: &Stats,
    ) -> Result<Arc<Self>, SetupError> {
        let credentials = match &config.credentials {
            Some(path) => {
                let text = std::fs::read(path).map_err(|source| SetupError::Credentials {
                    path: path.clone(),
                    source,
                })?;
                serde_json::from_slice::<DockerConfig>(&text).map_err(|source| {
                    SetupError::NotDockerConfig {
                        path: path.clone(),
                        source,
                    }
                })?
            }
            None => DockerConfig::default(),
        };
        let mut registries = BTreeMap::new();
        let token_hosts: Arc<[String]> = config.token_hosts.clone().into();
        for configured in &config.upstreams {
            let base = url::Url::parse(&configured.url).map_err(|source| SetupError::NotUrl {
                host: configured.host.clone(),
                url: configured.url.clone(),
                source,
            })?;
            let auth = credentials
                .auths
                .get(&configured.host)
                .or_else(|| credentials.auths.get(&format!("https://{}", configured.host)))
                .and_then(|a| a.auth.as_deref());
            let upstream = Arc::new(Upstream::new(
                &configured.host,
                base,
                auth,
                token_hosts.clone(),
                stats.origin.clone(),
            )?);
            let store = Arc::new(UpstreamStore::new(upstream.clone()));
            let origin = Arc::new(
                Origin::read_only(
                    &format!("{ORIGIN_PREFIX}{}", configured.host),
                    &format!("oci://{}", configured.host),
                    store,
                    object_store::path::Path::default(),
                    origin,
                    stats.origin.clone(),
                )
                .with_content_names(content_at),
            );
            registries.insert(configured.host.clone(), Registry { upstream, origin });
        }
        Ok(Arc::new(Self {
            registries,
            cache,
            index: Index::open(cache_dir),
            tag_ttl: config.tag_ttl,
            stats: stats.registry.clone(),
            verified: Mutex::new(HashMap::new()),
            checks: Mutex::new(HashMap::new()),
        }))
    }

    /// The upstreams, by the name image references give them, with the URL each is reached at.
    pub fn upstreams(&self) -> impl Iterator<Item = (&str, &url::Url)> {
        self.registries
            .iter()
            .map(|(host, registry)| (host.as_str(), registry.upstream.base()))
    }

    /// The registry a request is for, and the repository's name in it: `ns` (containerd's
    /// parameter) if given, else the name's first component if it is a configured registry
    /// (refused if it names another: a dot, a port or `localhost`), else the only one
    /// configured.
    fn registry_for<'a>(&self, ns: Option<&str>, name: &'a str) -> Result<(&Registry, &'a str), MirrorError> {
        if let Some(ns) = ns {
            let registry = self
                .registries
                .get(ns)
                .ok_or_else(|| MirrorError::NotConfigured(ns.to_owned()))?;
            return Ok((registry, name));
        }
        if let Some((first, rest)) = name.split_once('/') {
            if let Some(registry) = self.registries.get(first) {
                return Ok((registry, rest));
            }
            // As image references read it, a first component with a dot or a port, or
            // `localhost`, names a registry: one that is not configured. (A port never gets
            // here: a colon makes the name invalid first.)
            if first.contains(['.', ':']) || first == "localhost" {
                return Err(MirrorError::NotConfigured(first.to_owned()));
            }
        }
        match self.registries.values().next() {
            Some(registry) if self.registries.len() == 1 => Ok((registry, name)),
            _ => Err(MirrorError::WhichRegistry),
        }
    }

    /// What manifest `reference` of `name` in `registry` is: a digest as the index knows it
    /// (or as the upstream describes it), a tag as last resolved within the TTL, else as the
    /// upstream resolves it now (or, when the upstream cannot answer, as last resolved).
    /// `indexes` says whether the client takes image indexes and manifest lists.
    async fn resolve(
        &self,
        registry: &Registry,
        name: &str,
        reference: &Reference,
        indexes: bool,
    ) -> Result<Described, MirrorError> {
        let upstream = &registry.upstream;
        let accept = if indexes {
            upstream::MANIFEST_ACCEPT
        } else {
            SINGLE_ACCEPT
        };
        let tag = match reference {
            Reference::Digest(digest) => {
                if let Some(ContentEntry {
                    size,
                    media_type: Some(media_type),
                }) = self.index.content(digest)
                {
                    return Ok(Described {
                        digest: digest.clone(),
                        media_type,
                        size,
                    });
                }
                let described = upstream
                    .describe_manifest(name, &digest.to_string(), accept)
                    .await?;
                return Ok(self.learned(described).await);
            }
            Reference::Tag(tag) => tag,
        };
        let key = format!(
            "{}/{name}:{tag}{}",
            upstream.host(),
            if indexes { "" } else { "#single" }
        );
        let last = self.index.tag(&key).and_then(|(entry, age)| {
            let content = self.index.content(&entry.digest)?;
            Some((entry.digest, content, age))
        });
        if let Some((digest, content, age)) = &last
            && *age < self.tag_ttl
            && let Some(media_type) = &content.media_type
        {
            return Ok(Described {
                digest: digest.clone(),
                media_type: media_type.clone(),
                size: content.size,
            });
        }
        match upstream.describe_manifest(name, tag, accept).await {
            Ok(described) => {
                let content = ContentEntry {
                    size: described.size,
                    media_type: Some(described.media_type.clone()),
                };
                self.index.resolved(&key, &described.digest, content).await;
                Ok(described)
            }
            Err(error) if !error.is_not_found() => match last {
                Some((digest, content, age)) => {
                    add(&self.stats.registry_stale_tags, 1);
                    tracing::warn!(
                        tag = %key,
                        %digest,
                        age = %humantime::format_duration(Duration::from_secs(age.as_secs())),
                        %error,
                        "upstream unreachable: serving the tag as last resolved"
                    );
                    Ok(Described {
                        digest,
                        media_type: content.media_type.unwrap_or_default(),
                        size: content.size,
                    })
                }
                None => Err(error.into()),
            },
            Err(error) => Err(error.into()),
        }
    }

    /// Records a manifest the upstream described, and gives it as resolved.
    async fn learned(&self, described: Described) -> Described {
        let content = ContentEntry {
            size: described.size,
            media_type: Some(described.media_type.clone()),
        };
        self.index.learned([(described.digest.clone(), content)]).await;
        described
    }

    /// A page of the tags of `name` in `registry`, from its upstream (tags are not cached: a
    /// list is asked for rarely and may change at any time); `n` and `last` are the client's.
    /// The link to the next page names the repository as the client did.
    async fn tags(
        &self,
        registry: &Registry,
        asked_as: &str,
        name: &str,
        n: Option<&str>,
        last: Option<&str>,
    ) -> Result<TagsPage, MirrorError> {
        let query = {
            let mut query = url::form_urlencoded::Serializer::new(String::new());
            for (key, value) in [("n", n), ("last", last)] {
                if let Some(value) = value {
                    query.append_pair(key, value);
                }
            }
            query.finish()
        };
        let query = (!query.is_empty()).then_some(query.as_str());
        let mut page = registry.upstream.tags(name, query).await?;
        page.link = page
            .link
            .map(|link| link.replace(&format!("/v2/{name}/"), &format!("/v2/{asked_as}/")));
        Ok(page)
    }

    /// The size of blob `digest`: as the index knows it, else as the upstream says (`HEAD`).
    async fn blob_size(&self, registry: &Registry, name: &str, digest: &Digest) -> Result<u64, MirrorError> {
        if let Some(content) = self.index.content(digest) {
            return Ok(content.size);
        }
        let size = registry.upstream.blob_size(name, digest).await?;
        // Not kept when too large: only a claim, and one the mirror acts on by not fetching.
        self.fits(digest, size)?;
        let content = ContentEntry {
            size,
            media_type: None,
        };
        self.index.learned([(digest.clone(), content)]).await;
        Ok(size)
    }

    /// Whether content of `size` bytes can be fetched through the cache at all.
    fn fits(&self, digest: &Digest, size: u64) -> Result<(), MirrorError> {
        let room = self.cache.store().capacity();
        if size > room {
            return Err(MirrorError::TooLarge {
                digest: digest.clone(),
                size,
                room,
            });
        }
        Ok(())
    }

    /// The object holding `digest`'s `size` bytes, fetched (when missing) from `name` in
    /// `registry` as a blob or, with `manifest`, a manifest.
    fn object(
        &self,
        registry: &Registry,
        name: &str,
        digest: &Digest,
        size: u64,
        manifest: bool,
    ) -> Result<Arc<OpenObject>, MirrorError> {
        self.fits(digest, size)?;
        let identity = digest.identity(size).map_err(|e| MirrorError::Manifest {
            what: digest.to_string(),
            reason: e.to_string(),
        })?;
        let kind = if manifest { "manifests" } else { "blobs" };
        let version = ObjectVersion {
            origin_url: registry.origin.identity_url().to_owned(),
            key: format!("{name}/{kind}/{digest}"),
            etag: None,
            version: None,
            size,
            modified: SystemTime::UNIX_EPOCH,
            content: Some(Box::new(identity)),
        };
        Ok(OpenObject::new(registry.origin.clone(), version))
    }

    /// The BLAKE3 of each block of `object` once its bytes, whole in the cache, hash to the
    /// digest that names it: filled (or found) and hashed once however many ask at once.
    pub async fn verified(self: &Arc<Self>, object: &Arc<OpenObject>) -> Result<Verified, MirrorError> {
        match self.follow(object) {
            Following::Verified(hashes) => Ok(hashes),
            Following::UnderWay { result, waiting, .. } => {
                let result = result.await;
                drop(waiting);
                result
            }
        }
    }

    /// The check of `object`: done already, or under way (started now if nobody had).
    pub(crate) fn follow(self: &Arc<Self>, object: &Arc<OpenObject>) -> Following {
        let id = object.id();
        if let Some(hashes) = self.verified.lock().get(&id) {
            return Following::Verified(hashes.clone());
        }
        // Checked before a restart, and the store holds the very blocks that were checked
        // (each is checked against its hash again as it is sent).
        let store = self.cache.store();
        let block_size = store.block_size();
        let blocks = object.version().size.div_ceil(block_size) as u32;
        if let Some(digest) = digest_of(object)
            && let Some(hashes) = store.block_hashes(id, blocks)
            && self.index.verified(&digest, block_size, &hashes)
        {
            let hashes: Verified = hashes.into();
            self.verified.lock().insert(id, hashes.clone());
            return Following::Verified(hashes);
        }
        let mut checks = self.checks.lock();
        if let Some(check) = checks.get(&id)
            && let Some(waiting) = check.waiters.upgrade()
        {
            return Following::UnderWay {
                result: check.result.clone(),
                progress: check.progress.clone(),
                pace: check.pace.clone(),
                waiting,
            };
        }
        // A task of its own, so that a request that goes away does not cut it for the others
        // waiting; the last one to go stops it.
        let digest = digest_of(object);
        let (mirror, object) = (self.clone(), object.clone());
        let (progress, following) = tokio::sync::watch::channel(Progress::default());
        let pace = Arc::new(Pace::default());
        let paced = pace.clone();
        let task = tokio::spawn(async move {
            let result = mirror.check(&object, &progress, &paced).await;
            mirror.checks.lock().remove(&object.id());
            result
        });
        let waiting = Arc::new(Waiters(task.abort_handle()));
        let result = async move {
            task.await.unwrap_or_else(|_| {
                Err(MirrorError::Manifest {
                    what: digest.map(|d| d.to_string()).unwrap_or_default(),
                    reason: "the check was abandoned".into(),
                })
            })
        }
        .boxed()
        .shared();
        let check = Check {
            result: result.clone(),
            progress: following.clone(),
            pace: pace.clone(),
            waiters: Arc::downgrade(&waiting),
        };
        checks.insert(id, check);
        Following::UnderWay {
            result,
            progress: following,
            pace,
            waiting,
        }
    }

    /// Fills `object` whole and hashes it against its digest, saying in `progress` how far it
    /// has hashed, at the `pace` of the clients streaming it; a mismatch drops it from the
    /// cache and tries once more.
    async fn check(
        &self,
        object: &Arc<OpenObject>,
        progress: &tokio::sync::watch::Sender<Progress>,
        pace: &Pace,
    ) -> Result<Verified, MirrorError> {
        let digest = digest_of(object).ok_or_else(|| MirrorError::Manifest {
            what: object.version().key.clone(),
            reason: "not content named by a digest".into(),
        })?;
        let store = self.cache.store();
        let blocks = object.version().size.div_ceil(store.block_size()) as u32;
        for attempt in 0..2 {
            let early = (0..blocks).all(|index| !store.contains(object.id(), index));
            progress.send_replace(Progress {
                attempt,
                early,
                hashes: Vec::new(),
                recent: std::collections::VecDeque::new(),
            });
            let failed = Mutex::new(None);
            // The parts are fetched ahead, several at once, while the blocks are hashed in
            // order as they arrive: those fetched ahead of the hashing are held for it, so
            // that it need not read them back from the disk, and a part starts only once
            // its blocks would be held.
            let ahead = Ahead::new(self.cache.budget(), store.block_size());
            let hashed = progress.subscribe();
            let fills = self.cache.fill_objects_paced(
                vec![object.clone()],
                PARTS_AT_ONCE,
                |blocks| {
                    let mut hashed = hashed.clone();
                    // A part longer than the blocks held starts when its first is hashed.
                    let last = blocks.end.min(blocks.start + HELD_AHEAD as u32) as usize;
                    async move {
                        let within = |p: &Progress| p.hashes.len() + HELD_AHEAD >= last;
                        // Only this check sends progress, and it outlives its fills.
                        let _ = hashed.wait_for(within).await;
                    }
                },
                |_, index, result| match result {
                    Ok(fetched) => {
                        ahead.settle(index, fetched);
                        true
                    }
                    Err(error) => {
                        failed.lock().get_or_insert(error);
                        ahead.fail();
                        false
                    }
                },
            );
            add(&self.stats.registry_digest_checks, 1);
            let hashed = {
                let hash = self.hash(object, &digest, progress, pace, &ahead);
                tokio::pin!(fills, hash);
                tokio::select! {
                    // The fetch waits for the hashing: a hashing that failed leaves it waiting,
                    // and it goes; one that ended has opened the way for every part.
                    hashed = &mut hash => {
                        if hashed.is_ok() {
                            fills.await;
                        }
                        hashed
                    }
                    () = &mut fills => hash.await,
                }
            };
            if let Some(source) = failed.into_inner() {
                self.unfetchable(object, &digest).await;
                return Err(MirrorError::Fill { digest, source });
            }
            let (sha256, hashes) = hashed?;
            if sha256.as_slice() == hex::decode(digest.hex()).unwrap_or_default().as_slice() {
                let hashes: Verified = hashes.into();
                {
                    let mut verified = self.verified.lock();
                    // Bounded: past it, content is hashed again when next asked for.
                    if verified.len() >= VERIFIED_KEPT {
                        verified.clear();
                    }
                    verified.insert(object.id(), hashes.clone());
                }
                let block_size = self.cache.store().block_size();
                self.index.record_verified(&digest, block_size, &hashes).await;
                return Ok(hashes);
            }
            add(&self.stats.registry_digest_mismatches, 1);
            tracing::warn!(
                %digest,
                key = %object.version().key,
                "content from the upstream does not match its digest: dropped from the cache"
            );
            self.cache.store().drop_object(object.id()).await;
        }
        self.index.forget_claim(&digest).await;
        Err(MirrorError::DigestMismatch(digest))
    }

    /// `object` could not be fetched whole at the size it was said to have: its blocks go,
    /// and so does the size, unless the content was checked at it before (a verified size
    /// stands; the upstream's failure was something else).
    async fn unfetchable(&self, object: &Arc<OpenObject>, digest: &Digest) {
        let size = object.version().size;
        if self.index.content(digest).is_some_and(|c| c.size == size) {
            self.index.forget_claim(digest).await;
        }
        if !self.index.is_verified(digest) {
            self.cache.store().drop_object(object.id()).await;
        }
    }

    /// The SHA-256 of `object`, block by block in order (each block held in `ahead`, else from
    /// the cache), hashed off the runtime's threads at the `pace` of the clients streaming it;
    /// and each block's BLAKE3 as the cache has it (hashed as the block arrived, or checked on
    /// its read from disk): not hashed again.
    async fn hash(
        &self,
        object: &Arc<OpenObject>,
        digest: &Digest,
        progress: &tokio::sync::watch::Sender<Progress>,
        pace: &Pace,
        ahead: &Ahead<'_>,
    ) -> Result<([u8; 32], Vec<[u8; 32]>), MirrorError> {
        let block_size = self.cache.store().block_size();
        let count = object.version().size.div_ceil(block_size) as u32;
        let budget = self.cache.budget();
        let kept = || {
            if budget.room_for(block_size) {
                HASHED_KEPT
            } else {
                HASHED_KEPT_TIGHT
            }
        };
        let mut sha = Sha256::new();
        let mut hashes = Vec::with_capacity(count as usize);
        for index in 0..count {
            pace.until_kept(index, kept()).await;
            let (bytes, hash) = match ahead.take(index).await {
                Some(block) => block,
                None => self
                    .cache
                    .block_for_peer(object, index, false)
                    .await
                    .map_err(|source| MirrorError::Fill {
                        digest: digest.clone(),
                        source,
                    })?,
            };
            let (back, bytes) = tokio::task::spawn_blocking(move || {
                sha.update(&bytes);
                (sha, bytes)
            })
            .await
            .map_err(|_| MirrorError::Fill {
                digest: digest.clone(),
                source: ReadError::Abandoned,
            })?;
            sha = back;
            hashes.push(hash);
            progress.send_modify(|progress| {
                progress.hashes.push(hash);
                progress.recent.push_back((index, bytes));
                while progress.recent.len() > kept() {
                    progress.recent.pop_front();
                }
            });
        }
        Ok((sha.finalize().into(), hashes))
    }

    /// Block `index` of a verified `object`, if it is still the block that was verified.
    async fn verified_block(
        &self,
        object: &Arc<OpenObject>,
        expected: &[u8; 32],
        index: u32,
    ) -> Option<Bytes> {
        let (bytes, hash) = match self.cache.block_for_peer(object, index, false).await {
            Ok(block) => block,
            Err(error) => {
                tracing::warn!(key = %object.version().key, index, %error, "a block of verified content could not be read: the answer is cut");
                return None;
            }
        };
        if *expected == hash {
            return Some(bytes);
        }
        // Refetched since it was verified, and not the same bytes: dropped, and the content
        // fetched and checked again next time.
        self.verified.lock().remove(&object.id());
        if let Some(digest) = digest_of(object) {
            self.index.forget_verified(&digest).await;
        }
        self.cache.store().drop_object(object.id()).await;
        tracing::warn!(
            key = %object.version().key,
            index,
            "a block of verified content changed in the cache: the answer is cut, the content dropped and checked again"
        );
        None
    }

    /// The whole of a verified manifest (at most 4 MiB: larger ones are refused upstream).
    async fn read_manifest(self: &Arc<Self>, object: &Arc<OpenObject>) -> Result<Bytes, MirrorError> {
        let hashes = self.verified(object).await?;
        let mut bytes = Vec::with_capacity(object.version().size as usize);
        for (index, hash) in hashes.iter().enumerate() {
            let block = self
                .verified_block(object, hash, index as u32)
                .await
                .ok_or_else(|| MirrorError::Manifest {
                    what: object.version().key.clone(),
                    reason: "changed in the cache while read".into(),
                })?;
            bytes.extend_from_slice(&block);
        }
        Ok(bytes.into())
    }

    /// Every object an image needs for `platform` (`os/architecture[/variant]`): its index (if
    /// any), its manifest, config and layers, each checked against its digest as it is read;
    /// the index's and the manifest's bytes are fetched here, to find the rest.
    pub async fn image_plan(
        self: &Arc<Self>,
        image: &ImageRef,
        platform: &str,
    ) -> Result<Vec<(Arc<Origin>, ObjectVersion)>, MirrorError> {
        let (registry, name) = self.registry_for(Some(&image.host), &image.name)?;
        let mut plan = Vec::new();
        let mut resolved = self.resolve(registry, name, &image.reference, true).await?;
        let mut depth = 0;
        let manifest = loop {
            let object = self.object(registry, name, &resolved.digest, resolved.size, true)?;
            let bytes = self.read_manifest(&object).await?;
            plan.push((registry.origin.clone(), object.version().clone()));
            let parsed: ImageManifest =
                serde_json::from_slice(&bytes).map_err(|e| MirrorError::Manifest {
                    what: format!("{image} ({})", resolved.digest),
                    reason: format!("not an image manifest or index: {e}"),
                })?;
            let media_type = parsed.media_type.clone().unwrap_or(resolved.media_type.clone());
            if !INDEX_TYPES.contains(&media_type.as_str()) || depth > 0 {
                break parsed;
            }
            depth += 1;
            let chosen = parsed
                .manifests
                .iter()
                .find(|m| m.platform.as_ref().is_some_and(|p| p.matches(platform)))
                .ok_or_else(|| MirrorError::Manifest {
                    what: image.to_string(),
                    reason: format!("the index has no manifest for platform {platform}"),
                })?;
            let size = chosen.size;
            let content = ContentEntry {
                size,
                media_type: chosen.media_type.clone(),
            };
            self.index.learned([(chosen.digest.clone(), content)]).await;
            resolved = Described {
                digest: chosen.digest.clone(),
                media_type: chosen.media_type.clone().unwrap_or_default(),
                size,
            };
        };
        let blobs: Vec<&Descriptor> = manifest.config.iter().chain(&manifest.layers).collect();
        for blob in &blobs {
            let object = self.object(registry, name, &blob.digest, blob.size, false)?;
            plan.push((registry.origin.clone(), object.version().clone()));
        }
        // Known at once, in one write: a blob is found after a restart by its size.
        let contents = blobs.iter().map(|blob| {
            let content = ContentEntry {
                size: blob.size,
                media_type: None,
            };
            (blob.digest.clone(), content)
        });
        self.index.learned(contents).await;
        Ok(plan)
    }

    /// Checks a prefetched object against its digest, if it is content named by one.
    pub async fn check_prefetched(self: &Arc<Self>, object: &Arc<OpenObject>) -> Result<(), MirrorError> {
        if object.version().content.is_some() {
            self.verified(object).await?;
        }
        Ok(())
    }

    /// The upstreams' origins by name, for the peer listener: a member asks for image content
    /// by the registry's origin and the key the content was fetched at.
    pub fn origins(&self) -> impl Iterator<Item = (String, Arc<Origin>)> + '_ {
        self.registries
            .values()
            .map(|registry| (registry.origin.name().to_owned(), registry.origin.clone()))
    }

    /// Whether `host` is a configured upstream.
    pub fn knows(&self, host: &str) -> bool {
        self.registries.contains_key(host)
    }
}

/// The identity of content of `size` bytes fetched from an upstream at `key`
/// (`<repository>/blobs/<digest>` or `<repository>/manifests/<digest>`), as [`Mirror`] names
/// it; `None` for a key of another shape.
pub fn content_at(key: &str, size: u64) -> Option<Identity> {
    let (_, digest) = key
        .rsplit_once("/blobs/")
        .or_else(|| key.rsplit_once("/manifests/"))?;
    digest.parse::<Digest>().ok()?.identity(size).ok()
}

/// The digest naming `object`'s content, if it is content named by one.
fn digest_of(object: &OpenObject) -> Option<Digest> {
    match object.version().content.as_deref() {
        Some(Identity::Digest { algorithm, hex, .. }) => format!("{}:{hex}", algorithm.name()).parse().ok(),
        _ => None,
    }
}

/// The parts of an image manifest or index the mirror reads.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ImageManifest {
    media_type: Option<String>,
    #[serde(default)]
    manifests: Vec<Descriptor>,
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

/// A content descriptor.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: Option<String>,
    digest: Digest,
    size: u64,
    platform: Option<Platform>,
}

/// The platform of an index's manifest.
#[derive(Debug, serde::Deserialize)]
struct Platform {
    os: String,
    architecture: String,
    variant: Option<String>,
}

impl Platform {
    /// Whether it is `wanted` (`os/architecture[/variant]`; no variant matches any).
    fn matches(&self, wanted: &str) -> bool {
        let mut parts = wanted.split('/');
        let (os, architecture, variant) = (parts.next(), parts.next(), parts.next());
        os == Some(self.os.as_str())
            && architecture == Some(self.architecture.as_str())
            && (variant.is_none() || variant == self.variant.as_deref())
    }
}

/// This node's platform as an image index names it: `linux/amd64`, `linux/arm64`, ...
pub fn node_platform() -> String {
    let architecture = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    format!("{}/{architecture}", std::env::consts::OS)
}
