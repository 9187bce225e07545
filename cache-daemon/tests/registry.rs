//! The registry mirror end to end, with real parts only: Debian's `docker-registry` as the
//! upstream (behind the recording proxy, which counts the bytes it sends and injects faults),
//! a multi-platform image pushed by `skopeo`, the daemon as a process, and Debian's
//! `containerd` pulling with `ctr images pull --hosts-dir` through the hosts.toml files that
//! `larder containerd-config` writes.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use larder_tests::daemon::DaemonProcess;
use larder_tests::free_port;
use larder_tests::oci::{
    Blob, Containerd, MANIFEST_MEDIA_TYPE, Podman, Registry, TestImage, copy_out, hosts_dir, http_get,
    inspect, is_blob_get, push, write_auth_file,
};
use larder_tests::{Bucket, Fault, RecordingProxy, S3Server};

const BIN: &str = env!("CARGO_BIN_EXE_larder");

/// The registry's name in image references; the daemon's upstream list says where it is.
const HOST: &str = "registry.larder.test";

/// The repository and tag pushed.
const REPO_TAG: &str = "larder/test:v1";

/// Bytes of layers per platform of the big image (two platforms: about 200 MiB in all).
const BIG_LAYERS: u64 = 100 << 20;

/// A runtime for the proxy and the source's S3 server, whose threads serve them while the test
/// blocks on processes.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// One mirror under test: the upstream behind its proxy, the daemon, and what to run again.
struct Mirror {
    _runtime: tokio::runtime::Runtime,
    server: S3Server,
    proxy: RecordingProxy,
    registry: Registry,
    dir: tempfile::TempDir,
    daemon: Option<DaemonProcess>,
    /// The daemon's arguments after the harness's own.
    args: Vec<String>,
    /// The mirror's address.
    address: String,
    /// The metrics listener's address.
    metrics: String,
}

impl Mirror {
    /// A registry holding `image` as [`REPO_TAG`] (pushed with `credentials`, which the
    /// daemon is given too), and a daemon mirroring it with `extra` arguments.
    fn start(image: &TestImage, credentials: Option<(&str, &str)>, extra: &[&str]) -> Self {
        let registry = match credentials {
            Some((user, password)) => Registry::start_with_htpasswd(user, password),
            None => Registry::start(),
        }
        .expect("registry");
        Self::start_on(registry, image, credentials, extra)
    }

    /// As [`Mirror::start`], with a registry with token auth whose token server gives tokens
    /// only to the user of `credentials` (to anyone when `None`).
    fn start_with_token_auth(image: &TestImage, credentials: Option<(&str, &str)>) -> Self {
        let registry = Registry::start_with_token_auth(credentials).expect("registry");
        Self::start_on(registry, image, credentials, &[])
    }

    /// As [`Mirror::start`], with `registry` as the upstream.
    fn start_on(
        registry: Registry,
        image: &TestImage,
        credentials: Option<(&str, &str)>,
        extra: &[&str],
    ) -> Self {
        Self::start_pushed_as(registry, image, credentials, credentials, extra)
    }

    /// As [`Mirror::start_on`], the image pushed with `pusher`'s credentials and the daemon
    /// given `credentials` (none: it cannot pull a private image).
    fn start_pushed_as(
        registry: Registry,
        image: &TestImage,
        pusher: Option<(&str, &str)>,
        credentials: Option<(&str, &str)>,
        extra: &[&str],
    ) -> Self {
        push(image.path(), registry.address(), REPO_TAG, pusher).expect("push");
        let runtime = runtime();
        let server = runtime
            .block_on(S3Server::start("larder-test"))
            .expect("s3 server");
        let proxy = runtime
            .block_on(RecordingProxy::start_to(registry.address()))
            .expect("proxy");
        let dir = tempfile::tempdir().expect("dir");
        let address = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).expect("port"));
        let metrics = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).expect("port"));
        let mut args = vec![
            "--registry-listen".to_owned(),
            address.clone(),
            "--registry-upstream".to_owned(),
            format!("{HOST}={}", proxy.endpoint()),
            "--metrics-listen".to_owned(),
            metrics.clone(),
        ];
        if let Some((user, password)) = credentials {
            let auth = dir.path().join("auth.json");
            write_auth_file(&auth, registry.address(), user, password).expect("auth file");
            // The daemon's credentials are by the registry's name in references.
            let text = std::fs::read_to_string(&auth).expect("auth file");
            std::fs::write(&auth, text.replace(registry.address(), HOST)).expect("auth file");
            args.extend(["--registry-credentials".to_owned(), auth.display().to_string()]);
        }
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let mut mirror = Self {
            _runtime: runtime,
            server,
            proxy,
            registry,
            dir,
            daemon: None,
            args,
            address,
            metrics,
        };
        mirror.restart();
        mirror
    }

    /// Starts the daemon (again, after a stop: same cache dir).
    fn restart(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            daemon.stop().expect("stop");
        }
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let daemon =
            DaemonProcess::start(Path::new(BIN), &self.server, self.dir.path(), &args).expect("daemon");
        self.daemon = Some(daemon);
    }

    fn daemon(&self) -> &DaemonProcess {
        self.daemon.as_ref().expect("daemon")
    }

    /// `larder containerd-config --dir` for this daemon's configuration: the hosts dir.
    fn hosts_dir(&self) -> PathBuf {
        let hosts = self.dir.path().join("hosts");
        let mut command = Command::new(BIN);
        command
            .args(["containerd-config", "--dir"])
            .arg(&hosts)
            .args(["--source", "models=file:///"])
            .args(&self.args);
        let output = command.output().expect("containerd-config");
        assert_ok(&output, "larder containerd-config");
        hosts
    }

    /// A hosts dir whose registry fallback cannot be reached: containerd pulls through the
    /// mirror or not at all, never around it.
    fn mirror_only_hosts_dir(&self) -> PathBuf {
        let hosts = self.hosts_dir();
        let mirror = format!("http://{}", self.address);
        hosts_dir(&hosts, HOST, &mirror, "http://127.0.0.1:1").expect("hosts");
        hosts
    }

    /// Bytes of blobs the upstream has sent so far.
    fn upstream_blob_bytes(&self) -> u64 {
        self.proxy.body_bytes_of(is_blob_get)
    }

    /// The value of `series` in the daemon's metrics; 0 if absent.
    fn metric(&self, series: &str) -> f64 {
        let (_, body) = get(&self.metrics, "/metrics");
        body.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .map_or(0.0, |v| v.parse().expect("number"))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }
}

/// `GET path` on `address`, read until the connection ends: the status, the head and the
/// body's bytes (as many as came).
fn get_bytes(address: &str, path: &str) -> (u16, String, Vec<u8>) {
    let mut stream = send_get(address, path);
    let mut answer = Vec::new();
    // A cut answer ends with an error (a reset) or an early end: what came is kept.
    let _ = stream.read_to_end(&mut answer);
    let at = answer.windows(4).position(|w| w == b"\r\n\r\n").expect("a head") + 4;
    let head = String::from_utf8_lossy(&answer[..at]).into_owned();
    let status = head.get(9..12).and_then(|s| s.parse().ok()).expect("a status");
    (status, head, answer[at..].to_vec())
}

/// A connection to `address` that has sent `GET path` (the connection closed after the answer;
/// reads time out after a minute), for the caller to read the answer as it likes.
fn send_get(address: &str, path: &str) -> TcpStream {
    let mut stream = TcpStream::connect(address).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).expect("request");
    stream
}

/// A mirror of an image whose layers are of 40 MiB, with 1 MiB blocks and 4 MiB parts (so a
/// layer is many blocks and parts), the first layer, and the path of its blob.
fn small_block_mirror(seed: u64) -> (TestImage, Mirror, Blob, String) {
    let image = TestImage::write(seed, 160 << 20).expect("image");
    let extra = ["--block-size", "1MiB", "--part-size", "4MiB"];
    let mirror = Mirror::start(&image, None, &extra);
    let layer = image.image("linux/amd64").expect("amd64").layers[0].clone();
    assert!(layer.size >= 40 << 20, "a layer of {} bytes", layer.size);
    let path = format!("/v2/larder/test/blobs/{}?ns={HOST}", layer.digest);
    (image, mirror, layer, path)
}

/// `GET path` on `address`: the status and the body as text.
fn get(address: &str, path: &str) -> (u16, String) {
    let (status, _, body) = http_get(address, path, &[]).expect("GET");
    (status, body)
}

fn assert_ok(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what}: {}; stdout: {}; stderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Pulls `platform` of the image through `hosts` and checks every digest.
fn pull_and_check(containerd: &Containerd, hosts: &Path, image: &TestImage, platform: &str) {
    pull_as_and_check(containerd, hosts, image, platform, None);
}

/// As [`pull_and_check`], containerd given the registry credentials `user`.
fn pull_as_and_check(
    containerd: &Containerd,
    hosts: &Path,
    image: &TestImage,
    platform: &str,
    user: Option<(&str, &str)>,
) {
    let reference = format!("{HOST}/{REPO_TAG}");
    let pull = containerd
        .pull_as(&reference, Some(hosts), Some(platform), user)
        .expect("ctr");
    assert!(
        pull.status.success(),
        "pull of {platform}: {}; containerd: {}",
        String::from_utf8_lossy(&pull.stderr),
        containerd.log_tail(10)
    );
    assert_eq!(
        containerd.image_digest(&reference).expect("image"),
        image.index.digest
    );
    assert_eq!(
        containerd.content_digests().expect("content"),
        image.pulled(platform).expect("platform")
    );
}

#[test]
fn containerd_pulls_through_the_mirror_once_from_upstream_even_after_a_restart_or_a_prepull() {
    let image = TestImage::write(11, BIG_LAYERS).expect("image");
    let mut mirror = Mirror::start(&image, None, &[]);
    let hosts = mirror.hosts_dir();
    let written = std::fs::read_to_string(hosts.join(HOST).join("hosts.toml")).expect("hosts.toml");
    assert!(
        written.contains(&format!("[host.\"http://{}\"]", mirror.address)),
        "{written}"
    );
    let containerd = Containerd::start().expect("containerd");
    let amd64 = image.image("linux/amd64").expect("amd64");

    // Cold: the upstream sends each blob of the platform once.
    pull_and_check(&containerd, &hosts, &image, "linux/amd64");
    let first = mirror.upstream_blob_bytes();
    let wanted = amd64.layer_bytes() + amd64.config.size;
    assert!(
        first >= wanted && first as f64 <= 1.05 * wanted as f64,
        "the upstream sent {first} blob bytes for {wanted}"
    );
    assert!(mirror.metric("larder_registry_sent_bytes_total") >= wanted as f64);

    // Warm, after a restart of the daemon: no blob byte from the upstream.
    containerd.remove_all().expect("reset");
    mirror.restart();
    pull_and_check(&containerd, &hosts, &image, "linux/amd64");
    assert_eq!(
        mirror.upstream_blob_bytes(),
        first,
        "a warm pull fetched blobs upstream"
    );
    // Checked before the restart, and its blocks hash as they did: not hashed again.
    assert_eq!(mirror.metric("larder_registry_digest_checks_total"), 0.0);

    // Pre-pulled: `larder prefetch image:` of the other platform, then its first pull.
    let target = format!("image:{HOST}/{REPO_TAG}");
    let prefetch = mirror
        .daemon()
        .larder(&["prefetch", "--wait", "--platform", "linux/arm64", &target]);
    assert_ok(&prefetch, "prefetch of the image");
    let prepulled = mirror.upstream_blob_bytes();
    let arm64 = image.image("linux/arm64").expect("arm64");
    assert!(prepulled - first >= arm64.layer_bytes());
    containerd.remove_all().expect("reset");
    pull_and_check(&containerd, &hosts, &image, "linux/arm64");
    assert_eq!(
        mirror.upstream_blob_bytes(),
        prepulled,
        "a pre-pulled image fetched blobs upstream"
    );
}

#[test]
fn a_tampering_upstream_gets_no_bad_byte_to_containerd_or_into_the_cache() {
    // Layers of 8 MiB: two blocks, the first sent before the digest is checked.
    let image = TestImage::write(12, 32 << 20).expect("image");
    let mirror = Mirror::start(&image, None, &[]);
    let hosts = mirror.mirror_only_hosts_dir();
    let containerd = Containerd::start().expect("containerd");
    let reference = format!("{HOST}/{REPO_TAG}");
    let layers: BTreeSet<String> = image.images[0]
        .layers
        .iter()
        .map(|layer| layer.digest.clone())
        .collect();

    mirror.proxy.set_fault(Fault::FlipByte(64 << 10));
    let tampered = containerd
        .pull(&reference, Some(&hosts), Some("linux/amd64"))
        .expect("ctr");
    assert!(!tampered.status.success(), "a pull of tampered layers succeeded");
    let kept = containerd.content_digests().expect("content");
    assert!(
        kept.is_disjoint(&layers),
        "tampered layers reached containerd: {kept:?}"
    );
    assert!(mirror.metric("larder_registry_digest_mismatches_total") >= 1.0);
    // A blob whose bytes fail their digest never completes: its answer is cut short of its
    // length (its first block went out before the end was checked), or, when the verdict came
    // before the headers, it is an error.
    let layer = &image.images[0].layers[0];
    let path = format!("/v2/larder/test/blobs/{}?ns={HOST}", layer.digest);
    let (status, head, body) = get_bytes(&mirror.address, &path);
    if status == 200 {
        assert!(
            (body.len() as u64) < layer.size,
            "a tampered blob was sent whole: {head}"
        );
    } else {
        assert_eq!(status, 502, "{head}");
        assert!(String::from_utf8_lossy(&body).contains("DIGEST_INVALID"));
    }

    // The tampered bytes were not kept: with the upstream honest again, the pull succeeds.
    mirror.proxy.set_fault(Fault::PassThrough);
    containerd.remove_all().expect("reset");
    // Checks containerd gave up on stopped with it; blocks they left unchecked are not sent
    // before the digest is checked again.
    pull_and_check(&containerd, &hosts, &image, "linux/amd64");
}

#[test]
fn with_the_upstream_down_cached_images_pull_and_the_rest_fail_at_once_in_the_registry_shape() {
    let image = TestImage::write(13, 8 << 20).expect("image");
    // Every tag is resolved upstream again: the stale answer is what serves it.
    let mirror = Mirror::start(&image, None, &["--registry-tag-ttl", "0s"]);
    let hosts = mirror.mirror_only_hosts_dir();
    let containerd = Containerd::start().expect("containerd");
    pull_and_check(&containerd, &hosts, &image, "linux/amd64");
    // The tag's and blobs' HEADs are origin requests: as many as the upstream saw.
    let heads = || {
        mirror
            .proxy
            .requests()
            .iter()
            .filter(|r| r.method == "HEAD")
            .count()
    };
    let counted = |kind: &str| mirror.metric(&format!("larder_origin_requests_total{{kind=\"{kind}\"}}"));
    assert!(heads() > 0);
    assert_eq!(counted("head"), heads() as f64);
    let transient = "larder_origin_errors_total{kind=\"transient\"}";
    assert_eq!(mirror.metric(transient), 0.0);

    mirror.proxy.set_fault(Fault::CloseConnections);
    containerd.remove_all().expect("reset");
    pull_and_check(&containerd, &hosts, &image, "linux/amd64");
    let stale = mirror.metric("larder_registry_stale_tags_total");
    assert!(stale >= 1.0);
    assert!(mirror.log().contains("serving the tag as last resolved"));
    // Each stale answer followed an upstream that could not be reached: an origin error.
    assert!(mirror.metric(transient) >= stale, "{stale} stale tags");

    // Uncached: the other platform's manifest, an unknown blob, an unknown tag.
    let arm64 = &image.image("linux/arm64").expect("arm64").manifest.digest;
    let unknown_blob = format!("sha256:{}", "0".repeat(64));
    for (path, code) in [
        (
            format!("/v2/larder/test/manifests/{arm64}?ns={HOST}"),
            "UNAVAILABLE",
        ),
        (
            format!("/v2/larder/test/blobs/{unknown_blob}?ns={HOST}"),
            "UNAVAILABLE",
        ),
        (format!("/v2/larder/test/manifests/v2?ns={HOST}"), "UNAVAILABLE"),
    ] {
        let started = Instant::now();
        let (status, body) = get(&mirror.address, &path);
        assert_eq!(status, 503, "{path}: {body}");
        let errors: serde_json::Value = serde_json::from_str(&body).expect("registry error JSON");
        assert_eq!(errors["errors"][0]["code"], code, "{body}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{path} took {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn unknown_registries_bad_names_and_a_thousand_concurrent_requests_are_refused_or_bounded() {
    let image = TestImage::write(14, 8 << 20).expect("image");
    let mirror = Mirror::start(&image, None, &[]);
    let layer = image.images[0].layers[0].clone();
    for (path, status, code) in [
        (
            "/v2/x/manifests/v1?ns=registry.example.org".to_owned(),
            403,
            "DENIED",
        ),
        // Another registry named as the first component, with the one upstream configured:
        // a host (a dot or localhost), not a repository of that upstream; with a port, not a
        // repository name at all.
        ("/v2/other.io/app/manifests/v1".to_owned(), 403, "DENIED"),
        (
            "/v2/registry:5000/app/manifests/v1".to_owned(),
            400,
            "NAME_INVALID",
        ),
        (
            "/v2/localhost/app/blobs/sha256:".to_owned() + &"0".repeat(64),
            403,
            "DENIED",
        ),
        (format!("/v2/a/../b/manifests/v1?ns={HOST}"), 400, "NAME_INVALID"),
        (
            format!("/v2/A/blobs/{}?ns={HOST}", layer.digest),
            400,
            "NAME_INVALID",
        ),
        (format!("/v2/a/blobs/sha512:00?ns={HOST}"), 400, "DIGEST_INVALID"),
        ("/v2/_catalog".to_owned(), 404, "UNSUPPORTED"),
    ] {
        let (got, body) = get(&mirror.address, &path);
        assert_eq!(got, status, "{path}: {body}");
        assert!(body.contains(code), "{path}: {body}");
    }
    assert!(mirror.metric(r#"larder_registry_requests_total{kind="refused"}"#) >= 8.0);
    assert_eq!(
        mirror.proxy.requests().len(),
        0,
        "a refused request reached the upstream"
    );

    // A thousand requests for one blob at once: each answered right or told to retry (503
    // with Retry-After: no connection is closed unanswered), the blob fetched from the
    // upstream about once, and the daemon serving afterwards.
    let path = format!("/v2/larder/test/blobs/{}?ns={HOST}", layer.digest);
    let threads: Vec<_> = (0..1000)
        .map(|_| {
            let (address, path) = (mirror.address.clone(), path.clone());
            std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
                let mut stream = TcpStream::connect(&address)?;
                stream.set_read_timeout(Some(Duration::from_secs(60)))?;
                let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
                stream.write_all(request.as_bytes())?;
                let mut answer = Vec::new();
                stream.read_to_end(&mut answer)?;
                Ok(answer)
            })
        })
        .collect();
    let mut served = 0;
    for thread in threads {
        let answer = thread.join().expect("thread").expect("an answer");
        if answer.starts_with(b"HTTP/1.1 503") {
            let head = String::from_utf8_lossy(&answer).to_ascii_lowercase();
            assert!(head.contains("retry-after: 1"), "{head}");
        } else {
            assert!(
                answer.starts_with(b"HTTP/1.1 200"),
                "{}",
                String::from_utf8_lossy(&answer[..answer.len().min(200)])
            );
            let at = answer.windows(4).position(|w| w == b"\r\n\r\n").expect("head") + 4;
            assert_eq!(
                (answer.len() - at) as u64,
                layer.size,
                "a short answer: {}",
                String::from_utf8_lossy(&answer[..at])
            );
            served += 1;
        }
    }
    assert!(served > 0, "no request of the thousand was served");
    let fetched = mirror.upstream_blob_bytes();
    assert!(
        fetched as f64 <= 1.05 * layer.size as f64,
        "the upstream sent {fetched} bytes for one blob of {}",
        layer.size
    );
    let (status, _) = get(&mirror.address, &path);
    assert_eq!(status, 200, "the mirror stopped serving");
}

#[test]
fn an_upstream_with_basic_credentials_is_pulled_with_the_credentials_file() {
    let image = TestImage::write(15, 4 << 20).expect("image");
    let mirror = Mirror::start(&image, Some(("larder", "s3cret-pass")), &[]);
    let hosts = mirror.hosts_dir();
    let containerd = Containerd::start().expect("containerd");
    pull_and_check(&containerd, &hosts, &image, "linux/amd64");
    let logged = mirror.log();
    assert!(!logged.contains("s3cret-pass") && !logged.contains("bGFyZGVyOnMzY3JldC1wYXNz"));
}

#[test]
fn an_upstream_with_token_auth_is_pulled_through_the_bearer_flow() {
    let image = TestImage::write(16, 4 << 20).expect("image");
    // Tokens for anyone, then only for the user of the daemon's credentials file.
    for credentials in [None, Some(("larder", "s3cret-pass"))] {
        let mirror = Mirror::start_with_token_auth(&image, credentials);
        let hosts = mirror.mirror_only_hosts_dir();
        let containerd = Containerd::start().expect("containerd");
        let before = mirror.registry.tokens_issued().len();
        pull_and_check(&containerd, &hosts, &image, "linux/amd64");
        let tokens = mirror.registry.tokens_issued();
        assert!(
            tokens.len() > before,
            "{credentials:?}: the daemon pulled without a token"
        );
        let logged = mirror.log();
        for token in &tokens[before..] {
            assert!(!logged.contains(token.as_str()), "a token was logged");
        }
        assert!(!logged.contains("s3cret-pass") && !logged.contains("bGFyZGVyOnMzY3JldC1wYXNz"));
    }
}

/// A registry whose token service is on another host (127.0.0.2, over plain HTTP) that is
/// not in registry.token_hosts is not sent the registry's credentials: that service gives no
/// token, the pull fails, and the daemon says why. Listed with --registry-token-host, the
/// service gets them and the pull works. Before, the credentials went to any realm.
#[test]
fn credentials_go_only_to_token_services_on_the_registrys_host_or_listed() {
    let image = TestImage::write(18, 4 << 20).expect("image");
    let credentials = Some(("larder", "s3cret-pass"));
    let registry =
        Registry::start_with_token_auth_at(credentials, Ipv4Addr::new(127, 0, 0, 2)).expect("registry");
    let mut mirror = Mirror::start_on(registry, &image, credentials, &[]);
    let path = format!("/v2/larder/test/manifests/v1?ns={HOST}");
    let pushed = mirror.registry.tokens_issued().len();
    let (status, body) = get(&mirror.address, &path);
    assert_ne!(status, 200, "{body}");
    assert_eq!(
        mirror.registry.tokens_issued().len(),
        pushed,
        "the token service on another host was sent the credentials"
    );
    assert!(
        mirror.log().contains("token service is on another host"),
        "{}",
        mirror.log()
    );

    mirror
        .args
        .extend(["--registry-token-host".to_owned(), "127.0.0.2".to_owned()]);
    mirror.restart();
    let (status, body) = get(&mirror.address, &path);
    assert_eq!(status, 200, "{body}");
    assert!(mirror.registry.tokens_issued().len() > pushed);
}

/// An upstream that says every manifest is 5 MiB, over the 4 MiB any registry stores: a fake
/// around the real daemon, answering `HEAD` (all the mirror asks before it refuses) and `GET`.
fn oversize_upstream() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address").to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut head = Vec::new();
            let mut byte = [0; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let size = 5 << 20;
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/vnd.oci.image.manifest.v1+json\r\n\
                 docker-content-digest: sha256:{}\r\ncontent-length: {size}\r\nconnection: close\r\n\r\n",
                "1".repeat(64)
            );
            let _ = stream.write_all(answer.as_bytes());
            if head.starts_with(b"GET") {
                let _ = stream.write_all(&vec![b' '; size]);
            }
        }
    });
    format!("http://{address}")
}

#[test]
fn an_oversize_manifest_is_refused_and_the_mirror_keeps_serving() {
    let image = TestImage::write(16, 1 << 20).expect("image");
    let huge = format!("huge.test={}", oversize_upstream());
    let mirror = Mirror::start(&image, None, &["--registry-upstream", &huge]);
    let (status, body) = get(&mirror.address, "/v2/big/manifests/v1?ns=huge.test");
    assert_eq!(status, 502, "{body}");
    assert!(
        body.contains("MANIFEST_INVALID") && body.contains("larger than"),
        "{body}"
    );
    let (status, body) = get(
        &mirror.address,
        &format!("/v2/larder/test/manifests/v1?ns={HOST}"),
    );
    assert_eq!(status, 200, "{body}");
}

/// `skopeo inspect` through the mirror (it lists the repository's tags: the mirror asks the
/// upstream, with the client's paging); a repository the upstream does not know gets the
/// spec's NAME_UNKNOWN. Before, the tag list was a 404 NOT_FOUND and skopeo inspect failed.
#[test]
fn skopeo_inspect_lists_the_tags_through_the_mirror() {
    let image = TestImage::write(19, 1 << 20).expect("image");
    let mirror = Mirror::start(&image, None, &[]);
    let inspected = inspect(&mirror.address, REPO_TAG).expect("skopeo inspect");
    assert_eq!(inspected["RepoTags"], serde_json::json!(["v1"]), "{inspected}");
    let (status, body) = get(
        &mirror.address,
        &format!("/v2/larder/test/tags/list?n=1&ns={HOST}"),
    );
    assert_eq!(status, 200, "{body}");
    let tags: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(tags["tags"], serde_json::json!(["v1"]), "{body}");
    let upstream = mirror.proxy.requests();
    assert!(
        upstream
            .iter()
            .any(|r| r.path.ends_with("/tags/list") && r.query.as_deref() == Some("n=1")),
        "{upstream:?}"
    );
    let (status, body) = get(
        &mirror.address,
        &format!("/v2/larder/nothing/tags/list?ns={HOST}"),
    );
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("NAME_UNKNOWN"), "{body}");
}

/// An upstream whose blob HEAD claims one byte more, once: that request fails (the body ends
/// short), but the claim is forgotten with the blocks fetched for it, so the next request and
/// one after a restart get the blob. Before, the wrong size stayed in registry-index.json and
/// every later request of that digest got 503.
#[test]
fn a_size_claimed_wrong_once_does_not_poison_the_blob() {
    let image = TestImage::write(17, 4 << 20).expect("image");
    let mut mirror = Mirror::start(&image, None, &[]);
    let layer = image.image("linux/amd64").expect("amd64").layers[0].clone();
    let path = format!("/v2/larder/test/blobs/{}?ns={HOST}", layer.digest);
    mirror.proxy.set_fault(Fault::HeadLengthPlus(1));
    let (status, body) = get(&mirror.address, &path);
    assert_ne!(status, 200, "a blob one byte short was served: {body:.200}");
    mirror.proxy.set_fault(Fault::PassThrough);
    for round in ["again", "after a restart"] {
        // The mirror sends a blob only once its bytes hash to the digest.
        let (status, head, _) = http_get(&mirror.address, &path, &[]).expect("GET");
        assert_eq!(status, 200, "{round}: {head}");
        let length = format!("content-length: {}", layer.size);
        assert!(head.to_ascii_lowercase().contains(&length), "{round}: {head}");
        mirror.restart();
    }
}

/// A layer cached and verified through the mirror, then cross-mounted into another repository
/// of Debian's registry and named there by a manifest that says it is one byte longer, then
/// `larder prefetch --wait` of that image: the layer is still served whole in its own
/// repository and `skopeo copy` of its image succeeds, also after a restart. A size is a claim
/// until the digest is verified; it never overrides a verified one (before, the wrong size
/// replaced it and the layer got 503 in every repository for good).
#[test]
fn a_wrong_size_named_in_another_repository_leaves_a_verified_layer_served() {
    let image = TestImage::write(23, 4 << 20).expect("image");
    let mut mirror = Mirror::start(&image, None, &[]);
    let amd64 = image.image("linux/amd64").expect("amd64").clone();
    let layer = amd64.layers[0].clone();
    let path = format!("/v2/larder/test/blobs/{}?ns={HOST}", layer.digest);
    let (status, head, _) = http_get(&mirror.address, &path, &[]).expect("GET");
    assert_eq!(status, 200, "the layer through the mirror: {head}");

    for blob in [&amd64.config, &layer] {
        let registry = &mirror.registry;
        registry
            .mount_blob(&blob.digest, "larder/test", "larder/other")
            .expect("mount");
    }
    let descriptor = |blob: &Blob, size: u64| serde_json::json!({ "mediaType": blob.media_type, "digest": blob.digest, "size": size });
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": descriptor(&amd64.config, amd64.config.size),
        "layers": [descriptor(&layer, layer.size + 1)],
    });
    let registry = &mirror.registry;
    registry
        .put_manifest("larder/other", "v1", &manifest)
        .expect("manifest");
    let prefetch = mirror.daemon().larder(&[
        "prefetch",
        "--wait",
        "--platform",
        "linux/amd64",
        &format!("image:{HOST}/larder/other:v1"),
    ]);
    let said = String::from_utf8_lossy(&prefetch.stderr).into_owned();

    for round in ["after the prefetch", "after a restart"] {
        let (status, head, _) = http_get(&mirror.address, &path, &[]).expect("GET");
        assert_eq!(status, 200, "{round}: {head}; the prefetch said: {said}");
        let length = format!("content-length: {}", layer.size);
        assert!(head.to_ascii_lowercase().contains(&length), "{round}: {head}");
        let copied = tempfile::tempdir().expect("dir");
        copy_out(
            &mirror.address,
            REPO_TAG,
            "linux/amd64",
            &copied.path().join("image"),
        )
        .expect(round);
        mirror.restart();
    }
}

/// A blob whose upstream claims 100 GB, more than the cache holds, is refused at once with an
/// error that says so (containerd then pulls it from the registry itself), and nothing is
/// fetched; once the upstream tells the truth, the blob is served. A fetch that every client
/// has left stops: the parts in flight end, no other starts. Before, one GET of a claimed
/// 100 GB blob fetched through the cache for minutes after its client had gone.
#[test]
fn a_blob_larger_than_the_cache_is_refused_and_a_fetch_nobody_waits_for_stops() {
    let image = TestImage::write(20, 128 << 20).expect("image");
    let extra = ["--cache-capacity", "512MiB", "--part-size", "4MiB"];
    let mirror = Mirror::start(&image, None, &extra);
    let layers = &image.image("linux/amd64").expect("amd64").layers;
    let layer = layers.iter().max_by_key(|l| l.size).expect("a layer").clone();
    let path = format!("/v2/larder/test/blobs/{}?ns={HOST}", layer.digest);

    mirror.proxy.set_fault(Fault::HeadLengthPlus(100_000_000_000));
    let (status, body) = get(&mirror.address, &path);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("more than the cache can hold"), "{body}");
    assert_eq!(mirror.upstream_blob_bytes(), 0, "the oversize blob was fetched");

    // 1 MiB/s from the upstream: the 32 MiB layer would take about 32 s. The blocks stream
    // (all but the last go out as they are hashed): the client gets the first block while
    // the upstream is still sending, then goes; the parts in flight then (4 of 4 MiB) end,
    // and no more start.
    mirror.proxy.set_fault(Fault::Bandwidth(1 << 20));
    let mut stream = TcpStream::connect(&mirror.address).expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
    stream.write_all(request.as_bytes()).expect("request");
    let mut head = Vec::new();
    let mut byte = [0; 1];
    while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).expect("head") == 1 {
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    let mut first_block = vec![0; 4 << 20];
    stream.read_exact(&mut first_block).expect("the first block");
    let fetched = mirror.upstream_blob_bytes();
    assert!(
        fetched < layer.size,
        "the first block waited for the whole layer ({fetched} of {} bytes fetched)",
        layer.size
    );
    drop(stream);
    // Every blob GET to the upstream ends (the parts in flight are sent to their end), short
    // of the whole layer. Were the fetch going on, the next part's GET would be under way
    // before the last of the parts at once had ended: no blob GET open means it stopped.
    let deadline = Instant::now() + Duration::from_secs(40);
    while mirror.proxy.open_of(is_blob_get) > 0 {
        assert!(Instant::now() < deadline, "the upstream kept sending");
        std::thread::sleep(Duration::from_millis(50));
    }
    let last = mirror.upstream_blob_bytes();
    assert!(
        last < layer.size,
        "the whole layer ({} bytes) was fetched for a client that had gone: {last}",
        layer.size
    );
    mirror.proxy.set_fault(Fault::PassThrough);
    let (status, head, _) = http_get(&mirror.address, &path, &[]).expect("GET");
    assert_eq!(status, 200, "{head}");
}

/// The bytes of `blob` as pushed.
fn pushed(image: &TestImage, blob: &Blob) -> Vec<u8> {
    let hex = blob.digest.strip_prefix("sha256:").expect("a sha256 digest");
    std::fs::read(image.path().join("blobs/sha256").join(hex)).expect("the blob")
}

/// A client taking a cold 40 MiB layer slowly (1 MiB blocks, one every 50 ms) gets every
/// block from the mirror's memory as the check hashed it: the check keeps pace with it
/// instead of running to the end and leaving the client to read each block back from the
/// cache disk (before, the whole layer, 41 MB, was read back). The layer is whole and right.
#[test]
fn a_cold_layer_streams_to_a_slow_client_from_memory_not_from_the_cache_disk() {
    let (image, mirror, layer, path) = small_block_mirror(24);
    let before = mirror.daemon().disk_read_bytes().expect("disk reads");
    let mut stream = send_get(&mirror.address, &path);
    let mut answer = Vec::new();
    let mut chunk = vec![0; 1 << 20];
    loop {
        let read = stream.read(&mut chunk).expect("read");
        if read == 0 {
            break;
        }
        answer.extend_from_slice(&chunk[..read]);
        std::thread::sleep(Duration::from_millis(50 * read as u64 / (1 << 20)));
    }
    let at = answer.windows(4).position(|w| w == b"\r\n\r\n").expect("a head") + 4;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer[..at])
    );
    let body = &answer[at..];
    assert_eq!(body.len() as u64, layer.size, "the layer cut short");
    assert!(
        body == pushed(&image, &layer),
        "the layer's bytes are not those pushed"
    );
    let read_back = mirror.daemon().disk_read_bytes().expect("disk reads") - before;
    assert!(
        read_back < 1 << 20,
        "{read_back} bytes read back from the cache disk for a cold layer"
    );
}

/// With a memory budget of two blocks, smaller than the blocks a check keeps for its clients,
/// a cold layer still streams whole to a client (the check and its fetch wait on each other
/// and on the budget, and none of them for ever).
#[test]
fn a_cold_layer_streams_whole_with_a_memory_budget_of_two_blocks() {
    let image = TestImage::write(25, 64 << 20).expect("image");
    let extra = [
        "--block-size",
        "1MiB",
        "--part-size",
        "4MiB",
        "--memory-limit",
        "2MiB",
    ];
    let mirror = Mirror::start(&image, None, &extra);
    let layer = image.image("linux/amd64").expect("amd64").layers[0].clone();
    let path = format!("/v2/larder/test/blobs/{}?ns={HOST}", layer.digest);
    let (status, head, body) = get_bytes(&mirror.address, &path);
    assert_eq!(status, 200, "{head}");
    assert_eq!(body.len() as u64, layer.size, "the layer cut short");
    assert!(
        body == pushed(&image, &layer),
        "the layer's bytes are not those pushed"
    );
}

/// An upstream that starts refusing a cold layer's reads (403) once its first block has gone
/// to the client: the check fails at the first block it cannot have and the client's answer
/// ends at once, cut, instead of hanging while the fetch waits for a hashing that has stopped.
/// With the upstream mended (and the failure no longer remembered), the layer is served whole.
#[test]
fn a_layer_the_upstream_stops_serving_midway_ends_the_answer_and_is_served_once_mended() {
    let (image, mirror, layer, path) = small_block_mirror(26);
    let mut stream = send_get(&mirror.address, &path);
    let mut first = vec![0; 1 << 20];
    stream
        .read_exact(&mut first)
        .expect("the head and the first block");
    assert!(
        first.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..100])
    );
    mirror.proxy.set_fault(Fault::RefuseReads(403));
    let refused = Instant::now();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    let took = refused.elapsed();
    assert!(
        ((first.len() + rest.len()) as u64) < layer.size,
        "a layer the upstream stopped serving was sent whole"
    );
    assert!(took < Duration::from_secs(30), "the answer took {took:?} to end");
    // The failed blocks fail at once for a few seconds (FAILED_FILL_MEMORY), then are fetched.
    mirror.proxy.set_fault(Fault::PassThrough);
    let deadline = Instant::now() + larder_read_path::FAILED_FILL_MEMORY + Duration::from_secs(20);
    loop {
        let (status, head, body) = get_bytes(&mirror.address, &path);
        if status == 200 && body.len() as u64 == layer.size {
            assert!(
                body == pushed(&image, &layer),
                "the layer's bytes are not those pushed"
            );
            break;
        }
        assert!(Instant::now() < deadline, "never served whole again: {head}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// podman (the containers/image library CRI-O uses) pulls through the mirror with the
/// registries.conf of docs/REGISTRY.md ("CRI-O (and podman)"), the registry itself
/// unreachable (its name resolves nowhere): every layer right; after a restart of the daemon
/// the same pull fetches no blob from the upstream.
#[test]
fn podman_pulls_through_the_mirror_with_the_documented_registries_conf() {
    let image = TestImage::write(21, 8 << 20).expect("image");
    let mut mirror = Mirror::start(&image, None, &[]);
    let conf = format!(
        "[[registry]]\nlocation = \"{HOST}\"\n\n[[registry.mirror]]\nlocation = \"{}/{HOST}\"\ninsecure = true\n",
        mirror.address
    );
    let reference = format!("{HOST}/{REPO_TAG}");
    let amd64 = image.image("linux/amd64").expect("amd64");
    let layers: Vec<&str> = amd64.layers.iter().map(|l| l.digest.as_str()).collect();
    let mut upstream = 0;
    for round in ["cold", "after a restart"] {
        let podman = Podman::new(&conf).expect("podman");
        podman
            .run_ok(&["pull", "--quiet", "--arch", "amd64", "--os", "linux", &reference])
            .unwrap_or_else(|e| panic!("{round}: {e:#}"));
        // The test's layers are plain tar: their digests are their diff ids.
        let pulled = podman
            .run_ok(&[
                "image",
                "inspect",
                "--format",
                "{{json .RootFS.Layers}}",
                &reference,
            ])
            .expect("inspect");
        let pulled: Vec<String> = serde_json::from_str(pulled.trim()).expect("JSON");
        assert_eq!(pulled, layers, "{round}");
        if round == "cold" {
            upstream = mirror.upstream_blob_bytes();
            assert!(upstream > 0);
            mirror.restart();
        }
    }
    assert_eq!(
        mirror.upstream_blob_bytes(),
        upstream,
        "the pull after a restart fetched blobs"
    );
}

/// Tokens that last two seconds: once the mirror's token has expired (the mirror keeps one a
/// little less than its life, a second here), its next request to the registry gets a 401,
/// the mirror asks the token service for a new one, and the client never sees the 401. Every
/// pull's tag resolution reaches the registry (tag TTL 0); the client pulls until a new token
/// has been issued, each pull answered 200.
#[test]
fn an_expired_token_is_renewed() {
    let image = TestImage::write(22, 4 << 20).expect("image");
    let registry = Registry::start_with_short_tokens(Duration::from_secs(2)).expect("registry");
    let mirror = Mirror::start_on(registry, &image, None, &["--registry-tag-ttl", "0s"]);
    let path = format!("/v2/larder/test/manifests/v1?ns={HOST}");
    let (status, body) = get(&mirror.address, &path);
    assert_eq!(status, 200, "{body}");
    let issued = mirror.registry.tokens_issued().len();
    // Well past the token's life: a mirror that kept using it would get no other.
    let deadline = Instant::now() + Duration::from_secs(10);
    while mirror.registry.tokens_issued().len() == issued {
        assert!(Instant::now() < deadline, "no new token after the first expired");
        std::thread::sleep(Duration::from_millis(50));
        let (status, body) = get(&mirror.address, &path);
        assert_eq!(status, 200, "{body}");
    }
}

/// A private image whose credentials the daemon does not have, only the client (a pod's pull
/// secret, handed to containerd by the kubelet): the mirror answers 401 without a challenge,
/// containerd falls back to the registry its hosts.toml names, asks the token service with
/// its OAuth2 POST, and the pull succeeds, every digest right, without the mirror.
#[test]
fn a_private_image_the_daemon_cannot_pull_falls_back_to_the_registry_with_the_clients_credentials() {
    let image = TestImage::write(23, 4 << 20).expect("image");
    let user = ("larder", "s3cret-pass");
    let registry = Registry::start_with_token_auth(Some(user)).expect("registry");
    let mirror = Mirror::start_pushed_as(registry, &image, Some(user), None, &[]);
    let hosts = mirror.dir.path().join("fallback-hosts");
    let mirror_url = format!("http://{}", mirror.address);
    let registry_url = format!("http://{}", mirror.registry.address());
    hosts_dir(&hosts, HOST, &mirror_url, &registry_url).expect("hosts");
    let containerd = Containerd::start().expect("containerd");
    let posts = mirror.registry.token_posts();
    pull_as_and_check(&containerd, &hosts, &image, "linux/amd64", Some(user));
    assert!(
        mirror.registry.token_posts() > posts,
        "containerd asked for no token with POST"
    );
    assert_eq!(
        mirror.upstream_blob_bytes(),
        0,
        "the mirror fetched blobs it could not serve"
    );
}

/// The first line of every hosts.toml Larder writes.
const HOSTS_MARKER: &str = "# Written by Larder";

/// `larder daemon` serving `server` from `dir`, its mirror keeping containerd's hosts files in
/// `hosts` for each of `registries` (each reached at a loopback port nothing answers on: no
/// pull happens here), as `--registry-containerd-hosts-dir` makes it.
fn daemon_keeping_hosts(
    server: &S3Server,
    dir: &Path,
    hosts: &Path,
    registries: &[&str],
) -> anyhow::Result<DaemonProcess> {
    let mirror = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST)?);
    let mut args = vec![
        "--registry-listen".to_owned(),
        mirror,
        "--registry-containerd-hosts-dir".to_owned(),
        hosts.display().to_string(),
    ];
    for registry in registries {
        args.extend([
            "--registry-upstream".to_owned(),
            format!("{registry}=http://127.0.0.1:1"),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    DaemonProcess::start(Path::new(BIN), server, dir, &args)
}

/// An S3 server holding `a.bin` (1000 bytes of seed 7), on `runtime`.
fn bucket_with_a_file(runtime: &tokio::runtime::Runtime) -> S3Server {
    let server = runtime
        .block_on(S3Server::start("larder-test"))
        .expect("s3 server");
    runtime.block_on(server.put("a.bin", 7, 1000)).expect("put");
    server
}

/// One registry's `hosts.toml` in containerd's hosts dir is a directory (a slip of the node's
/// setup): the daemon says so and leaves it, writes the other registry's file, and mounts and
/// serves the models all the same; at SIGTERM it removes its own file only.
#[test]
fn a_hosts_toml_that_is_a_directory_costs_that_registry_its_file_not_the_mount() {
    let runtime = runtime();
    let server = bucket_with_a_file(&runtime);
    let dir = tempfile::tempdir().expect("dir");
    let hosts = dir.path().join("certs.d");
    std::fs::create_dir_all(hosts.join("nvcr.io/hosts.toml")).expect("mkdir");

    let daemon = daemon_keeping_hosts(&server, dir.path(), &hosts, &["nvcr.io", "quay.io"])
        .expect("the daemon mounts although the mirror cannot write one hosts.toml");
    let bytes = std::fs::read(daemon.mount.join("a.bin")).expect("read through the mount");
    assert!(bytes == larder_tests::content(7, 0, 1000), "a.bin differs");
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).expect("log");
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("nvcr.io/hosts.toml")),
        "no warning names the directory in the way:\n{log}"
    );
    assert!(hosts.join("nvcr.io/hosts.toml").is_dir());
    let quay = std::fs::read_to_string(hosts.join("quay.io/hosts.toml")).expect("quay.io's file");
    assert!(quay.starts_with(HOSTS_MARKER), "{quay}");

    assert!(daemon.stop().expect("stop").success());
    assert!(hosts.join("nvcr.io/hosts.toml").is_dir(), "the directory went");
    assert!(
        !hosts.join("quay.io").exists(),
        "Larder's own file and directory stayed"
    );
}

/// Links planted in containerd's hosts dir and an operator's empty directory: the mirror
/// writes through no link (a link at its temporary file's name, a registry's directory that is
/// a link out of the hosts dir), says which registries it left out, and at SIGTERM removes only
/// the files it wrote and the directories it made. Whatever the links point at is untouched
/// all along.
#[test]
fn the_mirror_follows_no_link_in_the_hosts_dir_and_removes_only_what_it_made() {
    let runtime = runtime();
    let server = bucket_with_a_file(&runtime);
    let dir = tempfile::tempdir().expect("dir");
    let node = dir.path().join("node");
    let hosts = node.join("certs.d");
    let precious = node.join("precious.conf");
    let elsewhere = node.join("elsewhere");
    let precious_text = "the operator's own file\n";
    std::fs::create_dir_all(hosts.join("nvcr.io")).expect("mkdir");
    std::fs::create_dir_all(hosts.join("quay.io")).expect("mkdir");
    std::fs::create_dir_all(&elsewhere).expect("mkdir");
    std::fs::write(&precious, precious_text).expect("write");
    std::os::unix::fs::symlink(&precious, hosts.join("nvcr.io/.hosts.toml.larder")).expect("link");
    std::os::unix::fs::symlink(&elsewhere, hosts.join("ghcr.io")).expect("link");
    let untouched = |when: &str| {
        assert_eq!(
            std::fs::read_to_string(&precious).expect("precious"),
            precious_text,
            "{when}: the file a planted link points at was overwritten"
        );
        let beside: Vec<_> = std::fs::read_dir(&elsewhere).expect("elsewhere").collect();
        assert!(
            beside.is_empty(),
            "{when}: written through a linked registry dir: {beside:?}"
        );
        assert!(
            !node.join("hosts.toml").exists(),
            "{when}: written above the hosts dir"
        );
    };

    let registries = ["nvcr.io", "ghcr.io", "quay.io", "docker.io"];
    let daemon = daemon_keeping_hosts(&server, dir.path(), &hosts, &registries).expect("daemon");
    untouched("while serving");
    for registry in ["quay.io", "docker.io"] {
        let text = std::fs::read_to_string(hosts.join(registry).join("hosts.toml")).expect(registry);
        assert!(text.starts_with(HOSTS_MARKER), "{registry}: {text}");
    }
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).expect("log");
    for refused in ["nvcr.io/.hosts.toml.larder", "ghcr.io"] {
        assert!(
            log.lines().any(|l| l.contains("WARN") && l.contains(refused)),
            "no warning names {refused}:\n{log}"
        );
    }

    assert!(daemon.stop().expect("stop").success());
    untouched("after SIGTERM");
    assert!(
        hosts.join("quay.io").is_dir(),
        "the operator's directory was removed"
    );
    assert!(!hosts.join("quay.io/hosts.toml").exists());
    assert!(
        !hosts.join("docker.io").exists(),
        "the directory Larder made stayed"
    );
    assert!(hosts.join("nvcr.io/.hosts.toml.larder").is_symlink());
    assert!(hosts.join("ghcr.io").is_symlink());
}

/// Upstream names that are no registry host (`.`, `..`, `a..b`), from a flag, a variable or the
/// config file, are refused with an error naming the setting, before anything is written:
/// `larder containerd-config --dir` writes no file, the daemon does not start.
#[test]
fn upstream_names_that_are_not_registry_hosts_are_refused_naming_the_setting() {
    let dir = tempfile::tempdir().expect("dir");
    let hosts = dir.path().join("certs.d");
    std::fs::create_dir_all(&hosts).expect("mkdir");
    let config = dir.path().join("larder.toml");
    for name in ["..", ".", "a..b"] {
        let flag = Command::new(BIN)
            .args(["containerd-config", "--dir"])
            .arg(&hosts)
            .args(["--source", "models=file:///"])
            .args(["--registry-upstream", &format!("{name}=http://127.0.0.1:1")])
            .output()
            .expect("containerd-config");
        std::fs::write(
            &config,
            format!(
                "[[sources]]\nname = \"models\"\nurl = \"file:///\"\n\n[registry]\nupstreams = [{name:?}]\n"
            ),
        )
        .expect("config");
        let file = Command::new(BIN)
            .args(["containerd-config", "--dir"])
            .arg(&hosts)
            .arg("--config")
            .arg(&config)
            .output()
            .expect("containerd-config");
        let variable = Command::new(BIN)
            .args(["daemon", "--source", "models=file:///"])
            .arg("--mount")
            .arg(dir.path().join("mnt"))
            .arg("--cache-dir")
            .arg(dir.path().join("cache"))
            .env("LARDER_REGISTRY_UPSTREAMS", name)
            .env("LARDER_METRICS_LISTEN", "127.0.0.1:0")
            .output()
            .expect("daemon");
        for (output, setting) in [
            (flag, "--registry-upstream"),
            (file, "registry.upstreams"),
            (variable, "LARDER_REGISTRY_UPSTREAMS"),
        ] {
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                !output.status.success(),
                "{name:?} by {setting} was taken: {stderr}"
            );
            assert!(
                stderr.contains(setting) && stderr.contains("not a registry host"),
                "{name:?} by {setting}: {stderr}"
            );
        }
        for written in [dir.path().join("hosts.toml"), hosts.join("hosts.toml")] {
            assert!(!written.exists(), "{name:?}: wrote {}", written.display());
        }
    }
    assert!(!dir.path().join("mnt").exists() || !larder_tests::daemon::is_mounted(&dir.path().join("mnt")));
}
