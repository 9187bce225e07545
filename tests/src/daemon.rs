//! `larder daemon` as a child process, for end-to-end tests through real kernel mounts.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::Bucket;

/// A running `larder daemon` serving a [`Bucket`] as source `models`.
/// Dropped, it is killed and its mount detached.
#[derive(Debug)]
pub struct DaemonProcess {
    child: Option<Child>,
    bin: PathBuf,
    /// The mount point.
    pub mount: PathBuf,
    /// The cache dir.
    pub cache: PathBuf,
    /// The control socket.
    pub socket: PathBuf,
    leave_mount: bool,
}

/// True when `path` is a mount point (of anything).
pub fn is_mounted(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|line| line.split(' ').nth(4).map(Path::new) == Some(path))
}

impl DaemonProcess {
    /// Starts `bin daemon` with mount `dir/mnt`, cache `dir/cache` and control socket
    /// `dir/control.sock`, plus `extra` arguments, and waits until the mount is up.
    pub fn start(bin: &Path, server: &dyn Bucket, dir: &Path, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_with_env(bin, server, dir, extra, &[])
    }

    /// Like [`DaemonProcess::start`], signing requests with `secret`.
    pub fn start_with_secret(
        bin: &Path,
        server: &dyn Bucket,
        dir: &Path,
        extra: &[&str],
        secret: &str,
    ) -> anyhow::Result<Self> {
        Self::start_with_env(bin, server, dir, extra, &[("AWS_SECRET_ACCESS_KEY", secret)])
    }

    /// Like [`DaemonProcess::start`], with the environment variables `env` set over the
    /// harness's own (`LARDER_LOG=info`, the AWS settings of `server`).
    pub fn start_with_env(
        bin: &Path,
        server: &dyn Bucket,
        dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let mount = dir.join("mnt");
        let cache = dir.join("cache");
        let socket = dir.join("control.sock");
        std::fs::create_dir_all(&mount).or_else(|e| match e.raw_os_error() {
            // A stale mount from a killed daemon is there: the daemon's job to clean.
            Some(libc::ENOTCONN) | Some(libc::EEXIST) => Ok(()),
            _ => Err(e),
        })?;
        let log = std::fs::File::create(dir.join("daemon.log"))?;
        let child = Command::new(bin)
            .arg("daemon")
            .arg("--mount")
            .arg(&mount)
            .arg("--cache-dir")
            .arg(&cache)
            .arg("--control-socket")
            .arg(&socket)
            .args(["--source", &format!("models={}", server.url())])
            .args(extra)
            .env("AWS_ENDPOINT_URL", server.endpoint())
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", crate::ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", crate::SECRET_KEY)
            .env("LARDER_LOG", "info")
            // Daemons of tests running side by side must not all take the default port; a
            // test that scrapes passes --metrics-listen, which wins over this.
            .env("LARDER_METRICS_LISTEN", "127.0.0.1:0")
            // The file system a test's cache lives on is the machine's, whose free space is
            // not the test's: the default 5% kept free made a fresh machine with a fuller disk
            // refuse to cache. A test of that limit passes --min-free-fraction, which wins.
            .env("LARDER_MIN_FREE_FRACTION", "0")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mount = mount.canonicalize().unwrap_or(mount);
        let mut daemon = Self {
            child: Some(child),
            bin: bin.to_owned(),
            mount,
            cache,
            socket,
            leave_mount: false,
        };
        let started = Instant::now();
        // Ready when it says so: a dead daemon's mount can look mounted, even with the same id.
        let log_path = dir.join("daemon.log");
        while !std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .contains("larder is serving")
        {
            if let Some(status) = daemon.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
                bail!("the daemon exited with {status} before mounting:\n{log}");
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!("the daemon did not mount within 30s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(daemon)
    }

    /// Runs `larder args` against this daemon's control socket.
    pub fn larder(&self, args: &[&str]) -> std::process::Output {
        Command::new(&self.bin)
            .args(args)
            .env("LARDER_CONTROL_SOCKET", &self.socket)
            .output()
            .expect("run larder")
    }

    /// `larder status --json`, which must succeed.
    pub fn status(&self) -> serde_json::Value {
        let output = self.larder(&["status", "--json"]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "larder status: {stderr}");
        serde_json::from_slice(&output.stdout).expect("status JSON")
    }

    /// The daemon's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Bytes the daemon has had read from a disk so far (`/proc/PID/io`, O_DIRECT reads of its
    /// cache included): measured outside the daemon.
    pub fn disk_read_bytes(&self) -> anyhow::Result<u64> {
        let pid = self.pid().context("the daemon has exited")?;
        let io = std::fs::read_to_string(format!("/proc/{pid}/io"))?;
        io.lines()
            .find_map(|line| line.strip_prefix("read_bytes: "))
            .context("no read_bytes in /proc/PID/io")?
            .parse()
            .context("read_bytes")
    }

    /// Stops the daemon with SIGTERM and returns its exit status.
    pub fn stop(self) -> anyhow::Result<ExitStatus> {
        self.terminate()?;
        self.wait(Duration::from_secs(30))
    }

    /// Sends the daemon SIGTERM without waiting for it.
    pub fn terminate(&self) -> anyhow::Result<()> {
        self.signal(libc::SIGTERM)
    }

    /// Sends the daemon `signal` without waiting for it.
    pub fn signal(&self, signal: libc::c_int) -> anyhow::Result<()> {
        let child = self.child.as_ref().context("already stopped")?;
        // SAFETY: signals our own child by its pid.
        if unsafe { libc::kill(child.id() as i32, signal) } != 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("signal {signal}"));
        }
        Ok(())
    }

    /// The daemon's exit status if it has exited, without waiting.
    pub fn exited(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        let child = self.child.as_mut().context("already stopped")?;
        Ok(child.try_wait()?)
    }

    /// Waits at most `within` for the daemon to exit and returns its exit status; kills it
    /// and fails if it is still running then.
    pub fn wait(mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        let mut child = self.child.take().context("already stopped")?;
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if started.elapsed() > within {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the daemon did not exit within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the daemon with SIGKILL, leaving its dead mount behind for the next daemon.
    pub fn kill9(mut self) -> anyhow::Result<()> {
        let mut child = self.child.take().context("already stopped")?;
        child.kill()?;
        child.wait()?;
        self.leave_mount = true;
        Ok(())
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if !self.leave_mount && is_mounted(&self.mount) {
            let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        }
    }
}
