//! End to end: `larder daemon` as a process, a real S3 server, reads through the kernel.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use larder_tests::daemon::{DaemonProcess, is_mounted};
use larder_tests::seaweed::Seaweed;
use larder_tests::{S3Server, ServedRequest, content, seed};
use rand::Rng;

const MIB: u64 = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");

const OBJECTS: &[(&str, u64)] = &[
    ("llama/model.safetensors", 40 * MIB + 3),
    ("llama/config.json", 1024),
    ("datasets/shard-0000.bin", 5 * MIB),
    ("datasets/shard-0001.bin", 5 * MIB + 1),
    ("top.txt", 10),
];

async fn server() -> S3Server {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for &(key, size) in OBJECTS {
        server.put(key, seed(key, 0), size as usize).await.expect("put");
    }
    server
}

/// SeaweedFS serving an empty `bucket`.
fn seaweed(bucket: &str) -> Seaweed {
    let weed = Seaweed::installed_binary();
    assert!(
        weed.exists(),
        "{} is missing: run scripts/test (it installs SeaweedFS)",
        weed.display()
    );
    Seaweed::start(&weed, bucket).expect("weed mini")
}

fn expected(key: &str) -> Vec<u8> {
    let size = OBJECTS.iter().find(|(k, _)| *k == key).map_or(0, |(_, s)| *s);
    content(seed(key, 0), 0, size as usize)
}

/// Every file under `root` with its size, by path relative to `root`.
fn walk(root: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in std::fs::read_dir(root.join(&rel)).expect("read_dir") {
            let entry = entry.expect("entry");
            let rel = rel.join(entry.file_name());
            let meta = entry.metadata().expect("stat");
            if meta.is_dir() {
                stack.push(rel);
            } else {
                out.insert(rel.to_string_lossy().into_owned(), meta.len());
            }
        }
    }
    out
}

/// Ranged GETs of one key, as (first block, last block) of `block` bytes.
fn block_gets(requests: &[ServedRequest], key: &str, block: u64) -> Vec<(u64, u64)> {
    requests
        .iter()
        .filter(|r| r.path.ends_with(key))
        .filter_map(|r| {
            let (start, end) = r.range.as_deref()?.strip_prefix("bytes=")?.split_once('-')?;
            Some((
                start.parse::<u64>().ok()? / block,
                end.parse::<u64>().ok()? / block,
            ))
        })
        .collect()
}

/// A read-only mapping of the first `len` bytes of a file, unmapped when dropped.
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    fn new(file: &std::fs::File, len: usize) -> Self {
        let fd = std::os::fd::AsRawFd::as_raw_fd(file);
        // SAFETY: a private read-only mapping of an open file; the kernel checks the rest.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                fd,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        Self { ptr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

fn sha256sum(path: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split(' ')
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_mount_serves_the_origins_tree_and_bytes() {
    let server = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let mount = daemon.mount.clone();
    tokio::task::spawn_blocking(move || {
        let tree = walk(&mount);
        let want: BTreeMap<String, u64> = OBJECTS.iter().map(|(k, s)| (k.to_string(), *s)).collect();
        assert_eq!(tree, want);
        // Files carry the object's last-modified time (before the mount); dirs the mount time.
        let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).expect("mtime");
        assert!(
            mtime(&mount.join("top.txt")) < mtime(&mount),
            "file mtime is not the object's"
        );

        for &(key, _) in OBJECTS {
            assert!(
                std::fs::read(mount.join(key)).expect("read") == expected(key),
                "{key}"
            );
        }
        let copy = dir.path().join("copy");
        std::fs::write(&copy, expected("llama/model.safetensors")).expect("copy");
        assert_eq!(
            sha256sum(&mount.join("llama/model.safetensors")),
            sha256sum(&copy)
        );

        let file = std::fs::File::open(mount.join("datasets/shard-0001.bin")).expect("open");
        let whole = expected("datasets/shard-0001.bin");
        let mut rng = rand::rng();
        for _ in 0..64 {
            let offset = rng.random_range(0..whole.len());
            let len = rng.random_range(1..200_000).min(whole.len() - offset);
            let mut buf = vec![0; len];
            file.read_exact_at(&mut buf, offset as u64).expect("pread");
            assert!(buf == whole[offset..offset + len], "pread at {offset} len {len}");
        }

        let file = std::fs::File::open(mount.join("llama/model.safetensors")).expect("open");
        let map = Mapping::new(&file, expected("llama/model.safetensors").len());
        assert!(map.bytes() == expected("llama/model.safetensors"));
        drop(daemon);
    })
    .await
    .expect("checks");
}

#[tokio::test(flavor = "multi_thread")]
async fn errno_for_missing_files_writes_and_denied_access() {
    let server = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let mount = daemon.mount.clone();
    let checks = tokio::task::spawn_blocking(move || {
        let errno = |r: std::io::Result<std::fs::File>| r.expect_err("must fail").raw_os_error();
        assert_eq!(
            errno(std::fs::File::open(mount.join("llama/absent.bin"))),
            Some(libc::ENOENT)
        );
        assert_eq!(
            errno(std::fs::File::create(mount.join("new.bin"))),
            Some(libc::EROFS)
        );
        assert_eq!(
            errno(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(mount.join("top.txt"))
            ),
            Some(libc::EROFS)
        );
        let long = "x".repeat(300);
        assert_eq!(
            errno(std::fs::File::open(mount.join(long))),
            Some(libc::ENAMETOOLONG)
        );
        daemon.stop().expect("stop")
    });
    assert!(checks.await.expect("checks").success());

    let denied_dir = tempfile::tempdir().expect("tempdir");
    let denied =
        DaemonProcess::start_with_secret(Path::new(BIN), &server, denied_dir.path(), &[], "wrong-secret")
            .expect("daemon starts even when the origin refuses it");
    let mount = denied.mount.clone();
    let error =
        tokio::task::spawn_blocking(move || std::fs::read_dir(&mount).and_then(|mut d| d.next().transpose()))
            .await
            .expect("list")
            .expect_err("listing with bad credentials");
    assert_eq!(error.raw_os_error(), Some(libc::EACCES));
    let log = std::fs::read_to_string(denied_dir.path().join("daemon.log")).unwrap_or_default();
    assert!(!log.contains("wrong-secret"), "the secret leaked into the log");
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_serves_from_the_cache_and_sigterm_unmounts() {
    let server = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let key = "llama/model.safetensors";
    for round in 0..2 {
        let before = server.ranged_gets().len();
        let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
        let file = daemon.mount.join(key);
        let bytes = tokio::task::spawn_blocking(move || std::fs::read(file))
            .await
            .expect("join")
            .expect("read");
        assert!(bytes == expected(key));
        let gets = server.ranged_gets().len() - before;
        if round == 0 {
            assert!(gets > 0);
        } else {
            assert_eq!(gets, 0, "the second daemon fetched from the origin");
        }
        let mount = daemon.mount.clone();
        let status = tokio::task::spawn_blocking(move || daemon.stop())
            .await
            .expect("join")
            .expect("stop");
        assert!(status.success(), "exit status {status}");
        assert!(!is_mounted(&mount), "SIGTERM left the mount behind");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_daemons_mount_is_recovered_by_the_next() {
    let server = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let mount = daemon.mount.clone();
    assert!(std::fs::read(mount.join("top.txt")).expect("read") == expected("top.txt"));
    daemon.kill9().expect("kill -9");
    // Attributes may still come from the kernel's cache; an open always asks the daemon.
    let stale =
        std::fs::File::open(mount.join("datasets/shard-0001.bin")).expect_err("a dead daemon's mount");
    assert_eq!(stale.raw_os_error(), Some(libc::ENOTCONN));

    let daemon =
        DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("restart on the stale mount");
    let file = daemon.mount.join("datasets/shard-0000.bin");
    let bytes = tokio::task::spawn_blocking(move || std::fs::read(file))
        .await
        .expect("join")
        .expect("read");
    assert!(bytes == expected("datasets/shard-0000.bin"));
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_readers_of_a_cold_file_fetch_each_block_once() {
    let server = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let key = "llama/model.safetensors";
    // Sixteen processes, each with its own open file.
    let path = daemon.mount.join(key);
    let sums = tokio::task::spawn_blocking(move || {
        let children: Vec<_> = (0..16)
            .map(|_| {
                std::process::Command::new("sha256sum")
                    .arg(&path)
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .expect("sha256sum")
            })
            .collect();
        children
            .into_iter()
            .map(|c| {
                String::from_utf8_lossy(&c.wait_with_output().expect("wait").stdout)
                    .split(' ')
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect::<Vec<_>>()
    })
    .await
    .expect("join");
    let want = expected(key);
    let copy = dir.path().join("copy");
    std::fs::write(&copy, &want).expect("copy");
    let want_sum = sha256sum(&copy);
    assert!(sums.iter().all(|s| *s == want_sum), "{sums:?} != {want_sum}");
    let mut fetched = vec![0; want.len().div_ceil(4 << 20)];
    for (first, last) in block_gets(&server.requests(), key, 4 * MIB) {
        for count in &mut fetched[first as usize..=last as usize] {
            *count += 1;
        }
    }
    assert_eq!(fetched, vec![1; fetched.len()]);
}

/// Reads 1 MiB at every 4th MiB from 8 to 40 of `file`, whose object changed at the origin
/// after its first MiB was read: each read gives the bytes of `old` or fails with `ESTALE`,
/// never other bytes or another errno. Returns the number that failed.
fn read_old_bytes_or_estale(file: &std::fs::File, old: &[u8]) -> usize {
    let mut stale = 0;
    for block in (8..40).step_by(4) {
        let mut buf = vec![0; MIB as usize];
        match file.read_exact_at(&mut buf, block * MIB) {
            Ok(()) => assert!(
                buf == old[(block * MIB) as usize..((block + 1) * MIB) as usize],
                "mixed bytes at {block} MiB"
            ),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
                stale += 1;
            }
        }
    }
    stale
}

/// The large test object, which [`with_a_file_open`] opens.
const OPEN_KEY: &str = "llama/model.safetensors";

/// A daemon started with `extra` over the test objects, with [`OPEN_KEY`] open and its first
/// MiB read and checked. Fields drop in order: the daemon before its directory.
struct FileOpen {
    daemon: DaemonProcess,
    file: std::fs::File,
    /// The object's bytes when it was opened.
    old: Vec<u8>,
    server: S3Server,
    _dir: tempfile::TempDir,
}

async fn with_a_file_open(extra: &[&str]) -> FileOpen {
    let server = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), extra).expect("daemon");
    let old = expected(OPEN_KEY);
    let path = daemon.mount.join(OPEN_KEY);
    let file = tokio::task::spawn_blocking(move || {
        let file = std::fs::File::open(path).expect("open");
        let mut buf = vec![0; MIB as usize];
        file.read_exact_at(&mut buf, 0).map(|()| (file, buf))
    });
    let (file, head) = file.await.expect("join").expect("first MiB");
    assert!(head == old[..MIB as usize]);
    FileOpen {
        daemon,
        file,
        old,
        server,
        _dir: dir,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_object_overwritten_while_open_reads_old_bytes_or_estale() {
    let open = with_a_file_open(&[]).await;
    let key = OPEN_KEY;
    let size = open.old.len();
    open.server.put(key, seed(key, 1), size).await.expect("overwrite");
    let (file, old, path) = (open.file, open.old, open.daemon.mount.join(key));
    tokio::task::spawn_blocking(move || {
        let stale = read_old_bytes_or_estale(&file, &old);
        assert!(stale > 0, "every later read was served from before the overwrite");
        // The daemon has seen the new version: the next open reads it, without waiting for
        // the metadata TTL (60 s).
        let new = std::fs::read(&path).expect("read after the overwrite");
        assert!(
            new == content(seed(key, 1), 0, size),
            "a new open read the old version"
        );
    })
    .await
    .expect("checks");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_object_deleted_while_open_reads_estale_and_its_name_goes() {
    let open = with_a_file_open(&[]).await;
    let dir = open.daemon.mount.join("llama");
    // Listed before the delete: the daemon keeps the listing for the metadata TTL.
    assert_eq!(names_in(dir.clone()).await, ["config.json", "model.safetensors"]);
    let client = open.server.client().expect("client");
    let key = object_store::path::Path::from(OPEN_KEY);
    object_store::ObjectStoreExt::delete(client.as_ref(), &key)
        .await
        .expect("delete");
    let (file, old, path) = (open.file, open.old, open.daemon.mount.join(OPEN_KEY));
    tokio::task::spawn_blocking(move || {
        let stale = read_old_bytes_or_estale(&file, &old);
        assert!(stale > 0, "every later read was served from before the delete");
        // The daemon has seen the 404: the name goes once the kernel's own entry cache
        // (1 s) lets go, not after the metadata TTL (60 s).
        let asked = Instant::now();
        loop {
            match std::fs::metadata(&path) {
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
                other => assert!(
                    asked.elapsed() < Duration::from_secs(10),
                    "stat still answers {other:?} 10 s after the daemon saw the object gone"
                ),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .expect("checks");
    assert_eq!(
        names_in(dir).await,
        ["config.json"],
        "the listing still shows the deleted object"
    );
}

/// Waits for `mount` to stop being a mount point, failing after 5 s.
fn assert_detached_soon(mount: &Path) {
    let signalled = Instant::now();
    while is_mounted(mount) {
        assert!(
            signalled.elapsed() < Duration::from_secs(5),
            "still mounted 5 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM with a file open: the mount leaves the namespace at once (new opens do not reach
/// it), the open file reads to its end, and the daemon exits 0 when it is closed, before
/// the grace period.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_detaches_the_mount_and_serves_open_files_until_they_close() {
    let open = with_a_file_open(&["--shutdown-grace", "60s"]).await;
    let FileOpen {
        mut daemon,
        file,
        old,
        ..
    } = open;
    let mount = daemon.mount.clone();
    tokio::task::spawn_blocking(move || {
        daemon.terminate().expect("SIGTERM");
        assert_detached_soon(&mount);
        let error = std::fs::File::open(mount.join(OPEN_KEY)).expect_err("a new open after SIGTERM");
        assert_eq!(error.raw_os_error(), Some(libc::ENOENT), "{error}");
        let mut rest = vec![0; old.len() - MIB as usize];
        file.read_exact_at(&mut rest, MIB)
            .expect("the rest after SIGTERM");
        assert!(rest == old[MIB as usize..], "wrong bytes after SIGTERM");
        assert_eq!(
            daemon.exited().expect("status"),
            None,
            "the daemon exited with a file open"
        );
        drop(file);
        let status = daemon
            .wait(Duration::from_secs(10))
            .expect("exit after the last file closed");
        assert!(status.success(), "exit status {status}");
    })
    .await
    .expect("checks");
}

/// SIGTERM with a file open and a long grace: the health listener answers for as long as the
/// daemon serves that file, `/readyz` saying "stopping" (so an alert on a stop that does not
/// end can fire), and closes only once the daemon is done. Before, it closed at SIGTERM: the
/// scrape failed while the open file was still served.
#[tokio::test(flavor = "multi_thread")]
async fn readyz_says_stopping_while_open_files_are_served_after_sigterm() {
    let metrics = format!(
        "127.0.0.1:{}",
        larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
    );
    let open = with_a_file_open(&["--shutdown-grace", "60s", "--metrics-listen", &metrics]).await;
    let FileOpen {
        daemon, file, old, ..
    } = open;
    tokio::task::spawn_blocking(move || {
        let readyz = || larder_tests::oci::http_get(&metrics, "/readyz", &[]);
        let (status, _, body) = readyz().expect("/readyz before SIGTERM");
        assert_eq!((status, body.as_str()), (200, "ready\n"));
        daemon.terminate().expect("SIGTERM");
        assert_detached_soon(&daemon.mount);
        // Past the moment every other listener stops.
        std::thread::sleep(Duration::from_millis(500));
        let (status, _, body) = readyz().expect("/readyz while an open file is served after SIGTERM");
        assert_eq!((status, body.as_str()), (503, "not ready: stopping\n"));
        let mut rest = vec![0; MIB as usize];
        file.read_exact_at(&mut rest, MIB).expect("a read after SIGTERM");
        assert!(
            rest == old[MIB as usize..2 * MIB as usize],
            "wrong bytes after SIGTERM"
        );
        drop(file);
        let status = daemon
            .wait(Duration::from_secs(10))
            .expect("exit after the last file closed");
        assert!(status.success(), "exit status {status}");
        assert!(readyz().is_err(), "the health listener outlived the daemon");
    })
    .await
    .expect("checks");
}

/// SIGHUP (a closed terminal, a supervisor's reload) with a file open: the daemon says it
/// reloads nothing and goes on serving; SIGTERM then stops it as usual. Before, SIGHUP's
/// default action killed it (exit 129) with nothing logged, the mount left giving ENOTCONN.
#[tokio::test(flavor = "multi_thread")]
async fn sighup_is_logged_and_the_daemon_keeps_serving() {
    let open = with_a_file_open(&[]).await;
    let FileOpen {
        mut daemon,
        file,
        old,
        _dir: dir,
        ..
    } = open;
    tokio::task::spawn_blocking(move || {
        for _ in 0..2 {
            daemon.signal(libc::SIGHUP).expect("SIGHUP");
        }
        let log = dir.path().join("daemon.log");
        let said = Instant::now();
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("SIGHUP")
        {
            assert!(said.elapsed() < Duration::from_secs(10), "SIGHUP was not logged");
            assert_eq!(daemon.exited().expect("status"), None, "SIGHUP ended the daemon");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut rest = vec![0; old.len() - MIB as usize];
        file.read_exact_at(&mut rest, MIB).expect("a read after SIGHUP");
        assert!(rest == old[MIB as usize..], "wrong bytes after SIGHUP");
        let again = std::fs::read(daemon.mount.join(OPEN_KEY)).expect("an open after SIGHUP");
        assert!(again == old);
        drop(file);
        let socket = daemon.socket.clone();
        let status = daemon.stop().expect("SIGTERM after SIGHUP");
        assert!(status.success(), "exit status {status}");
        assert!(!socket.exists(), "the control socket was left behind");
    })
    .await
    .expect("checks");
}

/// SIGTERM with a file that stays open: the daemon exits 0 after the grace period, or at
/// once on a second SIGTERM (or Ctrl-C), and the file's reads then fail instead of hanging.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_exits_after_the_grace_period_or_a_second_signal_with_a_file_still_open() {
    for (grace, second_signal) in [("2s", false), ("60s", true)] {
        let open = with_a_file_open(&["--shutdown-grace", grace]).await;
        let FileOpen { daemon, file, .. } = open;
        let status = tokio::task::spawn_blocking(move || {
            daemon.terminate().expect("SIGTERM");
            if second_signal {
                assert_detached_soon(&daemon.mount);
                daemon.terminate().expect("second SIGTERM");
            }
            daemon.wait(Duration::from_secs(20))
        });
        let status = status.await.expect("join").expect("exit with a file open");
        assert!(status.success(), "exit status {status}");
        let read = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0; MIB as usize];
            file.read_exact_at(&mut buf, 36 * MIB)
        });
        let read = tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("a read after the daemon exited hangs")
            .expect("join");
        let error = read.expect_err("a read after the daemon exited got bytes");
        assert_eq!(error.raw_os_error(), Some(libc::ENOTCONN), "{error}");
    }
}

/// Against SeaweedFS (a production object store): a 512 MiB model file listed, read with
/// `sha256sum`, and mapped whole with `mmap`, all equal to the origin's bytes.
#[tokio::test(flavor = "multi_thread")]
async fn a_512_mib_model_from_seaweedfs_reads_and_maps() {
    let store = seaweed("larder-e2e");
    let key = "llama-70b/model-00001-of-00030.safetensors";
    let size = 512 * MIB;
    let client = store.client().expect("client");
    larder_tests::upload(client.as_ref(), key, seed(key, 0), size)
        .await
        .expect("upload");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &store, dir.path(), &[]).expect("daemon");
    let path = daemon.mount.join(key);
    tokio::task::spawn_blocking(move || {
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), size);
        let copy = dir.path().join("copy");
        std::fs::write(&copy, content(seed(key, 0), 0, size as usize)).expect("copy");
        assert_eq!(sha256sum(&path), sha256sum(&copy));

        let file = std::fs::File::open(&path).expect("open");
        let len = size as usize;
        let map = Mapping::new(&file, len);
        let mapped = map.bytes();
        let want = std::fs::read(&copy).expect("read copy");
        // Like a safetensors loader: the header first, then tensors from the middle and the end.
        for range in [
            0..8,
            8..4096,
            len / 2..len / 2 + (3 << 20),
            len - (5 << 20)..len,
            0..len,
        ] {
            assert!(
                mapped[range.clone()] == want[range.clone()],
                "mapped bytes differ in {range:?}"
            );
        }
        drop(daemon);
    })
    .await
    .expect("checks");
}

/// The sorted names in a directory of the mount.
async fn names_in(dir: PathBuf) -> Vec<String> {
    tokio::task::spawn_blocking(move || {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    })
    .await
    .expect("join")
}

/// 100,000 keys in one directory of a SeaweedFS bucket: a name is found without listing the
/// directory, and `ls` reads the listing page by page.
#[tokio::test(flavor = "multi_thread")]
async fn a_directory_of_100k_keys_lists_in_pages_and_looks_up_without_listing() {
    let store = seaweed("larder-big");
    let client = store.client().expect("client");
    let names: Vec<String> = (0..100_000).map(|i| format!("f-{i:06}")).collect();
    let puts = futures::stream::iter(names.iter().map(|name| {
        let client = client.clone();
        let key = object_store::path::Path::from(format!("big/{name}"));
        async move { object_store::ObjectStoreExt::put(client.as_ref(), &key, name.clone().into()).await }
    }));
    let done: Vec<_> = futures::StreamExt::collect(futures::StreamExt::buffer_unordered(puts, 64)).await;
    assert!(done.iter().all(Result::is_ok), "uploads failed");
    let proxy = larder_tests::RecordingProxy::start(&store).await.expect("proxy");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &[]).expect("daemon");

    let last = daemon.mount.join("big/f-099999");
    let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(last).expect("read"));
    assert_eq!(read.await.expect("join"), "f-099999");
    let listings = |proxy: &larder_tests::RecordingProxy| {
        proxy
            .requests()
            .into_iter()
            .filter(ServedRequest::is_delimited_listing)
            .collect::<Vec<_>>()
    };
    assert_eq!(listings(&proxy), [], "a lookup listed a directory");

    assert_eq!(names_in(daemon.mount.join("big")).await, names);
    let pages = listings(&proxy);
    assert!(pages.len() >= 100, "{} listing requests", pages.len());
    assert!(
        pages
            .iter()
            .all(|r| r.query.as_deref().is_some_and(|q| q.contains("max-keys=1000"))),
        "{pages:?}"
    );

    // The listing gave each file's ETag: opening a listed file pins it without a HEAD, so
    // reading it costs its GET alone.
    for name in ["f-000123", "f-054321"] {
        let before = proxy.requests().len();
        let path = daemon.mount.join("big").join(name);
        let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(path).expect("read"));
        assert_eq!(read.await.expect("join"), name);
        let made: Vec<_> = proxy.requests()[before..]
            .iter()
            .map(|r| (r.method.clone(), r.path.clone()))
            .collect();
        assert_eq!(made, [("GET".to_owned(), format!("/larder-big/big/{name}"))]);
    }
}

/// Keys object_store cannot parse (control characters, in a file name or a directory name)
/// are left out of listings and cannot be looked up; spaces, `%2F`, long and non-ASCII names
/// are served as they are.
#[tokio::test(flavor = "multi_thread")]
async fn keys_that_cannot_be_names_are_left_out_and_the_rest_served() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let edge = server.bucket_dir().join("edge");
    let long: &'static str = format!("{}.bin", "n".repeat(251)).leak();
    let good = [
        ("with space.bin", "a"),
        ("percent%2Fslash.bin", "b"),
        ("ünïcødé.bin", "c"),
        ("sub/inner.bin", "d"),
        (long, "e"),
    ];
    std::fs::create_dir_all(edge.join("sub")).expect("mkdir");
    std::fs::create_dir_all(edge.join("ctl\u{1}dir")).expect("mkdir");
    for (key, body) in good {
        std::fs::write(edge.join(key), body).expect("write");
    }
    std::fs::write(edge.join("tab\there.bin"), "bad").expect("write");
    std::fs::write(edge.join("ctl\u{1}dir/inner.bin"), "bad").expect("write");

    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let mut expected: Vec<String> = vec![
        "percent%2Fslash.bin".into(),
        "sub".into(),
        "with space.bin".into(),
        "ünïcødé.bin".into(),
        long.into(),
    ];
    expected.sort();
    assert_eq!(names_in(daemon.mount.join("edge")).await, expected);
    let mount = daemon.mount.clone();
    tokio::task::spawn_blocking(move || {
        for (key, body) in good {
            assert_eq!(
                std::fs::read_to_string(mount.join("edge").join(key)).expect(key),
                body
            );
        }
        for bad in ["tab\there.bin", "ctl\u{1}dir", "ctl\u{1}dir/inner.bin"] {
            let error = std::fs::metadata(mount.join("edge").join(bad)).expect_err(bad);
            assert_eq!(error.raw_os_error(), Some(libc::ENOENT), "{bad:?}: {error}");
        }
    })
    .await
    .expect("checks");
}
