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
//! by commas).

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::str::FromStr;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Command, CommandFactory, FromArgMatches, Parser};

use crate::bytesize::ByteSize;
use crate::duration;
use crate::error::ConfigError;
use crate::schema::{Config, IoEngineKind, SourceConfig, parse_listen};

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
    config: Option<PathBuf>,

    /// Where to mount the tree of sources, default /models [mount.path].
    #[arg(long, env = "LARDER_MOUNT", value_name = "DIR", help_heading = "Mount")]
    mount: Option<PathBuf>,

    /// After SIGTERM, how long files already open are still served, e.g. "10s"
    /// [mount.shutdown_grace].
    #[arg(
        long,
        env = "LARDER_SHUTDOWN_GRACE",
        value_name = "DURATION",
        help_heading = "Mount"
    )]
    shutdown_grace: Option<String>,

    /// Unix socket for `larder prefetch` and `larder status` (created 0600), default
    /// /run/larder/control.sock [control.socket].
    #[arg(
        long,
        env = "LARDER_CONTROL_SOCKET",
        value_name = "PATH",
        help_heading = "Mount"
    )]
    control_socket: Option<PathBuf>,

    /// Cache directory, default /var/cache/larder [cache.dir].
    #[arg(long, env = "LARDER_CACHE_DIR", value_name = "DIR", help_heading = "Cache")]
    cache_dir: Option<PathBuf>,

    /// Most bytes the cache may hold, e.g. "500GiB"; default 100GiB [cache.capacity].
    #[arg(
        long,
        env = "LARDER_CACHE_CAPACITY",
        value_name = "SIZE",
        help_heading = "Cache"
    )]
    cache_capacity: Option<String>,

    /// Fraction of the cache filesystem kept free, 0.0 to below 1.0 [cache.min_free_fraction].
    #[arg(
        long,
        env = "LARDER_MIN_FREE_FRACTION",
        value_name = "FRACTION",
        help_heading = "Cache"
    )]
    min_free_fraction: Option<String>,

    /// Cache block size, a power of two from 1MiB to 64MiB [cache.block_size].
    #[arg(long, env = "LARDER_BLOCK_SIZE", value_name = "SIZE", help_heading = "Cache")]
    block_size: Option<String>,

    /// Verify each block's checksum on its first read after a start [cache.verify_on_read].
    #[arg(
        long,
        env = "LARDER_VERIFY_ON_READ",
        value_name = "true|false",
        help_heading = "Cache"
    )]
    verify_on_read: Option<String>,

    /// FUSE passthrough for fully cached files [cache.passthrough].
    #[arg(
        long,
        env = "LARDER_PASSTHROUGH",
        value_name = "true|false",
        help_heading = "Cache"
    )]
    passthrough: Option<String>,

    /// Disk I/O engine [cache.io_engine].
    #[arg(
        long,
        env = "LARDER_IO_ENGINE",
        value_name = "uring|psync",
        help_heading = "Cache"
    )]
    io_engine: Option<String>,

    /// Disk I/O requests in flight, 1 to 4096 [cache.io_queue_depth].
    #[arg(long, env = "LARDER_IO_QUEUE_DEPTH", value_name = "N", help_heading = "Cache")]
    io_queue_depth: Option<String>,

    /// Size of one ranged GET, a multiple of the block size [origin.part_size].
    #[arg(long, env = "LARDER_PART_SIZE", value_name = "SIZE", help_heading = "Origin")]
    part_size: Option<String>,

    /// Ranged GETs in flight, 1 to 1024 [origin.concurrency].
    #[arg(
        long,
        env = "LARDER_ORIGIN_CONCURRENCY",
        value_name = "N",
        help_heading = "Origin"
    )]
    origin_concurrency: Option<String>,

    /// Deadline for opening a connection, e.g. "3s" [origin.connect_timeout].
    #[arg(
        long,
        env = "LARDER_CONNECT_TIMEOUT",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    connect_timeout: Option<String>,

    /// Deadline of one request attempt, e.g. "10s" [origin.request_timeout].
    #[arg(
        long,
        env = "LARDER_REQUEST_TIMEOUT",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    request_timeout: Option<String>,

    /// Deadline of a whole fill including retries, e.g. "30s" [origin.read_deadline].
    #[arg(
        long,
        env = "LARDER_READ_DEADLINE",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    read_deadline: Option<String>,

    /// Attempts per request, 1 to 20 [origin.max_attempts].
    #[arg(long, env = "LARDER_MAX_ATTEMPTS", value_name = "N", help_heading = "Origin")]
    max_attempts: Option<String>,

    /// First retry delay, e.g. "50ms" [origin.backoff_base].
    #[arg(
        long,
        env = "LARDER_BACKOFF_BASE",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    backoff_base: Option<String>,

    /// Cap on the retry delay, e.g. "2s" [origin.backoff_max].
    #[arg(
        long,
        env = "LARDER_BACKOFF_MAX",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    backoff_max: Option<String>,

    /// Retries allowed per first attempt, 0 to 10 [origin.retry_budget_ratio].
    #[arg(
        long,
        env = "LARDER_RETRY_BUDGET_RATIO",
        value_name = "RATIO",
        help_heading = "Origin"
    )]
    retry_budget_ratio: Option<String>,

    /// Smallest readahead window, e.g. "8MiB" [origin.readahead_min].
    #[arg(
        long,
        env = "LARDER_READAHEAD_MIN",
        value_name = "SIZE",
        help_heading = "Origin"
    )]
    readahead_min: Option<String>,

    /// Largest readahead window, e.g. "256MiB" [origin.readahead_max].
    #[arg(
        long,
        env = "LARDER_READAHEAD_MAX",
        value_name = "SIZE",
        help_heading = "Origin"
    )]
    readahead_max: Option<String>,

    /// Address and port of the Prometheus endpoint, or "off" [metrics.listen].
    #[arg(
        long,
        env = "LARDER_METRICS_LISTEN",
        value_name = "ADDR:PORT|off",
        help_heading = "Metrics"
    )]
    metrics_listen: Option<String>,

    /// A source as NAME=URL; repeatable. Replaces the URL of the file's
    /// source with that name, or adds a new source with default settings.
    /// In LARDER_SOURCES, separate several with commas [source.name, source.url].
    #[arg(
        long = "source",
        env = "LARDER_SOURCES",
        value_name = "NAME=URL",
        value_delimiter = ',',
        help_heading = "Sources"
    )]
    sources: Vec<String>,

    /// NAME=true|false: whether source NAME never changes; repeatable, comma-separated in
    /// the variable [source.immutable].
    #[arg(
        long,
        env = "LARDER_SOURCE_IMMUTABLE",
        value_name = "NAME=BOOL",
        value_delimiter = ',',
        help_heading = "Sources"
    )]
    source_immutable: Vec<String>,

    /// NAME=DURATION: how long source NAME's metadata is trusted, e.g. "models=5m";
    /// repeatable, comma-separated in the variable [source.metadata_ttl].
    #[arg(
        long,
        env = "LARDER_SOURCE_METADATA_TTL",
        value_name = "NAME=DURATION",
        value_delimiter = ',',
        help_heading = "Sources"
    )]
    source_metadata_ttl: Vec<String>,
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
                }
                Some(_) => {
                    self.from_env.remove(id);
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
        let arg = self.command.get_arguments().find(|arg| arg.get_id() == id);
        let env = arg.and_then(|arg| arg.get_env()).and_then(|env| env.to_str());
        let long = arg.and_then(|arg| arg.get_long());
        match (self.from_env.contains(id), env, long) {
            (true, Some(env), _) => env.to_owned(),
            (_, _, Some(long)) => format!("--{long}"),
            _ => id.to_owned(),
        }
    }

    /// Records that flag `id` set `key`, and returns the flag's name.
    fn set(&mut self, key: impl Into<String>, id: &str) -> String {
        let name = self.of(id);
        self.overridden.insert(key.into(), name.clone());
        name
    }
}

impl ConfigArgs {
    /// Builds the effective configuration.
    ///
    /// Reads `--config` if given (otherwise starts from
    /// [`Config::default`]), applies the other flags, normalises and
    /// validates. Errors name the file, flag, variable or key and the bad
    /// value.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = match &self.flags.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                Config::parse_toml(&text, Some(path))?
            }
            None => Config::default(),
        };
        let mut names = Names {
            command: Self::command(),
            from_env: self.from_env.clone(),
            overridden: HashMap::new(),
        };
        self.apply(&mut config, &mut names)?;
        config.normalise();
        config.validate().map_err(|err| err.named_by(&names.overridden))?;
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
                target.clone_from(value);
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

        for spec in &flags.sources {
            let (name, url) = split_pair(spec, names.of("sources"), "NAME=URL")?;
            let index = match config
                .sources
                .iter()
                .position(|source| source.name.trim() == name)
            {
                Some(index) => {
                    url.clone_into(&mut config.sources[index].url);
                    index
                }
                None => {
                    config.sources.push(SourceConfig::new(name, url));
                    names.set(format!("source[{}].name", config.sources.len() - 1), "sources");
                    config.sources.len() - 1
                }
            };
            names.set(format!("source[{index}].url"), "sources");
        }
        for spec in &flags.source_immutable {
            let name = names.of("source_immutable");
            let (source, value) = split_pair(spec, name.clone(), "NAME=true|false")?;
            let source = find_source(config, source, spec, &name)?;
            source.immutable =
                parse_bool(value).map_err(|reason| ConfigError::invalid(&name, spec, reason))?;
        }
        for spec in &flags.source_metadata_ttl {
            let name = names.of("source_metadata_ttl");
            let (source, value) = split_pair(spec, name.clone(), "NAME=DURATION")?;
            let source = find_source(config, source, spec, &name)?;
            source.metadata_ttl =
                duration::parse(value).map_err(|reason| ConfigError::invalid(&name, spec, reason))?;
        }
        Ok(())
    }
}

/// Parses `raw` with `parse` into `target` when the override is present, and records that
/// flag `id` set `key`. A parse failure becomes an [`ConfigError::Invalid`] naming the flag
/// or variable.
fn set<T, E: ToString>(
    names: &mut Names,
    target: &mut T,
    raw: &Option<String>,
    key: &str,
    id: &str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<(), ConfigError> {
    if let Some(raw) = raw {
        let name = names.set(key, id);
        *target = parse(raw).map_err(|err| ConfigError::invalid(name, raw, err.to_string()))?;
    }
    Ok(())
}

/// Splits `NAME=VALUE`, trimmed; `form` says what was expected.
fn split_pair<'a>(spec: &'a str, flag: String, form: &str) -> Result<(&'a str, &'a str), ConfigError> {
    spec.split_once('=')
        .map(|(name, value)| (name.trim(), value.trim()))
        .ok_or_else(|| ConfigError::invalid(flag, spec, format!("expected {form}")))
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
