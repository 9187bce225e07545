//! End to end: FUSE passthrough of fully cached files. Reads through passthrough never reach
//! the daemon, so the bytes it reports as served tell whether a read was passed through.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::Command;

use larder_tests::daemon::DaemonProcess;
use larder_tests::{S3Server, content, seed};

const MIB: usize = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");
const MODEL: &str = "llama/model.safetensors";
const SIZE: usize = 20 * MIB + 7;

async fn server(keys: &[(&str, usize)]) -> S3Server {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for &(key, size) in keys {
        server.put(key, seed(key, 0), size).await.expect("put");
    }
    server
}

fn larder(daemon: &DaemonProcess, args: &[&str]) -> serde_json::Value {
    let output = Command::new(BIN)
        .args(args)
        .env("LARDER_CONTROL_SOCKET", &daemon.socket)
        .output()
        .expect("run larder");
    assert!(
        output.status.success(),
        "larder {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_default()
}

/// Bytes the daemon has served to readers, from every source.
fn served(daemon: &DaemonProcess) -> u64 {
    let status = larder(daemon, &["status", "--json"]);
    let served = &status["served"];
    served["nvme_bytes"].as_u64().expect("nvme") + served["origin_bytes"].as_u64().expect("origin")
}

fn drop_page_cache() {
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
}

fn read_checked(daemon: &DaemonProcess, key: &str, size: usize) {
    let bytes = std::fs::read(daemon.mount.join(key)).expect(key);
    assert!(bytes == content(seed(key, 0), 0, size), "{key} differs");
}

/// A file opened cold and completed by a prefetch while that handle is open: handles opened
/// meanwhile read through the daemon (the kernel does not mix the two on one inode), and once
/// the cold handle closes, the next open is passed through (no byte reaches the daemon). Every
/// handle reads the right bytes. With passthrough off, reads reach the daemon: the check can
/// fail.
#[tokio::test(flavor = "multi_thread")]
async fn a_complete_file_is_read_by_the_kernel_directly() {
    let server = server(&[(MODEL, SIZE)]).await;
    for passthrough in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let flag = passthrough.to_string();
        let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &["--passthrough", &flag])
            .expect("daemon");
        tokio::task::spawn_blocking(move || {
            let path = daemon.mount.join(MODEL);
            let mut cold = std::fs::File::open(&path).expect("open cold");
            let mut head = vec![0; MIB];
            cold.read_exact(&mut head).expect("read head");
            larder(&daemon, &["prefetch", "--wait", &format!("models:{MODEL}")]);

            drop_page_cache();
            let before = served(&daemon);
            read_checked(&daemon, MODEL, SIZE);
            assert!(
                // Pages the cold handle keeps may serve part of it; none would reach the
                // daemon if it were passed through.
                served(&daemon) > before,
                "read beside a cached handle"
            );
            cold.seek(SeekFrom::Start(0)).expect("seek");
            let mut all = Vec::new();
            cold.read_to_end(&mut all).expect("read the rest");
            assert!(all == content(seed(MODEL, 0), 0, SIZE));
            drop(cold);

            drop_page_cache();
            let before = served(&daemon);
            // Several opens in a row: each is passed through (a second one once failed).
            for _ in 0..3 {
                read_checked(&daemon, MODEL, SIZE);
            }
            let through_daemon = served(&daemon) - before;
            if passthrough {
                assert_eq!(through_daemon, 0, "a complete file was read through the daemon");
            } else {
                assert!(through_daemon >= SIZE as u64, "{through_daemon} bytes served");
            }
        })
        .await
        .expect("checks");
    }
}

/// Blocks read back from disk after a restart are verified before passthrough is offered: the
/// first read after a restart goes through the daemon, the next one does not; a prefetch after
/// a restart verifies what is cached, so the first read after it is passed through.
#[tokio::test(flavor = "multi_thread")]
async fn after_a_restart_blocks_are_verified_once_before_passthrough() {
    let server = server(&[(MODEL, SIZE)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    larder(&daemon, &["prefetch", "--wait", &format!("models:{MODEL}")]);
    daemon.stop().expect("stop");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("restart");
    tokio::task::spawn_blocking(move || {
        drop_page_cache();
        read_checked(&daemon, MODEL, SIZE);
        assert_eq!(
            served(&daemon),
            SIZE as u64,
            "the first read was not checked by the daemon"
        );
        drop_page_cache();
        read_checked(&daemon, MODEL, SIZE);
        assert_eq!(
            served(&daemon),
            SIZE as u64,
            "the second read was not passed through"
        );
        daemon
    })
    .await
    .expect("checks")
    .stop()
    .expect("stop");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("restart");
    tokio::task::spawn_blocking(move || {
        larder(&daemon, &["prefetch", "--wait", &format!("models:{MODEL}")]);
        drop_page_cache();
        read_checked(&daemon, MODEL, SIZE);
        assert_eq!(
            served(&daemon),
            0,
            "a prefetch after a restart did not verify the blocks"
        );
    })
    .await
    .expect("checks");
}

/// A file open in passthrough keeps its blocks while other reads push the cache over its
/// capacity: eviction happens, but not to the bytes under the open file.
#[tokio::test(flavor = "multi_thread")]
async fn eviction_spares_a_file_open_in_passthrough() {
    let others: Vec<(String, usize)> = (0..4).map(|i| (format!("other/{i}.bin"), 12 * MIB)).collect();
    let mut keys: Vec<(&str, usize)> = vec![(MODEL, SIZE)];
    keys.extend(others.iter().map(|(k, s)| (k.as_str(), *s)));
    let server = server(&keys).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(
        Path::new(BIN),
        &server,
        dir.path(),
        &["--cache-capacity", "40MiB"],
    )
    .expect("daemon");
    tokio::task::spawn_blocking(move || {
        larder(&daemon, &["prefetch", "--wait", &format!("models:{MODEL}")]);
        let mut open = std::fs::File::open(daemon.mount.join(MODEL)).expect("open");
        let before = served(&daemon);
        for (key, size) in &others {
            read_checked(&daemon, key, *size);
        }
        let status = larder(&daemon, &["status", "--json"]);
        assert!(
            status["evicted_blocks"].as_u64().expect("evicted") > 0,
            "{status}"
        );
        drop_page_cache();
        let mut all = Vec::new();
        open.read_to_end(&mut all).expect("read");
        assert!(
            all == content(seed(MODEL, 0), 0, SIZE),
            "the open file lost bytes"
        );
        let others_bytes: u64 = others.iter().map(|(_, s)| *s as u64).sum();
        let delta = served(&daemon) - before;
        assert_eq!(
            delta, others_bytes,
            "the open file was not passed through: {delta} bytes served, {others_bytes} by the others"
        );
    })
    .await
    .expect("checks");
}
