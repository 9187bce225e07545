//! The fleet's network: one network namespace per node, one for the origin and one holding the
//! bridge they all hang off (the spine), each link a veth pair with `tc tbf` on it. Nothing is
//! added to the root namespace, so no packet of the benchmark can leave the machine: the
//! namespaces hold one subnet and no route out of it.
//!
//! ```text
//!  node 0 (10.0.0.10) ─┐              ┌─ origin (10.0.0.1): relay to the proxy on loopback
//!  node 1 (10.0.0.11) ─┼─ hub: bridge ┤
//!  ...                 ┘              (origin link: origin-rate, shared by all nodes)
//!  (each node link: rack-rate, both ways)
//! ```
//!
//! With several racks, each rack's nodes hang off a bridge of the rack's own namespace, linked
//! to the spine by an uplink capped at uplink-rate each way:
//!
//! ```text
//!  nodes of r1 ─ r1: bridge ─(uplink)─┐
//!  nodes of r2 ─ r2: bridge ─(uplink)─┼─ hub: bridge ─ origin
//! ```

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail};
use tokio::task::JoinHandle;

/// The origin's address inside the fleet.
pub(super) const ORIGIN_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
/// The port the relay to the origin listens on.
pub(super) const ORIGIN_PORT: u16 = 9000;

/// Where `ip netns` keeps its namespaces.
const NETNS_DIR: &str = "/run/netns";

/// Set once Ctrl-C was pressed: the run stops at its next step.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The prefix of this run's namespace names: no other run, and nothing else, has it.
fn prefix() -> String {
    format!("larder-fleet-{}-", std::process::id())
}

/// Node `index`'s address inside the fleet.
pub(super) fn node_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 0, 10 + index as u8)
}

/// Whether Ctrl-C was pressed.
pub(super) fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// Ctrl-C: marks the run interrupted and sends SIGTERM to every process in this run's
/// namespaces (the daemons it started), so that reads waiting on them end and the run unwinds,
/// deleting the namespaces on its way out.
pub(crate) fn interrupt() {
    INTERRUPTED.store(true, Ordering::Relaxed);
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return;
    };
    for name in entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
    {
        if !name.starts_with(&prefix()) {
            continue;
        }
        let Ok(out) = Command::new("ip").args(["netns", "pids", &name]).output() else {
            continue;
        };
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<libc::pid_t>() {
                // SAFETY: kill(2) on a process in a namespace this run created: one it started.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }
}

/// Runs `command` (`ip` or `tc` with `args`); fails with its error output.
fn run(command: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(command)
        .args(args)
        .output()
        .with_context(|| format!("running {command} (Debian package iproute2)"))?;
    if !out.status.success() {
        bail!(
            "{command} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Caps the egress of `dev` in namespace `ns` at `rate` bytes a second (token bucket, 20 ms of
/// burst).
fn shape(ns: &str, dev: &str, rate: u64) -> anyhow::Result<()> {
    let bits = format!("{}bit", rate * 8);
    let burst = (rate / 50).max(64 << 10).to_string();
    run(
        "tc",
        &[
            "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", &bits, "burst", &burst, "latency",
            "100ms",
        ],
    )
}

/// The namespaces of one fleet; dropped, they are deleted (with the links and the bridge).
#[derive(Debug)]
pub(super) struct Network {
    hub: String,
    origin: String,
    nodes: Vec<String>,
    /// The namespaces made so far, deleted on drop: a failure halfway leaves nothing.
    made: Vec<String>,
}

impl Network {
    /// Creates the namespaces and links of `nodes` nodes in `racks` racks (node `i` in rack
    /// `i * racks / nodes`): origin link `origin_rate`, node links `rack_rate` and, with more
    /// than one rack, rack uplinks `uplink_rate` bytes a second.
    pub(super) fn create(
        nodes: usize,
        racks: usize,
        origin_rate: u64,
        rack_rate: u64,
        uplink_rate: u64,
    ) -> anyhow::Result<Self> {
        let prefix = prefix();
        let mut network = Self {
            hub: format!("{prefix}hub"),
            origin: format!("{prefix}origin"),
            nodes: (0..nodes).map(|i| format!("{prefix}n{i}")).collect(),
            made: Vec::new(),
        };
        let hub = network.hub.clone();
        network.bridge(&hub)?;
        let origin = network.origin.clone();
        network.add(&origin)?;
        network.link(&hub, &origin, "origin", Some(ORIGIN_IP))?;
        shape(&origin, "eth0", origin_rate)?;
        // Each node's bridge: the spine's, or its rack's.
        let bridges = if racks > 1 {
            (0..racks)
                .map(|r| {
                    let rack = format!("{prefix}r{}", r + 1);
                    network.bridge(&rack)?;
                    let port = format!("up{}", r + 1);
                    network.link(&hub, &rack, &port, None)?;
                    run("ip", &["-n", &rack, "link", "set", "eth0", "master", "br0"])?;
                    shape(&rack, "eth0", uplink_rate)?;
                    shape(&hub, &port, uplink_rate)?;
                    Ok(rack)
                })
                .collect::<anyhow::Result<Vec<_>>>()?
        } else {
            vec![hub.clone()]
        };
        for (i, ns) in network.nodes.clone().iter().enumerate() {
            let bridge = &bridges[i * bridges.len() / nodes];
            network.add(ns)?;
            let port = format!("n{i}");
            network.link(bridge, ns, &port, Some(node_ip(i)))?;
            shape(ns, "eth0", rack_rate)?;
            shape(bridge, &port, rack_rate)?;
        }
        Ok(network)
    }

    /// Creates namespace `ns` holding a bridge, `br0`.
    fn bridge(&mut self, ns: &str) -> anyhow::Result<()> {
        self.add(ns)?;
        run("ip", &["-n", ns, "link", "add", "br0", "type", "bridge"])?;
        run("ip", &["-n", ns, "link", "set", "br0", "up"])
    }

    /// Creates namespace `ns`.
    fn add(&mut self, ns: &str) -> anyhow::Result<()> {
        run("ip", &["netns", "add", ns])?;
        self.made.push(ns.to_owned());
        Ok(())
    }

    /// Links namespace `ns` to the bridge of namespace `bridge`: `eth0` in `ns` (with `ip`/24,
    /// if any), `port` on the bridge.
    fn link(&self, bridge: &str, ns: &str, port: &str, ip: Option<Ipv4Addr>) -> anyhow::Result<()> {
        run(
            "ip",
            &[
                "link", "add", port, "netns", bridge, "type", "veth", "peer", "name", "eth0", "netns", ns,
            ],
        )?;
        run("ip", &["-n", bridge, "link", "set", port, "master", "br0", "up"])?;
        if let Some(ip) = ip {
            run(
                "ip",
                &["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"],
            )?;
        }
        run("ip", &["-n", ns, "link", "set", "eth0", "up"])?;
        run("ip", &["-n", ns, "link", "set", "lo", "up"])
    }

    /// Node `index`'s namespace.
    pub(super) fn node(&self, index: usize) -> &str {
        &self.nodes[index]
    }

    /// Starts a relay from `ORIGIN_IP:ORIGIN_PORT` in the origin's namespace to `upstream` on
    /// this machine's loopback (the recording proxy in front of the object store).
    pub(super) fn relay(&self, upstream: SocketAddr) -> anyhow::Result<Relay> {
        let listener = in_netns(&self.origin, || {
            let listener = std::net::TcpListener::bind((ORIGIN_IP, ORIGIN_PORT))?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        })?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(Relay { task })
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            if let Err(error) = run("ip", &["netns", "del", ns]) {
                eprintln!("deleting namespace {ns}: {error:#}");
            }
        }
    }
}

/// The relay's accept loop; stopped when dropped.
#[derive(Debug)]
pub(super) struct Relay {
    task: JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs `work` on a thread that has joined network namespace `ns`: the sockets it opens and
/// the processes it starts live in that namespace (mounts stay in this process's mount
/// namespace, unlike under `ip netns exec`).
pub(super) fn in_netns<T: Send>(
    ns: &str,
    work: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    let handle = File::open(std::path::Path::new(NETNS_DIR).join(ns))
        .with_context(|| format!("opening namespace {ns}"))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: setns(2) with an open namespace file; it moves this thread only.
                if unsafe { libc::setns(handle.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(std::io::Error::last_os_error()).context("setns");
                }
                work()
            })
            .join()
            .map_err(|_| anyhow::anyhow!("a thread in namespace {ns} panicked"))?
    })
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use tokio::io::AsyncWriteExt;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_reaches_loopback_through_the_relay_and_drop_deletes_the_namespaces() {
        let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = upstream.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = upstream.accept().await.unwrap();
            stream.write_all(b"from the origin").await.unwrap();
        });
        let network = Network::create(2, 2, 100_000_000, 1_250_000_000, 1_250_000_000).unwrap();
        let relay = network.relay(address).unwrap();
        let answer = tokio::task::block_in_place(|| {
            in_netns(network.node(1), || {
                let mut stream = std::net::TcpStream::connect((ORIGIN_IP, ORIGIN_PORT))?;
                let mut answer = String::new();
                stream.read_to_string(&mut answer)?;
                Ok(answer)
            })
        })
        .unwrap();
        assert_eq!(answer, "from the origin");
        let made = network.made.clone();
        // The spine, the origin, two racks and two nodes.
        assert_eq!(made.len(), 6);
        drop(relay);
        drop(network);
        for ns in made {
            assert!(
                !std::path::Path::new(NETNS_DIR).join(&ns).exists(),
                "{ns} is left"
            );
        }
    }
}
