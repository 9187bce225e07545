//! End to end: what a running daemon does when its cache dir is tampered with. Bytes changed
//! on disk are caught by reads through the daemon; a cache dir deleted under the daemon is
//! never recreated by it, and a second daemon then started on that path owns it alone.

use std::os::unix::fs::FileExt;
use std::path::Path;

use larder_tests::daemon::DaemonProcess;
use larder_tests::fixture::files_with_extension;
use larder_tests::{S3Server, content, seed};

const MIB: usize = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");
const SIZE: usize = 12 * MIB + 5;

async fn server(keys: &[&str]) -> S3Server {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for &key in keys {
        server.put(key, seed(key, 0), SIZE).await.expect("put");
    }
    server
}

fn prefetch(daemon: &DaemonProcess, key: &str) {
    let output = daemon.larder(&["prefetch", "--wait", &format!("models:{key}")]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn read_checked(daemon: &DaemonProcess, key: &str) {
    let bytes = std::fs::read(daemon.mount.join(key)).expect(key);
    assert!(bytes == content(seed(key, 0), 0, SIZE), "{key} read wrong bytes");
}

fn drop_page_cache() {
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
}

/// 16 bytes flipped in a block's data file after the daemon checked it: every read through
/// the daemon checks what it reads, so the block is dropped and fetched again, and readers get
/// the right bytes. (Passthrough, where the kernel reads the file itself, is off here: what it
/// can catch is in the README.)
#[tokio::test(flavor = "multi_thread")]
async fn bytes_changed_on_disk_after_the_first_check_are_never_served() {
    const KEY: &str = "m/model.bin";
    let server = server(&[KEY]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &["--passthrough", "false"])
        .expect("daemon");
    tokio::task::spawn_blocking(move || {
        prefetch(&daemon, KEY);
        read_checked(&daemon, KEY);
        let data = files_with_extension(&daemon.cache, "data");
        assert_eq!(data.len(), 1, "{data:?}");
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&data[0])
            .expect("data file");
        let offset = 5 * MIB as u64 + 4099;
        let mut flipped = content(seed(KEY, 0), 0, SIZE)[offset as usize..][..16].to_vec();
        flipped.iter_mut().for_each(|b| *b = !*b);
        file.write_all_at(&flipped, offset).expect("flip bytes");
        file.sync_all().expect("sync");
        drop_page_cache();
        read_checked(&daemon, KEY);
        // Concurrent reads of the block (the kernel's readahead) may each have caught it.
        let corrupt = daemon.status()["lookups"]["corrupt"].as_u64().expect("corrupt");
        assert!(corrupt >= 1, "the flipped block was not caught");
        drop_page_cache();
        read_checked(&daemon, KEY);
    })
    .await
    .expect("checks");
}

/// The cache dir deleted under a running daemon: the daemon notices before its next write,
/// writes nothing more (no dir recreated without its lock), serves every read from the
/// origin, and says so in its status. A second daemon started on the path then owns it alone:
/// the first never writes into it.
#[tokio::test(flavor = "multi_thread")]
async fn a_cache_dir_deleted_under_the_daemon_is_left_to_whoever_locks_it_next() {
    let keys = ["m/a.bin", "m/b.bin", "m/c.bin", "m/d.bin"];
    let server = server(&keys).await;
    let first_dir = tempfile::tempdir().expect("tempdir");
    let second_dir = tempfile::tempdir().expect("tempdir");
    let first = DaemonProcess::start(Path::new(BIN), &server, first_dir.path(), &[]).expect("daemon");
    let cache = first.cache.clone();
    tokio::task::block_in_place(|| {
        read_checked(&first, keys[0]);
        std::fs::remove_dir_all(&cache).expect("delete the cache dir");
        read_checked(&first, keys[1]);
        assert!(!cache.exists(), "the daemon recreated its deleted cache dir");
        assert_eq!(first.status()["cache_dir_lost"], true);

        // An operator recreates the dir and starts another daemon on it.
        std::fs::create_dir(&cache).expect("recreate");
        std::os::unix::fs::symlink(&cache, second_dir.path().join("cache")).expect("link");
        let second = DaemonProcess::start(Path::new(BIN), &server, second_dir.path(), &[]).expect("second");
        read_checked(&second, keys[2]);
        drop_page_cache();
        for key in keys {
            read_checked(&first, key);
        }
        assert_eq!(
            files_with_extension(&cache, "rec").len(),
            1,
            "the first daemon wrote into the second's cache dir"
        );
    });
}

/// A cache file system with less free space than `min_free_fraction` asks for: reads are
/// served, nothing is cached, and the log says why once, naming the setting.
#[tokio::test(flavor = "multi_thread")]
async fn writes_skipped_for_free_space_are_explained_once() {
    let keys = ["m/a.bin", "m/b.bin"];
    let server = server(&keys).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let args = ["--min-free-fraction", "0.999"];
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");
    tokio::task::block_in_place(|| {
        for key in keys {
            read_checked(&daemon, key);
        }
        assert_eq!(daemon.status()["blocks"], 0);
    });
    drop(daemon);
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).expect("log");
    let explained = log
        .lines()
        .filter(|l| l.contains("cache.min_free_fraction"))
        .count();
    assert_eq!(explained, 1, "{log}");
}

/// A prefetch into a cache that cannot keep its blocks fails, and says why: a job cannot be
/// done when its blocks are not in the cache.
#[tokio::test(flavor = "multi_thread")]
async fn a_prefetch_whose_blocks_cannot_be_kept_fails_naming_why() {
    let keys = ["m/a.bin"];
    let server = server(&keys).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let args = ["--min-free-fraction", "0.999"];
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");
    tokio::task::block_in_place(|| {
        let output = daemon.larder(&["prefetch", "--wait", "models:m/a.bin"]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "the prefetch succeeded: {stderr}");
        assert!(
            stderr.contains("could not be stored") && stderr.contains("cache.min_free_fraction"),
            "{stderr}"
        );
    });
}

/// The cache on XFS, which shuts down on a fatal error (`xfs_io -x -c "shutdown -f"`, as XFS
/// does itself): every call on it fails with EIO, the lookup of the cache dir's lock included.
/// That is a failing disk, not a lost dir: status says CACHE DISK FAILING (not CACHE DIR
/// LOST), the metrics say `larder_cache_disk_failing` 1 and `larder_cache_dir_lost` 0, so the
/// alert that fires sends the operator to the disk. Reads still get the origin's bytes.
/// Before, the EIO of the lock's lookup was taken for a dir replaced under the daemon.
#[tokio::test(flavor = "multi_thread")]
async fn a_file_system_shut_down_under_the_cache_is_a_failing_disk_not_a_lost_dir() {
    const CACHED: &str = "m/cached.bin";
    const COLD: &str = "m/cold.bin";
    let server = server(&[CACHED, COLD]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (image, cache) = (dir.path().join("xfs.img"), dir.path().join("cache"));
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(320 << 20))
        .expect("image");
    larder_tests::run("mkfs.xfs", &["-q", image.to_str().expect("path")]).expect("mkfs.xfs");
    std::fs::create_dir_all(&cache).expect("mount point");
    larder_tests::run(
        "mount",
        &[
            "-o",
            "loop",
            image.to_str().expect("path"),
            cache.to_str().expect("path"),
        ],
    )
    .expect("mount");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(cache.clone());
    let metrics = format!(
        "127.0.0.1:{}",
        larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
    );
    let daemon = DaemonProcess::start(
        Path::new(BIN),
        &server,
        dir.path(),
        &["--metrics-listen", &metrics],
    )
    .expect("daemon");
    tokio::task::block_in_place(|| {
        prefetch(&daemon, CACHED);
        larder_tests::run(
            "xfs_io",
            &["-x", "-c", "shutdown -f", cache.to_str().expect("path")],
        )
        .expect("xfs_io");
        drop_page_cache();
        read_checked(&daemon, CACHED);
        read_checked(&daemon, COLD);
        let status = daemon.status();
        assert_eq!(status["cache_dir_lost"], false, "{status}");
        assert!(status.get("cache_disk_failing").is_some(), "{status}");
        let text = daemon.larder(&["status"]);
        let text = String::from_utf8_lossy(&text.stdout);
        assert!(text.contains("CACHE DISK FAILING"), "{text}");
        assert!(!text.contains("CACHE DIR LOST"), "{text}");
        let scrape = larder_tests::oci::http_get(&metrics, "/metrics", &[])
            .expect("metrics")
            .2;
        assert!(scrape.contains("\nlarder_cache_disk_failing 1\n"), "{scrape}");
        assert!(scrape.contains("\nlarder_cache_dir_lost 0\n"), "{scrape}");
    });
    drop(daemon);
}
