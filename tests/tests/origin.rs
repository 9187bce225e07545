//! Origins against a real S3 server and a local directory: listing, HEAD, typed errors, and
//! sources built from their configured URL.

use std::sync::Arc;

use larder_cache_daemon::cache::{Cache, OpenObject};
use larder_cache_daemon::engine;
use larder_cache_daemon::origin::{ListEntry, Origin, OriginError};
use larder_cache_daemon::stats::Stats;
use larder_cache_daemon::store::BlockStore;
use larder_config::{IoEngineKind, OriginConfig, SourceConfig};
use larder_tests::fixture::test_config;
use larder_tests::{S3Server, content, seed};
use object_store::path::Path;

fn origin_over(store: Arc<dyn object_store::ObjectStore>, prefix: &str) -> Origin {
    Origin::new(
        "models",
        "s3://larder-test",
        store,
        Path::from(prefix),
        &OriginConfig::default(),
        Arc::new(Stats::default()),
    )
}

#[tokio::test]
async fn lists_one_level_relative_to_the_source_prefix() {
    let server = S3Server::start("larder-test").await.expect("server");
    for key in [
        "models/llama/config.json",
        "models/llama/weights/00.bin",
        "models/top.bin",
        "other/x.bin",
    ] {
        server.put(key, seed(key, 0), 1000).await.expect("put");
    }
    let origin = origin_over(server.client().expect("client"), "models");
    let mut root = origin.list("").await.expect("list root");
    root.sort_by_key(|e| format!("{e:?}"));
    let names: Vec<String> = root
        .iter()
        .map(|e| match e {
            ListEntry::Prefix(p) => format!("{p}/"),
            ListEntry::Object(o) => format!("{}:{}", o.key, o.size),
        })
        .collect();
    assert_eq!(names, ["top.bin:1000", "llama/"]);
    let llama = origin.list("llama").await.expect("list llama");
    assert_eq!(llama.len(), 2, "{llama:?}");
    assert!(llama.contains(&ListEntry::Prefix("llama/weights".into())));

    let head = origin.head("llama/config.json").await.expect("head");
    assert_eq!((head.key.as_str(), head.size), ("llama/config.json", 1000));
    assert!(head.etag.is_some());
}

#[tokio::test]
async fn missing_forbidden_and_invalid_keys_are_distinct_errors() {
    let server = S3Server::start("larder-test").await.expect("server");
    server.put("present.bin", 1, 10).await.expect("put");
    let origin = origin_over(server.client().expect("client"), "");
    let missing = origin.head("absent.bin").await.expect_err("missing");
    assert!(
        matches!(missing, OriginError::NotFound { ref key, .. } if key == "absent.bin"),
        "{missing}"
    );

    let forbidden = larder_tests::s3_client_with_secret(&server.endpoint(), "larder-test", "wrong-secret")
        .expect("client");
    let origin = origin_over(forbidden, "");
    let denied = origin.head("present.bin").await.expect_err("bad credentials");
    assert!(matches!(denied, OriginError::PermissionDenied { .. }), "{denied}");
    assert!(
        !denied.to_string().contains("wrong-secret"),
        "the secret leaked into an error: {denied}"
    );

    for key in ["../escape", "a//b", "a/./b", ""] {
        let error = origin.head(key).await.expect_err(key);
        assert!(matches!(error, OriginError::Rejected { .. }), "{key:?}: {error}");
    }
}

#[tokio::test]
async fn a_local_directory_source_is_built_from_its_url_and_served() {
    let origin_dir = tempfile::tempdir().expect("tempdir");
    let size = 5 * 1024 * 1024 + 3;
    std::fs::create_dir_all(origin_dir.path().join("datasets")).expect("mkdir");
    std::fs::write(
        origin_dir.path().join("datasets/shard-0.bin"),
        content(seed("local", 0), 0, size),
    )
    .expect("write");
    let url = format!("file://{}", origin_dir.path().display());
    let cache_dir = tempfile::tempdir().expect("tempdir");
    let config = test_config(cache_dir.path(), 1 << 20, IoEngineKind::Psync, &url);
    let stats = Arc::new(Stats::default());
    let origin =
        Arc::new(Origin::from_config(&config.sources[0], &config.origin, stats.clone()).expect("origin"));
    assert_eq!(
        origin.list("").await.expect("list"),
        vec![ListEntry::Prefix("datasets".into())]
    );
    let version = origin.head("datasets/shard-0.bin").await.expect("head");
    let engine = engine::build(config.cache.io_engine, config.cache.io_queue_depth).expect("engine");
    let store = Arc::new(
        BlockStore::open(&config.cache, engine, stats.clone())
            .await
            .expect("store"),
    );
    let cache = Cache::new(store, &config.origin, stats);
    let object = OpenObject::new(origin, version);
    let got = cache.read(&object, 0, size).await.expect("read");
    assert!(got == content(seed("local", 0), 0, size));
}

#[test]
fn unusable_source_urls_are_config_errors() {
    for url in ["ftp://host/x", "memory:///", "s3:///no-bucket"] {
        let source = SourceConfig::new("bad", url);
        let error = Origin::from_config(&source, &OriginConfig::default(), Arc::new(Stats::default()))
            .expect_err(url);
        assert!(matches!(error, OriginError::Config { .. }), "{url}: {error}");
        assert!(error.to_string().contains("bad"), "{error}");
    }
}
