//! Model-aware reading of safetensors files, through the namespace the mount serves: the data
//! region is fetched in file order ahead of loaders that read it in any order, ranks share each
//! fetch, and a header from the bucket that does not hold up leaves the file a plain file,
//! read byte-exact, with one warning naming it. The log is captured (this binary's own
//! process), for that warning.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use larder_cache_daemon::prefetch::{JobReport, JobState, Jobs, PrefetchError};
use larder_config::{ByteSize, IoEngineKind};
use larder_tests::fixture::{CacheFixture, File, test_config};
use larder_tests::logs::{capture, events_containing};
use larder_tests::{S3Server, content};
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

const MIB: u64 = 1 << 20;

/// A safetensors file of `tensors` (name, dtype, shape), laid out in the order given, with
/// deterministic bytes: the file and each tensor's extent in it.
fn safetensors(tensors: &[(&str, &str, &[u64])]) -> (Vec<u8>, Vec<(String, Range<u64>)>) {
    let width = |dtype: &str| match dtype {
        "F32" => 4,
        "F16" | "BF16" => 2,
        _ => 1,
    };
    let mut entries = serde_json::Map::new();
    entries.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0;
    let mut extents = Vec::new();
    for &(name, dtype, shape) in tensors {
        let len = shape.iter().product::<u64>() * width(dtype);
        entries.insert(
            name.into(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len] }),
        );
        extents.push((name.to_owned(), offset..offset + len));
        offset += len;
    }
    let mut header = serde_json::to_vec(&entries).expect("json");
    // The format pads the header with spaces to 8 bytes.
    header.resize(header.len().next_multiple_of(8), b' ');
    let data_start = 8 + header.len() as u64;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&content(7, 0, offset as usize));
    let extents = extents
        .into_iter()
        .map(|(name, extent)| (name, data_start + extent.start..data_start + extent.end))
        .collect();
    (file, extents)
}

/// A model of `layers` layers of four 1 MiB projections and a norm each, after an embedding.
fn model(layers: usize) -> (Vec<u8>, Vec<(String, Range<u64>)>) {
    let names: Vec<Vec<String>> = (0..layers)
        .map(|layer| {
            ["q_proj", "k_proj", "v_proj", "o_proj", "norm"]
                .iter()
                .map(|part| format!("model.layers.{layer}.{part}.weight"))
                .collect()
        })
        .collect();
    let mut tensors: Vec<(&str, &str, &[u64])> = vec![("model.embed_tokens.weight", "F16", &[1024, 512])];
    for layer in &names {
        for (i, name) in layer.iter().enumerate() {
            if i == 4 {
                tensors.push((name, "F32", &[512]));
            } else {
                tensors.push((name, "F16", &[512, 1024]));
            }
        }
    }
    safetensors(&tensors)
}

async fn upload(server: &S3Server, key: &str, bytes: Vec<u8>) {
    let client = server.client().expect("client");
    client
        .put(&Path::from(key), PutPayload::from(bytes))
        .await
        .expect("put");
}

async fn fixture(server: &Arc<S3Server>, dir: &tempfile::TempDir) -> CacheFixture {
    fixture_with(server, dir, false).await
}

/// [`fixture`], offering files whose every block is cached and checked for passthrough if
/// `passthrough`.
async fn fixture_with(server: &Arc<S3Server>, dir: &tempfile::TempDir, passthrough: bool) -> CacheFixture {
    let mut config = test_config(dir.path(), MIB, IoEngineKind::Uring, &server.url());
    config.cache.passthrough = passthrough;
    // A first readahead window of one block: what the sequential detector fetches ahead of a
    // read at the start of the file is then one block, and what is fetched beyond it is the
    // model load's.
    config.origin.readahead_min = ByteSize(MIB);
    CacheFixture::open(server.clone(), config).await.expect("cache")
}

/// Reads `range` of `file` in reads of `piece` bytes, as mmap faults and slices do.
async fn read_in_pieces(file: &File, range: Range<u64>, piece: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut offset = range.start;
    while offset < range.end {
        let len = piece.min(range.end - offset) as usize;
        let bytes = file.read(offset, len).await.expect("read");
        assert_eq!(bytes.len(), len, "short read at {offset}");
        out.extend_from_slice(&bytes);
        offset += len as u64;
    }
    out
}

/// Reads the header as a loader does: the length, then the JSON.
async fn read_header(file: &File) {
    let len = file.read(0, 8).await.expect("read length");
    let len = u64::from_le_bytes(len[..].try_into().expect("8 bytes"));
    file.read(8, len as usize).await.expect("read header");
}

/// How many ranged GETs of `key` asked for each 1 MiB block of an object of `size`, and
/// whether any asked past its end.
fn fetches(server: &S3Server, key: &str, size: u64) -> (Vec<usize>, bool) {
    let mut counts = vec![0; size.div_ceil(MIB) as usize];
    let mut past_end = false;
    for get in server.ranged_gets() {
        if !get.path.ends_with(key) {
            continue;
        }
        let range = get.range.as_deref().and_then(|r| r.strip_prefix("bytes="));
        let Some((first, last)) = range.and_then(|r| r.split_once('-')) else {
            continue;
        };
        let (first, last): (u64, u64) = (first.parse().expect("first"), last.parse().expect("last"));
        past_end |= last >= size;
        let blocks = (first / MIB) as usize..=((last / MIB) as usize).min(counts.len() - 1);
        for count in &mut counts[blocks] {
            *count += 1;
        }
    }
    (counts, past_end)
}

/// A loader that reads the header, then the tensors from the last to the first (in 128 KiB
/// pieces, as mmap faults come): once it has read the header and the last tensor, the blocks
/// a window ahead of it in file order are fetched without any read of them, and in the end every
/// byte is right and every block was fetched once. Before model-aware reading, only the
/// blocks the reads asked for (and one block of readahead at the start) were fetched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_read_backwards_is_fetched_in_file_order_ahead_of_its_reader_once() {
    let key = "llama/model.safetensors";
    let (bytes, tensors) = model(5);
    let size = bytes.len() as u64;
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    upload(&server, key, bytes.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir).await;
    let object = fx.open_object(key).await.expect("open");
    let file = fx.open_file(key).await.expect("open");

    read_header(&file).await;
    let (_, last) = tensors.last().expect("tensors");
    let got = read_in_pieces(&file, last.clone(), 128 * 1024).await;
    assert!(
        got == bytes[last.start as usize..last.end as usize],
        "last tensor"
    );
    // The memory budget is 16 blocks, so the window is 8: blocks 0-10 come without a read.
    let ahead = 0..10;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ahead
        .clone()
        .all(|index| fx.cache.store().contains(object.id(), index))
    {
        assert!(
            Instant::now() < deadline,
            "blocks {ahead:?} not fetched ahead of the reader: fetched {:?}",
            fetches(&server, key, size).0
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    for (name, extent) in tensors.iter().rev() {
        let got = read_in_pieces(&file, extent.clone(), 128 * 1024).await;
        assert!(got == bytes[extent.start as usize..extent.end as usize], "{name}");
    }
    let (counts, past_end) = fetches(&server, key, size);
    assert!(counts.iter().all(|&n| n == 1), "fetches per block: {counts:?}");
    assert!(!past_end);
}

/// The same model loaded again after a restart (every block on disk, none checked yet in
/// this process), in key order: once the loader has read the header and the first tensor, the
/// blocks a window ahead in file order are read from disk and checked without any read of
/// them; every byte is right, and each block is read from disk about once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_loaded_after_a_restart_is_read_from_disk_ahead_of_its_reader() {
    let key = "llama/model.safetensors";
    let (bytes, mut tensors) = model(5);
    let size = bytes.len() as u64;
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    upload(&server, key, bytes.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture_with(&server, &dir, true).await;
    let file = fx.open_file(key).await.expect("open");
    assert!(file.read_all().await.expect("cold read") == bytes);
    // Key order, as vLLM's iterator: by name, not file order.
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    drop(file);
    fx.cache.flush().await;
    let fx = fx.restart().await.expect("restart");

    let file = fx.open_file(key).await.expect("open");
    assert!(!file.passed_through(), "no block is checked yet after a restart");
    read_header(&file).await;
    let (_, first) = tensors.first().expect("tensors");
    let got = read_in_pieces(&file, first.clone(), 128 * 1024).await;
    assert!(
        got == bytes[first.start as usize..first.end as usize],
        "first tensor"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while fx.disk.read_bytes() < 8 * MIB {
        assert!(
            Instant::now() < deadline,
            "{} bytes read from disk: nothing was read ahead of the reader",
            fx.disk.read_bytes()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (name, extent) in &tensors[1..] {
        let got = read_in_pieces(&file, extent.clone(), 128 * 1024).await;
        assert!(got == bytes[extent.start as usize..extent.end as usize], "{name}");
    }
    // Each block read from disk once (the loader's and the load's reads of one block are one
    // read), and let go from memory once every byte of it was read. (Before, without the
    // load: 1.55x.)
    let read = fx.disk.read_bytes();
    assert!(read <= size * 11 / 10, "{read} bytes read from disk for {size}");
    // Every block was checked whole, the ones the loader read in part first too: the next
    // open passes the file through (once the load's last checks, in flight, are done).
    drop(file);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !fx.open_file(key).await.expect("open").passed_through() {
        assert!(
            Instant::now() < deadline,
            "the model is not passed through after its load"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(server.ranged_gets().len() == fetches_before_restart(&server, key));
}

/// The ranged GETs of `key` so far (all made before the restart in the test above).
fn fetches_before_restart(server: &S3Server, key: &str) -> usize {
    server
        .ranged_gets()
        .iter()
        .filter(|get| get.path.ends_with(key))
        .count()
}

/// Two tensor-parallel ranks, each a handle of its own, read their halves of every tensor at
/// once in key order (which is not file order): every byte is right and every block is
/// fetched once for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_parallel_ranks_share_each_fetch() {
    let key = "llama/tp.safetensors";
    let (bytes, mut tensors) = model(4);
    let size = bytes.len() as u64;
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    upload(&server, key, bytes.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir).await;
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let ranks = (0..2u64).map(|rank| {
        let (fx, tensors, bytes) = (&fx, &tensors, &bytes);
        async move {
            let file = fx.open_file(key).await.expect("open");
            read_header(&file).await;
            for (name, extent) in tensors {
                let half = (extent.end - extent.start) / 2;
                let slice = extent.start + rank * half..extent.start + (rank + 1) * half;
                let got = read_in_pieces(&file, slice.clone(), 64 * 1024).await;
                assert!(
                    got == bytes[slice.start as usize..slice.end as usize],
                    "rank {rank}: {name}"
                );
            }
        }
    });
    futures::future::join_all(ranks).await;
    let (counts, past_end) = fetches(&server, key, size);
    assert!(counts.iter().all(|&n| n == 1), "fetches per block: {counts:?}");
    assert!(!past_end);
}

/// Files named `.safetensors` whose header does not hold up: each reads byte-exact as a plain
/// file, opened twice, with no GET past its end and one warning naming it; a good model is
/// not warned about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_that_does_not_hold_up_leaves_a_plain_file_and_one_warning() {
    capture();
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    let body = content(3, 0, (3 * MIB) as usize);
    let with_header = |len: u64, header: &[u8]| {
        let mut file = len.to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&body);
        file
    };
    let overlapping = br#"{"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#;
    let out_of_range = br#"{"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}"#;
    let size = 8 + body.len() as u64;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "bad/past-the-end.safetensors",
            with_header(size, b""),
            "past the end",
        ),
        ("bad/gigabytes.safetensors", with_header(4 << 30, b""), "over the"),
        (
            "bad/not-json.safetensors",
            with_header(16, b"not json at all!"),
            "not a JSON",
        ),
        (
            "bad/overlapping.safetensors",
            with_header(overlapping.len() as u64, overlapping),
            "overlap",
        ),
        (
            "bad/out-of-range.safetensors",
            {
                let mut file = (out_of_range.len() as u64).to_le_bytes().to_vec();
                file.extend_from_slice(out_of_range);
                file.extend_from_slice(&[0; 8]);
                file
            },
            "outside",
        ),
        (
            "bad/README.safetensors",
            b"# A model card, not a model\n".repeat(1000),
            "over the",
        ),
    ];
    for (key, bytes, _) in &cases {
        upload(&server, key, bytes.clone()).await;
    }
    let (good, _) = model(1);
    upload(&server, "good/model.safetensors", good.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir).await;

    for (key, bytes, reason) in &cases {
        for _ in 0..2 {
            let file = fx.open_file(key).await.expect("open");
            let got = file.read_all().await.expect("read");
            assert!(got == *bytes, "{key} does not read as itself");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let warnings = loop {
            let warnings: Vec<_> = events_containing(key)
                .into_iter()
                .filter(|event| event.level == tracing::Level::WARN)
                .collect();
            if !warnings.is_empty() || Instant::now() > deadline {
                break warnings;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(warnings.len(), 1, "{key}: {warnings:?}");
        assert!(warnings[0].text.contains(reason), "{key}: {warnings:?}");
        let (_, past_end) = fetches(&server, key, bytes.len() as u64);
        assert!(!past_end, "{key}: a GET past the end");
    }
    let file = fx.open_file("good/model.safetensors").await.expect("open");
    assert!(file.read_all().await.expect("read") == good);
    drop(file);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let warned = events_containing("good/model.safetensors");
    assert!(
        warned.iter().all(|e| e.level != tracing::Level::WARN),
        "{warned:?}"
    );
}

/// A sharded model as Hugging Face writes it under `dir`: `shards` files
/// `model-0000K-of-0000N.safetensors` of one layer each and their `model.safetensors.index.json`,
/// plus a `config.json`; each key and its bytes.
fn sharded_model(dir: &str, shards: usize) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    let mut weight_map = serde_json::Map::new();
    for shard in 1..=shards {
        let name = format!("model-{shard:05}-of-{shards:05}.safetensors");
        let (bytes, tensors) = model(1);
        for (tensor, _) in tensors {
            weight_map.insert(format!("{tensor}.{shard}"), name.clone().into());
        }
        files.push((format!("{dir}/{name}"), bytes));
    }
    let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": weight_map });
    files.push((
        format!("{dir}/model.safetensors.index.json"),
        index.to_string().into_bytes(),
    ));
    files.push((
        format!("{dir}/config.json"),
        br#"{"model_type": "llama"}"#.to_vec(),
    ));
    files
}

/// Runs a prefetch of `targets` on `fx` to its end.
async fn prefetch(fx: &CacheFixture, targets: &[&str]) -> Result<JobReport, PrefetchError> {
    let jobs = Arc::new(Jobs::new(
        fx.cache.clone(),
        vec![("models".into(), fx.origin.clone())],
        fx.config.cache.dir.join("mnt"),
        fx.stats.clone(),
    ));
    let targets = targets.iter().map(|t| (*t).to_owned()).collect();
    let id = jobs.start(targets, false, None).await?.id;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let report = jobs.report(id).expect("job");
        if report.state != JobState::Running {
            return Ok(report);
        }
        assert!(Instant::now() < deadline, "{report:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `larder prefetch` of a sharded model's index alone fetches the shards it names (and not
/// the files beside them it does not name); of the model's directory, every file. Either way
/// the small files come first, then every shard's first part (its header), then the shards in
/// name order, as loaders read them. Before, the index alone fetched only the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_index_prefetched_alone_brings_its_shards_headers_first() {
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    let files = sharded_model("llama", 3);
    for (key, bytes) in &files {
        upload(&server, key, bytes.clone()).await;
    }
    upload(&server, "llama/unrelated.safetensors", model(1).0).await;
    let shards: Vec<&str> = files
        .iter()
        .map(|(key, _)| key.as_str())
        .filter(|key| key.ends_with("-of-00003.safetensors"))
        .collect();

    for (target, objects) in [
        ("models:llama/model.safetensors.index.json", 4),
        ("models:llama", 6),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let fx = fixture(&server, &dir).await;
        let report = prefetch(&fx, &[target]).await.expect("start");
        assert_eq!(
            (report.state, report.objects),
            (JobState::Done, objects),
            "{target}: {report:?}"
        );
        for shard in &shards {
            let object = fx.open_object(shard).await.expect("open");
            let blocks = object.version().size.div_ceil(MIB) as u32;
            assert!(
                (0..blocks).all(|index| fx.cache.store().contains(object.id(), index)),
                "{target}: {shard} not all cached"
            );
        }
        // The order of the origin's GETs: each shard's first part before any later part of
        // any shard, and the later parts shard by shard.
        let gets: Vec<(String, u64)> = fx
            .faults
            .gets()
            .into_iter()
            .filter(|get| shards.contains(&get.path.as_str()))
            .map(|get| (get.path, get.range.map_or(0, |range| range.start)))
            .collect();
        let last_header = gets.iter().rposition(|(_, start)| *start == 0).expect("headers");
        let first_body = gets.iter().position(|(_, start)| *start > 0).expect("bodies");
        assert!(last_header < first_body, "{target}: {gets:?}");
        let bodies: Vec<&str> = gets[first_body..].iter().map(|(key, _)| key.as_str()).collect();
        assert!(bodies.is_sorted(), "{target}: shards out of order: {bodies:?}");
    }
}

/// An index that names a file outside its directory, or a shard that is not there, fails
/// the prefetch before anything is fetched, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_index_naming_what_is_not_beside_it_fails_the_prefetch_naming_it() {
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    let cases = [
        ("escape", "../secrets/model.safetensors", "not a file beside it"),
        (
            "missing",
            "model-00002-of-00002.safetensors",
            "model-00002-of-00002.safetensors, which is not in source",
        ),
    ];
    for (dir, shard, _) in cases {
        let index = serde_json::json!({ "weight_map": { "a": shard } });
        let key = format!("{dir}/model.safetensors.index.json");
        upload(&server, &key, index.to_string().into_bytes()).await;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir).await;
    for (dir, _, reason) in cases {
        let target = format!("models:{dir}/model.safetensors.index.json");
        let error = prefetch(&fx, &[&target]).await.expect_err("a bad index");
        assert!(error.to_string().contains(reason), "{target}: {error}");
    }
    assert!(
        fx.faults.gets().iter().all(|get| get.range.is_none()),
        "a block was fetched"
    );
}

/// The handle whose open found the header refused reads as any plain file's from then on:
/// small reads at random after a restart cost the groups they touch, not whole blocks. Before,
/// that handle kept reading whole blocks for each read (the mount benchmark's random 4 KiB
/// reads of its `model.safetensors`, random bytes, ran at 0.02x the local file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_whose_header_was_refused_reads_as_a_plain_file() {
    capture();
    let key = "plain/random.safetensors";
    let bytes = content(11, 0, (8 * MIB) as usize);
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    upload(&server, key, bytes.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = fixture(&server, &dir).await;
    let file = fx.open_file(key).await.expect("open");
    assert!(file.read_all().await.expect("cold read") == bytes);
    drop(file);
    fx.cache.flush().await;
    let fx = fx.restart().await.expect("restart");

    let warned = || {
        events_containing(key)
            .iter()
            .filter(|event| event.level == tracing::Level::WARN)
            .count()
    };
    let before = warned();
    let file = fx.open_file(key).await.expect("open");
    let deadline = Instant::now() + Duration::from_secs(10);
    while warned() == before {
        assert!(Instant::now() < deadline, "the header was not refused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let read_before = fx.disk.read_bytes();
    // Not at the file's start, where any read starts a sequential run.
    for i in 1..=16u64 {
        let offset = (i * 7919 * 4096) % (8 * MIB - 4096);
        let got = file.read(offset, 4096).await.expect("read");
        assert!(
            got == bytes[offset as usize..offset as usize + 4096],
            "at {offset}"
        );
    }
    let read = fx.disk.read_bytes() - read_before;
    assert!(read < MIB, "16 reads of 4 KiB read {read} bytes from disk");
}
