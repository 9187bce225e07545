//! Credentials in a source URL (a user and password, a signed query) never show: not in the
//! daemon's log at its most verbose, not in `larder status` (text or JSON), not in the
//! metrics, not in the errors that stop it at start.

use std::path::Path;
use std::process::Command;

use larder_tests::daemon::DaemonProcess;
use larder_tests::{S3Server, seed};

const BIN: &str = env!("CARGO_BIN_EXE_larder");

/// The secrets the URLs below carry; none may show anywhere.
const SECRETS: &[&str] = &[
    "alice",
    "PW-one",
    "SIG-one",
    "bob",
    "PW-two",
    "SIG-two",
    "TOKEN-two",
    "carol",
    "PW-three",
    "SIG-three",
];

/// A port nobody listens on right now.
fn free_port() -> u16 {
    larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in SECRETS {
        assert!(!text.contains(secret), "{what} shows {secret:?}:\n{text}");
    }
}

/// Two S3 sources that work (one from `--source`, one from `LARDER_SOURCES`) and an http
/// source that fails, all with credentials in their URLs; the daemon logs at trace, serves
/// two, fails on the other, and shows none of the secrets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_source_urls_never_show() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put("a.bin", seed("a.bin", 0), 1 << 20).await.expect("put");
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = format!("127.0.0.1:{}", free_port());
    // The harness's own source `models` is replaced by the same bucket with credentials in
    // its URL (which S3 ignores); `web` reaches the S3 server as a plain http origin, which
    // refuses it.
    let models = "models=s3://alice:PW-one@larder-test?sig=SIG-one";
    let web = format!(
        "web=http://bob:PW-two@{}/larder-test?X-Amz-Signature=SIG-two&token=TOKEN-two",
        server.endpoint().trim_start_matches("http://")
    );
    let extra = ["--source", models, "--source", &web, "--metrics-listen", &metrics];
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let log_path = dir.path().join("daemon.log");
    let (status, json, scrape, log) = tokio::task::spawn_blocking(move || {
        let daemon = DaemonProcess::start_with_env(
            Path::new(BIN),
            &server,
            dir.path(),
            &extra.iter().map(String::as_str).collect::<Vec<_>>(),
            &[
                ("LARDER_LOG", "trace"),
                (
                    "LARDER_SOURCES",
                    "env=s3://carol:PW-three@larder-test?sig=SIG-three",
                ),
            ],
        )
        .expect("daemon");
        // The working sources serve; the other fails, and its failure is logged.
        for source in ["models", "env"] {
            let bytes = std::fs::read(daemon.mount.join(source).join("a.bin")).expect("read");
            assert_eq!(bytes.len(), 1 << 20);
        }
        assert!(std::fs::read(daemon.mount.join("web/a.bin")).is_err());
        assert!(
            std::fs::read_dir(daemon.mount.join("web"))
                .and_then(|d| d.collect::<Result<Vec<_>, _>>())
                .is_err()
        );
        // A prefetch of the failing source reports its error.
        let prefetch = Command::new(BIN)
            .args(["prefetch", "--wait", "web:a.bin"])
            .env("LARDER_CONTROL_SOCKET", &daemon.socket)
            .output()
            .expect("run larder");
        assert!(!prefetch.status.success());
        assert_no_secret("larder prefetch", &String::from_utf8_lossy(&prefetch.stderr));
        assert_no_secret("larder prefetch", &String::from_utf8_lossy(&prefetch.stdout));
        let status = |json: bool| {
            let output = Command::new(BIN)
                .arg("status")
                .args(json.then_some("--json"))
                .env("LARDER_CONTROL_SOCKET", &daemon.socket)
                .output()
                .expect("run larder");
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            String::from_utf8(output.stdout).expect("utf-8")
        };
        let texts = (status(false), status(true), scrape(&metrics));
        daemon.stop().expect("stop");
        let log = std::fs::read_to_string(&log_path).expect("log");
        (texts.0, texts.1, texts.2, log)
    })
    .await
    .expect("join");
    // What is shown instead: the URLs with their secrets hidden.
    assert!(
        status.contains("models = s3://***@larder-test?sig=***"),
        "{status}"
    );
    assert!(status.contains("env = s3://***@larder-test?sig=***"), "{status}");
    assert!(json.contains("X-Amz-Signature=***&token=***"), "{json}");
    assert_no_secret("larder status", &status);
    assert_no_secret("larder status --json", &json);
    assert!(
        log.lines().count() > 100 && log.contains("TRACE"),
        "not a trace log:\n{log}"
    );
    assert_no_secret("the daemon's log", &log);
    assert!(scrape.contains("larder_origin_requests_total"), "{scrape}");
    assert_no_secret("/metrics", &scrape);
}

/// `GET /metrics` over plain HTTP/1.0, the body and headers as text.
fn scrape(address: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).expect("connect");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: larder\r\n\r\n")
        .expect("request");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("response");
    text
}

/// A source the daemon refuses at start is named in the error without its secrets: one the
/// configuration rejects, and one the object store cannot be built for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_source_url_is_named_without_its_secrets() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for source in [
        "bad=ftp://alice:PW-one@host/x?sig=SIG-one",
        "bad=https://bob:PW-two/with-slash@host/x?token=TOKEN-two",
        "bad=az://alice:PW-one@container?sig=SIG-one",
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let error = tokio::task::block_in_place(|| {
            DaemonProcess::start_with_env(
                Path::new(BIN),
                &server,
                dir.path(),
                &["--source", source],
                &[("LARDER_LOG", "trace")],
            )
            .map(drop)
            .expect_err("started")
        });
        let text = format!("{error:#}");
        assert!(text.contains("***@"), "the URL is not named: {text}");
        assert_no_secret("the error at start", &text);
    }
}

/// A server that refuses every request with 401 and echoes it in the body, request line and
/// headers (some WebDAV servers and proxies do): its address. Runs until the test ends.
fn echoing_server() -> String {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address").to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(&stream);
                loop {
                    let mut head = String::new();
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        head.push_str(&line);
                    }
                    let body = format!("401 Unauthorized. Your request was:\n{head}");
                    let answer = format!(
                        "HTTP/1.1 401 Unauthorized\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if (&stream).write_all(answer.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    address
}

/// A source whose server echoes the refused request in its 401 body: the URL's query secret
/// and the Basic credentials (base64) are in the text of the error, outside any URL. They show
/// neither in `larder prefetch`'s or `larder seal`'s errors nor in the daemon's debug log.
/// Before, both came out whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_a_server_echoes_in_its_error_never_show() {
    use base64::Engine as _;
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let dir = tempfile::tempdir().expect("tempdir");
    let echo = echoing_server();
    let web = format!("web=http://echo-user:Echoed-Pass-1@{echo}/data?auth=Echoed-Query-2");
    let basic = base64::engine::general_purpose::STANDARD.encode("echo-user:Echoed-Pass-1");
    let log_path = dir.path().join("daemon.log");
    tokio::task::spawn_blocking(move || {
        let daemon = DaemonProcess::start_with_env(
            Path::new(BIN),
            &server,
            dir.path(),
            &["--source", &web],
            &[("LARDER_LOG", "trace")],
        )
        .expect("daemon");
        let mut shown = Vec::new();
        for args in [
            &["prefetch", "--wait", "web:model.bin"][..],
            &["prefetch", "--wait", "web:"],
            &["seal", "--wait", "web:"],
        ] {
            let output = daemon.larder(args);
            let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
            assert!(!output.status.success(), "larder {args:?} succeeded: {stderr}");
            assert!(
                stderr.contains("401") || stderr.contains("ermission"),
                "larder {args:?}: {stderr}"
            );
            shown.push((format!("larder {args:?}"), stderr));
        }
        daemon.stop().expect("stop");
        let log = std::fs::read_to_string(&log_path).expect("log");
        shown.push(("the daemon's log".to_owned(), log));
        assert!(
            shown.iter().any(|(_, text)| text.contains("Your request was")),
            "the echo was never shown: the test proves nothing\n{shown:#?}"
        );
        for (what, text) in shown {
            let secrets = ["Echoed-Pass-1", "Echoed-Query-2", basic.as_str()];
            for secret in secrets {
                assert!(!text.contains(secret), "{what} shows {secret:?}:\n{text}");
            }
        }
    })
    .await
    .expect("checks");
}
