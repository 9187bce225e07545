//! The SeaweedFS helper: instances side by side, each on its own ports with its own bucket,
//! and nothing of theirs left behind. Needs `weed` (scripts/test installs it).

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use larder_tests::seaweed::Seaweed;
use object_store::ObjectStoreExt;
use object_store::path::Path;

/// Starts an instance on a thread of its own, failing after `limit` (a helper that waits for
/// another instance would otherwise hang the test).
fn start(bucket: &'static str, limit: Duration) -> Seaweed {
    let weed = Seaweed::installed_binary();
    assert!(weed.exists(), "{} is missing: run scripts/test", weed.display());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Seaweed::start(&weed, bucket));
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{bucket}: weed mini did not serve within {limit:?}"))
        .expect("weed mini")
}

/// What an instance leaves in /tmp when it is not cleaned up: `weed`'s gRPC sockets.
fn weed_sockets() -> Vec<PathBuf> {
    std::fs::read_dir("/tmp")
        .map(|dir| {
            dir.flatten()
                .map(|entry| entry.path())
                .filter(|path| {
                    path.file_name()
                        .and_then(|name| name.to_str())
                        .is_some_and(|name| name.starts_with("seaweedfs-") && name.ends_with(".sock"))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_run_side_by_side_and_leave_nothing_behind() {
    let sockets_before = weed_sockets();
    let limit = Duration::from_secs(90);
    let (first, second) =
        tokio::task::spawn_blocking(move || (start("first", limit), start("second", limit)))
            .await
            .expect("join");
    assert_ne!(first.endpoint, second.endpoint);
    for (server, key) in [(&first, "one.bin"), (&second, "two.bin")] {
        let client = server.client().expect("client");
        client
            .put(&Path::from(key), bytes::Bytes::from_static(b"hello").into())
            .await
            .expect("put");
        assert_eq!(
            client
                .get(&Path::from(key))
                .await
                .expect("get")
                .bytes()
                .await
                .expect("body"),
            "hello"
        );
    }
    // Each bucket is its own server's: the other's object is not there.
    let missing = first.client().expect("client").head(&Path::from("two.bin")).await;
    assert!(
        matches!(missing, Err(object_store::Error::NotFound { .. })),
        "{missing:?}"
    );

    tokio::task::spawn_blocking(move || {
        drop(first);
        drop(second);
    })
    .await
    .expect("join");
    let left: Vec<_> = weed_sockets()
        .into_iter()
        .filter(|path| !sockets_before.contains(path))
        .collect();
    assert!(left.is_empty(), "left in /tmp: {left:?}");
}
