//! WsgiDAV, a WebDAV server (PyPI `wsgidav`, which `scripts/test` installs into `bench/.venv`),
//! serving a temporary directory on a loopback port of its own: the HTTP origin's server.
//! object_store's HTTP store lists with `PROPFIND` and reads with ranged GETs, so a plain web
//! server can be read from but not listed; WebDAV is what it speaks.
//!
//! Its ETags are made of the file's inode, modification time and size, and it honours
//! `If-Match`, as a web server in front of files does.

use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tempfile::TempDir;

/// A running WsgiDAV, killed (by its PID) when dropped.
#[derive(Debug)]
pub struct WebDav {
    child: Child,
    address: String,
    dir: TempDir,
}

impl WebDav {
    /// Serves an empty directory to anyone.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(false)
    }

    /// Serves an empty directory only to the user `larder` with the password `secret`: a
    /// client without them is refused (401).
    pub fn start_with_password() -> anyhow::Result<Self> {
        Self::start_with(true)
    }

    fn start_with(password: bool) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("larder-webdav").tempdir()?;
        let root = dir.path().join("root");
        std::fs::create_dir(&root)?;
        let port = crate::free_port(Ipv4Addr::LOCALHOST)?;
        let address = format!("127.0.0.1:{port}");
        let binary = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/.venv/bin/wsgidav");
        if !binary.exists() {
            bail!("wsgidav is not in bench/.venv: run scripts/test");
        }
        let mut command = Command::new(&binary);
        command.args(["--host", "127.0.0.1", "--port", &port.to_string(), "-q"]);
        if password {
            let config = dir.path().join("wsgidav.json");
            let settings = serde_json::json!({
                "provider_mapping": { "/": root },
                "http_authenticator": { "domain_controller": null, "accept_basic": true, "accept_digest": false, "default_to_digest": false },
                "simple_dc": { "user_mapping": { "*": { "larder": { "password": "secret" } } } },
            });
            std::fs::write(&config, settings.to_string())?;
            command.arg("--config").arg(&config);
        } else {
            command
                .arg("--root")
                .arg(&root)
                .args(["--auth", "anonymous", "--no-config"]);
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let server = Self { child, address, dir };
        let started = Instant::now();
        while TcpStream::connect(&server.address).is_err() {
            if started.elapsed() > Duration::from_secs(20) {
                bail!("wsgidav did not listen on {} within 20 s", server.address);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(server)
    }

    /// The directory it serves: tests write objects there.
    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// The source URL of its directory `dir` (`""`: the whole tree).
    pub fn url(&self, dir: &str) -> String {
        format!("http://{}/{}", self.address, dir.trim_matches('/'))
    }

    /// Writes `bytes` at `key` under the served directory, its parents made.
    pub fn write(&self, key: &str, bytes: &[u8]) -> anyhow::Result<()> {
        write_under(&self.root(), key, bytes)
    }
}

/// Writes `bytes` at `key` under `root`, by a rename, so that no reader sees half of them.
pub fn write_under(root: &Path, key: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let path = root.join(key);
    std::fs::create_dir_all(path.parent().context("a key with a parent")?)?;
    let partial = path.with_extension("partial-write");
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, &path)?;
    Ok(())
}

impl Drop for WebDav {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
