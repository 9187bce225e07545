//! Azurite, Microsoft's Azure Blob Storage emulator (npm `azurite`, which `scripts/test` installs
//! into `bench/.node`), serving one container from a temporary directory on a loopback port of
//! its own, with Shared Key signatures enforced.
//!
//! Where it differs from the real service, as far as Larder meets it: it serves the well-known
//! development account (`devstoreaccount1`) path-style (`http://host:port/devstoreaccount1/…`)
//! rather than at `<account>.blob.core.windows.net`, and it ignores `startFrom` in listings
//! (object_store filters client-side for it). Like the service, it computes `Content-MD5` for a
//! blob uploaded in one request and enforces Shared Key signatures.

use std::net::{Ipv4Addr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{KeyInit, Mac};
use object_store::azure::{MicrosoftAzure, MicrosoftAzureBuilder};
use tempfile::TempDir;

use crate::Bucket;

/// The development account every Azurite serves.
pub const ACCOUNT: &str = "devstoreaccount1";

/// Its published key.
pub const ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// The REST API version requests say they speak.
const API_VERSION: &str = "2021-08-06";

/// A running Azurite, killed (by its PID) when dropped.
#[derive(Debug)]
pub struct Azurite {
    child: Child,
    address: String,
    container: String,
    _dir: TempDir,
}

impl Azurite {
    /// Starts the emulator with an empty `container`.
    pub fn start(container: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("larder-azurite").tempdir()?;
        let port = crate::free_port(Ipv4Addr::LOCALHOST)?;
        let address = format!("127.0.0.1:{port}");
        let binary = Self::installed_binary()?;
        let child = Command::new(&binary)
            .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
            .args(["--silent", "--skipApiVersionCheck", "--location"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let azurite = Self {
            child,
            address,
            container: container.to_owned(),
            _dir: dir,
        };
        let started = Instant::now();
        while TcpStream::connect(&azurite.address).is_err() {
            if started.elapsed() > Duration::from_secs(30) {
                bail!("Azurite did not listen on {} within 30 s", azurite.address);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        azurite.create_container()?;
        Ok(azurite)
    }

    /// The launcher npm installed in `bench/.node`.
    pub fn installed_binary() -> anyhow::Result<PathBuf> {
        let binary =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/.node/node_modules/.bin/azurite-blob");
        if !binary.exists() {
            bail!("Azurite is not in bench/.node: run scripts/test");
        }
        Ok(binary)
    }

    /// The connection string the Azure CLI and SDKs take, for the account at `endpoint`
    /// (`http://host:port`: this emulator's, or a proxy's in front of it), signing with `key`.
    pub fn connection_string(&self, endpoint: &str, key: &str) -> String {
        format!(
            "DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};BlobEndpoint={endpoint}/{ACCOUNT};"
        )
    }

    /// What a process's environment needs to reach it: its connection string.
    pub fn env(&self) -> [(&'static str, String); 1] {
        [(
            "AZURE_STORAGE_CONNECTION_STRING",
            self.connection_string(&Bucket::endpoint(self), ACCOUNT_KEY),
        )]
    }

    /// A client of the container, for tests to write and delete blobs with.
    pub fn client(&self) -> anyhow::Result<Arc<MicrosoftAzure>> {
        self.client_at(&Bucket::endpoint(self))
    }

    /// A client of the container through `endpoint` (`http://host:port`: a proxy's in front of
    /// it).
    pub fn client_at(&self, endpoint: &str) -> anyhow::Result<Arc<MicrosoftAzure>> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        Ok(Arc::new(
            MicrosoftAzureBuilder::new()
                .with_account(ACCOUNT)
                .with_access_key(ACCOUNT_KEY)
                .with_endpoint(format!("{endpoint}/{ACCOUNT}"))
                .with_allow_http(true)
                .with_container_name(&self.container)
                .build()?,
        ))
    }

    /// Its process ID, for what it costs (`/proc/PID/stat`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Creates the container: a `Create Container` request signed with the account's Shared
    /// Key (object_store has no call for it).
    fn create_container(&self) -> anyhow::Result<()> {
        let date = httpdate::fmt_http_date(SystemTime::now());
        let resource = format!("/{ACCOUNT}/{ACCOUNT}/{}\nrestype:container", self.container);
        // The verb, eleven standard headers (all empty; a zero Content-Length is empty too),
        // the x-ms- headers in order, and the resource.
        let to_sign =
            format!("PUT\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{API_VERSION}\n{resource}");
        let key = BASE64.decode(ACCOUNT_KEY)?;
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key)?;
        mac.update(to_sign.as_bytes());
        let signature = BASE64.encode(mac.finalize().into_bytes());
        let (status, body) = crate::http1::request(
            &self.address,
            "PUT",
            &format!("/{ACCOUNT}/{}?restype=container", self.container),
            &[
                format!("x-ms-date: {date}"),
                format!("x-ms-version: {API_VERSION}"),
                format!("Authorization: SharedKey {ACCOUNT}:{signature}"),
            ],
            b"",
        )?;
        if status != 201 {
            bail!("Azurite refused to create the container ({status}): {body}");
        }
        Ok(())
    }
}

impl Bucket for Azurite {
    fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    fn url(&self) -> String {
        format!("az://{}", self.container)
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
