//! Object versions and their content-independent identity.
//!
//! An [`ObjectVersion`] is one version of one object in one origin, as seen by a `HEAD` or a
//! listing: it is what a file handle pins. Its [`ObjectId`] is the BLAKE3 hash of a canonical
//! encoding of (origin URL, key, ETag or else version id, size), so every node computes the
//! same id for the same version and a new version never shares blocks with an old one.
//!
//! Where there is an ETag the version id is left out of the identity: a listing gives the
//! ETag but not the version id a HEAD of a versioned bucket gives, and both must name the same
//! cached bytes. Two versions of a key with one ETag and one size hold the same bytes.

use std::fmt;
use std::time::SystemTime;

/// Domain separation for [`ObjectId`] preimages; bump when the encoding changes.
const IDENTITY_DOMAIN: &[u8] = b"larder.object.v2";

/// BLAKE3 of an object version's identity.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId(pub [u8; 32]);

impl ObjectId {
    /// Lower-case hex, as used in cache file names.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
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

/// One version of one object: the unit a handle pins and the cache keys by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectVersion {
    /// The origin's URL, as configured (`s3://bucket/prefix`).
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
}

impl ObjectVersion {
    /// The canonical identity bytes: the preimage of [`ObjectId`], also stored in the record
    /// header so a record can be checked against the object it claims to describe.
    pub fn identity(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.origin_url.len() + self.key.len());
        out.extend_from_slice(IDENTITY_DOMAIN);
        for field in [
            Some(self.origin_url.as_str()),
            Some(self.key.as_str()),
            self.etag.as_deref(),
            self.version.as_deref().filter(|_| self.etag.is_none()),
        ] {
            match field {
                None => out.push(0),
                Some(s) => {
                    out.push(1);
                    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
                    out.extend_from_slice(s.as_bytes());
                }
            }
        }
        out.extend_from_slice(&self.size.to_le_bytes());
        out
    }

    /// The id of this version.
    pub fn id(&self) -> ObjectId {
        ObjectId(*blake3::hash(&self.identity()).as_bytes())
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
        }
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
        a.origin_url = "s3://b".into();
        a.key = "ucket/k".into();
        b.origin_url = "s3://bucket".into();
        b.key = "/k".into();
        assert_ne!(a.id(), b.id());
        a.etag = None;
        a.version = Some(String::new());
        b.etag = Some(String::new());
        b.version = None;
        assert_ne!(a.id(), b.id());
    }
}
