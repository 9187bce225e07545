//! Every `LARDER_*` variable of a setting: a bad value is refused naming the variable, and the
//! list variables (`LARDER_SOURCES` and the per-source ones) merge with their flags name by
//! name. The only test of this binary, so setting variables races with nothing.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use clap::Parser;
use larder_config::{ConfigArgs, SourceConfig};

fn args(flags: &[&str]) -> Result<ConfigArgs, clap::Error> {
    ConfigArgs::try_parse_from(std::iter::once("larder").chain(flags.iter().copied()))
}

/// The error of loading with `flags`, as text: a parse error of the command line or a
/// configuration error.
fn error_of(flags: &[&str]) -> String {
    match args(flags) {
        Ok(args) => args
            .load()
            .map(|_| "loaded".to_owned())
            .unwrap_or_else(|e| e.to_string()),
        Err(e) => e.to_string(),
    }
}

fn set(name: &str, value: impl AsRef<OsStr>) {
    // SAFETY: this binary's only test sets variables before reading them; no other thread
    // reads the environment meanwhile.
    unsafe { std::env::set_var(name, value) };
}

fn remove(name: &str) {
    // SAFETY: as in `set`.
    unsafe { std::env::remove_var(name) };
}

#[test]
fn variables_are_validated_by_name_and_list_variables_merge_with_their_flags() {
    let dir = tempfile::tempdir().expect("dir");
    set("LARDER_SOURCES", "a=s3://x");
    let bad = [
        ("LARDER_MOUNT", ""),
        ("LARDER_CONTROL_SOCKET", ""),
        ("LARDER_CACHE_DIR", ""),
        ("LARDER_CACHE_CAPACITY", "lots"),
        ("LARDER_MIN_FREE_FRACTION", "half"),
        ("LARDER_BLOCK_SIZE", "3MiB"),
        ("LARDER_VERIFY_ON_READ", "maybe"),
        ("LARDER_PASSTHROUGH", "maybe"),
        ("LARDER_IO_ENGINE", "aio"),
        ("LARDER_IO_QUEUE_DEPTH", "-1"),
        ("LARDER_PART_SIZE", "big"),
        ("LARDER_ORIGIN_CONCURRENCY", "many"),
        ("LARDER_CONNECT_TIMEOUT", "soon"),
        ("LARDER_REQUEST_TIMEOUT", "soon"),
        ("LARDER_READ_DEADLINE", "1 fortnight"),
        ("LARDER_MAX_ATTEMPTS", "0"),
        ("LARDER_BACKOFF_BASE", "-1s"),
        ("LARDER_BACKOFF_MAX", "x"),
        ("LARDER_RETRY_BUDGET_RATIO", "NaN"),
        ("LARDER_READAHEAD_MIN", "1 MB/s"),
        ("LARDER_READAHEAD_MAX", "bogus"),
        ("LARDER_METRICS_LISTEN", "localhost:1"),
        ("LARDER_SOURCE_IMMUTABLE", "a=perhaps"),
        ("LARDER_SOURCE_METADATA_TTL", "a=later"),
        ("LARDER_CONFIG", ""),
    ];
    // A path may be any bytes; every other value is text.
    let paths = [
        "LARDER_MOUNT",
        "LARDER_CONTROL_SOCKET",
        "LARDER_CACHE_DIR",
        "LARDER_CONFIG",
    ];
    let mut unnamed = Vec::new();
    for (name, value) in bad {
        let not_utf8 = OsStr::from_bytes(b"4Mi\xffB");
        let values = if paths.contains(&name) {
            &[OsStr::new(value)][..]
        } else {
            &[OsStr::new(value), not_utf8]
        };
        for &value in values {
            set(name, value);
            let text = error_of(&[]);
            if !text.contains(name) {
                unnamed.push(format!("{name}={value:?}: {text}"));
            }
        }
        remove(name);
    }
    assert!(
        unnamed.is_empty(),
        "errors not naming the variable:\n{}",
        unnamed.join("\n")
    );

    // Sources merge name by name: a flag over the variable, the variable over the file.
    let file = dir.path().join("larder.toml");
    std::fs::write(
        &file,
        "[[source]]\nname = \"a\"\nurl = \"s3://file-a\"\n\
         [[source]]\nname = \"b\"\nurl = \"s3://file-b\"\nimmutable = true\n",
    )
    .expect("write");
    set("LARDER_CONFIG", &file);
    set("LARDER_SOURCES", "b=s3://env-b,c=s3://env-c");
    set("LARDER_SOURCE_IMMUTABLE", "b=false");
    set("LARDER_SOURCE_METADATA_TTL", "c=5m");
    let flags = [
        "--source",
        "c=s3://flag-c",
        "--source",
        "d=s3://flag-d",
        "--source-immutable",
        "c=true",
    ];
    let config = args(&flags).expect("flags").load().expect("load");
    let source = |name: &str, url: &str, immutable: bool, ttl: u64| SourceConfig {
        immutable,
        metadata_ttl: Duration::from_secs(ttl),
        ..SourceConfig::new(name, url)
    };
    assert_eq!(
        config.sources,
        [
            source("a", "s3://file-a", false, 60),
            source("b", "s3://env-b", false, 60),
            source("c", "s3://flag-c", true, 300),
            source("d", "s3://flag-d", false, 60),
        ]
    );
    // Without flags, the variables alone.
    let config = args(&[]).expect("flags").load().expect("load");
    assert_eq!(config.sources[2], source("c", "s3://env-c", false, 300));
    // A bad entry is named by where it came from, flags or not.
    set("LARDER_SOURCES", "e=ftp://x");
    let err = args(&flags).expect("flags").load().expect_err("ftp").to_string();
    assert!(err.starts_with("invalid LARDER_SOURCES = \"e=ftp://x\""), "{err}");
    set("LARDER_SOURCE_METADATA_TTL", "zz=5m");
    set("LARDER_SOURCES", "b=s3://env-b");
    let err = args(&flags)
        .expect("flags")
        .load()
        .expect_err("no zz")
        .to_string();
    assert!(
        err.starts_with("invalid LARDER_SOURCE_METADATA_TTL = \"zz=5m\""),
        "{err}"
    );
}
