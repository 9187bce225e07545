//! End to end with a real Prometheus (Debian's `prometheus`, installed by `scripts/test`)
//! scraping a real daemon every second: the dashboard's hit-rate expression, read from
//! `deploy/grafana/larder.json` and evaluated by Prometheus over exactly the scrapes of a
//! read, says what a counting proxy in front of the origin saw: a cold read <= 2%, a warm
//! re-read >= 95%.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use larder_tests::daemon::DaemonProcess;
use larder_tests::{RecordingProxy, S3Server, content, free_port, seed};

const MIB: u64 = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");
const KEY: &str = "llama/prometheus.safetensors";
const SIZE: u64 = 64 * MIB;

/// A Prometheus server scraping one target every second, killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: larder\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .expect("config");
        let listen = format!(
            "127.0.0.1:{}",
            free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
        );
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={listen}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus (Debian package prometheus; scripts/test installs it)");
        Self {
            child,
            url: format!("http://{listen}"),
            _dir: dir,
        }
    }

    /// The value of the instant `query` at `time` (seconds since the epoch; now if `None`),
    /// if it has one.
    async fn query(&self, query: &str, time: Option<f64>) -> Option<f64> {
        let mut params = vec![("query", query.to_owned())];
        if let Some(time) = time {
            params.push(("time", format!("{time:.3}")));
        }
        let url = url::Url::parse_with_params(&format!("{}/api/v1/query", self.url), &params).ok()?;
        let response = reqwest::get(url).await.ok()?;
        let body: serde_json::Value = serde_json::from_str(&response.text().await.ok()?).ok()?;
        assert_eq!(body["status"], "success", "{query}: {body}");
        body["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    }

    /// The time of the newest scrape of the daemon that succeeded.
    async fn last_scrape(&self) -> Option<f64> {
        self.query("timestamp(larder_ready)", None).await
    }

    /// Waits for a scrape of the daemon later than `after` (seconds since the epoch) and
    /// returns its time.
    async fn scrape_after(&self, after: f64) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(time) = self.last_scrape().await
                && time > after
            {
                return time;
            }
            assert!(Instant::now() < deadline, "no scrape after {after} within 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

/// The dashboard's hit-rate expression over the range `seconds` long, for every instance.
fn dashboard_hit_rate(seconds: f64) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/larder.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("JSON");
    let panel = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .find(|p| p["title"] == "Hit rate (bytes)")
        .expect("the hit-rate panel");
    let expr = panel["targets"][0]["expr"].as_str().expect("expr");
    expr.replace("$instance", ".*")
        .replace("$__rate_interval", &format!("{}ms", (seconds * 1000.0).ceil()))
}

/// Reads the object through the mount in 1 MiB reads (the page cache dropped first) and
/// checks its bytes.
fn read_through(mount: &Path) {
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
    let mut file = std::fs::File::open(mount.join(KEY)).expect("open");
    let mut chunk = vec![0; MIB as usize];
    for offset in (0..SIZE).step_by(MIB as usize) {
        std::io::Read::read_exact(&mut file, &mut chunk).expect("read");
        assert!(
            chunk == content(seed(KEY, 0), offset, MIB as usize),
            "wrong bytes at {offset}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_evaluates_the_dashboards_hit_rate_as_the_origins_bytes_say() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    server.put(KEY, seed(KEY, 0), SIZE as usize).await.expect("put");
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = format!(
        "127.0.0.1:{}",
        free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
    );
    let args = ["--passthrough", "false", "--metrics-listen", metrics.as_str()];
    let daemon = DaemonProcess::start(Path::new(BIN), &proxy, dir.path(), &args).expect("daemon");
    let prometheus = Prometheus::start(&metrics);

    // Each read is measured between the newest scrape before it and the first one after it:
    // Prometheus's range takes both ends, the counters are flat outside the read.
    let mut measured = Vec::new();
    let mut mount = Some(daemon.mount.clone());
    for phase in ["cold", "warm"] {
        let before = prometheus.scrape_after(0.0).await;
        let origin_before = proxy.body_bytes();
        let path = mount.take().expect("mount");
        let path = tokio::task::spawn_blocking(move || {
            read_through(&path);
            path
        })
        .await
        .expect("read");
        mount = Some(path);
        let truth = 1.0 - (proxy.body_bytes() - origin_before) as f64 / SIZE as f64;
        let after = prometheus.scrape_after(now()).await;
        let shown = prometheus
            .query(&dashboard_hit_rate(after - before), Some(after))
            .await
            .expect("the hit rate has a value");
        println!("{phase}: the dashboard shows {shown:.4}, the origin's bytes say {truth:.4}");
        measured.push((shown, truth));
    }
    let [(cold, cold_truth), (warm, warm_truth)] = measured[..] else {
        unreachable!()
    };
    assert!(cold_truth <= 0.0, "the cold read was not wholly from the origin");
    assert!(
        cold <= 0.02,
        "the dashboard shows a cold read's hit rate as {cold}"
    );
    assert!(warm_truth > 0.999, "the warm read fetched from the origin");
    assert!(
        warm >= 0.95,
        "the dashboard shows a warm read's hit rate as {warm}"
    );
    drop(daemon);
}
