//! End to end: warm-node labels. `larder daemon` with `--warm-plan`, run as a process against
//! an S3 server, labels its Node through a stand-in of the Kubernetes API server (the harness's
//! `ApiServer`, which records every patch): removed at start, set once the plan is prefetched
//! and verified, removed when an object of the plan gets a new version and set again once the
//! daemon has fetched it, removed on SIGTERM; and, with the API server gone while the plan
//! stops being complete, retried until the server is back, without the daemon stopping. Over
//! HTTPS (a Python server with certificates openssl makes), only the configured CA is trusted.

use std::path::Path;
use std::process::{Command, Stdio};
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

/// The lines of the daemon's `log` that contain `what`, each with the time the daemon wrote
/// it (the RFC 3339 stamp that begins each line).
fn stamped<'a>(log: &'a str, what: &str) -> Vec<(std::time::SystemTime, &'a str)> {
    log.lines()
        .filter(|line| line.contains(what))
        .map(|line| {
            let stamp = line.split_whitespace().next().unwrap_or_default();
            let at = humantime::parse_rfc3339(stamp).unwrap_or_else(|e| panic!("{line}: {e}"));
            (at, line)
        })
        .collect()
}

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
    // The daemon tried, and said so: the label was to be removed, and the server is down.
    let log = dir.path().join("daemon.log");
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&log)
        .expect("log")
        .contains("cannot patch the node label")
    {
        assert!(
            started.elapsed() < WAIT,
            "no patch was tried while the server was down"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(api.patches().len(), seen, "patches reached a stopped server");
    let mut daemon = daemon;
    assert!(daemon.exited().expect("exited").is_none(), "the daemon stopped");
    api.resume().await.expect("resume");
    let patches = api
        .wait_for(WAIT, |p| p.len() > seen && removed(p))
        .await
        .expect("label removed after the outage");
    // And it stays removed: the checker goes on finding the plan incomplete, and nothing is
    // patched again. Each check lists the plan's prefix at the origin; once a second listing
    // after the removal has arrived, the check before it has ended, and a label it had wanted
    // set would have been patched.
    let listings = || {
        let requests = server.requests();
        requests
            .iter()
            .filter(|r| r.method == "GET" && r.query.as_deref().is_some_and(|q| q.contains("prefix=base")))
            .count()
    };
    let before = listings();
    let started = std::time::Instant::now();
    while listings() < before + 2 {
        assert!(started.elapsed() < WAIT, "the plan was not checked again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        api.patches()[patches.len()..],
        [],
        "patched after the label was removed: {:#?}",
        api.patches()
    );
    let log = std::fs::read_to_string(log).expect("log");
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

/// Makes a CA (`NAME-ca.pem`) and a certificate for 127.0.0.1 it signs (`NAME.pem`,
/// `NAME.key`) in `dir`, with the openssl command.
fn certificates(dir: &Path, name: &str) {
    let path = |file: &str| dir.join(format!("{name}{file}")).display().to_string();
    let openssl = |args: &[&str]| {
        let output = Command::new("openssl").args(args).output().expect("run openssl");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test CA",
        "-keyout",
        &path("-ca.key"),
        "-out",
        &path("-ca.pem"),
    ]);
    openssl(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-subj",
        "/CN=api",
        "-keyout",
        &path(".key"),
        "-out",
        &path(".csr"),
    ]);
    std::fs::write(
        path(".ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .expect("ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        &path(".csr"),
        "-CA",
        &path("-ca.pem"),
        "-CAkey",
        &path("-ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &path(".ext"),
        "-out",
        &path(".pem"),
    ]);
}

/// An HTTPS server on 127.0.0.1 (Python's ssl and http.server, from the venv) that answers
/// every PATCH 200 and appends its path and body to `log`, one line each; killed on drop.
struct HttpsApiServer {
    child: std::process::Child,
    port: u16,
}

impl HttpsApiServer {
    fn start(dir: &Path, name: &str, log: &Path) -> Self {
        const SCRIPT: &str = r#"
import http.server, ssl, sys
cert, key, log = sys.argv[1:4]
class Handler(http.server.BaseHTTPRequestHandler):
    def do_PATCH(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with open(log, "a") as out:
            out.write(self.path + " " + body.decode() + "\n")
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;
        let mut child = Command::new(larder_tests::kube::venv_bin().join("python3"))
            .args(["-c", SCRIPT])
            .arg(dir.join(format!("{name}.pem")))
            .arg(dir.join(format!("{name}.key")))
            .arg(log)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the HTTPS server");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
            &mut line,
        )
        .expect("port");
        let port = line.trim().parse().expect("a port");
        Self { child, port }
    }
}

impl Drop for HttpsApiServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Over HTTPS the API server is trusted only with the configured CA: with the one that signed
/// its certificate the label is patched; with another CA nothing reaches the server, the
/// daemon warns and keeps serving.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_server_is_trusted_only_through_the_configured_ca() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put(KEYS[1], seed(KEYS[1], 0), 1000).await.expect("put");
    let dir = tempfile::tempdir().expect("tempdir");
    tokio::task::block_in_place(|| {
        certificates(dir.path(), "api");
        certificates(dir.path(), "other");
    });
    let log = dir.path().join("patches.log");
    let https = tokio::task::block_in_place(|| HttpsApiServer::start(dir.path(), "api", &log));
    let plan = dir.path().join("base.toml");
    std::fs::write(&plan, "targets = [\"models:base/\"]\n").expect("plan");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).expect("token");
    let url = format!("https://127.0.0.1:{}", https.port);
    for (ca, trusted) in [("api-ca.pem", true), ("other-ca.pem", false)] {
        let _ = std::fs::remove_file(&log);
        let run = dir.path().join(ca.trim_end_matches(".pem"));
        std::fs::create_dir(&run).expect("run dir");
        let ca = dir.path().join(ca).display().to_string();
        let (plan, token) = (plan.display().to_string(), token.display().to_string());
        let args = [
            "--node-id",
            NODE,
            "--warm-plan",
            &plan,
            "--warm-api-server",
            &url,
            "--warm-token-file",
            &token,
            "--warm-ca-file",
            &ca,
        ];
        let mut daemon = DaemonProcess::start(Path::new(BIN), &server, &run, &args).expect("daemon");
        let expected =
            format!("/api/v1/nodes/{NODE} {{\"metadata\":{{\"labels\":{{\"{LABEL}\":\"true\"}}}}}}");
        let started = std::time::Instant::now();
        let seen = loop {
            let patches = std::fs::read_to_string(&log).unwrap_or_default();
            if patches.lines().any(|l| l == expected)
                || started.elapsed() > Duration::from_secs(if trusted { 30 } else { 3 })
            {
                break patches;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let daemon_log = std::fs::read_to_string(run.join("daemon.log")).expect("log");
        if trusted {
            assert!(seen.lines().any(|l| l == expected), "{seen}\n{daemon_log}");
        } else {
            assert_eq!(seen, "", "a patch got through a server the CA does not vouch for");
            assert!(daemon_log.contains("cannot patch the node label"), "{daemon_log}");
            assert!(daemon.exited().expect("exited").is_none(), "the daemon stopped");
        }
        assert!(
            tokio::task::block_in_place(|| daemon.stop())
                .expect("stop")
                .success()
        );
    }
}

/// A plan the cache cannot hold: each prefetch is refused before any GET, the label stays
/// off, and the prefetches come further and further apart (here a check every 100 ms: without
/// the backoff a prefetch every check), so a node that cannot hold its plan does not pull it
/// from the origin over and over. The daemon's own log says when each prefetch was tried and
/// how long it means to wait before the next: the waits double, and each gap between two
/// tries is at least the wait announced between them.
#[tokio::test(flavor = "multi_thread")]
async fn a_plan_that_does_not_fit_is_tried_less_and_less_often() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put(KEYS[0], seed(KEYS[0], 0), 9 * MIB).await.expect("put");
    let api = ApiServer::start().await.expect("api server");
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("base.toml");
    std::fs::write(&plan, "targets = [\"models:base/\"]\n").expect("plan");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).expect("token");
    let (plan, token) = (plan.display().to_string(), token.display().to_string());
    let api_url = api.url();
    let args = [
        "--cache-capacity",
        "8MiB",
        "--node-id",
        NODE,
        "--warm-plan",
        &plan,
        "--warm-check-interval",
        "100ms",
        "--warm-api-server",
        &api_url,
        "--warm-token-file",
        &token,
    ];
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");
    const TRIED: &str = "cannot prefetch the warm plan";
    const RETRY: &str = "the warm plan is still incomplete after a prefetch";
    let started = std::time::Instant::now();
    let log = loop {
        let log = std::fs::read_to_string(dir.path().join("daemon.log")).expect("log");
        if log.matches(RETRY).count() >= 4 {
            break log;
        }
        assert!(started.elapsed() < WAIT, "fewer than 4 prefetches tried:\n{log}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let tries: Vec<_> = stamped(&log, TRIED).into_iter().map(|(at, _)| at).collect();
    let waits: Vec<Duration> = stamped(&log, RETRY)
        .into_iter()
        .map(|(_, line)| {
            let wait = line.split_once("retry_in=").expect("retry_in").1.trim();
            humantime::parse_duration(wait).unwrap_or_else(|e| panic!("{line}: {e}"))
        })
        .collect();
    assert_eq!(
        waits[..4],
        [100, 200, 400, 800].map(Duration::from_millis),
        "the waits after each try:\n{log}"
    );
    assert!(tries.len() >= 4, "{log}");
    for (i, pair) in tries.windows(2).take(3).enumerate() {
        let gap = pair[1].duration_since(pair[0]).expect("tries in order");
        // The log's clock is the wall clock: a few milliseconds' leeway for its adjustments.
        assert!(
            gap + Duration::from_millis(5) >= waits[i],
            "try {} came {gap:?} after the one before, which announced {:?}:\n{log}",
            i + 2,
            waits[i]
        );
    }
    api.wait_for(WAIT, removed)
        .await
        .expect("the label removed at start");
    assert!(
        !api.patches()
            .iter()
            .any(|p| p.label(LABEL) == Some(Some("true".into())))
    );
    drop(daemon);
}
