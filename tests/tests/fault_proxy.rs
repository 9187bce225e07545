//! The fault proxy of process-level tests: each fault, switched at run time, does what it says
//! to a real S3 client's GETs through it.

use std::time::{Duration, Instant};

use larder_tests::{Bucket, Fault, RecordingProxy, S3Server, content, s3_client, seed};
use object_store::ObjectStoreExt;
use object_store::path::Path;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fault_of_the_proxy_switches_at_run_time() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let key = "proxy/object.bin";
    let size = 1 << 20;
    server.put(key, seed(key, 0), size).await.expect("put");
    let want = content(seed(key, 0), 0, size);
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    let client = s3_client(&proxy.endpoint(), "larder-test").expect("client");
    let get = || {
        let client = client.clone();
        async move { client.get(&Path::from(key)).await?.bytes().await }
    };

    assert!(get().await.expect("pass-through") == want);
    assert_eq!(proxy.body_bytes(), size as u64);
    assert_eq!(
        proxy.body_bytes_of(|request| request.path.ends_with(key)),
        size as u64
    );
    assert_eq!(proxy.body_bytes_of(|request| request.method != "GET"), 0);

    proxy.set_fault(Fault::FlipByte(1000));
    let flipped = get().await.expect("a flipped byte is no error");
    let differ: Vec<usize> = (0..size).filter(|&i| flipped[i] != want[i]).collect();
    assert_eq!(differ, [1000]);
    assert_eq!(flipped[1000], !want[1000]);

    proxy.set_fault(Fault::ResetAfter(100_000));
    let before = proxy.body_bytes();
    get().await.expect_err("a body cut short");
    assert_eq!(proxy.body_bytes() - before, 100_000);

    proxy.set_fault(Fault::StallAfterHeaders);
    let stalled = tokio::spawn(get());
    let started = Instant::now();
    while proxy.held() == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "no body was held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!stalled.is_finished(), "the body was not held");
    proxy.set_fault(Fault::PassThrough);
    assert!(stalled.await.expect("join").expect("released") == want);

    proxy.set_fault(Fault::Latency(Duration::from_millis(300)));
    let started = Instant::now();
    assert!(get().await.expect("late") == want);
    assert!(started.elapsed() >= Duration::from_millis(300));

    // 1 MiB at 4 MiB/s: a quarter of a second at least.
    proxy.set_fault(Fault::Bandwidth(4 << 20));
    let started = Instant::now();
    assert!(get().await.expect("slow") == want);
    assert!(
        started.elapsed() >= Duration::from_millis(240),
        "{:?}",
        started.elapsed()
    );

    // The first 100,000 bytes at once, then a thousand a second: never more than that.
    proxy.set_fault(Fault::Trickle {
        after: 100_000,
        per_second: 1_000,
    });
    let before = proxy.body_bytes();
    let trickled = tokio::spawn(get());
    let started = Instant::now();
    while proxy.body_bytes() - before < 100_000 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the first bytes did not pass"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (passed_at, passed) = (Instant::now(), proxy.body_bytes() - before);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let trickled_bytes = proxy.body_bytes() - before - passed;
    let most = 100 + (passed_at.elapsed().as_secs_f64() * 1_000.0) as u64;
    assert!(
        trickled_bytes > 0 && trickled_bytes <= most,
        "{trickled_bytes} bytes trickled"
    );
    assert!(!trickled.is_finished(), "the trickled answer ended");
    trickled.abort();

    proxy.set_fault(Fault::CloseConnections);
    let (asked, sent) = (proxy.requests().len(), proxy.body_bytes());
    get().await.expect_err("no answer");
    assert!(
        proxy.requests().len() > asked,
        "the request did not reach the proxy"
    );
    assert_eq!(proxy.body_bytes(), sent);
}
