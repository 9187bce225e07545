//! A rack peer that misbehaves on purpose, holding the cluster key: it answers run requests
//! with a good head and then stalls, or with blocks of wrong bytes whose BLAKE3 and tags are
//! its own (a lying member the key cannot catch).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use larder_peer_proto::auth::{ClusterKey, Verifier};
use larder_peer_proto::server::{authenticate, frame};
use larder_peer_proto::wire::RunRequest;
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
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// A misbehaving peer on a loopback port; stops when dropped.
#[derive(Debug)]
pub struct FakePeer {
    /// Where it listens.
    pub address: SocketAddr,
    requests: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl FakePeer {
    /// Starts one that checks requests with `key` and then does `misbehaviour`.
    pub async fn start(key: ClusterKey, misbehaviour: Misbehaviour) -> anyhow::Result<Self> {
        let verifier = Arc::new(Verifier::new(key.clone()));
        let requests = Arc::new(AtomicU64::new(0));
        let counted = requests.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            counted.fetch_add(1, Ordering::Relaxed);
            let (verifier, key) = (verifier.clone(), key.clone());
            async move { Ok::<_, Infallible>(answer(&verifier, &key, misbehaviour, &request)) }
        });
        let (address, accept) = serve_on_loopback(service).await?;
        Ok(Self {
            address,
            requests,
            accept,
        })
    }

    /// Run requests it was sent.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

fn answer<B>(
    verifier: &Verifier,
    key: &ClusterKey,
    misbehaviour: Misbehaviour,
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
    let Ok(sender) = authenticate(Some(verifier), "GET", path_and_query, request.headers(), now_ms) else {
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
        Misbehaviour::Lie => {
            let mut body = Vec::new();
            for index in run.first..run.first + run.count {
                let bytes = vec![0x5a; run.block_len(index) as usize];
                let hash = *blake3::hash(&bytes).as_bytes();
                let head = frame(Some(key), &sender.nonce, index, bytes.len() as u32, hash);
                body.extend_from_slice(&head.encode());
                body.extend_from_slice(&bytes);
            }
            hyper::Response::new(Full::new(Bytes::from(body)).boxed())
        }
    }
}
