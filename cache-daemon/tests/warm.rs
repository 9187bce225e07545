//! End to end: warm-node labels. `larder daemon` with `--warm-plan`, run as a process against
//! an S3 server, labels its Node through a stand-in of the Kubernetes API server (the harness's
//! `ApiServer`, which records every patch): removed at start, set once the plan is prefetched
//! and verified, removed when an object of the plan gets a new version and set again once the
//! daemon has fetched it, removed on SIGTERM; and, with the API server gone while the plan
//! stops being complete, retried until the server is back, without the daemon stopping.

use std::path::Path;
use std::time::Duration;

use larder_tests::daemon::DaemonProcess;
use larder_tests::kube::{ApiServer, Patch};
use larder_tests::{S3Server, content, seed};

const MIB: usize = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");
const NODE: &str = "gpu-017";
const LABEL: &str = "larder.dev/warm-base";
const TOKEN: &str = "test-token-not-a-secret";
const KEYS: [&str; 2] = ["base/model.safetensors", "base/config.json"];
const WAIT: Duration = Duration::from_secs(30);
/// An object outside the plan.
const OTHER: &str = "other/x.bin";

/// The label state the last patch of `patches` gave.
fn last(patches: &[Patch]) -> Option<Option<String>> {
    patches.last().and_then(|p| p.label(LABEL))
}

fn set(patches: &[Patch]) -> bool {
    last(patches) == Some(Some("true".into()))
}

fn removed(patches: &[Patch]) -> bool {
    last(patches) == Some(None)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_node_is_labelled_while_the_plan_is_complete_and_the_label_converges_after_an_outage() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for key in KEYS {
        server.put(key, seed(key, 0), 5 * MIB + 7).await.expect("put");
    }
    server.put(OTHER, seed(OTHER, 0), 1000).await.expect("put");
    let mut api = ApiServer::start().await.expect("api server");
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("base.toml");
    std::fs::write(&plan, "targets = [\"models:base/\"]\npin = true\n").expect("plan");
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token");
    let (plan, token) = (plan.display().to_string(), token.display().to_string());
    let api_url = api.url();
    let args = [
        "--node-id",
        NODE,
        "--warm-plan",
        &plan,
        "--warm-check-interval",
        "300ms",
        "--warm-api-server",
        &api_url,
        "--warm-token-file",
        &token,
    ];
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");

    // At start the label goes (nothing is verified yet), then comes once the plan is cached.
    let patches = api.wait_for(WAIT, set).await.expect("label set");
    assert_eq!(patches[0].label(LABEL), Some(None), "{patches:#?}");
    for patch in &patches {
        assert_eq!(patch.method, "PATCH");
        assert_eq!(patch.path, format!("/api/v1/nodes/{NODE}"));
        assert_eq!(patch.content_type, "application/merge-patch+json");
        assert_eq!(patch.authorization, format!("Bearer {TOKEN}"));
        // One label, nothing else.
        assert_eq!(
            patch.body["metadata"]["labels"].as_object().map(|l| l.len()),
            Some(1)
        );
        assert_eq!(patch.body.as_object().map(|b| b.len()), Some(1));
    }
    let status = tokio::task::block_in_place(|| daemon.status());
    assert_eq!(status["pinned_objects"], 2, "{status:#}");

    // A new version of an object of the plan: the label goes, and comes back once the daemon
    // has fetched the new version.
    let seen = api.patches().len();
    server
        .put(KEYS[0], seed(KEYS[0], 1), 5 * MIB + 9)
        .await
        .expect("replace");
    let patches = api
        .wait_for(WAIT, |p| {
            p[seen..].iter().any(|p| p.label(LABEL) == Some(None)) && set(p)
        })
        .await
        .expect("label removed, then set again");
    assert!(patches.len() >= seen + 2, "{patches:#?}");
    tokio::task::block_in_place(|| {
        let bytes = std::fs::read(daemon.mount.join(KEYS[0])).expect("read");
        assert!(bytes == content(seed(KEYS[0], 1), 0, 5 * MIB + 9), "wrong bytes");
        // The replaced version is no longer kept from eviction.
        assert_eq!(daemon.status()["pinned_objects"], 2);
    });

    // The API server goes away; then the plan stops being complete for good (the cache dir is
    // lost, which the daemon notices at its next cache write, here of a read outside the plan:
    // it forgets every block and caches nothing again). The daemon keeps trying, keeps
    // serving, and the label is removed once the server is back.
    api.stop();
    let seen = api.patches().len();
    let (cache, mount) = (daemon.cache.clone(), daemon.mount.clone());
    tokio::task::block_in_place(|| {
        std::fs::remove_dir_all(&cache).expect("delete the cache dir");
        let bytes = std::fs::read(mount.join(OTHER)).expect("read");
        assert!(bytes == content(seed(OTHER, 0), 0, 1000), "wrong bytes");
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(api.patches().len(), seen, "patches reached a stopped server");
    let mut daemon = daemon;
    assert!(daemon.exited().expect("exited").is_none(), "the daemon stopped");
    api.resume().await.expect("resume");
    api.wait_for(WAIT, |p| p.len() > seen && removed(p))
        .await
        .expect("label removed after the outage");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(removed(&api.patches()), "{:#?}", api.patches());
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).expect("log");
    assert_eq!(
        log.matches("cannot patch the node label").count(),
        1,
        "one warning per outage:\n{log}"
    );
    assert!(!log.contains(TOKEN), "the token is in the log:\n{log}");
    assert!(
        tokio::task::block_in_place(|| daemon.stop())
            .expect("stop")
            .success()
    );
}

/// SIGTERM removes a label the daemon had set: the mount is going away.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_removes_the_label() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put(KEYS[1], seed(KEYS[1], 0), 1000).await.expect("put");
    let api = ApiServer::start().await.expect("api server");
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("base.toml");
    std::fs::write(&plan, "targets = [\"models:base/\"]\n").expect("plan");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).expect("token");
    let (plan, token) = (plan.display().to_string(), token.display().to_string());
    let api_url = api.url();
    let args = [
        "--node-id",
        NODE,
        "--warm-plan",
        &plan,
        "--warm-api-server",
        &api_url,
        "--warm-token-file",
        &token,
    ];
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");
    let seen = api.wait_for(WAIT, set).await.expect("label set").len();
    let status = tokio::task::block_in_place(|| daemon.stop()).expect("stop");
    assert!(status.success(), "{status}");
    let patches = api.patches();
    assert_eq!(patches.len(), seen + 1, "{patches:#?}");
    assert!(removed(&patches), "{patches:#?}");
}
