//! `larder-bench fleet`: N nodes scale up one model at once, without rack peers and with them.
//!
//! Each node is a `larder daemon` in a network namespace of its own; the origin (SeaweedFS on
//! loopback, behind the recording proxy) is reached through a relay in the origin's namespace,
//! whose link to the rack is shaped to `--origin-rate` for all nodes together (see [`net`]).
//! Each round starts the N daemons on fresh cache dirs without `--peers`, then again as one
//! rack; all N read the whole model through their mounts at once. Measured: the time until the
//! last node has read it, and the bytes the origin sent.

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
use crate::common::{drop_page_cache, machine, summary, upload_with_retries};
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
}

/// Builds the fleet's network, starts the origin, runs the rounds and writes the report.
pub(crate) fn run(args: FleetArgs, runtime: &Handle) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=200).contains(&args.nodes) && args.rounds > 0,
        "--nodes must be 1 to 200 and --rounds positive"
    );
    anyhow::ensure!(args.size.as_u64() >= 1 << 20, "--size must be at least 1MiB");
    anyhow::ensure!(
        args.origin_rate.as_u64() > 0 && args.rack_rate.as_u64() > 0,
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
    let network = Network::create(args.nodes, args.origin_rate.as_u64(), args.rack_rate.as_u64())?;
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
        for peers in [false, true] {
            anyhow::ensure!(!net::interrupted(), "interrupted");
            let kind = if peers { "with peers" } else { "without peers" };
            let sample = fleet.round(number, peers).with_context(|| {
                let why = if net::interrupted() { ", interrupted" } else { "" };
                format!("round {}, {kind}{why}", number + 1)
            })?;
            progress(&format!(
                "round {}, {kind}: last node done after {:.1} s, origin sent {:.2}x the model",
                number + 1,
                sample.last.as_secs_f64(),
                sample.origin_bytes as f64 / args.size.as_u64() as f64
            ));
            round.push(sample);
        }
        rounds.push((round[0], round[1]));
    }
    let report = render(&args, &rounds, started.elapsed());
    print!("{report}");
    if let Some(out) = &args.out {
        std::fs::write(out, &report).with_context(|| format!("writing {}", out.display()))?;
    }
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
    /// Starts the N daemons on fresh cache dirs (as one rack if `peers`), has all of them read
    /// the whole model at once, checks what they read and stops them.
    fn round(&self, number: usize, peers: bool) -> anyhow::Result<Sample> {
        let dirs = tempfile::Builder::new()
            .prefix(if peers { "peers-" } else { "alone-" })
            .tempdir_in(self.work_dir)?;
        drop_page_cache();
        let (bytes, requests) = (self.proxy.body_bytes(), self.proxy.requests().len());
        let members = (0..self.args.nodes)
            .map(|i| format!("n{i}={}:{PEER_PORT}@r1", node_ip(i)))
            .collect::<Vec<_>>()
            .join(",");
        let daemons = (0..self.args.nodes)
            .map(|i| {
                let (id, listen) = (format!("n{i}"), format!("{}:{PEER_PORT}", node_ip(i)));
                let mut owned = vec!["--metrics-listen".to_owned(), "off".to_owned()];
                if peers {
                    owned.extend(member_args(&id, Some("r1"), &listen, self.key_file));
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
        // The logs are kept whether the reads succeeded or not.
        for (i, daemon) in daemons.into_iter().enumerate() {
            let status = daemon.stop()?;
            if let Some(keep) = &self.args.keep_logs {
                let kind = if peers { "peers" } else { "alone" };
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

/// The markdown report: per kind of round the times and origin bytes, the ratio of the two
/// times, and each time against its limit, each a median of the rounds with its min–max.
fn render(args: &FleetArgs, rounds: &[(Sample, Sample)], duration: Duration) -> String {
    use std::fmt::Write;
    let date = std::process::Command::new("date")
        .args(["-u", "+%F %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let size = args.size.as_u64() as f64;
    let rate = args.origin_rate.as_u64() as f64;
    // The origin link must carry the model once with peers, once per node without.
    let limit = |peers: bool| size / rate * if peers { 1.0 } else { args.nodes as f64 };
    let cell = |values: Vec<f64>, digits: usize| {
        let (median, min, max) = summary(values);
        format!("{median:.digits$} ({min:.digits$}–{max:.digits$})")
    };
    let mut out = String::new();
    let _ = writeln!(out, "# Fleet benchmark\n");
    let _ = writeln!(out, "{date}; {}", machine());
    let _ = writeln!(
        out,
        "{} nodes, model {}; origin link {:.0} MB/s shared by all nodes, node links {:.0} MB/s each \
         way (`tc tbf`); {} rounds (each without peers, then with), medians (min–max); whole run {:.0} s",
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
         also `--node-id`, `--rack`, `--peer-listen`, `--peers` naming all nodes, \
         `--cluster-key-file`) in a network namespace of its own, on a fresh cache dir each round. \
         All nodes read the whole model through their mounts at once (1 MiB reads). The origin is \
         SeaweedFS (data on tmpfs) behind a recording proxy, which counts the body bytes it sends; \
         the limit is the time the origin link needs for the bytes it must carry: the model once \
         with peers, once per node without.\n"
    );
    let _ = writeln!(
        out,
        "| round | last node done (s) | first node done (s) | limit (s) | last ÷ limit | origin bytes ÷ model | origin requests | peak origin fills in flight (a node) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    for (peers, name) in [(false, "without peers"), (true, "with peers")] {
        let samples: Vec<Sample> = rounds.iter().map(|&(a, b)| if peers { b } else { a }).collect();
        let column = |f: &dyn Fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {:.1} | {} | {} | {} | {} |",
            cell(column(&|s| s.last.as_secs_f64()), 1),
            cell(column(&|s| s.first.as_secs_f64()), 1),
            limit(peers),
            cell(column(&|s| s.last.as_secs_f64() / limit(peers)), 2),
            cell(column(&|s| s.origin_bytes as f64 / size), 2),
            cell(column(&|s| s.origin_requests as f64), 0),
            cell(column(&|s| s.fills_peak as f64), 0),
        );
    }
    let ratios = rounds
        .iter()
        .map(|(alone, peers)| peers.last.as_secs_f64() / alone.last.as_secs_f64())
        .collect();
    let _ = writeln!(
        out,
        "\nTime until the last node is done, with peers ÷ without (within each round): {}",
        cell(ratios, 2)
    );
    out
}
