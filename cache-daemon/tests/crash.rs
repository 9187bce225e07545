//! End to end: a daemon process killed with SIGKILL, again and again, in the middle of reads
//! and a prefetch, and restarted on the same cache dir and the same (stale) mount.

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use larder_tests::daemon::{DaemonProcess, is_mounted};
use larder_tests::fixture::files_with_extension;
use larder_tests::{Fault, RecordingProxy, S3Server, content, seed};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MIB: usize = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");

/// Objects read through the mount, one reader thread each.
const READ: &[(&str, usize)] = &[
    ("read/a.bin", 24 * MIB + 7),
    ("read/b.bin", 20 * MIB),
    ("read/c.bin", 17 * MIB + 4096),
];
/// The object of the prefetch job.
const PREFETCHED: (&str, usize) = ("prefetch/weights.bin", 64 * MIB + 3);

/// What the readers of a round saw.
#[derive(Debug, Default)]
struct Tally {
    /// Bytes read and found right.
    verified: AtomicU64,
    /// Failed opens and reads (a dead daemon's mount answers `ENOTCONN`).
    errors: AtomicU64,
}

/// Reads `key` under `mount` from start to end, 1 MiB at a time, over and over until `stop`,
/// checking every byte against `want`. After an error the file is opened again; wrong bytes
/// are returned as the first place they were seen.
fn read_until(mount: &Path, key: &str, want: &[u8], stop: &AtomicBool, tally: &Tally) -> Option<String> {
    let size = want.len();
    let mut buf = vec![0; MIB];
    while !stop.load(Ordering::Relaxed) {
        let Ok(file) = std::fs::File::open(mount.join(key)) else {
            tally.errors.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        // Each pass through the daemon, not the page cache of the last one.
        // SAFETY: an advice on an open descriptor of ours.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let mut offset = 0;
        while offset < size && !stop.load(Ordering::Relaxed) {
            match file.read_at(&mut buf, offset as u64) {
                Ok(0) => return Some(format!("{key}: end of file at {offset} of {size}")),
                Ok(n) if buf[..n] != want[offset..offset + n] => {
                    return Some(format!("{key}: wrong bytes in {n} at {offset}"));
                }
                Ok(n) => {
                    tally.verified.fetch_add(n as u64, Ordering::Relaxed);
                    offset += n;
                }
                Err(_) => {
                    tally.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
    None
}

/// Detaches the mount at its path when dropped, if one is there: a test that fails between a
/// kill and the next start leaves no dead mount behind.
struct DetachOnDrop(PathBuf);

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

fn prefetch(daemon: &DaemonProcess, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("prefetch")
        .args(args)
        .env("LARDER_CONTROL_SOCKET", &daemon.socket)
        .output()
        .expect("run larder prefetch")
}

/// Five rounds of: start on the cache dir the last daemon was killed on, read three objects
/// and prefetch a fourth through a slow origin, `kill -9` after a seeded random while. No read
/// ever returns a wrong byte; every start leaves no temporary file in the cache dir and
/// recovers the dead mount; the last daemon serves everything.
#[tokio::test(flavor = "multi_thread")]
async fn kill_9_during_reads_and_a_prefetch_never_serves_wrong_bytes() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for &(key, size) in READ.iter().chain([&PREFETCHED]) {
        server.put(key, seed(key, 0), size).await.expect("put");
    }
    // A slow origin: fills are under way when the daemon dies.
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    proxy.set_fault(Fault::Bandwidth(64 * MIB as u64));
    let dir = tempfile::tempdir().expect("tempdir");
    let started = Instant::now();
    let proxy = Arc::new(proxy);
    let dir_path = dir.path().to_owned();
    let mut rng = StdRng::seed_from_u64(0x4c41_5244);
    let checks = tokio::task::spawn_blocking(move || {
        let cache = dir_path.join("cache");
        let mut mount = None;
        let wanted: Vec<Arc<[u8]>> = READ
            .iter()
            .map(|&(key, size)| content(seed(key, 0), 0, size).into())
            .collect();
        let mut verified = 0;
        for round in 0..5 {
            let daemon = DaemonProcess::start(Path::new(BIN), proxy.as_ref(), &dir_path, &[]).expect("start");
            mount.get_or_insert_with(|| DetachOnDrop(daemon.mount.clone()));
            assert_eq!(
                files_with_extension(&cache, "tmp"),
                Vec::<PathBuf>::new(),
                "round {round}"
            );
            let stop = Arc::new(AtomicBool::new(false));
            let tally = Arc::new(Tally::default());
            let readers: Vec<_> = READ
                .iter()
                .zip(&wanted)
                .map(|(&(key, _), want)| {
                    let (mount, stop, tally) = (daemon.mount.clone(), stop.clone(), tally.clone());
                    let want = want.clone();
                    std::thread::spawn(move || read_until(&mount, key, &want, &stop, &tally))
                })
                .collect();
            let job = prefetch(&daemon, &["models:prefetch"]);
            assert!(job.status.success(), "{}", String::from_utf8_lossy(&job.stderr));
            let alive = Duration::from_millis(rng.random_range(500..2000));
            std::thread::sleep(alive);
            daemon.kill9().expect("kill -9");
            stop.store(true, Ordering::Relaxed);
            for reader in readers {
                let wrong = reader.join().expect("reader");
                assert_eq!(wrong, None, "round {round}, killed after {alive:?}");
            }
            println!("round {round}: killed after {alive:?}; readers saw {tally:?}");
            verified += tally.verified.load(Ordering::Relaxed);
            // A record compaction cut by the kill leaves its temporary copy beside the record.
            if let Some(record) = files_with_extension(&cache, "rec").first() {
                std::fs::write(record.with_extension("tmp"), b"torn").expect("plant a torn copy");
            }
        }

        assert!(verified > 0, "nothing was read between the kills");
        proxy.set_fault(Fault::PassThrough);
        let daemon =
            DaemonProcess::start(Path::new(BIN), proxy.as_ref(), &dir_path, &[]).expect("last start");
        assert_eq!(files_with_extension(&cache, "tmp"), Vec::<PathBuf>::new());
        let job = prefetch(&daemon, &["--wait", "models:prefetch"]);
        assert!(job.status.success(), "{}", String::from_utf8_lossy(&job.stderr));
        for &(key, size) in READ.iter().chain([&PREFETCHED]) {
            let bytes = std::fs::read(daemon.mount.join(key)).expect("read");
            assert!(bytes == content(seed(key, 0), 0, size), "{key}");
        }
        let status = daemon.stop().expect("stop");
        assert!(status.success(), "{status}");
    });
    checks.await.expect("checks");
    println!("five kills and a check in {:?}", started.elapsed());
}
