//! End to end: the Prometheus endpoint of `larder daemon` run as a process, scraped over HTTP
//! and parsed with a Prometheus text-format parser, after cold and warm reads through the mount.

use std::collections::HashMap;
use std::path::Path;

use larder_tests::daemon::DaemonProcess;
use larder_tests::{S3Server, content, seed};
use prometheus_parse::{Sample, Scrape, Value};

const MIB: u64 = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");
const CAPACITY: u64 = 64 * MIB;
const BLOCK: u64 = 4 * MIB;

/// At the top of the bucket: s3s-fs answers a HEAD of a key that is a directory on its disk
/// with a 500 (a real S3 says 404), which the daemon retries and counts as transient errors.
const OBJECTS: &[(&str, u64)] = &[
    ("model.safetensors", 21 * MIB + 5),
    ("config.json", 1000),
    ("shard-0.bin", 4 * MIB),
];

/// A port nobody listens on right now.
fn free_port() -> u16 {
    larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
}

/// One scrape, by metric name and labels.
struct Metrics {
    samples: Vec<Sample>,
    docs: HashMap<String, String>,
}

impl Metrics {
    async fn scrape(address: &str) -> Self {
        let response = reqwest::get(format!("http://{address}/metrics"))
            .await
            .expect("GET /metrics");
        assert_eq!(response.status(), 200);
        let content_type = response.headers()["content-type"]
            .to_str()
            .expect("ascii")
            .to_owned();
        assert!(
            content_type.starts_with("text/plain; version=0.0.4"),
            "{content_type}"
        );
        let text = response.text().await.expect("body");
        let scrape = Scrape::parse(text.lines().map(|line| Ok(line.to_owned()))).expect("parse");
        Self {
            samples: scrape.samples,
            docs: scrape.docs,
        }
    }

    /// The value of a counter or gauge sample with `label` (or with no labels when `None`).
    fn value(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        let sample = self
            .samples
            .iter()
            .find(|s| {
                s.metric == name
                    && match label {
                        Some((key, value)) => s.labels.get(key) == Some(value),
                        None => s.labels.is_empty(),
                    }
            })
            .unwrap_or_else(|| panic!("no sample {name} {label:?}"));
        match sample.value {
            Value::Counter(v) | Value::Gauge(v) => v,
            ref other => panic!("{name} is not a counter or gauge: {other:?}"),
        }
    }

    /// Observations in the histogram `name` with `label` (its `+Inf` bucket).
    fn observations(&self, name: &str, label: (&str, &str)) -> f64 {
        let sample = self
            .samples
            .iter()
            .find(|s| s.metric == name && s.labels.get(label.0) == Some(label.1))
            .unwrap_or_else(|| panic!("no histogram {name} {label:?}"));
        let Value::Histogram(buckets) = &sample.value else {
            panic!("{name} is not a histogram");
        };
        buckets
            .iter()
            .find(|b| b.less_than == f64::INFINITY)
            .map(|b| b.count)
            .expect("+Inf bucket")
    }

    fn read_bytes(&self, source: &str) -> f64 {
        self.value("larder_read_bytes_total", Some(("source", source)))
    }
}

/// Reads every object once through the mount and checks its bytes; returns the bytes read.
async fn read_all(daemon: &DaemonProcess) -> u64 {
    let mount = daemon.mount.clone();
    tokio::task::spawn_blocking(move || {
        let mut total = 0;
        for &(key, size) in OBJECTS {
            let bytes = std::fs::read(mount.join(key)).expect("read");
            assert!(
                bytes == content(seed(key, 0), 0, size as usize),
                "{key}: wrong bytes"
            );
            total += bytes.len() as u64;
        }
        total
    })
    .await
    .expect("join")
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_the_bytes_read_cold_and_warm() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for &(key, size) in OBJECTS {
        server.put(key, seed(key, 0), size as usize).await.expect("put");
    }
    let total: u64 = OBJECTS.iter().map(|(_, size)| size).sum();
    let blocks: u64 = OBJECTS.iter().map(|(_, size)| size.div_ceil(BLOCK)).sum();
    let dir = tempfile::tempdir().expect("tempdir");
    let address = format!("127.0.0.1:{}", free_port());
    let args = ["--metrics-listen", &address, "--cache-capacity", "64MiB"];

    // Cold: a new daemon, a new mount, so an empty page cache; each file is read once, so each
    // byte reaches the daemon once, but for a few pages the kernel may drop after reading them
    // ahead and ask for again. Everything came from the origin for this open.
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");
    assert_eq!(read_all(&daemon).await, total);
    let cold = Metrics::scrape(&address).await;
    let served = cold.read_bytes("nvme") + cold.read_bytes("origin");
    assert!(
        served >= total as f64 && served <= total as f64 * 1.01,
        "{served} of {total}"
    );
    assert_eq!(cold.read_bytes("nvme"), 0.0);
    assert!(cold.value("larder_origin_bytes_total", None) >= cold.read_bytes("origin"));
    assert!(cold.value("larder_origin_requests_total", Some(("kind", "get"))) > 0.0);
    assert!(cold.value("larder_block_lookups_total", Some(("result", "miss"))) > 0.0);
    // The readahead of the sequential reads fetched blocks before they were asked for.
    assert!(cold.value("larder_readahead_blocks_total", None) > 0.0);
    assert_eq!(cold.value("larder_passthrough_opens_total", None), 0.0);
    assert!(cold.observations("larder_fill_duration_seconds", ("source", "origin")) > 0.0);
    assert!(cold.observations("larder_fuse_request_duration_seconds", ("op", "read")) > 0.0);
    assert!(cold.observations("larder_fuse_request_duration_seconds", ("op", "lookup")) > 0.0);
    assert_eq!(cold.value("larder_cache_capacity_bytes", None), CAPACITY as f64);
    assert_eq!(cold.value("larder_origin_retries_total", None), 0.0);
    // Peers are off: their series are there, at zero.
    assert_eq!(cold.read_bytes("peer"), 0.0);
    for result in [
        "hit",
        "filled",
        "miss",
        "refused",
        "timeout",
        "unauthorized",
        "bad_data",
    ] {
        assert_eq!(
            cold.value("larder_peer_requests_total", Some(("result", result))),
            0.0,
            "{result}"
        );
    }
    for state in ["self", "up", "down", "unknown"] {
        assert_eq!(cold.value("larder_peer_members", Some(("state", state))), 0.0);
    }
    assert_eq!(
        cold.observations("larder_fill_duration_seconds", ("source", "peer")),
        0.0
    );
    for kind in ["not_found", "permission", "version_changed", "transient", "other"] {
        assert_eq!(
            cold.value("larder_origin_errors_total", Some(("kind", kind))),
            0.0,
            "{kind}"
        );
    }
    // Every family has its HELP text.
    for name in [
        "larder_read_bytes_total",
        "larder_block_lookups_total",
        "larder_cache_bytes",
        "larder_cache_capacity_bytes",
        "larder_fill_duration_seconds",
        "larder_fuse_request_duration_seconds",
        "larder_prefetch_planned_bytes_total",
        "larder_passthrough_open_bytes_total",
        "larder_peer_requests_total",
        "larder_peer_fetched_bytes_total",
        "larder_peer_sent_bytes_total",
        "larder_peer_refused_requests_total",
        "larder_peer_members",
    ] {
        assert!(cold.docs.contains_key(name), "no HELP for {name}");
    }
    let status = tokio::task::spawn_blocking(move || daemon.stop())
        .await
        .expect("join")
        .expect("stop");
    assert!(status.success(), "exit status {status}");

    // Warm: the restarted daemon serves every byte from its block store.
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("restart");
    let before = Metrics::scrape(&address).await;
    assert_eq!(before.value("larder_cache_blocks", None), blocks as f64);
    assert_eq!(before.value("larder_cache_objects", None), OBJECTS.len() as f64);
    assert!(before.value("larder_cache_bytes", None) >= total as f64);
    assert_eq!(read_all(&daemon).await, total);
    let warm = Metrics::scrape(&address).await;
    assert_eq!(warm.read_bytes("nvme"), total as f64);
    assert_eq!(warm.read_bytes("origin"), 0.0);
    assert_eq!(warm.value("larder_origin_bytes_total", None), 0.0);
    assert_eq!(
        warm.value("larder_origin_requests_total", Some(("kind", "get"))),
        0.0
    );
    assert_eq!(
        warm.value("larder_block_lookups_total", Some(("result", "miss"))),
        0.0
    );
    assert!(warm.value("larder_block_lookups_total", Some(("result", "hit"))) >= blocks as f64);
    assert!(warm.observations("larder_fill_duration_seconds", ("source", "nvme")) >= blocks as f64);
    assert_eq!(
        warm.observations("larder_fill_duration_seconds", ("source", "origin")),
        0.0
    );
    assert_eq!(warm.value("larder_cache_capacity_bytes", None), CAPACITY as f64);

    // Only GET (and HEAD) of /metrics is served.
    let client = reqwest::Client::new();
    let url = format!("http://{address}");
    let status =
        |request: reqwest::RequestBuilder| async move { request.send().await.expect("send").status() };
    assert_eq!(status(client.get(format!("{url}/"))).await, 404);
    assert_eq!(status(client.get(format!("{url}/metrics/x"))).await, 404);
    assert_eq!(status(client.post(format!("{url}/metrics"))).await, 405);
    assert_eq!(status(client.head(format!("{url}/metrics"))).await, 200);
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_address_in_use_stops_the_daemon_with_a_clear_error() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("addr").to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let err = DaemonProcess::start(
        Path::new(BIN),
        &server,
        dir.path(),
        &["--metrics-listen", &address],
    )
    .expect_err("the daemon started on a taken port");
    let text = format!("{err:#}");
    assert!(
        text.contains(&format!("cannot listen for metrics on {address}")),
        "{text}"
    );
    // Said once: the message quotes its cause, which the line does not repeat after it.
    let said = text.matches("Address already in use").count();
    assert_eq!(said, 1, "the cause repeated: {text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_off_serves_nothing() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put("a", seed("a", 0), 10).await.expect("put");
    // The variable names a port; the flag turns the endpoint off, and wins.
    let address = format!("127.0.0.1:{}", free_port());
    let env = [("LARDER_METRICS_LISTEN", address.as_str())];
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start_with_env(
        Path::new(BIN),
        &server,
        dir.path(),
        &["--metrics-listen", "off"],
        &env,
    )
    .expect("daemon");
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).expect("log");
    assert!(!log.contains("serving metrics"), "{log}");
    let refused = std::net::TcpStream::connect(&address);
    assert!(
        refused.is_err(),
        "something answers on {address} with metrics off"
    );
    drop(daemon);

    // The same variable without the flag: that port serves the metrics.
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon =
        DaemonProcess::start_with_env(Path::new(BIN), &server, dir.path(), &[], &env).expect("daemon");
    let metrics = Metrics::scrape(&address).await;
    assert!(metrics.value("larder_cache_capacity_bytes", None) > 0.0);
    drop(daemon);
}

/// A daemon given static members lists them in `larder status` (text and JSON), this node
/// first, and counts them by state in the metrics, with no member id or address in a label.
#[tokio::test(flavor = "multi_thread")]
async fn static_peers_show_in_status_and_metrics() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let dir = tempfile::tempdir().expect("tempdir");
    let address = format!("127.0.0.1:{}", free_port());
    let args = [
        "--metrics-listen",
        &address,
        "--node-id",
        "node-a",
        "--rack",
        "r1",
        "--peers",
        "node-a=127.0.0.1:7001@r1,node-b=127.0.0.2:7001@r1,node-c=127.0.0.3:7001@r2",
    ];
    // Peers without a cluster key: refused at start, saying what to give.
    let refused = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect_err("no key");
    assert!(refused.to_string().contains("need a cluster key"), "{refused}");
    let args: Vec<&str> = args.iter().copied().chain(["--peer-insecure"]).collect();
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");

    let status = daemon.status();
    let peers = &status["peers"];
    assert_eq!(peers["node_id"], "node-a", "{status}");
    assert_eq!(peers["rack"], "r1", "{status}");
    let members = peers["members"].as_array().expect("members");
    let listed: Vec<_> = members
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        listed,
        [("node-a", "self"), ("node-b", "unknown"), ("node-c", "unknown")]
    );
    assert_eq!(members[2]["address"], "127.0.0.3:7001");
    assert_eq!(members[2]["rack"], "r2");
    assert_eq!(members[2]["received_bytes"], 0);
    assert_eq!(members[2]["failures"], 0);

    let text = daemon.larder(&["status"]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("peers: this node is node-a in rack r1; 2 other members"),
        "{text}"
    );
    assert!(
        text.contains("peer node-c (rack r2, 127.0.0.3:7001): unknown, 0 failures in a row"),
        "{text}"
    );

    let metrics = Metrics::scrape(&address).await;
    assert_eq!(metrics.value("larder_peer_members", Some(("state", "self"))), 1.0);
    assert_eq!(
        metrics.value("larder_peer_members", Some(("state", "unknown"))),
        2.0
    );
    assert_eq!(metrics.value("larder_peer_members", Some(("state", "down"))), 0.0);
    assert!(metrics.samples.iter().all(|s| {
        s.labels
            .values()
            .all(|v| !v.contains("node-") && !v.contains("127.0.0."))
    }));
    let status = tokio::task::spawn_blocking(move || daemon.stop())
        .await
        .expect("join")
        .expect("stop");
    assert!(status.success(), "exit status {status}");
}

/// The health checks on the metrics listener: `/healthz` and `/readyz` answer 200 while the
/// daemon serves its mount; once the cache dir is deleted under it (noticed at the next cache
/// write), `/readyz` answers 503 with the reason while `/healthz` stays 200 (the process is
/// alive and still serves reads from the origin).
#[tokio::test(flavor = "multi_thread")]
async fn readyz_is_ready_while_mounted_and_not_once_the_cache_dir_is_lost() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    for &(key, size) in OBJECTS {
        server.put(key, seed(key, 0), size as usize).await.expect("put");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let address = format!("127.0.0.1:{}", free_port());
    let daemon = DaemonProcess::start(
        Path::new(BIN),
        &server,
        dir.path(),
        &["--metrics-listen", &address],
    )
    .expect("daemon");
    let get = |path: &'static str| {
        let url = format!("http://{address}{path}");
        async move {
            let response = reqwest::get(url).await.expect("GET");
            let status = response.status().as_u16();
            (status, response.text().await.expect("body"))
        }
    };
    assert_eq!(get("/healthz").await, (200, "ok\n".into()));
    assert_eq!(get("/readyz").await, (200, "ready\n".into()));
    assert_eq!(Metrics::scrape(&address).await.value("larder_ready", None), 1.0);

    let (mount, cache) = (daemon.mount.clone(), daemon.cache.clone());
    tokio::task::spawn_blocking(move || {
        std::fs::remove_dir_all(&cache).expect("delete the cache dir");
        let (key, size) = OBJECTS[0];
        let bytes = std::fs::read(mount.join(key)).expect("read");
        assert!(bytes == content(seed(key, 0), 0, size as usize), "wrong bytes");
    })
    .await
    .expect("join");
    let (status, body) = get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.starts_with("not ready: the cache dir was lost"), "{body}");
    let metrics = Metrics::scrape(&address).await;
    assert_eq!(metrics.value("larder_ready", None), 0.0);
    assert_eq!(metrics.value("larder_cache_dir_lost", None), 1.0);
    assert_eq!(get("/healthz").await, (200, "ok\n".into()));
    drop(daemon);
}

/// What the daemon served, by source, since start: (nvme, origin, peer) bytes and its hit
/// rate, as `larder status --json` says.
fn served_by_source(daemon: &DaemonProcess) -> ([u64; 3], f64) {
    let status = daemon.status();
    let served = &status["served"];
    let bytes = ["nvme_bytes", "origin_bytes", "peer_bytes"].map(|k| served[k].as_u64().expect(k));
    (bytes, served["hit_rate"].as_f64().unwrap_or(0.0))
}

/// The hit rate the daemon shows against the ground truth, the bytes a counting proxy in front
/// of the origin sent: a cold read (`--passthrough false`, 1 MiB reads through the kernel) came
/// wholly from the origin and shows at most 2%; a warm re-read and a read after a restart came
/// from the cache and show at least 95%. Before, the blocks readahead fetched from the origin
/// counted as hits when the reader got to them on disk: the cold read showed ~10%.
#[tokio::test(flavor = "multi_thread")]
async fn the_hit_rate_follows_the_bytes_the_origin_sent() {
    const KEY: &str = "llama/hit-rate.safetensors";
    let size = 128 * MIB;
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put(KEY, seed(KEY, 0), size as usize).await.expect("put");
    let proxy = larder_tests::RecordingProxy::start(&server).await.expect("proxy");
    let dir = tempfile::tempdir().expect("tempdir");
    let args = ["--passthrough", "false"];
    tokio::task::spawn_blocking(move || {
        let read = |daemon: &DaemonProcess| {
            std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
            let (before, _) = served_by_source(daemon);
            let origin_before = proxy.body_bytes();
            let mut file = std::fs::File::open(daemon.mount.join(KEY)).expect("open");
            let mut chunk = vec![0; MIB as usize];
            let mut offset = 0;
            while offset < size {
                std::io::Read::read_exact(&mut file, &mut chunk).expect("read");
                assert!(
                    chunk == content(seed(KEY, 0), offset, MIB as usize),
                    "wrong bytes at {offset}"
                );
                offset += MIB;
            }
            let (after, since_start) = served_by_source(daemon);
            let [nvme, origin, peer] = [0, 1, 2].map(|i| (after[i] - before[i]) as f64);
            let shown = nvme / (nvme + origin + peer);
            let truth = 1.0 - (proxy.body_bytes() - origin_before) as f64 / size as f64;
            println!(
                "hit rate shown {shown:.3} (since start {since_start:.3}), by the origin's bytes {truth:.3}"
            );
            (shown, since_start, truth)
        };
        let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("daemon");
        let (shown, since_start, truth) = read(&daemon);
        assert!(
            truth <= 0.0,
            "the cold read was not wholly from the origin ({truth})"
        );
        assert!(
            shown <= 0.02 && since_start <= 0.02,
            "a cold read shows a hit rate of {shown}"
        );
        let (shown, _, truth) = read(&daemon);
        // A listing's or HEAD's body may pass the proxy: no block did.
        assert!(truth > 0.999, "the warm read fetched from the origin ({truth})");
        assert!(shown >= 0.95, "a warm re-read shows a hit rate of {shown}");
        daemon.stop().expect("stop");
        let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("restart");
        let (shown, since_start, truth) = read(&daemon);
        assert!(
            truth > 0.999,
            "the read after a restart fetched from the origin ({truth})"
        );
        assert!(
            shown >= 0.95 && since_start >= 0.95,
            "after a restart the hit rate shows {shown}"
        );
    })
    .await
    .expect("checks");
}

/// The figures every exporter has, against what the kernel says of the daemon's process (its
/// `/proc/<pid>`) and what the test saw: the start time within the seconds the start took,
/// the open descriptors within a few (the scrape's own connection comes and goes), the
/// descriptor limit exactly, resident memory within a factor of two, the CPU time between what
/// /proc said before the scrape and after it; and the build's version and commit.
#[tokio::test(flavor = "multi_thread")]
async fn process_figures_agree_with_proc_and_build_info_names_the_commit() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let dir = tempfile::tempdir().expect("tempdir");
    let address = format!("127.0.0.1:{}", free_port());
    let before = std::time::SystemTime::now();
    let args = ["--metrics-listen", address.as_str()];
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &args).expect("daemon");
    let after = std::time::SystemTime::now();
    let pid = daemon.pid().expect("pid");
    let proc = |file: &str| std::fs::read_to_string(format!("/proc/{pid}/{file}")).expect(file);
    // CPU seconds by /proc/<pid>/stat (user and system ticks, fields 14 and 15).
    let cpu = || {
        let stat = proc("stat");
        let fields: Vec<&str> = stat[stat.rfind(')').expect(")") + 1..]
            .split_whitespace()
            .collect();
        let ticks: u64 =
            fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
        ticks as f64 / rustix::param::clock_ticks_per_second() as f64
    };
    let cpu_before = cpu();
    let metrics = Metrics::scrape(&address).await;
    let cpu_after = cpu();

    let epoch = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let started = metrics.value("process_start_time_seconds", None);
    // The kernel counts the start in clock ticks: allow one second either side.
    assert!(
        started >= epoch(before) - 1.0 && started <= epoch(after) + 1.0,
        "started {started}, launched between {} and {}",
        epoch(before),
        epoch(after)
    );
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fd").count() as f64;
    let open = metrics.value("process_open_fds", None);
    assert!((open - fds).abs() <= 4.0, "{open} open, /proc lists {fds}");
    let limit: f64 = proc("limits")
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .expect("the soft limit");
    assert_eq!(metrics.value("process_max_fds", None), limit);
    let rss_kib: f64 = proc("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .expect("VmRSS");
    let resident = metrics.value("process_resident_memory_bytes", None);
    let ratio = resident / (rss_kib * 1024.0);
    assert!(
        (0.5..=2.0).contains(&ratio),
        "{resident} resident, /proc says {rss_kib} KiB"
    );
    let seconds = metrics.value("process_cpu_seconds_total", None);
    assert!(
        (cpu_before..=cpu_after).contains(&seconds),
        "{seconds} CPU seconds, /proc said {cpu_before} before the scrape and {cpu_after} after"
    );
    assert!(metrics.value("process_virtual_memory_bytes", None) >= resident);

    let build = metrics
        .samples
        .iter()
        .find(|s| s.metric == "larder_build_info")
        .expect("larder_build_info");
    assert_eq!(build.labels.get("version"), Some(env!("CARGO_PKG_VERSION")));
    let git = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    let revision = build.labels.get("revision").expect("revision");
    assert_eq!(revision, git.as_deref().unwrap_or("unknown"));
    assert!(
        matches!(build.value, Value::Gauge(v) if v == 1.0),
        "{:?}",
        build.value
    );
}
