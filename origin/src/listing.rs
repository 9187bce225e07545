//! Listings: a directory's level page by page, every object under a directory (both stepping
//! over keys that cannot be paths), and whether a directory exists.

use futures::StreamExt;
use larder_object::ObjectVersion;
use larder_stats::add;
use object_store::ListResult;
use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::path::Path;

use crate::error::{bad_path, unparsable_key};
use crate::{Operation, Origin, OriginError};

/// One entry of a delimited listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListEntry {
    /// A common prefix ("directory"), relative to the source, without the trailing slash.
    Prefix(String),
    /// An object, relative to the source.
    Object(ObjectVersion),
}

/// Most entries asked for in one listing request (S3's own limit).
pub const PAGE_KEYS: usize = 1000;

/// One page of a delimited listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListPage {
    /// The entries, in the store's order.
    pub entries: Vec<ListEntry>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<PageToken>,
}

/// Every object under a directory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AllObjects {
    /// The objects, relative to the source.
    pub versions: Vec<ObjectVersion>,
    /// The keys listed that cannot be paths (an empty segment, `.` or `..`, a control
    /// character), relative to the source: stepped over, never read.
    pub unparsable_keys: Vec<String>,
}

/// Where a listing resumes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PageToken {
    /// The store's continuation token.
    Continue(String),
    /// After this store key: used to step over a key that cannot be a path.
    After(String),
}

impl Origin {
    fn dir_location(&self, dir: &str) -> Result<Path, OriginError> {
        if dir.is_empty() {
            Ok(self.prefix.clone())
        } else {
            self.location(dir)
        }
    }

    fn entries(&self, listing: ListResult) -> Vec<ListEntry> {
        let prefixes = listing
            .common_prefixes
            .iter()
            .filter_map(|p| self.relative_key(p))
            .map(ListEntry::Prefix);
        let objects = listing
            .objects
            .iter()
            .filter_map(|meta| self.version_at(meta).map(ListEntry::Object));
        prefixes.chain(objects).collect()
    }

    /// One page of the level of the tree under `dir` (relative to the source; `""` is its
    /// root), from `from` (`None`: the first page).
    ///
    /// A key object_store cannot turn into a path (an empty segment, `.`, a control character)
    /// would fail its whole page: the page is narrowed until the key comes first, and the key
    /// is stepped over and logged. Stores without paged listings return the whole level at once.
    pub async fn list_page(&self, dir: &str, from: Option<&PageToken>) -> Result<ListPage, OriginError> {
        let store = self.full_store(dir, Operation::List)?;
        let location = self.dir_location(dir)?;
        let Some(pager) = &self.pager else {
            let listing = self
                .with_retries(dir, || {
                    add(&self.stats.origin_list_requests, 1);
                    store.list_with_delimiter(Some(&location))
                })
                .await?;
            return Ok(ListPage {
                entries: self.entries(listing),
                next: None,
            });
        };
        let prefix = (!location.as_ref().is_empty()).then(|| format!("{location}/"));
        let (listing, next) = self
            .page_past_bad_keys(
                dir,
                pager.as_ref(),
                prefix.as_deref(),
                Some("/"),
                from.cloned(),
                &mut Vec::new(),
            )
            .await?;
        Ok(ListPage {
            entries: self.entries(listing),
            next,
        })
    }

    /// One page of `pager`'s listing of the keys under `prefix` (one level with `delimiter`,
    /// every key without), from `from`; where the next page starts.
    ///
    /// A key object_store cannot turn into a path fails its whole page: the page is narrowed
    /// until the key comes first, then the key is stepped over, logged and added to `skipped`
    /// (as the store names it).
    async fn page_past_bad_keys(
        &self,
        dir: &str,
        pager: &dyn PaginatedListStore,
        prefix: Option<&str>,
        delimiter: Option<&str>,
        mut from: Option<PageToken>,
        skipped: &mut Vec<String>,
    ) -> Result<(ListResult, Option<PageToken>), OriginError> {
        let mut max_keys = PAGE_KEYS;
        loop {
            let options = || PaginatedListOptions {
                delimiter: delimiter.map(|d| d.to_owned().into()),
                max_keys: Some(max_keys),
                page_token: match &from {
                    Some(PageToken::Continue(token)) => Some(token.clone()),
                    _ => None,
                },
                offset: match &from {
                    Some(PageToken::After(key)) => Some(key.clone()),
                    _ => None,
                },
                ..PaginatedListOptions::default()
            };
            let error = match self
                .with_retries(dir, || {
                    add(&self.stats.origin_list_requests, 1);
                    pager.list_paginated(prefix, options())
                })
                .await
            {
                Ok(page) => return Ok((page.result, page.page_token.map(PageToken::Continue))),
                Err(error) => error,
            };
            let Some(bad) = unparsable_key(&error) else {
                return Err(error);
            };
            if max_keys > 1 {
                max_keys /= 2;
                continue;
            }
            // The bad key comes first. A store that ignores start-after would return it again.
            if skipped.last().map(String::as_str) == Some(bad) {
                return Err(error);
            }
            tracing::warn!(source = %self.name, key = bad.escape_debug().to_string(), "skipping a listed key that cannot be a path");
            // A common prefix ends with the delimiter: step over every key under it as well.
            let after = if bad.ends_with('/') {
                format!("{bad}{}", char::MAX)
            } else {
                bad.to_owned()
            };
            skipped.push(bad.to_owned());
            from = Some(PageToken::After(after));
            max_keys = PAGE_KEYS;
        }
    }

    /// Every object under `dir/`, at any depth (`""`: the whole source), and the keys there
    /// that cannot be paths, stepped over as a directory's listing does (a store that pages its
    /// listings by narrowing the page; one that streams them, a local directory, item by item).
    pub async fn list_all(&self, dir: &str) -> Result<AllObjects, OriginError> {
        let store = self.full_store(dir, Operation::List)?;
        let location = self.dir_location(dir)?;
        let mut all = AllObjects::default();
        let mut skipped = Vec::new();
        if let Some(pager) = &self.pager {
            let prefix = (!location.as_ref().is_empty()).then(|| format!("{location}/"));
            let mut from = None;
            loop {
                let (listing, next) = self
                    .page_past_bad_keys(dir, pager.as_ref(), prefix.as_deref(), None, from, &mut skipped)
                    .await?;
                all.versions
                    .extend(listing.objects.iter().filter_map(|meta| self.version_at(meta)));
                match next {
                    Some(next) => from = Some(next),
                    None => break,
                }
            }
        } else {
            // The listing is one stream whose items fail one by one: a key that cannot be a
            // path fails its own item only, stepped over here.
            let items = self
                .with_retries(dir, || {
                    add(&self.stats.origin_list_requests, 1);
                    let items = store.list(Some(&location)).collect::<Vec<_>>();
                    async move { unless_failed(items.await) }
                })
                .await?;
            for item in items {
                match item {
                    Ok(meta) => all.versions.extend(self.version_at(&meta)),
                    Err(error) => {
                        if let Some(bad) = bad_path(&error) {
                            tracing::warn!(source = %self.name, key = bad.escape_debug().to_string(), "skipping a listed key that cannot be a path");
                            // A local store names it from its root, with a leading slash.
                            skipped.push(bad.trim_start_matches('/').to_owned());
                        }
                    }
                }
            }
        }
        let root = (!self.prefix.as_ref().is_empty()).then(|| format!("{}/", self.prefix));
        all.unparsable_keys = skipped
            .into_iter()
            .filter_map(|key| match &root {
                Some(root) => key.strip_prefix(root.as_str()).map(str::to_owned),
                None => Some(key),
            })
            .collect();
        Ok(all)
    }

    /// The version of a listed object, relative to the source; `None` outside it.
    fn version_at(&self, meta: &object_store::ObjectMeta) -> Option<ObjectVersion> {
        Some(self.version_of(self.relative_key(&meta.location)?, meta))
    }

    /// Whether any key lies under `dir/`, which makes `dir` a directory.
    pub async fn is_dir(&self, dir: &str) -> Result<bool, OriginError> {
        let store = self.full_store(dir, Operation::List)?;
        let location = self.location(dir)?;
        let found = match &self.pager {
            Some(pager) => {
                let prefix = format!("{location}/");
                self.with_retries(dir, || {
                    add(&self.stats.origin_list_requests, 1);
                    let options = PaginatedListOptions {
                        max_keys: Some(1),
                        ..PaginatedListOptions::default()
                    };
                    pager.list_paginated(Some(&prefix), options)
                })
                .await
                .map(|page| !page.result.objects.is_empty() || !page.result.common_prefixes.is_empty())
            }
            None => {
                self.with_retries(dir, || {
                    add(&self.stats.origin_list_requests, 1);
                    let mut keys = store.list(Some(&location));
                    async move { keys.next().await.transpose().map(|first| first.is_some()) }
                })
                .await
            }
        };
        match found {
            // Something is there, even if it cannot be a path.
            Err(error) if unparsable_key(&error).is_some() => Ok(true),
            found => found,
        }
    }
}

/// The items of a listing stream, unless one failed for another reason than a key that cannot
/// be a path: then that error.
fn unless_failed(
    items: Vec<object_store::Result<object_store::ObjectMeta>>,
) -> object_store::Result<Vec<object_store::Result<object_store::ObjectMeta>>> {
    let mut kept = Vec::with_capacity(items.len());
    for item in items {
        match item {
            Err(error) if bad_path(&error).is_none() => return Err(error),
            item => kept.push(item),
        }
    }
    Ok(kept)
}
