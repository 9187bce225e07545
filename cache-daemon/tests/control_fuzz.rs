//! The control API over arbitrary requests: any method, path and body (bytes, or JSON with
//! arbitrary targets) is answered with a status and a JSON body, a malformed one with 400;
//! never a panic. The service is the daemon's own, over a real cache and a real S3 server.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Method, Request, StatusCode};
use larder_cache_daemon::control::{self, Control};
use larder_cache_daemon::prefetch::Jobs;
use larder_cache_daemon::seal::Sealer;
use larder_config::IoEngineKind;
use larder_control_api::Settings;
use larder_http::Service;
use larder_peers::manifest::Manifests;
use larder_tests::fixture::{CacheFixture, test_config};
use larder_tests::{S3Server, seed};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const MOUNT: &str = "/larder-fuzz-mount";

/// A target: anything, or text after each form's start so that the parser gets past it.
fn target() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        any::<String>().prop_map(|rest| format!("models:{rest}")),
        any::<String>().prop_map(|rest| format!("{MOUNT}/{rest}")),
        any::<String>().prop_map(|rest| format!("s3://larder-test/{rest}")),
    ]
}

/// A request body: bytes, or a targets request with arbitrary targets.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        (prop::collection::vec(target(), 0..4), any::<bool>()).prop_map(|(targets, pin)| {
            serde_json::to_vec(&serde_json::json!({ "targets": targets, "pin": pin })).expect("json")
        }),
    ]
}

fn request() -> impl Strategy<Value = (Method, String, Vec<u8>)> {
    let method = prop_oneof![Just(Method::GET), Just(Method::POST), Just(Method::DELETE)];
    let path = prop_oneof![
        Just("/v1/prefetch".to_owned()),
        Just("/v1/unpin".to_owned()),
        Just("/v1/status".to_owned()),
        Just("/v1/seal".to_owned()),
        "/v1/seal/[0-9a-z-]{0,24}",
        "/v1/jobs/[0-9a-z-]{0,24}",
        "/[a-z0-9/%.]{0,32}",
    ];
    (method, path, body())
}

#[test]
fn arbitrary_control_requests_are_answered() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let (service, _fixture) = runtime.block_on(async {
        let server = Arc::new(S3Server::start("larder-test").await.expect("s3 server"));
        server
            .put("a/b.bin", seed("a/b.bin", 0), 1000)
            .await
            .expect("put");
        let config = test_config(dir.path(), 1 << 20, IoEngineKind::Psync, &server.url());
        let fx = CacheFixture::open(server, config).await.expect("cache");
        let sources = vec![("models".to_owned(), fx.origin.clone())];
        let jobs = Arc::new(Jobs::new(
            fx.cache.clone(),
            sources.clone(),
            PathBuf::from(MOUNT),
            fx.stats.clone(),
        ));
        let sealer = Arc::new(Sealer::new(
            sources,
            PathBuf::from(MOUNT),
            1 << 20,
            16 << 20,
            Manifests::new(),
        ));
        let settings = Settings {
            mount: MOUNT.into(),
            cache_dir: dir.path().display().to_string(),
            block_size: 1 << 20,
            sources: vec![],
        };
        let control = Control::new(
            jobs,
            sealer,
            fx.stats.clone(),
            fx.cache.store().clone(),
            settings,
            None,
        );
        (control::service(Arc::new(control)), fx)
    });
    let mut runner = TestRunner::new(Config::with_cases(256));
    runner
        .run(&request(), |(method, path, body)| {
            let request = Request::builder()
                .method(method.clone())
                .uri(&path)
                .body(Bytes::from(body.clone()))
                .expect("request");
            let (status, answer) = runtime.block_on(async {
                let response = service.call(request).await;
                let status = response.status();
                let answer = response.into_body().collect().await.expect("body").to_bytes();
                (status, answer)
            });
            let parsed = serde_json::from_slice::<serde_json::Value>(&answer);
            prop_assert!(parsed.is_ok(), "{method} {path}: {status} {answer:?}");
            prop_assert!(
                status != StatusCode::INTERNAL_SERVER_ERROR,
                "{method} {path}: {answer:?}"
            );
            if method == Method::POST && serde_json::from_slice::<serde_json::Value>(&body).is_err() {
                let expected = if ["/v1/prefetch", "/v1/unpin", "/v1/seal"].contains(&path.as_str()) {
                    StatusCode::BAD_REQUEST
                } else {
                    status
                };
                prop_assert_eq!(status, expected, "{} {:?}", path, answer);
            }
            Ok(())
        })
        .expect("every request answered");
}
