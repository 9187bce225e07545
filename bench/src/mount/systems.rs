//! The file systems under test, each a process serving the benchmark bucket through a kernel
//! mount: `larder daemon`, `rclone mount` with its full VFS cache, and s3fs-fuse with its disk
//! cache. Each keeps its mount point, cache dir and log in a directory of its own.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::Origin;
use crate::SystemArgs;
use crate::common::drop_page_cache;
use anyhow::{Context, bail};
use larder_tests::Bucket;
use larder_tests::daemon::{DaemonProcess, is_mounted};

/// A column of the report: the limit, or one of the mounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum System {
    /// The reference: the same bytes without a mount (local file or raw download).
    Limit,
    Larder,
    Rclone,
    S3fs,
}

impl System {
    pub(crate) fn name(self) -> &'static str {
        match self {
            System::Limit => "limit",
            System::Larder => "Larder",
            System::Rclone => "rclone",
            System::S3fs => "s3fs",
        }
    }
}

/// The systems `args` asks for, each keeping its files in a directory of its own under
/// `dir`, each checked to run. rclone and s3fs-fuse are set up for S3: unless the store is
/// S3 (`s3`), Larder alone.
pub(crate) fn setups(args: &SystemArgs, s3: bool, dir: &Path) -> anyhow::Result<Vec<Setup>> {
    let systems = [
        (System::Larder, true, &args.larder),
        (System::Rclone, s3 && !args.no_rclone, &args.rclone),
        (System::S3fs, s3 && !args.no_s3fs, &args.s3fs),
    ];
    let setups = systems
        .into_iter()
        .filter(|&(_, wanted, _)| wanted)
        .map(|(system, _, binary)| Setup::new(system, binary.clone(), dir.join(system.name().to_lowercase())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for setup in &setups {
        setup.check_installed()?;
    }
    Ok(setups)
}

/// How long a mount may take to come up or to go away.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);

/// How to start one system's mount.
#[derive(Debug)]
pub(crate) struct Setup {
    pub(crate) system: System,
    bin: PathBuf,
    /// Holds `mnt/`, `cache/` and the logs; absolute, since mount points are compared as
    /// `/proc/self/mountinfo` shows them.
    dir: PathBuf,
}

impl Setup {
    /// A mount system run from `bin`, keeping its files in `dir`.
    pub(crate) fn new(system: System, bin: PathBuf, dir: PathBuf) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        let dir = dir.canonicalize()?;
        Ok(Self { system, bin, dir })
    }

    /// Where the bucket appears.
    pub(crate) fn mount_dir(&self) -> PathBuf {
        self.dir.join("mnt")
    }

    /// What the system's log says went wrong, for a failed run: Larder's warnings, errors and
    /// panics, a peer's lines; at most ten, the first three (what started it) and the last.
    pub(crate) fn log_trouble(&self) -> Vec<String> {
        let (file, wanted): (_, fn(&str) -> bool) = match self.system {
            System::Larder => ("daemon.log", |l| {
                [" WARN ", " ERROR ", " panicked at "]
                    .iter()
                    .any(|what| l.contains(what))
            }),
            System::Rclone => ("rclone.log", |_| true),
            System::S3fs => ("s3fs.log", |_| true),
            System::Limit => return Vec::new(),
        };
        let log = std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
        let lines: Vec<_> = log.lines().filter(|l| wanted(l)).collect();
        let first = lines.len().min(3);
        let last = lines.len().saturating_sub(7).max(first);
        lines[..first]
            .iter()
            .chain(&lines[last..])
            .map(|l| (*l).to_owned())
            .collect()
    }

    /// The system's disk cache.
    pub(crate) fn cache_dir(&self) -> PathBuf {
        self.dir.join("cache")
    }

    /// The argument that makes the binary print its version.
    fn version_flag(&self) -> &'static str {
        match self.system {
            System::Rclone => "version",
            _ => "--version",
        }
    }

    /// Fails, saying how to install it, where the system's binary cannot be run.
    pub(crate) fn check_installed(&self) -> anyhow::Result<()> {
        let hint = match self.system {
            System::Limit | System::Larder => {
                "build it (cargo build --release -p larder-cache-daemon) or pass --larder"
            }
            System::Rclone => "run bench/setup, or pass --no-rclone",
            System::S3fs => "run bench/setup (Debian package s3fs), or pass --no-s3fs",
        };
        Command::new(&self.bin)
            .arg(self.version_flag())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .with_context(|| format!("cannot run {}: {hint}", self.bin.display()))?;
        Ok(())
    }

    /// The first line of the binary's version, for the report.
    pub(crate) fn version(&self) -> String {
        Command::new(&self.bin)
            .arg(self.version_flag())
            .output()
            .ok()
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| "version unknown".to_owned())
    }

    /// Removes the cache dir: the next start is cold.
    fn wipe_cache(&self) -> anyhow::Result<()> {
        match std::fs::remove_dir_all(self.cache_dir()) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("wiping {}", self.cache_dir().display()))
            }
            _ => Ok(()),
        }
    }

    /// Wipes the cache, drops the page cache and starts the system over `store`: the next
    /// read is cold.
    pub(crate) fn start_cold(&self, store: &Origin) -> anyhow::Result<Mounted> {
        self.wipe_cache()?;
        drop_page_cache();
        self.start(store)
    }

    /// Larder's largest data file (`*.data` anywhere under its cache dir). The cache is wiped
    /// before each cold read of the large file, so after one that file's blocks are there.
    pub(crate) fn larder_data_file(&self) -> anyhow::Result<PathBuf> {
        anyhow::ensure!(
            self.system == System::Larder,
            "{} has no Larder data file",
            self.system.name()
        );
        let mut largest: Option<(u64, PathBuf)> = None;
        let mut dirs = vec![self.cache_dir()];
        while let Some(dir) = dirs.pop() {
            let entries = std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?;
            for entry in entries {
                let entry = entry?;
                let meta = entry.metadata()?;
                let path = entry.path();
                if meta.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "data")
                    && largest.as_ref().is_none_or(|(len, _)| meta.len() > *len)
                {
                    largest = Some((meta.len(), path));
                }
            }
        }
        largest
            .map(|(_, path)| path)
            .with_context(|| format!("no data file under {}", self.cache_dir().display()))
    }

    /// Waits until the system has recorded the whole of `key` (`size` bytes) as cached, so
    /// that a restart finds it. rclone writes which ranges of a file it holds only when the
    /// file's downloaders stop, some seconds after the last read; stopped before that, it
    /// downloads the file again after the restart. Larder and s3fs record as they write.
    pub(crate) fn settle(&self, key: &str, size: u64) -> anyhow::Result<()> {
        if self.system != System::Rclone {
            return Ok(());
        }
        let started = Instant::now();
        while !rclone_holds(&self.cache_dir().join("vfsMeta"), key, size) {
            if started.elapsed() > MOUNT_TIMEOUT {
                bail!("rclone did not record {key} as cached within {MOUNT_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Starts the system over `store` and returns once its mount serves.
    pub(crate) fn start(&self, store: &Origin) -> anyhow::Result<Mounted> {
        if let System::Larder = self.system {
            let (source, env) = store.source();
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            return Ok(Mounted::Larder(DaemonProcess::start_with_env(
                &self.bin,
                source,
                &self.dir,
                &["--metrics-listen", "off"],
                &env,
            )?));
        }
        // The others read S3, through the proxy.
        let origin = &store.proxy;
        let bucket = origin
            .url()
            .strip_prefix("s3://")
            .context("the origin is not an S3 bucket")?
            .to_owned();
        match self.system {
            System::Limit => bail!("the limit is not a mount"),
            System::Larder => unreachable!("started above"),
            System::Rclone => {
                std::fs::create_dir_all(self.cache_dir())?;
                // The remote comes from the environment; the config file named does not exist.
                let mut command = Command::new(&self.bin);
                command
                    .arg("mount")
                    .arg(format!("larderbench:{bucket}"))
                    .arg(self.mount_dir())
                    .args(["--vfs-cache-mode", "full", "--read-only"])
                    .arg("--cache-dir")
                    .arg(self.cache_dir())
                    .arg("--config")
                    .arg(self.dir.join("rclone.conf"))
                    .env("RCLONE_CONFIG_LARDERBENCH_TYPE", "s3")
                    .env("RCLONE_CONFIG_LARDERBENCH_PROVIDER", "Other")
                    .env("RCLONE_CONFIG_LARDERBENCH_ENDPOINT", origin.endpoint())
                    .env("RCLONE_CONFIG_LARDERBENCH_REGION", "us-east-1")
                    .env("RCLONE_CONFIG_LARDERBENCH_FORCE_PATH_STYLE", "true")
                    .env(
                        "RCLONE_CONFIG_LARDERBENCH_ACCESS_KEY_ID",
                        larder_tests::ACCESS_KEY,
                    )
                    .env(
                        "RCLONE_CONFIG_LARDERBENCH_SECRET_ACCESS_KEY",
                        larder_tests::SECRET_KEY,
                    );
                Ok(Mounted::Peer(PeerProcess::spawn(
                    command,
                    self.mount_dir(),
                    &self.dir.join("rclone.log"),
                )?))
            }
            System::S3fs => {
                std::fs::create_dir_all(self.cache_dir())?;
                // s3fs refuses a password file that others can read.
                let passwd = self.dir.join("passwd");
                let _ = std::fs::remove_file(&passwd);
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&passwd)?
                    .write_all(
                        format!("{}:{}", larder_tests::ACCESS_KEY, larder_tests::SECRET_KEY).as_bytes(),
                    )?;
                let mut command = Command::new(&self.bin);
                command
                    .arg(&bucket)
                    .arg(self.mount_dir())
                    .arg("-f")
                    .arg("-o")
                    .arg(format!(
                        "ro,url={},use_path_request_style,passwd_file={},use_cache={}",
                        origin.endpoint(),
                        passwd.display(),
                        self.cache_dir().display()
                    ));
                Ok(Mounted::Peer(PeerProcess::spawn(
                    command,
                    self.mount_dir(),
                    &self.dir.join("s3fs.log"),
                )?))
            }
        }
    }
}

/// Whether rclone's metadata under `meta` (one JSON file per cached file, at
/// `<remote>/<bucket>/<key>`) says it holds all `size` bytes of `key`.
fn rclone_holds(meta: &Path, key: &str, size: u64) -> bool {
    /// The part of rclone's item metadata read here.
    #[derive(serde::Deserialize)]
    struct Item {
        #[serde(rename = "Rs")]
        ranges: Option<Vec<Range>>,
    }
    #[derive(serde::Deserialize)]
    struct Range {
        #[serde(rename = "Pos")]
        pos: u64,
        #[serde(rename = "Size")]
        size: u64,
    }
    let Ok(remotes) = std::fs::read_dir(meta) else {
        return false;
    };
    remotes.flatten().any(|remote| {
        let Ok(buckets) = std::fs::read_dir(remote.path()) else {
            return false;
        };
        buckets.flatten().any(|bucket| {
            std::fs::read(bucket.path().join(key))
                .ok()
                .and_then(|json| serde_json::from_slice::<Item>(&json).ok())
                .and_then(|item| item.ranges)
                .is_some_and(|ranges| ranges.iter().any(|r| r.pos == 0 && r.size >= size))
        })
    })
}

/// What a warm run reads through: a system restarted on the cache its cold run filled, or,
/// for the limit, no mount at all (the local copy).
#[derive(Debug)]
pub(crate) struct WarmRun {
    mount: Option<Mounted>,
    pub(crate) system: System,
}

impl WarmRun {
    /// Starts `setup`'s system over `store`; no setup, the limit.
    pub(crate) fn start(setup: Option<&Setup>, store: &Origin) -> anyhow::Result<Self> {
        Ok(Self {
            mount: setup.map(|s| s.start(store)).transpose()?,
            system: setup.map_or(System::Limit, |s| s.system),
        })
    }

    /// The process serving the mount; None for the limit.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.mount.as_ref().and_then(Mounted::pid)
    }

    /// Stops the mount, if there is one.
    pub(crate) fn stop(self) -> anyhow::Result<()> {
        self.mount.map_or(Ok(()), Mounted::stop)
    }
}

/// A running mount. Dropped, its process is killed and its mount detached.
#[derive(Debug)]
pub(crate) enum Mounted {
    Larder(DaemonProcess),
    Peer(PeerProcess),
}

impl Mounted {
    /// The process serving the mount.
    pub(crate) fn pid(&self) -> Option<u32> {
        match self {
            Mounted::Larder(daemon) => daemon.pid(),
            Mounted::Peer(peer) => peer.child.as_ref().map(Child::id),
        }
    }

    /// Stops the process with SIGTERM and waits until it has exited and its mount is gone.
    pub(crate) fn stop(self) -> anyhow::Result<()> {
        match self {
            Mounted::Larder(daemon) => {
                let status = daemon.stop()?;
                anyhow::ensure!(status.success(), "larder daemon exited with {status}");
                Ok(())
            }
            Mounted::Peer(peer) => peer.stop(),
        }
    }
}

/// A peer's mount process, started in the foreground, its output in a log file.
#[derive(Debug)]
pub(crate) struct PeerProcess {
    child: Option<Child>,
    mount: PathBuf,
}

impl PeerProcess {
    /// Runs `command` and waits until `mount` appears in the mount table.
    fn spawn(mut command: Command, mount: PathBuf, log: &Path) -> anyhow::Result<Self> {
        // A mount left by an earlier run that was killed: ours, so detach it.
        if is_mounted(&mount) {
            detach(&mount);
        }
        std::fs::create_dir_all(&mount)?;
        let child = command
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .with_context(|| format!("starting {:?}", command.get_program()))?;
        let mut peer = Self {
            child: Some(child),
            mount,
        };
        let started = Instant::now();
        while !is_mounted(&peer.mount) {
            if let Some(status) = peer.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                let log = std::fs::read_to_string(log).unwrap_or_default();
                bail!(
                    "{:?} exited with {status} before mounting:\n{log}",
                    command.get_program()
                );
            }
            if started.elapsed() > MOUNT_TIMEOUT {
                bail!(
                    "{:?} did not mount within {MOUNT_TIMEOUT:?}",
                    command.get_program()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(peer)
    }

    fn stop(mut self) -> anyhow::Result<()> {
        let mut child = self.child.take().context("already stopped")?;
        // SAFETY: signals our own child by its pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let started = Instant::now();
        while child.try_wait()?.is_none() {
            if started.elapsed() > MOUNT_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the mount process did not stop within {MOUNT_TIMEOUT:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Both peers unmount on SIGTERM; if one did not, Drop detaches the mount.
        Ok(())
    }
}

/// Detaches a mount of ours, even with a reader blocked inside.
fn detach(mount: &Path) {
    let _ = Command::new("umount").arg("-l").arg(mount).status();
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if is_mounted(&self.mount) {
            detach(&self.mount);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rclone_holds_a_file_once_its_metadata_covers_it() {
        let meta = tempfile::tempdir().unwrap();
        let dir = meta.path().join("larderbench{abcde}").join("bucket");
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!rclone_holds(meta.path(), "f", 100));
        let item = |ranges: &str| format!(r#"{{"Size": 100, "Rs": {ranges}, "Dirty": false}}"#);
        std::fs::write(dir.join("f"), item("null")).unwrap();
        assert!(!rclone_holds(meta.path(), "f", 100));
        std::fs::write(dir.join("f"), item(r#"[{"Pos": 0, "Size": 60}]"#)).unwrap();
        assert!(!rclone_holds(meta.path(), "f", 100));
        std::fs::write(dir.join("f"), item(r#"[{"Pos": 0, "Size": 100}]"#)).unwrap();
        assert!(rclone_holds(meta.path(), "f", 100));
        assert!(!rclone_holds(meta.path(), "g", 100));
    }
}
