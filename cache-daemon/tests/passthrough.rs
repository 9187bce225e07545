//! End to end: FUSE passthrough of fully cached files. Reads through passthrough never reach
//! the daemon, so the bytes it reports as served tell whether a read was passed through.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use larder_tests::daemon::DaemonProcess;
use larder_tests::faulty_disk::FaultyDisk;
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

/// `larder args`, which must succeed.
fn larder(daemon: &DaemonProcess, args: &[&str]) {
    let output = daemon.larder(args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "larder {args:?}: {stderr}");
}

/// Bytes the daemon has served to readers, from every source.
fn served(daemon: &DaemonProcess) -> u64 {
    let status = daemon.status();
    let served = &status["served"];
    served["nvme_bytes"].as_u64().expect("nvme") + served["origin_bytes"].as_u64().expect("origin")
}

/// Opens the daemon has seen taken in passthrough.
fn passthrough_opens(daemon: &DaemonProcess) -> u64 {
    let status = daemon.status();
    status["served"]["passthrough_opens"]
        .as_u64()
        .expect("passthrough opens")
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
            assert_eq!(
                passthrough_opens(&daemon),
                0,
                "an open served through the daemon was counted as passed through"
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
                assert_eq!(passthrough_opens(&daemon), 3);
            } else {
                assert_eq!(passthrough_opens(&daemon), 0);
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
        for (key, size) in &others {
            read_checked(&daemon, key, *size);
        }
        let status = daemon.status();
        assert!(
            status["evicted_blocks"].as_u64().expect("evicted") > 0,
            "{status}"
        );
        drop_page_cache();
        let before = served(&daemon);
        let mut all = Vec::new();
        open.read_to_end(&mut all).expect("read");
        assert!(
            all == content(seed(MODEL, 0), 0, SIZE),
            "the open file lost bytes"
        );
        let delta = served(&daemon) - before;
        assert_eq!(
            delta, 0,
            "the open file was not passed through: the daemon served {delta} bytes of it"
        );
    })
    .await
    .expect("checks");
}

/// The value of the unlabelled sample `name` in a scrape of `/metrics` at `address`.
async fn metric(address: &str, name: &str) -> f64 {
    labelled_metric(address, name, None).await
}

/// The sample of `name` with the one label `label` (none with `None`).
async fn labelled_metric(address: &str, name: &str, label: Option<(&str, &str)>) -> f64 {
    let text = reqwest::get(format!("http://{address}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("body");
    let scrape =
        prometheus_parse::Scrape::parse(text.lines().map(|line| Ok(line.to_owned()))).expect("parse");
    let sample = scrape
        .samples
        .iter()
        .find(|s| {
            s.metric == name
                && match label {
                    None => s.labels.is_empty(),
                    Some((label, value)) => s.labels.get(label) == Some(value),
                }
        })
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"));
    match sample.value {
        prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) => v,
        ref other => panic!("{name} is not a counter or gauge: {other:?}"),
    }
}

/// After a prefetch, reads through passthrough never reach the daemon; status and the metrics
/// still show them as served from the cache: the opens and the bytes of the files opened, and
/// a hit rate of 100% (nothing came from the origin).
#[tokio::test(flavor = "multi_thread")]
async fn reads_through_passthrough_count_as_served_from_the_cache() {
    let server = server(&[(MODEL, SIZE)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let port = larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port");
    let address = format!("127.0.0.1:{port}");
    let daemon = DaemonProcess::start(
        Path::new(BIN),
        &server,
        dir.path(),
        &["--passthrough", "true", "--metrics-listen", &address],
    )
    .expect("daemon");
    let (daemon, status) = tokio::task::spawn_blocking(move || {
        larder(&daemon, &["prefetch", "--wait", &format!("models:{MODEL}")]);
        drop_page_cache();
        for _ in 0..2 {
            read_checked(&daemon, MODEL, SIZE);
        }
        assert_eq!(served(&daemon), 0, "the reads were not passed through");
        let status = daemon.status();
        (daemon, status)
    })
    .await
    .expect("reads");

    let served = &status["served"];
    assert_eq!(served["passthrough_opens"], 2, "{status}");
    assert_eq!(served["passthrough_bytes"], 2 * SIZE as u64, "{status}");
    assert_eq!(served["hit_rate"], 1.0, "{status}");
    assert_eq!(status["served_recent"]["hit_rate"], 1.0, "{status}");
    assert_eq!(metric(&address, "larder_passthrough_opens_total").await, 2.0);
    assert_eq!(
        metric(&address, "larder_passthrough_open_bytes_total").await,
        2.0 * SIZE as f64
    );

    let text = tokio::task::spawn_blocking(move || {
        let output = daemon.larder(&["status"]);
        assert!(output.status.success());
        String::from_utf8(output.stdout).expect("utf-8")
    })
    .await
    .expect("status");
    assert!(
        text.contains("hit rate (bytes): 100.0% since start, 100.0% last 5 min"),
        "{text}"
    );
}

/// An ext4 file system in an image file, loop-mounted with `errors=remount-ro`: a cache disk
/// that can be made to fail. Unmounted (lazily) when dropped.
struct LoopExt4 {
    at: std::path::PathBuf,
}

impl LoopExt4 {
    /// Makes an image of `size` bytes at `image` and mounts it at `at`.
    fn mount(image: &Path, at: &Path, size: u64) -> Self {
        std::fs::File::create(image)
            .and_then(|f| f.set_len(size))
            .expect("image");
        larder_tests::run("mkfs.ext4", &["-q".as_ref(), image.as_os_str()]).expect("mkfs.ext4");
        std::fs::create_dir_all(at).expect("mount point");
        let options = ["-o".as_ref(), "loop,errors=remount-ro".as_ref()];
        larder_tests::run(
            "mount",
            &[&options[..], &[image.as_os_str(), at.as_os_str()]].concat(),
        )
        .expect("mount");
        Self { at: at.to_owned() }
    }

    /// Aborts the file system's journal, as ext4 does on a disk error: it goes read-only.
    fn abort(&self) {
        let options = ["-o".as_ref(), "remount,abort".as_ref()];
        larder_tests::run("mount", &[&options[..], &[self.at.as_os_str()]].concat()).expect("remount");
    }
}

impl Drop for LoopExt4 {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.at)
            .status();
    }
}

/// A loopback address for the metrics listener, on a port free now.
fn metrics_address() -> String {
    format!(
        "127.0.0.1:{}",
        larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
    )
}

/// Reads `key` cold (`size` bytes, the first file the daemon caches), waits for all its
/// blocks to be written, and reads it again: through passthrough, the daemon's first.
fn read_then_pass_through(daemon: &DaemonProcess, key: &str, size: usize) {
    read_checked(daemon, key, size);
    let blocks = size.div_ceil(4 * MIB) as u64;
    let written = std::time::Instant::now();
    while daemon.status()["blocks"].as_u64() < Some(blocks) {
        assert!(
            written.elapsed().as_secs() < 30,
            "the blocks of {key} were never all written"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    read_checked(daemon, key, size);
    assert_eq!(
        passthrough_opens(daemon),
        1,
        "the complete file was not passed through"
    );
}

/// The cache disk fails (its ext4 journal aborts, as on a disk error) during a read: the
/// failed writes mark it failing, so the next open of a cached file is not handed to the
/// kernel (whose reads of it would fail with no way back to the origin), `/readyz` says why
/// the daemon is not ready, and every read still gets the origin's bytes. Before, `/readyz`
/// stayed 200 and complete files were still passed through.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_cache_disk_stops_passthrough_and_makes_the_daemon_not_ready() {
    const CACHED: &str = "llama/cached.safetensors";
    const COLD: &str = "llama/cold.safetensors";
    let (cached, cold) = (64 * MIB, 128 * MIB);
    let server = server(&[(CACHED, cached), (COLD, cold)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = LoopExt4::mount(
        &dir.path().join("cache.img"),
        &dir.path().join("cache"),
        512 << 20,
    );
    let metrics = metrics_address();
    let args = ["--metrics-listen", &metrics];
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");
    let daemon = tokio::task::spawn_blocking(move || {
        read_then_pass_through(&daemon, CACHED, cached);

        // The disk fails while a cold file is read: its blocks' writes fail.
        std::thread::scope(|scope| {
            let reader = scope.spawn(|| read_checked(&daemon, COLD, cold));
            while served(&daemon) < (cached + 8 * MIB) as u64 && !reader.is_finished() {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            disk.abort();
            reader.join().expect("the cold read");
        });
        drop_page_cache();
        read_checked(&daemon, CACHED, cached);
        assert_eq!(
            passthrough_opens(&daemon),
            1,
            "a file on the failing disk was passed through"
        );
        let failing = daemon.status()["cache_disk_failing"].as_str().map(str::to_owned);
        assert!(failing.is_some(), "status does not say the disk fails");
        (daemon, disk)
    })
    .await
    .expect("checks");
    let ready = reqwest::get(format!("http://{metrics}/readyz"))
        .await
        .expect("readyz");
    assert_eq!(ready.status(), 503);
    let reason = ready.text().await.expect("body");
    assert!(reason.contains("the cache disk fails"), "{reason}");
    assert_eq!(metric(&metrics, "larder_cache_disk_failing").await, 1.0);
    drop(daemon);
}

/// The data file of the one object cached under `cache`.
fn data_file(cache: &Path) -> std::path::PathBuf {
    let objects = cache.join("v1/objects");
    let mut found = Vec::new();
    for fanout in std::fs::read_dir(&objects).expect("objects dir").flatten() {
        for entry in std::fs::read_dir(fanout.path()).into_iter().flatten().flatten() {
            if entry.path().extension().is_some_and(|e| e == "data") {
                found.push(entry.path());
            }
        }
    }
    assert_eq!(found.len(), 1, "{found:?}");
    found.remove(0)
}

/// `/readyz`: its status code and body.
async fn readyz(address: &str) -> (u16, String) {
    let answer = reqwest::get(format!("http://{address}/readyz"))
        .await
        .expect("readyz");
    (answer.status().as_u16(), answer.text().await.expect("body"))
}

/// A daemon with its defaults but `extra`, its cache on a [`FaultyDisk`], a 64 MiB file read
/// (cached) and read again through passthrough; the metrics listener's address.
async fn passed_through_on_a_faulty_disk(
    dir: &Path,
    extra: &[&str],
) -> (DaemonProcess, FaultyDisk, String, S3Server) {
    let server = server(&[(MODEL, 64 * MIB)]).await;
    let disk = FaultyDisk::mount(dir, &dir.join("cache"), 512 << 20).expect("faulty disk");
    let metrics = metrics_address();
    let args = [&["--metrics-listen", &metrics][..], extra].concat();
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir, &args).expect("daemon");
    let daemon = tokio::task::spawn_blocking(move || {
        read_then_pass_through(&daemon, MODEL, 64 * MIB);
        daemon
    })
    .await
    .expect("setup");
    (daemon, disk, metrics, server)
}

/// Fails the disk's reads of bytes `range` of the one cached file's data file, drops the page
/// cache, and waits (30 s at most) until the daemon says its disk fails.
fn fail_until_found(daemon: &DaemonProcess, disk: &FaultyDisk, range: std::ops::Range<u64>) {
    disk.fail_reads_of(&data_file(&daemon.cache), range)
        .expect("fail reads");
    drop_page_cache();
    let found = std::time::Instant::now();
    while daemon.status().get("cache_disk_failing").is_none() {
        assert!(
            found.elapsed().as_secs() < 30,
            "the disk error under the passed-through file was not found in 30 s ({} reads failed)",
            disk.failed_reads()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A 64 MiB file cached, verified and passed through, on a disk whose reads of the file's
/// blocks from 32 MiB on then fail (a real EIO from the block layer under ext4), with the
/// default config: reads through passthrough fail as the disk does, but the scrub finds the
/// bad blocks within seconds and drops them, `/readyz`, status and metrics say the disk
/// fails, and the next open goes through the daemon and reads every byte right (the dropped
/// blocks fetched again). Before, every open was passed through and failed, and nothing
/// said so (`/readyz` 200, no error counted, no log line).
#[tokio::test(flavor = "multi_thread")]
async fn a_disk_error_under_a_passed_through_file_is_found_and_the_file_reads_right_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (daemon, disk, metrics, _server) = passed_through_on_a_faulty_disk(dir.path(), &[]).await;
    let (daemon, disk) = tokio::task::spawn_blocking(move || {
        fail_until_found(&daemon, &disk, 32 * MIB as u64..64 * MIB as u64);
        (daemon, disk)
    })
    .await
    .expect("the scrub");
    let (status, reason) = readyz(&metrics).await;
    assert_eq!(status, 503, "{reason}");
    assert!(reason.contains("the cache disk fails"), "{reason}");
    assert_eq!(metric(&metrics, "larder_cache_disk_failing").await, 1.0);
    let dropped = labelled_metric(
        &metrics,
        "larder_cache_scrub_dropped_blocks_total",
        Some(("reason", "io_error")),
    )
    .await;
    assert!(dropped > 0.0, "no block dropped for an I/O error");
    tokio::task::spawn_blocking(move || {
        drop_page_cache();
        read_checked(&daemon, MODEL, 64 * MIB);
        assert_eq!(
            passthrough_opens(&daemon),
            1,
            "a file with bad blocks was passed through"
        );
        assert!(
            disk.failed_reads() > 0,
            "the disk never failed a read: the test proves nothing"
        );
        drop(daemon);
    })
    .await
    .expect("read right");
}

/// A transient disk error (the blocks it failed dropped), then the disk heals: a warm node
/// whose reads all hit writes no block, yet it is ready again once the disk has been quiet
/// for `cache.disk_recheck` and answers the daemon's probe, and passthrough resumes. Before,
/// `/readyz` stayed 503 until some block write happened.
#[tokio::test(flavor = "multi_thread")]
async fn a_healed_disk_makes_the_daemon_ready_again_without_a_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let extra = ["--disk-recheck", "2s"];
    let (daemon, disk, metrics, _server) = passed_through_on_a_faulty_disk(dir.path(), &extra).await;
    let daemon = tokio::task::spawn_blocking(move || {
        fail_until_found(&daemon, &disk, 0..64 * MIB as u64);
        disk.heal();
        // A read of the file fetches the dropped blocks again; their writes succeed and end
        // the failing state by themselves: wait for the probe without any read.
        daemon
    })
    .await
    .expect("the error");
    let healed = std::time::Instant::now();
    loop {
        let (status, reason) = readyz(&metrics).await;
        if status == 200 {
            break;
        }
        assert!(
            healed.elapsed().as_secs() < 30,
            "not ready 30 s after the disk healed: {reason}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let writes = metric(&metrics, "larder_cache_write_bytes_total").await;
    assert_eq!(
        writes,
        (64 * MIB) as f64,
        "a block was written: the test proves nothing"
    );
    drop(daemon);
}

/// A file smaller than a page is passed through like any other once complete: the probe of a
/// data file before passthrough reads what the file has, and a short file is no disk error.
#[tokio::test(flavor = "multi_thread")]
async fn a_file_smaller_than_a_page_is_passed_through_and_no_disk_error() {
    const SMALL: &str = "llama/config.json";
    let server = server(&[(SMALL, 100)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    tokio::task::spawn_blocking(move || {
        larder(&daemon, &["prefetch", "--wait", &format!("models:{SMALL}")]);
        read_checked(&daemon, SMALL, 100);
        assert_eq!(
            passthrough_opens(&daemon),
            1,
            "the small complete file was not passed through"
        );
        let status = daemon.status();
        assert!(status.get("cache_disk_failing").is_none(), "{status}");
    })
    .await
    .expect("checks");
}
