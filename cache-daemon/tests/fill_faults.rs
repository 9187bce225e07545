//! End to end: a daemon process whose origin is reached through the fault proxy, read through
//! the kernel's page cache: what a stalled origin costs a buffered read, and what a cold
//! sequential read costs the origin when the cache is small.

use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use larder_tests::daemon::DaemonProcess;
use larder_tests::{Fault, RecordingProxy, S3Server, content, seed};

const MIB: u64 = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");

/// The read deadline the daemons of these tests are given (`--read-deadline 3s`).
const READ_DEADLINE: Duration = Duration::from_secs(3);

/// Runs `read`, which must fail with EIO well before twice [`READ_DEADLINE`].
fn fails_with_eio_in_time(what: &str, read: impl FnOnce() -> std::io::Result<usize>) {
    let started = Instant::now();
    let error = read().expect_err(what);
    let elapsed = started.elapsed();
    println!("{what}: {error} after {elapsed:?}");
    assert_eq!(error.raw_os_error(), Some(libc::EIO), "{what}: {error}");
    assert!(
        elapsed < READ_DEADLINE + Duration::from_secs(2),
        "{what} took {elapsed:?} with a read deadline of {READ_DEADLINE:?}"
    );
}

/// A buffered read of a stalled origin fails with EIO within the read deadline, though the
/// kernel retries the failed page: the retry gets the remembered failure at once instead of a
/// fill of its own. Once the origin is back and the failure forgotten, the read succeeds.
#[tokio::test(flavor = "multi_thread")]
async fn a_buffered_read_of_a_stalled_origin_fails_within_the_read_deadline() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let key = "stalled/model.bin";
    let size = 8 * MIB as usize;
    server.put(key, seed(key, 0), size).await.expect("put");
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    let dir = tempfile::tempdir().expect("tempdir");
    let args = ["--request-timeout", "1s", "--read-deadline", "3s"];
    let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("daemon");
    let path = daemon.mount.join(key);
    let mut file = std::fs::File::open(&path).expect("open");

    proxy.set_fault(Fault::StallAfterHeaders);
    let file = tokio::task::spawn_blocking(move || {
        let mut buf = vec![0; MIB as usize];
        fails_with_eio_in_time("buffered read of a stalled origin", || file.read(&mut buf));
        file
    })
    .await
    .expect("join");

    // The failed blocks fail again at once for FAILED_FILL_MEMORY, then are fetched anew.
    proxy.set_fault(Fault::PassThrough);
    let bytes = tokio::task::spawn_blocking(move || {
        drop(file);
        let started = Instant::now();
        loop {
            match std::fs::read(&path) {
                Ok(bytes) => return bytes,
                Err(error) => assert!(
                    started.elapsed() < larder_read_path::FAILED_FILL_MEMORY + Duration::from_secs(10),
                    "no read succeeded once the origin was back: {error}"
                ),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .expect("join");
    assert!(bytes == content(seed(key, 0), 0, size), "wrong bytes");
}

/// The two objects of the origin slot tests.
const SLOT_KEYS: [&str; 2] = ["slots/first.bin", "slots/second.bin"];

/// A daemon with one origin slot, a 1 s request timeout and `deadline` as its read deadline,
/// over [`SLOT_KEYS`] of `size` bytes each, behind the fault proxy. Fields drop in order: the
/// daemon first.
struct OneSlot {
    daemon: DaemonProcess,
    proxy: RecordingProxy,
    _server: S3Server,
    _dir: tempfile::TempDir,
}

impl OneSlot {
    async fn start(size: usize, deadline: &str) -> Self {
        let server = S3Server::start("larder-test").await.expect("s3 server");
        for key in SLOT_KEYS {
            server.put(key, seed(key, 0), size).await.expect("put");
        }
        let proxy = RecordingProxy::start(&server).await.expect("proxy");
        let dir = tempfile::tempdir().expect("tempdir");
        let args = [
            "--origin-concurrency",
            "1",
            "--request-timeout",
            "1s",
            "--read-deadline",
            deadline,
        ];
        let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("daemon");
        Self {
            daemon,
            proxy,
            _server: server,
            _dir: dir,
        }
    }

    /// The path of `key` in the mount.
    fn path(&self, key: &str) -> std::path::PathBuf {
        self.daemon.mount.join(key)
    }

    /// Waits until the first object's fill has the only origin slot (its GET reached the origin).
    async fn first_has_the_slot(&self) {
        while !self
            .proxy
            .requests()
            .iter()
            .any(|r| r.path.ends_with(SLOT_KEYS[0]) && r.range.is_some())
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A read whose fill waits for an origin slot held by a stalled fill still fails within the
/// read deadline: the wait counts against it.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_waiting_for_an_origin_slot_fails_within_the_read_deadline() {
    let slot = OneSlot::start(4 * MIB as usize, "3s").await;
    let [mut first, mut second] = SLOT_KEYS.map(|key| std::fs::File::open(slot.path(key)).expect("open"));
    slot.proxy.set_fault(Fault::StallAfterHeaders);
    let holder = std::thread::spawn(move || first.read(&mut [0; 4096]));
    slot.first_has_the_slot().await;
    tokio::task::spawn_blocking(move || {
        fails_with_eio_in_time("read waiting for an origin slot", || second.read(&mut [0; 4096]))
    })
    .await
    .expect("join");
    let held = holder.join().expect("first reader");
    assert_eq!(held.expect_err("stalled").raw_os_error(), Some(libc::EIO));
}

/// A read whose fill waits for an origin slot held by a slow fill that still receives bytes
/// waits its turn, though its turn comes after a read deadline: a slow origin (a link shared by
/// a whole scale-up) makes reads slow, not fail.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_waiting_for_an_origin_slot_held_by_a_slow_fill_waits_its_turn() {
    // Each object alone takes 3 s at 2 MiB/s, within the 4 s deadline; both one after the
    // other take 6 s.
    let size = 6 * MIB as usize;
    let slot = OneSlot::start(size, "4s").await;
    slot.proxy.set_fault(Fault::Bandwidth(2 * MIB));
    let [first, second] = SLOT_KEYS.map(|key| slot.path(key));
    let holder = std::thread::spawn(move || std::fs::read(first));
    slot.first_has_the_slot().await;
    let started = Instant::now();
    let read = tokio::task::spawn_blocking(move || std::fs::read(second))
        .await
        .expect("join");
    let waited = started.elapsed();
    let bytes = read.unwrap_or_else(|e| panic!("the read behind a slow fill failed after {waited:?}: {e}"));
    assert!(bytes == content(seed(SLOT_KEYS[1], 0), 0, size), "wrong bytes");
    let held = holder
        .join()
        .expect("first reader")
        .expect("the slow fill's own read");
    assert!(held == content(seed(SLOT_KEYS[0], 0), 0, size), "wrong bytes");
    // Its turn came after a read deadline, or the test proves nothing.
    assert!(waited > Duration::from_secs(4), "the read took {waited:?}");
}

/// A cold sequential read of an object ten times the cache's size: the readahead fits in the
/// cache, so the origin serves each byte about once (blocks fetched ahead are not evicted
/// before the reader gets to them).
#[tokio::test(flavor = "multi_thread")]
async fn a_cold_read_larger_than_the_cache_costs_the_origin_its_size_once() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let key = "big/shard.bin";
    let size = 256 * MIB;
    let client = server.client().expect("client");
    larder_tests::upload(client.as_ref(), key, seed(key, 0), size)
        .await
        .expect("upload");
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    let dir = tempfile::tempdir().expect("tempdir");
    let args = ["--cache-capacity", "32MiB"];
    let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("daemon");
    let path = daemon.mount.join(key);
    let read = tokio::task::spawn_blocking(move || {
        let mut file = std::fs::File::open(path).expect("open");
        let mut buf = vec![0; MIB as usize];
        let mut offset = 0u64;
        loop {
            let n = file.read(&mut buf).expect("read");
            if n == 0 {
                break offset;
            }
            assert!(
                buf[..n] == content(seed(key, 0), offset, n),
                "wrong bytes at {offset}"
            );
            offset += n as u64;
        }
    });
    assert_eq!(read.await.expect("join"), size);
    let ratio = proxy.body_bytes() as f64 / size as f64;
    println!("origin bytes / object size: {ratio:.3}");
    assert!(ratio <= 1.1, "the origin served {ratio:.3}× the object");
    drop(daemon);
}

/// An origin that refuses a read as malformed (S3's `400 InvalidRequest`) gets it once: the
/// read fails with EIO at once, and the store is not asked the same again. Before, a 400 was
/// taken for a transient error and each block's request was sent 5 times.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_the_origin_refuses_as_malformed_is_not_retried() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let key = "refused/model.bin";
    server
        .put(key, seed(key, 0), 4 * MIB as usize)
        .await
        .expect("put");
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    let dir = tempfile::tempdir().expect("tempdir");
    // A budget that would allow every retry: what the retries of a busy daemon have.
    let args = [
        "--request-timeout",
        "1s",
        "--read-deadline",
        "3s",
        "--retry-budget-ratio",
        "10",
    ];
    let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("daemon");
    let path = daemon.mount.join(key);
    let mut file = std::fs::File::open(&path).expect("open");
    proxy.set_fault(Fault::RefuseReads(400));
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0; MIB as usize];
        fails_with_eio_in_time("a read the origin refuses", || file.read(&mut buf));
    })
    .await
    .expect("join");
    let reads = proxy.requests().iter().filter(|r| r.range.is_some()).count();
    assert_eq!(reads, 1, "the refused read was sent {reads} times");
}

/// 64 readers of as many cold files at once, behind an origin link of 20 MB/s, with a read
/// deadline of 1 s: no read fails. The reads share the link, so each takes longer than the
/// deadline; before, a fill failed once a deadline passed from its start (every read got EIO
/// here), and 16 requests at once each got too thin a share. Now a fill fails only after a
/// deadline without a byte, and the origin's slots are cut while requests starve.
#[tokio::test(flavor = "multi_thread")]
async fn many_cold_readers_behind_a_thin_origin_link_all_get_their_bytes() {
    const READERS: usize = 64;
    const SIZE: usize = 2 * MIB as usize;
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let keys: Vec<String> = (0..READERS).map(|i| format!("shards/{i:02}.bin")).collect();
    for key in &keys {
        server.put(key, seed(key, 0), SIZE).await.expect("put");
    }
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    proxy.set_fault(Fault::Bandwidth(20_000_000));
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = format!(
        "127.0.0.1:{}",
        larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
    );
    let args = [
        "--request-timeout",
        "1s",
        "--read-deadline",
        "1s",
        "--metrics-listen",
        &metrics,
    ];
    let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("daemon");
    let mount = daemon.mount.clone();
    let started = Instant::now();
    let failed = tokio::task::spawn_blocking(move || {
        std::thread::scope(|scope| {
            let readers: Vec<_> = keys
                .iter()
                .map(|key| {
                    let path = mount.join(key);
                    scope.spawn(move || match std::fs::read(&path) {
                        Ok(bytes) if bytes == content(seed(key, 0), 0, SIZE) => None,
                        Ok(_) => Some(format!("{key}: wrong bytes")),
                        Err(error) => Some(format!("{key}: {error}")),
                    })
                })
                .collect();
            readers
                .into_iter()
                .filter_map(|r| r.join().expect("reader"))
                .collect::<Vec<_>>()
        })
    })
    .await
    .expect("join");
    let scrape = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("body");
    let gauge = |name: &str| {
        scrape
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or(-1.0)
    };
    println!(
        "{READERS} readers of {} MiB in {:?}: slots at the end {}, peak fills in flight {}",
        SIZE >> 20,
        started.elapsed(),
        gauge("larder_origin_fill_slots"),
        gauge("larder_origin_fills_peak"),
    );
    assert!(failed.is_empty(), "{} reads failed: {failed:?}", failed.len());
    drop(daemon);
}
