//! The owner's side of the protocol, without networking or storage: checking a request's
//! authentication headers, and framing the blocks of the answer.
//!
//! The daemon's listener hands each request's method, path and headers to [`authenticate`],
//! parses the run with [`crate::wire::RunRequest::parse`], and writes each block as
//! [`frame`] followed by its bytes.

use hyper::HeaderMap;

use crate::auth::{AuthError, ClusterKey, RequestHead, Verifier, header};
use crate::wire::FrameHeader;

/// Who sent a request that passed [`authenticate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sender {
    /// The sender's node id, as it gave it.
    pub node: String,
    /// The request's nonce: the blocks of the answer are tagged under it.
    pub nonce: [u8; 16],
}

/// Reads and checks a request's authentication headers at `now_ms`. Without a verifier (a
/// node told to run without a key) only the node id and nonce are read.
pub fn authenticate(
    verifier: Option<&Verifier>,
    method: &str,
    path_and_query: &str,
    headers: &HeaderMap,
    now_ms: u64,
) -> Result<Sender, AuthError> {
    let text = |name: &'static str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .ok_or(AuthError::Malformed(name))
    };
    let node = text(header::NODE)?;
    if node.is_empty() || node.len() > 128 {
        return Err(AuthError::Malformed(header::NODE));
    }
    let mut nonce = [0; 16];
    hex::decode_to_slice(text(header::NONCE)?, &mut nonce)
        .map_err(|_| AuthError::Malformed(header::NONCE))?;
    if let Some(verifier) = verifier {
        let time_ms = text(header::TIME)?
            .parse()
            .map_err(|_| AuthError::Malformed(header::TIME))?;
        let head = RequestHead {
            method,
            path_and_query,
            node,
            time_ms,
            nonce,
        };
        verifier.verify(&head, text(header::MAC)?, now_ms)?;
    }
    Ok(Sender {
        node: node.to_owned(),
        nonce,
    })
}

/// The frame header of block `index` with `hash`, tagged for the request with `nonce` (a zero
/// tag without a key).
pub fn frame(
    key: Option<&ClusterKey>,
    nonce: &[u8; 16],
    index: u32,
    len: u32,
    hash: [u8; 32],
) -> FrameHeader {
    let tag = key.map_or([0; 32], |key| key.block_tag(nonce, index, len, &hash));
    FrameHeader {
        index,
        len,
        hash,
        tag,
    }
}
