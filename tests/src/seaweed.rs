//! SeaweedFS (`weed mini`) on loopback: a production object store for end-to-end tests and
//! benchmarks. `bench/setup` installs it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tempfile::TempDir;

/// A running `weed mini`, killed (by its PID) when dropped. Instances on one machine take
/// turns.
#[derive(Debug)]
pub struct Seaweed {
    child: Child,
    /// `http://127.0.0.1:<s3 port>`.
    pub endpoint: String,
    bucket: String,
    _dir: TempDir,
    /// `weed mini` always takes the master's port 9333: one instance at a time per machine.
    _turn: std::fs::File,
}

/// Waits for the machine-wide turn to run `weed mini`; the turn ends when the file closes.
fn wait_for_turn() -> anyhow::Result<std::fs::File> {
    let path = std::env::temp_dir().join("larder-weed-mini.lock");
    let file = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns; no memory is touched.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).context("locking the weed mini turn");
    }
    Ok(file)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Seaweed {
    /// Starts `weed mini` with its data on tmpfs (`/dev/shm`) where there is one, so the
    /// server's disk reads do not compete with the cache's; creates `bucket`.
    pub fn start(weed: &Path, bucket: &str) -> anyhow::Result<Self> {
        let turn = wait_for_turn()?;
        let shm = PathBuf::from("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm)?
        } else {
            tempfile::tempdir()?
        };
        let identities = format!(
            r#"{{"identities":[{{"name":"bench","credentials":[{{"accessKey":"{}","secretKey":"{}"}}],"actions":["Admin","Read","Write","List"]}}]}}"#,
            crate::ACCESS_KEY,
            crate::SECRET_KEY
        );
        std::fs::write(dir.path().join("s3.json"), identities)?;
        let port = free_port()?;
        let child = Command::new(weed)
            .arg("mini")
            .arg(format!("-dir={}", dir.path().join("data").display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false"])
            .arg(format!("-s3.port={port}"))
            .arg(format!("-s3.config={}", dir.path().join("s3.json").display()))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("weed.log"))?)
            .spawn()
            .with_context(|| format!("starting {}", weed.display()))?;
        let server = Self {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            bucket: bucket.to_owned(),
            _dir: dir,
            _turn: turn,
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if started.elapsed() > Duration::from_secs(30) {
                bail!("weed mini did not open its S3 port within 30s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // The master's shell creates buckets; retry while the cluster settles.
        loop {
            let mut shell = Command::new(weed)
                .args(["shell", "-master=127.0.0.1:9333"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()?;
            if let Some(mut stdin) = shell.stdin.take() {
                std::io::Write::write_all(
                    &mut stdin,
                    format!("s3.bucket.create -name {bucket}\n").as_bytes(),
                )?;
            }
            let output = shell.wait_with_output()?;
            if String::from_utf8_lossy(&output.stdout).contains("created bucket") {
                return Ok(server);
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!(
                    "could not create bucket {bucket}: {}",
                    String::from_utf8_lossy(&output.stdout)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Seaweed {
    /// The binary `bench/setup` installs, from a crate of this workspace.
    pub fn installed_binary() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/.venv/bin/weed")
    }

    /// The bucket's URL, as a source would name it.
    pub fn url(&self) -> String {
        format!("s3://{}", self.bucket)
    }

    /// A client of the bucket (Larder's retries, not the client's).
    pub fn client(&self) -> anyhow::Result<std::sync::Arc<object_store::aws::AmazonS3>> {
        crate::s3_client(&self.endpoint, &self.bucket)
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
