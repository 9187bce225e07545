//! The owner's side of the protocol, without networking or storage: checking a request's
//! authentication headers, and framing the blocks of the answer.
//!
//! The daemon's listener hands each request's method, path and headers to [`authenticate`],
//! parses the run with [`crate::wire::RunRequest::parse`], and writes each block as
//! [`frame`] followed by its bytes.

use hyper::HeaderMap;

use crate::auth::{AuthError, ClusterKey, RequestHead, Verifier, header};
use crate::wire::{FrameHeader, HELLO_PATH};

/// Who sent a request that passed [`authenticate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sender {
    /// The sender's node id, as it gave it.
    pub node: String,
    /// The request's nonce: the blocks of the answer are tagged under it.
    pub nonce: [u8; 16],
}

/// Reads and checks a request's authentication headers at `now_ms`, on member `this_node`.
/// Without a verifier (a node told to run without a key) the MAC and time are not read.
///
/// A request must be meant for `this_node`: one signed for another member is refused, so that
/// whoever sees a request cannot have a third member answer it. A hello may be meant for no
/// one in particular (the asker knows an address, not yet the member behind it).
pub fn authenticate(
    verifier: Option<&Verifier>,
    this_node: &str,
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
    let to = text(header::TO)?;
    if to.len() > 128 {
        return Err(AuthError::Malformed(header::TO));
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
            to,
            time_ms,
            nonce,
        };
        verifier.verify(&head, text(header::MAC)?, now_ms)?;
    }
    let path = path_and_query
        .split_once('?')
        .map_or(path_and_query, |(path, _)| path);
    let anyone = to.is_empty() && path == HELLO_PATH;
    if to != this_node && !anyone {
        return Err(AuthError::OtherMember {
            to: to.to_owned(),
            this: this_node.to_owned(),
        });
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

#[cfg(test)]
mod tests {
    use std::time::{SystemTime, UNIX_EPOCH};

    use hyper::header::HeaderValue;

    use super::*;
    use crate::wire::RUN_PATH;

    /// The headers of a GET of `path` signed by node `a` for member `to`.
    fn signed(key: &ClusterKey, path: &str, to: &str, nonce: u8, now_ms: u64) -> HeaderMap {
        let head = RequestHead {
            method: "GET",
            path_and_query: path,
            node: "a",
            to,
            time_ms: now_ms,
            nonce: [nonce; 16],
        };
        let mut headers = HeaderMap::new();
        for (name, value) in [
            (header::NODE, "a".to_owned()),
            (header::TO, to.to_owned()),
            (header::TIME, now_ms.to_string()),
            (header::NONCE, hex::encode([nonce; 16])),
            (header::MAC, hex::encode(key.request_mac(&head))),
        ] {
            headers.insert(name, HeaderValue::from_str(&value).expect("header"));
        }
        headers
    }

    #[test]
    fn a_request_is_accepted_only_by_the_member_it_was_signed_for() {
        let key = ClusterKey::from_secret(&[b's'; 40]).expect("key");
        let (b, c) = (Verifier::new(key.clone()), Verifier::new(key.clone()));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_millis() as u64;
        let run = format!("{RUN_PATH}?object=00");
        let for_b = signed(&key, &run, "b", 1, now);
        // Seen on its way to b and sent to c first: c refuses it, b then takes it.
        assert_eq!(
            authenticate(Some(&c), "c", "GET", &run, &for_b, now),
            Err(AuthError::OtherMember {
                to: "b".into(),
                this: "c".into()
            })
        );
        assert!(authenticate(Some(&b), "b", "GET", &run, &for_b, now).is_ok());
        // The member it names cannot be changed without the MAC failing.
        let mut to_c = for_b.clone();
        to_c.insert(header::TO, HeaderValue::from_static("c"));
        assert_eq!(
            authenticate(Some(&c), "c", "GET", &run, &to_c, now),
            Err(AuthError::BadMac)
        );
        // A hello may be for whoever is at the address; a run may not.
        let hello = crate::wire::hello_path("r1");
        assert!(
            authenticate(
                Some(&c),
                "c",
                "GET",
                &hello,
                &signed(&key, &hello, "", 2, now),
                now
            )
            .is_ok()
        );
        assert!(matches!(
            authenticate(Some(&c), "c", "GET", &run, &signed(&key, &run, "", 3, now), now),
            Err(AuthError::OtherMember { .. })
        ));
        // Without a key the member is still checked: a list that swapped two addresses shows.
        assert!(matches!(
            authenticate(None, "c", "GET", &run, &signed(&key, &run, "b", 4, now), now),
            Err(AuthError::OtherMember { .. })
        ));
    }
}
