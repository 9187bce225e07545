//! Several `larder daemon` processes as one rack: each on a loopback address of its own
//! (127.0.0.11, .12, ...), with the same cluster key and the same source, finding each other
//! by `--peers` (every member listed) or by `--peer-dns` (a name the test's DNS server
//! answers, every member on one port, as the pods behind a headless Service).

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use crate::daemon::DaemonProcess;
use crate::{Bucket, free_port};

/// The loopback address of member `index`.
pub fn member_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 11 + index as u8)
}

/// A port free on the addresses of members `0..n` alike when asked.
fn common_free_port(n: usize) -> anyhow::Result<u16> {
    for _ in 0..20 {
        let port = free_port(member_ip(0))?;
        if (1..n).all(|i| TcpListener::bind(SocketAddr::from((member_ip(i), port))).is_ok()) {
            return Ok(port);
        }
    }
    anyhow::bail!("no port free on all of {n} member addresses")
}

/// Writes a cluster key file (mode 0600) of 64 hex digits into `dir`.
pub fn write_key_file(dir: &Path, secret: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("cluster.key");
    std::fs::write(&path, secret)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(path)
}

/// The flags that make a daemon member `id` of `rack` (none: no `--rack`), listening on
/// `listen`, with the key in `key_file`; how it finds the other members is the caller's
/// (`--peers` or `--peer-dns`).
pub fn member_args(id: &str, rack: Option<&str>, listen: &str, key_file: &Path) -> Vec<String> {
    let key_file = key_file.to_string_lossy();
    let mut args = [
        "--node-id",
        id,
        "--peer-listen",
        listen,
        "--cluster-key-file",
        &key_file,
    ]
    .map(str::to_owned)
    .to_vec();
    if let Some(rack) = rack {
        args.extend(["--rack".to_owned(), rack.to_owned()]);
    }
    args
}

/// How a rack's members are started and listed in `--peers`: each optional part of the
/// README's grammar (`ID=HOST:PORT[@RACK]`, `--rack`) is a shape users write.
#[derive(Debug, Clone, Copy)]
pub struct Listing {
    /// Every member's peer listener on 127.0.0.1, each on a port of its own (one address,
    /// many ports), rather than an address each.
    pub one_address: bool,
    /// Members listed as `ID=HOST:PORT@r1`, rather than `ID=HOST:PORT`.
    pub racks_listed: bool,
    /// Each node started with `--rack r1`, rather than with no `--rack`.
    pub node_rack: bool,
    /// How many racks the nodes are split into, in order (`r1`, `r2`, ...; the first nodes in
    /// `r1`).
    pub racks: usize,
}

impl Listing {
    /// The harness's own shape: an address each, every rack given.
    pub const HARNESS: Self = Self {
        one_address: false,
        racks_listed: true,
        node_rack: true,
        racks: 1,
    };
}

/// A CA and a certificate issued by it for the name every member's certificate carries
/// (`larder-peer`), made with the `openssl` command: the files of a rack over TLS.
#[derive(Debug)]
pub struct TlsFiles {
    /// The CA's certificate (PEM).
    pub ca: PathBuf,
    /// The members' certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl TlsFiles {
    /// Makes a new CA and certificate in `dir` (`prefix` names the files).
    pub fn make(dir: &Path, prefix: &str) -> anyhow::Result<Self> {
        let path = |name: &str| dir.join(format!("{prefix}-{name}"));
        let files = Self {
            ca: path("ca.pem"),
            cert: path("cert.pem"),
            key: path("key.pem"),
        };
        let (ca_key, request) = (path("ca-key.pem"), path("cert.csr"));
        let extensions = path("ext.cnf");
        std::fs::write(
            &extensions,
            "subjectAltName = DNS:larder-peer\nextendedKeyUsage = serverAuth\n",
        )?;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509"],
                &ec[..],
                &["-days", "2", "-subj", "/CN=larder test CA"],
            ]
            .concat(),
            &[("-keyout", &ca_key), ("-out", &files.ca)],
        )?;
        openssl(
            &[&["req"], &ec[..], &["-subj", "/CN=larder-peer"]].concat(),
            &[("-keyout", &files.key), ("-out", &request)],
        )?;
        openssl(
            &["x509", "-req", "-days", "2", "-CAcreateserial"],
            &[
                ("-in", &request),
                ("-CA", &files.ca),
                ("-CAkey", &ca_key),
                ("-extfile", &extensions),
                ("-out", &files.cert),
            ],
        )?;
        Ok(files)
    }

    /// The flags that make a member serve and ask over TLS with these files.
    pub fn args(&self) -> Vec<String> {
        let [ca, cert, key] = [&self.ca, &self.cert, &self.key].map(|p| p.to_string_lossy().into_owned());
        [
            "--peer-tls-ca".into(),
            ca,
            "--peer-tls-cert".into(),
            cert,
            "--peer-tls-key".into(),
            key,
        ]
        .to_vec()
    }
}

/// Runs `openssl` with `args` and then each flag with its path; fails with its output.
fn openssl(args: &[&str], paths: &[(&str, &PathBuf)]) -> anyhow::Result<()> {
    let mut command = std::process::Command::new("openssl");
    command.args(args);
    for (flag, path) in paths {
        command.arg(flag).arg(path);
    }
    let output = command.output()?;
    anyhow::ensure!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// A secret for tests.
pub const SECRET: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// The daemons of one rack, and their directories.
#[derive(Debug)]
pub struct Rack {
    /// The members' daemons, by index; `None` once killed.
    pub daemons: Vec<Option<DaemonProcess>>,
    /// The members' peer addresses.
    pub addresses: Vec<SocketAddr>,
    /// The members' metrics addresses.
    pub metrics: Vec<SocketAddr>,
    /// The members' registry mirror addresses (serving only when `extra` names upstreams).
    pub registries: Vec<SocketAddr>,
    /// The cluster key file.
    pub key_file: PathBuf,
    /// Where each member keeps its mount, cache and log.
    pub dirs: Vec<PathBuf>,
    _root: TempDir,
}

impl Rack {
    /// Starts `n` members named `n0`, `n1`, ... in rack `r1` serving `bucket`, each with
    /// `extra` arguments and every member in `--peers`, plus `others` (`ID=HOST:PORT` of
    /// members started elsewhere).
    pub fn start(
        bin: &Path,
        bucket: &dyn Bucket,
        n: usize,
        extra: &[&str],
        others: &[String],
    ) -> anyhow::Result<Self> {
        Self::start_listed(bin, bucket, n, extra, others, Listing::HARNESS)
    }

    /// Starts members as [`Rack::start`] does, listed and started in the shape `listing`.
    pub fn start_listed(
        bin: &Path,
        bucket: &dyn Bucket,
        n: usize,
        extra: &[&str],
        others: &[String],
        listing: Listing,
    ) -> anyhow::Result<Self> {
        Self::listed(bin, bucket, n, extra, others, listing, &[])
    }

    fn listed(
        bin: &Path,
        bucket: &dyn Bucket,
        n: usize,
        extra: &[&str],
        others: &[String],
        listing: Listing,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let ip = |i| {
            if listing.one_address {
                Ipv4Addr::LOCALHOST
            } else {
                member_ip(i)
            }
        };
        let addresses = (0..n)
            .map(|i| Ok(SocketAddr::from((ip(i), free_port(ip(i))?))))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let label = |i: usize| format!("r{}", 1 + i * listing.racks.max(1) / n.max(1));
        let mut members: Vec<String> = addresses
            .iter()
            .enumerate()
            .map(|(i, address)| match listing.racks_listed {
                true => format!("n{i}={address}@{}", label(i)),
                false => format!("n{i}={address}"),
            })
            .collect();
        members.extend(others.iter().cloned());
        let racks = (0..n).map(|i| listing.node_rack.then(|| label(i))).collect();
        let peers = ["--peers".to_owned(), members.join(",")];
        Self::launch(bin, bucket, addresses, racks, extra, &|_| peers.to_vec(), env)
    }

    /// Starts members as [`Rack::start`] does, with the environment variables `env` set (an
    /// origin's endpoint and credentials).
    pub fn start_with_env(
        bin: &Path,
        bucket: &dyn Bucket,
        n: usize,
        extra: &[&str],
        others: &[String],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        Self::listed(bin, bucket, n, extra, others, Listing::HARNESS, env)
    }

    /// Starts `n` members as [`Rack::start`] does, all listening on one port, finding each
    /// other by resolving `name` at the DNS server `server` every second.
    pub fn start_dns(
        bin: &Path,
        bucket: &dyn Bucket,
        n: usize,
        extra: &[&str],
        name: &str,
        server: SocketAddr,
    ) -> anyhow::Result<Self> {
        let port = common_free_port(n)?;
        let addresses: Vec<_> = (0..n).map(|i| SocketAddr::from((member_ip(i), port))).collect();
        let (dns, server) = (format!("{name}:{port}"), server.to_string());
        let discovery = [
            "--peer-dns",
            &dns,
            "--peer-dns-server",
            &server,
            "--peer-dns-interval",
            "1s",
        ];
        let racks = vec![Some("r1".to_owned()); addresses.len()];
        let discovery = discovery.map(str::to_owned);
        Self::launch(bin, bucket, addresses, racks, extra, &|_| discovery.to_vec(), &[])
    }

    /// Starts member `i` at `addresses[i]` in `racks[i]` with the `--peers` list `lists[i]`
    /// (`ID=HOST:PORT@RACK,...`): members may see one another at different addresses (a proxy
    /// between racks, say).
    pub fn start_with_lists(
        bin: &Path,
        bucket: &dyn Bucket,
        addresses: Vec<SocketAddr>,
        racks: Vec<String>,
        lists: Vec<String>,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let racks = racks.into_iter().map(Some).collect();
        let discovery = |i: usize| vec!["--peers".to_owned(), lists[i].clone()];
        Self::launch(bin, bucket, addresses, racks, extra, &discovery, &[])
    }

    /// Starts a member at each of `addresses`, member `i` in `racks[i]` (none: no `--rack`),
    /// with `extra` arguments, `discovery(i)` and the environment variables `env`.
    fn launch(
        bin: &Path,
        bucket: &dyn Bucket,
        addresses: Vec<SocketAddr>,
        racks: Vec<Option<String>>,
        extra: &[&str],
        discovery: &dyn Fn(usize) -> Vec<String>,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let root = tempfile::tempdir()?;
        let key_file = write_key_file(root.path(), SECRET)?;
        let metrics = (0..addresses.len())
            .map(|i| Ok(SocketAddr::from((member_ip(i), free_port(member_ip(i))?))))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let registries = (0..addresses.len())
            .map(|i| Ok(SocketAddr::from((member_ip(i), free_port(member_ip(i))?))))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut daemons = Vec::new();
        let mut dirs = Vec::new();
        for (i, address) in addresses.iter().enumerate() {
            let dir = root.path().join(format!("n{i}"));
            std::fs::create_dir_all(&dir)?;
            let mut owned = vec![
                "--metrics-listen".to_owned(),
                metrics[i].to_string(),
                "--registry-listen".to_owned(),
                registries[i].to_string(),
            ];
            owned.extend(member_args(
                &format!("n{i}"),
                racks[i].as_deref(),
                &address.to_string(),
                &key_file,
            ));
            owned.extend(discovery(i));
            let mut args: Vec<&str> = owned.iter().map(String::as_str).collect();
            args.extend_from_slice(extra);
            // Failed peer requests are logged at debug: the log says why a run went elsewhere.
            let mut vars = vec![("LARDER_LOG", "info,larder_peers=debug")];
            vars.extend_from_slice(env);
            daemons.push(Some(DaemonProcess::start_with_env(
                bin, bucket, &dir, &args, &vars,
            )?));
            dirs.push(dir);
        }
        Ok(Self {
            daemons,
            addresses,
            metrics,
            registries,
            key_file,
            dirs,
            _root: root,
        })
    }

    /// Member `index`'s daemon.
    pub fn daemon(&self, index: usize) -> &DaemonProcess {
        self.daemons[index]
            .as_ref()
            .unwrap_or_else(|| panic!("member {index} is gone"))
    }

    /// Kills member `index` with SIGKILL and detaches the dead mount it leaves.
    pub fn kill9(&mut self, index: usize) -> anyhow::Result<()> {
        let daemon = self.daemons[index]
            .take()
            .ok_or_else(|| anyhow::anyhow!("member {index} is gone"))?;
        let mount = daemon.mount.clone();
        daemon.kill9()?;
        let path = std::ffi::CString::new(mount.as_os_str().as_encoded_bytes())?;
        // SAFETY: a valid C string; detaches the test's own dead mount.
        if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }

    /// The value of the series `series` (name and labels as Prometheus writes them, e.g.
    /// `larder_peer_requests_total{result="hit"}`) in member `index`'s metrics; 0 if absent.
    pub fn metric(&self, index: usize, series: &str) -> anyhow::Result<f64> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.metrics[index])?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
        stream.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        let value = text
            .lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .map_or(Ok(0.0), str::parse)?;
        Ok(value)
    }

    /// Member `index`'s objects checked against the origin's checksum that ended with
    /// `result`.
    pub fn origin_checks(&self, index: usize, result: &str) -> f64 {
        let series = format!("larder_peer_origin_checks_total{{result=\"{result}\"}}");
        self.metric(index, &series).expect("metrics")
    }

    /// Waits up to a minute for member `index` to count `n` origin checks that ended with
    /// `result`; says whether it did.
    pub fn wait_for_origin_checks(&self, index: usize, result: &str, n: f64) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while self.origin_checks(index, result) < n {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        true
    }

    /// The state of member `id` in member `index`'s status.
    pub fn member_state(&self, index: usize, id: &str) -> String {
        let status = self.daemon(index).status();
        let members = status["peers"]["members"].as_array().cloned().unwrap_or_default();
        let member = members.iter().find(|m| m["id"] == id);
        member.map_or_else(|| format!("missing from {status}"), |m| m["state"].to_string())
    }

    /// Member `index`'s log so far.
    pub fn log(&self, index: usize) -> String {
        std::fs::read_to_string(self.dirs[index].join("daemon.log")).unwrap_or_default()
    }
}
