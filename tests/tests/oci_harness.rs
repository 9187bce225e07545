//! The OCI harness on its own, without Larder: a test image pushed into a real registry is
//! pulled by a real containerd through the recording proxy, with every digest as written, and
//! a tampered layer or a registry with credentials behaves as the mirror's tests rely on.

use std::collections::BTreeSet;

use larder_tests::oci::{
    Containerd, Registry, TestImage, hosts_dir, http_get, http_status, is_blob_get, push, write_auth_file,
};
use larder_tests::{Bucket, Fault, RecordingProxy};

/// The registry name the image references use; only the hosts dir says where it is.
const REGISTRY_HOST: &str = "registry.larder.test";

/// A runtime for the proxy, whose threads serve it while the test blocks on `ctr`.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Asserts that `output` (of a `ctr` command) succeeded.
fn assert_ok(output: &std::process::Output, what: &str, containerd: &Containerd) {
    assert!(
        output.status.success(),
        "{what}: {}; stdout: {}; stderr: {}; containerd's log ends: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        containerd.log_tail(10)
    );
}

/// The status and the lower-cased head of `GET path` on `address`, with `authorization` if
/// given.
fn head_of_get(address: &str, path: &str, authorization: Option<&str>) -> (u16, String) {
    let headers: Vec<(&str, &str)> = authorization.map(|a| ("authorization", a)).into_iter().collect();
    let (status, head, _) = http_get(address, path, &headers).expect("GET");
    (status, head.to_ascii_lowercase())
}

/// How many committed snapshots (unpacked layers) containerd holds.
fn committed_snapshots(containerd: &Containerd) -> usize {
    let listed = containerd
        .ctr(&["snapshots", "--snapshotter", containerd.snapshotter(), "ls"])
        .expect("ctr");
    assert_ok(&listed, "snapshots ls", containerd);
    String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter(|line| line.split_whitespace().last() == Some("Committed"))
        .count()
}

#[test]
fn containerd_pulls_the_test_image_through_the_proxy_with_every_digest_intact() {
    let image = TestImage::write(1, 8 << 20).expect("test image");
    assert_eq!(image.images.len(), 2);
    let registry = Registry::start().expect("registry");
    push(image.path(), registry.address(), "larder/test:v1", None).expect("push");
    let runtime = runtime();
    let proxy = runtime
        .block_on(RecordingProxy::start_to(registry.address()))
        .expect("proxy");
    let hosts = tempfile::tempdir().expect("hosts dir");
    hosts_dir(hosts.path(), REGISTRY_HOST, &proxy.endpoint(), &registry.url()).expect("hosts.toml");
    let containerd = Containerd::start().expect("containerd");
    let reference = format!("{REGISTRY_HOST}/larder/test:v1");

    for platform in ["linux/amd64", "linux/arm64"] {
        let before = proxy.body_bytes_of(is_blob_get);
        let pull = containerd
            .pull(&reference, Some(hosts.path()), Some(platform))
            .expect("ctr");
        assert_ok(&pull, &format!("pull of {platform}"), &containerd);
        assert_eq!(
            containerd.image_digest(&reference).expect("image"),
            image.index.digest
        );
        assert_eq!(
            containerd.content_digests().expect("content"),
            image.pulled(platform).expect("platform")
        );
        let wanted = image.image(platform).expect("platform");
        // Unpacked: one committed snapshot per layer, so each layer is a tar containerd reads.
        assert_eq!(committed_snapshots(&containerd), wanted.layers.len());
        // Every blob of the platform came through the proxy: its layers and its config.
        assert_eq!(
            proxy.body_bytes_of(is_blob_get) - before,
            wanted.layer_bytes() + wanted.config.size,
            "{platform}: {:?}",
            proxy.requests()
        );
        containerd.remove_all().expect("reset");
        assert!(containerd.content_digests().expect("content").is_empty());
        assert_eq!(committed_snapshots(&containerd), 0);
    }

    // A flipped byte in each layer: containerd checks the digest and refuses the pull.
    proxy.set_fault(Fault::FlipByte(64 << 10));
    let tampered = containerd
        .pull(&reference, Some(hosts.path()), Some("linux/amd64"))
        .expect("ctr");
    assert!(!tampered.status.success(), "a tampered layer was accepted");
    let said = String::from_utf8_lossy(&tampered.stderr);
    assert!(said.contains("unexpected commit digest"), "{said}");
    let layers: BTreeSet<String> = image.images[0]
        .layers
        .iter()
        .map(|layer| layer.digest.clone())
        .collect();
    let kept = containerd.content_digests().expect("content");
    assert!(kept.is_disjoint(&layers), "tampered layers kept: {kept:?}");
    containerd.remove_all().expect("reset");

    // A mirror that closes every connection: containerd goes on to the registry itself.
    proxy.set_fault(Fault::CloseConnections);
    let before = (proxy.requests().len(), proxy.body_bytes());
    let around = containerd
        .pull(&reference, Some(hosts.path()), Some("linux/amd64"))
        .expect("ctr");
    assert_ok(&around, "pull around a closed mirror", &containerd);
    assert!(proxy.requests().len() > before.0, "the mirror was not asked");
    assert_eq!(proxy.body_bytes(), before.1);
    assert_eq!(
        containerd.content_digests().expect("content"),
        image.pulled("linux/amd64").expect("platform")
    );
}

#[test]
fn a_registry_with_htpasswd_serves_only_its_user() {
    let image = TestImage::write(2, 1 << 20).expect("test image");
    let registry = Registry::start_with_htpasswd("larder", "s3cret-pass").expect("registry");
    assert_eq!(http_status(registry.address(), "/v2/").expect("GET /v2/"), 401);
    for credentials in [None, Some(("larder", "wrong-pass"))] {
        let refused = push(image.path(), registry.address(), "larder/test:v1", credentials)
            .expect_err("a push without the credentials");
        assert!(format!("{refused:#}").contains("unauthorized"), "{refused:#}");
    }
    push(
        image.path(),
        registry.address(),
        "larder/test:v1",
        Some(("larder", "s3cret-pass")),
    )
    .expect("push with the credentials");

    // The Docker config file the daemon's --registry-credentials takes: base64 of user:password.
    let auth = tempfile::tempdir().expect("auth dir");
    let config = auth.path().join("config.json");
    write_auth_file(&config, registry.address(), "larder", "wrong-pass").expect_err("a wrong password");
    write_auth_file(&config, registry.address(), "larder", "s3cret-pass").expect("login");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).expect("read config.json")).expect("json");
    assert_eq!(
        config["auths"][registry.address()]["auth"],
        "bGFyZGVyOnMzY3JldC1wYXNz",
        "{config}"
    );

    let containerd = Containerd::start().expect("containerd");
    let reference = format!("{}/larder/test:v1", registry.address());
    let anonymous = containerd
        .pull(&reference, None, Some("linux/amd64"))
        .expect("ctr");
    assert!(!anonymous.status.success(), "an anonymous pull succeeded");
    let pull = containerd
        .ctr(&[
            "images",
            "pull",
            "--plain-http",
            "--user=larder:s3cret-pass",
            &format!("--snapshotter={}", containerd.snapshotter()),
            "--platform=linux/amd64",
            &reference,
        ])
        .expect("ctr");
    assert_ok(&pull, "pull with the credentials", &containerd);
    assert_eq!(
        containerd.image_digest(&reference).expect("image"),
        image.index.digest
    );
    assert_eq!(
        containerd.content_digests().expect("content"),
        image.pulled("linux/amd64").expect("platform")
    );
}

#[test]
fn a_registry_with_token_auth_serves_skopeo_and_containerd_with_tokens_of_its_server() {
    let image = TestImage::write(3, 1 << 20).expect("test image");
    let registry = Registry::start_with_token_auth(None).expect("registry");
    let (status, head) = head_of_get(registry.address(), "/v2/", None);
    assert_eq!(status, 401, "{head}");
    assert!(
        head.contains("www-authenticate: bearer realm=\"http://127.0.0.1:"),
        "{head}"
    );
    let (status, head) = head_of_get(registry.address(), "/v2/", Some("Bearer not.a.token"));
    assert_eq!(status, 401, "a forged token was taken: {head}");

    push(image.path(), registry.address(), "larder/test:v1", None).expect("push");
    let pushed = registry.tokens_issued();
    assert!(!pushed.is_empty(), "skopeo pushed without a token");
    let (status, head) = head_of_get(registry.address(), "/v2/", Some(&format!("Bearer {}", pushed[0])));
    assert_eq!(status, 200, "the server's token was refused: {head}");

    let containerd = Containerd::start().expect("containerd");
    let reference = format!("{}/larder/test:v1", registry.address());
    let pull = containerd
        .pull(&reference, None, Some("linux/amd64"))
        .expect("ctr");
    assert_ok(&pull, "pull from the registry", &containerd);
    assert_eq!(
        containerd.image_digest(&reference).expect("image"),
        image.index.digest
    );
    assert_eq!(
        containerd.content_digests().expect("content"),
        image.pulled("linux/amd64").expect("platform")
    );
    assert!(
        registry.tokens_issued().len() > pushed.len(),
        "containerd pulled without a token"
    );

    // A token server of one user: no token, so no push, without its credentials.
    let registry = Registry::start_with_token_auth(Some(("larder", "s3cret-pass"))).expect("registry");
    for credentials in [None, Some(("larder", "wrong-pass"))] {
        let refused = push(image.path(), registry.address(), "larder/test:v1", credentials)
            .expect_err("a push without the credentials");
        assert!(format!("{refused:#}").contains("unauthorized"), "{refused:#}");
    }
    assert!(registry.tokens_issued().is_empty());
    push(
        image.path(),
        registry.address(),
        "larder/test:v1",
        Some(("larder", "s3cret-pass")),
    )
    .expect("push with the credentials");
}
