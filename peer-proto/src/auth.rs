//! Authentication with the cluster key.
//!
//! Every node of a cluster holds the same secret, read from a file or the environment (never
//! argv, never logged: [`ClusterKey`]'s `Debug` shows nothing of it). A request carries the
//! sender's node id, the node id of the member it is meant for, the time, a random nonce and a
//! MAC (BLAKE3 in keyed mode, under a key derived from the secret) over method, path and query,
//! both node ids, time and nonce: a request signed for one member is refused by every other
//! (see [`crate::server::authenticate`]). The owner
//! refuses a request whose MAC is wrong before anything else, then one whose time is outside
//! the replay window, then one whose nonce it saw within the window ([`Verifier`]).
//!
//! Each block of the answer carries a tag over the request's nonce and the block's index,
//! length and BLAKE3 ([`ClusterKey::block_tag`]): nothing on the path can forge a block or
//! replay one from another answer. The asker checks the tag, then the bytes against the hash.
//! This stops anyone without the key; a node that holds it is trusted this far and no further
//! (the origin's checksums and sealed manifests check what it sends).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::path::Path;
use std::time::Duration;

use parking_lot::Mutex;

/// Request headers of the protocol.
pub mod header {
    /// The sender's node id.
    pub const NODE: &str = "x-larder-node";
    /// The node id of the member the request is meant for; empty only on a hello to an
    /// address whose member is not known yet.
    pub const TO: &str = "x-larder-to";
    /// The time the request was made, in milliseconds since the Unix epoch.
    pub const TIME: &str = "x-larder-time";
    /// A random nonce, 32 hex digits.
    pub const NONCE: &str = "x-larder-nonce";
    /// The request's MAC, 64 hex digits.
    pub const MAC: &str = "x-larder-mac";
}

/// The fewest bytes a cluster secret may have.
pub const MIN_SECRET_LEN: usize = 32;

/// How far a request's time may be from the owner's clock, either way.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(30);

/// Nonces remembered at most: past this many requests within one window, requests are refused
/// rather than a nonce forgotten early (which would let a request be replayed).
pub const MAX_REMEMBERED: usize = 100_000;

/// A cluster secret that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file could not be read.
    #[error("cannot read the cluster key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The key file can be read by others than its owner.
    #[error("the cluster key file {0} can be read by group or others (mode {1:o}); make it 0600 or 0400")]
    Exposed(String, u32),
    /// The secret is too short.
    #[error("the cluster key has {0} bytes; it needs at least {MIN_SECRET_LEN} (e.g. 64 hex digits)")]
    TooShort(usize),
}

/// A request the owner refuses, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A header is missing or malformed.
    #[error("missing or malformed {0} header")]
    Malformed(&'static str),
    /// The MAC does not match.
    #[error("bad MAC: the asker's cluster key is not the owner's")]
    BadMac,
    /// The request is meant for another member.
    #[error("the request is meant for member {to:?}, not this one ({this:?})")]
    OtherMember {
        /// The member it was signed for.
        to: String,
        /// This member.
        this: String,
    },
    /// The request's time is outside the replay window.
    #[error(
        "the asker's clock is {skew_ms} ms from the owner's, outside the replay window: sync the \
         nodes' clocks (NTP); the cluster key is not in question"
    )]
    Stale {
        /// The request's time minus this node's.
        skew_ms: i64,
    },
    /// The nonce was seen within the window.
    #[error("replayed request")]
    Replayed,
    /// Too many requests within one window to remember their nonces.
    #[error("too many requests to check for replays; try again")]
    Busy,
}

/// The key every node of the cluster holds.
#[derive(Clone)]
pub struct ClusterKey {
    key: [u8; 32],
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

/// What a request's MAC covers.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    /// `GET`.
    pub method: &'a str,
    /// The path and query, as sent.
    pub path_and_query: &'a str,
    /// The sender's node id.
    pub node: &'a str,
    /// The node id of the member the request is meant for.
    pub to: &'a str,
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The request's nonce.
    pub nonce: [u8; 16],
}

impl ClusterKey {
    /// A key from a secret of at least [`MIN_SECRET_LEN`] bytes (trailing whitespace, such as
    /// a file's final newline, is not part of it).
    pub fn from_secret(secret: &[u8]) -> Result<Self, KeyError> {
        let secret = secret.trim_ascii_end();
        if secret.len() < MIN_SECRET_LEN {
            return Err(KeyError::TooShort(secret.len()));
        }
        Ok(Self {
            key: blake3::derive_key("larder peer cluster key v1", secret),
        })
    }

    /// A key from a file only its owner can read.
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let read = |source| KeyError::Read {
            path: shown.clone(),
            source,
        };
        let mode = std::fs::metadata(path).map_err(read)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(KeyError::Exposed(shown, mode & 0o777));
        }
        Self::from_secret(&std::fs::read(path).map_err(read)?)
    }

    /// The MAC of a request.
    pub fn request_mac(&self, head: &RequestHead<'_>) -> [u8; 32] {
        let mut mac = blake3::Hasher::new_keyed(&self.key);
        for field in [
            b"request".as_slice(),
            head.method.as_bytes(),
            head.path_and_query.as_bytes(),
            head.node.as_bytes(),
            head.to.as_bytes(),
            &head.time_ms.to_le_bytes(),
            &head.nonce,
        ] {
            // Each field with its length, so that no two heads share an input.
            mac.update(&(field.len() as u64).to_le_bytes());
            mac.update(field);
        }
        *mac.finalize().as_bytes()
    }

    /// The tag of one block of the answer to the request with `nonce`.
    pub fn block_tag(&self, nonce: &[u8; 16], index: u32, len: u32, hash: &[u8; 32]) -> [u8; 32] {
        let mut mac = blake3::Hasher::new_keyed(&self.key);
        mac.update(b"block\0");
        mac.update(nonce);
        mac.update(&index.to_le_bytes());
        mac.update(&len.to_le_bytes());
        mac.update(hash);
        *mac.finalize().as_bytes()
    }

    /// Whether `tag` is the tag of that block (compared in constant time).
    pub fn block_tag_matches(
        &self,
        nonce: &[u8; 16],
        index: u32,
        len: u32,
        hash: &[u8; 32],
        tag: &[u8; 32],
    ) -> bool {
        blake3::Hash::from_bytes(self.block_tag(nonce, index, len, hash)) == *tag
    }
}

/// Checks requests on the owner's side, remembering nonces for the replay window.
#[derive(Debug)]
pub struct Verifier {
    key: ClusterKey,
    seen: Mutex<Seen>,
}

/// Nonces seen, with the time each may be forgotten, oldest first.
#[derive(Debug, Default)]
struct Seen {
    nonces: HashMap<[u8; 16], u64>,
    order: VecDeque<(u64, [u8; 16])>,
}

impl Verifier {
    /// A verifier for `key`.
    pub fn new(key: ClusterKey) -> Self {
        Self {
            key,
            seen: Mutex::default(),
        }
    }

    /// The key, to tag the blocks of the answer.
    pub fn key(&self) -> &ClusterKey {
        &self.key
    }

    /// Checks a request whose MAC header holds `mac_hex`, at `now_ms` by this node's clock.
    pub fn verify(&self, head: &RequestHead<'_>, mac_hex: &str, now_ms: u64) -> Result<(), AuthError> {
        let mut mac = [0; 32];
        hex::decode_to_slice(mac_hex, &mut mac).map_err(|_| AuthError::Malformed(header::MAC))?;
        if blake3::Hash::from_bytes(self.key.request_mac(head)) != mac {
            return Err(AuthError::BadMac);
        }
        let window = REPLAY_WINDOW.as_millis() as u64;
        let skew_ms = head.time_ms as i64 - now_ms as i64;
        if skew_ms.unsigned_abs() > window {
            return Err(AuthError::Stale { skew_ms });
        }
        let mut seen = self.seen.lock();
        while let Some(&(until, nonce)) = seen.order.front()
            && until < now_ms
        {
            seen.order.pop_front();
            seen.nonces.remove(&nonce);
        }
        if seen.nonces.contains_key(&head.nonce) {
            return Err(AuthError::Replayed);
        }
        if seen.nonces.len() >= MAX_REMEMBERED {
            return Err(AuthError::Busy);
        }
        // Forgotten only once its time can no longer pass the window check.
        let until = head.time_ms + window;
        seen.nonces.insert(head.nonce, until);
        let at = seen.order.partition_point(|&(t, _)| t <= until);
        seen.order.insert(at, (until, head.nonce));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000_000;

    fn key(secret: &str) -> ClusterKey {
        ClusterKey::from_secret(secret.as_bytes()).expect("key")
    }

    fn head(nonce: u8, time_ms: u64) -> RequestHead<'static> {
        RequestHead {
            method: "GET",
            path_and_query: "/v1/run?object=00&first=1",
            node: "node-a",
            to: "node-b",
            time_ms,
            nonce: [nonce; 16],
        }
    }

    #[test]
    fn a_signed_request_passes_once() {
        let key = key(&"s".repeat(40));
        let verifier = Verifier::new(key.clone());
        let mac = hex::encode(key.request_mac(&head(1, NOW)));
        assert_eq!(verifier.verify(&head(1, NOW), &mac, NOW + 5), Ok(()));
        assert_eq!(
            verifier.verify(&head(1, NOW), &mac, NOW + 6),
            Err(AuthError::Replayed)
        );
    }

    #[test]
    fn wrong_keys_changed_fields_and_old_requests_are_refused() {
        let key = key(&"s".repeat(40));
        let verifier = Verifier::new(key.clone());
        let other = hex::encode(super::tests::key(&"t".repeat(40)).request_mac(&head(1, NOW)));
        assert_eq!(
            verifier.verify(&head(1, NOW), &other, NOW),
            Err(AuthError::BadMac)
        );

        let mac = hex::encode(key.request_mac(&head(2, NOW)));
        let mut changed = head(2, NOW);
        changed.path_and_query = "/v1/run?object=00&first=2";
        assert_eq!(verifier.verify(&changed, &mac, NOW), Err(AuthError::BadMac));
        let mut changed = head(2, NOW);
        changed.node = "node-b";
        assert_eq!(verifier.verify(&changed, &mac, NOW), Err(AuthError::BadMac));
        // Signed for node-b, sent to node-c.
        let mut changed = head(2, NOW);
        changed.to = "node-c";
        assert_eq!(verifier.verify(&changed, &mac, NOW), Err(AuthError::BadMac));

        let old = head(3, NOW - 31_000);
        let mac = hex::encode(key.request_mac(&old));
        assert_eq!(
            verifier.verify(&old, &mac, NOW),
            Err(AuthError::Stale { skew_ms: -31_000 })
        );
        assert_eq!(
            verifier.verify(&head(4, NOW), "not hex", NOW),
            Err(AuthError::Malformed(header::MAC))
        );
    }

    #[test]
    fn nonces_are_forgotten_only_after_the_window() {
        let key = key(&"s".repeat(40));
        let verifier = Verifier::new(key.clone());
        let request = head(5, NOW);
        let mac = hex::encode(key.request_mac(&request));
        assert_eq!(verifier.verify(&request, &mac, NOW), Ok(()));
        // Still within the window: remembered.
        assert_eq!(
            verifier.verify(&request, &mac, NOW + 30_000),
            Err(AuthError::Replayed)
        );
        // Past it: the time check refuses it, and the next request lets the nonce go.
        assert!(matches!(
            verifier.verify(&request, &mac, NOW + 30_001),
            Err(AuthError::Stale { .. })
        ));
        let next = head(6, NOW + 30_001);
        let next_mac = hex::encode(key.request_mac(&next));
        assert_eq!(verifier.verify(&next, &next_mac, NOW + 30_001), Ok(()));
        let seen = verifier.seen.lock();
        assert_eq!(seen.nonces.keys().collect::<Vec<_>>(), vec![&[6; 16]]);
    }

    #[test]
    fn block_tags_bind_the_request_and_the_block() {
        let key = key(&"s".repeat(40));
        let tag = key.block_tag(&[1; 16], 3, 100, &[9; 32]);
        assert!(key.block_tag_matches(&[1; 16], 3, 100, &[9; 32], &tag));
        let others = [
            ([2; 16], 3, 100, [9; 32], "another request"),
            ([1; 16], 4, 100, [9; 32], "another block"),
            ([1; 16], 3, 99, [9; 32], "another length"),
            ([1; 16], 3, 100, [8; 32], "another hash"),
        ];
        for (nonce, index, len, hash, what) in others {
            assert!(!key.block_tag_matches(&nonce, index, len, &hash, &tag), "{what}");
        }
    }

    #[test]
    fn secrets_must_be_long_and_key_files_private() {
        assert!(matches!(
            ClusterKey::from_secret(b"short\n"),
            Err(KeyError::TooShort(5))
        ));
        assert!(format!("{:?}", key(&"s".repeat(40))) == "ClusterKey(..)");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("key");
        std::fs::write(&path, format!("{}\n", "k".repeat(64))).expect("write");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let error = ClusterKey::from_file(&path).expect_err("exposed");
        assert!(error.to_string().contains("mode 644"), "{error}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let from_file = ClusterKey::from_file(&path).expect("private file");
        let direct = key(&"k".repeat(64));
        assert_eq!(
            from_file.key, direct.key,
            "the final newline is not part of the secret"
        );
    }
}
