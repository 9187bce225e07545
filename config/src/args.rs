//! Command-line flags and `LARDER_*` environment variables.
//!
//! [`ConfigArgs`] is meant to be `#[command(flatten)]`ed into the daemon's
//! subcommands. Every key of the schema has a flag and a variable (the
//! `[key]` at the end of each flag's help names the keys it sets; a test
//! walks the schema to keep it so). Precedence is default ← file ←
//! environment ← flags: clap already prefers a flag over its environment
//! variable, and [`ConfigArgs::load`] lays whichever won over the file.
//!
//! Values are kept as raw text and parsed here with the same parsers as the
//! TOML file, so a bad `--block-size` is explained the same way as a bad
//! `block_size`. An error names the setting as the user wrote it: the flag
//! for a value from the command line (`invalid --block-size = "3 parsecs"`),
//! the variable for one from the environment, the key for one from the file.
//!
//! Per-source keys other than the URL take `NAME=VALUE`, naming a source of
//! the file or of `--source`: `--source-immutable models=true`,
//! `--source-metadata-ttl models=5m` (in the environment, several separated
//! by commas). These lists merge entry by entry rather than replace one
//! another: the file's sources, then the variable's entries, then the flags'
//! (clap would hide a list variable behind its flag; [`ConfigArgs`] keeps it).
//!
//! A `LARDER_*` variable that nothing reads is named in a warning by
//! [`ConfigArgs::load`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Command, CommandFactory, FromArgMatches, Parser};

use crate::bytesize::ByteSize;
use crate::duration;
use crate::error::ConfigError;
use crate::redact::Redacted;
use crate::schema::{
    Config, IoEngineKind, PeerConfig, PeerMember, RegistryConfig, RegistryUpstream, SourceConfig, WarmConfig,
    parse_listen,
};

/// The flags themselves; [`ConfigArgs`] adds where each value came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
struct Flags {
    /// TOML configuration file. Without one, built-in defaults are used.
    #[arg(
        long = "config",
        env = "LARDER_CONFIG",
        value_name = "FILE",
        help_heading = "Configuration"
    )]
    config: Option<OsString>,

    /// Where to mount the tree of sources, default /models [mount.path].
    #[arg(long, env = "LARDER_MOUNT", value_name = "DIR", help_heading = "Mount")]
    mount: Option<OsString>,

    /// After SIGTERM, how long files already open are still served, e.g. "10s"
    /// [mount.shutdown_grace].
    #[arg(
        long,
        env = "LARDER_SHUTDOWN_GRACE",
        value_name = "DURATION",
        help_heading = "Mount"
    )]
    shutdown_grace: Option<OsString>,

    /// Unix socket for `larder prefetch` and `larder status` (created 0600), default
    /// /run/larder/control.sock [control.socket].
    #[arg(
        long,
        env = "LARDER_CONTROL_SOCKET",
        value_name = "PATH",
        help_heading = "Mount"
    )]
    control_socket: Option<OsString>,

    /// Cache directory, default /var/cache/larder [cache.dir].
    #[arg(long, env = "LARDER_CACHE_DIR", value_name = "DIR", help_heading = "Cache")]
    cache_dir: Option<OsString>,

    /// Most bytes the cache may hold, e.g. "500GiB"; default 100GiB [cache.capacity].
    #[arg(
        long,
        env = "LARDER_CACHE_CAPACITY",
        value_name = "SIZE",
        help_heading = "Cache"
    )]
    cache_capacity: Option<OsString>,

    /// Fraction of the cache filesystem kept free, 0.0 to below 1.0 [cache.min_free_fraction].
    #[arg(
        long,
        env = "LARDER_MIN_FREE_FRACTION",
        value_name = "FRACTION",
        help_heading = "Cache"
    )]
    min_free_fraction: Option<OsString>,

    /// Cache block size, a power of two from 1MiB to 64MiB [cache.block_size].
    #[arg(long, env = "LARDER_BLOCK_SIZE", value_name = "SIZE", help_heading = "Cache")]
    block_size: Option<OsString>,

    /// Verify each block's checksum on its first read after a start [cache.verify_on_read].
    #[arg(
        long,
        env = "LARDER_VERIFY_ON_READ",
        value_name = "true|false",
        help_heading = "Cache"
    )]
    verify_on_read: Option<OsString>,

    /// FUSE passthrough for fully cached files [cache.passthrough].
    #[arg(
        long,
        env = "LARDER_PASSTHROUGH",
        value_name = "true|false",
        help_heading = "Cache"
    )]
    passthrough: Option<OsString>,

    /// Disk I/O engine [cache.io_engine].
    #[arg(
        long,
        env = "LARDER_IO_ENGINE",
        value_name = "uring|psync",
        help_heading = "Cache"
    )]
    io_engine: Option<OsString>,

    /// Disk I/O requests in flight, 1 to 4096 [cache.io_queue_depth].
    #[arg(long, env = "LARDER_IO_QUEUE_DEPTH", value_name = "N", help_heading = "Cache")]
    io_queue_depth: Option<OsString>,

    /// Block bytes kept in memory, at least two blocks [cache.memory_limit].
    #[arg(
        long,
        env = "LARDER_MEMORY_LIMIT",
        value_name = "SIZE",
        help_heading = "Cache"
    )]
    memory_limit: Option<OsString>,

    /// Size of one ranged GET, a multiple of the block size [origin.part_size].
    #[arg(long, env = "LARDER_PART_SIZE", value_name = "SIZE", help_heading = "Origin")]
    part_size: Option<OsString>,

    /// Ranged GETs in flight, 1 to 1024 [origin.concurrency].
    #[arg(
        long,
        env = "LARDER_ORIGIN_CONCURRENCY",
        value_name = "N",
        help_heading = "Origin"
    )]
    origin_concurrency: Option<OsString>,

    /// Deadline for opening a connection, e.g. "3s" [origin.connect_timeout].
    #[arg(
        long,
        env = "LARDER_CONNECT_TIMEOUT",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    connect_timeout: Option<OsString>,

    /// Deadline of one request attempt, e.g. "10s" [origin.request_timeout].
    #[arg(
        long,
        env = "LARDER_REQUEST_TIMEOUT",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    request_timeout: Option<OsString>,

    /// How long a fill may go without a byte, retries included, e.g. "30s" [origin.read_deadline].
    #[arg(
        long,
        env = "LARDER_READ_DEADLINE",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    read_deadline: Option<OsString>,

    /// Attempts per request, 1 to 20 [origin.max_attempts].
    #[arg(long, env = "LARDER_MAX_ATTEMPTS", value_name = "N", help_heading = "Origin")]
    max_attempts: Option<OsString>,

    /// First retry delay, e.g. "50ms" [origin.backoff_base].
    #[arg(
        long,
        env = "LARDER_BACKOFF_BASE",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    backoff_base: Option<OsString>,

    /// Cap on the retry delay, e.g. "2s" [origin.backoff_max].
    #[arg(
        long,
        env = "LARDER_BACKOFF_MAX",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    backoff_max: Option<OsString>,

    /// Retries allowed per first attempt, 0 to 10 [origin.retry_budget_ratio].
    #[arg(
        long,
        env = "LARDER_RETRY_BUDGET_RATIO",
        value_name = "RATIO",
        help_heading = "Origin"
    )]
    retry_budget_ratio: Option<OsString>,

    /// Smallest readahead window, e.g. "8MiB" [origin.readahead_min].
    #[arg(
        long,
        env = "LARDER_READAHEAD_MIN",
        value_name = "SIZE",
        help_heading = "Origin"
    )]
    readahead_min: Option<OsString>,

    /// Largest readahead window, e.g. "256MiB" [origin.readahead_max].
    #[arg(
        long,
        env = "LARDER_READAHEAD_MAX",
        value_name = "SIZE",
        help_heading = "Origin"
    )]
    readahead_max: Option<OsString>,

    /// Address and port of the Prometheus endpoint, or "off" [metrics.listen].
    #[arg(
        long,
        env = "LARDER_METRICS_LISTEN",
        value_name = "ADDR:PORT|off",
        help_heading = "Metrics"
    )]
    metrics_listen: Option<OsString>,

    /// This node's id in the rack, default the host name [peer.node_id].
    #[arg(long, env = "LARDER_NODE_ID", value_name = "ID", help_heading = "Peers")]
    node_id: Option<OsString>,

    /// This node's rack label [peer.rack].
    #[arg(long, env = "LARDER_RACK", value_name = "RACK", help_heading = "Peers")]
    rack: Option<OsString>,

    /// Address and port the peer listener binds, or "off" (the default) [peer.listen].
    #[arg(
        long,
        env = "LARDER_PEER_LISTEN",
        value_name = "ADDR:PORT|off",
        help_heading = "Peers"
    )]
    peer_listen: Option<OsString>,

    /// Static members as ID=HOST:PORT[@RACK]; repeatable, comma-separated in the variable;
    /// replaces the file's list [peer.members].
    #[arg(
        long,
        env = "LARDER_PEERS",
        value_name = "ID=HOST:PORT[@RACK]",
        value_delimiter = ',',
        help_heading = "Peers"
    )]
    peers: Vec<OsString>,

    /// A DNS name whose addresses are the members, as NAME:PORT [peer.dns].
    #[arg(
        long,
        env = "LARDER_PEER_DNS",
        value_name = "NAME:PORT",
        help_heading = "Peers"
    )]
    peer_dns: Option<OsString>,

    /// How often the DNS name is resolved again, e.g. "10s" [peer.dns_interval].
    #[arg(
        long,
        env = "LARDER_PEER_DNS_INTERVAL",
        value_name = "DURATION",
        help_heading = "Peers"
    )]
    peer_dns_interval: Option<OsString>,

    /// The DNS server asked for the peers' DNS name, as ADDR:PORT (UDP); default the
    /// system's resolver config [peer.dns_server].
    #[arg(
        long,
        env = "LARDER_PEER_DNS_SERVER",
        value_name = "ADDR:PORT",
        help_heading = "Peers"
    )]
    peer_dns_server: Option<OsString>,

    /// File holding the cluster secret, mode 0600; or put the secret in LARDER_CLUSTER_KEY
    /// [peer.cluster_key_file].
    #[arg(
        long,
        env = "LARDER_CLUSTER_KEY_FILE",
        value_name = "PATH",
        help_heading = "Peers"
    )]
    cluster_key_file: Option<OsString>,

    /// Serve and ask peers without a cluster key; alone it means true [peer.insecure].
    #[arg(
        long,
        env = "LARDER_PEER_INSECURE",
        value_name = "true|false",
        num_args = 0..=1,
        default_missing_value = "true",
        help_heading = "Peers"
    )]
    peer_insecure: Option<OsString>,

    /// How long a peer has at least to answer before the origin is asked, e.g. "500ms"
    /// [peer.first_byte_timeout].
    #[arg(
        long,
        env = "LARDER_PEER_FIRST_BYTE_TIMEOUT",
        value_name = "DURATION",
        help_heading = "Peers"
    )]
    peer_first_byte_timeout: Option<OsString>,

    /// How long a peer's answer may stall before the rest goes elsewhere, e.g. "3s"
    /// [peer.stall_timeout].
    #[arg(
        long,
        env = "LARDER_PEER_STALL_TIMEOUT",
        value_name = "DURATION",
        help_heading = "Peers"
    )]
    peer_stall_timeout: Option<OsString>,

    /// This node's certificate chain (PEM): the peer listener speaks TLS only [peer.tls_cert].
    #[arg(
        long,
        env = "LARDER_PEER_TLS_CERT",
        value_name = "PATH",
        help_heading = "Peers"
    )]
    peer_tls_cert: Option<OsString>,

    /// The private key (PEM) of the peer certificate [peer.tls_key].
    #[arg(
        long,
        env = "LARDER_PEER_TLS_KEY",
        value_name = "PATH",
        help_heading = "Peers"
    )]
    peer_tls_key: Option<OsString>,

    /// The CA (PEM) members' certificates chain to: peers are asked over TLS only
    /// [peer.tls_ca].
    #[arg(long, env = "LARDER_PEER_TLS_CA", value_name = "PATH", help_heading = "Peers")]
    peer_tls_ca: Option<OsString>,

    /// The name every member's certificate is issued for, default "larder-peer"
    /// [peer.tls_name].
    #[arg(
        long,
        env = "LARDER_PEER_TLS_NAME",
        value_name = "NAME",
        help_heading = "Peers"
    )]
    peer_tls_name: Option<OsString>,
    /// A plan file (as `larder prefetch --plan` reads) kept warm: prefetched at start, checked
    /// every interval, the Node labelled larder.dev/warm-NAME while complete [warm.plan].
    #[arg(
        long,
        env = "LARDER_WARM_PLAN",
        value_name = "PATH",
        help_heading = "Warm nodes"
    )]
    warm_plan: Option<OsString>,

    /// How often the warm plan's completeness is checked, e.g. "60s" [warm.check_interval].
    #[arg(
        long,
        env = "LARDER_WARM_CHECK_INTERVAL",
        value_name = "DURATION",
        help_heading = "Warm nodes"
    )]
    warm_check_interval: Option<OsString>,

    /// The Kubernetes API server, default from KUBERNETES_SERVICE_HOST and _PORT
    /// [warm.api_server].
    #[arg(
        long,
        env = "LARDER_WARM_API_SERVER",
        value_name = "URL",
        help_heading = "Warm nodes"
    )]
    warm_api_server: Option<OsString>,

    /// The service-account token file [warm.token_file].
    #[arg(
        long,
        env = "LARDER_WARM_TOKEN_FILE",
        value_name = "PATH",
        help_heading = "Warm nodes"
    )]
    warm_token_file: Option<OsString>,

    /// The CA certificates (PEM) of the API server [warm.ca_file].
    #[arg(
        long,
        env = "LARDER_WARM_CA_FILE",
        value_name = "PATH",
        help_heading = "Warm nodes"
    )]
    warm_ca_file: Option<OsString>,

    /// Address and port the OCI registry mirror binds, or "off"; default 127.0.0.1:7471
    /// [registry.listen].
    #[arg(
        long,
        env = "LARDER_REGISTRY_LISTEN",
        value_name = "ADDR:PORT|off",
        help_heading = "Registry mirror"
    )]
    registry_listen: Option<OsString>,

    /// A registry pulled through, as HOST[=URL] (URL for a plain-HTTP or moved registry);
    /// repeatable, comma-separated in the variable; replaces the file's list
    /// [registry.upstreams].
    #[arg(
        long,
        env = "LARDER_REGISTRY_UPSTREAMS",
        value_name = "HOST[=URL]",
        value_delimiter = ',',
        help_heading = "Registry mirror"
    )]
    registry_upstream: Vec<OsString>,

    /// Upstream credentials in docker's config.json format [registry.credentials].
    #[arg(
        long,
        env = "LARDER_REGISTRY_CREDENTIALS",
        value_name = "PATH",
        help_heading = "Registry mirror"
    )]
    registry_credentials: Option<OsString>,

    /// How long a resolved tag is trusted, e.g. "30s" [registry.tag_ttl].
    #[arg(
        long,
        env = "LARDER_REGISTRY_TAG_TTL",
        value_name = "DURATION",
        help_heading = "Registry mirror"
    )]
    registry_tag_ttl: Option<OsString>,

    /// A token service host, besides each upstream's own, that may be sent its credentials;
    /// repeatable, comma-separated in the variable; replaces the file's list
    /// [registry.token_hosts].
    #[arg(
        long,
        env = "LARDER_REGISTRY_TOKEN_HOSTS",
        value_name = "HOST",
        value_delimiter = ',',
        help_heading = "Registry mirror"
    )]
    registry_token_host: Vec<OsString>,

    /// containerd's hosts directory, e.g. /etc/containerd/certs.d: a hosts.toml per upstream
    /// while the mirror serves, removed at stop [registry.containerd_hosts_dir].
    #[arg(
        long,
        env = "LARDER_REGISTRY_CONTAINERD_HOSTS_DIR",
        value_name = "DIR",
        help_heading = "Registry mirror"
    )]
    registry_containerd_hosts_dir: Option<OsString>,

    /// A source as NAME=URL; repeatable. Replaces the URL of the file's (or
    /// LARDER_SOURCES') source with that name, or adds a new source with default settings.
    /// In LARDER_SOURCES, separate several with commas [source.name, source.url].
    #[arg(
        long = "source",
        env = "LARDER_SOURCES",
        value_name = "NAME=URL",
        value_delimiter = ',',
        help_heading = "Sources"
    )]
    sources: Vec<OsString>,

    /// NAME=true|false: whether source NAME never changes; repeatable, comma-separated in
    /// the variable [source.immutable].
    #[arg(
        long,
        env = "LARDER_SOURCE_IMMUTABLE",
        value_name = "NAME=BOOL",
        value_delimiter = ',',
        help_heading = "Sources"
    )]
    source_immutable: Vec<OsString>,

    /// NAME=DURATION: how long source NAME's metadata is trusted, e.g. "models=5m";
    /// repeatable, comma-separated in the variable [source.metadata_ttl].
    #[arg(
        long,
        env = "LARDER_SOURCE_METADATA_TTL",
        value_name = "NAME=DURATION",
        value_delimiter = ',',
        help_heading = "Sources"
    )]
    source_metadata_ttl: Vec<OsString>,
}

/// Configuration flags: a config file plus overrides of single settings.
///
/// Every flag can also be given through the environment variable shown in
/// its help. A flag beats its variable, and both beat the file. The value
/// also remembers which settings came from the environment, so that an
/// error names what the user wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigArgs {
    flags: Flags,
    /// Ids of the flags whose value came from their environment variable.
    from_env: BTreeSet<String>,
    /// Values of the list variables (`LARDER_SOURCES`, per-source settings) that the same
    /// flags on the command line hid from clap, by id: they are merged under the flags'.
    env_lists: BTreeMap<String, OsString>,
}

impl FromArgMatches for ConfigArgs {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut args = Self::default();
        args.update_from_arg_matches(matches)?;
        Ok(args)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.flags.update_from_arg_matches(matches)?;
        for arg in Flags::augment_args(Command::new("larder")).get_arguments() {
            let id = arg.get_id().as_str();
            match matches.value_source(id) {
                Some(ValueSource::EnvVariable) => {
                    self.from_env.insert(id.to_owned());
                    self.env_lists.remove(id);
                }
                Some(source) => {
                    self.from_env.remove(id);
                    // A list flag adds to its variable's list rather than replacing it.
                    let variable = arg.get_env().and_then(std::env::var_os);
                    match variable {
                        Some(value)
                            if source == ValueSource::CommandLine && arg.get_value_delimiter().is_some() =>
                        {
                            self.env_lists.insert(id.to_owned(), value);
                        }
                        _ => {
                            self.env_lists.remove(id);
                        }
                    }
                }
                None => {}
            }
        }
        Ok(())
    }
}

impl Args for ConfigArgs {
    fn augment_args(command: Command) -> Command {
        Flags::augment_args(command)
    }

    fn augment_args_for_update(command: Command) -> Command {
        Flags::augment_args_for_update(command)
    }
}

impl CommandFactory for ConfigArgs {
    fn command() -> Command {
        Self::augment_args(Command::new("larder"))
    }

    fn command_for_update() -> Command {
        Self::augment_args_for_update(Command::new("larder"))
    }
}

impl Parser for ConfigArgs {}

/// `LARDER_*` variables read elsewhere than here: the `larder` binary's log filter, and the
/// cluster secret (read by the daemon, never a flag).
const OTHER_VARIABLES: [&str; 2] = ["LARDER_LOG", "LARDER_CLUSTER_KEY"];

/// The `LARDER_*` variables among `names` that nothing reads (a misspelling, or a setting
/// that does not exist), each with the known variable it is most like, if one is close.
fn unknown_variables(names: impl Iterator<Item = OsString>) -> Vec<(String, Option<String>)> {
    let command = ConfigArgs::command();
    let known: Vec<&str> = command
        .get_arguments()
        .filter_map(|arg| arg.get_env()?.to_str())
        .chain(OTHER_VARIABLES)
        .collect();
    names
        .map(|name| name.to_string_lossy().into_owned())
        .filter(|name| name.starts_with("LARDER_") && !known.contains(&name.as_str()))
        .map(|name| {
            // Compared without the prefix they all share; at most about a third edited.
            let suffix = |name: &str| name.trim_start_matches("LARDER_").to_owned();
            let closest = known
                .iter()
                .map(|known| {
                    (
                        strsim::normalized_levenshtein(&suffix(&name), &suffix(known)),
                        *known,
                    )
                })
                .max_by(|a, b| a.0.total_cmp(&b.0))
                .filter(|(similarity, _)| *similarity >= 0.65)
                .map(|(_, known)| known.to_owned());
            (name, closest)
        })
        .collect()
}

/// How the settings given by flags or variables are named in errors.
struct Names {
    command: Command,
    from_env: BTreeSet<String>,
    /// Config key → the flag or variable that set it.
    overridden: HashMap<String, String>,
}

impl Names {
    /// `--flag` for a value from the command line, `LARDER_VAR` for one from the environment.
    fn of(&self, id: &str) -> String {
        if self.from_env.contains(id) {
            self.variable(id)
        } else {
            self.flag(id)
        }
    }

    /// `--flag`, the name of flag `id` on the command line.
    fn flag(&self, id: &str) -> String {
        let arg = self.command.get_arguments().find(|arg| arg.get_id() == id);
        match arg.and_then(|arg| arg.get_long()) {
            Some(long) => format!("--{long}"),
            None => id.to_owned(),
        }
    }

    /// `LARDER_VAR`, the variable of flag `id`.
    fn variable(&self, id: &str) -> String {
        let arg = self.command.get_arguments().find(|arg| arg.get_id() == id);
        match arg.and_then(|arg| arg.get_env()).and_then(|env| env.to_str()) {
            Some(env) => env.to_owned(),
            None => self.flag(id),
        }
    }

    /// Records that flag `id` set `key`, and returns the flag's name.
    fn set(&mut self, key: impl Into<String>, id: &str) -> String {
        let name = self.of(id);
        self.overridden.insert(key.into(), name.clone());
        name
    }
}

/// `raw` as text, or an error naming the setting `name` it was given for.
fn utf8<'a>(name: &str, raw: &'a OsStr) -> Result<&'a str, ConfigError> {
    raw.to_str()
        .ok_or_else(|| ConfigError::invalid(name, raw.to_string_lossy(), "not valid UTF-8"))
}

impl ConfigArgs {
    /// Builds the effective configuration.
    ///
    /// Reads `--config` if given (otherwise starts from
    /// [`Config::default`]), applies the other flags, normalises and
    /// validates. Errors name the file, flag, variable or key and the bad
    /// value.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let config = self.load_sources_optional()?;
        if config.sources.is_empty() {
            return Err(ConfigError::NoSources);
        }
        Ok(config)
    }

    /// As [`ConfigArgs::load`], without requiring a source: for commands that read the
    /// configuration but serve no source (`larder containerd-config` reads `[registry]`).
    pub fn load_sources_optional(&self) -> Result<Config, ConfigError> {
        for (variable, closest) in unknown_variables(std::env::vars_os().map(|(name, _)| name)) {
            match closest {
                Some(closest) => tracing::warn!(
                    "{variable} is not a Larder setting and is ignored; did you mean {closest}?"
                ),
                None => tracing::warn!("{variable} is not a Larder setting and is ignored"),
            }
        }
        let mut names = Names {
            command: Self::command(),
            from_env: self.from_env.clone(),
            overridden: HashMap::new(),
        };
        let mut config = match &self.flags.config {
            Some(path) if path.is_empty() => {
                return Err(ConfigError::invalid(names.of("config"), "", "must not be empty"));
            }
            Some(path) => {
                let path = PathBuf::from(path);
                let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                Config::parse_toml(&text, Some(&path))?
            }
            None => Config::default(),
        };
        self.apply(&mut config, &mut names)?;
        config.normalise();
        config
            .validate_sources_optional()
            .map_err(|err| err.named_by(&names.overridden))?;
        Ok(config)
    }

    /// Lays the overrides over `config`, parsing each raw value.
    fn apply(&self, config: &mut Config, names: &mut Names) -> Result<(), ConfigError> {
        let flags = &self.flags;
        let paths = [
            (&mut config.mount.path, &flags.mount, "mount.path", "mount"),
            (
                &mut config.control.socket,
                &flags.control_socket,
                "control.socket",
                "control_socket",
            ),
            (&mut config.cache.dir, &flags.cache_dir, "cache.dir", "cache_dir"),
        ];
        for (target, value, key, id) in paths {
            if let Some(value) = value {
                names.set(key, id);
                *target = PathBuf::from(value);
            }
        }

        set(
            names,
            &mut config.mount.shutdown_grace,
            &flags.shutdown_grace,
            "mount.shutdown_grace",
            "shutdown_grace",
            duration::parse,
        )?;
        let cache = &mut config.cache;
        let origin = &mut config.origin;
        set(
            names,
            &mut cache.capacity,
            &flags.cache_capacity,
            "cache.capacity",
            "cache_capacity",
            parse_size,
        )?;
        set(
            names,
            &mut cache.min_free_fraction,
            &flags.min_free_fraction,
            "cache.min_free_fraction",
            "min_free_fraction",
            parse_number,
        )?;
        set(
            names,
            &mut cache.block_size,
            &flags.block_size,
            "cache.block_size",
            "block_size",
            parse_size,
        )?;
        set(
            names,
            &mut cache.verify_on_read,
            &flags.verify_on_read,
            "cache.verify_on_read",
            "verify_on_read",
            parse_bool,
        )?;
        set(
            names,
            &mut cache.passthrough,
            &flags.passthrough,
            "cache.passthrough",
            "passthrough",
            parse_bool,
        )?;
        set(
            names,
            &mut cache.io_engine,
            &flags.io_engine,
            "cache.io_engine",
            "io_engine",
            IoEngineKind::from_str,
        )?;
        set(
            names,
            &mut cache.io_queue_depth,
            &flags.io_queue_depth,
            "cache.io_queue_depth",
            "io_queue_depth",
            parse_number,
        )?;
        set(
            names,
            &mut cache.memory_limit,
            &flags.memory_limit,
            "cache.memory_limit",
            "memory_limit",
            parse_size,
        )?;
        set(
            names,
            &mut origin.part_size,
            &flags.part_size,
            "origin.part_size",
            "part_size",
            parse_size,
        )?;
        set(
            names,
            &mut origin.concurrency,
            &flags.origin_concurrency,
            "origin.concurrency",
            "origin_concurrency",
            parse_number,
        )?;
        for (target, value, key, id) in [
            (
                &mut origin.connect_timeout,
                &flags.connect_timeout,
                "origin.connect_timeout",
                "connect_timeout",
            ),
            (
                &mut origin.request_timeout,
                &flags.request_timeout,
                "origin.request_timeout",
                "request_timeout",
            ),
            (
                &mut origin.read_deadline,
                &flags.read_deadline,
                "origin.read_deadline",
                "read_deadline",
            ),
            (
                &mut origin.backoff_base,
                &flags.backoff_base,
                "origin.backoff_base",
                "backoff_base",
            ),
            (
                &mut origin.backoff_max,
                &flags.backoff_max,
                "origin.backoff_max",
                "backoff_max",
            ),
        ] {
            set(names, target, value, key, id, duration::parse)?;
        }
        set(
            names,
            &mut origin.max_attempts,
            &flags.max_attempts,
            "origin.max_attempts",
            "max_attempts",
            parse_number,
        )?;
        set(
            names,
            &mut origin.retry_budget_ratio,
            &flags.retry_budget_ratio,
            "origin.retry_budget_ratio",
            "retry_budget_ratio",
            parse_number,
        )?;
        set(
            names,
            &mut origin.readahead_min,
            &flags.readahead_min,
            "origin.readahead_min",
            "readahead_min",
            parse_size,
        )?;
        set(
            names,
            &mut origin.readahead_max,
            &flags.readahead_max,
            "origin.readahead_max",
            "readahead_max",
            parse_size,
        )?;
        set(
            names,
            &mut config.metrics.listen,
            &flags.metrics_listen,
            "metrics.listen",
            "metrics_listen",
            parse_listen,
        )?;

        self.apply_peer(&mut config.peer, names)?;
        self.apply_warm(&mut config.warm, names)?;
        self.apply_registry(&mut config.registry, names)?;

        // Source by source: the file's, then the variable's, then the flags'; a later entry
        // for a name replaces that source's URL.
        for (setting, spec) in self.list(names, "sources", &flags.sources)? {
            let (name, url) = split_pair(&spec, setting.clone(), "NAME=URL")?;
            let index = match config
                .sources
                .iter()
                .position(|source| source.name.trim() == name)
            {
                Some(index) => {
                    config.sources[index].url = url.into();
                    index
                }
                None => {
                    config.sources.push(SourceConfig::new(name, url));
                    let key = format!("source[{}].name", config.sources.len() - 1);
                    names.overridden.insert(key, setting.clone());
                    config.sources.len() - 1
                }
            };
            names.overridden.insert(format!("source[{index}].url"), setting);
        }
        for (setting, spec) in self.list(names, "source_immutable", &flags.source_immutable)? {
            let (source, value) = split_pair(&spec, setting.clone(), "NAME=true|false")?;
            let source = find_source(config, source, &spec, &setting)?;
            source.immutable =
                parse_bool(value).map_err(|reason| ConfigError::invalid(&setting, &spec, reason))?;
        }
        for (setting, spec) in self.list(names, "source_metadata_ttl", &flags.source_metadata_ttl)? {
            let (source, value) = split_pair(&spec, setting.clone(), "NAME=DURATION")?;
            let source = find_source(config, source, &spec, &setting)?;
            source.metadata_ttl =
                duration::parse(value).map_err(|reason| ConfigError::invalid(&setting, &spec, reason))?;
        }
        Ok(())
    }

    /// Lays the `[peer]` overrides over `peer`.
    fn apply_peer(&self, peer: &mut PeerConfig, names: &mut Names) -> Result<(), ConfigError> {
        let flags = &self.flags;
        for (target, value, key, id) in [
            (&mut peer.node_id, &flags.node_id, "peer.node_id", "node_id"),
            (&mut peer.rack, &flags.rack, "peer.rack", "rack"),
            (
                &mut peer.tls_name,
                &flags.peer_tls_name,
                "peer.tls_name",
                "peer_tls_name",
            ),
        ] {
            set(names, target, value, key, id, |text| {
                Ok::<_, String>(text.to_owned())
            })?;
        }
        set(
            names,
            &mut peer.listen,
            &flags.peer_listen,
            "peer.listen",
            "peer_listen",
            parse_listen,
        )?;
        set(
            names,
            &mut peer.dns,
            &flags.peer_dns,
            "peer.dns",
            "peer_dns",
            |text| Ok::<_, String>(Some(text.to_owned())),
        )?;
        for (target, value, key, id) in [
            (
                &mut peer.cluster_key_file,
                &flags.cluster_key_file,
                "peer.cluster_key_file",
                "cluster_key_file",
            ),
            (
                &mut peer.tls_cert,
                &flags.peer_tls_cert,
                "peer.tls_cert",
                "peer_tls_cert",
            ),
            (
                &mut peer.tls_key,
                &flags.peer_tls_key,
                "peer.tls_key",
                "peer_tls_key",
            ),
            (&mut peer.tls_ca, &flags.peer_tls_ca, "peer.tls_ca", "peer_tls_ca"),
        ] {
            set(names, target, value, key, id, |text| {
                Ok::<_, String>(Some(PathBuf::from(text)))
            })?;
        }
        set(
            names,
            &mut peer.dns_server,
            &flags.peer_dns_server,
            "peer.dns_server",
            "peer_dns_server",
            |text| text.parse::<SocketAddr>().map(Some),
        )?;
        set(
            names,
            &mut peer.insecure,
            &flags.peer_insecure,
            "peer.insecure",
            "peer_insecure",
            parse_bool,
        )?;
        for (target, value, key, id) in [
            (
                &mut peer.dns_interval,
                &flags.peer_dns_interval,
                "peer.dns_interval",
                "peer_dns_interval",
            ),
            (
                &mut peer.first_byte_timeout,
                &flags.peer_first_byte_timeout,
                "peer.first_byte_timeout",
                "peer_first_byte_timeout",
            ),
            (
                &mut peer.stall_timeout,
                &flags.peer_stall_timeout,
                "peer.stall_timeout",
                "peer_stall_timeout",
            ),
        ] {
            set(names, target, value, key, id, duration::parse)?;
        }
        // The members given by flags or the variable replace the file's list as a whole: a
        // member list is one fact about the cluster, not entries to merge.
        let members = self.list(names, "peers", &flags.peers)?;
        if !members.is_empty() {
            peer.members.clear();
            for (setting, spec) in members {
                let member = spec
                    .parse::<PeerMember>()
                    .map_err(|reason| ConfigError::invalid(&setting, &spec, reason))?;
                names.overridden.insert("peer.members".to_owned(), setting);
                peer.members.push(member);
            }
        }
        Ok(())
    }

    /// Lays the `[warm]` overrides over `warm`.
    fn apply_warm(&self, warm: &mut WarmConfig, names: &mut Names) -> Result<(), ConfigError> {
        let flags = &self.flags;
        set(
            names,
            &mut warm.plan,
            &flags.warm_plan,
            "warm.plan",
            "warm_plan",
            |text| Ok::<_, String>(Some(PathBuf::from(text))),
        )?;
        set(
            names,
            &mut warm.check_interval,
            &flags.warm_check_interval,
            "warm.check_interval",
            "warm_check_interval",
            duration::parse,
        )?;
        set(
            names,
            &mut warm.api_server,
            &flags.warm_api_server,
            "warm.api_server",
            "warm_api_server",
            |text| Ok::<_, String>(Some(text.to_owned())),
        )?;
        for (target, value, key, id) in [
            (
                &mut warm.token_file,
                &flags.warm_token_file,
                "warm.token_file",
                "warm_token_file",
            ),
            (
                &mut warm.ca_file,
                &flags.warm_ca_file,
                "warm.ca_file",
                "warm_ca_file",
            ),
        ] {
            set(names, target, value, key, id, |text| {
                Ok::<_, String>(PathBuf::from(text))
            })?;
        }
        Ok(())
    }

    /// Lays the `[registry]` overrides over `registry`.
    fn apply_registry(&self, registry: &mut RegistryConfig, names: &mut Names) -> Result<(), ConfigError> {
        let flags = &self.flags;
        set(
            names,
            &mut registry.listen,
            &flags.registry_listen,
            "registry.listen",
            "registry_listen",
            parse_listen,
        )?;
        set(
            names,
            &mut registry.credentials,
            &flags.registry_credentials,
            "registry.credentials",
            "registry_credentials",
            |text| Ok::<_, String>(Some(PathBuf::from(text))),
        )?;
        set(
            names,
            &mut registry.tag_ttl,
            &flags.registry_tag_ttl,
            "registry.tag_ttl",
            "registry_tag_ttl",
            duration::parse,
        )?;
        set(
            names,
            &mut registry.containerd_hosts_dir,
            &flags.registry_containerd_hosts_dir,
            "registry.containerd_hosts_dir",
            "registry_containerd_hosts_dir",
            |text| Ok::<_, String>(Some(PathBuf::from(text))),
        )?;
        let upstreams = self.list(names, "registry_upstream", &flags.registry_upstream)?;
        if !upstreams.is_empty() {
            registry.upstreams.clear();
            for (setting, spec) in upstreams {
                let upstream = spec
                    .parse::<RegistryUpstream>()
                    .map_err(|reason| ConfigError::invalid(&setting, &spec, reason))?;
                names.overridden.insert("registry.upstreams".to_owned(), setting);
                registry.upstreams.push(upstream);
            }
        }
        let hosts = self.list(names, "registry_token_host", &flags.registry_token_host)?;
        if !hosts.is_empty() {
            registry.token_hosts.clear();
            for (setting, host) in hosts {
                names
                    .overridden
                    .insert("registry.token_hosts".to_owned(), setting);
                registry.token_hosts.push(host);
            }
        }
        Ok(())
    }

    /// The entries of list flag `id`, each with the name of the setting it came from: those
    /// of its variable that flags hid, then `values` (the flags', or the variable's when no
    /// flag was given).
    fn list(
        &self,
        names: &Names,
        id: &str,
        values: &[OsString],
    ) -> Result<Vec<(String, String)>, ConfigError> {
        let mut entries = Vec::new();
        if let Some(raw) = self.env_lists.get(id) {
            let variable = names.variable(id);
            for entry in utf8(&variable, raw)?.split(',') {
                entries.push((variable.clone(), entry.to_owned()));
            }
        }
        let setting = names.of(id);
        for value in values {
            entries.push((setting.clone(), utf8(&setting, value)?.to_owned()));
        }
        Ok(entries)
    }
}

/// Parses `raw` with `parse` into `target` when the override is present, and records that
/// flag `id` set `key`. A parse failure becomes an [`ConfigError::Invalid`] naming the flag
/// or variable.
fn set<T, E: ToString>(
    names: &mut Names,
    target: &mut T,
    raw: &Option<OsString>,
    key: &str,
    id: &str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<(), ConfigError> {
    if let Some(raw) = raw {
        let name = names.set(key, id);
        let text = utf8(&name, raw)?;
        *target = parse(text).map_err(|err| ConfigError::invalid(name, text, err.to_string()))?;
    }
    Ok(())
}

/// Splits `NAME=VALUE`, trimmed; `form` says what was expected. A value that is not of this
/// form is shown with the secrets of any URL in it hidden.
fn split_pair<'a>(spec: &'a str, flag: String, form: &str) -> Result<(&'a str, &'a str), ConfigError> {
    spec.split_once('=')
        .map(|(name, value)| (name.trim(), value.trim()))
        .ok_or_else(|| ConfigError::invalid(flag, Redacted(spec), format!("expected {form}")))
}

/// The configured source called `name`, for a per-source flag.
fn find_source<'a>(
    config: &'a mut Config,
    name: &str,
    spec: &str,
    flag: &str,
) -> Result<&'a mut SourceConfig, ConfigError> {
    config
        .sources
        .iter_mut()
        .find(|source| source.name.trim() == name)
        .ok_or_else(|| {
            ConfigError::invalid(
                flag,
                spec,
                format!("no source is named {name:?} (configure it in [[source]] or with --source)"),
            )
        })
}

fn parse_size(text: &str) -> Result<ByteSize, String> {
    text.parse::<ByteSize>().map_err(|err| err.reason)
}

fn parse_number<T: FromStr>(text: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    text.trim()
        .parse()
        .map_err(|err: T::Err| format!("not a valid number ({err})"))
}

/// Accepts the usual spellings of a yes/no switch, case-insensitively.
fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Ok(true),
        "false" | "no" | "off" | "0" => Ok(false),
        _ => Err("expected true or false".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use clap::CommandFactory;

    use super::*;

    fn args(flags: &[&str]) -> ConfigArgs {
        let argv = std::iter::once("larder").chain(flags.iter().copied());
        ConfigArgs::try_parse_from(argv).unwrap()
    }

    fn config_file(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }

    #[test]
    fn command_is_well_formed_and_parses_without_flags() {
        ConfigArgs::command().debug_assert();
        assert_eq!(
            ConfigArgs::try_parse_from(["larder"]).unwrap(),
            ConfigArgs::default()
        );
    }

    #[test]
    fn every_flag_has_its_environment_variable() {
        let expected = [
            ("config", "LARDER_CONFIG"),
            ("mount", "LARDER_MOUNT"),
            ("shutdown-grace", "LARDER_SHUTDOWN_GRACE"),
            ("control-socket", "LARDER_CONTROL_SOCKET"),
            ("cache-dir", "LARDER_CACHE_DIR"),
            ("cache-capacity", "LARDER_CACHE_CAPACITY"),
            ("min-free-fraction", "LARDER_MIN_FREE_FRACTION"),
            ("block-size", "LARDER_BLOCK_SIZE"),
            ("verify-on-read", "LARDER_VERIFY_ON_READ"),
            ("passthrough", "LARDER_PASSTHROUGH"),
            ("io-engine", "LARDER_IO_ENGINE"),
            ("io-queue-depth", "LARDER_IO_QUEUE_DEPTH"),
            ("memory-limit", "LARDER_MEMORY_LIMIT"),
            ("part-size", "LARDER_PART_SIZE"),
            ("origin-concurrency", "LARDER_ORIGIN_CONCURRENCY"),
            ("connect-timeout", "LARDER_CONNECT_TIMEOUT"),
            ("request-timeout", "LARDER_REQUEST_TIMEOUT"),
            ("read-deadline", "LARDER_READ_DEADLINE"),
            ("max-attempts", "LARDER_MAX_ATTEMPTS"),
            ("backoff-base", "LARDER_BACKOFF_BASE"),
            ("backoff-max", "LARDER_BACKOFF_MAX"),
            ("retry-budget-ratio", "LARDER_RETRY_BUDGET_RATIO"),
            ("readahead-min", "LARDER_READAHEAD_MIN"),
            ("readahead-max", "LARDER_READAHEAD_MAX"),
            ("metrics-listen", "LARDER_METRICS_LISTEN"),
            ("node-id", "LARDER_NODE_ID"),
            ("rack", "LARDER_RACK"),
            ("peer-listen", "LARDER_PEER_LISTEN"),
            ("peers", "LARDER_PEERS"),
            ("peer-dns", "LARDER_PEER_DNS"),
            ("peer-dns-interval", "LARDER_PEER_DNS_INTERVAL"),
            ("peer-dns-server", "LARDER_PEER_DNS_SERVER"),
            ("cluster-key-file", "LARDER_CLUSTER_KEY_FILE"),
            ("peer-insecure", "LARDER_PEER_INSECURE"),
            ("peer-first-byte-timeout", "LARDER_PEER_FIRST_BYTE_TIMEOUT"),
            ("peer-stall-timeout", "LARDER_PEER_STALL_TIMEOUT"),
            ("peer-tls-cert", "LARDER_PEER_TLS_CERT"),
            ("peer-tls-key", "LARDER_PEER_TLS_KEY"),
            ("peer-tls-ca", "LARDER_PEER_TLS_CA"),
            ("peer-tls-name", "LARDER_PEER_TLS_NAME"),
            ("warm-plan", "LARDER_WARM_PLAN"),
            ("warm-check-interval", "LARDER_WARM_CHECK_INTERVAL"),
            ("warm-api-server", "LARDER_WARM_API_SERVER"),
            ("warm-token-file", "LARDER_WARM_TOKEN_FILE"),
            ("warm-ca-file", "LARDER_WARM_CA_FILE"),
            ("registry-listen", "LARDER_REGISTRY_LISTEN"),
            ("registry-upstream", "LARDER_REGISTRY_UPSTREAMS"),
            ("registry-credentials", "LARDER_REGISTRY_CREDENTIALS"),
            ("registry-tag-ttl", "LARDER_REGISTRY_TAG_TTL"),
            ("registry-token-host", "LARDER_REGISTRY_TOKEN_HOSTS"),
            (
                "registry-containerd-hosts-dir",
                "LARDER_REGISTRY_CONTAINERD_HOSTS_DIR",
            ),
            ("source", "LARDER_SOURCES"),
            ("source-immutable", "LARDER_SOURCE_IMMUTABLE"),
            ("source-metadata-ttl", "LARDER_SOURCE_METADATA_TTL"),
        ];
        let command = ConfigArgs::command();
        let actual: Vec<(String, String)> = command
            .get_arguments()
            .filter_map(|arg| {
                let long = arg.get_long()?;
                let env = arg.get_env()?.to_str()?;
                Some((long.to_owned(), env.to_owned()))
            })
            .collect();
        let expected: Vec<(String, String)> = expected
            .iter()
            .map(|(l, e)| ((*l).to_owned(), (*e).to_owned()))
            .collect();
        assert_eq!(actual, expected);
        for arg in command.get_arguments() {
            assert!(
                arg.get_help_heading().is_some(),
                "{:?} has no help heading",
                arg.get_id()
            );
        }
    }

    #[test]
    fn environment_variable_splits_sources_on_commas() {
        // clap reads the process environment; rather than mutate it (tests run in
        // parallel), check that a comma-separated value splits like LARDER_SOURCES would.
        let parsed = args(&["--source", "a=s3://x,b=gs://y"]);
        assert_eq!(parsed.flags.sources, ["a=s3://x", "b=gs://y"]);
    }

    #[test]
    fn flags_override_file() {
        let file = config_file(
            r#"
            [cache]
            capacity = "10GiB"
            block_size = "8MiB"
            [origin]
            part_size = "64MiB"
            [[source]]
            name = "data"
            url = "s3://bucket"
            "#,
        );
        let dir = tempfile::tempdir().unwrap();
        let path = file.path().to_str().unwrap();
        let dir_arg = dir.path().to_str().unwrap();
        let config = args(&[
            "--config",
            path,
            "--cache-dir",
            dir_arg,
            "--cache-capacity",
            "1TiB",
            "--min-free-fraction",
            "0.25",
            "--block-size",
            "16MiB",
            "--verify-on-read",
            "false",
            "--passthrough",
            "false",
            "--io-engine",
            "psync",
            "--io-queue-depth",
            "8",
            "--memory-limit",
            "48MiB",
            "--part-size",
            "32MiB",
            "--origin-concurrency",
            "4",
            "--request-timeout",
            "2s",
            "--read-deadline",
            "1m",
            "--max-attempts",
            "2",
            "--connect-timeout",
            "1s",
            "--backoff-base",
            "10ms",
            "--backoff-max",
            "1s",
            "--retry-budget-ratio",
            "0.25",
            "--readahead-min",
            "4MiB",
            "--readahead-max",
            "64MiB",
            "--metrics-listen",
            "0.0.0.0:9100",
            "--mount",
            "/mnt/flag",
            "--shutdown-grace",
            "3s",
            "--control-socket",
            "/run/flag.sock",
            "--source-immutable",
            "data=true",
            "--source-metadata-ttl",
            "data=2m",
        ])
        .load()
        .unwrap();
        assert_eq!(config.cache.dir, dir.path());
        assert_eq!(config.cache.capacity, ByteSize(1 << 40));
        assert_eq!(config.cache.min_free_fraction, 0.25);
        assert_eq!(config.cache.block_size, ByteSize::mib(16));
        assert!(!config.cache.verify_on_read);
        assert!(!config.cache.passthrough);
        assert_eq!(config.cache.io_engine, IoEngineKind::Psync);
        assert_eq!(config.cache.io_queue_depth, 8);
        assert_eq!(config.cache.memory_limit, ByteSize::mib(48));
        assert_eq!(config.origin.part_size, ByteSize::mib(32));
        assert_eq!(config.origin.concurrency, 4);
        assert_eq!(config.origin.request_timeout, Duration::from_secs(2));
        assert_eq!(config.origin.read_deadline, Duration::from_secs(60));
        assert_eq!(config.origin.max_attempts, 2);
        assert_eq!(config.origin.connect_timeout, Duration::from_secs(1));
        assert_eq!(config.origin.backoff_base, Duration::from_millis(10));
        assert_eq!(config.origin.backoff_max, Duration::from_secs(1));
        assert_eq!(config.origin.retry_budget_ratio, 0.25);
        assert_eq!(config.origin.readahead_min, ByteSize::mib(4));
        assert_eq!(config.origin.readahead_max, ByteSize::mib(64));
        assert_eq!(config.metrics.listen, Some("0.0.0.0:9100".parse().unwrap()));
        assert_eq!(config.mount.path, std::path::Path::new("/mnt/flag"));
        assert_eq!(config.mount.shutdown_grace, Duration::from_secs(3));
        assert_eq!(config.control.socket, std::path::Path::new("/run/flag.sock"));
        let mut data = SourceConfig::new("data", "s3://bucket");
        data.immutable = true;
        data.metadata_ttl = Duration::from_secs(120);
        assert_eq!(config.sources, vec![data]);
    }

    #[test]
    fn source_flags_replace_and_add() {
        let file = config_file(
            r#"
            [[source]]
            name = "data"
            url = "s3://old"
            immutable = true
            metadata_ttl = "5m"
            [[source]]
            name = "logs"
            url = "gs://logs"
            "#,
        );
        let path = file.path().to_str().unwrap();
        let config = args(&[
            "--config",
            path,
            "--source",
            "data=s3://new/prefix",
            "--source",
            "extra=file:///",
        ])
        .load()
        .unwrap();
        let mut replaced = SourceConfig::new("data", "s3://new/prefix");
        replaced.immutable = true;
        replaced.metadata_ttl = Duration::from_secs(300);
        assert_eq!(
            config.sources,
            vec![
                replaced,
                SourceConfig::new("logs", "gs://logs"),
                SourceConfig::new("extra", "file:///")
            ]
        );
    }

    #[test]
    fn sources_from_flags_alone_suffice() {
        let config = args(&["--source", "a=s3://x", "--source", " b = gs://y "])
            .load()
            .unwrap();
        assert_eq!(
            config.sources,
            vec![SourceConfig::new("a", "s3://x"), SourceConfig::new("b", "gs://y")]
        );
        assert_eq!(config.cache, Config::default().cache);
    }

    #[test]
    fn no_file_and_no_sources_is_an_error() {
        let err = args(&[]).load().unwrap_err();
        assert!(matches!(err, ConfigError::NoSources), "{err}");
    }

    #[test]
    fn a_command_that_serves_no_source_needs_none_but_checks_those_given() {
        let config = args(&["--registry-upstream", "nvcr.io"])
            .load_sources_optional()
            .unwrap();
        assert!(config.sources.is_empty());
        assert_eq!(config.registry.upstreams[0].host, "nvcr.io");
        let err = args(&["--source", "bad name=s3://x"])
            .load_sources_optional()
            .unwrap_err();
        assert!(err.to_string().contains("bad name"), "{err}");
    }

    #[test]
    fn bad_flag_values_name_the_flag_and_value() {
        for (flag, value) in [
            ("--block-size", "4 MB/s"),
            ("--cache-capacity", "lots"),
            ("--cache-capacity", "-1GiB"),
            ("--min-free-fraction", "half"),
            ("--verify-on-read", "maybe"),
            ("--io-engine", "aio"),
            ("--io-queue-depth", "-1"),
            ("--origin-concurrency", "many"),
            ("--connect-timeout", "soon"),
            ("--request-timeout", "soon"),
            ("--backoff-base", "1 fortnight"),
            ("--retry-budget-ratio", "lots"),
            ("--readahead-max", "big"),
            ("--source", "just-a-name"),
            ("--source-immutable", "a"),
            ("--source-immutable", "a=perhaps"),
            ("--source-immutable", "nobody=true"),
            ("--source-metadata-ttl", "a=later"),
            ("--metrics-listen", "localhost:9464"),
        ] {
            let flag_and_value = format!("{flag}={value}");
            let err = args(&["--source", "a=s3://x", &flag_and_value])
                .load()
                .unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key: k, value: v, .. } if k == flag && v == value),
                "{flag}: {err}"
            );
            assert!(
                err.to_string()
                    .starts_with(&format!("invalid {flag} = {value:?}: ")),
                "{err}"
            );
        }
    }

    #[test]
    fn range_errors_name_the_flag_the_user_passed() {
        let err = args(&["--source", "a=s3://x", "--origin-concurrency", "0"])
            .load()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid --origin-concurrency = \"0\": must be between 1 and 1024"
        );
        let err = args(&["--source", "a=s3://x", "--read-deadline", "5s"])
            .load()
            .unwrap_err();
        assert!(
            err.to_string().starts_with("invalid --read-deadline = \"5s\""),
            "{err}"
        );
        let err = args(&["--source", "bad name=s3://x"]).load().unwrap_err();
        assert!(
            err.to_string().starts_with("invalid --source = \"bad name\""),
            "{err}"
        );
        let err = args(&["--source", "a=ftp://x"]).load().unwrap_err();
        assert!(
            err.to_string().starts_with("invalid --source = \"ftp://x\""),
            "{err}"
        );
    }

    #[test]
    fn range_errors_from_the_file_name_the_key() {
        let file = config_file("[origin]\nconcurrency = 0\n[[source]]\nname = \"a\"\nurl = \"s3://x\"\n");
        let err = args(&["--config", file.path().to_str().unwrap()])
            .load()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid origin.concurrency = \"0\": must be between 1 and 1024"
        );
        let file = config_file("[[source]]\nname = \"bad name\"\nurl = \"s3://x\"\n");
        let err = args(&["--config", file.path().to_str().unwrap()])
            .load()
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid source[0].name = \"bad name\""),
            "{err}"
        );
        // A URL replaced by --source is named by the flag; the file's name stays the key.
        let file = config_file("[[source]]\nname = \"a\"\nurl = \"s3://x\"\n");
        let path = file.path().to_str().unwrap();
        let err = args(&["--config", path, "--source", "a=ftp://y"])
            .load()
            .unwrap_err();
        assert!(
            err.to_string().starts_with("invalid --source = \"ftp://y\""),
            "{err}"
        );
    }

    #[test]
    fn values_from_the_environment_are_named_by_their_variable() {
        let mut parsed = args(&["--source", "bad name=s3://x", "--origin-concurrency", "0"]);
        parsed.from_env.insert("origin_concurrency".into());
        let err = parsed.load().unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid LARDER_ORIGIN_CONCURRENCY = \"0\""),
            "{err}"
        );
        parsed.flags.origin_concurrency = None;
        parsed.from_env.insert("sources".into());
        let err = parsed.load().unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid LARDER_SOURCES = \"bad name\""),
            "{err}"
        );
    }

    #[test]
    fn a_missing_local_source_directory_is_refused_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-origin");
        let url = format!("file://{}", missing.display());
        let err = args(&["--source", &format!("local={url}")]).load().unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("invalid --source = {url:?}")) && text.contains("No such file"),
            "{text}"
        );
        let file = config_file(&format!("[[source]]\nname = \"local\"\nurl = \"{url}\"\n"));
        let err = args(&["--config", file.path().to_str().unwrap()])
            .load()
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("invalid source[0].url = {url:?}")),
            "{err}"
        );
        std::fs::create_dir(&missing).unwrap();
        args(&["--source", &format!("local={url}")]).load().unwrap();
    }

    #[test]
    fn mount_and_control_socket_come_from_flag_file_or_default() {
        let config = args(&["--source", "a=s3://x"]).load().unwrap();
        assert_eq!(config.mount.path, std::path::Path::new("/models"));
        assert_eq!(
            config.control.socket,
            std::path::Path::new("/run/larder/control.sock")
        );
        let file = config_file(
            "[mount]\npath = \"/mnt/file\"\n[control]\nsocket = \"/run/file.sock\"\n[[source]]\nname = \"a\"\nurl = \"s3://x\"\n",
        );
        let path = file.path().to_str().unwrap();
        let config = args(&["--config", path]).load().unwrap();
        assert_eq!(config.mount.path, std::path::Path::new("/mnt/file"));
        assert_eq!(config.control.socket, std::path::Path::new("/run/file.sock"));
        let config = args(&["--config", path, "--mount", "/mnt/flag"]).load().unwrap();
        assert_eq!(config.mount.path, std::path::Path::new("/mnt/flag"));
        assert_eq!(config.control.socket, std::path::Path::new("/run/file.sock"));
    }

    /// Every key of the schema (found by serialising a config, so a new key cannot be
    /// forgotten) is named in the `[key]` of a flag's help, and that flag has a variable.
    #[test]
    fn every_schema_key_has_a_flag_and_a_variable() {
        fn keys(prefix: &str, value: &toml::Value, out: &mut BTreeSet<String>) {
            match value {
                toml::Value::Table(table) => {
                    for (name, value) in table {
                        let key = if prefix.is_empty() {
                            name.clone()
                        } else {
                            format!("{prefix}.{name}")
                        };
                        keys(&key, value, out);
                    }
                }
                toml::Value::Array(items) if items.iter().all(toml::Value::is_table) => {
                    for item in items {
                        keys(prefix, item, out);
                    }
                }
                _ => {
                    out.insert(prefix.to_owned());
                }
            }
        }
        let mut config = Config::default();
        config.sources.push(SourceConfig::new("a", "s3://x"));
        // Keys that are left out when they hold nothing.
        config.peer.members.push("a=h:1".parse().unwrap());
        config.peer.dns = Some("h:1".into());
        config.peer.cluster_key_file = Some("k".into());
        config.peer.dns_server = Some("127.0.0.1:53".parse().unwrap());
        config.peer.tls_cert = Some("c".into());
        config.peer.tls_key = Some("k".into());
        config.peer.tls_ca = Some("a".into());
        config.warm.plan = Some("p".into());
        config.warm.api_server = Some("http://h".into());
        config.registry.upstreams.push("h".parse().unwrap());
        config.registry.credentials = Some("c".into());
        config.registry.containerd_hosts_dir = Some("d".into());
        let value = toml::Value::try_from(&config).unwrap();
        let mut schema = BTreeSet::new();
        keys("", &value, &mut schema);
        assert!(
            schema.contains("source.metadata_ttl") && schema.contains("cache.dir"),
            "{schema:?}"
        );

        let mut covered = BTreeSet::new();
        for arg in ConfigArgs::command().get_arguments() {
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            let Some(named) = help
                .trim_end_matches('.')
                .rsplit_once('[')
                .and_then(|(_, rest)| rest.strip_suffix(']'))
            else {
                continue;
            };
            assert!(arg.get_long().is_some(), "{:?} has no flag", arg.get_id());
            assert!(arg.get_env().is_some(), "{:?} has no variable", arg.get_id());
            for key in named.split(", ") {
                assert!(
                    schema.contains(key),
                    "{:?} names {key}, which is not in the schema",
                    arg.get_id()
                );
                covered.insert(key.to_owned());
            }
        }
        let missing: Vec<_> = schema.difference(&covered).collect();
        assert!(
            missing.is_empty(),
            "keys without a flag and a variable: {missing:?}"
        );
    }

    #[test]
    fn peer_flags_set_the_peer_table_and_errors_name_the_flag() {
        let config = args(&[
            "--source",
            "a=s3://x",
            "--node-id",
            "n1",
            "--peers",
            "n1=127.0.0.2:7470@r1,n2=127.0.0.3:7470@r1",
            "--peer-listen",
            "127.0.0.2:7470",
            "--peer-insecure",
        ])
        .load()
        .unwrap();
        assert_eq!(config.peer.node_id, "n1");
        assert!(config.peer.insecure);
        assert_eq!(config.peer.members.len(), 2);
        assert_eq!(config.peer.members[1].address, "127.0.0.3:7470");
        assert!(config.peer.enabled());

        let error = args(&["--source", "a=s3://x", "--peers", "n1=nohost"])
            .load()
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--peers") && error.contains("HOST:PORT"),
            "{error}"
        );
        let error = args(&["--source", "a=s3://x", "--peers", "n=h:1,n=h:2"])
            .load()
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--peers") && error.contains("also member 0"),
            "{error}"
        );
    }

    #[test]
    fn warm_flags_set_the_warm_table_and_errors_name_the_flag() {
        let config = args(&[
            "--source",
            "a=s3://x",
            "--warm-plan",
            "/plans/llama.toml",
            "--warm-check-interval",
            "5s",
            "--warm-api-server",
            "http://127.0.0.1:8080",
            "--warm-token-file",
            "/t",
            "--warm-ca-file",
            "/c",
        ])
        .load()
        .unwrap();
        assert_eq!(config.warm.plan, Some(PathBuf::from("/plans/llama.toml")));
        assert_eq!(config.warm.plan_name().as_deref(), Some("llama"));
        assert_eq!(config.warm.check_interval, Duration::from_secs(5));
        assert_eq!(config.warm.api_server.as_deref(), Some("http://127.0.0.1:8080"));
        assert_eq!(config.warm.token_file, PathBuf::from("/t"));
        assert_eq!(config.warm.ca_file, PathBuf::from("/c"));

        let error = args(&["--source", "a=s3://x", "--warm-plan", "/p/bad name.toml"])
            .load()
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--warm-plan") && error.contains("larder.dev/warm-NAME"),
            "{error}"
        );
    }

    #[test]
    fn metrics_listen_off_disables_and_keeps_the_file_otherwise() {
        let file = config_file(
            "[metrics]\nlisten = \"127.0.0.2:9000\"\n[[source]]\nname = \"a\"\nurl = \"s3://x\"\n",
        );
        let path = file.path().to_str().unwrap();
        let config = args(&["--config", path]).load().unwrap();
        assert_eq!(config.metrics.listen, Some("127.0.0.2:9000".parse().unwrap()));
        let config = args(&["--config", path, "--metrics-listen", "off"])
            .load()
            .unwrap();
        assert_eq!(config.metrics.listen, None);
    }

    #[test]
    fn unknown_variables_are_found_with_the_closest_known_one() {
        let names = [
            "LARDER_CACHE_CAPACITI",
            "LARDER_SOURCE",
            "LARDER_LOG",
            "LARDER_SOURCES",
            "LARDER_FROBNICATE",
            "HOME",
            "larder_mount",
        ];
        assert_eq!(
            unknown_variables(names.into_iter().map(OsString::from)),
            [
                (
                    "LARDER_CACHE_CAPACITI".to_owned(),
                    Some("LARDER_CACHE_CAPACITY".to_owned())
                ),
                ("LARDER_SOURCE".to_owned(), Some("LARDER_SOURCES".to_owned())),
                ("LARDER_FROBNICATE".to_owned(), None),
            ]
        );
    }

    #[test]
    fn boolean_spellings() {
        for (text, value) in [
            ("true", true),
            ("FALSE", false),
            ("1", true),
            ("off", false),
            ("yes", true),
        ] {
            assert_eq!(parse_bool(text), Ok(value), "{text}");
        }
    }

    #[test]
    fn file_errors_name_the_path() {
        let missing = std::env::temp_dir().join("larder-config-test-no-such-file.toml");
        let err = args(&["--config", missing.to_str().unwrap()]).load().unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }), "{err}");
        assert!(err.to_string().contains(missing.to_str().unwrap()), "{err}");

        let file = config_file("[cache]\nblok_size = \"4MiB\"\n");
        let path = file.path().to_str().unwrap();
        let err = args(&["--config", path, "--source", "a=s3://x"])
            .load()
            .unwrap_err();
        assert!(matches!(err, ConfigError::Parse { path: Some(_), .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains(path) && text.contains("unknown field `blok_size`"),
            "{text}"
        );
    }
}
