//! Rack peers end to end: daemons as separate processes on loopback addresses of their own,
//! SeaweedFS behind a counting proxy as the origin, reads through the kernel mounts.

use std::path::Path;
use std::time::Instant;

use larder_tests::rack::Rack;
use larder_tests::seaweed::Seaweed;
use larder_tests::{RecordingProxy, content, seed, upload};

const MIB: u64 = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");
const MODEL: &str = "llama/model.safetensors";

/// Peer deadlines for several members and their origin on a machine of two cores.
const LOADED: &[&str] = &["--peer-first-byte-timeout", "2s", "--peer-stall-timeout", "10s"];

/// SeaweedFS with `size` bytes at [`MODEL`], behind a counting proxy.
async fn origin(size: u64) -> (Seaweed, RecordingProxy) {
    let weed = Seaweed::installed_binary();
    assert!(weed.exists(), "{} is missing: run scripts/test", weed.display());
    let server = tokio::task::spawn_blocking(move || Seaweed::start(&weed, "rack"))
        .await
        .expect("join")
        .expect("weed mini");
    let client = server.client().expect("client");
    upload(client.as_ref(), MODEL, seed(MODEL, 0), size)
        .await
        .expect("upload");
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    (server, proxy)
}

/// Reads the model through every member's mount at once; panics on a wrong byte.
fn read_everywhere(rack: &Rack, members: &[usize], size: u64) {
    let expected = content(seed(MODEL, 0), 0, size as usize);
    std::thread::scope(|scope| {
        for &i in members {
            let path = rack.daemon(i).mount.join(MODEL);
            let expected = &expected;
            scope.spawn(move || {
                let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("n{i}: {e}"));
                assert!(bytes == *expected, "n{i} read wrong bytes");
            });
        }
    });
}

/// Bytes member `i` served its readers from peers, by its status.
fn peer_bytes(rack: &Rack, i: usize) -> u64 {
    let status = rack.daemon(i).status();
    status["served"]["peer"]
        .as_u64()
        .unwrap_or_else(|| panic!("no peer bytes in {status}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn four_members_reading_one_model_at_once_pull_it_from_the_origin_about_once() {
    let size = 512 * MIB;
    let (_server, proxy) = origin(size).await;
    let rack = tokio::task::spawn_blocking(move || {
        // Four members and the origin share two cores here: deadlines for that.
        let rack = Rack::start(Path::new(BIN), &proxy, 4, LOADED, &[]).expect("rack");
        let started = Instant::now();
        read_everywhere(&rack, &[0, 1, 2, 3], size);
        eprintln!(
            "4 members read {} MiB each in {:?}",
            size / MIB,
            started.elapsed()
        );
        (rack, proxy)
    })
    .await
    .expect("join");
    let (rack, proxy) = rack;
    let fetched = proxy.body_bytes();
    for i in 0..4 {
        let failures: Vec<_> = rack
            .log(i)
            .lines()
            .filter(|l| l.contains("rack peer failed"))
            .map(str::to_owned)
            .collect();
        eprintln!(
            "n{i}: {} failed peer requests; first: {:?}",
            failures.len(),
            failures.first()
        );
    }
    eprintln!("origin sent {fetched} bytes for a model of {size}");
    assert!(
        fetched as f64 <= 1.15 * size as f64,
        "the origin sent {fetched} bytes, {:.2}x the model",
        fetched as f64 / size as f64
    );
    for i in 0..4 {
        assert!(peer_bytes(&rack, i) > 0, "n{i} read nothing from peers");
    }
}
