//! Origins: the object stores behind each source.
//!
//! An [`Origin`] wraps a store built from the source's URL and adds what a cache needs from it:
//! keys relative to the source's prefix, ranged GETs pinned to the version seen at open
//! (`If-Match`, and the response's ETag checked as well), per-attempt deadlines, jittered
//! exponential backoff under a shared retry budget, and errors typed by what the caller must do
//! about them.
//!
//! An origin reads through the narrow [`ReadStore`] seam (one GET with options; see
//! [`read_store`]), which every `object_store::ObjectStore` implements. Listing and writing
//! Larder's own objects (sealed manifests) need the whole `ObjectStore` and are there only where
//! the origin was given one ([`Origin::new`], as every source built from a URL is); an origin
//! over a store that can only be read ([`Origin::read_only`], the registry mirror's upstream)
//! answers a listing or a write with [`OriginError::NotSupported`], sending nothing. The same
//! retries, budget and deadlines govern every request, whichever seam it goes through.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod checksums;
pub mod environment;
mod error;
mod from_url;
mod listing;
pub mod read_store;
mod retry;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use larder_config::{OriginConfig, SourceUrl};
use larder_object::{Identity, ObjectVersion};
use larder_stats::{OriginStats, add};
use object_store::list::PaginatedListStore;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};
use tokio::time::Instant;

use crate::checksums::{Published, PublishedChecksums};
use crate::error::Failure;
pub use crate::error::{Operation, OriginError, TransientError};
pub use crate::listing::{AllObjects, ListEntry, ListPage, PAGE_KEYS, PageToken};
pub use crate::read_store::ReadStore;
use crate::retry::Backoff;
pub use crate::retry::RetryBudget;

/// A source's object store plus Larder's request discipline.
pub struct Origin {
    name: String,
    url: SourceUrl,
    /// The URL's canonical spelling, made once: what the versions it gives are named by.
    identity_url: String,
    /// What every read (GET, HEAD) goes through.
    reader: Arc<dyn ReadStore>,
    /// The whole store, for listings and writes: `None` where the source can only be read.
    full_store: Option<Arc<dyn ObjectStore>>,
    /// Paged listings, where the store has them (S3, GCS, Azure); others list a directory whole.
    /// Used only where there is a full store.
    pager: Option<Arc<dyn PaginatedListStore>>,
    prefix: Path,
    backoff: Backoff,
    budget: RetryBudget,
    request_timeout: Duration,
    deadline: Duration,
    stats: Arc<OriginStats>,
    /// Whether the first denied request was logged: later ones only reach the debug log.
    denied_logged: AtomicBool,
    /// Asks the store for the checksums it publishes (S3 and GCS only).
    published: Option<PublishedChecksums>,
    /// How a key and size name the object's content, where keys are content addresses (the
    /// registry mirror's blobs): the same content then has one id whatever the key.
    content_names: Option<ContentNames>,
}

/// How an origin whose keys are content addresses names the content of the object at a key
/// of a given size: `None` for a key that is not one.
pub type ContentNames = fn(&str, u64) -> Option<Identity>;

impl fmt::Debug for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Origin")
            .field("name", &self.name)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// Whether two ETags name the same version: the same opaque tag, whether or not a store quoted
/// it (fake-gcs-server lists ETags bare and quotes them in a GET's answer; a local directory's
/// are bare everywhere), weak or not.
pub(crate) fn same_entity_tag(a: &str, b: &str) -> bool {
    let bare = |tag: &str| {
        let tag = tag.strip_prefix("W/").unwrap_or(tag);
        tag.strip_prefix('"')
            .and_then(|t| t.strip_suffix('"'))
            .unwrap_or(tag)
            .to_owned()
    };
    bare(a) == bare(b)
}

impl Origin {
    /// The source's configured URL.
    pub fn url(&self) -> &SourceUrl {
        &self.url
    }

    /// The source's name in the config.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The canonical spelling of the source's URL, which the versions it gives carry.
    pub fn identity_url(&self) -> &str {
        &self.identity_url
    }

    /// The counters it adds to.
    pub fn stats(&self) -> &Arc<OriginStats> {
        &self.stats
    }

    /// Lists directories page by page through `pager` (the same store as the origin's). An
    /// origin made with [`Origin::read_only`] still lists nothing.
    pub fn with_pager(mut self, pager: Arc<dyn PaginatedListStore>) -> Self {
        self.pager = Some(pager);
        self
    }

    /// Names the content of its objects with `names` (see [`ContentNames`]).
    pub fn with_content_names(mut self, names: ContentNames) -> Self {
        self.content_names = Some(names);
        self
    }

    /// The content the object at `key` of `size` bytes is named by, where keys are content
    /// addresses.
    pub fn content_at(&self, key: &str, size: u64) -> Option<Identity> {
        self.content_names.and_then(|names| names(key, size))
    }

    /// Asks the store for the checksums it publishes through `checksums`.
    pub fn with_published_checksums(mut self, checksums: PublishedChecksums) -> Self {
        self.published = Some(checksums);
        self
    }

    /// What the store publishes about `version` beyond its ETag (`multipart`: whether the ETag
    /// is a multipart upload's). Nothing where it publishes nothing or cannot be asked, which
    /// is logged at debug: the caller falls back to the ETag.
    pub async fn published(&self, version: &ObjectVersion, multipart: bool) -> Published {
        let Some(checksums) = &self.published else {
            return Published::default();
        };
        let Ok(location) = self.location(&version.key) else {
            return Published::default();
        };
        match checksums
            .describe(&location, version.etag.as_deref(), multipart)
            .await
        {
            Ok(published) => published,
            Err(error) => {
                tracing::debug!(source = %self.name, key = %version.key, %error, "the store's published checksums could not be had");
                Published::default()
            }
        }
    }

    /// An origin over an already built store, which it reads, lists and writes Larder's
    /// manifests to; keys are resolved under `prefix`. Tests use this to put fault-injecting
    /// wrappers around real stores.
    pub fn new(
        name: &str,
        url: &str,
        store: Arc<dyn ObjectStore>,
        prefix: Path,
        config: &OriginConfig,
        stats: Arc<OriginStats>,
    ) -> Self {
        let reader: Arc<dyn ReadStore> = Arc::new(Arc::clone(&store));
        Self::over(name, url, reader, Some(store), prefix, config, stats)
    }

    /// An origin over a store that can only be read (the registry mirror's upstream): its
    /// listings and writes fail with [`OriginError::NotSupported`]. Keys are resolved under
    /// `prefix`.
    pub fn read_only(
        name: &str,
        url: &str,
        reader: Arc<dyn ReadStore>,
        prefix: Path,
        config: &OriginConfig,
        stats: Arc<OriginStats>,
    ) -> Self {
        Self::over(name, url, reader, None, prefix, config, stats)
    }

    fn over(
        name: &str,
        url: &str,
        reader: Arc<dyn ReadStore>,
        full_store: Option<Arc<dyn ObjectStore>>,
        prefix: Path,
        config: &OriginConfig,
        stats: Arc<OriginStats>,
    ) -> Self {
        Self {
            name: name.to_owned(),
            url: url.into(),
            identity_url: larder_object::canonical_source_url(url),
            reader,
            full_store,
            pager: None,
            prefix,
            backoff: Backoff {
                max_attempts: config.max_attempts.max(1),
                base: config.backoff_base,
                max: config.backoff_max,
            },
            budget: RetryBudget::new(config.retry_budget_ratio),
            request_timeout: config.request_timeout,
            deadline: config.read_deadline,
            stats,
            denied_logged: AtomicBool::new(false),
            published: None,
            content_names: None,
        }
    }

    /// The same origin with its store wrapped by `wrap` (tests put fault injectors around the
    /// real store this way): reads, listings and writes go through the wrapper; paged
    /// listings still go to the store's own pager. An origin that can only read is left as
    /// it is.
    pub fn around(mut self, wrap: impl FnOnce(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore>) -> Self {
        if let Some(store) = self.full_store.take() {
            let store = wrap(store);
            self.reader = Arc::new(Arc::clone(&store));
            self.full_store = Some(store);
        }
        self
    }

    /// The whole store, to `operation` on `key`, or the error saying this origin can only read.
    fn full_store(&self, key: &str, operation: Operation) -> Result<&Arc<dyn ObjectStore>, OriginError> {
        self.full_store.as_ref().ok_or_else(|| OriginError::NotSupported {
            source_name: self.name.clone(),
            key: key.to_owned(),
            operation,
        })
    }

    /// The store location of a key relative to the source. Keys are parsed, never concatenated:
    /// `..`, empty segments and the like are rejected, so no key escapes the prefix.
    fn location(&self, key: &str) -> Result<Path, OriginError> {
        let parsed = match key {
            "" => Err(object_store::path::Error::EmptySegment { path: String::new() }),
            key => Path::parse(key),
        };
        let relative = parsed.map_err(|e| OriginError::Rejected {
            source_name: self.name.clone(),
            key: key.to_owned(),
            source: e.into(),
        })?;
        Ok(self.prefix.parts().chain(relative.parts()).collect())
    }

    /// The key relative to the source of a location the store returned.
    fn relative_key(&self, location: &Path) -> Option<String> {
        let parts: Vec<_> = location.prefix_match(&self.prefix)?.collect();
        Some(Path::from_iter(parts).to_string())
    }

    fn version_of(&self, key: String, meta: &object_store::ObjectMeta) -> ObjectVersion {
        ObjectVersion {
            origin_url: self.identity_url.clone(),
            key,
            etag: meta.e_tag.clone(),
            version: meta.version.clone(),
            size: meta.size,
            modified: meta.last_modified.into(),
            content: None,
        }
    }

    /// The current version of `key`.
    pub async fn head(&self, key: &str) -> Result<ObjectVersion, OriginError> {
        let location = self.location(key)?;
        let meta = self
            .with_retries(key, || async {
                add(&self.stats.origin_head_requests, 1);
                let options = GetOptions {
                    head: true,
                    ..GetOptions::default()
                };
                Ok(self.reader.get_opts(&location, options).await?.meta)
            })
            .await?;
        Ok(self.version_of(key.to_owned(), &meta))
    }

    /// The whole of the current version of `key` if it is at most `max` bytes long; `None`
    /// (its body not read) if it is longer. For small objects of Larder's own (manifests).
    pub async fn get_at_most(&self, key: &str, max: u64) -> Result<Option<Bytes>, OriginError> {
        let location = self.location(key)?;
        self.with_retries(key, || async {
            add(&self.stats.origin_get_requests, 1);
            let response = self.reader.get_opts(&location, GetOptions::default()).await?;
            if response.meta.size > max {
                return Ok(None);
            }
            let bytes = response.bytes().await?;
            add(&self.stats.origin_bytes, bytes.len() as u64);
            Ok(Some(bytes))
        })
        .await
    }

    /// Writes `bytes` as the whole of `key`, replacing what is there (retried: a whole-object
    /// PUT is idempotent). For objects of Larder's own (manifests); the sources' data is never
    /// written.
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<(), OriginError> {
        let store = self.full_store(key, Operation::Write)?;
        let location = self.location(key)?;
        self.with_retries(key, || {
            add(&self.stats.origin_put_requests, 1);
            store.put(&location, bytes.clone().into())
        })
        .await
        .map(drop)
    }

    /// The deadline of a whole read, retries included (`origin.read_deadline`).
    pub fn read_deadline(&self) -> Duration {
        self.deadline
    }

    /// Streams `range` of the pinned `version` into `sink`, in order, each byte exactly once.
    ///
    /// A failed attempt is retried from the first byte not yet delivered. Every attempt carries
    /// `If-Match` with the pinned ETag and checks the ETag of the response: bytes of another
    /// version are never delivered. The read fails once a whole read deadline passes without a
    /// byte, counted from `started` (when the caller began waiting for its turn, if it had to)
    /// until the first byte, then from the last byte received: over a slow link shared by a
    /// scale-up a read takes longer; only one that stops getting bytes fails.
    pub async fn read_range(
        &self,
        version: &ObjectVersion,
        range: Range<u64>,
        started: Instant,
        sink: &mut (dyn FnMut(Bytes) + Send),
    ) -> Result<(), OriginError> {
        let location = self.location(&version.key)?;
        // The deadline runs from the last byte received (from `started` until the first): a
        // read behind a slow, shared link goes on while bytes come, one that gets none fails.
        // The time of the last byte is kept as nanoseconds after `started`.
        let (last_byte, received) = (AtomicU64::new(0), AtomicU64::new(0));
        let last_byte_at = || started + Duration::from_nanos(last_byte.load(Ordering::Relaxed));
        let mut counted = |chunk: Bytes| {
            let since = started.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
            last_byte.store(since, Ordering::Relaxed);
            received.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            sink(chunk);
        };
        self.budget.deposit();
        let attempts = async {
            let (mut attempt, mut next) = (0, range.start);
            loop {
                let failure = match self
                    .read_attempt(&location, version, next..range.end, &mut counted)
                    .await
                {
                    Ok(()) => return Ok(()),
                    Err((delivered, failure)) => {
                        next += delivered;
                        failure
                    }
                };
                attempt = self.after_failure(&version.key, attempt, failure).await?;
            }
        };
        tokio::pin!(attempts);
        loop {
            tokio::select! {
                result = &mut attempts => return result,
                () = tokio::time::sleep_until(last_byte_at() + self.deadline) => {
                    if last_byte_at() + self.deadline <= Instant::now() {
                        return Err(self.deadline_exceeded(&version.key, received.load(Ordering::Relaxed)));
                    }
                }
            }
        }
    }

    /// One GET of `range`; on failure, how many bytes it delivered before failing.
    async fn read_attempt(
        &self,
        location: &Path,
        version: &ObjectVersion,
        range: Range<u64>,
        sink: &mut (dyn FnMut(Bytes) + Send),
    ) -> Result<(), (u64, Failure)> {
        add(&self.stats.origin_get_requests, 1);
        let options = GetOptions {
            if_match: version.etag.clone(),
            version: version.version.clone(),
            range: Some(GetRange::Bounded(range.clone())),
            ..GetOptions::default()
        };
        let response =
            match tokio::time::timeout(self.request_timeout, self.reader.get_opts(location, options)).await {
                Err(_) => {
                    return Err((
                        0,
                        Failure::Transient(TransientError::Timeout(self.request_timeout)),
                    ));
                }
                // The pinned generation (GCS) or version ID is no longer there: the object was
                // replaced or deleted since it was opened.
                Ok(Err(object_store::Error::NotFound { .. })) if version.version.is_some() => {
                    return Err((0, Failure::Final(self.version_changed(version))));
                }
                Ok(Err(e)) => return Err((0, self.classify(&version.key, e))),
                Ok(Ok(response)) => response,
            };
        if let Some(expected) = &version.etag
            && !response
                .meta
                .e_tag
                .as_deref()
                .is_some_and(|etag| same_entity_tag(etag, expected))
        {
            return Err((0, Failure::Final(self.version_changed(version))));
        }
        let mut stream = response.into_stream();
        let want = range.end - range.start;
        let mut delivered = 0u64;
        while delivered < want {
            let chunk = match tokio::time::timeout(self.request_timeout, stream.next()).await {
                Err(_) => {
                    return Err((
                        delivered,
                        Failure::Transient(TransientError::Timeout(self.request_timeout)),
                    ));
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err((delivered, self.classify(&version.key, e))),
                Ok(Some(Ok(chunk))) => chunk,
            };
            let chunk = chunk.slice(..chunk.len().min((want - delivered) as usize));
            add(&self.stats.origin_bytes, chunk.len() as u64);
            delivered += chunk.len() as u64;
            sink(chunk);
        }
        if delivered < want {
            let missing = want - delivered;
            return Err((
                delivered,
                Failure::Transient(TransientError::ShortBody { missing }),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An origin over `store` (given whole or only to read from) holding `dir/a.bin`.
    async fn origin_holding_an_object(whole: bool) -> (Origin, Arc<OriginStats>) {
        let store = Arc::new(object_store::memory::InMemory::new());
        ObjectStoreExt::put(
            store.as_ref(),
            &Path::from("dir/a.bin"),
            Bytes::from_static(b"abc").into(),
        )
        .await
        .expect("put");
        let stats = Arc::new(OriginStats::default());
        let (name, url, config) = ("registry:example", "oci://example", OriginConfig::default());
        let origin = if whole {
            Origin::new(name, url, store, Path::default(), &config, stats.clone())
        } else {
            Origin::read_only(name, url, store, Path::default(), &config, stats.clone())
        };
        (origin, stats)
    }

    #[tokio::test]
    async fn an_origin_that_only_reads_answers_listings_and_writes_with_a_typed_error() {
        let (origin, stats) = origin_holding_an_object(false).await;
        // It reads...
        assert_eq!(origin.head("dir/a.bin").await.expect("head").size, 3);
        let whole = origin.get_at_most("dir/a.bin", 10).await.expect("get");
        assert_eq!(whole.as_deref(), Some(&b"abc"[..]));
        // ...and says, by source and operation, that it lists and writes nothing.
        let said = |result: Result<(), OriginError>, operation: Operation, asked: &str| match result {
            Err(OriginError::NotSupported {
                source_name,
                key,
                operation: what,
            }) => {
                assert_eq!(
                    (source_name.as_str(), key.as_str(), what),
                    ("registry:example", asked, operation)
                );
            }
            other => panic!("{operation} of {asked:?}: {other:?}"),
        };
        said(
            origin.list_page("dir", None).await.map(drop),
            Operation::List,
            "dir",
        );
        said(origin.list_page("", None).await.map(drop), Operation::List, "");
        said(origin.list_all("dir").await.map(drop), Operation::List, "dir");
        said(origin.is_dir("dir").await.map(drop), Operation::List, "dir");
        said(
            origin.put("dir/b.bin", Bytes::from_static(b"x")).await,
            Operation::Write,
            "dir/b.bin",
        );
        let error = origin.list_all("dir").await.expect_err("a listing");
        assert_eq!(
            error.to_string(),
            "source registry:example cannot list \"dir\": it can only read objects"
        );
        // Nothing was asked of the store.
        let sent = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        assert_eq!(sent(&stats.origin_list_requests), 0);
        assert_eq!(sent(&stats.origin_put_requests), 0);
        assert_eq!(sent(&stats.origin_errors_other), 0);
    }

    #[tokio::test]
    async fn the_same_store_given_whole_lists_and_writes() {
        let (origin, stats) = origin_holding_an_object(true).await;
        let listed = origin.list_all("dir").await.expect("list");
        assert_eq!(listed.versions.len(), 1);
        assert!(origin.is_dir("dir").await.expect("is_dir"));
        origin
            .put("dir/b.bin", Bytes::from_static(b"x"))
            .await
            .expect("put");
        assert_eq!(
            origin.list_page("dir", None).await.expect("page").entries.len(),
            2
        );
        assert_eq!(stats.origin_put_requests.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn entity_tags_compare_with_or_without_quotes() {
        assert!(same_entity_tag("\"abc==\"", "abc=="));
        assert!(same_entity_tag("abc", "abc"));
        assert!(same_entity_tag("W/\"abc\"", "\"abc\""));
        assert!(!same_entity_tag("\"abc\"", "\"abd\""));
        assert!(!same_entity_tag("\"abc", "abc"));
    }
}
