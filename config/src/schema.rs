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
    /// Check every read from disk through the daemon against the block's BLAKE3 (the 64 KiB
    /// groups it touches, against the block's stored group values); a mismatch is a miss (the
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
    /// Deadline of a whole fill, retries included; at least
    /// `request_timeout`. Default 30s.
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
    /// Largest readahead window; at least `readahead_min`. Default 256MiB.
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
        assert_eq!(config, expected);
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
