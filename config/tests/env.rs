//! `LARDER_*` variables as clap reads them from the process environment. The only test of this
//! binary, so setting variables races with nothing.

use std::io::Write;
use std::path::Path;

use clap::Parser;
use larder_config::ConfigArgs;

fn args(flags: &[&str]) -> ConfigArgs {
    ConfigArgs::try_parse_from(std::iter::once("larder").chain(flags.iter().copied())).expect("flags")
}

#[test]
fn the_environment_sits_between_the_file_and_the_flags_and_is_named_in_errors() {
    let mut file = tempfile::NamedTempFile::new().expect("file");
    file.write_all(
        b"[mount]\npath = \"/mnt/file\"\n[control]\nsocket = \"/run/file.sock\"\n\
          [[source]]\nname = \"a\"\nurl = \"s3://x\"\n",
    )
    .expect("write");
    let config_path = file.path().to_str().expect("utf-8");
    // SAFETY: this binary's only test sets these before reading them; no other thread reads
    // the environment meanwhile.
    unsafe {
        std::env::set_var("LARDER_CONFIG", config_path);
        std::env::set_var("LARDER_MOUNT", "/mnt/env");
        std::env::set_var("LARDER_CONTROL_SOCKET", "/run/env.sock");
    }
    // Environment over file.
    let config = args(&[]).load().expect("load");
    assert_eq!(config.mount.path, Path::new("/mnt/env"));
    assert_eq!(config.control.socket, Path::new("/run/env.sock"));
    // Flag over environment.
    let config = args(&["--mount", "/mnt/flag"]).load().expect("load");
    assert_eq!(config.mount.path, Path::new("/mnt/flag"));
    assert_eq!(config.control.socket, Path::new("/run/env.sock"));

    // A bad value is named by where it came from.
    // SAFETY: as above.
    unsafe { std::env::set_var("LARDER_ORIGIN_CONCURRENCY", "0") };
    let err = args(&[]).load().expect_err("0 is out of range");
    assert_eq!(
        err.to_string(),
        "invalid LARDER_ORIGIN_CONCURRENCY = \"0\": must be between 1 and 1024"
    );
    let err = args(&["--origin-concurrency", "2000"])
        .load()
        .expect_err("out of range");
    assert_eq!(
        err.to_string(),
        "invalid --origin-concurrency = \"2000\": must be between 1 and 1024"
    );
    // SAFETY: as above.
    unsafe {
        std::env::remove_var("LARDER_ORIGIN_CONCURRENCY");
        std::env::set_var("LARDER_SOURCES", "b=gopher://x");
    }
    let err = args(&[]).load().expect_err("bad scheme");
    assert!(
        err.to_string()
            .starts_with("invalid LARDER_SOURCES = \"b=gopher://x\""),
        "{err}"
    );
}
