//! `larder-bench fleet`: N nodes scale up one model at once, without rack peers and with them.
//!
//! Each node is a `larder daemon` in a network namespace of its own; the origin (SeaweedFS on
//! loopback, behind the recording proxy) is reached through a relay in the origin's namespace,
//! whose link is shaped to `--origin-rate` for all nodes together; with `--racks`, each rack's
//! nodes share an uplink to it of `--uplink-rate` (see [`net`]). Each round starts one node
//! alone, then the N daemons on fresh cache dirs without `--peers`, then again as members of
//! their racks; the nodes read the whole model through their mounts at once. Measured: the time
//! until the last node has read it, the bytes the origin sent, and the bytes that crossed
//! racks (what the daemons received from members of other racks).

mod net;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use larder_tests::daemon::DaemonProcess;
use larder_tests::rack::{SECRET, member_args, write_key_file};
use larder_tests::seaweed::Seaweed;
use larder_tests::{Bucket, RecordingProxy};
use tokio::runtime::Handle;

use crate::FleetArgs;
use crate::common::{drop_page_cache, machine, publish, summary, upload_with_retries, utc_now};
use crate::mount::workloads::{check_content, read_whole};
pub(crate) use net::interrupt;
use net::{Network, ORIGIN_IP, ORIGIN_PORT, in_netns, node_ip};

const BUCKET: &str = "larder-bench";
/// The model, at the root of every mount.
const KEY: &str = "model.safetensors";
/// The port every node's peer listener takes (each node has its own address).
const PEER_PORT: u16 = 7470;

/// The origin as the nodes see it: the relay in the origin's namespace.
#[derive(Debug)]
struct Origin;

impl Bucket for Origin {
    fn endpoint(&self) -> String {
        format!("http://{ORIGIN_IP}:{ORIGIN_PORT}")
    }

    fn url(&self) -> String {
        format!("s3://{BUCKET}")
    }
}

/// What one round of one kind measured.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// From the start of the reads until the first and the last node had read the whole model.
    first: Duration,
    last: Duration,
    /// Body bytes the origin sent, from the start of the daemons until they stopped.
    origin_bytes: u64,
    /// Requests the origin received in that time.
    origin_requests: u64,
    /// The most origin fills any node had in flight at once.
    fills_peak: u64,
    /// Block bytes the nodes received from members of other racks.
    spine_bytes: u64,
}

/// The kinds of round, in the order each round runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// One node, no peers: the time one node needs under the origin cap.
    Alone,
    /// Every node, no peers.
    NoPeers,
    /// Every node, members of their racks.
    Peers,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Alone, Kind::NoPeers, Kind::Peers];

    fn name(self) -> &'static str {
        match self {
            Kind::Alone => "one node alone",
            Kind::NoPeers => "without peers",
            Kind::Peers => "with peers",
        }
    }
}

/// Builds the fleet's network, starts the origin, runs the rounds and writes the report.
pub(crate) fn run(args: FleetArgs, runtime: &Handle) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=200).contains(&args.nodes) && args.rounds > 0,
        "--nodes must be 1 to 200 and --rounds positive"
    );
    anyhow::ensure!(
        (1..=args.nodes).contains(&args.racks),
        "--racks must be 1 to --nodes"
    );
    anyhow::ensure!(args.size.as_u64() >= 1 << 20, "--size must be at least 1MiB");
    anyhow::ensure!(
        args.origin_rate.as_u64() > 0 && args.rack_rate.as_u64() > 0 && args.uplink_rate.as_u64() > 0,
        "the rates must be positive"
    );
    std::fs::create_dir_all(&args.work_dir)?;
    let work = tempfile::Builder::new()
        .prefix("fleet-")
        .tempdir_in(&args.work_dir)?;
    let work_dir = work.path().canonicalize()?;
    let key_file = write_key_file(&work_dir, SECRET)?;
    let started = Instant::now();
    let progress = |what: &str| eprintln!("[{:4.0} s] {what}", started.elapsed().as_secs_f64());
    let network = Network::create(
        args.nodes,
        args.racks,
        args.origin_rate.as_u64(),
        args.rack_rate.as_u64(),
        args.uplink_rate.as_u64(),
    )?;
    progress(&format!("{} node namespaces are up", args.nodes));
    let weed = Seaweed::start(&args.weed, BUCKET)?;
    runtime.block_on(upload_with_retries(
        weed.client()?.as_ref(),
        KEY,
        args.size.as_u64(),
    ))?;
    progress(&format!("uploaded {}", args.size));
    let proxy = runtime.block_on(RecordingProxy::start(&weed))?;
    let upstream = proxy
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .context("the proxy's address")?;
    let _relay = {
        let _enter = runtime.enter();
        network.relay(upstream)?
    };
    let fleet = Fleet {
        args: &args,
        network: &network,
        proxy: &proxy,
        key_file: &key_file,
        work_dir: &work_dir,
    };
    let mut rounds = Vec::new();
    for number in 0..args.rounds {
        let mut round = Vec::new();
        for kind in Kind::ALL {
            anyhow::ensure!(!net::interrupted(), "interrupted");
            let sample = fleet.round(number, kind).with_context(|| {
                let why = if net::interrupted() { ", interrupted" } else { "" };
                format!("round {}, {}{why}", number + 1, kind.name())
            })?;
            progress(&format!(
                "round {}, {}: last node done after {:.1} s, origin sent {:.2}x the model, {:.2}x crossed racks",
                number + 1,
                kind.name(),
                sample.last.as_secs_f64(),
                sample.origin_bytes as f64 / args.size.as_u64() as f64,
                sample.spine_bytes as f64 / args.size.as_u64() as f64
            ));
            round.push(sample);
        }
        rounds.push([round[0], round[1], round[2]]);
    }
    let report = render(&args, &rounds, started.elapsed());
    publish(&report, args.out.as_deref())?;
    Ok(())
}

/// What every round needs.
#[derive(Debug)]
struct Fleet<'a> {
    args: &'a FleetArgs,
    network: &'a Network,
    proxy: &'a RecordingProxy,
    key_file: &'a Path,
    work_dir: &'a Path,
}

impl Fleet<'_> {
    /// The rack of node `i`.
    fn rack(&self, i: usize) -> String {
        format!("r{}", 1 + i * self.args.racks / self.args.nodes)
    }

    /// Starts the daemons `kind` runs on fresh cache dirs (members of their racks with
    /// peers), has all of them read the whole model at once, checks what they read and stops
    /// them.
    fn round(&self, number: usize, kind: Kind) -> anyhow::Result<Sample> {
        let peers = kind == Kind::Peers;
        let nodes = if kind == Kind::Alone { 1 } else { self.args.nodes };
        let dirs = tempfile::Builder::new()
            .prefix(if peers { "peers-" } else { "alone-" })
            .tempdir_in(self.work_dir)?;
        drop_page_cache();
        let (bytes, requests) = (self.proxy.body_bytes(), self.proxy.requests().len());
        let members = (0..nodes)
            .map(|i| format!("n{i}={}:{PEER_PORT}@{}", node_ip(i), self.rack(i)))
            .collect::<Vec<_>>()
            .join(",");
        let daemons = (0..nodes)
            .map(|i| {
                let (id, listen) = (format!("n{i}"), format!("{}:{PEER_PORT}", node_ip(i)));
                let mut owned = vec!["--metrics-listen".to_owned(), "off".to_owned()];
                if peers {
                    owned.extend(member_args(&id, Some(&self.rack(i)), &listen, self.key_file));
                    owned.extend(["--peers".to_owned(), members.clone()]);
                }
                let flags: Vec<&str> = owned.iter().map(String::as_str).collect();
                let dir = dirs.path().join(&id);
                let log = [("LARDER_LOG", self.args.daemon_log.as_str())];
                in_netns(self.network.node(i), || {
                    DaemonProcess::start_with_env(&self.args.larder, &Origin, &dir, &flags, &log)
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let paths: Vec<_> = daemons.iter().map(|d| d.mount.join(KEY)).collect();
        let read = read_all(&paths, self.args.size.as_u64()).and_then(|times| {
            let seed = larder_tests::seed(KEY, 0);
            for path in &paths {
                check_content(path, seed, self.args.size.as_u64())?;
            }
            Ok(times)
        });
        let fills_peak = daemons
            .iter()
            .filter_map(|d| d.status()["origin_fills_peak"].as_u64())
            .max()
            .unwrap_or(0);
        // What each node received from members of racks not its own.
        let spine_bytes = daemons
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let status = d.status();
                let racks = status["peers"]["received_by_rack"].as_array().cloned();
                racks
                    .unwrap_or_default()
                    .iter()
                    .filter(|r| r["rack"].as_str() != Some(self.rack(i).as_str()))
                    .filter_map(|r| r["bytes"].as_u64())
                    .sum::<u64>()
            })
            .sum();
        // The logs are kept whether the reads succeeded or not.
        for (i, daemon) in daemons.into_iter().enumerate() {
            let status = daemon.stop()?;
            if let Some(keep) = &self.args.keep_logs {
                let kind = match kind {
                    Kind::Alone => "one",
                    Kind::NoPeers => "alone",
                    Kind::Peers => "peers",
                };
                let name = format!("round-{}-{kind}-n{i}.log", number + 1);
                std::fs::create_dir_all(keep)?;
                std::fs::copy(
                    dirs.path().join(format!("n{i}")).join("daemon.log"),
                    keep.join(name),
                )?;
            }
            anyhow::ensure!(status.success(), "a larder daemon exited with {status}");
        }
        let (first, last) = read?;
        Ok(Sample {
            first,
            last,
            origin_bytes: self.proxy.body_bytes() - bytes,
            origin_requests: (self.proxy.requests().len() - requests) as u64,
            fills_peak,
            spine_bytes,
        })
    }
}

/// Reads every file of `paths` whole, each on a thread of its own, all started together;
/// returns the times until the first and the last were done.
fn read_all(paths: &[std::path::PathBuf], size: u64) -> anyhow::Result<(Duration, Duration)> {
    let barrier = std::sync::Barrier::new(paths.len());
    let mut times = std::thread::scope(|scope| {
        let readers: Vec<_> = paths
            .iter()
            .map(|path| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let started = Instant::now();
                    let (bytes, _) = read_whole(path)?;
                    anyhow::ensure!(
                        bytes == size,
                        "read {bytes} of {size} bytes of {}",
                        path.display()
                    );
                    Ok(started.elapsed())
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|r| r.join().map_err(|_| anyhow::anyhow!("a reader panicked"))?)
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    times.sort();
    Ok((times[0], times[times.len() - 1]))
}

/// The markdown report: per kind of round the times, origin and spine bytes, and each time
/// against its limit; the ratios with peers to without and to one node alone; each a median
/// of the rounds with its min–max.
fn render(args: &FleetArgs, rounds: &[[Sample; 3]], duration: Duration) -> String {
    use std::fmt::Write;
    let date = utc_now();
    let size = args.size.as_u64() as f64;
    let rate = args.origin_rate.as_u64() as f64;
    // The origin link must carry the model once with peers or for one node, once per node
    // without.
    let limit = |kind: Kind| {
        size / rate
            * match kind {
                Kind::NoPeers => args.nodes as f64,
                Kind::Alone | Kind::Peers => 1.0,
            }
    };
    let cell = |values: Vec<f64>, digits: usize| {
        let (median, min, max) = summary(values);
        format!("{median:.digits$} ({min:.digits$}–{max:.digits$})")
    };
    let uplinks = if args.racks > 1 {
        format!(
            ", {} racks ({} nodes each), each rack's uplink to the spine {:.0} MB/s each way",
            args.racks,
            args.nodes / args.racks,
            args.uplink_rate.as_u64() as f64 / 1e6
        )
    } else {
        ", one rack".to_owned()
    };
    let mut out = String::new();
    let _ = writeln!(out, "# Fleet benchmark\n");
    let _ = writeln!(out, "{date}; {}", machine());
    let _ = writeln!(
        out,
        "{} nodes, model {}; caps (`tc tbf`): origin link {:.0} MB/s shared by all nodes, node links {:.0} MB/s each \
         way{uplinks}; {} rounds (each one node alone, then all without peers, then with), medians (min–max); whole run {:.0} s",
        args.nodes,
        args.size,
        rate / 1e6,
        args.rack_rate.as_u64() as f64 / 1e6,
        rounds.len(),
        duration.as_secs_f64()
    );
    let _ = writeln!(
        out,
        "\nEach node is a `larder daemon` (`--metrics-listen off`, `LARDER_MIN_FREE_FRACTION=0`, otherwise defaults; with peers \
         also `--node-id`, `--rack`, `--peer-listen`, `--peers` naming all nodes with their racks, \
         `--cluster-key-file`) in a network namespace of its own, on a fresh cache dir each round. \
         The nodes read the whole model through their mounts at once (1 MiB reads). The origin is \
         SeaweedFS (data on tmpfs) behind a recording proxy, which counts the body bytes it sends; \
         the bytes across racks are what the daemons received from members of other racks. The \
         limit is the time the origin link needs for the bytes it must carry: the model once with \
         peers or for one node, once per node without.\n"
    );
    let _ = writeln!(out, "| link | cap (`tc tbf`), each way |\n|---|---|");
    let _ = writeln!(
        out,
        "| the origin's, shared by all nodes | {:.0} MB/s |",
        rate / 1e6
    );
    if args.racks > 1 {
        let _ = writeln!(
            out,
            "| each rack's uplink to the spine | {:.0} MB/s |",
            args.uplink_rate.as_u64() as f64 / 1e6
        );
    }
    let _ = writeln!(
        out,
        "| each node's | {:.0} MB/s |\n",
        args.rack_rate.as_u64() as f64 / 1e6
    );
    let _ = writeln!(
        out,
        "| round | last node done (s) | first node done (s) | limit (s) | last ÷ limit | origin bytes ÷ model | across racks ÷ model | origin requests | peak origin fills in flight (a node) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
    for (column, kind) in Kind::ALL.into_iter().enumerate() {
        let samples: Vec<Sample> = rounds.iter().map(|round| round[column]).collect();
        let values = |f: &dyn Fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.1} | {} | {} | {} | {} | {} |",
            kind.name(),
            cell(values(&|s| s.last.as_secs_f64()), 1),
            cell(values(&|s| s.first.as_secs_f64()), 1),
            limit(kind),
            cell(values(&|s| s.last.as_secs_f64() / limit(kind)), 2),
            cell(values(&|s| s.origin_bytes as f64 / size), 2),
            cell(values(&|s| s.spine_bytes as f64 / size), 2),
            cell(values(&|s| s.origin_requests as f64), 0),
            cell(values(&|s| s.fills_peak as f64), 0),
        );
    }
    let ratio = |over: usize, under: usize| {
        rounds
            .iter()
            .map(|round| round[over].last.as_secs_f64() / round[under].last.as_secs_f64())
            .collect()
    };
    let _ = writeln!(
        out,
        "\nTime until the last node is done, with peers ÷ without (within each round): {}; with \
         peers ÷ one node alone: {}",
        cell(ratio(2, 1), 2),
        cell(ratio(2, 0), 2)
    );
    out
}
