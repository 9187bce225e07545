//! Sealed manifests: the per-block BLAKE3 of one object version, written into the object store
//! beside the data by `larder seal`, and read back to check blocks that came from somewhere
//! less trusted than the origin (a rack peer).
//!
//! A manifest is a JSON object at `.larder-seal/<key>.json` relative to the source's root
//! ([`manifest_key`]):
//!
//! ```json
//! {
//!   "format": "larder-seal-v1",
//!   "key": "llama/model.safetensors",
//!   "etag": "\"9b2cf535f27731c974343645a3985328\"",
//!   "version_id": null,
//!   "size": 10485763,
//!   "block_size": 4194304,
//!   "blocks": ["<64 lower-case hex digits>", "...", "..."]
//! }
//! ```
//!
//! Block `i` covers bytes `i × block_size ..` up to the next block or the end of the object, and
//! its hash is the plain BLAKE3 of exactly those bytes: the hash the block store records for
//! the block (`VerifiedBlock`), so a block checked against a manifest can be stored as it is.
//!
//! Parsing is strict and bounded ([`Manifest::parse`]): at most [`MAX_SEAL_MANIFEST_BYTES`], no
//! unknown field, the format named, a power-of-two block size, exactly one hash per block of
//! the size, each 64 lower-case hex digits. Anything else is a typed [`ManifestError`].
//!
//! [`Manifests`] is the loader the peer fill path calls: it gives a manifest only when it
//! describes exactly the pinned version (key, ETag or version id, size, block size), and
//! remembers the answer per object version, a missing manifest for [`MISSING_MANIFEST_TTL`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use larder_object::{ObjectId, ObjectVersion};
use larder_origin::{Origin, OriginError};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use tokio::sync::OnceCell;

/// The directory, relative to a source's root, that manifests are written under. The mount
/// does not show it and prefetch never fetches it.
pub const SEAL_DIR: &str = ".larder-seal";

/// The `format` every manifest names.
pub const FORMAT: &str = "larder-seal-v1";

/// The largest manifest read: 64 MiB, about a million blocks (4 TiB of object at 4 MiB blocks).
pub const MAX_SEAL_MANIFEST_BYTES: u64 = 64 << 20;

/// How long a missing (or unreadable, or mismatched) manifest is remembered before the store is
/// asked again: an object sealed while a node runs is checked on that node within this time.
pub const MISSING_MANIFEST_TTL: Duration = Duration::from_secs(60);

/// Block hashes the loader keeps in memory, over every manifest (32 bytes each: 32 MiB).
const CACHED_HASHES: u64 = 1 << 20;

/// The key, relative to the source, of the manifest of object `key`.
pub fn manifest_key(key: &str) -> String {
    format!("{SEAL_DIR}/{key}.json")
}

/// Whether `key` (relative to the source) is under [`SEAL_DIR`]: a manifest, never data.
pub fn is_seal_key(key: &str) -> bool {
    key.strip_prefix(SEAL_DIR)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Why bytes are not a manifest.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Longer than [`MAX_SEAL_MANIFEST_BYTES`].
    #[error("the manifest is {size} bytes, more than the {max} read")]
    TooLarge {
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// Not JSON of the manifest's shape (an unknown or missing field, a hash that is not 64
    /// lower-case hex digits, ...).
    #[error("not a manifest: {0}")]
    Json(#[from] serde_json::Error),
    /// Another format, or a later version of this one.
    #[error("format {found:?} is not {FORMAT:?}")]
    Format {
        /// The format it names.
        found: String,
    },
    /// A block size of zero or not a power of two.
    #[error("block size {0} is not a power of two")]
    BlockSize(u64),
    /// Not exactly one hash per block of the size.
    #[error("{found} block hashes for {size} bytes in blocks of {block_size} (expected {expected})")]
    BlockCount {
        /// Hashes given.
        found: usize,
        /// Hashes the size needs.
        expected: u64,
        /// The object size it claims.
        size: u64,
        /// The block size it claims.
        block_size: u64,
    },
}

/// A BLAKE3 hash, written as 64 lower-case hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hash([u8; 32]);

impl Serialize for Hash {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&hex::encode(self.0))
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HexHash;
        impl Visitor<'_> for HexHash {
            type Value = Hash;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a BLAKE3 hash as 64 lower-case hex digits")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Hash, E> {
                let mut hash = [0; 32];
                let lower = text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
                if text.len() != 64 || !lower || hex::decode_to_slice(text, &mut hash).is_err() {
                    return Err(E::invalid_value(de::Unexpected::Str(text), &self));
                }
                Ok(Hash(hash))
            }
        }
        deserializer.deserialize_str(HexHash)
    }
}

/// A manifest as JSON has it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    format: String,
    key: String,
    etag: Option<String>,
    version_id: Option<String>,
    size: u64,
    block_size: u64,
    blocks: Vec<Hash>,
}

/// The per-block BLAKE3 of one object version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    key: String,
    etag: Option<String>,
    version_id: Option<String>,
    size: u64,
    block_size: u64,
    blocks: Vec<[u8; 32]>,
}

impl Manifest {
    /// The manifest of `version`, whose block `i` of `block_size` bytes hashes to `blocks[i]`;
    /// an error if `blocks` is not one hash per block or the block size not a power of two.
    pub fn new(
        version: &ObjectVersion,
        block_size: u64,
        blocks: Vec<[u8; 32]>,
    ) -> Result<Self, ManifestError> {
        let manifest = Self {
            key: version.key.clone(),
            etag: version.etag.clone(),
            version_id: version.version.clone(),
            size: version.size,
            block_size,
            blocks,
        };
        manifest.check().map(|()| manifest)
    }

    /// Reads a manifest; anything that is not exactly one is an error, never a panic.
    pub fn parse(bytes: &[u8]) -> Result<Self, ManifestError> {
        if bytes.len() as u64 > MAX_SEAL_MANIFEST_BYTES {
            return Err(ManifestError::TooLarge {
                size: bytes.len() as u64,
                max: MAX_SEAL_MANIFEST_BYTES,
            });
        }
        let wire: Wire = serde_json::from_slice(bytes)?;
        if wire.format != FORMAT {
            return Err(ManifestError::Format { found: wire.format });
        }
        let manifest = Self {
            key: wire.key,
            etag: wire.etag,
            version_id: wire.version_id,
            size: wire.size,
            block_size: wire.block_size,
            blocks: wire.blocks.into_iter().map(|hash| hash.0).collect(),
        };
        manifest.check()?;
        Ok(manifest)
    }

    /// The block size is a power of two and there is one hash per block.
    fn check(&self) -> Result<(), ManifestError> {
        if !self.block_size.is_power_of_two() {
            return Err(ManifestError::BlockSize(self.block_size));
        }
        let expected = self.size.div_ceil(self.block_size);
        if self.blocks.len() as u64 != expected {
            return Err(ManifestError::BlockCount {
                found: self.blocks.len(),
                expected,
                size: self.size,
                block_size: self.block_size,
            });
        }
        Ok(())
    }

    /// The JSON written to the store: the same manifest always gives the same bytes.
    pub fn to_json(&self) -> Vec<u8> {
        let wire = Wire {
            format: FORMAT.to_owned(),
            key: self.key.clone(),
            etag: self.etag.clone(),
            version_id: self.version_id.clone(),
            size: self.size,
            block_size: self.block_size,
            blocks: self.blocks.iter().copied().map(Hash).collect(),
        };
        let mut json = serde_json::to_vec_pretty(&wire).unwrap_or_default();
        json.push(b'\n');
        json
    }

    /// The BLAKE3 of block `index`, if the object has that block.
    pub fn block_hash(&self, index: u32) -> Option<[u8; 32]> {
        self.blocks.get(index as usize).copied()
    }

    /// Blocks in the object.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// The block size the hashes are of.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Why this manifest does not describe `version` cut in blocks of `block_size`, if it does
    /// not. With an ETag the version is named by it (as its identity is); without one, by its
    /// version id.
    fn mismatch(&self, version: &ObjectVersion, block_size: u64) -> Option<&'static str> {
        if self.key != version.key {
            Some("another key")
        } else if self.size != version.size {
            Some("another size")
        } else if self.block_size != block_size {
            Some("another block size")
        } else if version.etag.is_some() && self.etag != version.etag {
            Some("another ETag")
        } else if version.etag.is_none() && (version.version.is_none() || self.version_id != version.version)
        {
            Some("another version id, or none to match")
        } else {
            None
        }
    }
}

/// Hashes a stream of an object's bytes block by block, from a block boundary on.
#[derive(Debug)]
pub struct BlockHasher {
    block_size: u64,
    hasher: blake3::Hasher,
    /// Bytes of the current block hashed so far.
    filled: u64,
    hashes: Vec<[u8; 32]>,
}

impl BlockHasher {
    /// A hasher of blocks of `block_size` bytes (more than zero).
    pub fn new(block_size: u64) -> Self {
        Self {
            block_size: block_size.max(1),
            hasher: blake3::Hasher::new(),
            filled: 0,
            hashes: Vec::new(),
        }
    }

    /// The next bytes, in order.
    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let room = (self.block_size - self.filled).min(bytes.len() as u64) as usize;
            let (now, rest) = bytes.split_at(room);
            self.hasher.update(now);
            self.filled += room as u64;
            bytes = rest;
            if self.filled == self.block_size {
                self.end_block();
            }
        }
    }

    fn end_block(&mut self) {
        self.hashes.push(*self.hasher.finalize().as_bytes());
        self.hasher.reset();
        self.filled = 0;
    }

    /// The hash of every block given, the last one possibly short.
    pub fn finish(mut self) -> Vec<[u8; 32]> {
        if self.filled > 0 {
            self.end_block();
        }
        self.hashes
    }
}

/// What a lookup of one object version found, and when.
#[derive(Debug)]
struct Loaded {
    manifest: Option<Arc<Manifest>>,
    at: Instant,
}

/// The lookup of one object version: loaded once, however many ask at the same time.
type Slot = Arc<OnceCell<Loaded>>;

/// The manifests of the object versions the daemon checks blocks of, loaded from the sources
/// and remembered per [`ObjectId`] (bounded in hashes; a missing one for [`MISSING_MANIFEST_TTL`]).
/// Cheap to clone: clones share what they remember.
#[derive(Debug, Clone)]
pub struct Manifests {
    slots: moka::sync::Cache<ObjectId, Slot>,
}

impl Default for Manifests {
    fn default() -> Self {
        Self::new()
    }
}

impl Manifests {
    /// An empty loader.
    pub fn new() -> Self {
        let slots = moka::sync::Cache::builder()
            .max_capacity(CACHED_HASHES)
            .weigher(|_, slot: &Slot| {
                let hashes = slot
                    .get()
                    .and_then(|loaded| loaded.manifest.as_ref())
                    .map_or(0, |manifest| manifest.blocks.len());
                u32::try_from(hashes + 1).unwrap_or(u32::MAX)
            })
            .build();
        Self { slots }
    }

    /// The manifest of `version` of an object of `origin`, if the source has one that describes
    /// exactly that version (key, ETag or else version id, size) in blocks of `block_size`.
    ///
    /// Never an error: a manifest that is missing, cannot be read or parsed (logged at warn,
    /// naming the object) or describes another version (logged at debug) is `None`. The first
    /// call for a version GETs the manifest (callers at the same time wait for that one GET);
    /// later calls are answered from memory, a `None` for [`MISSING_MANIFEST_TTL`].
    pub async fn for_version(
        &self,
        origin: &Origin,
        version: &ObjectVersion,
        block_size: u64,
    ) -> Option<Arc<Manifest>> {
        let id = version.id();
        let mut slot = self.slots.get_with(id, Slot::default);
        if slot
            .get()
            .is_some_and(|loaded| loaded.manifest.is_none() && loaded.at.elapsed() >= MISSING_MANIFEST_TTL)
        {
            self.slots.invalidate(&id);
            slot = self.slots.get_with(id, Slot::default);
        }
        let fresh = !slot.initialized();
        let loaded = slot
            .get_or_init(|| async {
                Loaded {
                    manifest: load(origin, version, block_size).await.map(Arc::new),
                    at: Instant::now(),
                }
            })
            .await;
        if fresh {
            // Weighed again now that its size is known.
            self.slots.insert(id, slot.clone());
        }
        loaded
            .manifest
            .clone()
            .filter(|manifest| manifest.mismatch(version, block_size).is_none())
    }

    /// Forgets what is known of object `id`: its manifest was just written.
    pub fn forget(&self, id: ObjectId) {
        self.slots.invalidate(&id);
    }
}

/// GETs and checks the manifest of `version`; logs why there is none, where that is news.
async fn load(origin: &Origin, version: &ObjectVersion, block_size: u64) -> Option<Manifest> {
    let source = origin.name();
    let key = version.key.as_str();
    let bytes = match origin
        .get_at_most(&manifest_key(key), MAX_SEAL_MANIFEST_BYTES)
        .await
    {
        Ok(Some(bytes)) => bytes,
        Ok(None) => {
            tracing::warn!(
                source,
                key,
                max = MAX_SEAL_MANIFEST_BYTES,
                "the object's seal manifest is larger than Larder reads: ignored"
            );
            return None;
        }
        Err(OriginError::NotFound { .. }) => return None,
        Err(error) => {
            tracing::warn!(source, key, %error, "cannot read the object's seal manifest: blocks from peers are not checked against it");
            return None;
        }
    };
    let manifest = match Manifest::parse(&bytes) {
        Ok(manifest) => manifest,
        Err(error) => {
            tracing::warn!(source, key, %error, "the object's seal manifest is not valid: ignored");
            return None;
        }
    };
    if let Some(why) = manifest.mismatch(version, block_size) {
        tracing::debug!(
            source,
            key,
            why,
            "the object's seal manifest describes another version: ignored"
        );
        return None;
    }
    Some(manifest)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::SystemTime;

    use bytes::Bytes;
    use larder_config::OriginConfig;
    use larder_stats::OriginStats;
    use object_store::memory::InMemory;
    use object_store::{ObjectStore, ObjectStoreExt};
    use proptest::prelude::*;

    use super::*;

    const BLOCK: u64 = 1 << 16;

    fn version(size: u64) -> ObjectVersion {
        ObjectVersion {
            origin_url: "s3://bucket/models".into(),
            key: "llama/model.safetensors".into(),
            etag: Some("\"e1\"".into()),
            version: None,
            size,
            modified: SystemTime::UNIX_EPOCH,
            content: None,
        }
    }

    /// Deterministic bytes.
    fn bytes(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn hashes_of(data: &[u8], block_size: u64) -> Vec<[u8; 32]> {
        data.chunks(block_size as usize)
            .map(|block| *blake3::hash(block).as_bytes())
            .collect()
    }

    #[test]
    fn a_manifest_round_trips_and_always_writes_the_same_bytes() {
        let data = bytes(3 * BLOCK as usize + 5);
        let manifest =
            Manifest::new(&version(data.len() as u64), BLOCK, hashes_of(&data, BLOCK)).expect("manifest");
        let json = manifest.to_json();
        assert_eq!(Manifest::parse(&json).expect("parse"), manifest);
        assert_eq!(manifest.to_json(), json);
        assert_eq!(manifest.block_count(), 4);
        assert_eq!(
            manifest.block_hash(3),
            Some(*blake3::hash(&data[3 * BLOCK as usize..]).as_bytes())
        );
        assert_eq!(manifest.block_hash(4), None);
        assert!(Manifest::new(&version(10), BLOCK, vec![[0; 32]; 2]).is_err());
    }

    #[test]
    fn block_hashes_are_the_blake3_of_each_block_however_the_bytes_arrive() {
        let data = bytes(5 * BLOCK as usize + 17);
        let expected = hashes_of(&data, BLOCK);
        for chunk in [
            1,
            1000,
            BLOCK as usize - 1,
            BLOCK as usize,
            3 * BLOCK as usize + 1,
        ] {
            let mut hasher = BlockHasher::new(BLOCK);
            for piece in data.chunks(chunk) {
                hasher.update(piece);
            }
            assert_eq!(hasher.finish(), expected, "chunks of {chunk}");
        }
        // The block store's hash of a block is the same one.
        let first = &data[..BLOCK as usize];
        let mut buf = larder_engine::AlignedBuf::new(first.len());
        buf.extend_from_slice(first);
        let stored = larder_store::VerifiedBlock::verify(Arc::new(buf), expected[0]);
        assert!(
            stored.is_ok(),
            "the store does not take the manifest's hash of its block"
        );
        assert!(BlockHasher::new(BLOCK).finish().is_empty());
    }

    #[test]
    fn malformed_manifests_are_typed_errors() {
        let good = Manifest::new(&version(2 * BLOCK), BLOCK, vec![[7; 32]; 2]).expect("manifest");
        let json: serde_json::Value = serde_json::from_slice(&good.to_json()).expect("json");
        let with = |field: &str, value: serde_json::Value| {
            let mut json = json.clone();
            json[field] = value;
            serde_json::to_vec(&json).expect("json")
        };
        let hash = "ab".repeat(32);
        for (bytes, what) in [
            (with("format", "larder-seal-v2".into()), "format"),
            (with("block_size", 3.into()), "power of two"),
            (with("block_size", 0.into()), "power of two"),
            (with("size", (3 * BLOCK).into()), "block hashes"),
            (with("size", u64::MAX.into()), "block hashes"),
            (
                with("blocks", serde_json::json!([hash, hash, hash])),
                "block hashes",
            ),
            (
                with("blocks", serde_json::json!([hash, hash.to_uppercase()])),
                "hex",
            ),
            (with("blocks", serde_json::json!([hash, &hash[2..]])), "hex"),
            (with("blocks", serde_json::json!([hash, 5])), "hex"),
            (with("extra", 1.into()), "unknown field"),
            (b"[]".to_vec(), "not a manifest"),
            (b"{".to_vec(), "not a manifest"),
        ] {
            let error = Manifest::parse(&bytes).expect_err(what).to_string();
            assert!(error.contains(what), "{what}: {error}");
        }
        let huge = vec![b' '; MAX_SEAL_MANIFEST_BYTES as usize + 1];
        assert!(matches!(
            Manifest::parse(&huge),
            Err(ManifestError::TooLarge { .. })
        ));
    }

    #[test]
    fn manifests_live_under_the_seal_dir_and_only_there() {
        assert_eq!(manifest_key("a/b.bin"), ".larder-seal/a/b.bin.json");
        assert!(is_seal_key(".larder-seal") && is_seal_key(".larder-seal/a.json"));
        for key in [".larder-sealed/x", "a/.larder-seal/x", "larder-seal", ""] {
            assert!(!is_seal_key(key), "{key}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn arbitrary_bytes_never_panic_the_parser(data in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = Manifest::parse(&data);
        }

        #[test]
        fn arbitrary_manifest_shaped_json_parses_only_when_consistent(
            size in 0u64..1 << 20,
            shift in 0u32..21,
            count in 0usize..40,
            format in prop_oneof![Just(FORMAT.to_owned()), any::<String>()],
        ) {
            let block_size = 1u64 << shift;
            let json = serde_json::json!({
                "format": format, "key": "k", "etag": null, "version_id": "v",
                "size": size, "block_size": block_size, "blocks": vec!["00".repeat(32); count],
            });
            let parsed = Manifest::parse(&serde_json::to_vec(&json).expect("json"));
            let consistent = format == FORMAT && count as u64 == size.div_ceil(block_size);
            prop_assert_eq!(parsed.is_ok(), consistent, "{:?}", parsed);
        }
    }

    /// An origin over an in-memory store holding `objects`.
    async fn memory_origin(objects: &[(&str, Vec<u8>)]) -> Origin {
        let store = Arc::new(InMemory::new());
        for (key, data) in objects {
            store
                .put(
                    &object_store::path::Path::from(*key),
                    Bytes::from(data.clone()).into(),
                )
                .await
                .expect("put");
        }
        let store: Arc<dyn ObjectStore> = store;
        Origin::new(
            "models",
            "memory:///",
            store,
            object_store::path::Path::default(),
            &OriginConfig::default(),
            Arc::new(OriginStats::default()),
        )
    }

    #[tokio::test]
    async fn the_loader_gives_a_manifest_only_for_the_version_it_describes() {
        let data = bytes(2 * BLOCK as usize + 1);
        let key = "llama/model.safetensors";
        let origin = memory_origin(&[(key, data.clone())]).await;
        let version = origin.head(key).await.expect("head");
        let manifest = Manifest::new(&version, BLOCK, hashes_of(&data, BLOCK)).expect("manifest");
        let origin = {
            let mut objects = vec![(key, data.clone())];
            let path = manifest_key(key);
            objects.push((path.as_str(), manifest.to_json()));
            memory_origin(&objects).await
        };
        let version = origin.head(key).await.expect("head");
        let manifests = Manifests::new();
        let found = manifests
            .for_version(&origin, &version, BLOCK)
            .await
            .expect("a manifest");
        for (index, block) in data.chunks(BLOCK as usize).enumerate() {
            assert_eq!(
                found.block_hash(index as u32),
                Some(*blake3::hash(block).as_bytes())
            );
        }
        // Another version of the key, another block size, another key: none.
        let changed = ObjectVersion {
            etag: Some("\"other\"".into()),
            ..version.clone()
        };
        assert!(manifests.for_version(&origin, &changed, BLOCK).await.is_none());
        assert!(
            manifests
                .for_version(&origin, &version, 2 * BLOCK)
                .await
                .is_none()
        );
        let resized = ObjectVersion {
            size: version.size + 1,
            ..version.clone()
        };
        assert!(manifests.for_version(&origin, &resized, BLOCK).await.is_none());
        let unsealed = memory_origin(&[(key, data)]).await;
        assert!(
            Manifests::new()
                .for_version(&unsealed, &version, BLOCK)
                .await
                .is_none()
        );
    }

    #[tokio::test]
    async fn an_unreadable_manifest_is_absent_and_remembered() {
        let key = "a.bin";
        let path = manifest_key(key);
        let origin = memory_origin(&[(key, bytes(10)), (path.as_str(), b"{\"format\": 1".to_vec())]).await;
        let version = origin.head(key).await.expect("head");
        let manifests = Manifests::new();
        assert!(manifests.for_version(&origin, &version, BLOCK).await.is_none());
        let gets = origin.stats().origin_get_requests.load(Ordering::Relaxed);
        assert!(manifests.for_version(&origin, &version, BLOCK).await.is_none());
        assert_eq!(
            origin.stats().origin_get_requests.load(Ordering::Relaxed),
            gets,
            "a missing manifest was asked for again at once"
        );
        // Forgotten (sealed since): asked for again.
        manifests.forget(version.id());
        assert!(manifests.for_version(&origin, &version, BLOCK).await.is_none());
        assert_eq!(
            origin.stats().origin_get_requests.load(Ordering::Relaxed),
            gets + 1
        );
    }
}
