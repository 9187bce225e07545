//! The configuration structs, their defaults and their TOML form.
//!
//! A file looks like this (every key except a source's `name` and `url` may
//! be left out, in which case the default shown is used):
//!
//! ```toml
//! [cache]
//! dir = "/var/cache/larder"
//! capacity = "100GiB"
//! min_free_fraction = 0.05
//! block_size = "4MiB"
//! verify_on_read = true
//! passthrough = true         # FUSE passthrough for fully cached files
//! io_engine = "uring"        # or "psync"
//! io_queue_depth = 64
//! memory_limit = "256MiB"    # block bytes kept in memory (fills, writes, readers' blocks)
//! scrub_rate = "64MiB"       # per second: files handed to the kernel read back and checked
//! disk_recheck = "60s"       # a failing disk quiet this long is probed to see if it works
//!
//! [origin]
//! part_size = "16MiB"
//! concurrency = 16
//! connect_timeout = "3s"
//! request_timeout = "10s"
//! read_deadline = "30s"
//! max_attempts = 5
//! backoff_base = "50ms"
//! backoff_max = "2s"
//! retry_budget_ratio = 0.5
//! readahead_min = "8MiB"
//! readahead_max = "256MiB"
//!
//! [metrics]
//! listen = "127.0.0.1:9464"  # or "off"
//!
//! [mount]
//! path = "/models"
//! shutdown_grace = "10s"     # after SIGTERM, how long open files are still served
//!
//! [control]
//! socket = "/run/larder/control.sock"
//!
//! [peer]                     # rack peers; off unless members or a DNS name are given
//! node_id = "gpu-017"        # default: the host name
//! rack = "r12"
//! listen = "10.0.3.17:7470"  # or "off"
//! members = ["gpu-017=10.0.3.17:7470@r12", "gpu-018=10.0.3.18:7470@r12"]
//! dns = "larder-peers.larder.svc:7470"
//! dns_interval = "10s"
//! dns_server = "10.96.0.10:53"  # default: the system's resolver config
//! cluster_key_file = "/etc/larder/cluster.key"  # or LARDER_CLUSTER_KEY in the environment
//! insecure = false           # serve and ask without a key (a closed network only)
//! first_byte_timeout = "500ms"
//! stall_timeout = "3s"
//! min_rate = "16MiB"         # bytes a second a peer's block must at least come at
//! probe_interval = "10s"     # an idle node says hello to each member this often
//! tls_cert = "/etc/larder/peer.crt"  # the listener speaks TLS (with tls_key)
//! tls_key = "/etc/larder/peer.key"
//! tls_ca = "/etc/larder/peer-ca.crt" # asks members over TLS, checking this CA
//! tls_name = "larder-peer"           # the name every member's certificate carries
//!
//! [warm]                     # warm-node labels; off unless a plan is named
//! plan = "/etc/larder/plans/llama-70b.toml"  # label larder.dev/warm-llama-70b
//! check_interval = "60s"
//! api_server = "https://10.96.0.1:443"  # default: KUBERNETES_SERVICE_HOST and _PORT
//! token_file = "/var/run/secrets/kubernetes.io/serviceaccount/token"
//! ca_file = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
//!
//! [registry]                 # OCI pull-through mirror; off unless upstreams are given
//! listen = "127.0.0.1:7471"  # or "off"
//! upstreams = ["nvcr.io", "docker.io", "registry.local:5000=http://10.0.0.5:5000"]
//! credentials = "/etc/larder/registry-auth.json"  # docker config.json format
//! tag_ttl = "30s"
//! token_hosts = ["auth.docker.io"]  # token services, besides the upstream's, given credentials
//! containerd_hosts_dir = "/etc/containerd/certs.d"  # a hosts.toml per upstream while serving
//!
//! [[source]]
//! name = "datasets"
//! url = "s3://bucket/prefix"
//! immutable = false
//! metadata_ttl = "60s"
//! ```

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::de::IntoDeserializer;
use serde::{Deserialize, Serialize};

use crate::bytesize::ByteSize;
use crate::duration::humantime_serde;
use crate::error::ConfigError;
use crate::redact::{Redacted, SourceUrl};

/// The whole configuration of a Larder daemon.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The local cache: where it lives, how big it is, how it does I/O.
    pub cache: CacheConfig,
    /// How the daemon fetches from the object stores behind the cache.
    pub origin: OriginConfig,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// Where the sources are mounted.
    pub mount: MountConfig,
    /// The control socket of `larder prefetch` and `larder status`.
    pub control: ControlConfig,
    /// Rack peers: who they are, and how this node serves and asks them.
    pub peer: PeerConfig,
    /// Warm-node labels: a plan kept in the cache, and the Kubernetes API server told of it.
    pub warm: WarmConfig,
    /// The OCI registry mirror: where it listens, the registries it pulls through.
    pub registry: RegistryConfig,
    /// The object stores served; written as `[[source]]` tables in TOML.
    /// At least one is required by [`Config::validate`].
    #[serde(rename = "source", skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceConfig>,
}

/// Settings of the on-disk cache (`[cache]`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Directory holding the cached blocks. Created by the daemon if
    /// missing; must not be an existing non-directory.
    /// Default `/var/cache/larder`.
    pub dir: PathBuf,
    /// Most bytes the cache may hold. At least one block. Default 100GiB.
    pub capacity: ByteSize,
    /// Fraction of the cache filesystem that must stay free, in `[0, 1)`.
    /// Default 0.05.
    pub min_free_fraction: f64,
    /// Unit of caching and verification: a power of two from 1MiB to
    /// 64MiB. Default 4MiB.
    pub block_size: ByteSize,
    /// Check every read from disk through the daemon against the block's BLAKE3 (the 16 KiB
    /// groups it touches, with the block's stored tree); a mismatch is a miss (the
    /// block is dropped and fetched again). Default true. Turning it off also gives up the protection against data a power loss
    /// took from the page cache after its record entry was written.
    pub verify_on_read: bool,
    /// Hand the kernel the data file of a fully cached, verified object at open (FUSE
    /// passthrough), so its reads and mmaps skip the daemon. Default true; needs Linux 6.9
    /// and CAP_SYS_ADMIN, and falls back to serving reads itself where the kernel refuses.
    pub passthrough: bool,
    /// Which disk I/O engine to use. Default `uring`.
    pub io_engine: IoEngineKind,
    /// Disk I/O requests in flight, 1 to 4096. Default 64.
    pub io_queue_depth: u32,
    /// Block bytes the daemon keeps in memory: blocks being fetched, waiting for their cache
    /// write, read from disk, or held by readers. Readahead and prefetch keep within it; a
    /// block a reader waits for is fetched even over it. At least two blocks. Default 256MiB:
    /// every one of the default 16 origin requests in flight can hold its 16MiB part.
    pub memory_limit: ByteSize,
    /// Bytes per second the scrub reads back from the cache disk: the blocks of files handed
    /// to the kernel (passthrough), whose reads the daemon never sees, checked against their
    /// BLAKE3, open files first, one pass after another; a block that fails its read or its
    /// check is dropped (fetched again when read) and new opens of its file go through the
    /// daemon. "0" turns it off. Default 64MiB (a pass over 100 GiB of such files takes 27
    /// minutes).
    pub scrub_rate: ByteSize,
    /// How long the cache disk must go without an I/O error before the daemon writes and reads
    /// back a probe page to see whether it works again (it is taken to be failing, and not
    /// ready, meanwhile; a block written also ends it). Default 60s.
    #[serde(with = "humantime_serde")]
    pub disk_recheck: Duration,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("/var/cache/larder"),
            capacity: ByteSize::gib(100),
            min_free_fraction: 0.05,
            block_size: ByteSize::mib(4),
            verify_on_read: true,
            passthrough: true,
            io_engine: IoEngineKind::Uring,
            io_queue_depth: 64,
            memory_limit: ByteSize::mib(256),
            scrub_rate: ByteSize::mib(64),
            disk_recheck: Duration::from_secs(60),
        }
    }
}

/// The disk I/O engine of the cache. Written `"uring"` or `"psync"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IoEngineKind {
    /// Linux io_uring.
    #[default]
    Uring,
    /// Positional reads and writes (`pread`/`pwrite`) on a thread pool.
    Psync,
}

impl IoEngineKind {
    /// The name used in TOML, flags and the environment.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Uring => "uring",
            Self::Psync => "psync",
        }
    }
}

impl fmt::Display for IoEngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for IoEngineKind {
    type Err = String;

    /// Parses with the same rules as the TOML file (lowercase names).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::deserialize(text.trim().into_deserializer())
            .map_err(|err: serde::de::value::Error| err.to_string())
    }
}

/// How the daemon talks to the object stores (`[origin]`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OriginConfig {
    /// Size of one ranged GET: a multiple of `cache.block_size`, at most
    /// 1GiB. Default 16MiB.
    pub part_size: ByteSize,
    /// Ranged GETs in flight per daemon, 1 to 1024. Default 16.
    pub concurrency: usize,
    /// Deadline for opening a connection. Non-zero. Default 3s.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Deadline of one attempt of one request. Non-zero. Default 10s.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// How long a fill may go without a byte, retries included, before its reads fail: counted
    /// from its wait for an origin slot (restarted while the fills ahead of it receive bytes),
    /// then from the last byte it received. A quarter of it is how long a fill may take before
    /// the origin's slots are cut. At least `request_timeout`. Default 30s.
    #[serde(with = "humantime_serde")]
    pub read_deadline: Duration,
    /// Attempts per request, first try included, 1 to 20. Default 5.
    pub max_attempts: u32,
    /// First retry delay; zero means retry at once. Default 50ms.
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    /// Cap on the retry delay; at least `backoff_base`. Default 2s.
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// Retries allowed per first attempt (a token bucket, plus 10 a second), 0 to 10. Default
    /// 0.5: an origin failing 30% of requests needs 0.43.
    pub retry_budget_ratio: f64,
    /// Smallest readahead window. Default 8MiB.
    pub readahead_min: ByteSize,
    /// Largest readahead window; at least `readahead_min`. Default 256MiB. The cache uses at
    /// most an eighth of its capacity and half of `cache.memory_limit` (the blocks fetched
    /// ahead are kept in memory for their reader).
    pub readahead_max: ByteSize,
}

impl Default for OriginConfig {
    fn default() -> Self {
        Self {
            part_size: ByteSize::mib(16),
            concurrency: 16,
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(10),
            read_deadline: Duration::from_secs(30),
            max_attempts: 5,
            backoff_base: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            retry_budget_ratio: 0.5,
            readahead_min: ByteSize::mib(8),
            readahead_max: ByteSize::mib(256),
        }
    }
}

/// The Prometheus endpoint (`[metrics]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address and port of the HTTP listener serving `GET /metrics`, e.g. `"127.0.0.1:9464"`
    /// or `"[::]:9464"`; an IP address, not a host name. Written `"off"` (`None`) to serve no
    /// metrics. Default `127.0.0.1:9464`: loopback only, so a node exposes its metrics to the
    /// network only when told to.
    #[serde(with = "listen_serde")]
    pub listen: Option<SocketAddr>,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            listen: Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 9464))),
        }
    }
}

/// Parses a `metrics.listen` value: `"off"`, or an IP address and port.
pub(crate) fn parse_listen(text: &str) -> Result<Option<SocketAddr>, String> {
    match text.trim() {
        "off" => Ok(None),
        address => address
            .parse()
            .map(Some)
            .map_err(|_| "expected an IP address and port such as \"127.0.0.1:9464\", or \"off\"".to_owned()),
    }
}

/// Serde `with` helpers storing `metrics.listen` as text, `"off"` for none.
mod listen_serde {
    use std::net::SocketAddr;

    use serde::{Deserialize, Deserializer, Serializer, de};

    pub(super) fn serialize<S: Serializer>(
        value: &Option<SocketAddr>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(address) => serializer.collect_str(address),
            None => serializer.serialize_str("off"),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<SocketAddr>, D::Error> {
        let text = String::deserialize(deserializer)?;
        super::parse_listen(&text).map_err(|reason| de::Error::custom(format!("{text:?}: {reason}")))
    }
}

/// Where the daemon mounts the tree of sources (`[mount]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MountConfig {
    /// The mount point: an existing directory. Default `/models`.
    pub path: PathBuf,
    /// After SIGTERM the mount is detached at once (new opens no longer reach it) and the
    /// files already open are served for at most this long; the daemon exits when the last
    /// one closes or this has passed, whichever comes first. Zero exits at once. Default 10s.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
}

impl Default for MountConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::from("/models"),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// Where the daemon listens for control requests when nothing else is configured; the
/// clients (`larder prefetch`, `larder status`) look there too.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/larder/control.sock";

/// The control socket (`[control]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ControlConfig {
    /// Unix socket for `larder prefetch` and `larder status`, created 0600. Default
    /// `/run/larder/control.sock`.
    pub socket: PathBuf,
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_CONTROL_SOCKET),
        }
    }
}

/// Rack peers (`[peer]`). Peers are on when `members` or `dns` name any; a node serves its
/// blocks to them when `listen` is set.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeerConfig {
    /// This node's id, unique in the cluster: 1 to 128 characters of `A-Z a-z 0-9 . _ -`.
    /// Empty (the default) takes the host name.
    pub node_id: String,
    /// This node's rack label (same characters, may be empty): runs are owned within the
    /// asker's rack first. Default empty.
    pub rack: String,
    /// Address and port the peer listener binds, or `"off"` (the default).
    #[serde(with = "listen_serde")]
    pub listen: Option<SocketAddr>,
    /// Static members, each `ID=HOST:PORT[@RACK]`; this node may be among them.
    pub members: Vec<PeerMember>,
    /// A DNS name and port, `NAME:PORT`, whose addresses are the members (a headless
    /// Service); re-resolved every `dns_interval`. Each address's node id and rack are
    /// asked of the member itself.
    pub dns: Option<String>,
    /// How often `dns` is resolved again. Default 10s.
    #[serde(with = "humantime_serde")]
    pub dns_interval: Duration,
    /// The DNS server (`ADDR:PORT`, UDP) asked for `dns`, instead of the servers of the
    /// system's resolver config (the default).
    pub dns_server: Option<SocketAddr>,
    /// File holding the cluster secret (at least 32 bytes, mode 0600 or 0400). The variable
    /// `LARDER_CLUSTER_KEY` may hold the secret instead; it is never a flag, so that it stays
    /// out of process listings.
    pub cluster_key_file: Option<PathBuf>,
    /// Serve and ask peers without a cluster key: anyone who can reach the listener can read
    /// cached blocks and feed unauthenticated ones (still checked against sealed manifests).
    /// Default false.
    pub insecure: bool,
    /// How long a peer has to answer a request's head before one block of the run comes from
    /// the origin: the least such deadline, stretched by the peer's recent answer times as
    /// TCP's retransmission timeout is by round trips (at most `stall_timeout`). Default 500ms.
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// How long an answer may go without bytes before the rest of the run goes to the next
    /// candidate or the origin. Default 3s.
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// The least rate, in bytes a second, at which a peer's block must come: each block of an
    /// answer (its header, group values and bytes) must have arrived within `stall_timeout`
    /// plus its size at this rate, counted from the end of the frame before it, or that block
    /// comes from the origin and the member gets a strike (three in a row open its circuit). A
    /// member that trickles its bytes would otherwise keep every gap under `stall_timeout`
    /// and hold its askers' reads forever. Set it below what the origin gives one stream.
    /// `0` turns the floor off. Default 16MiB.
    pub min_rate: ByteSize,
    /// How often each member not heard from meanwhile is sent an authenticated hello, so that
    /// a member that stopped is marked down, and one that is back comes back up, even on a
    /// node no read goes through. `0s` turns the probes off. Default 10s.
    #[serde(with = "humantime_serde")]
    pub probe_interval: Duration,
    /// This node's certificate chain (PEM) for the peer listener: with it (and `tls_key`) the
    /// listener speaks TLS only. Default none.
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// The CA certificates (PEM) members' certificates must chain to: with it this node asks
    /// peers over TLS only. Default none.
    pub tls_ca: Option<PathBuf>,
    /// The name every member's certificate is issued for, checked when asking over TLS
    /// (members are reached by address, so they share one name). Default "larder-peer".
    pub tls_name: String,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            node_id: String::new(),
            rack: String::new(),
            listen: None,
            members: Vec::new(),
            dns: None,
            dns_interval: Duration::from_secs(10),
            dns_server: None,
            cluster_key_file: None,
            insecure: false,
            first_byte_timeout: Duration::from_millis(500),
            stall_timeout: Duration::from_secs(3),
            min_rate: ByteSize::mib(16),
            probe_interval: Duration::from_secs(10),
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            tls_name: "larder-peer".to_owned(),
        }
    }
}

impl PeerConfig {
    /// Whether rack peers are on: some member is named, statically or by DNS.
    pub fn enabled(&self) -> bool {
        !self.members.is_empty() || self.dns.is_some()
    }
}

/// Where a pod finds its service-account token (Kubernetes' standard path).
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// Where a pod finds the cluster's CA certificate (Kubernetes' standard path).
pub const DEFAULT_CA_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

/// Warm-node labels (`[warm]`): with a `plan`, the daemon prefetches it at start, checks every
/// `check_interval` that it is still complete and verified (prefetching it again when not), and
/// labels its own Node `larder.dev/warm-<plan>=true` through the Kubernetes API server while it
/// is, removing the label when it stops being so. The Node is the one named `peer.node_id`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmConfig {
    /// A plan file, the format `larder prefetch --plan` reads (`targets = [...]`, `pin`);
    /// the file name without its extension names the label, so it must be 1 to 58 characters
    /// of `A-Z a-z 0-9 - _ .`, beginning and ending with a letter or digit. Default: none (off).
    pub plan: Option<PathBuf>,
    /// How often the plan's completeness is checked (a listing and a HEAD per object, no
    /// block read). Default 60s.
    #[serde(with = "humantime_serde")]
    pub check_interval: Duration,
    /// The API server's URL (`https://HOST:PORT`; `http://` sends the token in clear, for
    /// tests). Default: none, taken from `KUBERNETES_SERVICE_HOST` and
    /// `KUBERNETES_SERVICE_PORT` as in every pod.
    pub api_server: Option<String>,
    /// The service-account token, read again for every request (the kubelet rotates it).
    pub token_file: PathBuf,
    /// The CA certificates (PEM) the API server's certificate must chain to.
    pub ca_file: PathBuf,
}

impl Default for WarmConfig {
    fn default() -> Self {
        Self {
            plan: None,
            check_interval: Duration::from_secs(60),
            api_server: None,
            token_file: PathBuf::from(DEFAULT_TOKEN_FILE),
            ca_file: PathBuf::from(DEFAULT_CA_FILE),
        }
    }
}

impl WarmConfig {
    /// The plan's name in the label: its file name without the extension.
    pub fn plan_name(&self) -> Option<String> {
        let plan = self.plan.as_ref()?;
        Some(plan.file_stem()?.to_string_lossy().into_owned())
    }
}

/// Whether `name` may follow `warm-` in a label name: at most 58 characters (a label name is at
/// most 63) of `A-Z a-z 0-9 - _ .`, beginning and ending with a letter or digit.
pub(crate) fn is_plan_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    (1..=58).contains(&bytes.len())
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(b))
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// The OCI registry mirror (`[registry]`): the read-only pull API for containerd and CRI-O,
/// served from the block cache, for the configured upstream registries only.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    /// Address and port the mirror binds, or `"off"`. Default `127.0.0.1:7471`; it serves only
    /// when `upstreams` names at least one registry.
    #[serde(with = "listen_serde")]
    pub listen: Option<SocketAddr>,
    /// The registries pulled through, each `HOST[=URL]`. Default none (the mirror is off).
    pub upstreams: Vec<RegistryUpstream>,
    /// Credentials for the upstreams, in docker's `config.json` format (`auths.HOST.auth`,
    /// base64 of `user:password`). Default none: anonymous tokens only.
    pub credentials: Option<PathBuf>,
    /// How long a tag's digest is trusted before it is resolved upstream again; past it, a
    /// tag whose upstream cannot be reached is served from the last answer. Default 30s.
    #[serde(with = "humantime_serde")]
    pub tag_ttl: Duration,
    /// Hosts of token services, other than an upstream's own host, that may be sent the
    /// upstream's credentials when its challenge names them. Any other realm is asked for an
    /// anonymous token. Default `["auth.docker.io"]` (docker.io's token service).
    pub token_hosts: Vec<String>,
    /// containerd's hosts directory (its `config_path`, e.g. `/etc/containerd/certs.d`): while
    /// the mirror serves, the daemon keeps a `hosts.toml` there for each upstream that sends
    /// containerd's pulls of it through the mirror, and removes them when it stops. Default
    /// none: the daemon writes nothing (`larder containerd-config` writes them by hand).
    pub containerd_hosts_dir: Option<PathBuf>,
}

/// The mirror's address when none is configured: loopback, next to the peer port.
const DEFAULT_REGISTRY_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7471);

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            listen: Some(DEFAULT_REGISTRY_LISTEN),
            upstreams: Vec::new(),
            credentials: None,
            tag_ttl: Duration::from_secs(30),
            token_hosts: vec!["auth.docker.io".to_owned()],
            containerd_hosts_dir: None,
        }
    }
}

impl RegistryConfig {
    /// Whether the mirror serves: an address and at least one upstream.
    pub fn enabled(&self) -> bool {
        self.listen.is_some() && !self.upstreams.is_empty()
    }
}

/// An upstream registry: `HOST` as image references name it (`nvcr.io`, `localhost:5000`),
/// and the URL it is reached at: `https://HOST` unless given (`docker.io` is
/// `https://registry-1.docker.io`); an `http://` URL for a plain-HTTP registry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub struct RegistryUpstream {
    /// The registry's name in image references.
    pub host: String,
    /// Where it is reached: scheme, host and port, no path.
    pub url: String,
    /// Whether the URL was written (and is shown) rather than taken from the host.
    explicit: bool,
}

impl FromStr for RegistryUpstream {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (host, url) = match text.split_once('=') {
            Some((host, url)) => (host, Some(url)),
            None => (text, None),
        };
        let named = match host.rsplit_once(':') {
            Some((_, port)) if port.bytes().all(|b| b.is_ascii_digit()) => check_host_port(host),
            _ => check_host_port(&format!("{host}:443")),
        };
        named.map_err(|_| format!("{text:?}: {host:?} is not a registry host (HOST or HOST:PORT)"))?;
        let explicit = url.is_some();
        let url = match url {
            Some(url) => url.trim_end_matches('/').to_owned(),
            None if host == "docker.io" => "https://registry-1.docker.io".to_owned(),
            None => format!("https://{host}"),
        };
        let parsed = url::Url::parse(&url).map_err(|e| format!("{text:?}: {url:?} is not a URL: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https")
            || parsed.host_str().is_none()
            || parsed.path() != "/"
            || parsed.query().is_some()
            || !parsed.username().is_empty()
        {
            return Err(format!(
                "{text:?}: the URL must be http(s)://HOST[:PORT], without path, query or credentials"
            ));
        }
        Ok(Self {
            host: host.to_owned(),
            url,
            explicit,
        })
    }
}

impl TryFrom<String> for RegistryUpstream {
    type Error = String;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl From<RegistryUpstream> for String {
    fn from(upstream: RegistryUpstream) -> Self {
        upstream.to_string()
    }
}

impl fmt::Display for RegistryUpstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.host)?;
        if self.explicit {
            write!(f, "={}", self.url)?;
        }
        Ok(())
    }
}

/// A statically configured member: `ID=HOST:PORT[@RACK]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub struct PeerMember {
    /// The member's node id.
    pub id: String,
    /// Host (name or IP address) and port of its peer listener.
    pub address: String,
    /// Its rack label; empty if not given.
    pub rack: String,
}

/// Whether `text` may be a node id or rack label: `A-Z a-z 0-9 . _ -`, at most 128. What a
/// member says of itself over the network is held to the same rule.
pub fn is_peer_label(text: &str) -> bool {
    text.len() <= 128
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Checks `HOST:PORT`: a host name or IP address (IPv6 in brackets) and a port. A host name is
/// labels of `A-Z a-z 0-9 -` joined by dots, none empty, with perhaps a dot at the end (a fully
/// qualified name): so never `.` or `..`, which as a directory name would lead elsewhere.
pub(crate) fn check_host_port(text: &str) -> Result<(), String> {
    let (host, port) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("{text:?}: expected HOST:PORT"))?;
    port.parse::<u16>()
        .ok()
        .filter(|&port| port != 0)
        .ok_or_else(|| format!("{text:?}: {port:?} is not a port"))?;
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    let valid = match bare {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            let name = host.strip_suffix('.').unwrap_or(host);
            host.len() <= 253
                && name.split('.').all(|label| {
                    !label.is_empty() && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                })
        }
    };
    if valid {
        Ok(())
    } else {
        Err(format!("{text:?}: {host:?} is not a host name or IP address"))
    }
}

impl FromStr for PeerMember {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (id, rest) = text
            .split_once('=')
            .ok_or_else(|| format!("{text:?}: expected ID=HOST:PORT[@RACK]"))?;
        let (address, rack) = rest.split_once('@').unwrap_or((rest, ""));
        if id.is_empty() || !is_peer_label(id) {
            return Err(format!(
                "{text:?}: node id {id:?} must be 1 to 128 characters of A-Z a-z 0-9 . _ -"
            ));
        }
        if !is_peer_label(rack) {
            return Err(format!(
                "{text:?}: rack {rack:?} must be at most 128 characters of A-Z a-z 0-9 . _ -"
            ));
        }
        check_host_port(address)?;
        Ok(Self {
            id: id.to_owned(),
            address: address.to_owned(),
            rack: rack.to_owned(),
        })
    }
}

impl TryFrom<String> for PeerMember {
    type Error = String;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl From<PeerMember> for String {
    fn from(member: PeerMember) -> Self {
        member.to_string()
    }
}

impl fmt::Display for PeerMember {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.id, self.address)?;
        if !self.rack.is_empty() {
            write!(f, "@{}", self.rack)?;
        }
        Ok(())
    }
}

/// One object store served by the daemon (`[[source]]`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Unique name: 1 to 64 characters of `a-z 0-9 . _ -`, not `.` or `..`.
    pub name: String,
    /// Where the objects live, e.g. `s3://bucket/prefix`, `gs://bucket`,
    /// `az://container`, `file:///data`, `https://host/path`. Shown with its secrets hidden.
    pub url: SourceUrl,
    /// Objects never change once written, so cached data and metadata are
    /// never revalidated. Default false.
    #[serde(default)]
    pub immutable: bool,
    /// How long object metadata is trusted before it is checked again.
    /// Ignored when `immutable` is true. Default 60s.
    #[serde(default = "SourceConfig::default_metadata_ttl", with = "humantime_serde")]
    pub metadata_ttl: Duration,
}

impl SourceConfig {
    /// A source with the given name and URL and defaults for the rest.
    pub fn new(name: impl Into<String>, url: impl Into<SourceUrl>) -> Self {
        Self {
            name: name.into(),
            url: url.into(),
            immutable: false,
            metadata_ttl: Self::default_metadata_ttl(),
        }
    }

    /// Default of [`SourceConfig::metadata_ttl`].
    const fn default_metadata_ttl() -> Duration {
        Duration::from_secs(60)
    }
}

impl Config {
    /// Parses TOML text, normalises it and validates it.
    ///
    /// The result is ready to use; see [`Config::validate`] for the rules.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let mut config = Self::parse_toml(text, None)?;
        config.normalise();
        config.validate()?;
        Ok(config)
    }

    /// Renders the configuration as TOML that [`Config::from_toml_str`]
    /// reads back to an equal value, e.g. to show the effective config.
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|err| ConfigError::Render {
            message: err.to_string(),
        })
    }

    /// Parses TOML text without normalising or validating it. toml's message quotes the
    /// line at fault: the secrets of a URL on it are hidden.
    pub(crate) fn parse_toml(text: &str, path: Option<&Path>) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|err| ConfigError::Parse {
            path: path.map(Path::to_path_buf),
            key: err.span().and_then(|span| key_at(text, span.start)),
            message: Redacted(err.to_string().trim_end()).to_string(),
        })
    }
}

/// Best-effort dotted name (`cache.block_size`, `source[1].url`) of the key
/// on the line holding byte `offset` of a TOML document, for error messages.
///
/// Understands the plain layout this crate's files use: `[table]` and
/// `[[array]]` headers followed by `key = value` lines.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let before = text.get(..offset)?;
    let line_start = before.rfind('\n').map_or(0, |newline| newline + 1);
    let line = text.get(line_start..)?.lines().next()?;
    let key = line.split_once('=')?.0.trim().trim_matches('"');
    if key.is_empty() || key.starts_with('[') {
        return None;
    }
    let earlier = &text[..line_start];
    let Some(header) = earlier
        .lines()
        .map(str::trim)
        .rev()
        .find(|line| line.starts_with('['))
    else {
        return Some(key.to_owned());
    };
    let table = if let Some(name) = header.strip_prefix("[[").and_then(|h| h.split_once("]]")) {
        let index = earlier
            .lines()
            .filter(|line| line.trim() == header)
            .count()
            .saturating_sub(1);
        format!("{}[{index}]", name.0.trim())
    } else {
        header
            .trim_start_matches('[')
            .split_once(']')?
            .0
            .trim()
            .to_owned()
    };
    Some(format!("{table}.{key}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL_EXAMPLE: &str = r#"
        [cache]
        dir = "/mnt/nvme/larder"
        capacity = "500GiB"
        min_free_fraction = 0.1
        block_size = "8MiB"
        verify_on_read = false
        passthrough = false
        io_engine = "psync"
        io_queue_depth = 128
        memory_limit = "1GiB"
        scrub_rate = "16MiB"
        disk_recheck = "5m"

        [origin]
        part_size = "32MiB"
        concurrency = 64
        connect_timeout = "1s"
        request_timeout = "5s"
        read_deadline = "1m"
        max_attempts = 3
        backoff_base = "100ms"
        backoff_max = "5s"
        retry_budget_ratio = 0.5
        readahead_min = "16MiB"
        readahead_max = "1GiB"

        [metrics]
        listen = "[::]:9100"

        [mount]
        path = "/mnt/models"
        shutdown_grace = "30s"

        [control]
        socket = "/run/larder-test.sock"

        [peer]
        node_id = "gpu-1"
        rack = "r1"
        listen = "10.0.0.1:7470"
        members = ["gpu-1=10.0.0.1:7470@r1", "gpu-2=gpu-2.example:7470"]
        dns = "peers.larder.svc:7470"
        dns_interval = "30s"
        dns_server = "127.0.0.53:53"
        cluster_key_file = "/etc/larder/key"
        insecure = true
        first_byte_timeout = "250ms"
        stall_timeout = "1s"
        min_rate = "8MiB"
        probe_interval = "30s"
        tls_cert = "/etc/larder/peer.crt"
        tls_key = "/etc/larder/peer.key"
        tls_ca = "/etc/larder/ca.crt"
        tls_name = "peers.example"

        [warm]
        plan = "/etc/larder/warm.toml"
        check_interval = "30s"
        api_server = "http://127.0.0.1:8080"
        token_file = "/t"
        ca_file = "/c"

        [registry]
        listen = "127.0.0.1:5000"
        upstreams = ["nvcr.io", "docker.io", "localhost:5001=http://127.0.0.2:5001"]
        credentials = "/etc/larder/auth.json"
        tag_ttl = "1m"
        token_hosts = ["auth.example"]
        containerd_hosts_dir = "/etc/containerd/certs.d"

        [[source]]
        name = "datasets"
        url = "s3://training-data/datasets"
        immutable = true

        [[source]]
        name = "ckpt.v2"
        url = "gs://checkpoints"
        metadata_ttl = "5m"
    "#;

    #[test]
    fn defaults_match_the_documented_values() {
        let config = Config::default();
        assert!(config.sources.is_empty());
        assert_eq!(config.cache.dir, Path::new("/var/cache/larder"));
        assert_eq!(config.cache.capacity, ByteSize::gib(100));
        assert_eq!(config.cache.block_size, ByteSize::mib(4));
        assert_eq!(config.cache.io_engine, IoEngineKind::Uring);
        assert_eq!(config.origin.part_size, ByteSize::mib(16));
        assert_eq!(config.origin.read_deadline, Duration::from_secs(30));
        assert_eq!(config.origin.backoff_base, Duration::from_millis(50));
        assert_eq!(config.origin.readahead_max, ByteSize::mib(256));
        assert_eq!(config.metrics.listen, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(config.mount.path, Path::new("/models"));
        assert_eq!(config.mount.shutdown_grace, Duration::from_secs(10));
        assert_eq!(config.control.socket, Path::new("/run/larder/control.sock"));
        assert!(!config.peer.enabled());
        assert_eq!(config.peer.listen, None);
        assert_eq!(config.peer.first_byte_timeout, Duration::from_millis(500));
        assert_eq!(config.peer.stall_timeout, Duration::from_secs(3));
        assert_eq!(config.peer.min_rate, ByteSize::mib(16));
        assert_eq!(config.peer.probe_interval, Duration::from_secs(10));
        assert_eq!(config.peer.tls_name, "larder-peer");
        assert_eq!(config.warm.plan, None);
        assert_eq!(config.warm.check_interval, Duration::from_secs(60));
        assert_eq!(
            config.warm.token_file,
            Path::new("/var/run/secrets/kubernetes.io/serviceaccount/token")
        );
        assert_eq!(
            config.warm.ca_file,
            Path::new("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
        );
    }

    #[test]
    fn peer_members_read_back_as_written_and_bad_ones_say_why() {
        for text in ["a=10.0.0.1:7470@r1", "node-2.x=host.example:1", "b=[::1]:7470"] {
            let member: PeerMember = text.parse().unwrap();
            assert_eq!(member.to_string(), text);
        }
        for (text, says) in [
            ("10.0.0.1:7470", "expected ID=HOST:PORT"),
            ("a=10.0.0.1", "expected HOST:PORT"),
            ("a=10.0.0.1:0", "is not a port"),
            ("a=10.0.0.1:99999", "is not a port"),
            ("a=ho st:7470", "is not a host name"),
            ("a=..:7470", "is not a host name"),
            ("=h:1", "node id"),
            ("a b=h:1", "node id"),
            ("a=h:1@r 1", "rack"),
            ("a=[zz]:1", "is not a host name"),
        ] {
            let error = text.parse::<PeerMember>().unwrap_err();
            assert!(error.contains(says), "{text}: {error}");
        }
    }

    #[test]
    fn registry_upstreams_parse_with_their_urls_and_errors_name_the_problem() {
        let url = |text: &str| text.parse::<RegistryUpstream>().unwrap().url;
        assert_eq!(url("nvcr.io"), "https://nvcr.io");
        assert_eq!(url("docker.io"), "https://registry-1.docker.io");
        assert_eq!(
            url("localhost:5000=http://127.0.0.1:5001/"),
            "http://127.0.0.1:5001"
        );
        for text in [
            "nvcr.io",
            "localhost:5000=http://127.0.0.1:5001",
            "registry.local.",
        ] {
            assert_eq!(text.parse::<RegistryUpstream>().unwrap().to_string(), text);
        }
        for (text, says) in [
            ("", "not a registry host"),
            ("a/b", "not a registry host"),
            (".", "not a registry host"),
            ("..", "not a registry host"),
            ("..=http://x", "not a registry host"),
            ("a..b", "not a registry host"),
            (".a", "not a registry host"),
            ("h=ftp://x", "http(s)://HOST"),
            ("h=http://x/v2", "without path"),
            ("h=http://u:p@x", "credentials"),
            ("h=not a url", "not a URL"),
        ] {
            let error = text.parse::<RegistryUpstream>().unwrap_err();
            assert!(error.contains(says), "{text}: {error}");
        }
    }

    #[test]
    fn full_example_parses_to_expected_struct() {
        let config = Config::from_toml_str(FULL_EXAMPLE).unwrap();
        let expected = Config {
            cache: CacheConfig {
                dir: PathBuf::from("/mnt/nvme/larder"),
                capacity: ByteSize::gib(500),
                min_free_fraction: 0.1,
                block_size: ByteSize::mib(8),
                verify_on_read: false,
                passthrough: false,
                io_engine: IoEngineKind::Psync,
                io_queue_depth: 128,
                memory_limit: ByteSize::gib(1),
                scrub_rate: ByteSize::mib(16),
                disk_recheck: Duration::from_secs(300),
            },
            origin: OriginConfig {
                part_size: ByteSize::mib(32),
                concurrency: 64,
                connect_timeout: Duration::from_secs(1),
                request_timeout: Duration::from_secs(5),
                read_deadline: Duration::from_secs(60),
                max_attempts: 3,
                backoff_base: Duration::from_millis(100),
                backoff_max: Duration::from_secs(5),
                retry_budget_ratio: 0.5,
                readahead_min: ByteSize::mib(16),
                readahead_max: ByteSize::gib(1),
            },
            metrics: MetricsConfig {
                listen: Some("[::]:9100".parse().unwrap()),
            },
            mount: MountConfig {
                path: PathBuf::from("/mnt/models"),
                shutdown_grace: Duration::from_secs(30),
            },
            control: ControlConfig {
                socket: PathBuf::from("/run/larder-test.sock"),
            },
            peer: PeerConfig {
                node_id: "gpu-1".into(),
                rack: "r1".into(),
                listen: Some("10.0.0.1:7470".parse().unwrap()),
                members: vec![
                    PeerMember {
                        id: "gpu-1".into(),
                        address: "10.0.0.1:7470".into(),
                        rack: "r1".into(),
                    },
                    PeerMember {
                        id: "gpu-2".into(),
                        address: "gpu-2.example:7470".into(),
                        rack: String::new(),
                    },
                ],
                dns: Some("peers.larder.svc:7470".into()),
                dns_interval: Duration::from_secs(30),
                dns_server: Some("127.0.0.53:53".parse().unwrap()),
                cluster_key_file: Some(PathBuf::from("/etc/larder/key")),
                insecure: true,
                first_byte_timeout: Duration::from_millis(250),
                stall_timeout: Duration::from_secs(1),
                min_rate: ByteSize::mib(8),
                probe_interval: Duration::from_secs(30),
                tls_cert: Some(PathBuf::from("/etc/larder/peer.crt")),
                tls_key: Some(PathBuf::from("/etc/larder/peer.key")),
                tls_ca: Some(PathBuf::from("/etc/larder/ca.crt")),
                tls_name: "peers.example".into(),
            },
            warm: WarmConfig {
                plan: Some(PathBuf::from("/etc/larder/warm.toml")),
                check_interval: Duration::from_secs(30),
                api_server: Some("http://127.0.0.1:8080".into()),
                token_file: PathBuf::from("/t"),
                ca_file: PathBuf::from("/c"),
            },
            registry: RegistryConfig {
                listen: Some("127.0.0.1:5000".parse().unwrap()),
                upstreams: ["nvcr.io", "docker.io", "localhost:5001=http://127.0.0.2:5001"]
                    .map(|text| text.parse().unwrap())
                    .to_vec(),
                credentials: Some(PathBuf::from("/etc/larder/auth.json")),
                tag_ttl: Duration::from_secs(60),
                token_hosts: vec!["auth.example".into()],
                containerd_hosts_dir: Some(PathBuf::from("/etc/containerd/certs.d")),
            },
            sources: vec![
                SourceConfig {
                    name: "datasets".into(),
                    url: "s3://training-data/datasets".into(),
                    immutable: true,
                    metadata_ttl: Duration::from_secs(60),
                },
                SourceConfig {
                    name: "ckpt.v2".into(),
                    url: "gs://checkpoints".into(),
                    immutable: false,
                    metadata_ttl: Duration::from_secs(300),
                },
            ],
        };
        assert_eq!(config, expected);
    }

    #[test]
    fn module_doc_example_is_valid() {
        let doc = include_str!("schema.rs");
        let example: String = doc
            .lines()
            .skip_while(|line| !line.starts_with("//! ```toml"))
            .skip(1)
            .take_while(|line| !line.starts_with("//! ```"))
            .map(|line| format!("{}\n", line.trim_start_matches("//!").trim_start()))
            .collect();
        let config = Config::from_toml_str(&example).unwrap();
        let mut expected = Config::default();
        expected
            .sources
            .push(SourceConfig::new("datasets", "s3://bucket/prefix"));
        expected.peer = PeerConfig {
            node_id: "gpu-017".into(),
            rack: "r12".into(),
            listen: Some("10.0.3.17:7470".parse().unwrap()),
            members: vec![
                "gpu-017=10.0.3.17:7470@r12".parse().unwrap(),
                "gpu-018=10.0.3.18:7470@r12".parse().unwrap(),
            ],
            dns: Some("larder-peers.larder.svc:7470".into()),
            dns_server: Some("10.96.0.10:53".parse().unwrap()),
            cluster_key_file: Some("/etc/larder/cluster.key".into()),
            tls_cert: Some("/etc/larder/peer.crt".into()),
            tls_key: Some("/etc/larder/peer.key".into()),
            tls_ca: Some("/etc/larder/peer-ca.crt".into()),
            ..PeerConfig::default()
        };
        expected.warm = WarmConfig {
            plan: Some("/etc/larder/plans/llama-70b.toml".into()),
            api_server: Some("https://10.96.0.1:443".into()),
            ..WarmConfig::default()
        };
        expected.registry = RegistryConfig {
            upstreams: ["nvcr.io", "docker.io", "registry.local:5000=http://10.0.0.5:5000"]
                .map(|text| text.parse().unwrap())
                .to_vec(),
            credentials: Some("/etc/larder/registry-auth.json".into()),
            containerd_hosts_dir: Some("/etc/containerd/certs.d".into()),
            ..RegistryConfig::default()
        };
        assert_eq!(config, expected);
        assert_eq!(config.warm.plan_name().as_deref(), Some("llama-70b"));
    }

    #[test]
    fn defaults_round_trip_through_toml() {
        let mut config = Config::default();
        config
            .sources
            .push(SourceConfig::new("data", "s3://bucket/prefix"));
        let text = config.to_toml_string().unwrap();
        assert_eq!(Config::from_toml_str(&text).unwrap(), config);
        // The full example survives a round trip too.
        let full = Config::from_toml_str(FULL_EXAMPLE).unwrap();
        assert_eq!(
            Config::from_toml_str(&full.to_toml_string().unwrap()).unwrap(),
            full
        );
    }

    #[test]
    fn missing_sections_and_keys_take_defaults() {
        let config = Config::from_toml_str("[[source]]\nname = \"a\"\nurl = \"file:///\"\n").unwrap();
        assert_eq!(config.cache, CacheConfig::default());
        assert_eq!(config.origin, OriginConfig::default());
        assert_eq!(config.metrics, MetricsConfig::default());
        assert_eq!(config.sources, vec![SourceConfig::new("a", "file:///")]);
        let config = Config::from_toml_str(
            "[cache]\nblock_size = 2097152\n[[source]]\nname = \"a\"\nurl = \"file:///\"\n",
        )
        .unwrap();
        assert_eq!(config.cache.block_size, ByteSize::mib(2));
        assert_eq!(config.cache.capacity, ByteSize::gib(100));
    }

    #[test]
    fn unknown_keys_are_rejected_everywhere() {
        let source = "[[source]]\nname = \"a\"\nurl = \"file:///\"\n";
        for (text, key) in [
            (format!("colour = 1\n{source}"), "colour"),
            (format!("[cache]\nblocksize = \"4MiB\"\n{source}"), "blocksize"),
            (format!("[origin]\ntimeout = \"1s\"\n{source}"), "timeout"),
            (format!("{source}ttl = \"1s\"\n"), "ttl"),
            (format!("[sources]\n{source}"), "sources"),
        ] {
            let err = Config::from_toml_str(&text).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
            assert!(
                err.to_string().contains(&format!("unknown field `{key}`")),
                "{err}"
            );
        }
    }

    #[test]
    fn bad_units_name_the_key_and_value() {
        for (key, value) in [
            ("block_size", "\"4 MB/s\""),
            ("capacity", "\"lots\""),
            ("capacity", "\"-1GiB\""),
            ("capacity", "-1"),
            ("io_engine", "\"aio\""),
        ] {
            let text = format!("[cache]\n{key} = {value}\n[[source]]\nname = \"a\"\nurl = \"file:///\"\n");
            let err = Config::from_toml_str(&text).unwrap_err().to_string();
            assert!(
                err.contains(&format!("at cache.{key}:")) && err.contains(value),
                "{err}"
            );
        }
        let text = "[origin]\nrequest_timeout = \"soon\"\n[[source]]\nname = \"a\"\nurl = \"file:///\"\n";
        let err = Config::from_toml_str(text).unwrap_err().to_string();
        assert!(
            err.contains("at origin.request_timeout:") && err.contains("\"soon\""),
            "{err}"
        );
    }

    #[test]
    fn parse_errors_name_the_dotted_key() {
        let text = "[cache]\nblock_size = \"4 MB/s\"\n";
        let err = Config::from_toml_str(text).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Parse { key: Some(k), .. } if k == "cache.block_size"),
            "{err}"
        );
        assert!(
            err.to_string()
                .starts_with("cannot parse config at cache.block_size: "),
            "{err}"
        );

        let text = "[[source]]\nname = \"a\"\nurl = \"s3://a\"\n\n[[source]]\nname = \"b\"\nurl = \"s3://b\"\nttl = 1\n";
        let err = Config::from_toml_str(text).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Parse { key: Some(k), .. } if k == "source[1].ttl"),
            "{err}"
        );

        assert_eq!(key_at("top = 1\n", 0).as_deref(), Some("top"));
        assert_eq!(
            key_at("[origin]\n\"concurrency\" = -1\n", 12).as_deref(),
            Some("origin.concurrency")
        );
        assert_eq!(key_at("[cache\n", 1), None);
    }

    #[test]
    fn metrics_listen_is_an_address_or_off() {
        let source = "[[source]]\nname = \"a\"\nurl = \"file:///\"\n";
        let parse = |value: &str| Config::from_toml_str(&format!("[metrics]\nlisten = {value}\n{source}"));
        assert_eq!(parse("\"off\"").unwrap().metrics.listen, None);
        assert_eq!(
            parse("\"0.0.0.0:9000\"").unwrap().metrics.listen,
            Some("0.0.0.0:9000".parse().unwrap())
        );
        assert_eq!(
            parse("\"[::1]:9464\"").unwrap().metrics.listen,
            Some("[::1]:9464".parse().unwrap())
        );
        for bad in ["\"localhost:9464\"", "\"127.0.0.1\"", "\"\"", "\"on\"", "9464"] {
            let err = parse(bad).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Parse { key: Some(k), .. } if k == "metrics.listen"),
                "{bad}: {err}"
            );
        }
        let err = parse("\"localhost:9464\"").unwrap_err().to_string();
        assert!(
            err.contains("\"localhost:9464\"") && err.contains("or \"off\""),
            "{err}"
        );
        // "off" survives a round trip through TOML.
        let mut config = parse("\"off\"").unwrap();
        config = Config::from_toml_str(&config.to_toml_string().unwrap()).unwrap();
        assert_eq!(config.metrics.listen, None);
    }

    #[test]
    fn a_parse_error_hides_the_secrets_of_the_line_it_quotes() {
        let text = "[[source]]\nname = \"a\"\nurl = \"https://alice:PW@h/x?sig=S\" junk\n";
        let err = Config::from_toml_str(text).unwrap_err().to_string();
        assert!(err.contains("https://***@h/x?sig=***"), "{err}");
        assert!(
            !err.contains("alice") && !err.contains("PW") && !err.contains("=S"),
            "{err}"
        );
    }

    #[test]
    fn sources_need_name_and_url() {
        let err = Config::from_toml_str("[[source]]\nname = \"a\"\n").unwrap_err();
        assert!(err.to_string().contains("missing field `url`"), "{err}");
        let err = Config::from_toml_str("[[source]]\nurl = \"s3://b\"\n").unwrap_err();
        assert!(err.to_string().contains("missing field `name`"), "{err}");
    }

    #[test]
    fn io_engine_text_forms() {
        assert_eq!("uring".parse::<IoEngineKind>().unwrap(), IoEngineKind::Uring);
        assert_eq!(" psync ".parse::<IoEngineKind>().unwrap(), IoEngineKind::Psync);
        let err = "aio".parse::<IoEngineKind>().unwrap_err();
        assert!(
            err.contains("aio") && err.contains("uring") && err.contains("psync"),
            "{err}"
        );
        assert_eq!(IoEngineKind::Psync.to_string(), "psync");
        assert_eq!(IoEngineKind::Uring.to_string(), "uring");
    }
}
