//! The owner's side: the peer listener's service.
//!
//! Each request is authenticated first (401 and nothing else otherwise), then read as a run
//! of one object version of one of this node's own sources, by name: the owner fetches only
//! from its configured sources, so no request can make it fetch anything else. The answer
//! starts at once (`x-larder-run: hit` if every block was cached, else `filled`) and streams
//! the blocks in order, each as it becomes available: from disk, from a fill in flight, or
//! from this node's own fill: from the run's fleet owner in another rack where a member of this
//! node's rack asked (`relay`), else from its origin, never from another peer. A block it
//! cannot get ends the answer early; the asker takes the rest from elsewhere.
//!
//! A hello says the asker's rack: the members take it as that member's rack only when the
//! hello comes from the IP address the member is listed at (see [`crate::members`]); a rack
//! the config would refuse as a label gets 400.
//!
//! Bounds, besides the listener's own ([`LIMITS`]): at most [`RUNS_PER_PEER`] answers in
//! flight per asking node and [`RUNS_IN_FLIGHT`] in all (then 503 at once), and each answer is
//! cut off after [`ANSWER_DEADLINE`] however slowly its asker reads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response, StatusCode};
use larder_block_tree::Tree;
use larder_config::is_peer_label;
use larder_http::{self as http, Body, Limits};
use larder_object::ObjectVersion;
use larder_origin::Origin;
use larder_peer_proto::auth::Verifier;
use larder_peer_proto::client::{KEEPALIVE_EVERY, RUN_HIT_HEADER};
use larder_peer_proto::server::{Sender, authenticate, frame};
use larder_peer_proto::wire::{HELLO_PATH, Hello, KEEPALIVE_INDEX, RUN_PATH, RunRequest, hello_rack};
use larder_read_path::{Cache, OpenObject};
use larder_stats::{PeerStats, add};
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::members::{Membership, RackRefused, SaidBy};

/// The peer listener's connection bounds.
pub const LIMITS: Limits = Limits {
    max_connections: 512,
    max_per_client: 64,
    read_timeout: Duration::from_secs(2),
    request_deadline: Duration::from_secs(5),
    max_body: 0,
    // Members send their request as they connect.
    fresh_grace: Duration::from_secs(1),
};

/// Answers in flight for one asking node at most.
pub const RUNS_PER_PEER: usize = 16;

/// Answers in flight at most.
pub const RUNS_IN_FLIGHT: usize = 256;

/// The longest one answer may take, however slowly its asker reads.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(120);

/// What the listener serves with.
#[derive(Debug)]
pub struct PeerListener {
    verifier: Option<Verifier>,
    hello: Hello,
    /// The members, to learn the rack of one listed without it from its hello.
    members: Option<Membership>,
    cache: Cache,
    origins: HashMap<String, Arc<Origin>>,
    stats: Arc<PeerStats>,
    /// Answers in flight, by asking node.
    running: Mutex<HashMap<String, usize>>,
}

/// A place among the answers in flight, given back when dropped.
struct Slot {
    listener: Arc<PeerListener>,
    node: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut running = self.listener.running.lock();
        if let Some(count) = running.get_mut(&self.node) {
            *count -= 1;
            if *count == 0 {
                running.remove(&self.node);
            }
        }
    }
}

impl PeerListener {
    /// A listener for node `hello` serving `cache`'s blocks of `origins`, checking requests
    /// with `verifier` (none: told to run without a key), telling `members` the racks askers
    /// say they are in.
    pub fn new(
        verifier: Option<Verifier>,
        hello: Hello,
        members: Option<Membership>,
        cache: Cache,
        origins: HashMap<String, Arc<Origin>>,
        stats: Arc<PeerStats>,
    ) -> Arc<Self> {
        Arc::new(Self {
            verifier,
            hello,
            members,
            cache,
            origins,
            stats,
            running: Mutex::new(HashMap::new()),
        })
    }

    /// A place for an answer to `node`, if it and the listener are under their bounds.
    fn slot(self: &Arc<Self>, node: &str) -> Option<Slot> {
        let mut running = self.running.lock();
        let total: usize = running.values().sum();
        let count = running.entry(node.to_owned()).or_default();
        if *count >= RUNS_PER_PEER || total >= RUNS_IN_FLIGHT {
            return None;
        }
        *count += 1;
        Some(Slot {
            listener: self.clone(),
            node: node.to_owned(),
        })
    }

    /// The answer to one request.
    async fn answer(self: Arc<Self>, request: Request<Bytes>) -> Response<Body> {
        let path_and_query = request.uri().path_and_query().map_or("", |pq| pq.as_str());
        // Paths are no secret: another release's (or no member's) get 404 before anything.
        let path = request.uri().path();
        if path != HELLO_PATH && path != RUN_PATH {
            return http::error(StatusCode::NOT_FOUND, "no such path");
        }
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let sender = match authenticate(
            self.verifier.as_ref(),
            &self.hello.node,
            request.method().as_str(),
            path_and_query,
            request.headers(),
            now_ms,
        ) {
            Ok(sender) => sender,
            Err(error) => {
                add(&self.stats.peer_served_refused, 1);
                tracing::debug!(%error, "peer request refused");
                return http::error(StatusCode::UNAUTHORIZED, &error.to_string());
            }
        };
        if request.method() != Method::GET {
            return http::error(StatusCode::METHOD_NOT_ALLOWED, "only GET");
        }
        match request.uri().path() {
            HELLO_PATH => {
                let rack = request.uri().query().and_then(hello_rack);
                if rack.as_deref().is_some_and(|rack| !is_peer_label(rack)) {
                    add(&self.stats.peer_served_refused, 1);
                    return http::error(StatusCode::BAD_REQUEST, &RackRefused::BadLabel.to_string());
                }
                let from = request.extensions().get::<http::Client>();
                if let (Some(members), Some(rack), Some(&http::Client::Ip(from))) =
                    (&self.members, rack, from)
                    && let Err(refused) = members.said_rack(&sender.node, &rack, SaidBy::Hello(from))
                {
                    tracing::debug!(%refused, "the rack a hello gave was not taken");
                }
                match serde_json::to_vec(&self.hello) {
                    Ok(body) => http::full(StatusCode::OK, "application/json", body),
                    Err(error) => http::error(StatusCode::INTERNAL_SERVER_ERROR, &error.to_string()),
                }
            }
            RUN_PATH => match RunRequest::parse(path_and_query) {
                Ok(run) => self.run(run, sender),
                Err(error) => {
                    add(&self.stats.peer_served_refused, 1);
                    http::error(StatusCode::BAD_REQUEST, &error.to_string())
                }
            },
            _ => http::error(StatusCode::NOT_FOUND, "no such path"),
        }
    }

    /// The object a run request names, if this node has its source and it names the same
    /// version the asker holds.
    fn object(&self, run: &RunRequest) -> Result<Arc<OpenObject>, &'static str> {
        let origin = self
            .origins
            .get(&run.source)
            .ok_or("no source of that name here")?;
        if run.block_size != self.cache.store().block_size() {
            return Err("this node caches blocks of another size");
        }
        let (etag, version) = run.version.parts();
        // Image content is named by its digest, whichever repository it was fetched from.
        let content = origin.content_at(&run.key, run.size).map(Box::new);
        let version = ObjectVersion {
            origin_url: origin.identity_url().to_owned(),
            key: run.key.clone(),
            etag: etag.map(str::to_owned),
            version: version.map(str::to_owned),
            size: run.size,
            modified: UNIX_EPOCH,
            content,
        };
        let object = OpenObject::new(origin.clone(), version);
        if object.id().0 != run.object {
            return Err("the source of that name here is not the asker's");
        }
        Ok(object)
    }

    /// Streams the blocks of `run`.
    fn run(self: Arc<Self>, run: RunRequest, sender: Sender) -> Response<Body> {
        let object = match self.object(&run) {
            Ok(object) => object,
            Err(reason) => return http::error(StatusCode::NOT_FOUND, reason),
        };
        let Some(slot) = self.slot(&sender.node) else {
            return http::error(StatusCode::SERVICE_UNAVAILABLE, "too many runs in flight");
        };
        let blocks = run.first..run.first + run.count;
        let relay = run.relay;
        let store = self.cache.store();
        let hit = blocks.clone().all(|index| store.contains(object.id(), index));
        // Two frames in the channel at most: a slow asker holds one block here, not a run.
        let (tx, rx) = mpsc::channel::<Bytes>(2);
        let key = self.verifier.as_ref().map(|v| v.key().clone());
        let listener = self.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let send = async {
                for index in blocks {
                    // While the block is on its way (from this node's origin), a keepalive a
                    // second tells the asker this owner is alive, so that it does not take the
                    // run to the origin too.
                    let block = listener.cache.block_for_peer(&object, index, relay);
                    tokio::pin!(block);
                    let keepalive = frame(key.as_ref(), &sender.nonce, KEEPALIVE_INDEX, 0, [0; 32]).encode();
                    let bytes = loop {
                        tokio::select! {
                            got = &mut block => break got,
                            () = tokio::time::sleep(KEEPALIVE_EVERY) => {
                                if tx.send(Bytes::copy_from_slice(&keepalive)).await.is_err() {
                                    return;
                                }
                            }
                        }
                    };
                    let bytes = match bytes {
                        Ok((bytes, _)) => bytes,
                        Err(error) => {
                            tracing::debug!(%error, index, "a block asked by a peer could not be had");
                            return;
                        }
                    };
                    let tree = Tree::of(&bytes);
                    let head = frame(key.as_ref(), &sender.nonce, index, bytes.len() as u32, tree.root);
                    let head = [&head.encode()[..], tree.groups.as_flattened()].concat();
                    let len = bytes.len() as u64;
                    if tx.send(head.into()).await.is_err() || tx.send(bytes).await.is_err() {
                        return;
                    }
                    add(&listener.stats.peer_sent_bytes, len);
                }
            };
            if tokio::time::timeout(ANSWER_DEADLINE, send).await.is_err() {
                tracing::debug!(peer = %sender.node, "an answer to a peer ran past its deadline");
            }
        });
        let mut response = Response::new(http::channel_body(rx));
        let answer = HeaderValue::from_static(if hit { "hit" } else { "filled" });
        response.headers_mut().insert(RUN_HIT_HEADER, answer);
        response
    }
}

/// The listener as an HTTP service.
pub fn service(listener: Arc<PeerListener>) -> impl http::Service {
    move |request: Request<Bytes>| listener.clone().answer(request)
}
