//! End to end: the daemon's HTTP listeners (metrics over TCP, the control socket) keep
//! answering while clients hold idle connections open, and cut those clients off quickly.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use larder_tests::daemon::DaemonProcess;
use larder_tests::{S3Server, content, seed};

const BIN: &str = env!("CARGO_BIN_EXE_larder");

/// A port nobody listens on right now.
fn free_port() -> u16 {
    larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
}

/// `GET /metrics` with a deadline: the status code, or why there was none.
async fn scrape(address: &str, deadline: Duration) -> Result<u16, String> {
    let client = reqwest::Client::builder()
        .timeout(deadline)
        .build()
        .expect("client");
    let response = client
        .get(format!("http://{address}/metrics"))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    response.text().await.map_err(|e| e.to_string())?;
    Ok(status)
}

/// Idle TCP connections (connected, sending nothing) do not keep a scrape out, and each is
/// closed by the daemon within a couple of seconds.
#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_do_not_block_a_scrape() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let dir = tempfile::tempdir().expect("tempdir");
    let address = format!("127.0.0.1:{}", free_port());
    let daemon = DaemonProcess::start(
        Path::new(BIN),
        &server,
        dir.path(),
        &["--metrics-listen", &address],
    )
    .expect("daemon");

    let opened = Instant::now();
    let idle: Vec<std::net::TcpStream> = (0..32)
        .map(|_| std::net::TcpStream::connect(&address).expect("connect"))
        .collect();
    for round in 0..3 {
        let started = Instant::now();
        let answer = scrape(&address, Duration::from_secs(3)).await;
        assert_eq!(
            answer,
            Ok(200),
            "scrape {round} with 32 idle connections open, after {:?}",
            started.elapsed()
        );
    }

    // Every idle connection is closed by the daemon (EOF or reset), within 4 s of opening.
    let checks: Vec<_> = idle
        .into_iter()
        .map(|mut stream| {
            std::thread::spawn(move || {
                stream
                    .set_read_timeout(Some(Duration::from_secs(6)))
                    .expect("timeout");
                let mut byte = [0; 1];
                match stream.read(&mut byte) {
                    Ok(0) => Ok(()),
                    Ok(_) => Err("the daemon sent bytes to a client that asked nothing".to_owned()),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(()),
                    Err(e) => Err(format!("still open: {e}")),
                }
            })
        })
        .collect();
    for check in checks {
        check.join().expect("join").expect("an idle connection");
    }
    let closed_after = opened.elapsed();
    assert!(
        closed_after < Duration::from_secs(4),
        "idle connections were held {closed_after:?}"
    );
    drop(daemon);
}

/// Sets the daemon's limit of open files, as a node with a low `ulimit -n` would have it.
fn limit_open_files(pid: u32, limit: u64) {
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: prlimit on our own child's pid with a valid rlimit; the old value is not asked for.
    let done = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &rlimit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(done, 0, "prlimit: {}", std::io::Error::last_os_error());
}

fn open_files(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fds").count() as u64
}

/// Runs `larder ARGS` against the daemon, killed if it does not finish within `deadline`.
fn larder_within(daemon: &DaemonProcess, args: &[&str], deadline: Duration) -> Result<String, String> {
    let mut child = Command::new(BIN)
        .args(args)
        .env("LARDER_CONTROL_SOCKET", &daemon.socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run larder");
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut out = String::new();
            let mut err = String::new();
            child
                .stdout
                .take()
                .expect("stdout")
                .read_to_string(&mut out)
                .expect("stdout");
            child
                .stderr
                .take()
                .expect("stderr")
                .read_to_string(&mut err)
                .expect("stderr");
            return if status.success() {
                Ok(out)
            } else {
                Err(format!("{status}: {err}"))
            };
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("no answer within {deadline:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Hundreds of idle connections to the control socket, more than the daemon has file
/// descriptors to spare: `larder status` still answers, and reads through the mount still get
/// their blocks written to the cache (the daemon's own files are not starved).
#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_do_not_starve_the_control_socket() {
    const KEY: &str = "weights.bin";
    const SIZE: usize = 9 << 20;
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put(KEY, seed(KEY, 0), SIZE).await.expect("put");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let pid = daemon.pid().expect("pid");
    let spare = 200;
    limit_open_files(pid, open_files(pid) + spare);

    // More connections than the spare descriptors; a connect the daemon never takes from its
    // backlog ends the flood.
    let mut idle = Vec::new();
    for _ in 0..2 * spare {
        match tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::UnixStream::connect(&daemon.socket),
        )
        .await
        {
            Ok(Ok(stream)) => idle.push(stream),
            Ok(Err(_)) | Err(_) => break,
        }
    }
    assert!(!idle.is_empty(), "no connection was accepted at all");
    // No pause for the daemon to take the flood: the listener's backlog is first in, first
    // out, so the connection of the `status` below is accepted only once the daemon has
    // accepted every connection of the flood.

    let daemon = tokio::task::spawn_blocking(move || {
        let status = larder_within(&daemon, &["status", "--json"], Duration::from_secs(5))
            .expect("status with idle connections open");
        let status: serde_json::Value = serde_json::from_str(&status).expect("json");
        assert!(status["capacity_bytes"].as_u64().is_some(), "{status}");

        let bytes = std::fs::read(daemon.mount.join(KEY)).expect("read");
        assert!(bytes == content(seed(KEY, 0), 0, SIZE), "wrong bytes");
        daemon
    })
    .await
    .expect("checks");
    drop(idle);
    // The blocks of the read are written behind it: wait for them, then check no write failed.
    let status = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        loop {
            let status =
                larder_within(&daemon, &["status", "--json"], Duration::from_secs(5)).expect("status");
            let status: serde_json::Value = serde_json::from_str(&status).expect("json");
            if status["blocks"] == 3 || started.elapsed() > Duration::from_secs(10) {
                return status;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .expect("status");
    assert_eq!(status["cache_write_failures"], 0, "{status}");
    assert_eq!(status["blocks"], 3, "{status}");
}
