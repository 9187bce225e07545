//! A logging HTTP proxy on a loopback port, for servers that keep no request log of their own.

use std::net::SocketAddr;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::http::uri::{Authority, Scheme, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use tokio::task::JoinHandle;

use crate::server::serve_on_loopback;
use crate::{Bucket, ServedRequest};

/// Forwards every request to a bucket's server unchanged (the `Host` header too, so request
/// signatures still verify) and logs it. Stops when dropped.
#[derive(Debug)]
pub struct RecordingProxy {
    addr: SocketAddr,
    url: String,
    log: Arc<Mutex<Vec<ServedRequest>>>,
    accept: JoinHandle<()>,
}

impl RecordingProxy {
    /// Starts a proxy in front of `upstream`'s server.
    pub async fn start(upstream: &dyn Bucket) -> anyhow::Result<Self> {
        Self::with_delay(upstream, std::time::Duration::ZERO).await
    }

    /// Like [`RecordingProxy::start`], holding each request `delay` before forwarding it: a
    /// slow origin, so that tests can act while transfers are in flight.
    pub async fn with_delay(upstream: &dyn Bucket, delay: std::time::Duration) -> anyhow::Result<Self> {
        let authority: Authority = upstream
            .endpoint()
            .parse::<Uri>()?
            .authority()
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("{} has no host", upstream.endpoint()))?;
        let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new()).build_http();
        let log = Arc::new(Mutex::new(Vec::new()));
        let served = log.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            served.lock().push(ServedRequest::of(&request));
            let (mut parts, body) = request.into_parts();
            let mut uri = std::mem::take(&mut parts.uri).into_parts();
            uri.scheme = Some(Scheme::HTTP);
            uri.authority = Some(authority.clone());
            let forward = Uri::from_parts(uri).map(|uri| {
                parts.uri = uri;
                client.request(hyper::Request::from_parts(parts, body))
            });
            async move {
                tokio::time::sleep(delay).await;
                forward?.await.map_err(anyhow::Error::from)
            }
        });
        let (addr, accept) = serve_on_loopback(service).await?;
        Ok(Self {
            addr,
            url: upstream.url(),
            log,
            accept,
        })
    }

    /// Every request forwarded, in order.
    pub fn requests(&self) -> Vec<ServedRequest> {
        self.log.lock().clone()
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
