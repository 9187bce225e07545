//! An in-process S3 server (s3s-fs) on a loopback port.

use std::net::SocketAddr;
use std::sync::Arc;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{BackoffConfig, ObjectStoreExt, PutPayload, RetryConfig};
use parking_lot::Mutex;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Access key of the test and benchmark S3 servers.
pub const ACCESS_KEY: &str = "larder-test-access";
/// Secret key of the test and benchmark S3 servers.
pub const SECRET_KEY: &str = "larder-test-secret-key";

/// Serves `service` over HTTP on `127.0.0.1:<random port>` until the returned task is aborted.
pub(crate) async fn serve_on_loopback<S, B>(service: S) -> anyhow::Result<(SocketAddr, JoinHandle<()>)>
where
    S: hyper::service::Service<hyper::Request<hyper::body::Incoming>, Response = hyper::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let accept = tokio::spawn(async move {
        let http = ConnBuilder::new(TokioExecutor::new());
        while let Ok((socket, _)) = listener.accept().await {
            let conn = http
                .serve_connection(TokioIo::new(socket), service.clone())
                .into_owned();
            tokio::spawn(async move {
                let _ = conn.await;
            });
        }
    });
    Ok((addr, accept))
}

/// One request as the server saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedRequest {
    /// HTTP method.
    pub method: String,
    /// `/bucket/key`.
    pub path: String,
    /// The query string, if any.
    pub query: Option<String>,
    /// The `Range` header, if any.
    pub range: Option<String>,
    /// The `Authorization` header, if any (tests of which credentials were used).
    pub authorization: Option<String>,
}

impl ServedRequest {
    /// What a server saw of `request`.
    pub fn of<B>(request: &hyper::Request<B>) -> Self {
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Self {
            method: request.method().to_string(),
            path: request.uri().path().to_owned(),
            query: request.uri().query().map(str::to_owned),
            range: header("range"),
            authorization: header("authorization"),
        }
    }

    /// A page of a delimited listing (what `ls` makes), not a probe or a GET.
    pub fn is_delimited_listing(&self) -> bool {
        self.method == "GET" && self.query.as_deref().is_some_and(|q| q.contains("delimiter="))
    }
}

/// A real S3 server on `127.0.0.1:<random port>`, serving one bucket from a temporary
/// directory. Stops when dropped.
#[derive(Debug)]
pub struct S3Server {
    addr: SocketAddr,
    log: Arc<Mutex<Vec<ServedRequest>>>,
    bucket: String,
    root: TempDir,
    accept: JoinHandle<()>,
}

impl S3Server {
    /// Starts the server with an empty bucket `bucket`.
    pub async fn start(bucket: &str) -> anyhow::Result<Self> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let root = tempfile::tempdir()?;
        std::fs::create_dir(root.path().join(bucket))?;
        let fs = s3s_fs::FileSystem::new(root.path()).map_err(|e| anyhow::anyhow!("s3s-fs: {e:?}"))?;
        let mut builder = S3ServiceBuilder::new(fs);
        builder.set_auth(SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
        let s3 = builder.build();
        let log = Arc::new(Mutex::new(Vec::new()));
        let served = log.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            served.lock().push(ServedRequest::of(&request));
            hyper::service::Service::call(&s3, request)
        });
        let (addr, accept) = serve_on_loopback(service).await?;
        Ok(Self {
            addr,
            log,
            bucket: bucket.to_owned(),
            root,
            accept,
        })
    }

    /// Every request the server has answered, in order (from every client, any process).
    pub fn requests(&self) -> Vec<ServedRequest> {
        self.log.lock().clone()
    }

    /// The directory holding the bucket's objects as files, one per key. Tests write keys
    /// here that object_store would refuse to upload.
    pub fn bucket_dir(&self) -> std::path::PathBuf {
        self.root.path().join(&self.bucket)
    }

    /// The ranged GETs of objects, in order.
    pub fn ranged_gets(&self) -> Vec<ServedRequest> {
        self.requests()
            .into_iter()
            .filter(|r| r.method == "GET" && r.range.is_some())
            .collect()
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bucket's URL, as a source would name it.
    pub fn url(&self) -> String {
        format!("s3://{}", self.bucket)
    }

    /// An object_store client for the bucket with its own retries off (Larder retries).
    pub fn client(&self) -> anyhow::Result<Arc<AmazonS3>> {
        s3_client(&self.endpoint(), &self.bucket)
    }

    /// Uploads `len` bytes of deterministic content with `seed` at `key`.
    pub async fn put(&self, key: &str, seed: u64, len: usize) -> anyhow::Result<()> {
        let bytes = crate::content(seed, 0, len);
        self.client()?
            .put(&Path::from(key), PutPayload::from(bytes))
            .await?;
        Ok(())
    }
}

/// A client for `bucket` of the test server at `endpoint`, from any process.
pub fn s3_client(endpoint: &str, bucket: &str) -> anyhow::Result<Arc<AmazonS3>> {
    s3_client_with_secret(endpoint, bucket, SECRET_KEY)
}

/// Like [`s3_client`], signing with `secret` (a wrong one gets 403s).
pub fn s3_client_with_secret(endpoint: &str, bucket: &str, secret: &str) -> anyhow::Result<Arc<AmazonS3>> {
    Ok(Arc::new(s3_builder(endpoint, bucket, secret).build()?))
}

/// Like [`s3_client`], sending a CRC64NVME of each upload, which the store keeps as the
/// object's full-object checksum.
pub fn s3_client_with_crc64nvme(endpoint: &str, bucket: &str) -> anyhow::Result<Arc<AmazonS3>> {
    let builder = s3_builder(endpoint, bucket, SECRET_KEY);
    Ok(Arc::new(
        builder
            .with_checksum_algorithm(object_store::aws::Checksum::CRC64NVME)
            .build()?,
    ))
}

fn s3_builder(endpoint: &str, bucket: &str, secret: &str) -> AmazonS3Builder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_access_key_id(ACCESS_KEY)
        .with_secret_access_key(secret)
        .with_retry(RetryConfig {
            backoff: BackoffConfig::default(),
            max_retries: 0,
            retry_timeout: std::time::Duration::from_secs(30),
        })
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
