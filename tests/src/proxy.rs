//! A logging HTTP fault proxy on a loopback port: in front of a server that keeps no request log
//! of its own, or between a daemon process and its origin to inject faults at run time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::{Frame, Incoming};
use hyper::http::uri::{Authority, Scheme, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::server::serve_on_loopback;
use crate::{Bucket, ServedRequest};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every request forwarded, with the body bytes of its response sent so far and whether its
/// answer has ended.
type RequestLog = Arc<Mutex<Vec<(ServedRequest, Arc<AtomicU64>, Arc<AtomicBool>)>>>;

/// What the proxy does to the traffic it forwards; switched at run time with
/// [`RecordingProxy::set_fault`]. Body faults are applied chunk by chunk as the body passes, so
/// a switch also reaches responses already under way, from their next chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything unchanged.
    PassThrough,
    /// Hold each request this long before forwarding it.
    Latency(Duration),
    /// Response bodies leave the proxy at most this many bytes a second, all responses together
    /// (one shared link).
    Bandwidth(u64),
    /// Pass each response's first `after` body bytes, then trickle the rest at `per_second`
    /// bytes a second in pieces of a tenth of that (at least a byte): the answer never stalls
    /// for long, and never ends in any useful time.
    Trickle {
        /// Body bytes of each response passed at once.
        after: u64,
        /// The rate after them.
        per_second: u64,
    },
    /// Send response headers, then no byte of the body until the fault is switched to another
    /// (forever, if it never is).
    StallAfterHeaders,
    /// Cut each response's connection after this many bytes of its body: the client gets a
    /// body that ends early on a dead connection.
    ResetAfter(u64),
    /// Flip the bits of the body byte at this offset of each response (no byte flipped in a
    /// body shorter than that).
    FlipByte(u64),
    /// Answer nothing: close each connection as a request arrives on it, as a server that is
    /// down looks to a client that still reaches its port.
    CloseConnections,
    /// Answer each ranged GET (an object read; listings and HEADs pass) with this status and
    /// an S3 error body, as a store refusing the request would.
    RefuseReads(u16),
    /// Answer each HEAD with its `Content-Length` this many bytes larger: an upstream that
    /// claims a wrong size.
    HeadLengthPlus(u64),
}

/// Forwards every request to a bucket's server (or any HTTP server) unchanged (the `Host`
/// header too, so request signatures still verify), logs it, counts the body bytes it returns
/// and applies the current [`Fault`]. Stops when dropped (a stalled body then ends with an
/// error).
#[derive(Debug)]
pub struct RecordingProxy {
    addr: SocketAddr,
    url: String,
    log: RequestLog,
    fault: watch::Sender<Fault>,
    body_bytes: Arc<AtomicU64>,
    /// Bodies held by [`Fault::StallAfterHeaders`] now.
    held: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl RecordingProxy {
    /// Starts a pass-through proxy in front of `upstream`'s server.
    pub async fn start(upstream: &dyn Bucket) -> anyhow::Result<Self> {
        let authority: Authority = upstream
            .endpoint()
            .parse::<Uri>()?
            .authority()
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("{} has no host", upstream.endpoint()))?;
        Self::start_with(authority, Some(upstream.url())).await
    }

    /// Starts a pass-through proxy in front of the HTTP server at `upstream` (`host:port`),
    /// one that is no bucket, such as an OCI registry. Its [`Bucket::url`] is then its own
    /// endpoint.
    pub async fn start_to(upstream: &str) -> anyhow::Result<Self> {
        Self::start_with(upstream.parse()?, None).await
    }

    /// Starts the proxy in front of the server at `authority`; `url` is what
    /// [`Bucket::url`] answers (the proxy's endpoint if `None`).
    async fn start_with(authority: Authority, url: Option<String>) -> anyhow::Result<Self> {
        let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new()).build_http();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (fault, _) = watch::channel(Fault::PassThrough);
        let body_bytes = Arc::new(AtomicU64::new(0));
        let link = Arc::new(Mutex::new(Instant::now()));
        let held = Arc::new(AtomicU64::new(0));
        let (served, faults, counted, holding) =
            (log.clone(), fault.clone(), body_bytes.clone(), held.clone());
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let is_ranged_get = request.method() == hyper::Method::GET
                && request.headers().contains_key(hyper::header::RANGE);
            let is_head = request.method() == hyper::Method::HEAD;
            let sent = Arc::new(AtomicU64::new(0));
            let ended = Arc::new(AtomicBool::new(false));
            served
                .lock()
                .push((ServedRequest::of(&request), sent.clone(), ended.clone()));
            let (mut parts, body) = request.into_parts();
            let mut uri = std::mem::take(&mut parts.uri).into_parts();
            uri.scheme = Some(Scheme::HTTP);
            uri.authority = Some(authority.clone());
            let forward = Uri::from_parts(uri).map(|uri| {
                parts.uri = uri;
                client.request(hyper::Request::from_parts(parts, body))
            });
            let body = FaultyBody {
                faults: faults.subscribe(),
                link: link.clone(),
                counted: counted.clone(),
                held: holding.clone(),
                sent,
                ended,
                cut: false,
                rest: Bytes::new(),
            };
            async move {
                let fault = *body.faults.borrow();
                match fault {
                    Fault::Latency(delay) => tokio::time::sleep(delay).await,
                    // An error from the service makes hyper close the connection unanswered.
                    Fault::CloseConnections => anyhow::bail!("the fault proxy closes the connection"),
                    Fault::RefuseReads(status) if is_ranged_get => return refusal(status),
                    _ => {}
                }
                let mut response = forward?.await.map_err(anyhow::Error::from)?;
                if let Fault::HeadLengthPlus(more) = fault
                    && is_head
                {
                    let length = response.headers().get(hyper::header::CONTENT_LENGTH);
                    let length = length.and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                    if let Some(length) = length {
                        response
                            .headers_mut()
                            .insert(hyper::header::CONTENT_LENGTH, (length + more).into());
                    }
                }
                Ok::<_, anyhow::Error>(response.map(|upstream| body.wrap(upstream)))
            }
        });
        let (addr, accept) = serve_on_loopback(service).await?;
        Ok(Self {
            addr,
            url: url.unwrap_or_else(|| format!("http://{addr}")),
            log,
            fault,
            body_bytes,
            held,
            accept,
        })
    }

    /// Like [`RecordingProxy::start`], with [`Fault::Latency`] of `delay`: a slow origin, so
    /// that tests can act while transfers are in flight.
    pub async fn with_delay(upstream: &dyn Bucket, delay: Duration) -> anyhow::Result<Self> {
        let proxy = Self::start(upstream).await?;
        proxy.set_fault(Fault::Latency(delay));
        Ok(proxy)
    }

    /// Switches what the proxy does from now on.
    pub fn set_fault(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Every request forwarded, in order.
    pub fn requests(&self) -> Vec<ServedRequest> {
        self.log
            .lock()
            .iter()
            .map(|(request, ..)| request.clone())
            .collect()
    }

    /// Response bodies [`Fault::StallAfterHeaders`] holds now: their headers were sent.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Bytes of response bodies sent to clients so far.
    pub fn body_bytes(&self) -> u64 {
        self.body_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of the response bodies sent so far to the requests that `pick` chooses, such as
    /// the GETs of one object or of an OCI registry's blobs.
    pub fn body_bytes_of(&self, pick: impl Fn(&ServedRequest) -> bool) -> u64 {
        self.log
            .lock()
            .iter()
            .filter(|(request, ..)| pick(request))
            .map(|(_, sent, _)| sent.load(Ordering::Relaxed))
            .sum()
    }

    /// How many of the requests that `pick` chooses are still under way: arrived, and their
    /// answer not yet sent to its end nor dropped (a client that went, a cut connection).
    pub fn open_of(&self, pick: impl Fn(&ServedRequest) -> bool) -> usize {
        self.log
            .lock()
            .iter()
            .filter(|(request, _, ended)| pick(request) && !ended.load(Ordering::Relaxed))
            .count()
    }
}

/// An S3 error answer with `status` (`InvalidRequest` for a 400, else `InternalError`).
fn refusal(status: u16) -> anyhow::Result<hyper::Response<UnsyncBoxBody<Bytes, BoxError>>> {
    let code = if status == 400 {
        "InvalidRequest"
    } else {
        "InternalError"
    };
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
         <Message>refused by the fault proxy</Message></Error>"
    );
    let body = http_body_util::Full::new(Bytes::from(body))
        .map_err(|never| match never {})
        .boxed_unsync();
    Ok(hyper::Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "application/xml")
        .body(body)?)
}

/// One response body on its way through the proxy.
struct FaultyBody {
    faults: watch::Receiver<Fault>,
    /// When the shared link is free again, for [`Fault::Bandwidth`].
    link: Arc<Mutex<Instant>>,
    counted: Arc<AtomicU64>,
    /// Bodies held now, all responses together.
    held: Arc<AtomicU64>,
    /// Body bytes of this response sent so far (shared with the request log).
    sent: Arc<AtomicU64>,
    /// Set when this is dropped: the answer has ended, one way or another (shared with the
    /// request log).
    ended: Arc<AtomicBool>,
    /// [`Fault::ResetAfter`] was reached: the connection is cut before the next chunk.
    cut: bool,
    /// Bytes of the last chunk [`Fault::Trickle`] holds back, passed before the next chunk.
    rest: Bytes,
}

impl FaultyBody {
    fn wrap(self, upstream: Incoming) -> UnsyncBoxBody<Bytes, BoxError> {
        let frames = futures::stream::unfold(Some((self, upstream)), |state| async move {
            let (mut body, mut upstream) = state?;
            if body.cut {
                let error = format!(
                    "connection cut by the fault proxy after {} body bytes",
                    body.sent.load(Ordering::Relaxed)
                );
                return Some((Err(error.into()), None));
            }
            if !body.rest.is_empty() {
                let rest = std::mem::take(&mut body.rest);
                return match body.pass(rest).await {
                    Ok(data) => Some((Ok(Frame::data(data)), Some((body, upstream)))),
                    Err(error) => Some((Err(error), None)),
                };
            }
            let frame = match upstream.frame().await? {
                Ok(frame) => frame,
                Err(error) => return Some((Err(error.into()), None)),
            };
            match frame.into_data() {
                Ok(data) => match body.pass(data).await {
                    Ok(data) => Some((Ok(Frame::data(data)), Some((body, upstream)))),
                    // The error aborts the connection; end the stream after it.
                    Err(error) => Some((Err(error), None)),
                },
                Err(trailers) => Some((Ok(trailers), Some((body, upstream)))),
            }
        });
        http_body_util::StreamBody::new(frames).boxed_unsync()
    }

    /// Applies the current fault to the next chunk of the body.
    async fn pass(&mut self, mut data: Bytes) -> Result<Bytes, BoxError> {
        let stalled = *self.faults.borrow() == Fault::StallAfterHeaders;
        if stalled {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
        let fault = self
            .faults
            .wait_for(|fault| *fault != Fault::StallAfterHeaders)
            .await
            .map(|fault| *fault);
        if stalled {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
        let fault = fault.map_err(|_| "the proxy stopped while the body was stalled")?;
        let start = self.sent.load(Ordering::Relaxed);
        let end = start + data.len() as u64;
        match fault {
            Fault::Bandwidth(per_second) => {
                let busy = Duration::from_secs_f64(data.len() as f64 / per_second.max(1) as f64);
                let free_at = {
                    let mut link = self.link.lock();
                    *link = (*link).max(Instant::now()) + busy;
                    *link
                };
                tokio::time::sleep_until(free_at).await;
            }
            Fault::Trickle { after, per_second } if end > after => {
                let piece = (per_second / 10).max(1);
                let now = if start < after { after - start } else { piece };
                self.rest = data.split_off((now as usize).min(data.len()));
                if start >= after {
                    tokio::time::sleep(Duration::from_secs_f64(piece as f64 / per_second.max(1) as f64))
                        .await;
                }
            }
            Fault::ResetAfter(at) if end > at => {
                data.truncate(at.saturating_sub(start) as usize);
                self.cut = true;
            }
            Fault::FlipByte(at) if (start..end).contains(&at) => {
                let mut flipped = data.to_vec();
                flipped[(at - start) as usize] ^= 0xff;
                data = Bytes::from(flipped);
            }
            _ => {}
        }
        self.sent.store(start + data.len() as u64, Ordering::Relaxed);
        self.counted.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(data)
    }
}

impl Drop for FaultyBody {
    fn drop(&mut self) {
        self.ended.store(true, Ordering::Relaxed);
    }
}

impl Bucket for RecordingProxy {
    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn url(&self) -> String {
        self.url.clone()
    }
}

impl Drop for RecordingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
