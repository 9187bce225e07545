//! The `hosts.toml` files that make containerd pull the configured registries through the
//! node's mirror, and straight from the registry when the mirror does not answer (containerd
//! tries the hosts in order, then the `server`): written by `larder containerd-config`, and by
//! the daemon itself while its mirror serves when `registry.containerd_hosts_dir` is set.
//!
//! Every file Larder writes begins with [`MARKER`]. A `hosts.toml` without it is someone
//! else's: Larder never replaces or removes it. Nor does it remove a directory it did not make.
//!
//! The hosts dir is opened once ([`HostsDir`]); everything below it is reached from that
//! descriptor one name at a time with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` (and
//! `mkdirat`, `renameat`, `unlinkat`, which never follow a link in the name they act on), and a
//! registry's name must be one plain directory name. So no link planted in the hosts dir, and
//! no upstream named `.` or `..`, can lead a write or a removal to a file outside it or to a
//! file that is not Larder's. What cannot be written for one registry is that registry's
//! loss alone: the others are written, and the daemon serves.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use anyhow::bail;
use larder_config::{ConfigArgs, RegistryUpstream};
use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// The first line of every `hosts.toml` Larder writes, and the only sign it looks for before
/// replacing or removing one: delete the line and the file is yours.
pub const MARKER: &str =
    "# Written by Larder, which replaces or removes this file; delete this line to keep it.";

/// The file containerd reads in a registry's directory.
const HOSTS_TOML: &str = "hosts.toml";

/// Where a `hosts.toml` is written whole before it is renamed into place, beside it
/// (containerd reads only `hosts.toml` and certificates there).
const PARTIAL: &str = ".hosts.toml.larder";

/// How every name below the hosts dir is resolved: inside it, through no symbolic link.
const BENEATH: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_SYMLINKS);

/// Arguments of `larder containerd-config`.
#[derive(Debug, Clone, clap::Args)]
pub struct ContainerdConfigArgs {
    /// The daemon's configuration: its `[registry]` table says what to write.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Write `DIR/<registry>/hosts.toml` for each upstream (containerd's `config_path`, e.g.
    /// /etc/containerd/certs.d); without it, print them.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// Why a registry's `hosts.toml` could not be written or removed.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    /// The OS refused to open, read, write, rename or remove something.
    #[error("containerd's hosts dir, {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The registry's directory is a symbolic link.
    #[error(
        "{path} is a symbolic link, which Larder does not follow in containerd's hosts dir: nothing written for this registry"
    )]
    Link {
        /// The link.
        path: PathBuf,
    },
    /// A link, or a file Larder did not write, has the name of Larder's temporary file.
    #[error(
        "{path} is in the way (a link, or a file Larder did not write): left as it is, nothing written for this registry"
    )]
    InTheWay {
        /// What is in the way.
        path: PathBuf,
    },
    /// The registry's name is not one plain directory name.
    #[error("registry {host:?} does not name a directory in containerd's hosts dir")]
    NotADirName {
        /// The name.
        host: String,
    },
}

/// The `hosts.toml` of registry `host`, reached at `server`, through the mirror at `mirror`.
pub fn hosts_toml(host: &str, server: &str, mirror: SocketAddr) -> String {
    // An unspecified listen address is reached at loopback on the node.
    let mirror = match mirror.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), mirror.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), mirror.port()),
        _ => mirror,
    };
    format!(
        "{MARKER}\n\
         # Pulls of {host} go through the node's Larder mirror first, and to the registry itself\n\
         # when the mirror does not answer.\n\
         server = \"{server}\"\n\
         \n\
         [host.\"http://{mirror}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
    )
}

/// What is at a name in a registry's directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    Nothing,
    /// A regular file that begins with [`MARKER`].
    Larders,
    /// Anything else: someone else's file, a directory, a link, a device.
    Other,
}

/// A `hosts.toml` Larder wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostsFile {
    /// The registry, which names its directory.
    host: String,
    /// Whether Larder made the registry's directory (and so may remove it when empty).
    made_dir: bool,
    /// The file.
    pub path: PathBuf,
}

/// What writing the `hosts.toml` files did.
#[derive(Debug, Default)]
pub struct Written {
    /// The files written: new, or replacing one Larder wrote before.
    pub written: Vec<HostsFile>,
    /// The files left as they were: someone else's (no [`MARKER`], or not a file).
    pub not_ours: Vec<PathBuf>,
    /// The registries whose file could not be written, and why.
    pub failed: Vec<HostsError>,
}

/// containerd's hosts dir, held open: every path below it is opened from this descriptor.
#[derive(Debug)]
pub struct HostsDir {
    path: PathBuf,
    fd: OwnedFd,
}

/// `openat2(dir, name, flags, mode)` resolved inside `dir` through no link.
fn open_beneath(dir: BorrowedFd<'_>, name: &str, flags: OFlags, mode: Mode) -> Result<OwnedFd, Errno> {
    rustix::fs::openat2(dir, name, flags | OFlags::CLOEXEC, mode, BENEATH)
}

/// An OS error at `path`.
fn io_error(path: &Path) -> impl FnOnce(Errno) -> HostsError + '_ {
    move |errno| HostsError::Io {
        path: path.to_owned(),
        source: errno.into(),
    }
}

/// What is at `name` in the directory `dir` (at `path`), looked at without following a link
/// or waiting on a pipe.
fn found(dir: BorrowedFd<'_>, path: &Path, name: &str) -> Result<Found, HostsError> {
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK;
    let file = match open_beneath(dir, name, flags, Mode::empty()) {
        Ok(fd) => File::from(fd),
        Err(Errno::NOENT) => return Ok(Found::Nothing),
        Err(Errno::LOOP) => return Ok(Found::Other),
        Err(errno) => return Err(io_error(&path.join(name))(errno)),
    };
    let read = |source| HostsError::Io {
        path: path.join(name),
        source,
    };
    if !file.metadata().map_err(read)?.is_file() {
        return Ok(Found::Other);
    }
    let mut head = Vec::new();
    file.take(MARKER.len() as u64 + 2)
        .read_to_end(&mut head)
        .map_err(read)?;
    let marked = head
        .strip_prefix(MARKER.as_bytes())
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(b"\n") || rest.starts_with(b"\r\n"));
    Ok(if marked { Found::Larders } else { Found::Other })
}

impl HostsDir {
    /// Opens containerd's hosts dir at `path`, made first if it is missing (the path itself is
    /// the operator's setting, and may pass through links).
    pub fn open(path: &Path) -> Result<Self, HostsError> {
        std::fs::create_dir_all(path).map_err(|source| HostsError::Io {
            path: path.to_owned(),
            source,
        })?;
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let fd = rustix::fs::open(path, flags, Mode::empty()).map_err(io_error(path))?;
        Ok(Self {
            path: path.to_owned(),
            fd,
        })
    }

    /// The directory of registry `host`, opened without following a link.
    fn registry_dir(&self, host: &str) -> Result<OwnedFd, HostsError> {
        let path = self.path.join(host);
        open_beneath(
            self.fd.as_fd(),
            host,
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
        )
        .map_err(|errno| match errno {
            Errno::LOOP => HostsError::Link { path },
            errno => io_error(&path)(errno),
        })
    }

    /// Writes the `hosts.toml` of registry `host` with `text`, unless one that is not Larder's
    /// is there (`Ok(None)`).
    fn write(&self, host: &str, text: &str) -> Result<Option<HostsFile>, HostsError> {
        let mut names = Path::new(host).components();
        if !(matches!(names.next(), Some(Component::Normal(name)) if name == host) && names.next().is_none())
        {
            return Err(HostsError::NotADirName {
                host: host.to_owned(),
            });
        }
        let dir_path = self.path.join(host);
        let made_dir = match rustix::fs::mkdirat(self.fd.as_fd(), host, Mode::from_raw_mode(0o755)) {
            Ok(()) => true,
            Err(Errno::EXIST) => false,
            Err(errno) => return Err(io_error(&dir_path)(errno)),
        };
        let written = self.registry_dir(host).and_then(|dir| {
            let path = dir_path.join(HOSTS_TOML);
            if found(dir.as_fd(), &dir_path, HOSTS_TOML)? == Found::Other {
                return Ok(None);
            }
            write_partial(dir.as_fd(), &dir_path, text)?;
            rustix::fs::renameat(dir.as_fd(), PARTIAL, dir.as_fd(), HOSTS_TOML).map_err(io_error(&path))?;
            Ok(Some(HostsFile {
                host: host.to_owned(),
                made_dir,
                path,
            }))
        });
        if made_dir && !matches!(written, Ok(Some(_))) {
            // Fails, and keeps it, unless it is empty.
            let _ = rustix::fs::unlinkat(self.fd.as_fd(), host, AtFlags::REMOVEDIR);
        }
        written
    }

    /// Removes `file` if it still begins with [`MARKER`] (a file made someone else's since is
    /// kept), and its directory if Larder made it and it is then empty. Returns whether it
    /// removed the file.
    fn remove(&self, file: &HostsFile) -> Result<bool, HostsError> {
        let dir = match self.registry_dir(&file.host) {
            Ok(dir) => dir,
            Err(HostsError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(false);
            }
            Err(error) => return Err(error),
        };
        let dir_path = self.path.join(&file.host);
        if found(dir.as_fd(), &dir_path, HOSTS_TOML)? != Found::Larders {
            return Ok(false);
        }
        rustix::fs::unlinkat(dir.as_fd(), HOSTS_TOML, AtFlags::empty()).map_err(io_error(&file.path))?;
        if file.made_dir {
            // Fails, and keeps it, unless it is empty.
            let _ = rustix::fs::unlinkat(self.fd.as_fd(), file.host.as_str(), AtFlags::REMOVEDIR);
        }
        Ok(true)
    }
}

/// Writes `text` to a new [`PARTIAL`] in the registry directory `dir` (at `dir_path`). One
/// left there by Larder before (a crash) is replaced; anything else there is left alone, and
/// nothing is written.
fn write_partial(dir: BorrowedFd<'_>, dir_path: &Path, text: &str) -> Result<(), HostsError> {
    let path = dir_path.join(PARTIAL);
    let create = || {
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL;
        open_beneath(dir, PARTIAL, flags, Mode::from_raw_mode(0o644))
    };
    let fd = match create() {
        Err(Errno::EXIST) => {
            if found(dir, dir_path, PARTIAL)? != Found::Larders {
                return Err(HostsError::InTheWay { path });
            }
            rustix::fs::unlinkat(dir, PARTIAL, AtFlags::empty()).map_err(io_error(&path))?;
            create()
        }
        created => created,
    }
    .map_err(io_error(&path))?;
    let written = File::from(fd).write_all(text.as_bytes());
    written.map_err(|source| {
        // Ours, just made: no half-written file stays.
        let _ = rustix::fs::unlinkat(dir, PARTIAL, AtFlags::empty());
        HostsError::Io { path, source }
    })
}

/// Writes `<registry>/hosts.toml` in `dir` for each of `upstreams`, through the mirror at
/// `mirror`. Each is written whole to a file beside it and renamed over it, so containerd never
/// reads half of one; a `hosts.toml` that Larder did not write is left as it is; a registry
/// whose file cannot be written is listed with why, and the others are written.
pub fn write_hosts_files(dir: &HostsDir, upstreams: &[RegistryUpstream], mirror: SocketAddr) -> Written {
    let mut done = Written::default();
    for upstream in upstreams {
        let text = hosts_toml(&upstream.host, &upstream.url, mirror);
        match dir.write(&upstream.host, &text) {
            Ok(Some(file)) => done.written.push(file),
            Ok(None) => done.not_ours.push(dir.path.join(&upstream.host).join(HOSTS_TOML)),
            Err(error) => done.failed.push(error),
        }
    }
    done
}

/// The `hosts.toml` files the daemon keeps while its mirror serves: written when made, removed
/// when dropped (at SIGTERM, or when the daemon fails to start after writing them).
#[derive(Debug)]
pub struct MirrorHostsFiles {
    dir: HostsDir,
    written: Vec<HostsFile>,
}

impl MirrorHostsFiles {
    /// Writes the files of `upstreams` in containerd's hosts directory `dir`, through the
    /// mirror listening at `mirror`; says in the log which it wrote, which it left alone and
    /// which it could not write. `None` when the hosts dir itself cannot be opened (said in
    /// the log): the mirror serves all the same, and containerd pulls as its files say.
    pub fn write(dir: &Path, upstreams: &[RegistryUpstream], mirror: SocketAddr) -> Option<Self> {
        let dir = match HostsDir::open(dir) {
            Ok(dir) => dir,
            Err(error) => {
                tracing::warn!(%error, "cannot keep containerd's hosts.toml files: containerd pulls as its own files say, not through the mirror");
                return None;
            }
        };
        let done = write_hosts_files(&dir, upstreams, mirror);
        for path in &done.not_ours {
            tracing::warn!(
                path = %path.display(),
                "containerd's hosts.toml for this registry was not written by Larder: left as it is, so containerd pulls the registry as that file says, not through the mirror"
            );
        }
        for error in &done.failed {
            tracing::warn!(%error, "cannot write containerd's hosts.toml for a registry: containerd pulls it without the mirror");
        }
        if !done.written.is_empty() {
            let files: Vec<_> = done
                .written
                .iter()
                .map(|f| f.path.display().to_string())
                .collect();
            tracing::info!(
                ?files,
                "containerd pulls these registries through the mirror until the daemon stops"
            );
        }
        Some(Self {
            dir,
            written: done.written,
        })
    }
}

impl Drop for MirrorHostsFiles {
    fn drop(&mut self) {
        let mut removed = Vec::new();
        for file in &self.written {
            match self.dir.remove(file) {
                Ok(true) => removed.push(file.path.display().to_string()),
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, "cannot remove containerd's hosts.toml"),
            }
        }
        if !removed.is_empty() {
            tracing::info!(
                files = ?removed,
                "removed containerd's hosts.toml files: containerd pulls straight from the registries"
            );
        }
    }
}

/// Runs `larder containerd-config`.
pub fn run(args: ContainerdConfigArgs) -> anyhow::Result<()> {
    let config = args.config.load_sources_optional()?;
    let registry = &config.registry;
    let Some(mirror) = registry.listen else {
        bail!(
            "the registry mirror is off (registry.listen = \"off\"): there is nothing to point containerd at"
        );
    };
    if registry.upstreams.is_empty() {
        bail!("no registry is configured upstream (registry.upstreams): there is nothing to write");
    }
    let Some(dir) = &args.dir else {
        for upstream in &registry.upstreams {
            let text = hosts_toml(&upstream.host, &upstream.url, mirror);
            println!("# {}/hosts.toml\n{text}", upstream.host);
        }
        return Ok(());
    };
    let done = write_hosts_files(&HostsDir::open(dir)?, &registry.upstreams, mirror);
    for file in &done.written {
        println!("{}", file.path.display());
    }
    let mut problems: Vec<String> = done.failed.iter().map(ToString::to_string).collect();
    if !done.not_ours.is_empty() {
        let paths: Vec<String> = done.not_ours.iter().map(|p| p.display().to_string()).collect();
        problems.push(format!(
            "left as they are, not written by Larder (their first line is not {MARKER:?}): {}",
            paths.join(", ")
        ));
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstreams(hosts: &[&str]) -> Vec<RegistryUpstream> {
        hosts.iter().map(|host| host.parse().unwrap()).collect()
    }

    #[test]
    fn hosts_toml_puts_the_mirror_first_and_the_registry_as_server() {
        let text = hosts_toml("nvcr.io", "https://nvcr.io", "0.0.0.0:7471".parse().unwrap());
        assert_eq!(text.lines().next(), Some(MARKER));
        let parsed: toml::Value = toml::from_str(&text).unwrap();
        assert_eq!(parsed["server"].as_str(), Some("https://nvcr.io"));
        let host = &parsed["host"]["http://127.0.0.1:7471"];
        assert_eq!(host["capabilities"].as_array().unwrap().len(), 2, "{text}");
    }

    fn paths(written: &Written) -> Vec<PathBuf> {
        written.written.iter().map(|f| f.path.clone()).collect()
    }

    #[test]
    fn only_files_larder_wrote_are_replaced_or_removed() {
        let dir = tempfile::tempdir().unwrap();
        let hosts = HostsDir::open(dir.path()).unwrap();
        let mirror = "127.0.0.1:7471".parse().unwrap();
        let path = |host: &str| dir.path().join(host).join("hosts.toml");
        // The operator's own file for one of the upstreams, and one for another registry.
        let theirs = "server = \"https://nvcr.io\"\n";
        for host in ["nvcr.io", "quay.io"] {
            std::fs::create_dir_all(dir.path().join(host)).unwrap();
            std::fs::write(path(host), theirs).unwrap();
        }

        let upstreams = upstreams(&["nvcr.io", "docker.io", "registry.local:5000=http://10.0.0.5:5000"]);
        let done = write_hosts_files(&hosts, &upstreams, mirror);
        assert_eq!(done.not_ours, [path("nvcr.io")]);
        assert_eq!(paths(&done), [path("docker.io"), path("registry.local:5000")]);
        assert!(done.failed.is_empty(), "{:?}", done.failed);
        assert_eq!(std::fs::read_to_string(path("nvcr.io")).unwrap(), theirs);
        let ours = std::fs::read_to_string(path("registry.local:5000")).unwrap();
        assert_eq!(
            ours,
            hosts_toml("registry.local:5000", "http://10.0.0.5:5000", mirror)
        );
        // Written again over its own files, with nothing left beside them; the directories
        // are the first run's, not the second's.
        let again = write_hosts_files(&hosts, &upstreams, mirror);
        assert_eq!(paths(&again), paths(&done));
        assert!(again.written.iter().all(|f| !f.made_dir));
        let beside: Vec<_> = std::fs::read_dir(dir.path().join("docker.io")).unwrap().collect();
        assert_eq!(beside.len(), 1);

        // A file of Larder's that the operator took over (the marker line deleted) is kept.
        let taken = ours.replacen(&format!("{MARKER}\n"), "", 1);
        std::fs::write(path("registry.local:5000"), &taken).unwrap();
        let removed: Vec<bool> = done.written.iter().map(|f| hosts.remove(f).unwrap()).collect();
        assert_eq!(removed, [true, false]);
        assert!(
            !dir.path().join("docker.io").exists(),
            "the directory Larder made was left empty"
        );
        assert_eq!(
            std::fs::read_to_string(path("registry.local:5000")).unwrap(),
            taken
        );
        assert_eq!(std::fs::read_to_string(path("nvcr.io")).unwrap(), theirs);
        assert_eq!(std::fs::read_to_string(path("quay.io")).unwrap(), theirs);
    }

    #[test]
    fn the_daemons_files_go_when_it_stops_and_one_registrys_trouble_is_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let mirror = "127.0.0.1:7471".parse().unwrap();
        let files = MirrorHostsFiles::write(dir.path(), &upstreams(&["nvcr.io"]), mirror).unwrap();
        assert!(dir.path().join("nvcr.io/hosts.toml").exists());
        drop(files);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        // The first registry's directory is a file: the second's is written all the same.
        std::fs::write(dir.path().join("quay.io"), "").unwrap();
        let files = MirrorHostsFiles::write(dir.path(), &upstreams(&["quay.io", "nvcr.io"]), mirror).unwrap();
        assert!(dir.path().join("nvcr.io/hosts.toml").exists());
        drop(files);
        assert!(!dir.path().join("nvcr.io").exists());
        assert!(dir.path().join("quay.io").is_file());

        // Hosts dir that cannot be made: nothing kept, nothing fails.
        let under_a_file = dir.path().join("quay.io").join("certs.d");
        assert!(MirrorHostsFiles::write(&under_a_file, &upstreams(&["nvcr.io"]), mirror).is_none());
    }

    #[test]
    fn a_name_that_is_not_one_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let hosts = HostsDir::open(&dir.path().join("certs.d")).unwrap();
        for name in ["..", ".", "a/b", ""] {
            let error = hosts.write(name, "x").unwrap_err();
            assert!(
                matches!(error, HostsError::NotADirName { .. }),
                "{name:?}: {error}"
            );
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
