//! The asker's side: one HTTP/1.1 request per run, on a connection of its own, with deadlines
//! on the answer's start, on every gap in its bytes, and on each block as a whole.
//!
//! The deadline on the answer's start (the first-byte deadline) follows the peer's recent
//! answers as TCP's retransmission timeout follows round trips (RFC 6298): their smoothed
//! latency plus four times its smoothed deviation, doubled after each late answer until one
//! comes in time; never less than the configured deadline nor more than the stall deadline.
//! A node whose answers slow down or grow erratic (its CPU is saturated: a scale-up on a busy
//! node) is given the time it has been taking, so that its runs are not fetched from the origin
//! a second time; one that stops answering is still found out within a deadline.
//!
//! The gaps alone bound nothing: a peer that sends a byte a second never stalls. So each frame
//! of an answer (a block's header, group values and bytes, or a keepalive) must also have
//! arrived within the stall deadline plus its size at the rate floor (`peer.min_rate`),
//! counted from the end of the frame before it. A block that comes slower is late as a stalled
//! one is ([`PeerError::Timeout`]): the caller takes it from the origin and holds it against
//! the peer. Keepalives restart the count, as an owner waiting for its own origin is no slower
//! than that origin.
//!
//! [`Client::fetch_run`] checks each block's tag (with a key), that the blocks come in order
//! with the lengths the run implies, that their group values merge to the tagged hash, and
//! each 16 KiB group of bytes against its value as soon as it has arrived: a bad answer ends
//! at its first bad group. The bytes go straight into the caller's buffer, which it gets
//! whole with the check, to finish on the very bytes it keeps. An answer that ends early or stalls leaves the
//! blocks it gave with the caller and returns an error: the rest of the run is the next
//! tier's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header::HOST;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use larder_block_tree::{BadGroup, CV_LEN, GroupCheck, groups_in};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, timeout_at};

use crate::auth::{ClusterKey, RequestHead, header};
use crate::tls::Connector;
use crate::wire::{FRAME_HEADER_LEN, FrameHeader, Hello, RunRequest, hello_path};

/// Keepalives an owner may send while one block is on its way: with one a second, an owner
/// whose own origin fill takes longer than this is left for the next tier.
pub const MAX_KEEPALIVES: u32 = 60;

/// How often an owner waiting for a block tells its asker it is alive.
pub const KEEPALIVE_EVERY: Duration = Duration::from_secs(1);

/// Peers whose answer-head latency is kept, at most (the moving averages are dropped and
/// started again beyond it).
const HEADS_KEPT: usize = 4096;

/// The most bytes read of a hello or of an error's body.
const MAX_SMALL_BODY: usize = 4096;

/// Times a late peer's first-byte deadline is doubled, at most (the stall deadline caps it
/// anyway).
const MAX_BACKOFF_DOUBLINGS: u32 = 3;

/// One peer's answer-head latency, smoothed as RFC 6298 smooths round trips.
#[derive(Debug, Clone, Copy)]
struct HeadLatency {
    smoothed: Duration,
    deviation: Duration,
    /// Late answers since the last one in time: each doubles the deadline.
    backoff: u32,
}

impl HeadLatency {
    fn first(took: Duration) -> Self {
        Self {
            smoothed: took,
            deviation: took / 2,
            backoff: 0,
        }
    }

    fn answered(&mut self, took: Duration) {
        let gap = self.smoothed.abs_diff(took);
        self.deviation = (self.deviation * 3 + gap) / 4;
        self.smoothed = (self.smoothed * 7 + took) / 8;
        self.backoff = 0;
    }

    fn deadline(&self) -> Duration {
        (self.smoothed + self.deviation * 4) * (1 << self.backoff)
    }
}

/// Response header saying whether the owner had every block of the run before it answered.
pub const RUN_HIT_HEADER: &str = "x-larder-run";

/// Why a run or a hello could not be had from a peer; each maps to one result of the peer
/// request counters.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// No connection: refused, unreachable, or not within the first-byte deadline.
    #[error("cannot connect to {address}: {reason}")]
    Connect {
        /// The peer.
        address: String,
        /// Why.
        reason: String,
    },
    /// The answer did not start within the first-byte deadline, or stalled past the stall
    /// deadline.
    #[error("{0}")]
    Timeout(&'static str),
    /// The peer refused the request as unauthenticated (401), for the reason it gave.
    #[error("the peer refused the request as unauthenticated: {0}")]
    Unauthorized(String),
    /// A block's tag did not match: the answer was not made with the cluster key.
    #[error("block {0}: bad tag")]
    BadTag(u32),
    /// The peer has not the run and will not fill it, or refused it otherwise.
    #[error("the peer declined the request: {0}")]
    Declined(StatusCode),
    /// A block was out of order, of the wrong length, or its bytes failed the caller's check.
    #[error("block {index}: {reason}")]
    BadData {
        /// The block.
        index: u32,
        /// What was wrong.
        reason: String,
    },
    /// The connection failed or the answer ended before the run did.
    #[error("the answer broke off: {0}")]
    Broken(String),
}

/// A block's buffer, which [`Client::fetch_run`] fills as the block's bytes arrive.
pub trait BlockBuf: AsRef<[u8]> {
    /// An empty buffer with room for `len` bytes.
    fn with_room(len: usize) -> Self;
    /// Appends `bytes`.
    fn extend_from_slice(&mut self, bytes: &[u8]);
}

/// How a run was had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAnswer {
    /// The owner had every block cached when it answered (else it filled some).
    pub hit: bool,
}

/// Asks peers for runs.
#[derive(Debug, Clone)]
pub struct Client {
    key: Option<ClusterKey>,
    node: String,
    first_byte_timeout: Duration,
    stall_timeout: Duration,
    /// Bytes a second each block must at least come at (0: no floor).
    min_rate: u64,
    tls: Option<Connector>,
    /// Each peer's answer-head latency, by address.
    heads: Arc<Mutex<HashMap<String, HeadLatency>>>,
}

impl Client {
    /// A client for node `node`, signing with `key` (none: a cluster run without keys), with
    /// the deadlines of the module's doc: `min_rate` is the rate floor in bytes a second (0:
    /// none).
    pub fn new(
        key: Option<ClusterKey>,
        node: String,
        first_byte_timeout: Duration,
        stall_timeout: Duration,
        min_rate: u64,
    ) -> Self {
        Self {
            key,
            node,
            first_byte_timeout,
            stall_timeout,
            min_rate,
            tls: None,
            heads: Arc::default(),
        }
    }

    /// The first-byte deadline for the peer at `address`: what its recent answers call for
    /// (see the module's doc), at least the configured deadline, at most the stall deadline.
    fn first_byte_deadline(&self, address: &str) -> Duration {
        let wanted = self
            .heads
            .lock()
            .get(address)
            .map(HeadLatency::deadline)
            .unwrap_or_default();
        wanted.clamp(
            self.first_byte_timeout,
            self.stall_timeout.max(self.first_byte_timeout),
        )
    }

    /// The longest a frame of `len` bytes (plus its header) may take to arrive: the stall
    /// deadline, plus `len` at the rate floor. `None` without a floor.
    fn frame_time(&self, len: usize) -> Option<Duration> {
        (self.min_rate > 0).then(|| {
            let at_floor = Duration::from_secs_f64(len as f64 / self.min_rate as f64);
            self.stall_timeout.saturating_add(at_floor)
        })
    }

    /// Notes an answer head from `address` that took `took`.
    fn answered(&self, address: &str, took: Duration) {
        let mut heads = self.heads.lock();
        if heads.len() >= HEADS_KEPT && !heads.contains_key(address) {
            heads.clear();
        }
        match heads.get_mut(address) {
            Some(latency) => latency.answered(took),
            None => {
                heads.insert(address.to_owned(), HeadLatency::first(took));
            }
        }
    }

    /// Notes that `address` did not answer within its deadline.
    fn late(&self, address: &str) {
        if let Some(latency) = self.heads.lock().get_mut(address) {
            latency.backoff = (latency.backoff + 1).min(MAX_BACKOFF_DOUBLINGS);
        }
    }

    /// The same client, asking peers over TLS with `tls` (the handshake counts against the
    /// first-byte deadline).
    pub fn with_tls(self, tls: Connector) -> Self {
        Self {
            tls: Some(tls),
            ..self
        }
    }

    /// Fetches `request` from the peer at `address` (`HOST:PORT`), calling `on_block` with
    /// each block's header, its bytes in a buffer of type `B`, and their check, in order. Every
    /// group but the last is checked by then; `on_block` must finish the check
    /// ([`GroupCheck::finish`]) before using the bytes. Its error ends the fetch as
    /// [`PeerError::BadData`].
    pub async fn fetch_run<B: BlockBuf, E: std::fmt::Display>(
        &self,
        address: &str,
        to: &str,
        request: &RunRequest,
        mut on_block: impl FnMut(&FrameHeader, B, GroupCheck) -> Result<(), E>,
    ) -> Result<RunAnswer, PeerError> {
        let (response, nonce) = self.send(address, to, &request.path_and_query()).await?;
        let hit = response
            .headers()
            .get(RUN_HIT_HEADER)
            .is_some_and(|value| value == "hit");
        let mut answer = Answer {
            body: response.into_body(),
            pending: BytesMut::new(),
            deadline: Instant::now() + self.stall_timeout,
            stall: self.stall_timeout,
            frame_deadline: None,
        };
        let mut index = request.first;
        let mut waited = 0;
        while index < request.first + request.count {
            let want = request.block_len(index) as usize;
            answer.frame_deadline = self.frame_time(want).map(|time| Instant::now() + time);
            let bad = |reason: String| PeerError::BadData { index, reason };
            let mut head = [0; FRAME_HEADER_LEN];
            head.copy_from_slice(&answer.take(FRAME_HEADER_LEN).await?);
            let head = FrameHeader::decode(&head);
            if let Some(key) = &self.key
                && !key.block_tag_matches(&nonce, head.index, head.len, &head.hash, &head.tag)
            {
                return Err(PeerError::BadTag(head.index));
            }
            if head.is_keepalive() {
                // The owner is alive and still waiting for the block (its own origin is slow):
                // its bytes moved the stall deadline on, for a bounded number of times.
                waited += 1;
                if waited > MAX_KEEPALIVES {
                    return Err(PeerError::Timeout("the owner kept a block waiting too long"));
                }
                continue;
            }
            waited = 0;
            if head.index != index || head.len as usize != want {
                return Err(bad(format!(
                    "got block {} of {} bytes, expected {want} bytes",
                    head.index, head.len
                )));
            }
            let values = answer.take(groups_in(want) * CV_LEN).await?;
            let mut check = GroupCheck::new(&values, want, head.hash)
                .ok_or_else(|| bad("its group values do not merge to its hash".into()))?;
            let mut block = B::with_room(want);
            let check_so_far = |so_far: &[u8]| {
                let checked = check.update(so_far);
                checked.map_err(|BadGroup(group)| bad(format!("group {group} does not hash to its value")))
            };
            answer.fill(&mut block, want, check_so_far).await?;
            on_block(&head, block, check).map_err(|e| bad(e.to_string()))?;
            index += 1;
        }
        Ok(RunAnswer { hit })
    }

    /// Asks the peer at `address` who it is, telling it this node's rack (`rack`). `to` is the
    /// member expected there, empty when not known yet.
    pub async fn hello(&self, address: &str, to: &str, rack: &str) -> Result<Hello, PeerError> {
        let (response, _) = self.send(address, to, &hello_path(rack)).await?;
        let body = self
            .small_body(response, "no hello within the stall deadline")
            .await?;
        serde_json::from_slice(&body).map_err(|e| PeerError::Broken(format!("bad hello: {e}")))
    }

    /// The whole body of a short answer (a hello, an error), within the stall deadline.
    async fn small_body(&self, response: Response<Incoming>, late: &'static str) -> Result<Bytes, PeerError> {
        let body = http_body_util::Limited::new(response.into_body(), MAX_SMALL_BODY);
        Ok(timeout_at(Instant::now() + self.stall_timeout, body.collect())
            .await
            .map_err(|_| PeerError::Timeout(late))?
            .map_err(|e| PeerError::Broken(e.to_string()))?
            .to_bytes())
    }

    /// Sends a GET of `path_and_query` signed for member `to` and waits for a 200 answer's
    /// head, all within the first-byte deadline. Returns the answer and the request's nonce.
    async fn send(
        &self,
        address: &str,
        to: &str,
        path_and_query: &str,
    ) -> Result<(Response<Incoming>, [u8; 16]), PeerError> {
        let started = Instant::now();
        let deadline = started + self.first_byte_deadline(address);
        let connect = |reason: String| PeerError::Connect {
            address: address.to_owned(),
            reason,
        };
        let stream = timeout_at(deadline, tokio::net::TcpStream::connect(address))
            .await
            .map_err(|_| connect("no connection within the first-byte deadline".into()))?
            .map_err(|e| connect(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        let mut sender = match &self.tls {
            None => start_http(stream).await,
            Some(tls) => {
                let stream = timeout_at(deadline, tls.connect(stream))
                    .await
                    .map_err(|_| connect("no TLS handshake within the first-byte deadline".into()))?
                    .map_err(|e| connect(format!("TLS: {e}")))?;
                start_http(stream).await
            }
        }
        .map_err(|e| connect(e.to_string()))?;

        let nonce: [u8; 16] = rand::random();
        let time_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut builder = Request::get(path_and_query)
            .header(HOST, address)
            .header(header::NODE, &self.node)
            .header(header::TO, to)
            .header(header::TIME, time_ms.to_string())
            .header(header::NONCE, hex::encode(nonce));
        if let Some(key) = &self.key {
            let head = RequestHead {
                method: "GET",
                path_and_query,
                node: &self.node,
                to,
                time_ms,
                nonce,
            };
            builder = builder.header(header::MAC, hex::encode(key.request_mac(&head)));
        }
        let request = builder
            .body(Empty::<Bytes>::new())
            .map_err(|e| PeerError::Broken(e.to_string()))?;
        let response = timeout_at(deadline, sender.send_request(request))
            .await
            .map_err(|_| {
                self.late(address);
                PeerError::Timeout("no answer within the first-byte deadline")
            })?
            .map_err(|e| PeerError::Broken(e.to_string()))?;
        self.answered(address, started.elapsed());
        match response.status() {
            StatusCode::OK => Ok((response, nonce)),
            StatusCode::UNAUTHORIZED => {
                // The owner says why (another key, another clock, another member): the log
                // must name the one that is wrong.
                let body = self
                    .small_body(response, "no reason within the stall deadline")
                    .await?;
                let reason = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v["error"].as_str().map(str::to_owned))
                    .unwrap_or_else(|| "no reason given".to_owned());
                Err(PeerError::Unauthorized(reason))
            }
            status => Err(PeerError::Declined(status)),
        }
    }
}

/// Starts HTTP/1.1 on `io`, driving the connection on a task of its own.
async fn start_http<I>(io: I) -> hyper::Result<SendRequest<Empty<Bytes>>>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "peer connection ended");
        }
    });
    Ok(sender)
}

/// An answer's body as it is read: bytes come within the stall deadline of the last ones, and
/// the frame being read by its own deadline.
struct Answer {
    body: Incoming,
    /// Bytes received and not yet used.
    pending: BytesMut,
    deadline: Instant,
    stall: Duration,
    /// When the frame being read must have arrived whole (the rate floor), if there is one.
    frame_deadline: Option<Instant>,
}

impl Answer {
    /// The answer's next `len` bytes.
    async fn take(&mut self, len: usize) -> Result<BytesMut, PeerError> {
        while self.pending.len() < len {
            let data = self.next().await?;
            self.pending.extend_from_slice(&data);
        }
        Ok(self.pending.split_to(len))
    }

    /// Appends the answer's next bytes to `block` until it holds `len`, calling `check` with
    /// what it holds before each wait for more.
    async fn fill<B: BlockBuf>(
        &mut self,
        block: &mut B,
        len: usize,
        mut check: impl FnMut(&[u8]) -> Result<(), PeerError>,
    ) -> Result<(), PeerError> {
        let here = self.pending.len().min(len);
        block.extend_from_slice(&self.pending.split_to(here));
        while block.as_ref().len() < len {
            check(block.as_ref())?;
            let data = self.next().await?;
            let take = (len - block.as_ref().len()).min(data.len());
            block.extend_from_slice(&data[..take]);
            self.pending.extend_from_slice(&data[take..]);
        }
        Ok(())
    }

    /// The body's next bytes, waiting at most until the stall deadline, which then moves a
    /// stall deadline past now, or the frame's deadline, which does not move.
    async fn next(&mut self) -> Result<Bytes, PeerError> {
        loop {
            let (until, late) = match self.frame_deadline {
                Some(frame) if frame < self.deadline => {
                    (frame, "the block came slower than the rate floor (peer.min_rate)")
                }
                _ => (self.deadline, "the answer stalled past the stall deadline"),
            };
            let frame = timeout_at(until, self.body.frame())
                .await
                .map_err(|_| PeerError::Timeout(late))?;
            match frame {
                None => return Err(PeerError::Broken("the answer ended before the run did".into())),
                Some(Err(error)) => return Err(PeerError::Broken(error.to_string())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.deadline = Instant::now() + self.stall;
                        return Ok(data);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::wire::VersionTag;

    /// A peer on a loopback port that answers one run request with the head of its first
    /// block of `block` bytes (zeros), the block's first `sent` bytes, and then one byte every
    /// `every`, for ever: it never stalls, and never finishes.
    async fn trickling_peer(block: usize, sent: usize, every: Duration) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let mut byte = [0];
                stream.read_exact(&mut byte).await.unwrap();
                head.push(byte[0]);
            }
            let bytes = vec![0; block];
            let tree = larder_block_tree::Tree::of(&bytes);
            let frame = crate::server::frame(None, &[0; 16], 0, block as u32, tree.root);
            let start = [&frame.encode()[..], tree.groups.as_flattened(), &bytes[..sent]].concat();
            let chunk = |data: &[u8]| [format!("{:x}\r\n", data.len()).as_bytes(), data, b"\r\n"].concat();
            let answer = [
                &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"[..],
                &chunk(&start),
            ]
            .concat();
            stream.write_all(&answer).await.unwrap();
            loop {
                tokio::time::sleep(every).await;
                if stream.write_all(&chunk(&[0])).await.is_err() {
                    return;
                }
            }
        });
        address
    }

    /// A peer whose answer trickles (a byte every 100 ms, well within the stall deadline) is
    /// late once its block has taken the stall deadline plus its size at the rate floor; before
    /// the floor, every byte moved the stall deadline on and the fetch never ended.
    #[tokio::test]
    async fn a_peer_that_trickles_its_block_is_late_by_the_rate_floor() {
        let block = 64 << 10;
        let address = trickling_peer(block, 1000, Duration::from_millis(100)).await;
        let stall = Duration::from_millis(500);
        let client = Client::new(None, "n0".into(), Duration::from_millis(500), stall, 1 << 20);
        let request = RunRequest {
            object: [0; 32],
            source: "models".into(),
            key: "k".into(),
            version: VersionTag::Unversioned,
            size: 2 * block as u64,
            block_size: block as u64,
            first: 0,
            count: 2,
            relay: false,
        };
        let started = std::time::Instant::now();
        let fetch = client.fetch_run::<Vec<u8>, String>(&address, "n1", &request, |_, _, _| Ok(()));
        let result = tokio::time::timeout(Duration::from_secs(10), fetch).await;
        let took = started.elapsed();
        let Ok(result) = result else {
            panic!("a trickling peer still held the fetch after {took:?}");
        };
        assert!(
            matches!(result, Err(PeerError::Timeout(why)) if why.contains("rate floor")),
            "{result:?}"
        );
        eprintln!("the trickling peer was late after {took:?}");
    }

    impl BlockBuf for Vec<u8> {
        fn with_room(len: usize) -> Self {
            Vec::with_capacity(len)
        }

        fn extend_from_slice(&mut self, bytes: &[u8]) {
            Vec::extend_from_slice(self, bytes);
        }
    }

    #[test]
    fn the_first_byte_deadline_follows_a_peers_answers_within_bounds() {
        let (floor, stall) = (Duration::from_millis(500), Duration::from_secs(3));
        let client = Client::new(None, "n0".into(), floor, stall, 0);
        let ms = Duration::from_millis;
        // Nothing known, and steady fast answers: the configured deadline.
        assert_eq!(client.first_byte_deadline("a:1"), floor);
        for _ in 0..20 {
            client.answered("a:1", ms(5));
        }
        assert_eq!(client.first_byte_deadline("a:1"), floor);
        // Erratic answers stretch it, for that peer only: 4 times the deviation on top.
        for took in [300, 50, 400, 20, 350, 30, 380, 40] {
            client.answered("a:1", ms(took));
        }
        let stretched = client.first_byte_deadline("a:1");
        assert!(stretched > ms(600), "{stretched:?}");
        assert_eq!(client.first_byte_deadline("b:1"), floor);
        // A late answer doubles it, up to the stall deadline.
        client.late("a:1");
        assert_eq!(client.first_byte_deadline("a:1"), (stretched * 2).min(stall));
        for _ in 0..5 {
            client.late("a:1");
        }
        assert_eq!(client.first_byte_deadline("a:1"), stall);
        // Steady fast answers again: back down to the configured deadline.
        for _ in 0..60 {
            client.answered("a:1", ms(5));
        }
        assert_eq!(client.first_byte_deadline("a:1"), floor);
    }

    #[test]
    fn a_block_may_take_the_stall_deadline_plus_its_size_at_the_rate_floor() {
        let stall = Duration::from_secs(3);
        let floor = Client::new(None, "n0".into(), stall, stall, 1 << 20);
        assert_eq!(floor.frame_time(4 << 20), Some(stall + Duration::from_secs(4)));
        assert_eq!(floor.frame_time(0), Some(stall));
        // No floor: no deadline but the stall deadline (before, a floor of 0 panicked).
        let none = Client::new(None, "n0".into(), stall, stall, 0);
        assert_eq!(none.frame_time(4 << 20), None);
    }
}
