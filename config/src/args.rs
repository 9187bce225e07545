//! Command-line flags and `LARDER_*` environment variables.
//!
//! [`ConfigArgs`] is meant to be `#[command(flatten)]`ed into the daemon's
//! subcommands. Precedence is file ← environment ← flags: clap already
//! prefers a flag over its environment variable, and [`ConfigArgs::load`]
//! lays whichever won over the file.
//!
//! Values are kept as raw text and parsed here with the same parsers as the
//! TOML file, so a bad `--block-size` is explained the same way as a bad
//! `block_size`; such errors name the flag and its variable, e.g.
//! `invalid --block-size / LARDER_BLOCK_SIZE = "3 parsecs": ...`.

use std::path::PathBuf;
use std::str::FromStr;

use clap::Parser;

use crate::bytesize::ByteSize;
use crate::duration;
use crate::error::ConfigError;
use crate::schema::{Config, IoEngineKind, SourceConfig, parse_listen};

/// Configuration flags: a config file plus overrides of single settings.
///
/// Every flag can also be given through the environment variable shown in
/// its help. A flag beats its variable, and both beat the file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Parser)]
pub struct ConfigArgs {
    /// TOML configuration file. Without one, built-in defaults are used.
    #[arg(
        long = "config",
        env = "LARDER_CONFIG",
        value_name = "FILE",
        help_heading = "Configuration"
    )]
    pub config: Option<PathBuf>,

    /// Cache directory [cache.dir].
    #[arg(long, env = "LARDER_CACHE_DIR", value_name = "DIR", help_heading = "Cache")]
    pub cache_dir: Option<PathBuf>,

    /// Most bytes the cache may hold, e.g. "500GiB" [cache.capacity].
    #[arg(
        long,
        env = "LARDER_CACHE_CAPACITY",
        value_name = "SIZE",
        help_heading = "Cache"
    )]
    pub cache_capacity: Option<String>,

    /// Fraction of the cache filesystem kept free, 0.0 to below 1.0 [cache.min_free_fraction].
    #[arg(
        long,
        env = "LARDER_MIN_FREE_FRACTION",
        value_name = "FRACTION",
        help_heading = "Cache"
    )]
    pub min_free_fraction: Option<String>,

    /// Cache block size, a power of two from 1MiB to 64MiB [cache.block_size].
    #[arg(long, env = "LARDER_BLOCK_SIZE", value_name = "SIZE", help_heading = "Cache")]
    pub block_size: Option<String>,

    /// Verify each block's checksum on its first read after a start [cache.verify_on_read].
    #[arg(
        long,
        env = "LARDER_VERIFY_ON_READ",
        value_name = "true|false",
        help_heading = "Cache"
    )]
    pub verify_on_read: Option<String>,

    /// FUSE passthrough for fully cached files [cache.passthrough].
    #[arg(
        long,
        env = "LARDER_PASSTHROUGH",
        value_name = "true|false",
        help_heading = "Cache"
    )]
    pub passthrough: Option<String>,

    /// Disk I/O engine [cache.io_engine].
    #[arg(
        long,
        env = "LARDER_IO_ENGINE",
        value_name = "uring|psync",
        help_heading = "Cache"
    )]
    pub io_engine: Option<String>,

    /// Disk I/O requests in flight, 1 to 4096 [cache.io_queue_depth].
    #[arg(long, env = "LARDER_IO_QUEUE_DEPTH", value_name = "N", help_heading = "Cache")]
    pub io_queue_depth: Option<String>,

    /// Size of one ranged GET, a multiple of the block size [origin.part_size].
    #[arg(long, env = "LARDER_PART_SIZE", value_name = "SIZE", help_heading = "Origin")]
    pub part_size: Option<String>,

    /// Ranged GETs in flight, 1 to 1024 [origin.concurrency].
    #[arg(
        long,
        env = "LARDER_ORIGIN_CONCURRENCY",
        value_name = "N",
        help_heading = "Origin"
    )]
    pub origin_concurrency: Option<String>,

    /// Deadline of one request attempt, e.g. "10s" [origin.request_timeout].
    #[arg(
        long,
        env = "LARDER_REQUEST_TIMEOUT",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    pub request_timeout: Option<String>,

    /// Deadline of a whole fill including retries, e.g. "30s" [origin.read_deadline].
    #[arg(
        long,
        env = "LARDER_READ_DEADLINE",
        value_name = "DURATION",
        help_heading = "Origin"
    )]
    pub read_deadline: Option<String>,

    /// Attempts per request, 1 to 20 [origin.max_attempts].
    #[arg(long, env = "LARDER_MAX_ATTEMPTS", value_name = "N", help_heading = "Origin")]
    pub max_attempts: Option<String>,

    /// Address and port of the Prometheus endpoint, or "off" [metrics.listen].
    #[arg(
        long,
        env = "LARDER_METRICS_LISTEN",
        value_name = "ADDR:PORT|off",
        help_heading = "Metrics"
    )]
    pub metrics_listen: Option<String>,

    /// A source as NAME=URL; repeatable. Replaces the URL of the file's
    /// source with that name, or adds a new source with default settings.
    /// In LARDER_SOURCES, separate several with commas.
    #[arg(
        long = "source",
        env = "LARDER_SOURCES",
        value_name = "NAME=URL",
        value_delimiter = ',',
        help_heading = "Sources"
    )]
    pub sources: Vec<String>,
}

impl ConfigArgs {
    /// Builds the effective configuration.
    ///
    /// Reads `--config` if given (otherwise starts from
    /// [`Config::default`]), applies the other flags, normalises and
    /// validates. Errors name the file, flag or key and the bad value.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                Config::parse_toml(&text, Some(path))?
            }
            None => Config::default(),
        };
        self.apply(&mut config)?;
        config.normalise();
        config.validate()?;
        Ok(config)
    }

    /// Lays the overrides over `config`, parsing each raw value.
    fn apply(&self, config: &mut Config) -> Result<(), ConfigError> {
        let cache = &mut config.cache;
        if let Some(dir) = &self.cache_dir {
            cache.dir.clone_from(dir);
        }
        set(
            &mut cache.capacity,
            &self.cache_capacity,
            "--cache-capacity / LARDER_CACHE_CAPACITY",
            parse_size,
        )?;
        set(
            &mut cache.min_free_fraction,
            &self.min_free_fraction,
            "--min-free-fraction / LARDER_MIN_FREE_FRACTION",
            parse_number,
        )?;
        set(
            &mut cache.block_size,
            &self.block_size,
            "--block-size / LARDER_BLOCK_SIZE",
            parse_size,
        )?;
        set(
            &mut cache.verify_on_read,
            &self.verify_on_read,
            "--verify-on-read / LARDER_VERIFY_ON_READ",
            parse_bool,
        )?;
        set(
            &mut cache.passthrough,
            &self.passthrough,
            "--passthrough / LARDER_PASSTHROUGH",
            parse_bool,
        )?;
        set(
            &mut cache.io_engine,
            &self.io_engine,
            "--io-engine / LARDER_IO_ENGINE",
            IoEngineKind::from_str,
        )?;
        set(
            &mut cache.io_queue_depth,
            &self.io_queue_depth,
            "--io-queue-depth / LARDER_IO_QUEUE_DEPTH",
            parse_number,
        )?;

        let origin = &mut config.origin;
        set(
            &mut origin.part_size,
            &self.part_size,
            "--part-size / LARDER_PART_SIZE",
            parse_size,
        )?;
        set(
            &mut origin.concurrency,
            &self.origin_concurrency,
            "--origin-concurrency / LARDER_ORIGIN_CONCURRENCY",
            parse_number,
        )?;
        set(
            &mut origin.request_timeout,
            &self.request_timeout,
            "--request-timeout / LARDER_REQUEST_TIMEOUT",
            duration::parse,
        )?;
        set(
            &mut origin.read_deadline,
            &self.read_deadline,
            "--read-deadline / LARDER_READ_DEADLINE",
            duration::parse,
        )?;
        set(
            &mut origin.max_attempts,
            &self.max_attempts,
            "--max-attempts / LARDER_MAX_ATTEMPTS",
            parse_number,
        )?;

        set(
            &mut config.metrics.listen,
            &self.metrics_listen,
            "--metrics-listen / LARDER_METRICS_LISTEN",
            parse_listen,
        )?;

        for spec in &self.sources {
            let (name, url) = spec.split_once('=').ok_or_else(|| {
                ConfigError::invalid("--source / LARDER_SOURCES", spec, "expected NAME=URL")
            })?;
            let (name, url) = (name.trim(), url.trim());
            match config
                .sources
                .iter_mut()
                .find(|source| source.name.trim() == name)
            {
                Some(existing) => url.clone_into(&mut existing.url),
                None => config.sources.push(SourceConfig::new(name, url)),
            }
        }
        Ok(())
    }
}

/// Parses `raw` with `parse` into `target` when the override is present.
/// A parse failure becomes an [`ConfigError::Invalid`] naming `key`.
fn set<T, E: ToString>(
    target: &mut T,
    raw: &Option<String>,
    key: &str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<(), ConfigError> {
    if let Some(raw) = raw {
        *target = parse(raw).map_err(|err| ConfigError::invalid(key, raw, err.to_string()))?;
    }
    Ok(())
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
            ("request-timeout", "LARDER_REQUEST_TIMEOUT"),
            ("read-deadline", "LARDER_READ_DEADLINE"),
            ("max-attempts", "LARDER_MAX_ATTEMPTS"),
            ("metrics-listen", "LARDER_METRICS_LISTEN"),
            ("source", "LARDER_SOURCES"),
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
        assert_eq!(parsed.sources, ["a=s3://x", "b=gs://y"]);
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
            "--metrics-listen",
            "0.0.0.0:9100",
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
        assert_eq!(config.metrics.listen, Some("0.0.0.0:9100".parse().unwrap()));
        // Untouched settings keep the file's or the default value.
        assert_eq!(config.origin.connect_timeout, Duration::from_secs(3));
        assert_eq!(config.sources, vec![SourceConfig::new("data", "s3://bucket")]);
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
            "extra=file:///x",
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
                SourceConfig::new("extra", "file:///x")
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
    fn bad_flag_values_name_flag_and_value() {
        for (flag, value, key) in [
            ("--block-size", "4 MB/s", "--block-size / LARDER_BLOCK_SIZE"),
            (
                "--cache-capacity",
                "lots",
                "--cache-capacity / LARDER_CACHE_CAPACITY",
            ),
            (
                "--cache-capacity",
                "-1GiB",
                "--cache-capacity / LARDER_CACHE_CAPACITY",
            ),
            (
                "--min-free-fraction",
                "half",
                "--min-free-fraction / LARDER_MIN_FREE_FRACTION",
            ),
            (
                "--verify-on-read",
                "maybe",
                "--verify-on-read / LARDER_VERIFY_ON_READ",
            ),
            ("--io-engine", "aio", "--io-engine / LARDER_IO_ENGINE"),
            (
                "--io-queue-depth",
                "-1",
                "--io-queue-depth / LARDER_IO_QUEUE_DEPTH",
            ),
            (
                "--origin-concurrency",
                "many",
                "--origin-concurrency / LARDER_ORIGIN_CONCURRENCY",
            ),
            (
                "--request-timeout",
                "soon",
                "--request-timeout / LARDER_REQUEST_TIMEOUT",
            ),
            ("--source", "just-a-name", "--source / LARDER_SOURCES"),
            (
                "--metrics-listen",
                "localhost:9464",
                "--metrics-listen / LARDER_METRICS_LISTEN",
            ),
        ] {
            let flag_and_value = format!("{flag}={value}");
            let err = args(&["--source", "a=s3://x", &flag_and_value])
                .load()
                .unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key: k, value: v, .. } if k == key && v == value),
                "{flag}: {err}"
            );
            assert!(
                err.to_string()
                    .starts_with(&format!("invalid {key} = {value:?}: ")),
                "{err}"
            );
        }
    }

    #[test]
    fn range_errors_from_flags_name_the_config_key() {
        let err = args(&["--source", "a=s3://x", "--origin-concurrency", "0"])
            .load()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid origin.concurrency = \"0\": must be between 1 and 1024"
        );
        let err = args(&["--source", "a=s3://x", "--read-deadline", "5s"])
            .load()
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid origin.read_deadline = \"5s\""),
            "{err}"
        );
        let err = args(&["--source", "bad name=s3://x"]).load().unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid source[0].name = \"bad name\""),
            "{err}"
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
