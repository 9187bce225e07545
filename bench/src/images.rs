//! `larder-bench images`: containerd pulls one multi-platform image straight from its registry
//! and through Larder's mirror, cold, warm and pre-pulled, side by side in each round.
//!
//! The registry is Debian's `docker-registry` on loopback, behind the recording proxy, which
//! counts the blob bytes the registry sends; containerd is started for the run on its own
//! socket. Each round:
//! - **direct**: containerd pulls from the registry itself, not through the proxy (the
//!   reference; its blob bytes are the platform's blobs by definition);
//! - **cold**: a daemon on a fresh cache dir, containerd pulls through it;
//! - **warm**: containerd's store emptied, the same daemon restarted, pulled again;
//! - **pre-pulled**: a daemon on a fresh cache dir runs `larder prefetch --wait image:...`
//!   (timed apart), then containerd's first pull through it.
//!
//! Every pull is of one platform (linux/amd64) and unpacks its layers; containerd's content
//! store is emptied before each. The report gives each pull's median time, its ratio to the
//! direct pull, and the registry's blob bytes per pull as a multiple of the platform's blobs.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use larder_tests::daemon::DaemonProcess;
use larder_tests::oci::{Containerd, Registry, TestImage, hosts_dir, is_blob_get, push};
use larder_tests::{Bucket, RecordingProxy, S3Server};
use tokio::runtime::Handle;

use crate::ImagesArgs;
use crate::common::{machine, summary};

/// The registry's name in the image reference.
const HOST: &str = "registry.bench.test";

/// The repository and tag of the image.
const REPO_TAG: &str = "bench/image:v1";

/// The platform pulled.
const PLATFORM: &str = "linux/amd64";

/// One kind of pull and what each round measured of it.
#[derive(Debug, Default)]
struct Row {
    seconds: Vec<f64>,
    upstream_bytes: Vec<u64>,
}

/// Runs the benchmark.
pub(crate) fn run(args: ImagesArgs, runtime: &Handle) -> anyhow::Result<()> {
    let larder = args
        .larder
        .canonicalize()
        .with_context(|| format!("{}", args.larder.display()))?;
    std::fs::create_dir_all(&args.work_dir)?;
    let work = tempfile::tempdir_in(&args.work_dir)?;
    eprintln!("writing the image ({} of layers per platform)", args.layers);
    let image = TestImage::write(7, args.layers.as_u64())?;
    let registry = Registry::start()?;
    push(image.path(), registry.address(), REPO_TAG, None)?;
    let proxy = runtime.block_on(RecordingProxy::start_to(registry.address()))?;
    let server = runtime.block_on(S3Server::start("bench-images"))?;
    let containerd = Containerd::start()?;
    let wanted = image.image(PLATFORM)?;
    let blob_bytes = wanted.layer_bytes() + wanted.config.size;
    let reference = format!("{HOST}/{REPO_TAG}");

    // The direct pull goes to the registry itself: the recording proxy would slow it.
    let direct_hosts = work.path().join("hosts-direct");
    hosts_dir(&direct_hosts, HOST, &registry.url(), &registry.url())?;
    let mut rows: Vec<(&str, Row)> = ["direct", "cold", "warm", "pre-pulled"]
        .into_iter()
        .map(|name| (name, Row::default()))
        .collect();
    let mut prefetch_seconds = Vec::new();
    for round in 0..args.rounds {
        eprintln!("round {}/{}", round + 1, args.rounds);
        let mut pull = |hosts: &Path, row: usize| -> anyhow::Result<()> {
            containerd.remove_all()?;
            let before = proxy.body_bytes_of(is_blob_get);
            let started = Instant::now();
            let output = containerd.pull(&reference, Some(hosts), Some(PLATFORM))?;
            let took = started.elapsed().as_secs_f64();
            if !output.status.success() {
                bail!("pull failed: {}", String::from_utf8_lossy(&output.stderr));
            }
            rows[row].1.seconds.push(took);
            // The direct pull bypasses the proxy: it takes every blob from the registry.
            let sent = match row {
                0 => blob_bytes,
                _ => proxy.body_bytes_of(is_blob_get) - before,
            };
            rows[row].1.upstream_bytes.push(sent);
            Ok(())
        };
        pull(&direct_hosts, 0)?;

        let (mut daemon, hosts) = start_daemon(
            &larder,
            &server,
            &proxy,
            &work.path().join(format!("cold-{round}")),
        )?;
        pull(&hosts, 1)?;
        daemon.restart()?;
        pull(&hosts, 2)?;
        drop(daemon);

        let (daemon, hosts) = start_daemon(
            &larder,
            &server,
            &proxy,
            &work.path().join(format!("pre-{round}")),
        )?;
        let started = Instant::now();
        let prefetch = daemon.process()?.larder(&[
            "prefetch",
            "--wait",
            "--platform",
            PLATFORM,
            &format!("image:{reference}"),
        ]);
        if !prefetch.status.success() {
            bail!("prefetch failed: {}", String::from_utf8_lossy(&prefetch.stderr));
        }
        prefetch_seconds.push(started.elapsed().as_secs_f64());
        pull(&hosts, 3)?;
    }
    containerd.remove_all()?;

    let report = report(&args, &rows, &prefetch_seconds, blob_bytes);
    print!("{report}");
    if let Some(out) = &args.out {
        std::fs::write(out, &report).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// A daemon mirroring the registry (through the proxy), its cache in `dir`.
struct Mirror<'a> {
    daemon: Option<DaemonProcess>,
    larder: PathBuf,
    dir: PathBuf,
    args: Vec<String>,
    server: &'a S3Server,
}

impl Mirror<'_> {
    fn process(&self) -> anyhow::Result<&DaemonProcess> {
        self.daemon.as_ref().context("the daemon is stopped")
    }

    /// Stops the daemon and starts it again on the same cache dir.
    fn restart(&mut self) -> anyhow::Result<()> {
        if let Some(daemon) = self.daemon.take() {
            daemon.stop()?;
        }
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.daemon = Some(DaemonProcess::start(&self.larder, self.server, &self.dir, &args)?);
        Ok(())
    }
}

/// A daemon on a fresh cache dir under `dir` mirroring the registry through `proxy`, and the
/// hosts dir that points containerd at it (the registry as the fallback).
fn start_daemon<'a>(
    larder: &Path,
    server: &'a S3Server,
    proxy: &RecordingProxy,
    dir: &Path,
) -> anyhow::Result<(Mirror<'a>, PathBuf)> {
    std::fs::create_dir_all(dir)?;
    let port = larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST)?;
    let address = format!("127.0.0.1:{port}");
    let args = vec![
        "--registry-listen".to_owned(),
        address.clone(),
        "--registry-upstream".to_owned(),
        format!("{HOST}={}", proxy.endpoint()),
    ];
    let mut mirror = Mirror {
        daemon: None,
        larder: larder.to_owned(),
        dir: dir.to_owned(),
        args,
        server,
    };
    mirror.restart()?;
    let hosts = dir.join("hosts");
    hosts_dir(&hosts, HOST, &format!("http://{address}"), &proxy.endpoint())?;
    Ok((mirror, hosts))
}

/// The report: one row per kind of pull.
fn report(args: &ImagesArgs, rows: &[(&str, Row)], prefetch: &[f64], blob_bytes: u64) -> String {
    let mut out = String::new();
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let _ = writeln!(out, "# Image pull benchmark\n");
    let _ = writeln!(out, "{date}; {}", machine());
    let _ = writeln!(
        out,
        "\ncontainerd pulls `{PLATFORM}` of a two-platform image ({} of layers per platform, {} \
         bytes of blobs for the platform pulled, {} rounds; unpacked each time) from Debian's \
         docker-registry on loopback, directly and through Larder's mirror (`{}`).\n",
        args.layers,
        blob_bytes,
        args.rounds,
        args.larder.display()
    );
    let _ = writeln!(
        out,
        "| pull | median s (min–max) | ÷ direct | upstream blob bytes per pull |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    let direct = summary(rows[0].1.seconds.clone()).0;
    for (name, row) in rows {
        let (median, min, max) = summary(row.seconds.clone());
        let bytes = summary(row.upstream_bytes.iter().map(|&b| b as f64).collect()).0;
        let _ = writeln!(
            out,
            "| {name} | {median:.2} ({min:.2}–{max:.2}) | {:.2}× | {:.2}× the blobs |",
            median / direct,
            bytes / blob_bytes as f64
        );
    }
    let (median, min, max) = summary(prefetch.to_vec());
    let _ = writeln!(
        out,
        "\n`larder prefetch --wait image:...` before the pre-pulled pull: {median:.2} s ({min:.2}–{max:.2})."
    );
    out
}
