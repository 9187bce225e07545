//! The `larder` command as a newcomer meets it: what it says when no daemon runs, and paths
//! given relative to the current directory.

use std::path::Path;
use std::process::{Command, Output};

use larder_tests::daemon::DaemonProcess;
use larder_tests::{S3Server, seed};

const BIN: &str = env!("CARGO_BIN_EXE_larder");

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// With no daemon: one line naming the socket and what to do, no backtrace, exit 1.
#[test]
fn status_without_a_daemon_says_so_in_one_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("control.sock");
    for command in [&["status"][..], &["prefetch", "models:x"], &["unpin", "models:x"]] {
        let output = Command::new(BIN)
            .args(command)
            .arg("--socket")
            .arg(&socket)
            .env("RUST_BACKTRACE", "1")
            .env_remove("LARDER_CONTROL_SOCKET")
            .output()
            .expect("run larder");
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{command:?}: {text}");
        assert_eq!(text.lines().count(), 1, "{command:?}: not one line:\n{text}");
        assert!(
            text.contains(&socket.display().to_string())
                && text.contains("larder daemon")
                && text.contains("--socket"),
            "{command:?}: {text}"
        );
        assert!(!text.to_lowercase().contains("backtrace"), "{text}");
    }
}

/// `larder prefetch` run inside the mount takes paths relative to the current directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_takes_paths_relative_to_the_current_directory() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for (key, size) in [
        ("llama/a.bin", 3 << 20),
        ("llama/b.bin", 5 << 20),
        ("other/c.bin", 1 << 20),
    ] {
        server.put(key, seed(key, 0), size).await.expect("put");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let output = tokio::task::spawn_blocking(move || {
        let output = Command::new(BIN)
            .args(["prefetch", "--wait", "a.bin", "./b.bin"])
            .current_dir(daemon.mount.join("llama"))
            .env("LARDER_CONTROL_SOCKET", &daemon.socket)
            .output()
            .expect("run larder");
        drop(daemon);
        output
    })
    .await
    .expect("join");
    let text = stderr(&output);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("2 objects") && text.contains("done"), "{text}");
}

/// `--control-socket` replaces only a socket nobody answers on: a regular file or a symlink
/// there is an error naming the path, and stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_socket_replaces_only_a_dead_socket() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put("a.bin", seed("a.bin", 0), 1000).await.expect("put");
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("control.sock");
    let kept = dir.path().join("kept.txt");
    std::fs::write(&kept, "keep me").expect("write");
    tokio::task::spawn_blocking(move || {
        // A regular file at the socket's path.
        std::fs::write(&socket, "not a socket").expect("write");
        let error = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect_err("started");
        let text = format!("{error:#}");
        assert!(text.contains(&socket.display().to_string()), "{text}");
        assert_eq!(std::fs::read_to_string(&socket).expect("file"), "not a socket");

        // A symlink at the socket's path.
        std::fs::remove_file(&socket).expect("remove");
        std::os::unix::fs::symlink(&kept, &socket).expect("symlink");
        let error = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect_err("started");
        let text = format!("{error:#}");
        assert!(text.contains(&socket.display().to_string()), "{text}");
        assert_eq!(std::fs::read_link(&socket).expect("symlink"), kept);
        assert_eq!(std::fs::read_to_string(&kept).expect("file"), "keep me");

        // A socket left by a dead listener is replaced.
        std::fs::remove_file(&socket).expect("remove");
        drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
        let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
        std::os::unix::net::UnixStream::connect(&daemon.socket).expect("connect");
        assert_eq!(daemon.stop().expect("stop").code(), Some(0));
    })
    .await
    .expect("join");
}

/// `larder status | head`: a reader that closes its end early ends the command quietly, with
/// no panic, in text and in JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_into_a_closed_pipe_exits_quietly() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put("a.bin", seed("a.bin", 0), 1 << 20).await.expect("put");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let outputs = tokio::task::spawn_blocking(move || {
        let outputs: Vec<_> = [&["status"][..], &["status", "--json"]]
            .into_iter()
            .map(|command| {
                let mut child = Command::new(BIN)
                    .args(command)
                    .env("LARDER_CONTROL_SOCKET", &daemon.socket)
                    .env("RUST_BACKTRACE", "1")
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("run larder");
                // The reader goes away before the command prints anything.
                drop(child.stdout.take());
                (command, child.wait_with_output().expect("wait for larder"))
            })
            .collect();
        drop(daemon);
        outputs
    })
    .await
    .expect("join");
    for (command, output) in outputs {
        let text = stderr(&output);
        assert!(!text.contains("panicked"), "{command:?}: {text}");
        assert!(!text.contains("Broken pipe"), "{command:?}: {text}");
        assert!(
            output.status.success(),
            "{command:?}: {:?}: {text}",
            output.status
        );
    }
}

/// A `LARDER_*` variable that no setting reads (here a misspelt one) is named in a warning,
/// with the variable it is most like; the daemon starts all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_larder_variable_is_warned_about() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let dir = tempfile::tempdir().expect("tempdir");
    let log = tokio::task::block_in_place(|| {
        let env = [("LARDER_CACHE_CAPACITI", "1GiB"), ("LARDER_LOG", "info")];
        let daemon =
            DaemonProcess::start_with_env(Path::new(BIN), &server, dir.path(), &[], &env).expect("daemon");
        drop(daemon);
        std::fs::read_to_string(dir.path().join("daemon.log")).expect("log")
    });
    let warning = log
        .lines()
        .find(|line| line.contains("LARDER_CACHE_CAPACITI"))
        .unwrap_or_else(|| panic!("no warning:\n{log}"));
    assert!(
        warning.contains("WARN") && warning.contains("did you mean LARDER_CACHE_CAPACITY"),
        "{warning}"
    );
    assert!(
        !log.contains("LARDER_LOG"),
        "a known variable is warned about:\n{log}"
    );
}

/// `larder containerd-config` reads only `[registry]`: it needs no source, with or without a
/// config file, and writes or prints the same files.
#[test]
fn containerd_config_needs_no_source() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("larder.toml");
    std::fs::write(&config, "[registry]\nupstreams = [\"nvcr.io\"]\n").expect("config");
    let hosts = dir.path().join("certs.d");
    let runs: [&[&str]; 2] = [
        &["containerd-config", "--registry-upstream", "nvcr.io"],
        &[
            "containerd-config",
            "--config",
            config.to_str().unwrap(),
            "--dir",
            hosts.to_str().unwrap(),
        ],
    ];
    for args in runs {
        let output = Command::new(BIN)
            .args(args)
            .env_remove("LARDER_SOURCES")
            .env_remove("LARDER_CONFIG")
            .output()
            .expect("run larder");
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
    }
    let written = std::fs::read_to_string(hosts.join("nvcr.io/hosts.toml")).expect("hosts.toml");
    assert!(written.contains("server = \"https://nvcr.io\""), "{written}");
}

/// `larder containerd-config --dir` never replaces a `hosts.toml` that Larder did not write: it
/// writes the others, names that one and exits 1. Its own files it replaces.
#[test]
fn containerd_config_leaves_hosts_files_it_did_not_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hosts = dir.path().join("certs.d");
    let theirs = hosts.join("nvcr.io/hosts.toml");
    std::fs::create_dir_all(theirs.parent().unwrap()).expect("dir");
    let text = "server = \"https://nvcr.io\"\n\n[host.\"https://mirror.internal\"]\n";
    std::fs::write(&theirs, text).expect("hosts.toml");
    let run = |upstreams: &[&str]| {
        let mut command = Command::new(BIN);
        command.arg("containerd-config").arg("--dir").arg(&hosts);
        for upstream in upstreams {
            command.args(["--registry-upstream", upstream]);
        }
        command.env_remove("LARDER_CONFIG").output().expect("run larder")
    };
    let output = run(&["nvcr.io", "quay.io"]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(
        stderr(&output).contains(&theirs.display().to_string()),
        "{}",
        stderr(&output)
    );
    assert_eq!(std::fs::read_to_string(&theirs).expect("theirs"), text);
    let ours = std::fs::read_to_string(hosts.join("quay.io/hosts.toml")).expect("ours");
    assert!(ours.starts_with("# Written by Larder"), "{ours}");
    let output = run(&["quay.io"]);
    assert!(output.status.success(), "{}", stderr(&output));
}
