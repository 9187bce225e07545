//! Normalisation and validation of a [`Config`].
//!
//! Loading goes parse → apply overrides → `Config::normalise` →
//! [`Config::validate`]. Normalising only tidies text (it trims stray
//! whitespace around source names and URLs); validating checks every rule
//! and reports the first broken one with its key and value.

use std::collections::HashMap;
use std::time::Duration;

use url::Url;

use crate::bytesize::ByteSize;
use crate::error::ConfigError;
use crate::redact::SourceUrl;
use crate::schema::{
    CacheConfig, Config, OriginConfig, PeerConfig, RegistryConfig, SourceConfig, WarmConfig, check_host_port,
    is_peer_label, is_plan_name,
};

/// Smallest allowed `cache.block_size`.
const MIN_BLOCK_SIZE: ByteSize = ByteSize::mib(1);
/// Largest allowed `cache.block_size`.
const MAX_BLOCK_SIZE: ByteSize = ByteSize::mib(64);
/// Largest allowed `origin.part_size`.
const MAX_PART_SIZE: ByteSize = ByteSize::gib(1);
/// Longest allowed source name, in characters.
const MAX_SOURCE_NAME_LEN: usize = 64;
/// URL schemes a source may use.
const SOURCE_SCHEMES: [&str; 11] = [
    "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "file", "http", "https",
];

impl Config {
    /// Tidies values that have an obvious canonical form. Infallible.
    pub(crate) fn normalise(&mut self) {
        for source in &mut self.sources {
            trim_in_place(&mut source.name);
            source.url.trim();
            // Before anything can print an error that quotes them.
            crate::redact::hide_url_secrets(source.url.as_str());
        }
    }

    /// Checks every rule of the configuration.
    ///
    /// The error names the offending key (`cache.block_size`,
    /// `source[1].name`, ...; source indices count from 0) and its value.
    /// Besides checking values this looks at the filesystem once: if
    /// `cache.dir` exists it must be a directory (a missing one is fine,
    /// the daemon creates it).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_sources_optional()?;
        if self.sources.is_empty() {
            return Err(ConfigError::NoSources);
        }
        Ok(())
    }

    /// As [`Config::validate`], without requiring a `[[source]]` (the sources given are
    /// checked all the same): for commands that read the configuration but serve no source.
    pub fn validate_sources_optional(&self) -> Result<(), ConfigError> {
        validate_cache(&self.cache)?;
        validate_origin(&self.origin, self.cache.block_size)?;
        if self.mount.path.as_os_str().is_empty() {
            return Err(ConfigError::invalid("mount.path", "", "must not be empty"));
        }
        if self.control.socket.as_os_str().is_empty() {
            return Err(ConfigError::invalid("control.socket", "", "must not be empty"));
        }
        validate_peer(&self.peer)?;
        validate_warm(&self.warm)?;
        validate_registry(&self.registry)?;
        validate_sources(&self.sources)
    }
}

/// Trims leading and trailing whitespace without reallocating when there is none.
fn trim_in_place(text: &mut String) {
    let trimmed = text.trim();
    if trimmed.len() != text.len() {
        *text = trimmed.to_owned();
    }
}

fn validate_cache(cache: &CacheConfig) -> Result<(), ConfigError> {
    let dir = &cache.dir;
    if dir.as_os_str().is_empty() {
        return Err(ConfigError::invalid("cache.dir", "", "must not be empty"));
    }
    if let Ok(metadata) = std::fs::metadata(dir)
        && !metadata.is_dir()
    {
        return Err(ConfigError::invalid(
            "cache.dir",
            dir.display(),
            "exists but is not a directory",
        ));
    }

    let block = cache.block_size;
    if !block.as_u64().is_power_of_two() || block < MIN_BLOCK_SIZE || block > MAX_BLOCK_SIZE {
        return Err(ConfigError::invalid(
            "cache.block_size",
            block,
            format!("must be a power of two between {MIN_BLOCK_SIZE} and {MAX_BLOCK_SIZE}"),
        ));
    }
    if cache.capacity < block {
        return Err(ConfigError::invalid(
            "cache.capacity",
            cache.capacity,
            format!("must hold at least one block (cache.block_size = {block})"),
        ));
    }
    let fraction = cache.min_free_fraction;
    if !(0.0..1.0).contains(&fraction) {
        return Err(ConfigError::invalid(
            "cache.min_free_fraction",
            fraction,
            "must be a number from 0.0 up to but excluding 1.0",
        ));
    }
    if cache.memory_limit.as_u64() < 2 * block.as_u64() {
        return Err(ConfigError::invalid(
            "cache.memory_limit",
            cache.memory_limit,
            format!("must hold at least two blocks (cache.block_size = {block})"),
        ));
    }
    check_range("cache.io_queue_depth", cache.io_queue_depth, 1, 4096)
}

fn validate_origin(origin: &OriginConfig, block: ByteSize) -> Result<(), ConfigError> {
    let part = origin.part_size;
    if part.as_u64() == 0 || !part.as_u64().is_multiple_of(block.as_u64()) || part > MAX_PART_SIZE {
        return Err(ConfigError::invalid(
            "origin.part_size",
            part,
            format!("must be a non-zero multiple of cache.block_size ({block}) and at most {MAX_PART_SIZE}"),
        ));
    }
    check_range("origin.concurrency", origin.concurrency, 1, 1024)?;
    check_non_zero("origin.connect_timeout", origin.connect_timeout)?;
    check_non_zero("origin.request_timeout", origin.request_timeout)?;
    check_non_zero("origin.read_deadline", origin.read_deadline)?;
    if origin.read_deadline < origin.request_timeout {
        return Err(ConfigError::invalid(
            "origin.read_deadline",
            humantime::format_duration(origin.read_deadline),
            format!(
                "must be at least origin.request_timeout ({})",
                humantime::format_duration(origin.request_timeout)
            ),
        ));
    }
    check_range("origin.max_attempts", origin.max_attempts, 1, 20)?;
    if origin.backoff_max < origin.backoff_base {
        return Err(ConfigError::invalid(
            "origin.backoff_max",
            humantime::format_duration(origin.backoff_max),
            format!(
                "must be at least origin.backoff_base ({})",
                humantime::format_duration(origin.backoff_base)
            ),
        ));
    }
    let ratio = origin.retry_budget_ratio;
    if !(0.0..=10.0).contains(&ratio) {
        return Err(ConfigError::invalid(
            "origin.retry_budget_ratio",
            ratio,
            "must be a number from 0.0 to 10.0",
        ));
    }
    if origin.readahead_max < origin.readahead_min {
        return Err(ConfigError::invalid(
            "origin.readahead_max",
            origin.readahead_max,
            format!("must be at least origin.readahead_min ({})", origin.readahead_min),
        ));
    }
    Ok(())
}

fn validate_peer(peer: &PeerConfig) -> Result<(), ConfigError> {
    const LABEL: &str = "must be at most 128 characters of A-Z a-z 0-9 . _ -";
    if !is_peer_label(&peer.node_id) {
        return Err(ConfigError::invalid("peer.node_id", &peer.node_id, LABEL));
    }
    if !is_peer_label(&peer.rack) {
        return Err(ConfigError::invalid("peer.rack", &peer.rack, LABEL));
    }
    if let Some(dns) = &peer.dns {
        check_host_port(dns).map_err(|reason| ConfigError::invalid("peer.dns", dns, reason))?;
    }
    let mut seen = HashMap::new();
    for (index, member) in peer.members.iter().enumerate() {
        if let Some(first) = seen.insert(member.id.as_str(), index) {
            return Err(ConfigError::invalid(
                "peer.members",
                member,
                format!("node id {:?} is also member {first}", member.id),
            ));
        }
    }
    match (&peer.tls_cert, &peer.tls_key) {
        (Some(cert), None) => {
            return Err(ConfigError::invalid(
                "peer.tls_cert",
                cert.display(),
                "the listener needs peer.tls_key too",
            ));
        }
        (None, Some(key)) => {
            return Err(ConfigError::invalid(
                "peer.tls_key",
                key.display(),
                "the listener needs peer.tls_cert too",
            ));
        }
        _ => {}
    }
    if peer.tls_name.is_empty() {
        return Err(ConfigError::invalid(
            "peer.tls_name",
            &peer.tls_name,
            "must be the name members' certificates are issued for",
        ));
    }
    check_non_zero("peer.dns_interval", peer.dns_interval)?;
    check_non_zero("peer.first_byte_timeout", peer.first_byte_timeout)?;
    check_non_zero("peer.stall_timeout", peer.stall_timeout)
}

fn validate_warm(warm: &WarmConfig) -> Result<(), ConfigError> {
    if let Some(plan) = &warm.plan {
        let shown = plan.display().to_string();
        let name = warm.plan_name().unwrap_or_default();
        if !is_plan_name(&name) {
            return Err(ConfigError::invalid(
                "warm.plan",
                shown,
                "the file name without its extension names the label larder.dev/warm-NAME: \
                 1 to 58 characters of A-Z a-z 0-9 - _ ., beginning and ending with a letter or digit",
            ));
        }
    }
    if let Some(server) = &warm.api_server {
        match Url::parse(server) {
            Ok(url) if ["http", "https"].contains(&url.scheme()) && url.host().is_some() => {}
            _ => {
                return Err(ConfigError::invalid(
                    "warm.api_server",
                    server,
                    "expected http(s)://HOST[:PORT]",
                ));
            }
        }
    }
    check_non_zero("warm.check_interval", warm.check_interval)
}

fn validate_registry(registry: &RegistryConfig) -> Result<(), ConfigError> {
    if registry
        .containerd_hosts_dir
        .as_ref()
        .is_some_and(|dir| dir.as_os_str().is_empty())
    {
        return Err(ConfigError::invalid(
            "registry.containerd_hosts_dir",
            "",
            "must not be empty",
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for upstream in &registry.upstreams {
        if !seen.insert(upstream.host.as_str()) {
            return Err(ConfigError::invalid(
                "registry.upstreams",
                upstream.to_string(),
                format!("registry {:?} is listed twice", upstream.host),
            ));
        }
    }
    Ok(())
}

fn validate_sources(sources: &[SourceConfig]) -> Result<(), ConfigError> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (index, source) in sources.iter().enumerate() {
        check_source_name(index, &source.name)?;
        if let Some(first) = seen.insert(&source.name, index) {
            return Err(ConfigError::invalid(
                format!("source[{index}].name"),
                &source.name,
                format!("duplicate source name (also used by source[{first}])"),
            ));
        }
        check_source_url(index, &source.url)?;
    }
    Ok(())
}

fn check_source_name(index: usize, name: &str) -> Result<(), ConfigError> {
    let fail = |reason: &str| {
        Err(ConfigError::invalid(
            format!("source[{index}].name"),
            name,
            reason,
        ))
    };
    let length = name.chars().count();
    if length == 0 || length > MAX_SOURCE_NAME_LEN {
        return fail("must be 1 to 64 characters long");
    }
    if !name
        .chars()
        .all(|c| matches!(c, 'a'..='z' | '0'..='9' | '.' | '_' | '-'))
    {
        return fail("may only contain lowercase letters a-z, digits 0-9, '.', '_' and '-'");
    }
    if name == "." || name == ".." {
        return fail("must not be \".\" or \"..\"");
    }
    Ok(())
}

fn check_source_url(index: usize, source_url: &SourceUrl) -> Result<(), ConfigError> {
    // The value is shown with its secrets hidden; url's errors never quote the text.
    let fail = |reason: String| {
        Err(ConfigError::invalid(
            format!("source[{index}].url"),
            source_url,
            reason,
        ))
    };
    let url = match Url::parse(source_url.as_str()) {
        Ok(url) => url,
        Err(err) => return fail(format!("not a URL ({err}); expected e.g. \"s3://bucket/prefix\"")),
    };
    let scheme = url.scheme();
    if !SOURCE_SCHEMES.contains(&scheme) {
        return fail(format!(
            "unsupported scheme {scheme:?}; expected one of {}",
            SOURCE_SCHEMES.join(", ")
        ));
    }
    if scheme != "file" && url.host_str().is_none_or(str::is_empty) {
        return fail(format!(
            "a {scheme}:// URL needs a bucket, container or host after the \"//\""
        ));
    }
    if scheme == "file" {
        // A local directory is not an origin that comes back later: a missing one is a
        // mistake in the configuration, said plainly at start rather than as EIO on reads.
        let Ok(path) = url.to_file_path() else {
            return fail("a file:// URL needs an absolute local path, e.g. \"file:///data/models\"".into());
        };
        match std::fs::metadata(&path) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => return fail(format!("{} is not a directory", path.display())),
            Err(err) => return fail(format!("cannot use directory {}: {err}", path.display())),
        }
    }
    Ok(())
}

/// Checks that an integer setting lies in `min..=max`.
fn check_range<T>(key: &str, value: T, min: T, max: T) -> Result<(), ConfigError>
where
    T: PartialOrd + std::fmt::Display,
{
    if value < min || value > max {
        return Err(ConfigError::invalid(
            key,
            &value,
            format!("must be between {min} and {max}"),
        ));
    }
    Ok(())
}

/// Checks that a timeout is not zero.
fn check_non_zero(key: &str, value: Duration) -> Result<(), ConfigError> {
    if value.is_zero() {
        return Err(ConfigError::invalid(key, "0s", "must be greater than zero"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::IoEngineKind;

    /// A valid config with one source, to break one rule at a time.
    fn valid() -> Config {
        let mut config = Config::default();
        config.cache.dir = std::env::temp_dir().join("larder-config-test-missing-dir");
        config
            .sources
            .push(SourceConfig::new("data", "s3://bucket/prefix"));
        config
    }

    /// Asserts that `config` is rejected with an error naming `key` and `value`.
    #[track_caller]
    fn assert_invalid(config: &Config, key: &str, value: &str) {
        let err = config.validate().expect_err("config should be rejected");
        let text = err.to_string();
        assert!(
            matches!(&err, ConfigError::Invalid { key: k, value: v, .. } if k == key && v == value),
            "expected {key} = {value:?}, got: {text}"
        );
        assert!(
            text.contains(key) && text.contains(&format!("{value:?}")),
            "{text}"
        );
    }

    #[test]
    fn half_a_tls_pair_is_refused_naming_the_half_given() {
        let mut config = valid();
        config.peer.tls_cert = Some("peer.crt".into());
        assert_invalid(&config, "peer.tls_cert", "peer.crt");
        config.peer.tls_cert = None;
        config.peer.tls_key = Some("peer.key".into());
        assert_invalid(&config, "peer.tls_key", "peer.key");
        config.peer.tls_cert = Some("peer.crt".into());
        config.validate().expect("a whole pair");
        config.peer.tls_name.clear();
        assert_invalid(&config, "peer.tls_name", "");
    }

    #[test]
    fn warm_plan_names_a_label_and_the_api_server_is_a_url() {
        let mut config = valid();
        for good in ["/p/llama-70b.toml", "/p/a", "/p/v1.2_x.toml"] {
            config.warm.plan = Some(good.into());
            config.validate().unwrap();
        }
        for bad in [
            "/p/-a.toml",
            "/p/a b.toml",
            "/p/.toml",
            &format!("/p/{}.toml", "x".repeat(59)),
        ] {
            config.warm.plan = Some(bad.into());
            assert_invalid(&config, "warm.plan", bad);
        }
        config.warm.plan = None;
        config.warm.api_server = Some("127.0.0.1:8080".into());
        assert_invalid(&config, "warm.api_server", "127.0.0.1:8080");
        config.warm.api_server = Some("http://127.0.0.1:8080".into());
        config.validate().unwrap();
        config.warm.check_interval = Duration::ZERO;
        assert!(config.validate().is_err());
    }

    #[test]
    fn the_baseline_is_valid() {
        valid().validate().unwrap();
        let mut config = valid();
        config.cache.io_engine = IoEngineKind::Psync;
        config.cache.min_free_fraction = 0.0;
        config.origin.backoff_base = Duration::ZERO;
        config.origin.retry_budget_ratio = 10.0;
        config.origin.part_size = ByteSize::gib(1);
        config.cache.block_size = ByteSize::mib(64);
        config.cache.capacity = ByteSize::mib(64);
        config.validate().unwrap();
    }

    #[test]
    fn block_size_must_be_power_of_two_in_range() {
        for (size, text) in [
            (ByteSize::mib(3), "3MiB"),
            (ByteSize::kib(512), "512KiB"),
            (ByteSize::mib(128), "128MiB"),
        ] {
            let mut config = valid();
            config.cache.block_size = size;
            config.origin.part_size = ByteSize::mib(384);
            assert_invalid(&config, "cache.block_size", text);
        }
        let mut config = valid();
        config.cache.block_size = ByteSize::mib(3);
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "invalid cache.block_size = \"3MiB\": must be a power of two between 1MiB and 64MiB"
        );
    }

    #[test]
    fn capacity_must_hold_one_block() {
        let mut config = valid();
        config.cache.capacity = ByteSize::mib(2);
        assert_invalid(&config, "cache.capacity", "2MiB");
    }

    #[test]
    fn min_free_fraction_range() {
        for (fraction, text) in [
            (1.0, "1"),
            (-0.1, "-0.1"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "inf"),
        ] {
            let mut config = valid();
            config.cache.min_free_fraction = fraction;
            assert_invalid(&config, "cache.min_free_fraction", text);
        }
    }

    #[test]
    fn memory_limit_holds_two_blocks() {
        let mut config = valid();
        config.cache.memory_limit = ByteSize::mib(7);
        assert_invalid(&config, "cache.memory_limit", "7MiB");
        config.cache.memory_limit = ByteSize::mib(8);
        assert!(config.validate().is_ok());
    }

    #[test]
    fn io_queue_depth_range() {
        for depth in [0, 4097] {
            let mut config = valid();
            config.cache.io_queue_depth = depth;
            assert_invalid(&config, "cache.io_queue_depth", &depth.to_string());
        }
    }

    #[test]
    fn part_size_must_be_block_multiple_up_to_one_gib() {
        let mut config = valid();
        config.origin.part_size = ByteSize::mib(6);
        assert_invalid(&config, "origin.part_size", "6MiB");
        config.origin.part_size = ByteSize(0);
        assert_invalid(&config, "origin.part_size", "0B");
        config.origin.part_size = ByteSize::gib(2);
        assert_invalid(&config, "origin.part_size", "2GiB");
    }

    #[test]
    fn concurrency_and_attempts_ranges() {
        let mut config = valid();
        config.origin.concurrency = 0;
        assert_invalid(&config, "origin.concurrency", "0");
        config.origin.concurrency = 1025;
        assert_invalid(&config, "origin.concurrency", "1025");
        let mut config = valid();
        config.origin.max_attempts = 0;
        assert_invalid(&config, "origin.max_attempts", "0");
        config.origin.max_attempts = 21;
        assert_invalid(&config, "origin.max_attempts", "21");
    }

    #[test]
    fn timeouts_must_be_non_zero_and_ordered() {
        let mut config = valid();
        config.origin.read_deadline = Duration::from_secs(5);
        assert_invalid(&config, "origin.read_deadline", "5s");
        for field in ["connect_timeout", "request_timeout", "read_deadline"] {
            let mut config = valid();
            match field {
                "connect_timeout" => config.origin.connect_timeout = Duration::ZERO,
                "request_timeout" => config.origin.request_timeout = Duration::ZERO,
                _ => config.origin.read_deadline = Duration::ZERO,
            }
            assert_invalid(&config, &format!("origin.{field}"), "0s");
        }
    }

    #[test]
    fn backoff_retry_budget_and_readahead() {
        let mut config = valid();
        config.origin.backoff_max = Duration::from_millis(10);
        assert_invalid(&config, "origin.backoff_max", "10ms");
        let mut config = valid();
        config.origin.retry_budget_ratio = 10.5;
        assert_invalid(&config, "origin.retry_budget_ratio", "10.5");
        config.origin.retry_budget_ratio = f64::NAN;
        assert_invalid(&config, "origin.retry_budget_ratio", "NaN");
        let mut config = valid();
        config.origin.readahead_max = ByteSize::mib(4);
        assert_invalid(&config, "origin.readahead_max", "4MiB");
    }

    #[test]
    fn at_least_one_source() {
        let mut config = valid();
        config.sources.clear();
        let err = config.validate().unwrap_err();
        assert!(matches!(err, ConfigError::NoSources));
        assert!(
            err.to_string().contains("at least one [[source]] is required"),
            "{err}"
        );
    }

    #[test]
    fn duplicate_source_names() {
        let mut config = valid();
        config.sources.push(SourceConfig::new("other", "gs://b"));
        config.sources.push(SourceConfig::new("data", "gs://c"));
        assert_invalid(&config, "source[2].name", "data");
        assert!(config.validate().unwrap_err().to_string().contains("source[0]"));
    }

    #[test]
    fn bad_source_names() {
        let long = "a".repeat(65);
        for name in [
            "../x",
            "A B",
            "",
            ".",
            "..",
            "Data",
            "a/b",
            "naïve",
            long.as_str(),
        ] {
            let mut config = valid();
            config.sources.push(SourceConfig::new(name, "gs://b"));
            assert_invalid(&config, "source[1].name", name);
        }
        let mut config = valid();
        config.sources.push(SourceConfig::new("a".repeat(64), "gs://b"));
        config.sources.push(SourceConfig::new("x.y_z-0..", "gs://b"));
        config.validate().unwrap();
    }

    #[test]
    fn bad_source_urls() {
        for url in ["ftp://x", "not a url", "", "s3://", "s3:bucket", "https://"] {
            let mut config = valid();
            config.sources[0].url = url.into();
            assert_invalid(&config, "source[0].url", url);
        }
        // A rejected URL is quoted with its secrets hidden.
        let mut config = valid();
        config.sources[0].url = "ftp://alice:PW@host/x?sig=S".into();
        assert_invalid(&config, "source[0].url", "ftp://***@host/x?sig=***");
        let err = {
            let mut config = valid();
            config.sources[0].url = "ftp://x".into();
            config.validate().unwrap_err().to_string()
        };
        assert!(err.contains("unsupported scheme \"ftp\""), "{err}");
    }

    #[test]
    fn accepted_source_urls() {
        let urls = [
            "s3://b/p",
            "s3a://b",
            "gs://b/p/",
            "az://container/p",
            "azure://container",
            "abfs://fs@account.dfs.core.windows.net/p",
            "abfss://fs@account.dfs.core.windows.net",
            "adl://account.azuredatalakestore.net/p",
            "file:///",
            "http://localhost:9000/bucket",
            "https://storage.example.com/b",
        ];
        let mut config = valid();
        config.sources = urls
            .iter()
            .enumerate()
            .map(|(i, url)| SourceConfig::new(format!("s{i}"), *url))
            .collect();
        config.validate().unwrap();
    }

    #[test]
    fn registry_upstreams_once_each_and_a_hosts_dir_that_names_one() {
        let mut config = valid();
        config.registry.upstreams = vec!["nvcr.io".parse().unwrap(), "nvcr.io".parse().unwrap()];
        assert_invalid(&config, "registry.upstreams", "nvcr.io");
        config.registry.upstreams.pop();
        config.registry.containerd_hosts_dir = Some("".into());
        assert_invalid(&config, "registry.containerd_hosts_dir", "");
        config.registry.containerd_hosts_dir = Some("/etc/containerd/certs.d".into());
        config.validate().unwrap();
    }

    #[test]
    fn cache_dir_must_not_be_a_file() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let mut config = valid();
        config.cache.dir = file.path().to_path_buf();
        assert_invalid(&config, "cache.dir", &file.path().display().to_string());

        let dir = tempfile::tempdir().unwrap();
        config.cache.dir = dir.path().to_path_buf();
        config.validate().unwrap();
        config.cache.dir = dir.path().join("not-yet-created");
        config.validate().unwrap();
        config.cache.dir = "".into();
        assert_invalid(&config, "cache.dir", "");
    }

    #[test]
    fn normalise_trims_source_text() {
        let mut config = valid();
        config.sources[0] = SourceConfig::new("  data ", " s3://bucket/prefix\n");
        config.normalise();
        assert_eq!(config, valid());
    }
}
