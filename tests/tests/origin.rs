//! Origins against a real S3 server and a local directory: listing, HEAD, typed errors, and
//! sources built from their configured URL.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use larder_config::{IoEngineKind, OriginConfig, SourceConfig};
use larder_engine as engine;
use larder_origin::environment::Environment;
use larder_origin::{ListEntry, Origin, OriginError};
use larder_read_path::{Cache, OpenObject, Reader};
use larder_stats::{OriginStats, Stats};
use larder_store::BlockStore;
use larder_tests::fixture::test_config;
use larder_tests::{FaultPlan, FaultStore, RequestKind, S3Server, content, seed};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

fn origin_over(store: Arc<dyn object_store::ObjectStore>, prefix: &str) -> Origin {
    Origin::new(
        "models",
        "s3://larder-test",
        store,
        Path::from(prefix),
        &OriginConfig::default(),
        Arc::new(OriginStats::default()),
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
    let mut root = origin.list_page("", None).await.expect("list root").entries;
    root.sort_by_key(|e| format!("{e:?}"));
    let names: Vec<String> = root
        .iter()
        .map(|e| match e {
            ListEntry::Prefix(p) => format!("{p}/"),
            ListEntry::Object(o) => format!("{}:{}", o.key, o.size),
        })
        .collect();
    assert_eq!(names, ["top.bin:1000", "llama/"]);
    let llama = origin.list_page("llama", None).await.expect("list llama").entries;
    assert_eq!(llama.len(), 2, "{llama:?}");
    assert!(llama.contains(&ListEntry::Prefix("llama/weights".into())));

    let head = origin.head("llama/config.json").await.expect("head");
    assert_eq!((head.key.as_str(), head.size), ("llama/config.json", 1000));
    assert!(head.etag.is_some());
}

#[tokio::test]
async fn listings_page_through_thousands_of_keys_and_step_over_unparsable_ones() {
    let server = S3Server::start("larder-test").await.expect("server");
    let big = server.bucket_dir().join("big");
    std::fs::create_dir_all(big.join("sub")).expect("mkdir");
    let names: Vec<String> = (0..2500).map(|i| format!("f-{i:05}")).collect();
    for name in &names {
        std::fs::write(big.join(name), name).expect("write");
    }
    // Keys object_store cannot parse: first in order, in the middle of a page, and a common
    // prefix (a "directory" with a control character in its name).
    std::fs::write(big.join("\u{1}first"), "x").expect("write");
    std::fs::write(big.join("f-01500\tbad"), "x").expect("write");
    std::fs::create_dir(big.join("g\u{2}dir")).expect("mkdir");
    std::fs::write(big.join("g\u{2}dir/inner"), "x").expect("write");
    std::fs::write(big.join("sub/inner"), "x").expect("write");

    let client = server.client().expect("client");
    let origin = origin_over(client.clone(), "").with_pager(client);
    let mut listed = Vec::new();
    let mut pages = 0;
    let mut from = None;
    loop {
        let page = origin.list_page("big", from.as_ref()).await.expect("page");
        pages += 1;
        listed.extend(page.entries.into_iter().map(|e| match e {
            ListEntry::Prefix(p) => format!("{p}/"),
            ListEntry::Object(o) => o.key,
        }));
        match page.next {
            Some(next) => from = Some(next),
            None => break,
        }
    }
    let mut expected: Vec<String> = names.iter().map(|n| format!("big/{n}")).collect();
    expected.push("big/sub/".into());
    listed.sort();
    expected.sort();
    assert_eq!(listed, expected);
    assert!(pages >= 3, "{pages} pages");

    // Every object at any depth, the same keys stepped over and named.
    let all = origin.list_all("big").await.expect("all");
    let mut keys: Vec<String> = all.versions.into_iter().map(|v| v.key).collect();
    keys.sort();
    let mut expected: Vec<String> = names.iter().map(|n| format!("big/{n}")).collect();
    expected.push("big/sub/inner".into());
    expected.sort();
    assert_eq!(keys, expected);
    assert_eq!(
        all.unparsable_keys,
        ["big/\u{1}first", "big/f-01500\tbad", "big/g\u{2}dir/inner"]
    );

    assert!(origin.is_dir("big").await.expect("probe"));
    assert!(
        origin
            .is_dir("big/g\u{2}dir")
            .await
            .is_err_and(|e| matches!(e, OriginError::Rejected { .. }))
    );
    assert!(!origin.is_dir("big/f-00001").await.expect("probe"));
    assert!(!origin.is_dir("nothing").await.expect("probe"));
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
    let origin = Arc::new(
        Origin::from_config(
            &config.sources[0],
            &config.origin,
            stats.origin.clone(),
            &Environment::default(),
        )
        .expect("origin"),
    );
    assert_eq!(
        origin.list_page("", None).await.expect("list").entries,
        vec![ListEntry::Prefix("datasets".into())]
    );
    let version = origin.head("datasets/shard-0.bin").await.expect("head");
    let engine = engine::build(config.cache.io_engine, config.cache.io_queue_depth).expect("engine");
    let store = Arc::new(
        BlockStore::open(&config.cache, engine, stats.store.clone())
            .await
            .expect("store"),
    );
    let cache = Cache::new(store, &config.origin, config.cache.memory_limit, &stats, None);
    let object = OpenObject::new(origin, version);
    let got = Reader::new(cache, object).read(0, size).await.expect("read");
    assert!(got == content(seed("local", 0), 0, size));
}

#[test]
fn unusable_source_urls_are_config_errors() {
    for url in ["ftp://host/x", "memory:///", "s3:///no-bucket"] {
        let source = SourceConfig::new("bad", url);
        let error = Origin::from_config(
            &source,
            &OriginConfig::default(),
            Arc::new(OriginStats::default()),
            &Environment::default(),
        )
        .expect_err(url);
        assert!(matches!(error, OriginError::Config { .. }), "{url}: {error}");
        assert!(error.to_string().contains("bad"), "{error}");
    }
}

/// The retry budget in exact tokens: it starts with one second of trickle (10), every
/// operation's first attempt deposits `retry_budget_ratio`, every retry withdraws one, and
/// 10 tokens a second trickle in, up to 1000. The clock is paused and the backoff is zero, so
/// time passes only when the test advances it.
#[tokio::test(start_paused = true)]
async fn the_retry_budget_gets_ratio_tokens_per_first_attempt_and_a_trickle() {
    let faults = FaultStore::new(Arc::new(InMemory::new()));
    faults
        .put(&Path::from("k"), PutPayload::from_static(b"x"))
        .await
        .expect("put");
    let config = OriginConfig {
        retry_budget_ratio: 0.5,
        max_attempts: 5000,
        backoff_base: Duration::ZERO,
        backoff_max: Duration::ZERO,
        ..OriginConfig::default()
    };
    let stats = Arc::new(OriginStats::default());
    let origin = Origin::new(
        "models",
        "s3://larder-test",
        faults.clone(),
        Path::default(),
        &config,
        stats.clone(),
    );
    // 20 first attempts that succeed: 10 + 20 × 0.5 = 20 tokens.
    for _ in 0..20 {
        origin.head("k").await.expect("head");
    }
    faults.set_plan(FaultPlan {
        unavailable: 1.0,
        ..FaultPlan::default()
    });
    let attempts = || async {
        match origin.head("k").await {
            Err(OriginError::RetriesExhausted { attempts, .. }) => attempts,
            other => panic!("expected exhausted retries, got {other:?}"),
        }
    };
    // 20 + 0.5 deposited: 20 retries, 0.5 left.
    assert_eq!(attempts().await, 21);
    // 0.5 + 0.5: one retry, then none; then 0.5 is not enough for one.
    assert_eq!(attempts().await, 2);
    assert_eq!(attempts().await, 1);
    // A second trickles in 10: 0.5 + 0.5 + 10 = 11 retries.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(attempts().await, 12);
    // An hour of idling fills the budget to its cap, never past it.
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert_eq!(attempts().await, 1001);
    assert_eq!(stats.origin_retries.load(Ordering::Relaxed), 20 + 1 + 11 + 1000);
    let heads = faults
        .requests()
        .iter()
        .filter(|r| r.kind == RequestKind::Head)
        .count();
    assert_eq!(heads, 20 + 21 + 2 + 1 + 12 + 1001);
}
