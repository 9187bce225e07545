//! `larder-bench images`: containerd pulls one multi-platform image straight from its registry
//! and through Larder's mirror, cold, warm and pre-pulled, side by side in each round.
//!
//! The registry is Debian's `docker-registry` on loopback; the blob bytes it sends are read
//! from its own access log, so nothing but the mirror stands between it and containerd (an
//! in-path counting proxy would copy every byte of the mirrored pulls only). containerd is
//! started for the run on its own socket. Each round:
//! - **direct**: containerd pulls from the registry itself (the reference);
//! - **cold**: a daemon on a fresh cache dir, containerd pulls through it;
//! - **warm**: containerd's store emptied, the same daemon restarted, pulled again;
//! - **pre-pulled**: a daemon on a fresh cache dir runs `larder prefetch --wait image:...`
//!   (timed apart), then containerd's first pull through it.
//!
//! Every pull is of one platform (linux/amd64) and unpacks its layers; containerd's content
//! store is emptied before each. The report gives each pull's median time, its ratio to the
//! direct pull, and the registry's blob bytes per pull as a multiple of the platform's blobs;
//! and the mirror's disk reads per pull (`read_bytes` of its `/proc/PID/io`), with its binary
//! read back into the page cache after the cache is dropped, so that its code pages are not
//! counted as reads of the cache.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use larder_tests::S3Server;
use larder_tests::daemon::DaemonProcess;
use larder_tests::oci::{Containerd, Registry, TestImage, hosts_dir, push};
use tokio::runtime::Handle;

use crate::ImagesArgs;
use crate::common::{drop_page_cache, machine, process_cpu, publish, summary, utc_now};

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
    /// Each round's time over that round's direct pull.
    ratios: Vec<f64>,
    upstream_bytes: Vec<u64>,
    /// CPU seconds the daemon used during the pull (none for a direct pull).
    mirror_cpu: Vec<f64>,
    /// Bytes the daemon read from its disk during the pull (`/proc/PID/io`).
    mirror_reads: Vec<u64>,
}

/// What one pull took.
struct Pulled {
    seconds: f64,
    upstream_bytes: u64,
    /// The daemon's CPU seconds and disk reads (none for a direct pull).
    cpu: f64,
    reads: u64,
}

/// The kinds of pull, in the order of the report.
const PULLS: [&str; 4] = ["direct", "cold", "warm", "pre-pulled"];

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
    let server = runtime.block_on(S3Server::start("bench-images"))?;
    let containerd = Containerd::start()?;
    let wanted = image.image(PLATFORM)?;
    let blob_bytes = wanted.layer_bytes() + wanted.config.size;
    let reference = format!("{HOST}/{REPO_TAG}");

    let direct_hosts = work.path().join("hosts-direct");
    hosts_dir(&direct_hosts, HOST, &registry.url(), &registry.url())?;
    let mut rows: Vec<Row> = PULLS.iter().map(|_| Row::default()).collect();
    let mut prefetch_seconds = Vec::new();
    let mut dropped = true;
    for round in 0..args.rounds {
        eprintln!("round {}/{}", round + 1, args.rounds);
        // Every pull starts alike: containerd's store empty, no dirty pages of the last pull
        // left to write back, nothing in the page cache.
        let mut pull = |hosts: &Path, mirror: Option<&Mirror>| -> anyhow::Result<Pulled> {
            containerd.remove_all()?;
            // SAFETY: sync takes no arguments and cannot fail.
            unsafe { libc::sync() };
            dropped &= drop_page_cache();
            // The daemon's binary back in the page cache: its code pages, faulted in from disk
            // as the pull runs code for the first time, would count as the mirror's disk reads
            // (4 to 9 MB a pull, a third of the blobs of a 16 MiB smoke run). Only the cache's
            // own reads are wanted.
            if mirror.is_some() {
                std::fs::read(&larder).with_context(|| format!("{}", larder.display()))?;
            }
            let daemon = mirror.and_then(|m| m.process().ok());
            let cpu = || daemon.and_then(|d| process_cpu(d.pid()?)).unwrap_or(0.0);
            let reads = || daemon.and_then(|d| d.disk_read_bytes().ok()).unwrap_or(0);
            let (bytes, cpu_before, reads_before) = (registry.blob_bytes_sent()?, cpu(), reads());
            let started = Instant::now();
            let output = containerd.pull(&reference, Some(hosts), Some(PLATFORM))?;
            let took = started.elapsed().as_secs_f64();
            if !output.status.success() {
                bail!("pull failed: {}", String::from_utf8_lossy(&output.stderr));
            }
            Ok(Pulled {
                seconds: took,
                upstream_bytes: registry.blob_bytes_sent()? - bytes,
                cpu: cpu() - cpu_before,
                reads: reads() - reads_before,
            })
        };
        // Direct pulls open and close the round; the others are compared with their mean.
        let mut round_pulls = vec![pull(&direct_hosts, None)?];

        let cold_dir = work.path().join(format!("cold-{round}"));
        let (mut daemon, hosts) = start_daemon(&larder, &server, &registry, &cold_dir)?;
        round_pulls.push(pull(&hosts, Some(&daemon))?);
        daemon.restart()?;
        round_pulls.push(pull(&hosts, Some(&daemon))?);
        drop(daemon);
        std::fs::remove_dir_all(&cold_dir)?;

        let pre_dir = work.path().join(format!("pre-{round}"));
        let (daemon, hosts) = start_daemon(&larder, &server, &registry, &pre_dir)?;
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
        round_pulls.push(pull(&hosts, Some(&daemon))?);
        drop(daemon);
        std::fs::remove_dir_all(&pre_dir)?;
        let closing = pull(&direct_hosts, None)?;

        let direct = (round_pulls[0].seconds + closing.seconds) / 2.0;
        round_pulls[0].seconds = direct;
        for (row, pulled) in rows.iter_mut().zip(round_pulls) {
            row.seconds.push(pulled.seconds);
            row.ratios.push(pulled.seconds / direct);
            row.upstream_bytes.push(pulled.upstream_bytes);
            row.mirror_cpu.push(pulled.cpu);
            row.mirror_reads.push(pulled.reads);
        }
    }
    containerd.remove_all()?;
    if !dropped {
        eprintln!("the page cache could not be dropped: pulls may have read from memory");
    }

    let report = report(&args, &rows, &prefetch_seconds, blob_bytes);
    publish(&report, args.out.as_deref())?;
    Ok(())
}

/// A daemon mirroring the registry, its cache in `dir`.
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

/// A daemon on a fresh cache dir under `dir` mirroring `registry`, and the
/// hosts dir that points containerd at it (the registry as the fallback).
fn start_daemon<'a>(
    larder: &Path,
    server: &'a S3Server,
    registry: &Registry,
    dir: &Path,
) -> anyhow::Result<(Mirror<'a>, PathBuf)> {
    std::fs::create_dir_all(dir)?;
    let port = larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST)?;
    let address = format!("127.0.0.1:{port}");
    let args = vec![
        "--registry-listen".to_owned(),
        address.clone(),
        "--registry-upstream".to_owned(),
        format!("{HOST}={}", registry.url()),
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
    hosts_dir(&hosts, HOST, &format!("http://{address}"), &registry.url())?;
    Ok((mirror, hosts))
}

/// The report: one row per kind of pull.
fn report(args: &ImagesArgs, rows: &[Row], prefetch: &[f64], blob_bytes: u64) -> String {
    let mut out = String::new();
    let date = utc_now();
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
        "| pull | median s (min–max) | ÷ the round's direct, median (min–max) | upstream blob bytes per pull | mirror CPU s per GiB | mirror disk reads per pull |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    let gib = blob_bytes as f64 / (1u64 << 30) as f64;
    for (name, row) in PULLS.iter().zip(rows) {
        let (median, min, max) = summary(row.seconds.clone());
        let (ratio, low, high) = summary(row.ratios.clone());
        let bytes = summary(row.upstream_bytes.iter().map(|&b| b as f64).collect()).0;
        let cpu = summary(row.mirror_cpu.clone()).0 / gib;
        let reads = summary(row.mirror_reads.iter().map(|&b| b as f64).collect()).0;
        let _ = writeln!(
            out,
            "| {name} | {median:.2} ({min:.2}–{max:.2}) | {ratio:.2}× ({low:.2}–{high:.2}) | {:.2}× the blobs | {cpu:.2} | {:.2}× the blobs |",
            bytes / blob_bytes as f64,
            reads / blob_bytes as f64
        );
    }
    let (median, min, max) = summary(prefetch.to_vec());
    let _ = writeln!(
        out,
        "\n`larder prefetch --wait image:...` before the pre-pulled pull: {median:.2} s ({min:.2}–{max:.2})."
    );
    out
}
