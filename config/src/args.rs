//! Command-line flags and `LARDER_*` environment variables.
//!
//! [`ConfigArgs`] is meant to be `#[command(flatten)]`ed into the daemon's
//! subcommands. Precedence is default ← file ← environment ← flags: clap
//! already prefers a flag over its environment variable, and
//! [`ConfigArgs::load`] lays whichever won over the file.
//!
//! Each flag is declared once, in the table given to `flags!` below: its help,
//! variable, value name and, for a flag that sets one key of the schema, that
//! key and the parser of its value. From that one entry come the clap flag, the
//! `[key]` that ends its help, and the line that lays the value over the
//! configuration. The key is the field path itself (`cache.block_size`), so it
//! is checked by the compiler against the schema rather than copied by hand;
//! a test walks the schema so that every key keeps a flag and a variable. A list
//! that replaces the file's (`--peers`) is one key too, its entries parsed one
//! by one; the per-source lists below and `--config` are declared in the table
//! but read by hand in [`ConfigArgs::apply`].
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
use std::convert::Infallible;
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
use crate::schema::{Config, IoEngineKind, PeerMember, RegistryUpstream, SourceConfig, parse_listen};

/// Declares the flags: help headings in the order `--help` shows them, each with its flags.
///
/// A flag is its help (the doc comment), its id (clap makes `cache_dir` the flag
/// `--cache-dir`), its variable, its value name and any further clap settings, then one of
///
/// - `=> section.key, parser`: the flag sets that key of [`Config`]; its help ends with
///   `[section.key]`, and `apply_keys` lays the value over the config with [`set`];
/// - `=> section.key, each parser`: the same for a list flag, whose entries (the variable's,
///   then the flags') replace the file's list ([`replace`]);
/// - `=> by hand: Type`: the raw value is kept as `Type` for [`ConfigArgs::apply`] to read;
///   the help names the keys it sets itself.
///
/// The kinds need different field types, and a macro cannot pick a type without a rule of
/// its own; so the entries are first brought one by one into one shape, `{heading
/// [doc lines] id variable value_name [settings] Type [key and parser of a value, if any]
/// [key and parser of a list's entries, if any]}`, and the last rule writes the struct and
/// `apply_keys` from that list.
macro_rules! flags {
    (@entries [$({
        $heading:literal [$($doc:literal)+] $id:ident $variable:literal $value_name:literal
        [$($setting:ident = $setting_value:expr),*] $ty:ty
        [$($section:ident . $key:ident, $parse:expr)?]
        [$($list_section:ident . $list_key:ident, $parse_each:expr)?]
    })*]) => {
        /// The flags themselves; [`ConfigArgs`] adds where each value came from.
        #[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
        struct Flags {
            $(
                #[arg(
                    long,
                    env = $variable,
                    value_name = $value_name,
                    help_heading = $heading,
                    // clap would join the doc lines the same way, without the space each begins with.
                    help = concat!(
                        $($doc),+
                        $(, " [", stringify!($section), ".", stringify!($key), "]")?
                        $(, " [", stringify!($list_section), ".", stringify!($list_key), "]")?
                    ).trim_start()
                    $(, $setting = $setting_value)*
                )]
                $id: $ty,
            )*
        }

        impl ConfigArgs {
            /// Lays the flags that set one key each over `config`, in the table's order.
            fn apply_keys(&self, config: &mut Config, names: &mut Names) -> Result<(), ConfigError> {
                $(
                    $(set(
                        names,
                        &mut config.$section.$key,
                        &self.flags.$id,
                        concat!(stringify!($section), ".", stringify!($key)),
                        stringify!($id),
                        $parse,
                    )?;)?
                    $(replace(
                        names,
                        &mut config.$list_section.$list_key,
                        self.list(names, stringify!($id), &self.flags.$id)?,
                        concat!(stringify!($list_section), ".", stringify!($list_key)),
                        $parse_each,
                    )?;)?
                )*
                Ok(())
            }
        }
    };
    (@entries [$($done:tt)*] $heading:literal {
        $(#[doc = $doc:literal])+
        $id:ident: $variable:literal, $value_name:literal $(, $setting:ident = $setting_value:expr)*
            => $section:ident . $key:ident, each $parse:expr;
        $($entries:tt)*
    } $($headings:tt)*) => {
        flags!(@entries [$($done)* {
            $heading [$($doc)+] $id $variable $value_name [$($setting = $setting_value),*]
            Vec<OsString> [] [$section . $key, $parse]
        }] $heading { $($entries)* } $($headings)*);
    };
    (@entries [$($done:tt)*] $heading:literal {
        $(#[doc = $doc:literal])+
        $id:ident: $variable:literal, $value_name:literal $(, $setting:ident = $setting_value:expr)*
            => $section:ident . $key:ident, $parse:expr;
        $($entries:tt)*
    } $($headings:tt)*) => {
        flags!(@entries [$($done)* {
            $heading [$($doc)+] $id $variable $value_name [$($setting = $setting_value),*]
            Option<OsString> [$section . $key, $parse] []
        }] $heading { $($entries)* } $($headings)*);
    };
    (@entries [$($done:tt)*] $heading:literal {
        $(#[doc = $doc:literal])+
        $id:ident: $variable:literal, $value_name:literal $(, $setting:ident = $setting_value:expr)*
            => by hand: $ty:ty;
        $($entries:tt)*
    } $($headings:tt)*) => {
        flags!(@entries [$($done)* {
            $heading [$($doc)+] $id $variable $value_name [$($setting = $setting_value),*] $ty [] []
        }] $heading { $($entries)* } $($headings)*);
    };
    (@entries $done:tt $heading:literal {} $($headings:tt)*) => {
        flags!(@entries $done $($headings)*);
    };
    ($($heading:literal { $($entries:tt)* })*) => {
        flags!(@entries [] $($heading { $($entries)* })*);
    };
}

flags! {
    "Configuration" {
        /// TOML configuration file. Without one, built-in defaults are used
        config: "LARDER_CONFIG", "FILE" => by hand: Option<OsString>;
    }
    "Mount" {
        /// Where to mount the tree of sources, default /models
        mount: "LARDER_MOUNT", "DIR" => mount.path, OsPath;
        /// After SIGTERM, how long files already open are still served, e.g. "10s"
        shutdown_grace: "LARDER_SHUTDOWN_GRACE", "DURATION" => mount.shutdown_grace, duration::parse;
        /// Unix socket for `larder prefetch` and `larder status` (created 0600), default
        /// /run/larder/control.sock
        control_socket: "LARDER_CONTROL_SOCKET", "PATH" => control.socket, OsPath;
    }
    "Cache" {
        /// Cache directory, default /var/cache/larder
        cache_dir: "LARDER_CACHE_DIR", "DIR" => cache.dir, OsPath;
        /// Most bytes the cache may hold, e.g. "500GiB"; default 100GiB
        cache_capacity: "LARDER_CACHE_CAPACITY", "SIZE" => cache.capacity, parse_size;
        /// Fraction of the cache filesystem kept free, 0.0 to below 1.0
        min_free_fraction: "LARDER_MIN_FREE_FRACTION", "FRACTION" => cache.min_free_fraction, parse_number;
        /// Cache block size, a power of two from 1MiB to 64MiB
        block_size: "LARDER_BLOCK_SIZE", "SIZE" => cache.block_size, parse_size;
        /// Verify each block's checksum on its first read after a start
        verify_on_read: "LARDER_VERIFY_ON_READ", "true|false" => cache.verify_on_read, parse_bool;
        /// FUSE passthrough for fully cached files
        passthrough: "LARDER_PASSTHROUGH", "true|false" => cache.passthrough, parse_bool;
        /// Disk I/O engine
        io_engine: "LARDER_IO_ENGINE", "uring|psync" => cache.io_engine, IoEngineKind::from_str;
        /// Disk I/O requests in flight, 1 to 4096
        io_queue_depth: "LARDER_IO_QUEUE_DEPTH", "N" => cache.io_queue_depth, parse_number;
        /// Block bytes kept in memory, at least two blocks
        memory_limit: "LARDER_MEMORY_LIMIT", "SIZE" => cache.memory_limit, parse_size;
        /// Bytes per second the scrub reads back (files handed to the kernel), "0" for off
        scrub_rate: "LARDER_SCRUB_RATE", "SIZE" => cache.scrub_rate, parse_size;
        /// Quiet time after which a failing cache disk is probed again, e.g. "60s"
        disk_recheck: "LARDER_DISK_RECHECK", "DURATION" => cache.disk_recheck, duration::parse;
    }
    "Origin" {
        /// Size of one ranged GET, a multiple of the block size
        part_size: "LARDER_PART_SIZE", "SIZE" => origin.part_size, parse_size;
        /// Ranged GETs in flight, 1 to 1024
        origin_concurrency: "LARDER_ORIGIN_CONCURRENCY", "N" => origin.concurrency, parse_number;
        /// Deadline for opening a connection, e.g. "3s"
        connect_timeout: "LARDER_CONNECT_TIMEOUT", "DURATION" => origin.connect_timeout, duration::parse;
        /// Deadline of one request attempt, e.g. "10s"
        request_timeout: "LARDER_REQUEST_TIMEOUT", "DURATION" => origin.request_timeout, duration::parse;
        /// How long a fill may go without a byte, retries included, e.g. "30s"
        read_deadline: "LARDER_READ_DEADLINE", "DURATION" => origin.read_deadline, duration::parse;
        /// Attempts per request, 1 to 20
        max_attempts: "LARDER_MAX_ATTEMPTS", "N" => origin.max_attempts, parse_number;
        /// First retry delay, e.g. "50ms"
        backoff_base: "LARDER_BACKOFF_BASE", "DURATION" => origin.backoff_base, duration::parse;
        /// Cap on the retry delay, e.g. "2s"
        backoff_max: "LARDER_BACKOFF_MAX", "DURATION" => origin.backoff_max, duration::parse;
        /// Retries allowed per first attempt, 0 to 10
        retry_budget_ratio: "LARDER_RETRY_BUDGET_RATIO", "RATIO" => origin.retry_budget_ratio, parse_number;
        /// Smallest readahead window, e.g. "8MiB"
        readahead_min: "LARDER_READAHEAD_MIN", "SIZE" => origin.readahead_min, parse_size;
        /// Largest readahead window, e.g. "256MiB"
        readahead_max: "LARDER_READAHEAD_MAX", "SIZE" => origin.readahead_max, parse_size;
    }
    "Metrics" {
        /// Address and port of the Prometheus endpoint, or "off"
        metrics_listen: "LARDER_METRICS_LISTEN", "ADDR:PORT|off" => metrics.listen, parse_listen;
    }
    "Peers" {
        /// This node's id in the rack, default the host name
        node_id: "LARDER_NODE_ID", "ID" => peer.node_id, parse_text;
        /// This node's rack label
        rack: "LARDER_RACK", "RACK" => peer.rack, parse_text;
        /// Address and port the peer listener binds, or "off" (the default)
        peer_listen: "LARDER_PEER_LISTEN", "ADDR:PORT|off" => peer.listen, parse_listen;
        /// Static members as ID=HOST:PORT[@RACK]; repeatable, comma-separated in the variable;
        /// replaces the file's list
        peers: "LARDER_PEERS", "ID=HOST:PORT[@RACK]", value_delimiter = ','
            => peer.members, each PeerMember::from_str;
        /// A DNS name whose addresses are the members, as NAME:PORT
        peer_dns: "LARDER_PEER_DNS", "NAME:PORT" => peer.dns, some(parse_text);
        /// How often the DNS name is resolved again, e.g. "10s"
        peer_dns_interval: "LARDER_PEER_DNS_INTERVAL", "DURATION" => peer.dns_interval, duration::parse;
        /// The DNS server asked for the peers' DNS name, as ADDR:PORT (UDP); default the
        /// system's resolver config
        peer_dns_server: "LARDER_PEER_DNS_SERVER", "ADDR:PORT" => peer.dns_server, some(SocketAddr::from_str);
        /// File holding the cluster secret, mode 0600; or put the secret in LARDER_CLUSTER_KEY
        cluster_key_file: "LARDER_CLUSTER_KEY_FILE", "PATH" => peer.cluster_key_file, some(parse_path);
        /// Serve and ask peers without a cluster key; alone it means true
        peer_insecure: "LARDER_PEER_INSECURE", "true|false", num_args = 0..=1, default_missing_value = "true"
            => peer.insecure, parse_bool;
        /// How long a peer has at least to answer before the origin is asked, e.g. "500ms"
        peer_first_byte_timeout: "LARDER_PEER_FIRST_BYTE_TIMEOUT", "DURATION"
            => peer.first_byte_timeout, duration::parse;
        /// How long a peer's answer may stall before the rest goes elsewhere, e.g. "3s"
        peer_stall_timeout: "LARDER_PEER_STALL_TIMEOUT", "DURATION" => peer.stall_timeout, duration::parse;
        /// The least rate (bytes a second) a peer's block must come at, e.g. "16MiB"; 0 is off
        peer_min_rate: "LARDER_PEER_MIN_RATE", "SIZE" => peer.min_rate, parse_size;
        /// How often an idle node says hello to each member, e.g. "10s"; "0s" is off
        peer_probe_interval: "LARDER_PEER_PROBE_INTERVAL", "DURATION" => peer.probe_interval, duration::parse;
        /// This node's certificate chain (PEM): the peer listener speaks TLS only
        peer_tls_cert: "LARDER_PEER_TLS_CERT", "PATH" => peer.tls_cert, some(parse_path);
        /// The private key (PEM) of the peer certificate
        peer_tls_key: "LARDER_PEER_TLS_KEY", "PATH" => peer.tls_key, some(parse_path);
        /// The CA (PEM) members' certificates chain to: peers are asked over TLS only
        peer_tls_ca: "LARDER_PEER_TLS_CA", "PATH" => peer.tls_ca, some(parse_path);
        /// The name every member's certificate is issued for, default "larder-peer"
        peer_tls_name: "LARDER_PEER_TLS_NAME", "NAME" => peer.tls_name, parse_text;
    }
    "Warm nodes" {
        /// A plan file (as `larder prefetch --plan` reads) kept warm: prefetched at start, checked
        /// every interval, the Node labelled larder.dev/warm-NAME while complete
        warm_plan: "LARDER_WARM_PLAN", "PATH" => warm.plan, some(parse_path);
        /// How often the warm plan's completeness is checked, e.g. "60s"
        warm_check_interval: "LARDER_WARM_CHECK_INTERVAL", "DURATION" => warm.check_interval, duration::parse;
        /// The Kubernetes API server, default from KUBERNETES_SERVICE_HOST and _PORT
        warm_api_server: "LARDER_WARM_API_SERVER", "URL" => warm.api_server, some(parse_text);
        /// The service-account token file
        warm_token_file: "LARDER_WARM_TOKEN_FILE", "PATH" => warm.token_file, parse_path;
        /// The CA certificates (PEM) of the API server
        warm_ca_file: "LARDER_WARM_CA_FILE", "PATH" => warm.ca_file, parse_path;
    }
    "Registry mirror" {
        /// Address and port the OCI registry mirror binds, or "off"; default 127.0.0.1:7471
        registry_listen: "LARDER_REGISTRY_LISTEN", "ADDR:PORT|off" => registry.listen, parse_listen;
        /// A registry pulled through, as HOST[=URL] (URL for a plain-HTTP or moved registry);
        /// repeatable, comma-separated in the variable; replaces the file's list
        registry_upstream: "LARDER_REGISTRY_UPSTREAMS", "HOST[=URL]", value_delimiter = ','
            => registry.upstreams, each RegistryUpstream::from_str;
        /// Upstream credentials in docker's config.json format
        registry_credentials: "LARDER_REGISTRY_CREDENTIALS", "PATH" => registry.credentials, some(parse_path);
        /// How long a resolved tag is trusted, e.g. "30s"
        registry_tag_ttl: "LARDER_REGISTRY_TAG_TTL", "DURATION" => registry.tag_ttl, duration::parse;
        /// A token service host, besides each upstream's own, that may be sent its credentials;
        /// repeatable, comma-separated in the variable; replaces the file's list
        registry_token_host: "LARDER_REGISTRY_TOKEN_HOSTS", "HOST", value_delimiter = ','
            => registry.token_hosts, each parse_text;
        /// containerd's hosts directory, e.g. /etc/containerd/certs.d: a hosts.toml per upstream
        /// while the mirror serves, removed at stop
        registry_containerd_hosts_dir: "LARDER_REGISTRY_CONTAINERD_HOSTS_DIR", "DIR"
            => registry.containerd_hosts_dir, some(parse_path);
    }
    "Sources" {
        /// A source as NAME=URL; repeatable. Replaces the URL of the file's (or
        /// LARDER_SOURCES') source with that name, or adds a new source with default settings.
        /// In LARDER_SOURCES, separate several with commas [source.name, source.url]
        sources: "LARDER_SOURCES", "NAME=URL", long = "source", value_delimiter = ','
            => by hand: Vec<OsString>;
        /// NAME=true|false: whether source NAME never changes; repeatable, comma-separated in
        /// the variable [source.immutable]
        source_immutable: "LARDER_SOURCE_IMMUTABLE", "NAME=BOOL", value_delimiter = ','
            => by hand: Vec<OsString>;
        /// NAME=DURATION: how long source NAME's metadata is trusted, e.g. "models=5m";
        /// repeatable, comma-separated in the variable [source.metadata_ttl]
        source_metadata_ttl: "LARDER_SOURCE_METADATA_TTL", "NAME=DURATION", value_delimiter = ','
            => by hand: Vec<OsString>;
    }
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
    /// Config key → the whole value typed for the flag or variable that set it, where that
    /// holds more than the key's value (`NAME=URL` for a source's URL), secrets hidden.
    typed: HashMap<String, String>,
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
            typed: HashMap::new(),
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
            .map_err(|err| err.named_by(&names.overridden, &names.typed))?;
        Ok(config)
    }

    /// Lays the overrides over `config`, parsing each raw value.
    fn apply(&self, config: &mut Config, names: &mut Names) -> Result<(), ConfigError> {
        let flags = &self.flags;
        self.apply_keys(config, names)?;

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
                    names.typed.insert(key.clone(), Redacted(&spec).to_string());
                    names.overridden.insert(key, setting.clone());
                    config.sources.len() - 1
                }
            };
            names.overridden.insert(format!("source[{index}].url"), setting);
            names
                .typed
                .insert(format!("source[{index}].url"), Redacted(&spec).to_string());
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
fn set<T>(
    names: &mut Names,
    target: &mut T,
    raw: &Option<OsString>,
    key: &str,
    id: &str,
    parse: impl Parse<T>,
) -> Result<(), ConfigError> {
    if let Some(raw) = raw {
        let name = names.set(key, id);
        *target = parse
            .parse(raw)
            .map_err(|reason| ConfigError::invalid(name, raw.to_string_lossy(), reason))?;
    }
    Ok(())
}

/// Replaces the list `target` with `entries`, each parsed with `parse`, when there are any,
/// and records which setting gave them. A list given by flags or a variable is one fact (the
/// cluster's members, the registries mirrored), not entries to merge with the file's.
fn replace<T, E: ToString>(
    names: &mut Names,
    target: &mut Vec<T>,
    entries: Vec<(String, String)>,
    key: &str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<(), ConfigError> {
    if entries.is_empty() {
        return Ok(());
    }
    target.clear();
    for (setting, spec) in entries {
        let entry =
            parse(&spec).map_err(|reason| ConfigError::invalid(&setting, &spec, reason.to_string()))?;
        names.overridden.insert(key.to_owned(), setting);
        target.push(entry);
    }
    Ok(())
}

/// How a flag's raw value becomes a setting.
trait Parse<T> {
    /// The setting, or why `raw` is not one.
    fn parse(&self, raw: &OsStr) -> Result<T, String>;
}

/// Most values are text, parsed as the file's are.
impl<T, E: ToString, F: Fn(&str) -> Result<T, E>> Parse<T> for F {
    fn parse(&self, raw: &OsStr) -> Result<T, String> {
        let text = raw.to_str().ok_or("not valid UTF-8")?;
        self(text).map_err(|err| err.to_string())
    }
}

/// A path as the system gives it, UTF-8 or not (the mount point and the cache and control
/// socket paths have always been taken so).
struct OsPath;

impl Parse<PathBuf> for OsPath {
    fn parse(&self, raw: &OsStr) -> Result<PathBuf, String> {
        Ok(PathBuf::from(raw))
    }
}

/// `parse` for a key that is unset by default: a value sets it.
fn some<T, E>(parse: impl Fn(&str) -> Result<T, E>) -> impl Fn(&str) -> Result<Option<T>, E> {
    move |text| parse(text).map(Some)
}

fn parse_text(text: &str) -> Result<String, Infallible> {
    Ok(text.to_owned())
}

fn parse_path(text: &str) -> Result<PathBuf, Infallible> {
    Ok(PathBuf::from(text))
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
            ("scrub-rate", "LARDER_SCRUB_RATE"),
            ("disk-recheck", "LARDER_DISK_RECHECK"),
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
            ("peer-min-rate", "LARDER_PEER_MIN_RATE"),
            ("peer-probe-interval", "LARDER_PEER_PROBE_INTERVAL"),
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
            err.to_string()
                .starts_with("invalid --source = \"bad name=s3://x\""),
            "{err}"
        );
        let err = args(&["--source", "a=ftp://x"]).load().unwrap_err();
        assert!(
            err.to_string().starts_with("invalid --source = \"a=ftp://x\""),
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
            err.to_string().starts_with("invalid --source = \"a=ftp://y\""),
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
                .starts_with("invalid LARDER_SOURCES = \"bad name=s3://x\""),
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
            text.starts_with(&format!("invalid --source = \"local={url}\"")) && text.contains("No such file"),
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
