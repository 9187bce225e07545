//! A rack peer that misbehaves on purpose, holding the cluster key: it answers run requests
//! with a good head and then stalls, with blocks of wrong bytes whose BLAKE3 and tags are
//! its own (a lying member the key cannot catch), late the first time it is asked for a run
//! of more than one block, or with a block whose first group is not what its group values say.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use larder_block_tree::{GROUP, Tree};
use larder_peer_proto::auth::{ClusterKey, Verifier};
use larder_peer_proto::server::{authenticate, frame};
use larder_peer_proto::wire::{RUN_PATH, RunRequest};
use tokio::task::JoinHandle;

use crate::server::serve_on_loopback;

/// What a [`FakePeer`] does with a run request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misbehaviour {
    /// Answers 200 and never sends a byte of the body.
    StallAfterHead,
    /// Sends every block of the run as bytes of its own (all `0x5a`), with their true BLAKE3
    /// and valid tags.
    Lie,
    /// Answers the first request of more than one block for each object (by key) only after
    /// the delay, every other one at once, with the run's true bytes: the harness's
    /// deterministic content of the key (seed 0), as [`crate::upload`] wrote it. (A reader's
    /// first fill may ask for one block; a late answer to it shows nothing about a run.)
    LateOnce(Duration),
    /// Sends the run's first block's header and group values, true to the harness's content
    /// of the key (seed 0), then that block's first group with one byte changed, and then
    /// nothing more.
    BadGroupThenStall,
    /// Sends the run's true bytes (as [`Misbehaviour::LateOnce`]) with one byte of each block
    /// flipped and 8 others solved so that every block keeps its CRC-64/NVME, and so the whole
    /// object its full-object CRC: what a member holding the key can do to any CRC.
    ForgeCrc64Nvme,
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// The fake peer's node id: list it as `f=ADDRESS@RACK`.
pub const ID: &str = "f";

/// A misbehaving peer on a loopback port; stops when dropped.
#[derive(Debug)]
pub struct FakePeer {
    /// Where it listens.
    pub address: SocketAddr,
    requests: Arc<AtomicU64>,
    /// The runs answered late (key, first block, blocks).
    late: Arc<parking_lot::Mutex<Vec<(String, u32, u32)>>>,
    accept: JoinHandle<()>,
}

impl FakePeer {
    /// Starts one that checks requests with `key` and then does `misbehaviour`.
    pub async fn start(key: ClusterKey, misbehaviour: Misbehaviour) -> anyhow::Result<Self> {
        let verifier = Arc::new(Verifier::new(key.clone()));
        let requests = Arc::new(AtomicU64::new(0));
        let counted = requests.clone();
        let late = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let recorded = late.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            // Run requests only: the asker's hellos (its probes) say nothing of a run.
            if request.uri().path() == RUN_PATH {
                counted.fetch_add(1, Ordering::Relaxed);
            }
            let (verifier, key, late) = (verifier.clone(), key.clone(), recorded.clone());
            async move { Ok::<_, Infallible>(answer(&verifier, &key, misbehaviour, &late, &request).await) }
        });
        let (address, accept) = serve_on_loopback(service).await?;
        Ok(Self {
            address,
            requests,
            late,
            accept,
        })
    }

    /// The runs it answered late: key, first block and number of blocks.
    pub fn late_runs(&self) -> Vec<(String, u32, u32)> {
        self.late.lock().clone()
    }

    /// Run requests it was sent (hellos aside).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn answer<B>(
    verifier: &Verifier,
    key: &ClusterKey,
    misbehaviour: Misbehaviour,
    late: &parking_lot::Mutex<Vec<(String, u32, u32)>>,
    request: &hyper::Request<B>,
) -> hyper::Response<Body> {
    let refuse = |status: u16| {
        let mut response = hyper::Response::new(Full::new(Bytes::new()).boxed());
        *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
        response
    };
    let path_and_query = request.uri().path_and_query().map_or("", |pq| pq.as_str());
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let Ok(sender) = authenticate(
        Some(verifier),
        ID,
        "GET",
        path_and_query,
        request.headers(),
        now_ms,
    ) else {
        return refuse(401);
    };
    let Ok(run) = RunRequest::parse(path_and_query) else {
        return refuse(400);
    };
    match misbehaviour {
        Misbehaviour::StallAfterHead => {
            let never = futures::stream::pending::<Result<Frame<Bytes>, Infallible>>();
            hyper::Response::new(StreamBody::new(never).boxed())
        }
        Misbehaviour::Lie => blocks(key, &sender.nonce, &run, |_, len| vec![0x5a; len]),
        Misbehaviour::LateOnce(delay) => {
            let first = {
                let mut late = late.lock();
                let first = run.count > 1 && !late.iter().any(|(key, ..)| *key == run.key);
                if first {
                    late.push((run.key.clone(), run.first, run.count));
                }
                first
            };
            if first {
                tokio::time::sleep(delay).await;
            }
            let seed = crate::seed(&run.key, 0);
            blocks(key, &sender.nonce, &run, move |offset, len| {
                crate::content(seed, offset, len)
            })
        }
        Misbehaviour::ForgeCrc64Nvme => {
            let seed = crate::seed(&run.key, 0);
            blocks(key, &sender.nonce, &run, move |offset, len| {
                let mut bytes = crate::content(seed, offset, len);
                forge_crc64nvme(&mut bytes);
                bytes
            })
        }
        Misbehaviour::BadGroupThenStall => {
            let offset = u64::from(run.first) * run.block_size;
            let block = crate::content(
                crate::seed(&run.key, 0),
                offset,
                run.block_len(run.first) as usize,
            );
            let mut start = framed(key, &sender.nonce, run.first, &block);
            start.truncate(start.len() - block.len() + GROUP);
            if let Some(last) = start.last_mut() {
                *last ^= 1;
            }
            let first = futures::stream::once(async move { Ok(Frame::data(Bytes::from(start))) });
            let body = futures::StreamExt::chain(first, futures::stream::pending());
            hyper::Response::new(StreamBody::new(body).boxed())
        }
    }
}

/// Block `index` as an answer frames it: tagged header, group values, bytes.
fn framed(key: &ClusterKey, nonce: &[u8; 16], index: u32, bytes: &[u8]) -> Vec<u8> {
    let tree = Tree::of(bytes);
    let head = frame(Some(key), nonce, index, bytes.len() as u32, tree.root);
    [&head.encode()[..], tree.groups.as_flattened(), bytes].concat()
}

/// An answer of every block of `run`, each block's bytes from `bytes(offset, len)`, with their
/// group values, BLAKE3 and tags. The head goes at once and each block is made as the body is
/// read, as a member streams its blocks: made whole first, a run of 4 MiB blocks took a loaded
/// machine past the asker's first-byte deadline, and the member was never heard at all.
fn blocks(
    key: &ClusterKey,
    nonce: &[u8; 16],
    run: &RunRequest,
    bytes: impl Fn(u64, usize) -> Vec<u8> + Clone + Send + Sync + 'static,
) -> hyper::Response<Body> {
    hyper::Response::new(StreamBody::new(block_frames(key.clone(), *nonce, run.clone(), bytes)).boxed())
}

/// The frames of [`blocks`], each made on the blocking pool when the body asks for it; one
/// that cannot be made ends the answer early, as a member's failure would.
fn block_frames(
    key: ClusterKey,
    nonce: [u8; 16],
    run: RunRequest,
    bytes: impl Fn(u64, usize) -> Vec<u8> + Clone + Send + Sync + 'static,
) -> impl futures::Stream<Item = Result<Frame<Bytes>, Infallible>> {
    use futures::StreamExt;
    futures::stream::iter(run.first..run.first + run.count)
        .then(move |index| {
            let (key, run, bytes) = (key.clone(), run.clone(), bytes.clone());
            let made = tokio::task::spawn_blocking(move || {
                let offset = u64::from(index) * run.block_size;
                framed(&key, &nonce, index, &bytes(offset, run.block_len(index) as usize))
            });
            async move { made.await.ok() }
        })
        .take_while(|made| std::future::ready(made.is_some()))
        .filter_map(std::future::ready)
        .map(|made| Ok(Frame::data(Bytes::from(made))))
}

/// Flips the first byte of `block` and rewrites bytes 8..16 so that its CRC-64/NVME is what it
/// was. A CRC is affine over GF(2): setting bit `i` of the rewritten bytes changes the CRC by a
/// fixed `effect[i]`, whatever the rest, so the bits to set solve 64 linear equations.
pub fn forge_crc64nvme(block: &mut [u8]) {
    const AT: usize = 8;
    let crc = |bytes: &[u8]| crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, bytes);
    assert!(
        block.len() >= AT + 8,
        "a block of {} bytes is too short to forge",
        block.len()
    );
    let target = crc(block);
    block[0] ^= 0xff;
    block[AT..AT + 8].fill(0);
    let base = crc(block);
    let effect: Vec<u64> = (0..64)
        .map(|bit| {
            block[AT + bit / 8] = 1 << (bit % 8);
            let changed = crc(block) ^ base;
            block[AT + bit / 8] = 0;
            changed
        })
        .collect();
    // Rows: one equation per CRC bit, over the 64 unknown bits (as a mask), and its value.
    let mut rows: Vec<(u64, bool)> = (0..64)
        .map(|j| {
            let mask = (0..64).fold(0u64, |m, i| m | (((effect[i] >> j) & 1) << i));
            (mask, ((target ^ base) >> j) & 1 == 1)
        })
        .collect();
    let mut solution = 0u64;
    for column in 0..64 {
        let pivot = (column..64)
            .find(|&r| rows[r].0 >> column & 1 == 1)
            .expect("a CRC's effect on 8 consecutive bytes is invertible");
        rows.swap(column, pivot);
        let (mask, value) = rows[column];
        for (r, row) in rows.iter_mut().enumerate() {
            if r != column && row.0 >> column & 1 == 1 {
                row.0 ^= mask;
                row.1 ^= value;
            }
        }
    }
    for (column, &(_, value)) in rows.iter().enumerate() {
        solution |= u64::from(value) << column;
    }
    block[AT..AT + 8].copy_from_slice(&solution.to_le_bytes());
    assert_eq!(crc(block), target, "the forged block keeps its CRC");
}
