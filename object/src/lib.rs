//! Object versions and their content-independent identity.
//!
//! An [`ObjectVersion`] is one version of one object in one origin, as seen by a `HEAD` or a
//! listing: it is what a file handle pins. What the cache keys by is an [`Identity`], and the
//! [`ObjectId`] is the BLAKE3 hash of the identity's encoding, so every node computes the same
//! id for the same bytes and a new version never shares blocks with an old one. An identity is
//! one of:
//! - [`Identity::Version`]: (canonical source URL, key, ETag or else version id, size), an
//!   object version in a source;
//! - [`Identity::Digest`]: (algorithm, hex digest, size), content named by its digest, as an
//!   OCI blob is by its `sha256:...`, whatever store it comes from.
//!
//! The encoding is a domain string ([`IDENTITY_DOMAIN`], bumped whenever the encoding changes:
//! cache entries of an older encoding are never looked up again and leave by eviction), a
//! variant byte, then length-prefixed fields: no two identities share a preimage.
//!
//! Where there is an ETag the version id is left out of the identity: a listing gives the
//! ETag but not the version id a HEAD of a versioned bucket gives, and both must name the same
//! cached bytes. Two versions of a key with one ETag and one size hold the same bytes.
//!
//! # One spelling of a source URL
//!
//! Nodes may write a source's URL differently; [`canonical_source_url`] gives the one spelling
//! an identity uses:
//! - the scheme in lower case, aliases of one store folded: `s3a` → `s3`, `azure` and `adl` →
//!   `az` (`gs`, `file`, `http`, `https`, `abfs` and `abfss` stay as they are);
//! - the host in lower case (DNS names are case-insensitive; S3 and GCS bucket names and Azure
//!   container names are lower case only); the port left out when it is the scheme's default
//!   (`https://host:443/x` is `https://host/x`);
//! - user info, query and fragment left out (credentials and signatures do not name an
//!   object), except the `container@` of `abfs[s]://container@account.dfs.core.windows.net`,
//!   which does;
//! - the path as object_store makes the source's prefix of it: percent-decoded, `.` and `..`
//!   segments resolved, leading and trailing `/` dropped; its case is kept (keys are
//!   case-sensitive). `s3://b/p`, `s3://b/p/` and `S3://b/./p` are one source; `s3://b/P` is
//!   another.
//!
//! Not folded: one store named through two schemes (`s3://bucket/p` and
//! `https://bucket.s3.amazonaws.com/p`), and a prefix moved into the key (`s3://b/p` with key
//! `k`, `s3://b` with key `p/k`); the nodes of a cluster share one configuration. The Azure
//! account of an `az://` source comes from the environment and is not part of its identity.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod crc;

use std::fmt;
use std::time::SystemTime;

/// Domain separation for [`Identity`] encodings; bump when the encoding changes.
pub const IDENTITY_DOMAIN: &[u8] = b"larder.object.v3";

/// BLAKE3 of an object's [`Identity`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId(pub [u8; 32]);

impl ObjectId {
    /// Lower-case hex, as used in cache file names.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The id of content named by its digest, written as OCI writes it (`sha256:<64 lower-case
    /// hex digits>`), `size` bytes long.
    pub fn for_digest(digest: &str, size: u64) -> Result<Self, IdentityError> {
        Ok(Identity::digest(digest, size)?.id())
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectId({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Why a content digest cannot name an object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// Not `ALGORITHM:HEX`, or an algorithm Larder does not verify.
    #[error("digest {digest:?}: only sha256:<hex> digests are supported")]
    UnsupportedAlgorithm {
        /// The digest as given.
        digest: String,
    },
    /// The hex part is not the algorithm's length in lower-case hex digits.
    #[error("digest {digest:?}: expected {expected} lower-case hex digits")]
    BadDigest {
        /// The digest as given.
        digest: String,
        /// Hex digits the algorithm's digests have.
        expected: usize,
    },
}

/// How an object version is told apart from the other versions of its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionTag {
    /// The entity tag.
    ETag(String),
    /// The version id, for stores that give one but no ETag.
    VersionId(String),
    /// Neither: the key and the size alone.
    Unversioned,
}

/// A digest algorithm content can be named by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestAlgorithm {
    /// SHA-256, as OCI names blobs and manifests.
    Sha256,
}

impl DigestAlgorithm {
    /// The name OCI digests use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
        }
    }

    fn hex_len(self) -> usize {
        match self {
            Self::Sha256 => 64,
        }
    }
}

/// What names an object's bytes; its encoding is the preimage of [`ObjectId`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// One version of one object of a source.
    Version {
        /// The source's URL, in its [canonical spelling](canonical_source_url).
        source: String,
        /// Key relative to the source.
        key: String,
        /// ETag, or else version id.
        tag: VersionTag,
        /// Size in bytes.
        size: u64,
    },
    /// Content named by its digest.
    Digest {
        /// The algorithm.
        algorithm: DigestAlgorithm,
        /// The digest, lower-case hex.
        hex: String,
        /// Size in bytes.
        size: u64,
    },
}

impl Identity {
    /// Content named by an OCI digest (`sha256:<hex>`), `size` bytes long.
    pub fn digest(digest: &str, size: u64) -> Result<Self, IdentityError> {
        let algorithm = match digest.split_once(':') {
            Some(("sha256", _)) => DigestAlgorithm::Sha256,
            _ => {
                return Err(IdentityError::UnsupportedAlgorithm {
                    digest: digest.to_owned(),
                });
            }
        };
        let hex = &digest[algorithm.name().len() + 1..];
        if hex.len() != algorithm.hex_len() || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(IdentityError::BadDigest {
                digest: digest.to_owned(),
                expected: algorithm.hex_len(),
            });
        }
        Ok(Self::Digest {
            algorithm,
            hex: hex.to_owned(),
            size,
        })
    }

    /// The canonical encoding: the preimage of [`ObjectId`], also stored in the record header
    /// so a record can be checked against the object it claims to describe.
    pub fn to_bytes(&self) -> Vec<u8> {
        fn field(out: &mut Vec<u8>, s: &str) {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        let mut out = Vec::with_capacity(128);
        out.extend_from_slice(IDENTITY_DOMAIN);
        match self {
            Self::Version {
                source,
                key,
                tag,
                size,
            } => {
                out.push(1);
                field(&mut out, source);
                field(&mut out, key);
                match tag {
                    VersionTag::ETag(etag) => {
                        out.push(1);
                        field(&mut out, etag);
                    }
                    VersionTag::VersionId(version) => {
                        out.push(2);
                        field(&mut out, version);
                    }
                    VersionTag::Unversioned => out.push(0),
                }
                out.extend_from_slice(&size.to_le_bytes());
            }
            Self::Digest { algorithm, hex, size } => {
                out.push(2);
                field(&mut out, algorithm.name());
                field(&mut out, hex);
                out.extend_from_slice(&size.to_le_bytes());
            }
        }
        out
    }

    /// Its id.
    pub fn id(&self) -> ObjectId {
        ObjectId(*blake3::hash(&self.to_bytes()).as_bytes())
    }
}

/// The one spelling of an ETag that identities use: quoted, as HTTP writes it. Some stores list
/// an ETag bare and quote it in a HEAD's answer (fake-gcs-server): one version must have one id
/// however it was seen. A tag already quoted (S3's, always) is kept as it is.
fn quoted(etag: &str) -> String {
    let (weak, tag) = match etag.strip_prefix("W/") {
        Some(tag) => ("W/", tag),
        None => ("", etag),
    };
    if tag.len() >= 2 && tag.starts_with('"') && tag.ends_with('"') {
        etag.to_owned()
    } else {
        format!("{weak}\"{tag}\"")
    }
}

/// The one spelling of a source URL that identities use (the rules are in the module doc).
/// A string that is not a URL object_store could serve stays as written: no source is ever
/// built from it.
pub fn canonical_source_url(written: &str) -> String {
    let Ok(url) = url::Url::parse(written) else {
        return written.to_owned();
    };
    let Ok(prefix) = object_store::path::Path::from_url_path(url.path()) else {
        return written.to_owned();
    };
    let scheme = match url.scheme() {
        "s3a" => "s3",
        "azure" | "adl" => "az",
        other => other,
    };
    let container = match scheme {
        "abfs" | "abfss" if !url.username().is_empty() => format!("{}@", url.username()),
        _ => String::new(),
    };
    let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
    let port = url.port().map(|port| format!(":{port}")).unwrap_or_default();
    format!("{scheme}://{container}{host}{port}/{prefix}")
}

/// One version of one object: the unit a handle pins and the cache keys by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectVersion {
    /// The origin's URL in its [canonical spelling](canonical_source_url) (`s3://bucket/prefix`),
    /// made once by the origin: the identity takes it as it is.
    pub origin_url: String,
    /// Key relative to the source's prefix.
    pub key: String,
    /// Entity tag seen at open; every ranged GET is pinned to it.
    pub etag: Option<String>,
    /// Version id, where the store has them.
    pub version: Option<String>,
    /// Size in bytes.
    pub size: u64,
    /// When the origin last wrote it. Shown as the file's mtime; not part of the identity.
    pub modified: SystemTime,
    /// The identity of its content, where the origin names content by digest (an OCI blob or
    /// manifest, [`Identity::Digest`]): then it is the version's identity, the same in every
    /// repository and registry, and the URL, key and ETag only say where to fetch it.
    pub content: Option<Box<Identity>>,
}

impl ObjectVersion {
    /// What names this version's bytes.
    pub fn as_identity(&self) -> Identity {
        if let Some(content) = &self.content {
            return (**content).clone();
        }
        let tag = match (&self.etag, &self.version) {
            (Some(etag), _) => VersionTag::ETag(quoted(etag)),
            (None, Some(version)) => VersionTag::VersionId(version.clone()),
            (None, None) => VersionTag::Unversioned,
        };
        Identity::Version {
            source: self.origin_url.clone(),
            key: self.key.clone(),
            tag,
            size: self.size,
        }
    }

    /// The encoding of its [`Identity`]: the preimage of its [`ObjectId`].
    pub fn identity(&self) -> Vec<u8> {
        self.as_identity().to_bytes()
    }

    /// The id of this version.
    pub fn id(&self) -> ObjectId {
        self.as_identity().id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version() -> ObjectVersion {
        ObjectVersion {
            origin_url: "s3://bucket/prefix".into(),
            key: "llama/model.safetensors".into(),
            etag: Some("\"abc\"".into()),
            version: None,
            size: 1 << 30,
            modified: SystemTime::UNIX_EPOCH,
            content: None,
        }
    }

    #[test]
    fn an_etag_seen_bare_or_quoted_names_one_version() {
        let with = |etag: &str| {
            ObjectVersion {
                etag: Some(etag.into()),
                ..version()
            }
            .id()
        };
        assert_eq!(with("abc"), with("\"abc\""));
        assert_eq!(with("W/abc"), with("W/\"abc\""));
        assert_ne!(with("abc"), with("W/\"abc\""));
        assert_ne!(with("abc"), with("\"abd\""));
    }

    /// The id of the version an origin configured with `url` gives.
    fn id_of(url: &str) -> ObjectId {
        ObjectVersion {
            origin_url: canonical_source_url(url),
            ..version()
        }
        .id()
    }

    /// Every spelling in `same` has the id of the first; every one in `other` another id.
    fn spellings(canonical: &str, same: &[&str], other: &[&str]) {
        for url in same {
            assert_eq!(canonical_source_url(url), canonical, "{url}");
            assert_eq!(id_of(url), id_of(canonical), "{url}");
        }
        for url in other {
            assert_ne!(canonical_source_url(url), canonical, "{url}");
            assert_ne!(id_of(url), id_of(canonical), "{url}");
        }
    }

    #[test]
    fn s3_spellings_of_one_source_have_one_id() {
        spellings(
            "s3://bucket/models/llama",
            &[
                "s3://bucket/models/llama",
                "s3://bucket/models/llama/",
                "S3://Bucket/models/llama",
                "s3a://bucket/models/llama",
                "s3://bucket/models/./llama",
                "s3://bucket/models/x/../llama",
                "s3://bucket/models/%6Clama",
                "s3://key:secret@bucket/models/llama?x-id=1#f",
            ],
            &[
                "s3://bucket/models/Llama",
                "s3://bucket/models",
                "s3://other/models/llama",
            ],
        );
        spellings(
            "s3://bucket/",
            &["s3://bucket", "s3://bucket/"],
            &["s3://bucket2"],
        );
    }

    #[test]
    fn gs_spellings_of_one_source_have_one_id() {
        spellings(
            "gs://bucket/data",
            &["gs://bucket/data/", "GS://BUCKET/data", "gs://bucket/data/."],
            &["gs://bucket/Data", "s3://bucket/data"],
        );
    }

    #[test]
    fn azure_spellings_of_one_source_have_one_id() {
        spellings(
            "az://container/p",
            &["az://container/p/", "azure://container/p", "adl://Container/p"],
            &["az://container/P", "az://other/p"],
        );
        // The file system of an abfs URL is its user info: kept.
        spellings(
            "abfss://fs@account.dfs.core.windows.net/p",
            &["abfss://fs@Account.dfs.core.windows.net/p/"],
            &["abfss://other@account.dfs.core.windows.net/p"],
        );
    }

    #[test]
    fn file_spellings_of_one_source_have_one_id() {
        spellings(
            "file:///srv/models",
            &[
                "file:///srv/models/",
                "file:///srv/./models",
                "file:///srv/x/../models/",
                "FILE://localhost/srv/models",
            ],
            &["file:///srv/Models", "file:///srv"],
        );
    }

    #[test]
    fn http_spellings_of_one_source_have_one_id() {
        spellings(
            "https://host.example/files/x",
            &[
                "https://host.example/files/x/",
                "https://HOST.example:443/files/x",
                "https://user:pw@host.example/files/x?sig=abc",
            ],
            &[
                "https://host.example:8443/files/x",
                "http://host.example/files/x",
                "https://host.example/files/X",
            ],
        );
        spellings(
            "http://127.0.0.1:9000/b",
            &["http://127.0.0.1:9000/b/"],
            &["http://127.0.0.1/b"],
        );
        spellings("http://host/", &["http://host:80", "http://host/"], &[]);
    }

    #[test]
    fn every_identifying_field_changes_the_id() {
        let base = version();
        let mut others = vec![base.clone(); 5];
        others[0].origin_url.push('x');
        others[1].key.push('x');
        others[2].etag = Some("\"abd\"".into());
        others[3].etag = None;
        others[4].size += 1;
        for other in others {
            assert_ne!(other.id(), base.id(), "{other:?}");
        }
        assert_eq!(base.id(), version().id());
        // Without an ETag, the version id tells versions apart.
        let unnamed = ObjectVersion {
            etag: None,
            version: Some("v1".into()),
            ..version()
        };
        let next = ObjectVersion {
            version: Some("v2".into()),
            ..unnamed.clone()
        };
        assert_ne!(unnamed.id(), next.id());
    }

    #[test]
    fn a_listing_and_a_head_with_a_version_id_name_the_same_bytes() {
        let listed = version();
        let headed = ObjectVersion {
            version: Some("3HL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY".into()),
            ..version()
        };
        assert_eq!(listed.id(), headed.id());
    }

    #[test]
    fn fields_cannot_bleed_into_each_other() {
        let mut a = version();
        let mut b = version();
        a.origin_url = "s3://b/u".into();
        a.key = "k".into();
        b.origin_url = "s3://b".into();
        b.key = "/uk".into();
        assert_ne!(a.id(), b.id());
        a.etag = None;
        a.version = Some("x".into());
        b.etag = Some("x".into());
        b.version = None;
        assert_ne!(a.id(), b.id());
    }

    const SHA: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn a_digest_names_content_and_only_well_formed_sha256_digests_do() {
        let id = ObjectId::for_digest(SHA, 0).expect("a sha256 digest");
        assert_eq!(id, Identity::digest(SHA, 0).expect("digest").id());
        assert_ne!(id, ObjectId::for_digest(SHA, 1).expect("digest"));
        let other = SHA.replace("e3b0", "e3b1");
        assert_ne!(id, ObjectId::for_digest(&other, 0).expect("digest"));
        for bad in [
            SHA.to_uppercase().replacen("SHA256", "sha256", 1),
            SHA[..SHA.len() - 1].to_owned(),
            format!("{SHA}0"),
            SHA.replace('e', "g"),
        ] {
            assert!(
                matches!(
                    ObjectId::for_digest(&bad, 0),
                    Err(IdentityError::BadDigest { .. })
                ),
                "{bad}"
            );
        }
        for bad in [
            SHA.replace("sha256", "sha512"),
            SHA[7..].to_owned(),
            String::new(),
        ] {
            assert!(
                matches!(
                    ObjectId::for_digest(&bad, 0),
                    Err(IdentityError::UnsupportedAlgorithm { .. })
                ),
                "{bad}"
            );
        }
        // A version whose fields spell the digest is another object.
        let lookalike = Identity::Version {
            source: "sha256".into(),
            key: SHA[7..].into(),
            tag: VersionTag::Unversioned,
            size: 0,
        };
        assert_ne!(lookalike.id(), id);
    }

    /// Fails when the encoding changes: bump IDENTITY_DOMAIN, then update these ids.
    #[test]
    fn golden_ids() {
        assert_eq!(
            version().id().to_hex(),
            "2efd2cb6f558ff4396b0d34626fe167db90286d7c7dff52e9f0f0ae717d6dfb4"
        );
        assert_eq!(
            ObjectId::for_digest(SHA, 0).expect("digest").to_hex(),
            "779b4d25f1ebbe1b65e410e692ab3ed01a2affaf263b6a036c453914e0524061"
        );
    }
}
