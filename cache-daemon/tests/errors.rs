//! Errors are logged once, where the mount answers them, with the operation, the node, the
//! errno and the cause; a denied origin is named in one warning. The log is captured by a
//! subscriber of this test binary (its own process, so the capture is global).

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use larder_cache_daemon::namespace::{ConfiguredSource, Namespace};
use larder_config::IoEngineKind;
use larder_engine::fault::{Fault, Op};
use larder_fuse_mount::MountOptions;
use larder_origin::Origin;
use larder_stats::OriginStats;
use larder_tests::fixture::{CacheFixture, test_config};
use larder_tests::logs::{capture, events_containing};
use larder_tests::{FaultPlan, S3Server, content, s3_client_with_secret, seed};

/// A page-aligned buffer for O_DIRECT reads.
#[repr(align(4096))]
struct Page([u8; 4096]);

/// A read through the kernel whose fill fails (the origin answers 503 to everything) is logged
/// once: by the mount, at warn, with the operation, the inode, the errno and the whole cause
/// chain; nothing below it logs the same error again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_read_is_logged_once_with_its_cause() {
    capture();
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    let key = "llama/failing.bin";
    server.put(key, seed(key, 0), 3 << 20).await.expect("put");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(
        &dir.path().join("cache"),
        1 << 20,
        IoEngineKind::Psync,
        &server.url(),
    );
    config.origin.max_attempts = 2;
    let fixture = CacheFixture::open(server, config).await.expect("cache");
    let source = ConfiguredSource {
        origin: fixture.origin.clone(),
        ttl: None,
    };
    let namespace = Arc::new(Namespace::new(
        vec![("models".into(), source)],
        fixture.cache.clone(),
        false,
        fixture.stats.mount.clone(),
    ));
    let mountpoint = dir.path().join("mnt");
    std::fs::create_dir(&mountpoint).expect("mkdir");
    let mounted = larder_fuse_mount::mount(
        namespace,
        &mountpoint,
        &MountOptions::default(),
        tokio::runtime::Handle::current(),
    )
    .expect("mount");

    let path = mountpoint.join(key);
    let faults = fixture.faults.clone();
    let result = tokio::task::spawn_blocking(move || {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .expect("open");
        faults.set_plan(FaultPlan {
            unavailable: 1.0,
            ..FaultPlan::default()
        });
        let mut page = Box::new(Page([0; 4096]));
        file.read_at(&mut page.0, 0)
    })
    .await
    .expect("join");
    let error = result.expect_err("the read should fail");
    assert_eq!(error.raw_os_error(), Some(libc::EIO), "{error}");
    tokio::task::spawn_blocking(move || mounted.unmount())
        .await
        .expect("join")
        .expect("unmount");

    // The final error of the fill: RetriesExhausted's text.
    let final_error = "gave up after";
    let about_it = events_containing(final_error);
    assert_eq!(
        about_it.len(),
        1,
        "logged {} times: {about_it:#?}",
        about_it.len()
    );
    let event = &about_it[0];
    assert_eq!(event.level, tracing::Level::WARN, "{event:?}");
    for field in [
        "op=read",
        "errno=5",
        "injected 503 Slow Down",
        key,
        "message=request failed",
    ] {
        assert!(event.text.contains(field), "{field} missing: {event:?}");
    }
    assert!(event.text.contains(" ino="), "{event:?}");
    // Every failed request of the mount was logged with its cause.
    let failed: Vec<_> = events_containing("message=request failed")
        .into_iter()
        .filter(|e| e.text.contains("op=read"))
        .collect();
    assert_eq!(failed.len(), 1, "{failed:#?}");
}

/// An origin that refuses the credentials: one warning naming the source, however many
/// requests it denies, and never the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_origin_is_named_in_one_warning() {
    capture();
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put("a.bin", seed("a.bin", 0), 1024).await.expect("put");
    let secret = "not-the-secret-0123456789";
    let client = s3_client_with_secret(&server.endpoint(), "larder-test", secret).expect("client");
    let origin = Origin::new(
        "denied-src",
        &server.url(),
        client,
        Default::default(),
        &larder_config::OriginConfig::default(),
        Arc::new(OriginStats::default()),
    );
    for _ in 0..3 {
        let error = origin.head("a.bin").await.expect_err("denied");
        assert!(
            matches!(error, larder_origin::OriginError::PermissionDenied { .. }),
            "{error}"
        );
    }
    let warnings: Vec<_> = events_containing("denied-src")
        .into_iter()
        .filter(|e| e.level == tracing::Level::WARN)
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert!(warnings[0].text.contains("denied access"), "{warnings:?}");
    assert!(events_containing(secret).is_empty(), "the secret was logged");
}

/// A cache disk that fails every write (gone read-only, say) is said in one warning, not one
/// per block: before, a 300 MiB read on a read-only cache logged 111 of them. The reads still
/// get the origin's bytes, and each failure is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_disk_that_fails_every_write_is_said_once_not_per_block() {
    capture();
    let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
    let key = "llama/unwritable.bin";
    let size = 32 << 20;
    server.put(key, seed(key, 0), size).await.expect("put");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = test_config(
        &dir.path().join("cache"),
        1 << 20,
        IoEngineKind::Psync,
        &server.url(),
    );
    let fixture = CacheFixture::open(server, config).await.expect("cache");
    fixture.disk.inject(Op::Write, Fault::Eio, None);
    let object = fixture.open_object(key).await.expect("open");
    let bytes = fixture.read_all(&object).await.expect("read");
    assert!(bytes == content(seed(key, 0), 0, size), "wrong bytes");
    // The writes run after the reads are answered: wait for the last to be counted.
    let started = std::time::Instant::now();
    while fixture.stats.read.cache_write_failures.load(Ordering::Relaxed) < 32 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "32 failed writes were never counted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let said = events_containing("cache write failed");
    assert_eq!(said.len(), 1, "{said:#?}");
    assert_eq!(said[0].level, tracing::Level::WARN);
}
