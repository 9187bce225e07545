//! The object store a mount benchmark reads from (`--origin`): SeaweedFS over S3,
//! fake-gcs-server (GCS) or Azurite (Azure Blob Storage), on loopback, behind the run's
//! recording proxy. rclone and s3fs-fuse are compared over S3 only.

use std::path::Path;
use std::sync::Arc;

use larder_tests::azurite::{ACCOUNT, ACCOUNT_KEY, Azurite};
use larder_tests::gcs::FakeGcs;
use larder_tests::seaweed::Seaweed;
use larder_tests::{Bucket, RecordingProxy, content, free_port, seed};
use object_store::ObjectStore;

use crate::common::{upload_file_with_retries, upload_with_retries};

/// Which store `--origin` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OriginKind {
    /// SeaweedFS, over S3.
    S3,
    /// fake-gcs-server, a Google Cloud Storage emulator.
    Gcs,
    /// Azurite, an Azure Blob Storage emulator.
    Azure,
}

enum Server {
    S3(Seaweed),
    Gcs(FakeGcs),
    Azure(Azurite),
}

/// The running store and the proxy in front of it.
pub(crate) struct Origin {
    server: Server,
    pub(crate) proxy: RecordingProxy,
}

impl Origin {
    /// Starts the store `kind` names with `bucket` (SeaweedFS from `weed`) and a proxy.
    pub(crate) async fn start(kind: OriginKind, weed: &Path, bucket: &str) -> anyhow::Result<Self> {
        Ok(match kind {
            OriginKind::S3 => {
                let server = Seaweed::start(weed, bucket)?;
                let proxy = RecordingProxy::start(&server).await?;
                Self {
                    server: Server::S3(server),
                    proxy,
                }
            }
            OriginKind::Gcs => {
                // The proxy first: the emulator answers only requests to the host it is told.
                let port = free_port(std::net::Ipv4Addr::LOCALHOST)?;
                let proxy = RecordingProxy::start_to(&format!("127.0.0.1:{port}")).await?;
                let public = proxy.endpoint().trim_start_matches("http://").to_owned();
                let server = FakeGcs::start_at(bucket, &[], port, &public)?;
                Self {
                    server: Server::Gcs(server),
                    proxy,
                }
            }
            OriginKind::Azure => {
                let server = Azurite::start(bucket)?;
                let proxy = RecordingProxy::start(&server).await?;
                Self {
                    server: Server::Azure(server),
                    proxy,
                }
            }
        })
    }

    /// What the report calls it.
    pub(crate) fn name(&self) -> &'static str {
        match self.server {
            Server::S3(_) => "SeaweedFS (`weed mini`, data on tmpfs), over S3",
            Server::Gcs(_) => "fake-gcs-server (a GCS emulator)",
            Server::Azure(_) => "Azurite (an Azure Blob Storage emulator)",
        }
    }

    /// Whether rclone and s3fs-fuse can read it (they are set up for S3).
    pub(crate) fn is_s3(&self) -> bool {
        matches!(self.server, Server::S3(_))
    }

    /// The server's process, for the CPU it spends.
    pub(crate) fn pid(&self) -> u32 {
        match &self.server {
            Server::S3(server) => server.pid(),
            Server::Gcs(server) => server.pid(),
            Server::Azure(server) => server.pid(),
        }
    }

    /// Uploads `size` bytes of the harness's content of `key` (seed 0), not through the proxy.
    pub(crate) async fn put(&self, key: &str, size: u64) -> anyhow::Result<()> {
        match &self.server {
            Server::S3(server) => upload_with_retries(server.client()?.as_ref(), key, size).await,
            // Its XML API takes no uploads: one request to its JSON API.
            Server::Gcs(server) => server.put(key, &content(seed(key, 0), 0, size as usize)),
            Server::Azure(server) => upload_with_retries(server.client()?.as_ref(), key, size).await,
        }
    }

    /// Uploads the file at `path` to `key`, not through the proxy.
    pub(crate) async fn put_file(&self, key: &str, path: &Path) -> anyhow::Result<()> {
        match &self.server {
            Server::S3(server) => upload_file_with_retries(server.client()?.as_ref(), key, path).await,
            Server::Gcs(server) => server.put(key, &std::fs::read(path)?),
            Server::Azure(server) => upload_file_with_retries(server.client()?.as_ref(), key, path).await,
        }
    }

    /// The source a daemon is given (its URL) and the environment that sends it through the
    /// proxy.
    pub(crate) fn source(&self) -> (&dyn Bucket, Vec<(&'static str, String)>) {
        match &self.server {
            // The harness points a daemon at a bucket's endpoint: the proxy's.
            Server::S3(_) => (&self.proxy, Vec::new()),
            Server::Gcs(server) => (server, server.env().to_vec()),
            Server::Azure(server) => (
                server,
                vec![(
                    "AZURE_STORAGE_CONNECTION_STRING",
                    server.connection_string(&self.proxy.endpoint(), ACCOUNT_KEY),
                )],
            ),
        }
    }

    /// A client of the bucket through the proxy, for the limits.
    pub(crate) fn client(&self, bucket: &str) -> anyhow::Result<Arc<dyn ObjectStore>> {
        let endpoint = self.proxy.endpoint();
        Ok(match &self.server {
            Server::S3(_) => larder_tests::s3_client(&endpoint, bucket)?,
            Server::Gcs(server) => server.client()?,
            Server::Azure(server) => server.client_at(&endpoint)?,
        })
    }

    /// The key a request path names (`/BUCKET/KEY`; Azurite's `/ACCOUNT/BUCKET/KEY`).
    pub(crate) fn key_of<'a>(&self, path: &'a str, bucket: &str) -> Option<&'a str> {
        let path = match self.server {
            Server::Azure(_) => path.strip_prefix(&format!("/{ACCOUNT}"))?,
            Server::S3(_) | Server::Gcs(_) => path,
        };
        path.strip_prefix(&format!("/{bucket}/"))
    }
}
