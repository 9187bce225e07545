//! Rack peers: the tier between this node's NVMe and the object store.
//!
//! A miss on this node asks the run's owner (rendezvous hashing over the live members, this
//! rack first; see [`crate::members`]) before the origin: [`PeerSource`] is the fill path's
//! [`BlockSource`](larder_read_path::fill::BlockSource) for that. The owner answers from its own
//! NVMe, or joins or starts its own fill from its origin and streams the blocks as they
//! arrive ([`listener`]), so a rack fetches each part from the object store about once.
//!
//! Every block from a peer is checked before it reaches a reader or the cache: its tag under
//! the cluster key and the request's nonce, its place and length in the run, its bytes
//! against its BLAKE3. A peer that is down, slow, or sends anything wrong costs at most the
//! first-byte or stall deadline; the member's circuit opens (its runs go to the next member
//! by rank meanwhile), and the rest of the run comes from the origin. A peer never fails a
//! read.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod listener;
pub mod manifest;
pub mod members;
mod source;

use std::path::Path;

use futures::FutureExt;
use futures::future::BoxFuture;
use larder_config::PeerConfig;
use larder_peer_proto::auth::{ClusterKey, KeyError};
use larder_peer_proto::client::{Client, PeerError};
use larder_peer_proto::wire::Hello as Said;

use crate::members::Hello;
pub use source::PeerSource;

/// Asks the member behind an address who it is (its node id and rack), over the peer
/// protocol, telling it this node's rack: how members found by DNS get their ids, and members
/// listed without a rack their racks.
#[derive(Debug)]
pub struct AskWho {
    /// Asks.
    pub client: Client,
    /// This node's rack.
    pub rack: String,
}

impl Hello for AskWho {
    fn hello<'a>(&'a self, address: &'a str, to: &'a str) -> BoxFuture<'a, Result<Said, PeerError>> {
        self.client.hello(address, to, &self.rack).boxed()
    }
}

/// The variable that may hold the cluster secret instead of a file.
pub const CLUSTER_KEY_VARIABLE: &str = "LARDER_CLUSTER_KEY";

/// Why rack peers cannot start.
#[derive(Debug, thiserror::Error)]
pub enum PeerSetupError {
    /// The key cannot be used.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// No key, and not told to run without one.
    #[error(
        "rack peers need a cluster key: give --cluster-key-file (peer.cluster_key_file) or \
         {CLUSTER_KEY_VARIABLE}, or run without one on a closed network with --peer-insecure"
    )]
    NoKey,
}

/// The cluster key as configured: the file, else the variable; `None` only when told to run
/// without one.
pub fn cluster_key(config: &PeerConfig) -> Result<Option<ClusterKey>, PeerSetupError> {
    if let Some(path) = &config.cluster_key_file {
        return Ok(Some(ClusterKey::from_file(Path::new(path))?));
    }
    if let Some(secret) = std::env::var_os(CLUSTER_KEY_VARIABLE) {
        use std::os::unix::ffi::OsStrExt;
        return Ok(Some(ClusterKey::from_secret(secret.as_bytes())?));
    }
    if config.insecure {
        Ok(None)
    } else {
        Err(PeerSetupError::NoKey)
    }
}
