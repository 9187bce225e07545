//! The configuration's entry points over arbitrary input: TOML text, values of every key in
//! the file, and values of every flag (the variables' values go through the same parsers).
//! Each gives a configuration or a typed error naming the setting, never a panic.

use clap::Parser;
use larder_config::{Config, ConfigArgs, ConfigError, Redacted};
use proptest::prelude::*;

/// Every key of the file with a value that must be quoted text, and every flag but
/// `--config` (which would read whatever file the input names).
const KEYS: &[(&str, &str)] = &[
    ("cache", "dir"),
    ("cache", "capacity"),
    ("cache", "min_free_fraction"),
    ("cache", "block_size"),
    ("cache", "verify_on_read"),
    ("cache", "passthrough"),
    ("cache", "io_engine"),
    ("cache", "io_queue_depth"),
    ("origin", "part_size"),
    ("origin", "concurrency"),
    ("origin", "connect_timeout"),
    ("origin", "request_timeout"),
    ("origin", "read_deadline"),
    ("origin", "max_attempts"),
    ("origin", "backoff_base"),
    ("origin", "backoff_max"),
    ("origin", "retry_budget_ratio"),
    ("origin", "readahead_min"),
    ("origin", "readahead_max"),
    ("metrics", "listen"),
    ("mount", "path"),
    ("control", "socket"),
    ("peer", "node_id"),
    ("peer", "rack"),
    ("peer", "listen"),
    ("peer", "dns"),
    ("peer", "dns_interval"),
    ("peer", "dns_server"),
    ("peer", "cluster_key_file"),
    ("peer", "insecure"),
    ("peer", "first_byte_timeout"),
    ("peer", "stall_timeout"),
    ("peer", "min_rate"),
    ("peer", "probe_interval"),
    ("peer", "tls_cert"),
    ("peer", "tls_key"),
    ("peer", "tls_ca"),
    ("peer", "tls_name"),
    ("registry", "listen"),
    ("registry", "upstreams"),
    ("registry", "credentials"),
    ("registry", "tag_ttl"),
    ("source", "name"),
    ("source", "url"),
    ("source", "immutable"),
    ("source", "metadata_ttl"),
];

const FLAGS: &[&str] = &[
    "--mount",
    "--control-socket",
    "--cache-dir",
    "--cache-capacity",
    "--min-free-fraction",
    "--block-size",
    "--verify-on-read",
    "--passthrough",
    "--io-engine",
    "--io-queue-depth",
    "--part-size",
    "--origin-concurrency",
    "--connect-timeout",
    "--request-timeout",
    "--read-deadline",
    "--max-attempts",
    "--backoff-base",
    "--backoff-max",
    "--retry-budget-ratio",
    "--readahead-min",
    "--readahead-max",
    "--metrics-listen",
    "--node-id",
    "--rack",
    "--peer-listen",
    "--peers",
    "--peer-dns",
    "--peer-dns-interval",
    "--peer-dns-server",
    "--cluster-key-file",
    "--peer-insecure",
    "--peer-first-byte-timeout",
    "--peer-stall-timeout",
    "--peer-tls-cert",
    "--peer-tls-key",
    "--peer-tls-ca",
    "--peer-tls-name",
    "--registry-listen",
    "--registry-upstream",
    "--registry-credentials",
    "--registry-tag-ttl",
    "--source",
    "--source-immutable",
    "--source-metadata-ttl",
];

/// Whether an error's `key` names a setting: a flag, or a key of the file (a rule between two
/// keys may name the other one).
fn names_a_setting(key: &str) -> bool {
    let indexed = key
        .strip_prefix("source[")
        .and_then(|rest| rest.split_once("]."))
        .map(|(_, name)| format!("source.{name}"));
    let key = indexed.as_deref().unwrap_or(key);
    FLAGS.contains(&key) || KEYS.iter().any(|(table, name)| key == format!("{table}.{name}"))
}

/// A value as TOML writes it: a string, a number or a boolean.
fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>().prop_map(|text| toml::Value::String(text).to_string()),
        "[0-9]{1,3}(MiB|GiB|KiB|B|ms|s|m)?".prop_map(|text| toml::Value::String(text).to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|n| toml::Value::Float(n).to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any text at all.
    #[test]
    fn arbitrary_toml_text(text in any::<String>()) {
        let _ = Config::from_toml_str(&text);
    }

    /// A well-formed file whose one key holds anything: a configuration, or an error that
    /// names a setting.
    #[test]
    fn any_value_of_each_key(key in 0..KEYS.len(), value in toml_value()) {
        let (table, name) = KEYS[key];
        let source = if table == "source" {
            format!("[[source]]\n{name} = {value}\n")
        } else {
            format!("[{table}]\n{name} = {value}\n")
        };
        let text = format!("{source}[[source]]\nname = \"z\"\nurl = \"s3://bucket\"\n");
        match Config::from_toml_str(&text) {
            Ok(_) => {}
            Err(ConfigError::Invalid { key, .. }) => prop_assert!(
                names_a_setting(&key),
                "{} named for {}.{}", key, table, name
            ),
            Err(ConfigError::Parse { .. } | ConfigError::NoSources) => {}
            Err(other) => prop_assert!(false, "{}", other),
        }
    }

    /// Any value of each flag: a configuration, or an error that names a setting.
    #[test]
    fn any_value_of_each_flag(flag in 0..FLAGS.len(), value in prop_oneof![any::<String>(), "[a-z]=[ -~]{0,16}"]) {
        let flag = FLAGS[flag];
        let argv = ["larder", "--source", "z=s3://bucket", &format!("{flag}={value}")];
        // clap refuses a value it cannot take (a NUL in a path), naming the flag itself.
        let Ok(args) = ConfigArgs::try_parse_from(argv) else { return Ok(()) };
        match args.load() {
            Ok(_) => {}
            Err(ConfigError::Invalid { key, .. }) => prop_assert!(
                names_a_setting(&key),
                "{} named for {}", key, flag
            ),
            Err(other) => prop_assert!(false, "{}: {}", flag, other),
        }
    }

    /// Redaction of text made of URL pieces (schemes, user info, queries) and wide characters:
    /// never a panic, and never a password that was in the text.
    #[test]
    fn redaction_of_url_like_text(
        pieces in prop::collection::vec(
            "[ (é\u{1970}]{0,2}[a-z0-9+.-]{0,3}://([a-z]{1,3}:PW@)?[a-zé/@:?#&=%\\\\)]{0,12}",
            1..4,
        ),
    ) {
        let text = pieces.concat();
        let shown = Redacted(&text).to_string();
        prop_assert!(!shown.contains(":PW@"), "{} shown as {}", text, shown);
    }
}
