//! One HTTP/1 server for every listener of the daemon: the control socket and the metrics
//! endpoint today, the peer and registry ports next. [`serve`] runs an accept loop over a
//! [`Listener`] (TCP or Unix), hands each request to a service with its body read, and stops
//! gracefully when its [`CancellationToken`] is cancelled.
//!
//! The [`Limits`], and why they keep a listener answering whatever its clients do:
//! - At most `max_connections` connections, at most `max_per_client` from one client (a peer
//!   IP address over TCP; a Unix socket has one client), so file descriptors stay bounded
//!   (the daemon's own cache files must never run short of them).
//! - A connection is *idle* while it waits for a request head (a new connection, or one kept
//!   alive between requests). An idle connection is closed after `read_timeout` (hyper's header
//!   read timeout), and when a limit is reached, the oldest idle connection (of that client if
//!   the client is at its limit, else of anyone) is closed at once to make room (a new one
//!   that has sent no request yet only past `fresh_grace`); one that has
//!   answered a request only once `read_timeout` has passed since, as the last bytes of its
//!   answer may still be on their way to a slow reader when its body ends. Only when
//!   every connection in the way is busy with a request is a new connection refused: its
//!   request is answered `503` with `Retry-After` and the connection closed, by at most
//!   [`REFUSALS_PER_CONNECTION`] × `max_connections` such answers at once (past that, it is
//!   closed unanswered: descriptors stay bounded). Idle sockets
//!   therefore never keep a request out: a scrape that sends its request gets in.
//! - The request body is read whole, at most `max_body` bytes (else 413), within
//!   `read_timeout` (else 408), before the service sees the request.
//! - The service must produce its response within `request_deadline` (else 503); a service
//!   that panics is logged and answers 500, and the listener keeps serving.
//!
//! Errors the helper answers itself are JSON: `{"error": "..."}`.
//!
//! Stop: cancelling the token stops the accept loop and closes idle connections; requests in
//! flight get [`STOP_GRACE`] to finish, then their connections are dropped; [`serve`] returns
//! when every connection is gone.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{CONNECTION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long requests in flight may still take once the server is told to stop: a stop must
/// not wait for a long request (a prefetch being planned) to end.
pub const STOP_GRACE: Duration = Duration::from_secs(2);

/// The error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a response: whole or streamed.
pub type Body = BoxBody<Bytes, BoxError>;

/// The bounds a listener serves under (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one client.
    pub max_per_client: usize,
    /// Longest wait for a request head, and then for its body.
    pub read_timeout: Duration,
    /// Longest a service may take to answer one request.
    pub request_deadline: Duration,
    /// Largest request body accepted.
    pub max_body: usize,
    /// How long a new connection that has sent no request yet is kept from being closed to
    /// make room: zero where a client that holds connections open must never keep a request
    /// out (a scrape); a moment where clients send their request at once, so that under a flood
    /// each is answered (at worst told to retry) rather than closed with its request unread.
    pub fresh_grace: Duration,
}

/// Who a connection comes from, for the per-client limit; each request carries it in its
/// extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Client {
    /// A TCP peer, by IP address.
    Ip(IpAddr),
    /// Any process on this node's Unix socket.
    Local,
}

/// A socket that accepts connections.
pub trait Listener: Send + 'static {
    /// An accepted connection.
    type Io: Send + 'static;
    /// A connection ready for HTTP: the accepted one, or a TLS session over it.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// The next connection and who it is from.
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Io, Client)>> + Send;

    /// Readies an accepted connection for HTTP. It runs on the connection's own task, once
    /// the connection is admitted, within `read_timeout`: a client that stalls its TLS
    /// handshake holds one connection of its own, never the accept loop.
    fn handshake(&self, io: Self::Io) -> impl Future<Output = io::Result<Self::Stream>> + Send + 'static;
}

impl Listener for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    type Stream = tokio::net::TcpStream;

    async fn accept(&self) -> io::Result<(Self::Io, Client)> {
        let (stream, peer) = tokio::net::TcpListener::accept(self).await?;
        Ok((stream, Client::Ip(peer.ip())))
    }

    fn handshake(&self, io: Self::Io) -> impl Future<Output = io::Result<Self::Stream>> + Send + 'static {
        std::future::ready(Ok(io))
    }
}

impl Listener for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    type Stream = tokio::net::UnixStream;

    async fn accept(&self) -> io::Result<(Self::Io, Client)> {
        let (stream, _) = tokio::net::UnixListener::accept(self).await?;
        Ok((stream, Client::Local))
    }

    fn handshake(&self, io: Self::Io) -> impl Future<Output = io::Result<Self::Stream>> + Send + 'static {
        std::future::ready(Ok(io))
    }
}

/// A TCP listener whose connections speak TLS only.
pub struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("tcp", &self.tcp)
            .finish_non_exhaustive()
    }
}

impl TlsListener {
    /// Serves TLS with `acceptor` on `tcp`.
    pub fn new(tcp: tokio::net::TcpListener, acceptor: tokio_rustls::TlsAcceptor) -> Self {
        Self { tcp, acceptor }
    }
}

impl Listener for TlsListener {
    type Io = tokio::net::TcpStream;
    type Stream = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

    async fn accept(&self) -> io::Result<(Self::Io, Client)> {
        Listener::accept(&self.tcp).await
    }

    fn handshake(&self, io: Self::Io) -> impl Future<Output = io::Result<Self::Stream>> + Send + 'static {
        self.acceptor.accept(io)
    }
}

/// What answers requests: a request with its body read, to a response.
pub trait Service: Send + Sync + 'static {
    /// The response to `request`.
    fn call(&self, request: Request<Bytes>) -> impl Future<Output = Response<Body>> + Send;
}

impl<F, Fut> Service for F
where
    F: Fn(Request<Bytes>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send,
{
    fn call(&self, request: Request<Bytes>) -> impl Future<Output = Response<Body>> + Send {
        self(request)
    }
}

/// A response with a whole body.
pub fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let body = Full::new(body.into()).map_err(|never| match never {}).boxed();
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A JSON error answer: `{"error": message}`.
pub fn error(status: StatusCode, message: &str) -> Response<Body> {
    let body = serde_json::json!({ "error": message }).to_string();
    full(status, "application/json", body)
}

/// A streamed body: the chunks an answering task sends, until it drops its sender. A task
/// that stops before the `Content-Length` it announced cuts the answer short, and the client
/// sees the connection fail rather than a complete body.
pub fn channel_body(chunks: tokio::sync::mpsc::Receiver<Bytes>) -> Body {
    ChannelBody(chunks).boxed()
}

struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        self.0
            .poll_recv(cx)
            .map(|bytes| bytes.map(|bytes| Ok(hyper::body::Frame::data(bytes))))
    }
}

/// Serves `service` on `listener` under `limits` until `cancel` is cancelled and the
/// connections still open have finished. A failed connection is logged at debug and dropped;
/// nothing here stops the daemon.
pub async fn serve<L: Listener, S: Service>(
    listener: L,
    service: S,
    limits: Limits,
    cancel: CancellationToken,
) {
    let service = Arc::new(service);
    let connections = Arc::new(Mutex::new(Connections::default()));
    let refusing = Arc::new(AtomicUsize::new(0));
    let tracker = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (io, client) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Usually out of file descriptors: wait rather than spin.
                tracing::warn!(%error, "accept failed");
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                }
            }
        };
        let Some(admitted) = connections.lock().admit(client, &limits) else {
            tracing::debug!(
                ?client,
                "connection refused: every connection is busy with a request"
            );
            let most = REFUSALS_PER_CONNECTION * limits.max_connections;
            if let Some(refusal) = Refusal::new(&refusing, most) {
                tracker.spawn(refuse(listener.handshake(io), limits, refusal));
            }
            continue;
        };
        let (service, connections, cancel) = (service.clone(), connections.clone(), cancel.clone());
        let handshake = listener.handshake(io);
        tracker.spawn(async move {
            // Gives the connection's room back however it ends, a panic included.
            let _registered = Registered {
                connections,
                id: admitted.id,
            };
            let io = tokio::select! {
                io = tokio::time::timeout(limits.read_timeout, handshake) => match io {
                    Ok(Ok(io)) => io,
                    Ok(Err(error)) => {
                        tracing::debug!(?client, %error, "handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(?client, "no handshake within the read timeout");
                        return;
                    }
                },
                () = admitted.evict.cancelled() => return,
                () = cancel.cancelled() => return,
            };
            connection(io, client, service, limits, admitted, cancel).await;
        });
    }
    tracker.close();
    tracker.wait().await;
}

/// Refusals (`503` answers to connections over the limits) under way at once, per connection
/// allowed: each holds a descriptor for the moments it takes to read a request head and answer.
pub const REFUSALS_PER_CONNECTION: usize = 4;

/// Seconds a refused client is told to wait before it tries again.
const RETRY_AFTER_SECONDS: &str = "1";

/// One of the refusals under way, counted while it lives.
struct Refusal(Arc<AtomicUsize>);

impl Refusal {
    /// A refusal, if fewer than `most` are under way.
    fn new(under_way: &Arc<AtomicUsize>, most: usize) -> Option<Self> {
        let now = under_way.fetch_add(1, Ordering::Relaxed);
        let refusal = Self(under_way.clone());
        (now < most).then_some(refusal)
    }
}

impl Drop for Refusal {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Answers the request of a connection over the limits `503` with `Retry-After`, then closes
/// it: the client learns to come back rather than seeing its connection dropped.
async fn refuse<I>(handshake: impl Future<Output = io::Result<I>>, limits: Limits, _refusal: Refusal)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Ok(Ok(io)) = tokio::time::timeout(limits.read_timeout, handshake).await else {
        return;
    };
    let service = hyper::service::service_fn(|_: Request<Incoming>| async {
        let mut refused = error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many connections at once: try again shortly",
        );
        let headers = refused.headers_mut();
        headers.insert(RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECONDS));
        headers.insert(CONNECTION, HeaderValue::from_static("close"));
        Ok::<_, Infallible>(refused)
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout)
        .keep_alive(false)
        .serve_connection(TokioIo::new(io), service);
    let _ = tokio::time::timeout(limits.read_timeout * 2, connection).await;
}

/// One connection, until it ends, is evicted, or the server stops.
async fn connection<I, S>(
    io: I,
    client: Client,
    service: Arc<S>,
    limits: Limits,
    admitted: Admitted,
    cancel: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Service,
{
    let Admitted { idle, evict, .. } = admitted;
    let hyper_service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        let (service, idle) = (service.clone(), idle.clone());
        request.extensions_mut().insert(client);
        async move {
            // Busy until the body has been sent: a streamed answer is not an idle connection.
            let Some(busy) = Busy::new(idle) else {
                // Closed to make room just as this request arrived: it is refused.
                let refused = error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the connection was closed to make room",
                );
                return Ok::<_, Infallible>(refused);
            };
            let response = answer(request, service.as_ref(), &limits).await;
            Ok::<_, Infallible>(response.map(|body| BusyBody { body, _busy: busy }.boxed()))
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout)
        .serve_connection(TokioIo::new(io), hyper_service);
    tokio::pin!(connection);
    let result = tokio::select! {
        // An evicted connection is not polled again: nothing more of it goes out.
        biased;
        () = evict.cancelled() => {
            tracing::debug!("closed an idle connection to make room");
            return;
        }
        result = connection.as_mut() => result,
        () = cancel.cancelled() => {
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                result = tokio::time::timeout(STOP_GRACE, connection.as_mut()) => {
                    result.unwrap_or(Ok(()))
                }
                () = evict.cancelled() => return,
            }
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, "connection failed");
    }
}

/// Reads the body of `request` under the limits and asks the service for the answer.
async fn answer<S: Service>(request: Request<Incoming>, service: &S, limits: &Limits) -> Response<Body> {
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(limits.read_timeout, Limited::new(body, limits.max_body).collect()).await;
    let body = match read {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<LengthLimitError>() => {
            let message = format!("the body is over {} bytes", limits.max_body);
            return error(StatusCode::PAYLOAD_TOO_LARGE, &message);
        }
        Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, &format!("reading the body: {e}")),
        Err(_) => {
            let message = format!("the body did not arrive within {:?}", limits.read_timeout);
            return error(StatusCode::REQUEST_TIMEOUT, &message);
        }
    };
    let deadline = limits.request_deadline;
    let call = AssertUnwindSafe(service.call(Request::from_parts(parts, body))).catch_unwind();
    match tokio::time::timeout(deadline, call).await {
        Ok(Ok(response)) => response,
        Ok(Err(_)) => {
            // The panic's message was printed by the panic hook.
            tracing::error!("a request handler panicked");
            error(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
        }
        Err(_) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("no answer within {deadline:?}"),
        ),
    }
}

/// Whether a connection may be closed to make room: a fresh one (no request yet) once it is
/// `fresh_grace` old, a busy one never, one that has answered once `read_timeout` has passed
/// (its answer's last bytes may still be in its buffer when the body ends).
#[derive(Debug)]
struct Idle {
    /// [`Idle::FRESH`], [`Idle::BUSY`], or 1 + the milliseconds since `epoch` at which its
    /// last answer's body ended.
    state: AtomicU64,
    epoch: Instant,
}

impl Idle {
    const FRESH: u64 = 0;
    const BUSY: u64 = u64::MAX;
    const EVICTED: u64 = u64::MAX - 1;

    fn new() -> Arc<Self> {
        Arc::new(Self {
            state: AtomicU64::new(Self::FRESH),
            epoch: Instant::now(),
        })
    }

    fn now(&self) -> u64 {
        1 + self.epoch.elapsed().as_millis() as u64
    }

    /// Marks it busy; false if it was closed to make room first.
    fn busy(&self) -> bool {
        let before = self.state.swap(Self::BUSY, Ordering::AcqRel);
        if before == Self::EVICTED {
            self.state.store(Self::EVICTED, Ordering::Release);
            return false;
        }
        true
    }

    /// Marks it closed to make room, if it may be closed: in one step, so that a request
    /// arriving at the same moment either finds it closed or keeps it.
    fn evict(&self, limits: &Limits) -> bool {
        let mut state = self.state.load(Ordering::Acquire);
        while self.evictable_in(state, limits) {
            match self
                .state
                .compare_exchange(state, Self::EVICTED, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(now) => state = now,
            }
        }
        false
    }

    fn answered(&self) {
        let now = self.now();
        // Not over an eviction.
        let _ = self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |state| {
                (state != Self::EVICTED).then_some(now)
            });
    }

    fn evictable_in(&self, state: u64, limits: &Limits) -> bool {
        match state {
            Self::FRESH => self.epoch.elapsed() >= limits.fresh_grace,
            Self::BUSY | Self::EVICTED => false,
            since => self.now().saturating_sub(since) >= limits.read_timeout.as_millis() as u64,
        }
    }
}

/// Marks a connection busy while a request is being answered; answered when dropped.
struct Busy(Arc<Idle>);

impl Busy {
    /// `None` if the connection was closed to make room first.
    fn new(idle: Arc<Idle>) -> Option<Self> {
        idle.busy().then(|| Self(idle))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.answered();
    }
}

/// A response body that keeps its connection marked busy until it is sent or dropped.
struct BusyBody {
    body: Body,
    _busy: Busy,
}

impl hyper::body::Body for BusyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Removes a connection from its listener's [`Connections`] when dropped.
struct Registered {
    connections: Arc<Mutex<Connections>>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.connections.lock().remove(self.id);
    }
}

/// A connection let in.
struct Admitted {
    id: u64,
    /// Whether the connection may be closed to make room.
    idle: Arc<Idle>,
    /// Cancelled when the connection is closed to make room.
    evict: CancellationToken,
}

/// The open connections of one listener, oldest first.
#[derive(Default)]
struct Connections {
    next: u64,
    open: BTreeMap<u64, Open>,
    per_client: HashMap<Client, usize>,
}

struct Open {
    client: Client,
    idle: Arc<Idle>,
    evict: CancellationToken,
}

impl Connections {
    /// Makes room for a connection from `client` by evicting idle ones where a limit is
    /// reached, and registers it; `None` when the connections in the way are all busy.
    fn admit(&mut self, client: Client, limits: &Limits) -> Option<Admitted> {
        let from_client = self.per_client.get(&client).copied().unwrap_or(0);
        if from_client >= limits.max_per_client && !self.evict_idle(Some(client), limits) {
            return None;
        }
        if self.open.len() >= limits.max_connections && !self.evict_idle(None, limits) {
            return None;
        }
        let id = self.next;
        self.next += 1;
        let idle = Idle::new();
        let evict = CancellationToken::new();
        self.open.insert(
            id,
            Open {
                client,
                idle: idle.clone(),
                evict: evict.clone(),
            },
        );
        *self.per_client.entry(client).or_default() += 1;
        Some(Admitted { id, idle, evict })
    }

    /// Closes the oldest idle connection (of `client`, if given) that `limits` let go; false
    /// if there is none.
    fn evict_idle(&mut self, client: Option<Client>, limits: &Limits) -> bool {
        let victim = self
            .open
            .iter()
            .find(|(_, open)| client.is_none_or(|c| c == open.client) && open.idle.evict(limits))
            .map(|(&id, _)| id);
        let Some(open) = victim.and_then(|id| self.remove(id)) else {
            return false;
        };
        open.evict.cancel();
        true
    }

    /// Forgets connection `id` (closed, or evicted).
    fn remove(&mut self, id: u64) -> Option<Open> {
        let open = self.open.remove(&id)?;
        if let Some(count) = self.per_client.get_mut(&open.client) {
            *count -= 1;
            if *count == 0 {
                self.per_client.remove(&open.client);
            }
        }
        Some(open)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_connections: 3,
        max_per_client: 2,
        read_timeout: Duration::from_secs(2),
        request_deadline: Duration::from_secs(10),
        max_body: 16,
        fresh_grace: Duration::ZERO,
    };

    /// A service that echoes the length of the body, sleeps on `/slow`, panics on `/panic`.
    async fn echo(request: Request<Bytes>) -> Response<Body> {
        match request.uri().path() {
            "/slow" => tokio::time::sleep(Duration::from_secs(60)).await,
            "/panic" => panic!("a handler bug"),
            _ => {}
        }
        full(StatusCode::OK, "text/plain", request.body().len().to_string())
    }

    /// Serves `echo` on a loopback port: its URL, the token that stops it and its task.
    async fn start(limits: Limits) -> (String, CancellationToken, tokio::task::JoinHandle<()>) {
        start_with(limits, echo).await
    }

    /// Serves `service` on a loopback port, as [`start`] does.
    async fn start_with(
        limits: Limits,
        service: impl Service,
    ) -> (String, CancellationToken, tokio::task::JoinHandle<()>) {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let cancel = CancellationToken::new();
        let server = tokio::spawn(serve(listener, service, limits, cancel.clone()));
        (url, cancel, server)
    }

    #[tokio::test]
    async fn bodies_and_answers_are_bounded() {
        let limits = Limits {
            request_deadline: Duration::from_secs(1),
            ..LIMITS
        };
        let (url, _cancel, _server) = start(limits).await;
        let client = reqwest::Client::new();
        let post = |body: &'static str| client.post(format!("{url}/")).body(body).send();
        let answer = post("0123456789").await.unwrap();
        assert_eq!(answer.status(), 200);
        assert_eq!(answer.text().await.unwrap(), "10");
        assert_eq!(post("0123456789abcdefg").await.unwrap().status(), 413);
        let started = std::time::Instant::now();
        let slow = client.get(format!("{url}/slow")).send().await.unwrap();
        assert_eq!(slow.status(), 503);
        assert!(started.elapsed() < Duration::from_secs(3));
        let panicked = client.get(format!("{url}/panic")).send().await.unwrap();
        assert_eq!(panicked.status(), 500);
        assert_eq!(post("after").await.unwrap().status(), 200);
    }

    /// With every connection busy with a request, one more is answered 503 with Retry-After,
    /// not closed unanswered; and once the busy ones end, requests get in again.
    #[tokio::test]
    async fn a_connection_over_the_limit_is_told_to_retry() {
        let (entered, mut handling) = tokio::sync::mpsc::unbounded_channel();
        let release = Arc::new(tokio::sync::Notify::new());
        let waiting = release.clone();
        let service = move |request: Request<Bytes>| {
            let (entered, waiting) = (entered.clone(), waiting.clone());
            async move {
                if request.uri().path() == "/hold" {
                    let _ = entered.send(());
                    waiting.notified().await;
                }
                full(StatusCode::OK, "text/plain", "done")
            }
        };
        let (url, _cancel, _server) = start_with(LIMITS, service).await;
        // Held requests fill the connections this client (127.0.0.1) may have.
        let held: Vec<_> = (0..LIMITS.max_per_client)
            .map(|_| tokio::spawn(reqwest::get(format!("{url}/hold"))))
            .collect();
        for _ in 0..LIMITS.max_per_client {
            handling.recv().await.unwrap();
        }
        let refused = reqwest::get(format!("{url}/"))
            .await
            .expect("an answer, not a closed connection");
        assert_eq!(refused.status(), 503);
        assert_eq!(refused.headers()[RETRY_AFTER], RETRY_AFTER_SECONDS);
        release.notify_waiters();
        for request in held {
            assert_eq!(request.await.unwrap().unwrap().status(), 200);
        }
        assert_eq!(reqwest::get(format!("{url}/")).await.unwrap().status(), 200);
    }

    #[tokio::test]
    async fn a_stop_ends_idle_connections_and_requests_in_flight_within_the_grace() {
        // Echo, saying when a request reaches the handler.
        let (entered, mut handling) = tokio::sync::mpsc::unbounded_channel();
        let service = move |request: Request<Bytes>| {
            let _ = entered.send(());
            echo(request)
        };
        let (url, cancel, server) = start_with(LIMITS, service).await;
        let client = reqwest::Client::new();
        let _idle = tokio::net::TcpStream::connect(url.trim_start_matches("http://"))
            .await
            .unwrap();
        let in_flight = tokio::spawn(client.get(format!("{url}/slow")).send());
        handling.recv().await.expect("the request reached its handler");
        let started = std::time::Instant::now();
        cancel.cancel();
        server.await.unwrap();
        assert!(started.elapsed() < STOP_GRACE + Duration::from_secs(1));
        assert!(
            in_flight.await.unwrap().is_err(),
            "the request in flight was not cut"
        );
        assert!(
            client.get(format!("{url}/")).send().await.is_err(),
            "still listening"
        );
    }

    fn ip(last: u8) -> Client {
        Client::Ip(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn a_client_at_its_limit_makes_room_by_closing_its_oldest_idle_connection() {
        let mut connections = Connections::default();
        let first = connections.admit(ip(1), &LIMITS).unwrap();
        let second = connections.admit(ip(1), &LIMITS).unwrap();
        let other = connections.admit(ip(2), &LIMITS).unwrap();
        let third = connections.admit(ip(1), &LIMITS).unwrap();
        assert!(
            first.evict.is_cancelled(),
            "the oldest idle one of that client goes"
        );
        // A request arriving on it now finds it closed, and is refused rather than cut.
        assert!(!first.idle.busy());
        assert!(!second.evict.is_cancelled() && !other.evict.is_cancelled());
        assert_eq!(connections.open.len(), 3);
        assert_eq!(connections.per_client[&ip(1)], 2);

        // Busy connections are never closed: with all of a client's busy, it is refused.
        second.idle.busy();
        third.idle.busy();
        assert!(connections.admit(ip(1), &LIMITS).is_none());
        // Another client takes the room of the oldest idle connection of anyone.
        let fourth = connections.admit(ip(3), &LIMITS).unwrap();
        assert!(other.evict.is_cancelled());
        other.idle.busy();
        fourth.idle.busy();
        assert!(connections.admit(ip(4), &LIMITS).is_none(), "all busy");

        // Just answered: its answer may not have left yet, so it is not closed for room.
        fourth.idle.answered();
        assert!(!fourth.idle.evict(&LIMITS));
        assert!(
            connections.admit(ip(4), &LIMITS).is_none(),
            "an answer just sent was cut"
        );

        // A closed connection gives its room back once.
        connections.remove(second.id);
        connections.remove(second.id);
        assert_eq!(connections.per_client[&ip(1)], 1);
        assert!(connections.admit(ip(4), &LIMITS).is_some());
        assert_eq!(connections.open.len(), 3);

        // Where new connections have a grace, one that has sent nothing yet keeps its room
        // for it (its request may be on the way), then goes like any idle one.
        let patient = Limits {
            fresh_grace: Duration::from_secs(3600),
            ..LIMITS
        };
        let mut connections = Connections::default();
        let new = connections.admit(ip(1), &patient).unwrap();
        assert!(!new.idle.evict(&patient));
        assert!(new.idle.evict(&LIMITS));
    }
}
