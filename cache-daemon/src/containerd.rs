//! The `hosts.toml` files that make containerd pull the configured registries through the
//! node's mirror, and straight from the registry when the mirror does not answer (containerd
//! tries the hosts in order, then the `server`): written by `larder containerd-config`, and by
//! the daemon itself while its mirror serves when `registry.containerd_hosts_dir` is set.
//!
//! Every file Larder writes begins with [`MARKER`]. A `hosts.toml` without it is someone
//! else's: Larder never replaces or removes it.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::bail;
use larder_config::{ConfigArgs, RegistryUpstream};

/// The first line of every `hosts.toml` Larder writes, and the only sign it looks for before
/// replacing or removing one: delete the line and the file is yours.
pub const MARKER: &str =
    "# Written by Larder, which replaces or removes this file; delete this line to keep it.";

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

/// A `hosts.toml` that could not be read, written or removed.
#[derive(Debug, thiserror::Error)]
#[error("containerd's hosts file {path}: {source}")]
pub struct HostsError {
    /// The file (or its directory).
    pub path: PathBuf,
    /// The OS error.
    pub source: io::Error,
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

/// Whether the file at `path` is one Larder wrote: it begins with [`MARKER`]. A missing file,
/// or one that is not text, is not.
fn written_by_larder(path: &Path) -> Result<bool, HostsError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text.lines().next() == Some(MARKER)),
        Err(error) if matches!(error.kind(), io::ErrorKind::NotFound | io::ErrorKind::InvalidData) => {
            Ok(false)
        }
        Err(source) => Err(HostsError {
            path: path.to_owned(),
            source,
        }),
    }
}

/// What writing the `hosts.toml` files did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// The files written: new, or replacing one Larder wrote before.
    pub written: Vec<PathBuf>,
    /// The files left as they were: someone else's (no [`MARKER`]).
    pub not_ours: Vec<PathBuf>,
}

/// Writes `dir/<host>/hosts.toml` for each of `upstreams`, through the mirror at `mirror`, and
/// adds each to `done` (on an error, those written before it are there). Each is written whole
/// to a file beside it and renamed over it, so containerd never reads half of one; a
/// `hosts.toml` that Larder did not write is left as it is.
pub fn write_hosts_files(
    dir: &Path,
    upstreams: &[RegistryUpstream],
    mirror: SocketAddr,
    done: &mut Written,
) -> Result<(), HostsError> {
    for upstream in upstreams {
        let host_dir = dir.join(&upstream.host);
        let path = host_dir.join("hosts.toml");
        if path.exists() && !written_by_larder(&path)? {
            done.not_ours.push(path);
            continue;
        }
        let failed = |path: &Path| {
            let path = path.to_owned();
            move |source| HostsError { path, source }
        };
        std::fs::create_dir_all(&host_dir).map_err(failed(&host_dir))?;
        // containerd reads only hosts.toml (and certificates) in a host's directory.
        let partial = host_dir.join(".hosts.toml.larder");
        let text = hosts_toml(&upstream.host, &upstream.url, mirror);
        std::fs::write(&partial, text).map_err(failed(&partial))?;
        std::fs::rename(&partial, &path).map_err(failed(&path))?;
        done.written.push(path);
    }
    Ok(())
}

/// Removes each of `files` that Larder wrote (read again: a file made someone else's since is
/// kept), and its directory if that is then empty. Returns the files removed.
pub fn remove_hosts_files(files: &[PathBuf]) -> Result<Vec<PathBuf>, HostsError> {
    let mut removed = Vec::new();
    for path in files {
        if !written_by_larder(path)? {
            continue;
        }
        std::fs::remove_file(path).map_err(|source| HostsError {
            path: path.clone(),
            source,
        })?;
        if let Some(host_dir) = path.parent() {
            // Fails, and keeps it, unless it is empty.
            let _ = std::fs::remove_dir(host_dir);
        }
        removed.push(path.clone());
    }
    Ok(removed)
}

/// The `hosts.toml` files the daemon keeps while its mirror serves: written when made, removed
/// when dropped (at SIGTERM, or when the daemon fails to start after writing them).
#[derive(Debug)]
pub struct MirrorHostsFiles {
    written: Vec<PathBuf>,
}

impl MirrorHostsFiles {
    /// Writes the files of `upstreams` in containerd's hosts directory `dir`, through the
    /// mirror listening at `mirror`; says in the log which it wrote and which it left alone.
    pub fn write(dir: &Path, upstreams: &[RegistryUpstream], mirror: SocketAddr) -> Result<Self, HostsError> {
        let mut done = Written::default();
        let result = write_hosts_files(dir, upstreams, mirror, &mut done);
        // Built first, so that the files written before an error are removed with it.
        let files = Self {
            written: done.written,
        };
        result?;
        for path in &done.not_ours {
            tracing::warn!(
                path = %path.display(),
                "containerd's hosts.toml for this registry was not written by Larder: left as it is, so containerd pulls the registry as that file says, not through the mirror"
            );
        }
        if !files.written.is_empty() {
            tracing::info!(
                files = ?files.written,
                "containerd pulls these registries through the mirror until the daemon stops"
            );
        }
        Ok(files)
    }
}

impl Drop for MirrorHostsFiles {
    fn drop(&mut self) {
        match remove_hosts_files(&self.written) {
            Ok(removed) if !removed.is_empty() => tracing::info!(
                files = ?removed,
                "removed containerd's hosts.toml files: containerd pulls straight from the registries"
            ),
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "cannot remove containerd's hosts.toml files"),
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
    let mut done = Written::default();
    let result = write_hosts_files(dir, &registry.upstreams, mirror, &mut done);
    for path in &done.written {
        println!("{}", path.display());
    }
    result?;
    if !done.not_ours.is_empty() {
        let paths: Vec<String> = done.not_ours.iter().map(|p| p.display().to_string()).collect();
        bail!(
            "left as they are, not written by Larder (their first line is not {MARKER:?}): {}",
            paths.join(", ")
        );
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

    #[test]
    fn only_files_larder_wrote_are_replaced_or_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mirror = "127.0.0.1:7471".parse().unwrap();
        let path = |host: &str| dir.path().join(host).join("hosts.toml");
        // The operator's own file for one of the upstreams, and one for another registry.
        let theirs = "server = \"https://nvcr.io\"\n";
        for host in ["nvcr.io", "quay.io"] {
            std::fs::create_dir_all(dir.path().join(host)).unwrap();
            std::fs::write(path(host), theirs).unwrap();
        }

        let mut done = Written::default();
        let hosts = upstreams(&["nvcr.io", "docker.io", "registry.local:5000=http://10.0.0.5:5000"]);
        write_hosts_files(dir.path(), &hosts, mirror, &mut done).unwrap();
        assert_eq!(done.not_ours, [path("nvcr.io")]);
        assert_eq!(done.written, [path("docker.io"), path("registry.local:5000")]);
        assert_eq!(std::fs::read_to_string(path("nvcr.io")).unwrap(), theirs);
        let ours = std::fs::read_to_string(path("registry.local:5000")).unwrap();
        assert_eq!(
            ours,
            hosts_toml("registry.local:5000", "http://10.0.0.5:5000", mirror)
        );
        // Written again over its own files, with nothing left beside them.
        let mut again = Written::default();
        write_hosts_files(dir.path(), &hosts, mirror, &mut again).unwrap();
        assert_eq!(again, done);
        let beside: Vec<_> = std::fs::read_dir(dir.path().join("docker.io")).unwrap().collect();
        assert_eq!(beside.len(), 1);

        // A file of Larder's that the operator took over (the marker line deleted) is kept.
        let taken = ours.replacen(&format!("{MARKER}\n"), "", 1);
        std::fs::write(path("registry.local:5000"), &taken).unwrap();
        let asked: Vec<PathBuf> = [&done.written[..], &done.not_ours[..], &[path("quay.io")]].concat();
        let removed = remove_hosts_files(&asked).unwrap();
        assert_eq!(removed, [path("docker.io")]);
        assert!(
            !dir.path().join("docker.io").exists(),
            "its directory was left empty"
        );
        assert_eq!(
            std::fs::read_to_string(path("registry.local:5000")).unwrap(),
            taken
        );
        assert_eq!(std::fs::read_to_string(path("nvcr.io")).unwrap(), theirs);
        assert_eq!(std::fs::read_to_string(path("quay.io")).unwrap(), theirs);
    }

    #[test]
    fn the_daemons_files_go_when_it_stops_and_when_it_fails_part_way() {
        let dir = tempfile::tempdir().unwrap();
        let mirror = "127.0.0.1:7471".parse().unwrap();
        let files = MirrorHostsFiles::write(dir.path(), &upstreams(&["nvcr.io"]), mirror).unwrap();
        assert!(dir.path().join("nvcr.io/hosts.toml").exists());
        drop(files);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        // The second registry's directory is a file: nothing of the first is left behind.
        std::fs::write(dir.path().join("quay.io"), "").unwrap();
        let error =
            MirrorHostsFiles::write(dir.path(), &upstreams(&["nvcr.io", "quay.io"]), mirror).unwrap_err();
        assert!(error.path.ends_with("quay.io"), "{error}");
        assert!(!dir.path().join("nvcr.io").exists());
    }
}
