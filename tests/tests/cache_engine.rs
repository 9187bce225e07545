//! Integration tests of the block cache engine against a real S3 server (in-process s3s-fs):
//! integrity, restart and crash safety, corruption, single-flight, capacity, disk full and
//! origin faults.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::OsStr;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use larder_block_tree::{CV_LEN, GROUP};
use larder_config::{ByteSize, IoEngineKind};
use larder_engine::fault::{Fault, Op};
use larder_fuse_mount::{FileTree, FsError, ROOT_INO};
use larder_origin::{Origin, OriginError, PAGE_KEYS};
use larder_read_path::{OpenObject, ReadError, Reader};
use larder_store::{Lookup, Removal, VALUES_EXTENSION};
use larder_tests::fixture::{self, CacheFixture, allocated_bytes, files_with_extension, test_config};
use larder_tests::{FaultPlan, S3Server, content, free_port, seed};
use proptest::prelude::*;
use tempfile::TempDir;
use test_case::test_case;

const MIB: u64 = 1 << 20;

async fn server_with(objects: &[(&str, u64)]) -> Arc<S3Server> {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for &(key, size) in objects {
        server.put(key, seed(key, 0), size as usize).await.expect("put");
    }
    Arc::new(server)
}

async fn fixture(
    server: &Arc<S3Server>,
    dir: &TempDir,
    block_size: u64,
    engine: IoEngineKind,
) -> CacheFixture {
    let config = test_config(dir.path(), block_size, engine, &server.url());
    CacheFixture::open(server.clone(), config).await.expect("cache")
}

fn expected(key: &str, offset: u64, len: usize) -> Vec<u8> {
    content(seed(key, 0), offset, len)
}

fn origin_error(error: &FsError) -> &OriginError {
    fixture::origin_error(error).unwrap_or_else(|| panic!("not an origin error: {error}"))
}

// ---------------------------------------------------------------------------------------------
// Integrity

#[derive(Debug, Clone)]
struct Scenario {
    block_size: u64,
    engine: IoEngineKind,
    sizes: Vec<u64>,
    /// (object, offset, length), offsets and lengths possibly past the end.
    reads: Vec<(usize, u64, usize)>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop_oneof![Just(MIB), Just(2 * MIB)],
        prop_oneof![Just(IoEngineKind::Uring), Just(IoEngineKind::Psync)],
    )
        .prop_flat_map(|(block_size, engine)| {
            let size = prop_oneof![
                0..5 * block_size,
                (1..5u64).prop_map(move |n| n * block_size),
                Just(1u64),
            ];
            (Just(block_size), Just(engine), prop::collection::vec(size, 1..4))
        })
        .prop_flat_map(|(block_size, engine, sizes)| {
            let objects = sizes.len();
            let read = (0..objects, 0..6 * block_size, 0..(3 * block_size) as usize);
            (
                Just(block_size),
                Just(engine),
                Just(sizes),
                prop::collection::vec(read, 1..24),
            )
        })
        .prop_map(|(block_size, engine, sizes, reads)| Scenario {
            block_size,
            engine,
            sizes,
            reads,
        })
}

/// Random reads of random objects, across a restart halfway, return exactly the origin's bytes.
fn check_random_reads(scenario: Scenario) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        let keys: Vec<String> = (0..scenario.sizes.len())
            .map(|i| format!("objects/o{i}.bin"))
            .collect();
        let objects: Vec<(&str, u64)> = keys
            .iter()
            .map(String::as_str)
            .zip(scenario.sizes.iter().copied())
            .collect();
        let server = server_with(&objects).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut fx = fixture(&server, &dir, scenario.block_size, scenario.engine).await;
        let (first_half, second_half) = scenario.reads.split_at(scenario.reads.len() / 2);
        for (round, reads) in [first_half, second_half].into_iter().enumerate() {
            if round == 1 {
                fx = fx.restart().await.expect("restart");
            }
            // Every other read goes through a reader kept per object: its jumps read parts of
            // verified blocks, its runs read ahead.
            let mut readers = HashMap::new();
            for (i, &(object, offset, len)) in reads.iter().enumerate() {
                let (key, size) = objects[object];
                let open = fx.open_object(key).await.expect("open");
                let got = if i % 2 == 0 {
                    fx.read(&open, offset, len).await.expect("read")
                } else {
                    let file = match readers.entry(object) {
                        Entry::Occupied(file) => file.into_mut(),
                        Entry::Vacant(entry) => entry.insert(fx.open_file(key).await.expect("open")),
                    };
                    file.read(offset, len).await.expect("read")
                };
                let end = size.min(offset + len as u64);
                let want = if offset >= end {
                    Vec::new()
                } else {
                    expected(key, offset, (end - offset) as usize)
                };
                prop_assert_eq!(got.len(), want.len(), "{} at {} len {}", key, offset, len);
                prop_assert!(got == want, "{} at {} len {}: wrong bytes", key, offset, len);
            }
        }
        fx.cache.flush().await;
        prop_assert_eq!(fx.cache.in_flight(), 0);
        let usage = fx.cache.store().usage();
        prop_assert_eq!(usage.reserved, 0);
        prop_assert!(allocated_bytes(&fx.data_files()) <= usage.used);
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn random_reads_return_the_origins_bytes(scenario in scenario()) {
        check_random_reads(scenario)?;
    }
}

/// Reads that jump around read and check only the 16 KiB groups they touch (and the blocks'
/// stored group values), before and after a restart: the bytes are right at page and block
/// boundaries and at the end of the object, and no read goes back to the origin.
#[test_case(IoEngineKind::Uring; "uring")]
#[test_case(IoEngineKind::Psync; "psync")]
#[tokio::test]
async fn jumping_reads_of_cached_blocks_return_the_right_bytes(engine: IoEngineKind) {
    let size = 3 * MIB + 5;
    let server = server_with(&[("j.bin", size)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, engine, &server.url());
    // A small window, so that only reads within 128 KiB of each other count as a run.
    config.origin.readahead_min = ByteSize::kib(64);
    let mut fx = CacheFixture::open(server.clone(), config).await.expect("cache");
    let open = fx.open_object("j.bin").await.expect("open");
    fx.read_all(&open).await.expect("fill");
    fx.cache.flush().await;
    // Opening the file after the restart asks the origin for its version; its bytes come
    // from disk.
    let gets = server.ranged_gets().len();
    // Far apart, so that none counts as sequential: a page edge, a block edge, the tail.
    let jumps = [
        (2 * MIB + 4095, 10),
        (100, 5000),
        (3 * MIB - 3, 7),
        (MIB - 1, 2),
        (size - 5, 5),
        (MIB / 2, 4096),
    ];
    for round in 0..2 {
        if round == 1 {
            fx = fx.restart().await.expect("restart");
        }
        let disk_bytes = fx.disk.read_bytes();
        let reader = fx.open_file(&open.version().key).await.expect("open");
        for (offset, len) in jumps {
            let got = reader.read(offset, len).await.expect("read");
            assert!(
                got == expected("j.bin", offset, len),
                "round {round}: {len} bytes at {offset}"
            );
        }
        let read = fx.disk.read_bytes() - disk_bytes;
        // Six groups in all, the 5-byte last block (one group, checked whole) twice, and a
        // page of group values for each of the six groups.
        let bound = 6 * GROUP as u64 + 2 * 4096 + 6 * 4096;
        assert!(read <= bound, "round {round}: {read} bytes read from disk");
    }
    assert_eq!(server.ranged_gets().len(), gets, "a read went to the origin");
}

/// A cut body is resumed from the first missing byte, never repeated or skipped.
#[test_case(IoEngineKind::Uring; "uring")]
#[test_case(IoEngineKind::Psync; "psync")]
#[tokio::test]
async fn cut_bodies_resume_where_they_stopped(engine: IoEngineKind) {
    let server = server_with(&[("m.bin", 9 * MIB + 5)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, engine).await;
    fx.faults.set_plan(FaultPlan {
        cut_body: 0.5,
        cut_after: 300_000,
        ..FaultPlan::default()
    });
    let open = fx.open_object("m.bin").await.expect("open");
    let got = fx.read_all(&open).await.expect("read");
    assert!(got == expected("m.bin", 0, got.len()) && got.len() as u64 == 9 * MIB + 5);
    assert!(fx.stats.snapshot().origin_retries > 0, "no body was cut");
}

// ---------------------------------------------------------------------------------------------
// Restart and crash

#[test_case(IoEngineKind::Uring; "uring")]
#[test_case(IoEngineKind::Psync; "psync")]
#[tokio::test]
async fn restart_serves_recorded_blocks_without_the_origin(engine: IoEngineKind) {
    let size = 10 * MIB + 123;
    let server = server_with(&[("llama/model.safetensors", size)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, engine).await;
    let open = fx.open_object("llama/model.safetensors").await.expect("open");
    assert!(
        fx.read_all(&open).await.expect("cold read") == expected("llama/model.safetensors", 0, size as usize)
    );
    assert_eq!(fx.block_fetch_counts(&open), vec![1; 11]);
    // Bytes served add up to the bytes read (a block read ahead may already be on disk).
    let stats = fx.stats.snapshot();
    assert_eq!(stats.served_origin_bytes + stats.served_nvme_bytes, size);

    assert_private(dir.path());
    let fx = fx.restart().await.expect("restart");
    let warm = fx.read_all(&open).await.expect("warm read");
    assert!(warm == expected("llama/model.safetensors", 0, size as usize));
    // Opening the file asks for its version (a HEAD, and a listing to tell a file from a
    // directory of the same name); no byte of it comes from the origin.
    assert!(
        fx.faults.gets().is_empty(),
        "origin GETs after restart: {:?}",
        fx.faults.gets()
    );
    let stats = fx.stats.snapshot();
    assert_eq!(stats.served_nvme_bytes, size);
    // A lookup of each block, and one of the first for the model load's look at the header
    // (the name says safetensors; the content is not one, which it finds).
    assert_eq!((stats.lookup_hit, stats.lookup_miss), (12, 0));
}

/// Every dir under the cache dir is 0700, every file 0600, and no name contains the key.
fn assert_private(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut stack = vec![dir.to_owned()];
    while let Some(path) = stack.pop() {
        let mode = std::fs::metadata(&path).expect("metadata").permissions().mode() & 0o777;
        assert!(
            !path.to_string_lossy().contains("safetensors"),
            "a key leaked into {}",
            path.display()
        );
        if path.is_dir() {
            assert_eq!(mode, 0o700, "{}", path.display());
            stack.extend(
                std::fs::read_dir(&path)
                    .expect("read_dir")
                    .map(|e| e.expect("entry").path()),
            );
        } else {
            assert_eq!(mode, 0o600, "{}", path.display());
        }
    }
}

/// SIGKILL a filling process at random points; each restart serves only whole, recorded blocks,
/// refetches only what was not recorded, and leaves no temporary files.
#[tokio::test]
async fn kill_9_mid_fill_leaves_a_consistent_cache() {
    let key = "weights/shard-00001.safetensors";
    let size = 48 * MIB + 777;
    let blocks = size.div_ceil(MIB) as usize;
    let server = server_with(&[(key, size)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut killed_mid_fill = false;
    for round in 0..3u64 {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_fill-child"))
            .args([
                dir.path().to_str().expect("utf-8"),
                &server.url(),
                key,
                &MIB.to_string(),
            ])
            .env("AWS_ENDPOINT_URL", server.endpoint())
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", larder_tests::ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", larder_tests::SECRET_KEY)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn fill-child");
        let mut stdout = tokio::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let started = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line),
        );
        started
            .await
            .expect("child started filling")
            .expect("child stdout");
        assert_eq!(line.trim(), "filling");
        // Killed once the record names a quarter, a half, then three quarters of the blocks
        // (or more: the child writes on while the record is read).
        let target = (blocks * (round as usize + 1) / 4).max(1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while recorded_blocks(dir.path()) < target && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        child.start_kill().expect("SIGKILL");
        child.wait().await.expect("wait");

        let fx = fixture(&server, &dir, MIB, IoEngineKind::Uring).await;
        let stray: Vec<_> = files_with_extension(dir.path(), "tmp");
        assert!(stray.is_empty(), "temporary files left: {stray:?}");
        let open = fx.open_object(key).await.expect("open");
        let recorded: Vec<bool> = (0..blocks as u32)
            .map(|i| fx.cache.store().contains(open.version().id(), i))
            .collect();
        let count = recorded.iter().filter(|r| **r).count();
        killed_mid_fill |= count > 0 && count < blocks;
        for (index, _) in recorded.iter().enumerate().filter(|(_, r)| **r) {
            let offset = index as u64 * MIB;
            let got = fx
                .cache
                .store()
                .read_block(open.version(), open.version().id(), index as u32)
                .await;
            let len = MIB.min(size - offset) as usize;
            assert!(
                matches!(got, Ok(Lookup::Hit(hit)) if hit.bytes == expected(key, offset, len)),
                "recorded block {index} is not whole"
            );
        }
        assert_eq!(fx.stats.snapshot().lookup_corrupt, 0);
        if round < 2 {
            continue;
        }
        // The last round reads everything: only unrecorded blocks are fetched.
        assert!(fx.read_all(&open).await.expect("read") == expected(key, 0, size as usize));
        let fetched = fx.block_fetch_counts(&open);
        for (index, was_recorded) in recorded.iter().enumerate() {
            assert_eq!(
                fetched[index],
                usize::from(!was_recorded),
                "block {index} (recorded: {was_recorded})"
            );
        }
    }
    assert!(
        killed_mid_fill,
        "no round killed the child between its first and last block"
    );
}

/// Blocks the records under a cache dir name as present.
fn recorded_blocks(dir: &std::path::Path) -> usize {
    files_with_extension(dir, "rec")
        .iter()
        .filter_map(|path| std::fs::read(path).ok())
        .filter_map(|bytes| larder_store::format::replay(&bytes).ok())
        .map(|replayed| replayed.blocks.len())
        .sum()
}

// ---------------------------------------------------------------------------------------------
// Corruption

#[test_case(IoEngineKind::Uring; "uring")]
#[test_case(IoEngineKind::Psync; "psync")]
#[tokio::test]
async fn corrupted_truncated_and_swapped_files_are_refetched(engine: IoEngineKind) {
    let keys = ["a.bin", "b.bin", "c.bin", "d.bin"];
    let objects: Vec<(&str, u64)> = keys.iter().map(|k| (*k, 4 * MIB)).collect();
    let server = server_with(&objects).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, engine).await;
    let mut opened = Vec::new();
    for key in keys {
        let open = fx.open_object(key).await.expect("open");
        fx.read_all(&open).await.expect("fill");
        opened.push(open);
    }
    fx.cache.flush().await;
    let files: Vec<_> = opened.iter().map(|o| fx.data_file(o)).collect();

    // a: one flipped byte in block 1. b: cut in the middle of block 2. c and d: swapped.
    let mut a = std::fs::read(&files[0]).expect("read a");
    a[(MIB + MIB / 2) as usize] ^= 0x40;
    std::fs::write(&files[0], a).expect("write a");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&files[1])
        .expect("open b")
        .set_len(2 * MIB + 100)
        .expect("truncate b");
    let tmp = files[2].with_extension("swap");
    std::fs::rename(&files[2], &tmp).expect("swap");
    std::fs::rename(&files[3], &files[2]).expect("swap");
    std::fs::rename(&tmp, &files[3]).expect("swap");

    let fx = fx.restart().await.expect("restart");
    for (key, open) in keys.iter().zip(&opened) {
        assert!(
            fx.read_all(open).await.expect("read") == expected(key, 0, (4 * MIB) as usize),
            "{key}"
        );
    }
    let refetched: Vec<Vec<usize>> = opened.iter().map(|o| fx.block_fetch_counts(o)).collect();
    assert_eq!(
        refetched,
        vec![vec![0, 1, 0, 0], vec![0, 0, 1, 1], vec![1; 4], vec![1; 4]]
    );
    assert_eq!(fx.stats.snapshot().lookup_corrupt, 1 + 2 + 4 + 4);
    // The store says why each went, for a waiter that finds its block gone.
    let store = fx.cache.store();
    assert_eq!(store.removed_lately(opened[0].id(), 1), Some(Removal::Corrupt));
    assert_eq!(store.removed_lately(opened[0].id(), 0), None);

    // Repaired: a third run serves everything from disk.
    let fx = fx.restart().await.expect("restart");
    for (key, open) in keys.iter().zip(&opened) {
        assert!(fx.read_all(open).await.expect("read") == expected(key, 0, (4 * MIB) as usize));
    }
    assert!(fx.faults.gets().is_empty());
}

/// A cache of 1 MiB blocks over objects of 4 MiB named `keys`, the first read whole and
/// written; reads within 128 KiB of the last count as a run, so reads further apart do not.
async fn cached_in_1_mib_blocks(
    keys: &[&str],
    engine: IoEngineKind,
) -> (TempDir, CacheFixture, Arc<OpenObject>) {
    let objects: Vec<(&str, u64)> = keys.iter().map(|key| (*key, 4 * MIB)).collect();
    let server = server_with(&objects).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, engine, &server.url());
    config.origin.readahead_min = ByteSize::kib(64);
    let fx = CacheFixture::open(server.clone(), config).await.expect("cache");
    let open = fx.open_object(keys[0]).await.expect("open");
    fx.read_all(&open).await.expect("fill");
    fx.cache.flush().await;
    (dir, fx, open)
}

/// Small reads check the 16 KiB groups they touch against the block's stored group values.
/// Values that are missing (a cache written before they were kept) cost one whole-block check,
/// which stores them; values that were tampered with, or bytes changed in the group read, are
/// caught (the block is fetched again); the bytes served are always right.
#[test_case(IoEngineKind::Uring; "uring")]
#[test_case(IoEngineKind::Psync; "psync")]
#[tokio::test]
async fn small_reads_check_their_groups_and_catch_tampering(engine: IoEngineKind) {
    use std::os::unix::fs::FileExt;
    let (_dir, fx, open) = cached_in_1_mib_blocks(&["g.bin"], engine).await;
    let data = std::fs::OpenOptions::new()
        .write(true)
        .open(fx.data_file(&open))
        .expect("data file");
    let values = std::fs::OpenOptions::new()
        .write(true)
        .open(fx.data_file(&open).with_extension(VALUES_EXTENSION))
        .expect("values file");
    // The tree of a block of 1 MiB is 126 values of 32 bytes, in a slot of 128.
    let slot = 2 * MIB / GROUP as u64 * CV_LEN as u64;
    values
        .write_all_at(&vec![0; slot as usize], 0)
        .expect("forget block 0's values");
    values
        .write_all_at(&vec![7; slot as usize], slot)
        .expect("garble block 1's values");
    data.write_all_at(&[0xa5], 2 * MIB + 5 * GROUP as u64 + 9)
        .expect("change block 2");
    data.sync_all().expect("sync");
    values.sync_all().expect("sync");

    let fx = fx.restart().await.expect("restart");
    // One reader, each read over 1 MiB from the last: none starts a sequential run.
    let reader = fx.open_file(&open.version().key).await.expect("open");
    let small_read = |offset: u64| {
        let (fx, reader) = (&fx, &reader);
        async move {
            let before = fx.disk.read_bytes();
            let got = reader.read(offset, 100).await.expect("read");
            assert!(got == expected("g.bin", offset, 100), "bytes at {offset}");
            fx.disk.read_bytes() - before
        }
    };
    let group = GROUP as u64 + 4096;
    // Block 3, untouched: one group and its values.
    assert!(small_read(3 * MIB + 200_000).await <= group);
    // Block 0 without values: checked whole once, then group by group.
    assert!(small_read(200_000).await >= MIB);
    assert!(small_read(3 * MIB + 600_000).await <= group);
    assert!(small_read(700_000).await <= group);
    assert!(small_read(3 * MIB + 900_000).await <= group);
    assert_eq!(fx.stats.snapshot().lookup_corrupt, 0);
    // Block 1's values and block 2's fifth group were changed: both caught, both refetched.
    small_read(MIB + 1000).await;
    small_read(2 * MIB + 5 * GROUP as u64).await;
    assert_eq!(fx.stats.snapshot().lookup_corrupt, 2);
    assert_eq!(fx.block_fetch_counts(&open), vec![0, 1, 1, 0]);
}

/// A cache of the release whose groups were 64 KiB kept their values in `<id>.values`. After
/// the upgrade such a file is removed at start, never read as values of today's groups: small
/// reads check each block whole once (which stores its values again) and serve the right
/// bytes, with nothing found corrupt and nothing fetched again.
#[tokio::test]
async fn values_of_another_group_size_are_removed_not_read() {
    let (_dir, fx, open) = cached_in_1_mib_blocks(&["old.bin"], IoEngineKind::Uring).await;
    let values = fx.data_file(&open).with_extension(VALUES_EXTENSION);
    let old = fx.data_file(&open).with_extension("values");
    // Today's values go; the old file holds values that are not today's: no slot of them
    // merges to its block's hash.
    std::fs::remove_file(&values).expect("today's values");
    let slots = 4 * (2 * MIB / GROUP as u64 * CV_LEN as u64) as usize;
    std::fs::write(&old, vec![7; slots]).expect("old values");

    let fx = fx.restart().await.expect("restart");
    assert!(!old.exists(), "the old values file is left");
    let reader = fx.open_file(&open.version().key).await.expect("open");
    // Each over 1 MiB from the last (and the first from the start): none starts a run.
    let offsets = [3 * MIB + 900_000, 200_000, 2 * MIB + 500_000, MIB + 300_000];
    let mut read = Vec::new();
    for round in 0..2 {
        let before = fx.disk.read_bytes();
        for offset in offsets {
            let got = reader.read(offset, 100).await.expect("read");
            assert!(
                got == expected("old.bin", offset, 100),
                "round {round}: bytes at {offset}"
            );
        }
        read.push(fx.disk.read_bytes() - before);
    }
    // Whole blocks first, then a group and the values of each.
    assert!(read[0] >= 4 * MIB, "first round read {} bytes", read[0]);
    assert!(
        read[1] <= 4 * (GROUP as u64 + 4096),
        "second round read {} bytes",
        read[1]
    );
    assert!(values.exists());
    assert_eq!(fx.stats.snapshot().lookup_corrupt, 0);
    assert_eq!(fx.block_fetch_counts(&open), vec![0, 0, 0, 0]);
}

/// Small reads that do not continue a run are answered on the calling thread (the FUSE
/// thread) when their block is on disk with its group values: with the right bytes, checked
/// like any read. Anything else is left to the runtime's path, which reports it: a block not
/// cached, a read that continues a run, a large one, and a group whose bytes changed on disk
/// (never served; the runtime's read then finds it corrupt and fetches it again).
#[tokio::test]
async fn reads_answered_at_once_are_checked_and_leave_the_rest_to_the_runtime() {
    use std::os::unix::fs::FileExt;
    let (_dir, fx, open) = cached_in_1_mib_blocks(&["now.bin", "cold.bin"], IoEngineKind::Uring).await;
    let data = std::fs::OpenOptions::new()
        .write(true)
        .open(fx.data_file(&open))
        .expect("data file");
    data.write_all_at(&[0xa5], 2 * MIB + 5 * GROUP as u64 + 9)
        .expect("change block 2");
    data.sync_all().expect("sync");

    let fx = fx.restart().await.expect("restart");
    let reader = fx.open_file(&open.version().key).await.expect("open");
    // The store opens an object's files on its first read through the runtime.
    let first = reader.read(3 * MIB, 4096).await.expect("read");
    assert!(first == expected("now.bin", 3 * MIB, 4096));
    // Each over 1 MiB from the last: none starts a run.
    for offset in [200_000, 2 * MIB + 70_000, 3 * MIB + 900_000 - 4096] {
        let before = fx.disk.read_bytes();
        let got = reader.read_now(offset, 4096).expect("answered at once");
        assert!(got == expected("now.bin", offset, 4096), "bytes at {offset}");
        assert_eq!(fx.disk.read_bytes(), before, "not through the engine");
    }
    assert!(
        reader.read_now(2 * MIB + 5 * GROUP as u64, 4096).is_none(),
        "changed bytes served"
    );
    assert!(reader.read_now(MIB, 256 << 10).is_none(), "a large read");
    let run = reader.read(0, 65536).await.expect("read");
    assert!(run == expected("now.bin", 0, 65536));
    assert!(
        reader.read_now(65536, 4096).is_none(),
        "a read that continues a run"
    );
    let got = reader.read(2 * MIB + 5 * GROUP as u64, 4096).await.expect("read");
    assert!(got == expected("now.bin", 2 * MIB + 5 * GROUP as u64, 4096));
    assert_eq!(fx.stats.snapshot().lookup_corrupt, 1);
    assert_eq!(fx.block_fetch_counts(&open), vec![0, 0, 1, 0]);
    let cold = fx.open_object("cold.bin").await.expect("open");
    let cold = fx.open_file(&cold.version().key).await.expect("open");
    assert!(cold.read_now(3 * MIB, 4096).is_none());
}

/// A read answered on a FUSE thread feeds the sequential detector after its bytes are read,
/// and a read of the same handle on another thread may have made it a run's start by then: it
/// starts the readahead from a thread with no runtime. The fills must run all the same, on the
/// cache's runtime. (They once panicked there, after their blocks were registered in flight:
/// every later read of those blocks failed with "the fill was abandoned".)
#[tokio::test]
async fn fills_started_from_a_thread_without_a_runtime_run_on_the_caches() {
    let server = server_with(&[("ahead.bin", 8 * MIB)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, IoEngineKind::Uring).await;
    let open = fx.open_object("ahead.bin").await.expect("open");
    let (cache, ahead) = (fx.cache.clone(), open.clone());
    std::thread::spawn(move || cache.prefetch(&ahead, 4 * MIB..8 * MIB))
        .join()
        .expect("the readahead started on a thread without a runtime");
    let reader = fx.open_file(&open.version().key).await.expect("open");
    for offset in [4 * MIB, 7 * MIB + 5000] {
        let got = reader.read(offset, 4096).await.expect("a block fetched ahead");
        assert!(got == expected("ahead.bin", offset, 4096), "bytes at {offset}");
    }
    fx.cache.flush().await;
    assert_eq!(fx.block_fetch_counts(&open), vec![0, 0, 0, 0, 1, 1, 1, 1]);
}

/// A cache disk whose reads fail (EIO) costs no time: the production read path drops each
/// block it cannot read and serves it from the origin at once, and writes it back.
#[test_case(IoEngineKind::Uring; "uring")]
#[test_case(IoEngineKind::Psync; "psync")]
#[tokio::test]
async fn a_failing_cache_disk_falls_back_to_the_origin_at_once(engine: IoEngineKind) {
    let size = 3 * MIB + 100;
    let server = server_with(&[("e.bin", size)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, engine).await;
    let open = fx.open_object("e.bin").await.expect("open");
    fx.read_all(&open).await.expect("fill");
    fx.cache.flush().await;
    assert_eq!(fx.cache.store().usage().blocks, 4);
    let gets = fx.faults.gets().len();

    fx.disk.inject(Op::Read, Fault::Eio, None);
    let read = tokio::time::timeout(Duration::from_secs(10), fx.read_all(&open)).await;
    let got = read.expect("a failing disk read was not served from the origin within 10 s");
    assert!(got.expect("read") == expected("e.bin", 0, size as usize));
    assert!(
        fx.faults.gets().len() > gets,
        "the origin served the blocks the disk failed"
    );
    assert!(fx.stats.snapshot().cache_read_errors >= 4);

    // The disk recovers: the blocks written back after the refetch are served from it.
    fx.disk.clear();
    fx.cache.flush().await;
    let gets = fx.faults.gets().len();
    assert!(fx.read_all(&open).await.expect("read") == expected("e.bin", 0, size as usize));
    assert_eq!(fx.faults.gets().len(), gets, "served from the disk again");
}

/// An object overwritten while open: reads give the pinned version's bytes or VersionChanged,
/// never a mix; a new open sees the new version.
#[tokio::test]
async fn overwritten_object_gives_old_bytes_or_version_changed() {
    let key = "data/shard.bin";
    let size = 8 * MIB;
    let server = server_with(&[(key, size)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, IoEngineKind::Uring).await;
    let old = fx.open_object(key).await.expect("open");
    // One file open across the overwrite: it pinned the old version.
    let file = fx.open_file(key).await.expect("open");
    // Away from the start, so that the read starts no readahead: its fill covers its own
    // origin part (blocks 4 to 7), and the rest is left to fetch after the overwrite.
    let first = file.read(4 * MIB, MIB as usize).await.expect("first block");
    assert!(first == expected(key, 4 * MIB, MIB as usize));

    server
        .put(key, seed(key, 1), size as usize)
        .await
        .expect("overwrite");
    let mut changed = 0;
    for block in 0..8 {
        match file.read(block * MIB, MIB as usize).await {
            Ok(bytes) => assert!(
                bytes == expected(key, block * MIB, MIB as usize),
                "block {block} is not the old version"
            ),
            Err(e) => {
                assert!(
                    matches!(origin_error(&e), OriginError::VersionChanged { .. }),
                    "{e}"
                );
                changed += 1;
            }
        }
    }
    assert!(changed > 0, "every block came from somewhere after the overwrite");

    let new = fx.open_object(key).await.expect("reopen");
    assert_ne!(new.version().id(), old.version().id());
    let got = fx.read_all(&new).await.expect("new version");
    assert!(got == content(seed(key, 1), 0, size as usize));
}

// ---------------------------------------------------------------------------------------------
// Single-flight

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readers_of_a_cold_object_fetch_each_block_once() {
    let key = "llama/consolidated.00.pth";
    let size = 16 * MIB + 4096;
    let server = server_with(&[(key, size)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
    // 64 readers checking every block they read, on a machine that may be busy: what is
    // tested is that each block is fetched once, not how fast.
    config.origin.read_deadline = std::time::Duration::from_secs(120);
    let fx = Arc::new(CacheFixture::open(server.clone(), config).await.expect("cache"));
    let open = fx.open_object(key).await.expect("open");
    let readers = (0..64u64).map(|i| {
        let fx = fx.clone();
        let open = open.clone();
        tokio::spawn(async move {
            // One file handle each; each starts at a different block and wraps around.
            let reader = fx.open_file(&open.version().key).await.expect("open");
            for step in 0..17u64 {
                let offset = ((i + step) % 17) * MIB;
                let got = reader.read(offset, MIB as usize).await.expect("read");
                let len = MIB.min(size - offset) as usize;
                assert!(got == expected(key, offset, len), "reader {i} at {offset}");
            }
        })
    });
    for reader in futures::future::join_all(readers).await {
        reader.expect("reader task");
    }
    fx.cache.flush().await;
    assert_eq!(fx.block_fetch_counts(&open), vec![1; 17]);
    assert_eq!(fx.cache.in_flight(), 0);
    // A demand miss starts a fill: there were at most as many as blocks.
    assert!(fx.stats.snapshot().lookup_miss <= 17);
}

/// A reader that gives up does not cancel the fill others are waiting on.
#[tokio::test]
async fn a_cancelled_reader_does_not_cancel_the_shared_fill() {
    let key = "x.bin";
    let server = server_with(&[(key, 4 * MIB)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = Arc::new(fixture(&server, &dir, MIB, IoEngineKind::Uring).await);
    let open = fx.open_object(key).await.expect("open");
    let impatient = {
        let file = fx.open_file(key).await.expect("open");
        tokio::spawn(async move { file.read(0, 4 * MIB as usize).await })
    };
    // The test runs on one thread: the reader (its file open already) has started its fill
    // once it has run to its first wait.
    for _ in 0..1000 {
        if fx.cache.in_flight() > 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(fx.cache.in_flight() > 0, "no fill in flight to cancel");
    impatient.abort();
    assert!(impatient.await.is_err_and(|e| e.is_cancelled()));
    let got = fx.read(&open, 0, 4 * MIB as usize).await.expect("patient read");
    assert!(got == expected(key, 0, 4 * MIB as usize));
    fx.cache.flush().await;
    assert_eq!(fx.block_fetch_counts(&open), vec![1; 4]);
}

// ---------------------------------------------------------------------------------------------
// Memory budget

/// 16 sequential readers of 16 cold objects, whose readahead would otherwise fetch them whole,
/// keep the block bytes in memory within the budget, but for what they wait for (the block
/// each waits for): the readahead shrinks, and readers read their blocks in pieces, instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_cold_sequential_readers_keep_within_the_memory_budget() {
    let keys: Vec<String> = (0..16).map(|i| format!("shards/{i:02}.bin")).collect();
    let size = 8 * MIB;
    let objects: Vec<(&str, u64)> = keys.iter().map(|k| (k.as_str(), size)).collect();
    let server = server_with(&objects).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
    config.cache.memory_limit = ByteSize::mib(8);
    config.origin.read_deadline = Duration::from_secs(120);
    let fx = Arc::new(CacheFixture::open(server.clone(), config).await.expect("cache"));
    let readers = keys.iter().cloned().map(|key| {
        let fx = fx.clone();
        tokio::spawn(async move {
            let reader = fx.open_file(&key).await.expect("open");
            for offset in (0..size).step_by(MIB as usize / 2) {
                let got = reader.read(offset, MIB as usize / 2).await.expect("read");
                assert!(
                    got == expected(&key, offset, MIB as usize / 2),
                    "{key} at {offset}"
                );
            }
        })
    });
    for reader in futures::future::join_all(readers).await {
        reader.expect("reader task");
    }
    fx.cache.flush().await;
    let peak = fx.cache.budget().peak();
    // Over the limit: what each reader reads from disk, a piece of a block.
    let bound = 8 * MIB + 16 * MIB / 2;
    assert!(
        peak <= bound,
        "{} MiB in memory at the peak, over {} MiB",
        peak / MIB,
        bound / MIB
    );
    let stats = fx.stats.snapshot();
    assert!(
        stats.readahead_held_back > 0,
        "the budget never held the readahead back"
    );
    assert_eq!(
        stats.memory_used_bytes, 0,
        "every charge is returned once the bytes are gone"
    );
}

/// A cold sequential read gets the blocks its readahead fetched from memory: none is read back
/// from the cache disk (and hashed a second time) after its write. A prefetch job's blocks are
/// not kept: no reader is expected.
#[tokio::test]
async fn a_cold_sequential_read_never_reads_back_what_its_readahead_fetched() {
    let size = 24 * MIB;
    let server = server_with(&[("seq.bin", size), ("job.bin", size)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, IoEngineKind::Uring).await;
    let open = fx.open_object("seq.bin").await.expect("open");
    let got = fx.read_all(&open).await.expect("read");
    assert!(got == expected("seq.bin", 0, size as usize));
    fx.cache.flush().await;
    let stats = fx.stats.snapshot();
    assert!(stats.readahead_blocks > 0, "the readahead fetched nothing");
    assert_eq!(fx.disk.read_bytes(), 0, "blocks read back from the cache disk");
    let job = fx.open_object("job.bin").await.expect("open");
    fx.cache
        .fill_objects(vec![job], 4, |_, index, result| {
            assert!(result.is_ok(), "block {index}: {result:?}");
            true
        })
        .await;
    fx.cache.flush().await;
    assert_eq!(
        fx.stats.snapshot().memory_used_bytes,
        0,
        "a job's blocks kept in memory"
    );
}

/// A prefetch job (many parts at once) never passes the budget: its fills wait for room.
#[tokio::test]
async fn a_prefetch_job_waits_for_room_in_the_memory_budget() {
    let key = "weights/model.bin";
    let size = 32 * MIB;
    let server = server_with(&[(key, size)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
    config.cache.memory_limit = ByteSize::mib(6);
    let fx = CacheFixture::open(server.clone(), config).await.expect("cache");
    let open = fx.open_object(key).await.expect("open");
    fx.cache
        .fill_objects(vec![open.clone()], 8, |_, index, result| {
            assert!(result.is_ok(), "block {index}: {result:?}");
            true
        })
        .await;
    fx.cache.flush().await;
    let peak = fx.cache.budget().peak();
    assert!(peak <= 6 * MIB, "{} MiB in memory at the peak", peak / MIB);
    assert!(fx.stats.snapshot().memory_waits > 0, "the job never waited");
    assert_eq!(fx.block_fetch_counts(&open), vec![1; 32]);
    assert!(fx.read_all(&open).await.expect("read") == expected(key, 0, size as usize));
}

// ---------------------------------------------------------------------------------------------
// Capacity and disk full

#[tokio::test]
async fn random_reads_over_four_times_the_capacity_never_exceed_it() {
    let keys = ["c0.bin", "c1.bin", "c2.bin", "c3.bin"];
    let objects: Vec<(&str, u64)> = keys.iter().map(|k| (*k, 8 * MIB + 1000)).collect();
    let server = server_with(&objects).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
    config.cache.capacity = ByteSize(8 * MIB);
    let fx = Arc::new(CacheFixture::open(server.clone(), config).await.expect("cache"));
    let capacity = 8 * MIB;

    // Sample the disk all along, not only between reads.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (fx, done) = (fx.clone(), done.clone());
        tokio::spawn(async move {
            let mut peak = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let usage = fx.cache.store().usage();
                assert!(usage.used + usage.reserved <= capacity, "{usage:?}");
                peak = peak.max(allocated_bytes(&fx.data_files()));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            peak
        })
    };
    let mut opened = Vec::new();
    for key in keys {
        opened.push(fx.open_object(key).await.expect("open"));
    }
    let mut rng = rand::rng();
    for _ in 0..150 {
        use rand::Rng;
        let object = rng.random_range(0..keys.len());
        let offset = rng.random_range(0..8 * MIB);
        let len = rng.random_range(1..2 * MIB as usize);
        let got = fx.read(&opened[object], offset, len).await.expect("read");
        let end = (8 * MIB + 1000).min(offset + len as u64);
        assert!(got == expected(keys[object], offset, (end - offset) as usize));
    }
    fx.cache.flush().await;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.await.expect("sampler");
    // The sampler reads the files one after the other while blocks move between them, and the
    // file system may add an extent block to a file full of holes (more than four extents),
    // and keep it: one 4 KiB block per data file of slack, at any time. A block written and
    // not accounted for (1 MiB) is still caught.
    let slack = 4096 * fx.data_files().len().max(4) as u64;
    assert!(
        peak <= capacity + slack,
        "data files allocated {peak} bytes, capacity {capacity}"
    );
    let (allocated, used) = (allocated_bytes(&fx.data_files()), fx.cache.store().usage().used);
    assert!(allocated <= used + slack, "allocated {allocated}, used {used}");
    let usage = fx.cache.store().usage();
    assert!(usage.used <= capacity && usage.used > capacity / 2, "{usage:?}");
    assert!(fx.stats.snapshot().evicted_blocks > 0);
    // The counts kept as blocks come and go agree with the records on disk.
    assert_eq!(usage.blocks, recorded_blocks(dir.path()));
}

#[tokio::test]
async fn pinned_objects_are_not_evicted() {
    let keys = ["pinned.bin", "p1.bin", "p2.bin", "p3.bin"];
    let objects: Vec<(&str, u64)> = keys.iter().map(|k| (*k, 4 * MIB)).collect();
    let server = server_with(&objects).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
    config.cache.capacity = ByteSize(8 * MIB);
    let fx = CacheFixture::open(server.clone(), config).await.expect("cache");
    let pinned = fx.open_object(keys[0]).await.expect("open");
    fx.cache.store().set_pinned(pinned.version(), true);
    fx.read_all(&pinned).await.expect("fill pinned");
    for key in &keys[1..] {
        let open = fx.open_object(key).await.expect("open");
        assert!(fx.read_all(&open).await.expect("read") == expected(key, 0, (4 * MIB) as usize));
        fx.cache.flush().await;
    }
    for index in 0..4 {
        assert!(
            fx.cache.store().contains(pinned.version().id(), index),
            "pinned block {index} evicted"
        );
    }
    assert!(fx.stats.snapshot().evicted_blocks >= 8);
    assert_eq!(fx.cache.store().usage().pinned_bytes, 4 * MIB);
    let first_unpinned = fx.open_object(keys[1]).await.expect("open").id();
    assert_eq!(
        fx.cache.store().removed_lately(first_unpinned, 0),
        Some(Removal::EvictedForCapacity)
    );

    // With the whole capacity pinned, new blocks are served but not stored.
    let second = fx.open_object(keys[1]).await.expect("open");
    fx.cache.store().set_pinned(second.version(), true);
    fx.read_all(&second).await.expect("fill second pinned");
    fx.cache.flush().await;
    let third = fx.open_object(keys[2]).await.expect("open");
    assert!(fx.read_all(&third).await.expect("read") == expected(keys[2], 0, (4 * MIB) as usize));
    fx.cache.flush().await;
    assert!(fx.stats.snapshot().cache_writes_skipped > 0);
    assert!(fx.cache.store().usage().used <= 8 * MIB);
    // The pinned bytes follow the pins: the blocks of both objects, then of the second only.
    let usage = fx.cache.store().usage();
    assert_eq!((usage.pinned, usage.pinned_bytes), (2, 8 * MIB), "{usage:?}");
    fx.cache.store().set_pinned(pinned.version(), false);
    let usage = fx.cache.store().usage();
    assert_eq!((usage.pinned, usage.pinned_bytes), (1, 4 * MIB), "{usage:?}");
}

/// A sequential reader that finds the memory budget full reads its block in pieces from disk
/// and holds it there: reads of other objects that evict everything else do not evict it while
/// the reader is in it, and do once it has moved on.
#[tokio::test]
async fn a_block_read_in_pieces_is_not_evicted_while_its_reader_is_in_it() {
    let server = server_with(&[("held.bin", 4 * MIB), ("churn.bin", 8 * MIB)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
    config.cache.capacity = ByteSize(4 * MIB);
    config.cache.memory_limit = ByteSize(2 * MIB);
    let fx = CacheFixture::open(server.clone(), config).await.expect("cache");
    let budget = fx.cache.budget();
    let _full = budget.charge(budget.limit());
    let held = fx.open_object("held.bin").await.expect("open");
    let id = held.version().id();
    let reader = fx.open_file("held.bin").await.expect("open");
    let piece = MIB as usize / 4;
    let read = |offset: u64| {
        let reader = &reader;
        async move {
            let got = reader.read(offset, piece).await.expect("read");
            assert!(got == expected("held.bin", offset, piece), "at {offset}");
        }
    };
    let churn = || async {
        let churn = fx.open_object("churn.bin").await.expect("open");
        assert!(fx.read_all(&churn).await.expect("churn") == expected("churn.bin", 0, 8 * MIB as usize));
        fx.cache.flush().await;
    };
    read(0).await;
    read(piece as u64).await;
    fx.cache.flush().await;
    churn().await;
    assert!(
        fx.stats.snapshot().evicted_blocks >= 4,
        "the churn evicted nothing"
    );
    assert!(
        fx.cache.store().contains(id, 0),
        "the block being read was evicted"
    );
    read(2 * piece as u64).await;
    read(3 * piece as u64).await;
    read(MIB).await;
    churn().await;
    assert!(
        !fx.cache.store().contains(id, 0),
        "a block left behind is still held"
    );
}

/// A small tmpfs mounted for the test, unmounted when dropped.
struct Tmpfs {
    dir: TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(status.success(), "mounting a tmpfs needs root");
        Self { dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.dir.path()).status();
    }
}

#[tokio::test]
async fn reads_succeed_when_the_cache_disk_is_full() {
    let server = server_with(&[("full.bin", 6 * MIB), ("later.bin", 2 * MIB)]).await;
    let tmpfs = Tmpfs::mount("8m");
    let cache_dir = tmpfs.dir.path().join("cache");
    let config = test_config(&cache_dir, MIB, IoEngineKind::Uring, &server.url());
    let fx = CacheFixture::open(server.clone(), config).await.expect("cache");

    // Something else on the node fills the disk.
    let filler_path = tmpfs.dir.path().join("filler");
    let mut filler = std::fs::File::create(&filler_path).expect("filler");
    let chunk = vec![1u8; 1 << 16];
    while std::io::Write::write_all(&mut filler, &chunk).is_ok() {}
    drop(filler);

    let open = fx.open_object("full.bin").await.expect("open");
    assert!(
        fx.read_all(&open).await.expect("read on a full disk") == expected("full.bin", 0, (6 * MIB) as usize)
    );
    fx.cache.flush().await;
    let stats = fx.stats.snapshot();
    assert!(
        stats.cache_writes_skipped + stats.cache_write_failures > 0,
        "{stats:?}"
    );

    // Space comes back: blocks are stored again.
    std::fs::remove_file(&filler_path).expect("remove filler");
    let later = fx.open_object("later.bin").await.expect("open");
    assert!(fx.read_all(&later).await.expect("read") == expected("later.bin", 0, (2 * MIB) as usize));
    fx.cache.flush().await;
    assert!(fx.cache.store().contains(later.version().id(), 1));
}

// ---------------------------------------------------------------------------------------------
// Origin faults

#[tokio::test]
async fn reads_succeed_when_30_percent_of_requests_fail() {
    let keys: Vec<String> = (0..6).map(|i| format!("flaky/{i}.bin")).collect();
    let objects: Vec<(&str, u64)> = keys.iter().map(|k| (k.as_str(), 6 * MIB + 17)).collect();
    let server = server_with(&objects).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, IoEngineKind::Uring).await;
    fx.faults.set_plan(FaultPlan {
        unavailable: 0.3,
        ..FaultPlan::default()
    });
    let started = Instant::now();
    for key in &keys {
        let open = fx.open_object(key).await.expect("open");
        assert!(fx.read_all(&open).await.expect("read") == expected(key, 0, (6 * MIB + 17) as usize));
    }
    let stats = fx.stats.snapshot();
    let requests = stats.origin_get_requests + stats.origin_head_requests;
    let first_attempts = requests - stats.origin_retries;
    assert!(stats.origin_retries > 0, "{stats:?}");
    // The budget: 0.5 retries per first attempt, plus 10 a second, plus 10 to start with.
    let budget = 0.5 * first_attempts as f64 + 10.0 * started.elapsed().as_secs_f64() + 10.0;
    assert!(
        (stats.origin_retries as f64) <= budget,
        "{} retries, budget {budget}",
        stats.origin_retries
    );
}

/// A listener that accepts connections and never answers.
async fn black_hole() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (endpoint, task)
}

#[tokio::test]
async fn origin_down_serves_cached_data_and_fails_cold_reads_within_the_deadline() {
    let server = server_with(&[("warm.bin", 3 * MIB), ("cold.bin", 3 * MIB)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, IoEngineKind::Uring).await;
    let warm = fx.open_object("warm.bin").await.expect("open");
    let cold = fx.open_object("cold.bin").await.expect("open");
    fx.read_all(&warm).await.expect("fill");
    fx.cache.flush().await;
    drop(fx);

    // Refused connections: retries run out quickly.
    let refused = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", listener.local_addr().expect("addr"))
    };
    // Accepted but never answered: the per-request deadline, then the overall one.
    let (stalled, _hole) = black_hole().await;
    for (endpoint, deadline) in [
        (refused, Duration::from_secs(5)),
        (stalled, Duration::from_millis(1500)),
    ] {
        let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
        config.origin.request_timeout = Duration::from_millis(300);
        config.origin.read_deadline = deadline;
        config.origin.max_attempts = 20;
        let fx = CacheFixture::open_at(server.clone(), &endpoint, config)
            .await
            .expect("cache");
        // Versions pinned before the origin went down (a restarted mount cannot look names
        // up without it: open files and prefetch jobs hold versions this way).
        let down: Arc<Origin> = fx.origin.clone();
        let warm = Reader::new(
            fx.cache.clone(),
            OpenObject::new(down.clone(), warm.version().clone()),
        );
        let cached = warm.read(0, 3 * MIB as usize).await.expect("cached read");
        assert!(cached == expected("warm.bin", 0, (3 * MIB) as usize));

        let cold = Reader::new(fx.cache.clone(), OpenObject::new(down, cold.version().clone()));
        let started = Instant::now();
        let error = match cold.read(0, 4096).await {
            Err(ReadError::Origin(error)) => error,
            other => panic!("a cold read with the origin down gave {other:?}"),
        };
        let elapsed = started.elapsed();
        assert!(
            elapsed < deadline + Duration::from_secs(1),
            "took {elapsed:?} for a deadline of {deadline:?}"
        );
        assert!(
            matches!(
                *error,
                OriginError::DeadlineExceeded { .. } | OriginError::RetriesExhausted { .. }
            ),
            "{error}"
        );
    }
}

/// An 8 MiB cache of 1 MiB blocks over `objects`, whose `hot.bin` was read twice: filled, then
/// read again from disk, by the daemon or (with `passthrough`) by the kernel.
async fn an_8_mib_cache_with_hot_bin_read_twice(
    objects: &[(&str, u64)],
    dir: &TempDir,
    passthrough: bool,
) -> (CacheFixture, Arc<OpenObject>) {
    let server = server_with(objects).await;
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
    config.cache.capacity = ByteSize(8 * MIB);
    config.cache.passthrough = passthrough;
    let fx = CacheFixture::open(server.clone(), config).await.expect("cache");
    let hot = fx.open_object("hot.bin").await.expect("open");
    fx.read_all(&hot).await.expect("fill");
    fx.cache.flush().await;
    fx.read_all(&hot).await.expect("second read, from disk");
    let passed_through = fx.stats.snapshot().passthrough_opens;
    assert_eq!(passed_through, u64::from(passthrough), "passthrough opens");
    (fx, hot)
}

/// A block fetched ahead of its reader and then read from disk has been used once, not twice:
/// a scan whose blocks were fetched ahead does not push the blocks read twice out of the
/// protected segment, and the next scan evicts the scanned blocks, not those.
#[tokio::test]
async fn blocks_fetched_ahead_and_read_once_are_not_promoted_over_blocks_read_twice() {
    let objects = [
        ("hot.bin", 2 * MIB),
        ("scan0.bin", 6 * MIB),
        ("scan1.bin", 6 * MIB),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    let (fx, hot) = an_8_mib_cache_with_hot_bin_read_twice(&objects, &dir, false).await;
    for key in ["scan0.bin", "scan1.bin"] {
        let scan = fx.open_object(key).await.expect("open");
        // Fetched ahead of any reader, then each block read once, from disk.
        fx.cache.prefetch(&scan, 0..6 * MIB);
        fx.cache.flush().await;
        for index in 0..6 {
            let offset = index * MIB + MIB / 2;
            let got = fx.read(&scan, offset, 4096).await.expect("read");
            assert!(got == expected(key, offset, 4096), "{key} block {index}");
        }
    }
    assert!(fx.stats.snapshot().evicted_blocks >= 6);
    for index in 0..2 {
        assert!(
            fx.cache.store().contains(hot.version().id(), index),
            "hot block {index} evicted by a scan fetched ahead"
        );
    }
}

/// Blocks read again after they were stored survive a one-off scan larger than the cache, also
/// when the kernel read them again itself, through passthrough (straight from the cache's data
/// file, unseen by the daemon block by block: the blocks were put back in probation when
/// the file's lease ended, and the scan evicted them first).
#[test_case(false; "read again by the daemon")]
#[test_case(true; "read again through passthrough")]
#[tokio::test]
async fn a_scan_larger_than_the_cache_keeps_blocks_read_twice(passthrough: bool) {
    let keys = ["hot.bin", "scan0.bin", "scan1.bin", "scan2.bin"];
    let sizes = [2 * MIB, 6 * MIB, 6 * MIB, 6 * MIB];
    let objects: Vec<(&str, u64)> = keys.iter().copied().zip(sizes).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let (fx, hot) = an_8_mib_cache_with_hot_bin_read_twice(&objects, &dir, passthrough).await;
    for key in &keys[1..] {
        let open = fx.open_object(key).await.expect("open");
        fx.read_all(&open).await.expect("scan");
        fx.cache.flush().await;
    }
    assert!(fx.stats.snapshot().evicted_blocks >= 10);
    for index in 0..2 {
        assert!(
            fx.cache.store().contains(hot.version().id(), index),
            "hot block {index} evicted by a scan"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The node's whole read side: paged listings and the rack's peer tier

/// A directory of more keys than one listing page holds is listed page by page, as the
/// kernel reads it: every name once, in order.
#[tokio::test]
async fn a_directory_longer_than_a_listing_page_is_listed_whole_page_by_page() {
    let names: Vec<String> = (0..PAGE_KEYS + 50).map(|i| format!("f{i:05}")).collect();
    let keys: Vec<String> = names.iter().map(|name| format!("many/{name}")).collect();
    let objects: Vec<(&str, u64)> = keys.iter().map(|key| (key.as_str(), 100)).collect();
    let server = server_with(&objects).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir, MIB, IoEngineKind::Uring).await;
    let continued = || {
        server
            .requests()
            .iter()
            .filter(|r| {
                r.query
                    .as_deref()
                    .is_some_and(|q| q.contains("continuation-token"))
            })
            .count()
    };
    // The kernel's first readdir costs the first page alone.
    let many = fx
        .namespace
        .lookup(ROOT_INO, OsStr::new("many"))
        .await
        .expect("lookup");
    let fh = fx.namespace.opendir(many.ino).await.expect("opendir");
    let first = fx.namespace.readdir(fh, 0).await.expect("readdir");
    assert_eq!(first[0].name, "f00000");
    assert_eq!(continued(), 0, "the first readdir listed more than a page");
    fx.namespace.releasedir(fh).await;
    assert_eq!(fx.list("many").await.expect("list"), names);
    assert!(continued() >= 1, "{} keys listed in one page", names.len());

    // Each listed file reads as itself (this server lists no ETags, so an open asks for the
    // version: the mount's tests show a listing with ETags saving that HEAD).
    for key in [&keys[7], &keys[PAGE_KEYS + 3]] {
        let file = fx.open_file(key).await.expect("open");
        assert!(
            file.read_all().await.expect("read") == expected(key, 0, 100),
            "{key}"
        );
    }
}

/// Two nodes of one rack, each listed in the other's members as users write them
/// (`ID=HOST:PORT@RACK`), read one model in turn: each run is fetched from the origin once,
/// by its owner, and the other node takes it from that owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_of_a_rack_read_a_model_that_the_origin_sends_once() {
    let key = "llama/model.safetensors";
    let size = 32 * MIB + 5;
    let server = server_with(&[(key, size)]).await;
    let (nodes, _dirs) = rack_of_two(&server).await;
    for fx in &nodes {
        let file = fx.open_file(key).await.expect("open");
        assert!(file.read_all().await.expect("read") == expected(key, 0, size as usize));
    }
    let from_origin: u64 = server
        .ranged_gets()
        .iter()
        .filter_map(|get| {
            let (first, last) = get.range.as_deref()?.strip_prefix("bytes=")?.split_once('-')?;
            Some(last.parse::<u64>().ok()? + 1 - first.parse::<u64>().ok()?)
        })
        .sum();
    assert_eq!(from_origin, size, "the origin's bytes for a model of {size}");
    let from_peers: u64 = nodes.iter().map(|fx| fx.stats.snapshot().served_peer_bytes).sum();
    assert!(from_peers > 0, "no node read a byte from the other");
}

/// Two nodes of rack `r1` over `server`, each listing the other as users write members
/// (`ID=HOST:PORT@RACK`), and their cache dirs.
async fn rack_of_two(server: &Arc<S3Server>) -> (Vec<CacheFixture>, [TempDir; 2]) {
    let ports = [0, 1].map(|_| free_port(Ipv4Addr::LOCALHOST).expect("port"));
    let dirs = [0, 1].map(|_| tempfile::tempdir().expect("tempdir"));
    let mut nodes = Vec::new();
    for i in 0..2 {
        let mut config = test_config(dirs[i].path(), MIB, IoEngineKind::Uring, &server.url());
        config.peer.node_id = format!("n{i}");
        config.peer.rack = "r1".into();
        config.peer.insecure = true;
        config.peer.listen = Some(SocketAddr::from((Ipv4Addr::LOCALHOST, ports[i])));
        let other = 1 - i;
        let member = format!("n{other}=127.0.0.1:{}@r1", ports[other]);
        config.peer.members = vec![member.parse().expect("member")];
        let fx = CacheFixture::open(server.clone(), config).await.expect("cache");
        fx.serve_peers().await.expect("peer listener");
        nodes.push(fx);
    }
    (nodes, dirs)
}

/// Two jobs wait for one block whose cache write fails (no room: the file system keeps more
/// free than it has): both are told that cause. Before, the first waiter took the reason and
/// the second was told the block "was evicted as soon as it was written", on a cache with
/// nothing in it.
#[tokio::test(flavor = "multi_thread")]
async fn every_waiter_of_an_unstored_block_is_told_why() {
    let server = server_with(&[("m/a.bin", 4 * MIB)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Psync, &server.url());
    config.cache.min_free_fraction = 0.999;
    let cache = CacheFixture::open(server.clone(), config).await.expect("cache");
    // Slow enough that the second waiter joins the first's fill.
    cache.faults.set_plan(FaultPlan {
        get_delay: Duration::from_millis(300),
        ..FaultPlan::default()
    });
    let object = cache.open_object("m/a.bin").await.expect("open");
    let (first, second) = tokio::join!(cache.cache.fill(&object, 0), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        cache.cache.fill(&object, 0).await
    });
    assert_eq!(
        cache.faults.gets().len(),
        1,
        "the second waiter did not join the first's fill"
    );
    for result in [first, second] {
        let error = result.expect_err("a block that cannot be stored");
        let text = error.to_string();
        assert!(matches!(error, ReadError::NotStored(_)), "{text}");
        assert!(text.contains("min_free_fraction"), "{text}");
    }
}

/// Jobs and readers at once on one object, on a healthy cache: four jobs fill every block (in
/// different orders) while four readers read ranges of it, over a slow origin. Every job's
/// fill of every block ends stored (never "not stored" with nothing wrong), every byte read
/// is right, and the store holds each block once, its bytes in use what the blocks take.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_jobs_and_readers_of_one_object_store_every_block() {
    let server = server_with(&[(BUSY_KEY, BUSY_SIZE)]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = fixture(&server, &dir, MIB, IoEngineKind::Uring).await;
    cache.faults.set_plan(FaultPlan {
        get_delay: Duration::from_millis(20),
        ..FaultPlan::default()
    });
    jobs_and_readers_store_every_block(&cache).await;
}

/// The same on two nodes of a rack at once: each block is filled from the origin by its
/// run's owner and from that owner by the other node, while both nodes' jobs and readers
/// wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_jobs_and_readers_on_two_rack_nodes_store_every_block() {
    let server = server_with(&[(BUSY_KEY, BUSY_SIZE)]).await;
    let (nodes, _dirs) = rack_of_two(&server).await;
    for fx in &nodes {
        fx.faults.set_plan(FaultPlan {
            get_delay: Duration::from_millis(20),
            ..FaultPlan::default()
        });
    }
    tokio::join!(
        jobs_and_readers_store_every_block(&nodes[0]),
        jobs_and_readers_store_every_block(&nodes[1])
    );
    let from_peers: u64 = nodes.iter().map(|fx| fx.stats.snapshot().served_peer_bytes).sum();
    assert!(from_peers > 0, "no node read a byte from the other");
}

const BUSY_KEY: &str = "m/busy.bin";
const BUSY_SIZE: u64 = 24 * MIB + 5;

/// Four jobs fill every block of [`BUSY_KEY`] (each from its own starting point) while four
/// readers read ranges of it; then every block is in the store once, with nothing reserved.
async fn jobs_and_readers_store_every_block(cache: &CacheFixture) {
    const KEY: &str = BUSY_KEY;
    const SIZE: u64 = BUSY_SIZE;
    let object = cache.open_object(KEY).await.expect("open");
    let blocks = SIZE.div_ceil(MIB) as u32;
    let jobs = (0..4u32).map(|job| {
        let (cache, object) = (&cache, &object);
        async move {
            for step in 0..blocks {
                // Each job walks the blocks from its own starting point.
                let index = (step + job * blocks / 4) % blocks;
                if let Err(error) = cache.cache.fill(object, index).await {
                    panic!("job {job}: block {index}: {error}");
                }
            }
        }
    });
    let readers = (0..4u64).map(|reader| {
        let (cache, object) = (&cache, &object);
        async move {
            for step in 0..16u64 {
                let offset = (reader * 7 + step * 13) * 97 * 1024 % SIZE;
                let len = (3 * MIB).min(SIZE - offset) as usize;
                let bytes = cache.read(object, offset, len).await.expect("read");
                assert!(
                    bytes == expected(KEY, offset, len),
                    "reader {reader}: bytes at {offset}"
                );
            }
        }
    });
    tokio::join!(
        futures::future::join_all(jobs),
        futures::future::join_all(readers)
    );
    let store = cache.cache.store();
    for index in 0..blocks {
        assert!(
            store.contains(object.id(), index),
            "block {index} is not in the store"
        );
    }
    let usage = store.usage();
    assert_eq!(usage.blocks, blocks as usize);
    let last = SIZE - u64::from(blocks - 1) * MIB;
    assert_eq!(
        usage.used,
        u64::from(blocks - 1) * MIB + last.div_ceil(4096) * 4096
    );
    assert_eq!(usage.reserved, 0, "a reservation outlived its write");
}
