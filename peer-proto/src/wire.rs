//! What goes over the wire: a request for a run of blocks (path and query), the frames of
//! the answer, and the hello that tells who a member is.
//!
//! A request names one object version the way the owner needs it to fill the run from its own
//! configured source: the source's name (never a URL, so a requester cannot make the owner
//! fetch anything else), the key, the version it pins (ETag or version id), the size, the block
//! size both sides cut it into, and the blocks. The answer is the blocks in order, each a
//! [`FrameHeader`] (index, length, BLAKE3, and the tag that authenticates them; see
//! [`crate::auth`]), then the chaining values of the block's 16 KiB groups (see
//! [`larder_block_tree`]; none for a block of one group), then its bytes, with keepalive
//! frames (a header alone) between them while the owner waits for a block. The group values
//! need no tag of their own: they must merge to the tagged hash. With them the asker checks
//! each group as it arrives. An answer that stops early gives the blocks it gave.
//!
//! The path names the protocol's version, which changes with the group size the values are
//! for and with what a request's MAC covers: members of the releases before group values ask
//! `/v1/run`, those whose groups were 64 KiB `/v2/run`, those whose requests were not signed
//! for one member `/v3/run`. This one answers none of them (404), nor they `/v4/run`. In a
//! rack being upgraded, runs between members of different releases come from the origin.
//!
//! A hello tells the member asked the asker's rack (`/v2/hello?rack=R`) as well as asking for
//! its id and rack: members listed without a rack learn each other's from either side.

use url::form_urlencoded;

/// The path of run requests: version 4, signed for one member, whose answers carry the values
/// of 16 KiB groups.
pub const RUN_PATH: &str = "/v4/run";

/// The path of hello requests: who a member behind an address is.
pub const HELLO_PATH: &str = "/v2/hello";

/// The path and query of a hello from a node of rack `rack`.
pub fn hello_path(rack: &str) -> String {
    let query = form_urlencoded::Serializer::new(String::new())
        .append_pair("rack", rack)
        .finish();
    format!("{HELLO_PATH}?{query}")
}

/// The asker's rack a hello's query gives, if it gives one.
pub fn hello_rack(query: &str) -> Option<String> {
    form_urlencoded::parse(query.as_bytes())
        .find(|(name, _)| name == "rack")
        .map(|(_, rack)| rack.into_owned())
}

/// The answer to a hello: the member's node id and rack.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hello {
    /// The node id.
    pub node: String,
    /// The rack label.
    pub rack: String,
}

/// The most blocks one request may ask for.
pub const MAX_RUN_BLOCKS: u32 = 64;

/// Longest source name, key and version a request may carry.
pub const MAX_SOURCE_LEN: usize = 255;
/// See [`MAX_SOURCE_LEN`].
pub const MAX_KEY_LEN: usize = 1024;
/// See [`MAX_SOURCE_LEN`].
pub const MAX_VERSION_LEN: usize = 1024;

/// A request that cannot be read, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not the run path.
    #[error("unknown path {0:?}")]
    Path(String),
    /// A parameter is missing.
    #[error("missing parameter {0}")]
    Missing(&'static str),
    /// A parameter is given twice.
    #[error("parameter {0} given twice")]
    Repeated(String),
    /// A parameter the protocol does not have.
    #[error("unknown parameter {0:?}")]
    Unknown(String),
    /// A parameter's value is not what it must be.
    #[error("parameter {name}: {reason}")]
    Invalid {
        /// The parameter.
        name: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// The version of an object a request pins, as both sides name it: the ETag where the origin
/// gives one, else the version id, else neither (a store that keeps no versions). On the wire:
/// `e:<ETag>`, `v:<version id>` or `-`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionTag {
    /// The ETag, quotes included, as the origin sent it.
    ETag(String),
    /// The version id, where the origin gives no ETag.
    VersionId(String),
    /// Neither.
    Unversioned,
}

impl VersionTag {
    /// The tag of a version with `etag` and `version_id`: the ETag wins.
    pub fn of(etag: Option<&str>, version_id: Option<&str>) -> Self {
        match (etag, version_id) {
            (Some(etag), _) => Self::ETag(etag.to_owned()),
            (None, Some(id)) => Self::VersionId(id.to_owned()),
            (None, None) => Self::Unversioned,
        }
    }

    /// The ETag and the version id it names.
    pub fn parts(&self) -> (Option<&str>, Option<&str>) {
        match self {
            Self::ETag(etag) => (Some(etag), None),
            Self::VersionId(id) => (None, Some(id)),
            Self::Unversioned => (None, None),
        }
    }
}

impl std::fmt::Display for VersionTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ETag(etag) => write!(f, "e:{etag}"),
            Self::VersionId(id) => write!(f, "v:{id}"),
            Self::Unversioned => f.write_str("-"),
        }
    }
}

/// A version tag of none of the three forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not a version tag: e:<ETag>, v:<version id> or -")]
pub struct UnknownVersionTag;

impl std::str::FromStr for VersionTag {
    type Err = UnknownVersionTag;

    fn from_str(tag: &str) -> Result<Self, Self::Err> {
        match tag.split_once(':') {
            Some(("e", etag)) => Ok(Self::ETag(etag.to_owned())),
            Some(("v", id)) => Ok(Self::VersionId(id.to_owned())),
            _ if tag == "-" => Ok(Self::Unversioned),
            _ => Err(UnknownVersionTag),
        }
    }
}

/// A request for blocks `first..first + count` of one object version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRequest {
    /// The object version's id (the daemon's canonical id).
    pub object: [u8; 32],
    /// The source's name in the owner's config.
    pub source: String,
    /// The key under the source.
    pub key: String,
    /// The version pinned.
    pub version: VersionTag,
    /// The object's size in bytes.
    pub size: u64,
    /// The block size both sides use.
    pub block_size: u64,
    /// The first block.
    pub first: u32,
    /// How many blocks.
    pub count: u32,
    /// Whether the owner may ask the run's fleet owner (in another rack) for blocks it lacks:
    /// set by a member of the owner's own rack. An owner asked across racks fills only from
    /// its own origin, so a request is passed on once at most and never loops.
    pub relay: bool,
}

impl RunRequest {
    /// The request's path and query.
    pub fn path_and_query(&self) -> String {
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("object", &hex::encode(self.object))
            .append_pair("source", &self.source)
            .append_pair("key", &self.key)
            .append_pair("version", &self.version.to_string())
            .append_pair("size", &self.size.to_string())
            .append_pair("block_size", &self.block_size.to_string())
            .append_pair("first", &self.first.to_string())
            .append_pair("count", &self.count.to_string())
            .finish();
        // Sent only when set: an owner of an earlier version knows no such field.
        let query = if self.relay {
            format!("{query}&relay=1")
        } else {
            query
        };
        format!("{RUN_PATH}?{query}")
    }

    /// Reads a request from its path and query, checking every field and the run's bounds.
    pub fn parse(path_and_query: &str) -> Result<Self, WireError> {
        let (path, query) = path_and_query.split_once('?').unwrap_or((path_and_query, ""));
        if path != RUN_PATH {
            return Err(WireError::Path(path.chars().take(64).collect()));
        }
        let mut fields = Fields::default();
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            fields.set(&name, value.into_owned())?;
        }
        let invalid = |name, reason| WireError::Invalid { name, reason };
        let number = |name, value: Option<String>| -> Result<u64, WireError> {
            value
                .ok_or(WireError::Missing(name))?
                .parse()
                .map_err(|_| invalid(name, "not a number"))
        };
        let text = |name, value: Option<String>, max: usize| -> Result<String, WireError> {
            let value = value.ok_or(WireError::Missing(name))?;
            if value.is_empty() || value.len() > max {
                return Err(invalid(name, "empty or too long"));
            }
            Ok(value)
        };
        let mut object = [0; 32];
        hex::decode_to_slice(fields.object.ok_or(WireError::Missing("object"))?, &mut object)
            .map_err(|_| invalid("object", "not 64 hex digits"))?;
        let request = Self {
            object,
            source: text("source", fields.source, MAX_SOURCE_LEN)?,
            key: text("key", fields.key, MAX_KEY_LEN)?,
            version: text("version", fields.version, MAX_VERSION_LEN)?
                .parse()
                .map_err(|UnknownVersionTag| invalid("version", "not e:<ETag>, v:<version id> or -"))?,
            size: number("size", fields.size)?,
            block_size: number("block_size", fields.block_size)?,
            first: u32::try_from(number("first", fields.first)?)
                .map_err(|_| invalid("first", "too large"))?,
            count: u32::try_from(number("count", fields.count)?)
                .map_err(|_| invalid("count", "too large"))?,
            relay: match fields.relay.as_deref() {
                None => false,
                Some("1") => true,
                Some(_) => return Err(invalid("relay", "not 1")),
            },
        };
        if !request.block_size.is_power_of_two() {
            return Err(invalid("block_size", "not a power of two"));
        }
        if request.count == 0 || request.count > MAX_RUN_BLOCKS {
            return Err(invalid(
                "count",
                "not between 1 and the most a request may ask for",
            ));
        }
        let blocks = request.size.div_ceil(request.block_size);
        if u64::from(request.first) + u64::from(request.count) > blocks {
            return Err(invalid("count", "past the end of the object"));
        }
        Ok(request)
    }

    /// The length of block `index` of this object.
    pub fn block_len(&self, index: u32) -> u64 {
        let start = u64::from(index) * self.block_size;
        self.size.saturating_sub(start).min(self.block_size)
    }
}

/// The request's parameters as they arrive, each at most once.
#[derive(Default)]
struct Fields {
    object: Option<String>,
    source: Option<String>,
    key: Option<String>,
    version: Option<String>,
    size: Option<String>,
    block_size: Option<String>,
    first: Option<String>,
    count: Option<String>,
    relay: Option<String>,
}

impl Fields {
    fn set(&mut self, name: &str, value: String) -> Result<(), WireError> {
        let slot = match name {
            "object" => &mut self.object,
            "source" => &mut self.source,
            "key" => &mut self.key,
            "version" => &mut self.version,
            "size" => &mut self.size,
            "block_size" => &mut self.block_size,
            "first" => &mut self.first,
            "count" => &mut self.count,
            "relay" => &mut self.relay,
            other => return Err(WireError::Unknown(other.chars().take(64).collect())),
        };
        if slot.replace(value).is_some() {
            return Err(WireError::Repeated(name.to_owned()));
        }
        Ok(())
    }
}

/// Bytes of an encoded [`FrameHeader`].
pub const FRAME_HEADER_LEN: usize = 4 + 4 + 32 + 32;

/// What precedes each block of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The block's index in the object.
    pub index: u32,
    /// The block's length in bytes.
    pub len: u32,
    /// The block's BLAKE3.
    pub hash: [u8; 32],
    /// The MAC over the request's nonce and the three fields above ([`crate::auth`]).
    pub tag: [u8; 32],
}

/// The index of a keepalive frame: no block, sent by an owner still waiting for the next one.
pub const KEEPALIVE_INDEX: u32 = u32::MAX;

impl FrameHeader {
    /// Whether this is a keepalive (index [`KEEPALIVE_INDEX`], no bytes, zero hash): the
    /// owner is alive and waiting for its origin. It is tagged like a block, so nothing on
    /// the path can keep an asker waiting.
    pub fn is_keepalive(&self) -> bool {
        self.index == KEEPALIVE_INDEX && self.len == 0 && self.hash == [0; 32]
    }

    /// The header's bytes: index and length little-endian, then hash and tag.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut out = [0; FRAME_HEADER_LEN];
        out[..4].copy_from_slice(&self.index.to_le_bytes());
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..40].copy_from_slice(&self.hash);
        out[40..].copy_from_slice(&self.tag);
        out
    }

    /// Reads a header from its bytes. Any bytes are a header; the tag says whether to trust it.
    pub fn decode(bytes: &[u8; FRAME_HEADER_LEN]) -> Self {
        let (index, rest) = bytes.split_at(4);
        let (len, rest) = rest.split_at(4);
        let (hash, tag) = rest.split_at(32);
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let array = |b: &[u8]| {
            let mut a = [0; 32];
            a.copy_from_slice(b);
            a
        };
        Self {
            index: word(index),
            len: word(len),
            hash: array(hash),
            tag: array(tag),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn request() -> RunRequest {
        RunRequest {
            object: [7; 32],
            source: "models".into(),
            key: "llama 3/model-00001-of-00004.safetensors?&=#%".into(),
            version: VersionTag::ETag("\"9b2cf535f27731c974343645a3985328\"".into()),
            size: 10 * (4 << 20) + 5,
            block_size: 4 << 20,
            first: 4,
            count: 7,
            relay: false,
        }
    }

    #[test]
    fn a_request_reads_back_as_it_was_written() {
        let request = request();
        assert_eq!(RunRequest::parse(&request.path_and_query()), Ok(request.clone()));
        let bad = format!("{}&relay=yes", request.path_and_query());
        let relayed = RunRequest {
            relay: true,
            ..request
        };
        assert_eq!(RunRequest::parse(&relayed.path_and_query()), Ok(relayed));
        assert!(RunRequest::parse(&bad).is_err());
    }

    #[test]
    fn requests_out_of_bounds_or_malformed_are_refused_with_the_reason() {
        let with = |change: &dyn Fn(&mut RunRequest)| {
            let mut request = request();
            change(&mut request);
            RunRequest::parse(&request.path_and_query())
        };
        let invalid = |name| Err(WireError::Invalid { name, reason: "" });
        let reason_free = |r: Result<RunRequest, WireError>| match r {
            Err(WireError::Invalid { name, .. }) => Err(WireError::Invalid { name, reason: "" }),
            other => other,
        };
        assert_eq!(reason_free(with(&|r| r.count = 0)), invalid("count"));
        assert_eq!(
            reason_free(with(&|r| r.count = MAX_RUN_BLOCKS + 1)),
            invalid("count")
        );
        assert_eq!(
            reason_free(with(&|r| r.first = 5)),
            invalid("count"),
            "past the end"
        );
        assert!(with(&|r| r.first = 4).is_ok(), "the last block");
        assert_eq!(
            reason_free(with(&|r| r.block_size = 3 << 20)),
            invalid("block_size")
        );
        assert_eq!(
            reason_free(with(&|r| r.source = String::new())),
            invalid("source")
        );
        assert_eq!(
            reason_free(with(&|r| r.key = "k".repeat(MAX_KEY_LEN + 1))),
            invalid("key")
        );

        let good = request().path_and_query();
        assert_eq!(
            RunRequest::parse(&good.replace("/v4/run", "/v3/run")),
            Err(WireError::Path("/v3/run".into())),
            "the release before's path"
        );
        assert_eq!(
            RunRequest::parse(&format!("{good}&count=2")),
            Err(WireError::Repeated("count".into()))
        );
        assert_eq!(
            RunRequest::parse(&format!("{good}&url=http://elsewhere")),
            Err(WireError::Unknown("url".into()))
        );
        assert_eq!(
            RunRequest::parse(&good.replace("&count=7", "")),
            Err(WireError::Missing("count"))
        );
    }

    #[test]
    fn a_frame_header_reads_back_as_it_was_written() {
        let header = FrameHeader {
            index: 0x0102_0304,
            len: 4 << 20,
            hash: [9; 32],
            tag: [3; 32],
        };
        assert_eq!(FrameHeader::decode(&header.encode()), header);
    }

    proptest! {
        #[test]
        fn any_query_parses_or_is_refused_without_panic(query in proptest::collection::vec(any::<u8>(), 0..512)) {
            let text = format!("{RUN_PATH}?{}", String::from_utf8_lossy(&query));
            if let Ok(request) = RunRequest::parse(&text) {
                prop_assert!(request.count >= 1 && request.count <= MAX_RUN_BLOCKS);
            }
        }
    }
}
