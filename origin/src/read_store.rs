//! The seam an [`Origin`](crate::Origin) reads objects through.
//!
//! Reading is all that every source can do: a GET of an object, whole or a range of it, pinned
//! to a version (`If-Match`, a version id), or only its metadata (a `HEAD`, which object_store
//! also spells as a GET with `head` set). [`ReadStore`] is that one call. Every
//! `object_store::ObjectStore` is a `ReadStore` (the blanket impl below), so the cloud stores, a
//! local directory, HTTP and the fault-injecting wrappers of the tests need nothing new; a
//! source that can only be read (the registry mirror's upstream) implements `ReadStore` alone
//! and never has to pretend to list, write, copy or delete.
//!
//! Listing and writing Larder's own objects (sealed manifests) need the whole `ObjectStore`,
//! which [`Origin::new`](crate::Origin::new) takes and
//! [`Origin::read_only`](crate::Origin::read_only) does not: a read-only origin asked to list or
//! write answers [`OriginError::NotSupported`](crate::OriginError::NotSupported) without sending
//! a request.

use std::fmt;

use async_trait::async_trait;
use object_store::path::Path;
use object_store::{GetOptions, GetResult, ObjectStore};

/// What an origin needs of a store to read its objects: one GET with options.
///
/// `options` carries what a read asks for: a range, the version it is pinned to (`if_match`,
/// `version`), or `head` for the metadata alone (the answer's body is then not read). Errors
/// are object_store's, which the origin sorts into retries and
/// [`OriginError`](crate::OriginError)s as it does for any store: report a missing object as
/// `object_store::Error::NotFound`, a refusal as `PermissionDenied`, and a failure worth
/// retrying as `Generic`.
#[async_trait]
pub trait ReadStore: fmt::Debug + Send + Sync + 'static {
    /// The object at `location`, as `options` ask for it.
    async fn get_opts(&self, location: &Path, options: GetOptions) -> object_store::Result<GetResult>;
}

#[async_trait]
impl<T: ObjectStore + ?Sized> ReadStore for T {
    async fn get_opts(&self, location: &Path, options: GetOptions) -> object_store::Result<GetResult> {
        ObjectStore::get_opts(self, location, options).await
    }
}
