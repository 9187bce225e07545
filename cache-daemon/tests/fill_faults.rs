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
    let read_deadline = Duration::from_secs(3);
    let args = ["--request-timeout", "1s", "--read-deadline", "3s"];
    let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("daemon");
    let path = daemon.mount.join(key);
    let mut file = std::fs::File::open(&path).expect("open");

    proxy.set_fault(Fault::StallAfterHeaders);
    let (file, elapsed, error) = tokio::task::spawn_blocking(move || {
        let mut buf = vec![0; MIB as usize];
        let started = Instant::now();
        let error = file.read(&mut buf).expect_err("a read of a stalled origin");
        (file, started.elapsed(), error)
    })
    .await
    .expect("join");
    println!("buffered read of a stalled origin: {error} after {elapsed:?}");
    assert_eq!(error.raw_os_error(), Some(libc::EIO), "{error}");
    assert!(
        elapsed < read_deadline + Duration::from_secs(2),
        "the read took {elapsed:?} with a read deadline of {read_deadline:?}"
    );

    proxy.set_fault(Fault::PassThrough);
    tokio::time::sleep(larder_cache_daemon::cache::FAILED_FILL_MEMORY + Duration::from_millis(500)).await;
    let bytes = tokio::task::spawn_blocking(move || {
        drop(file);
        std::fs::read(path).expect("a read once the origin is back")
    })
    .await
    .expect("join");
    assert!(bytes == content(seed(key, 0), 0, size), "wrong bytes");
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
