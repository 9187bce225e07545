//! SeaweedFS (`weed mini`) on loopback: a production object store for end-to-end tests and
//! benchmarks. `scripts/test` and `bench/setup` install it.
//!
//! Every instance has ports of its own (master, volume, filer, S3, each with its gRPC port) and
//! its files in a temporary directory removed on drop, so instances started by different
//! tests, or a SeaweedFS someone else runs on the machine, never meet. `weed mini` creates the
//! bucket itself (`-bucket`); nothing talks to a master by a fixed address.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tempfile::TempDir;

/// The listeners of one instance.
#[derive(Debug, Clone, Copy)]
struct Ports {
    master: u16,
    master_grpc: u16,
    volume: u16,
    volume_grpc: u16,
    filer: u16,
    filer_grpc: u16,
    s3: u16,
    s3_grpc: u16,
    admin: u16,
    admin_grpc: u16,
}

impl Ports {
    /// Ten ports no other server of this process was given.
    fn free() -> anyhow::Result<Self> {
        let port = || crate::free_port(Ipv4Addr::LOCALHOST);
        Ok(Self {
            master: port()?,
            master_grpc: port()?,
            volume: port()?,
            volume_grpc: port()?,
            filer: port()?,
            filer_grpc: port()?,
            s3: port()?,
            s3_grpc: port()?,
            admin: port()?,
            admin_grpc: port()?,
        })
    }

    /// The `weed mini` flags that set every port.
    fn flags(&self) -> Vec<String> {
        [
            ("master.port", self.master),
            ("master.port.grpc", self.master_grpc),
            ("volume.port", self.volume),
            ("volume.port.grpc", self.volume_grpc),
            ("filer.port", self.filer),
            ("filer.port.grpc", self.filer_grpc),
            ("s3.port", self.s3),
            ("s3.port.grpc", self.s3_grpc),
            ("admin.port", self.admin),
            ("admin.port.grpc", self.admin_grpc),
            // The Iceberg and Lance catalogs are off.
            ("s3.port.iceberg", 0),
            ("s3.port.lance", 0),
        ]
        .iter()
        .map(|(flag, port)| format!("-{flag}={port}"))
        .collect()
    }

    /// The gRPC servers by role and port: `weed` puts a Unix socket for each in /tmp, named
    /// by both.
    fn grpc(&self) -> [(&'static str, u16); 5] {
        [
            ("master", self.master_grpc),
            ("volume", self.volume_grpc),
            ("filer", self.filer_grpc),
            ("s3", self.s3_grpc),
            ("admin", self.admin_grpc),
        ]
    }
}

/// A running `weed mini`, stopped (by its PID) and its files removed when dropped.
#[derive(Debug)]
pub struct Seaweed {
    child: Child,
    /// `http://127.0.0.1:<s3 port>`.
    pub endpoint: String,
    bucket: String,
    ports: Ports,
    _dir: TempDir,
}

impl Seaweed {
    /// Starts `weed mini` on ports of its own with its data on tmpfs (`/dev/shm`) where there
    /// is one, so the server's disk reads do not compete with the cache's, and with `bucket`
    /// created. Its ports are free when chosen but not held until it binds them, so another
    /// process may take one first: an instance that exits before serving is started again on
    /// new ports, three times at most.
    pub fn start(weed: &Path, bucket: &str) -> anyhow::Result<Self> {
        let mut attempt = 1;
        loop {
            match Self::start_once(weed, bucket)? {
                Ok(server) => return Ok(server),
                Err(exited) if attempt < 3 => {
                    eprintln!("{exited}; starting it again on other ports");
                    attempt += 1;
                }
                Err(exited) => bail!(exited),
            }
        }
    }

    /// One start: the server, or why `weed mini` exited before serving (with the end of its
    /// log, which goes with its directory).
    fn start_once(weed: &Path, bucket: &str) -> anyhow::Result<Result<Self, String>> {
        let shm = PathBuf::from("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::Builder::new().prefix("larder-weed").tempdir_in(shm)?
        } else {
            tempfile::Builder::new().prefix("larder-weed").tempdir()?
        };
        let identities = format!(
            r#"{{"identities":[{{"name":"bench","credentials":[{{"accessKey":"{}","secretKey":"{}"}}],"actions":["Admin","Read","Write","List"]}}]}}"#,
            crate::ACCESS_KEY,
            crate::SECRET_KEY
        );
        let root = dir.path().to_owned();
        let path = |name: &str| root.join(name).display().to_string();
        std::fs::write(path("s3.json"), identities)?;
        let ports = Ports::free()?;
        let child = Command::new(weed)
            .arg("mini")
            .arg(format!("-dir={}", path("data")))
            .args([
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-admin.ui=false",
                "-webdav=false",
            ])
            .arg("-master.telemetry=false")
            .args(ports.flags())
            .arg(format!("-filer.localSocket={}", path("filer.sock")))
            .arg(format!("-s3.localSocket={}", path("s3.sock")))
            .arg(format!("-s3.config={}", path("s3.json")))
            .arg(format!("-bucket={bucket}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(path("weed.log"))?)
            .spawn()
            .with_context(|| format!("starting {}", weed.display()))?;
        let mut server = Self {
            child,
            endpoint: format!("http://127.0.0.1:{}", ports.s3),
            bucket: bucket.to_owned(),
            ports,
            _dir: dir,
        };
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", ports.s3)).is_err() || !server.has_bucket() {
            if let Some(status) = server.child.try_wait()? {
                let log = std::fs::read_to_string(path("weed.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                return Ok(Err(format!(
                    "weed mini exited ({status}) before serving bucket {bucket}; its log ends: {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                )));
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!("weed mini did not serve bucket {bucket} within 60s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Ok(server))
    }

    /// Whether the filer holds the bucket's directory yet (`weed mini -bucket` creates it
    /// once the cluster is up).
    fn has_bucket(&self) -> bool {
        let ask = || -> std::io::Result<bool> {
            let mut stream = TcpStream::connect(("127.0.0.1", self.ports.filer))?;
            stream.set_read_timeout(Some(Duration::from_secs(2)))?;
            write!(
                stream,
                "HEAD /buckets/{}/ HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                self.bucket
            )?;
            let mut head = [0; 12];
            stream.read_exact(&mut head)?;
            Ok(head.ends_with(b"200"))
        };
        ask().unwrap_or(false)
    }

    /// The binary `scripts/test` and `bench/setup` install, from a crate of this workspace.
    pub fn installed_binary() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/.venv/bin/weed")
    }

    /// The server's process ID, for what it costs (`/proc/PID/stat`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The bucket's URL, as a source would name it.
    pub fn url(&self) -> String {
        format!("s3://{}", self.bucket)
    }

    /// A client of the bucket (Larder's retries, not the client's).
    pub fn client(&self) -> anyhow::Result<std::sync::Arc<object_store::aws::AmazonS3>> {
        crate::s3_client(&self.endpoint, &self.bucket)
    }

    /// A client whose uploads carry a CRC64NVME, kept as the objects' full-object checksum.
    pub fn crc64nvme_client(&self) -> anyhow::Result<std::sync::Arc<object_store::aws::AmazonS3>> {
        crate::s3_client_with_crc64nvme(&self.endpoint, &self.bucket)
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        // SIGTERM lets weed remove its sockets; SIGKILL if it does not stop in time.
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child's PID, which `wait` has not reaped yet.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let asked = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) && asked.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // What a killed weed leaves in /tmp: a gRPC socket per port, named by port number.
        for (role, port) in self.ports.grpc() {
            let _ = std::fs::remove_file(format!("/tmp/seaweedfs-{role}-grpc-{port}.sock"));
        }
    }
}
