//! `larder-bench simulate`: a discrete-event model of a fleet scaling up one model, to see what
//! a thousand nodes would do where the machine holds eight.
//!
//! Who fetches what from whom is the daemon's own ownership code
//! (`larder_peer_proto::owner::candidates`, the rendezvous ranking every daemon computes): for
//! each run (an origin part, 16 MiB), its fleet owner fetches it from the origin, each other
//! rack's owner from the fleet owner, and every other node from its rack's owner. A member that
//! is dead or has not joined yet is left out of the ranking, as a daemon leaves out a member
//! whose circuit is open: a dead member is found out by each asker after one first-byte
//! deadline (`--detect`), the daemon's `peer.first_byte_timeout`; the runs it owned go to their
//! next candidate, and a run a new owner lacks is fetched again.
//!
//! What is modelled, and what is not: every link is a queue served at its rate (the origin's
//! link, each rack's uplink each way, each node's link each way); a transfer joins the queue of
//! every link on its path once its run is at its source, and ends when the last of them has
//! served it, at the share of its rate a transfer gets (`--efficiency`, calibrated from the
//! fleet benchmark), plus a latency per run (`--run-cost`: a request's round trip, a fill's
//! start). Real links share their bandwidth between transfers rather than serve them in turn,
//! and a daemon streams a run block by block, forwarding each block as it comes rather than the
//! run once whole: a run reaches a rack's members only after the rack owner has all of it
//! here, which the daemon does not wait for. `--check` states the model's error against the
//! fleet benchmark's measurements.

mod svg;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt::Write;
use std::path::PathBuf;

use anyhow::Context;
use larder_config::ByteSize;
use larder_peer_proto::owner::{self, Member, RunId};

use crate::common::machine;

/// Arguments of `larder-bench simulate`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SimulateArgs {
    /// Nodes in the fleet.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Racks they are split into, in order.
    #[arg(long, default_value_t = 32)]
    racks: usize,
    /// Size of the model every node reads.
    #[arg(long, default_value = "16GiB")]
    size: ByteSize,
    /// Size of a run (an origin part; Larder's `origin.part_size`).
    #[arg(long, default_value = "16MiB")]
    run_size: ByteSize,
    /// Bandwidth of the origin's link, shared by the whole fleet, in bytes a second.
    #[arg(long, default_value = "2500MB")]
    origin_rate: ByteSize,
    /// Bandwidth of each rack's uplink to the spine, each way.
    #[arg(long, default_value = "12500MB")]
    uplink_rate: ByteSize,
    /// Bandwidth of each node's link to its rack, each way.
    #[arg(long, default_value = "3125MB")]
    node_rate: ByteSize,
    /// The share of a link's rate a transfer gets (TCP, the shaper). The default is the fleet
    /// benchmark's: one node alone read 512 MiB in 5.6 s where the origin's cap needs 5.37 s
    /// (`bench/results/2026-12-04-fleet-8-nodes-2-racks.md`).
    #[arg(long, default_value_t = 0.96)]
    efficiency: f64,
    /// The latency of each run fetched beyond its bytes, in seconds (a request's round trip, a
    /// fill's start); it delays the run, not the link, which serves other runs meanwhile.
    #[arg(long, default_value_t = 0.005)]
    run_cost: f64,
    /// How long an asker takes to find a dead member out, in seconds.
    #[arg(long, default_value_t = 0.5)]
    detect: f64,
    /// Share of the nodes that die halfway through the scale-up (by the healthy run's median).
    #[arg(long, default_value_t = 0.05)]
    die: f64,
    /// Share of the nodes that join late, halfway through the scale-up.
    #[arg(long, default_value_t = 0.10)]
    late: f64,
    /// Seed of the choice of the nodes that die and join late.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where the report and the plot go (`NAME.md`, `NAME.svg`).
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
    /// The name of the report and the plot.
    #[arg(long, default_value = "simulated-fleet")]
    name: String,
    /// Also model the fleet benchmark's measured runs and state the model's error against them.
    #[arg(long)]
    check: bool,
}

/// A node's place and life in the fleet.
#[derive(Debug, Clone, Copy)]
struct Node {
    rack: usize,
    /// When it joins (starts reading and is ranked).
    joins: f64,
    /// When it dies, if it does.
    dies: Option<f64>,
}

/// One link direction: a queue served at its rate.
#[derive(Debug, Clone, Copy)]
struct Link {
    rate: f64,
    free_at: f64,
}

/// The fleet's links, by index: the origin's, then each rack's up and down, then each node's
/// egress and ingress.
struct Links {
    links: Vec<Link>,
    racks: usize,
    nodes: usize,
}

impl Links {
    fn new(args: &Shape) -> Self {
        let mut links = vec![Link {
            rate: args.origin_rate,
            free_at: 0.0,
        }];
        links.extend((0..2 * args.racks).map(|_| Link {
            rate: args.uplink_rate,
            free_at: 0.0,
        }));
        links.extend((0..2 * args.nodes).map(|_| Link {
            rate: args.node_rate,
            free_at: 0.0,
        }));
        Self {
            links,
            racks: args.racks,
            nodes: args.nodes,
        }
    }

    const ORIGIN: usize = 0;

    fn up(&self, rack: usize) -> usize {
        1 + 2 * rack
    }

    fn down(&self, rack: usize) -> usize {
        2 + 2 * rack
    }

    fn egress(&self, node: usize) -> usize {
        1 + 2 * self.racks + 2 * node
    }

    fn ingress(&self, node: usize) -> usize {
        debug_assert!(node < self.nodes);
        2 + 2 * self.racks + 2 * node
    }

    /// Queues `bytes` on every link of `path` from `ready` on: when the last link is done with
    /// them, plus `cost`. Each link serves its queue on its own (a transfer does not hold one
    /// link idle while it waits for another), so the slowest queue on the path sets the end.
    fn transfer(&mut self, path: &[usize], bytes: f64, ready: f64, cost: f64) -> f64 {
        let mut end = ready;
        for &l in path {
            let link = &mut self.links[l];
            link.free_at = link.free_at.max(ready) + bytes / link.rate;
            end = end.max(link.free_at);
        }
        end + cost
    }
}

/// The numbers a simulation needs.
#[derive(Debug, Clone, Copy)]
struct Shape {
    nodes: usize,
    racks: usize,
    size: f64,
    run_size: f64,
    origin_rate: f64,
    uplink_rate: f64,
    node_rate: f64,
    run_cost: f64,
    detect: f64,
}

/// Where a node takes a run from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Supplier {
    Origin,
    Node(usize),
}

/// What one scenario gave.
#[derive(Debug, Clone)]
struct Outcome {
    name: &'static str,
    /// Each surviving node's time to ready, from its joining, sorted.
    ready: Vec<f64>,
    origin_bytes: f64,
    spine_bytes: f64,
    rack_bytes: f64,
    /// Runs the busiest fleet owner filled from the origin ÷ the mean over owners.
    owner_balance: f64,
}

/// The event queue's order: by time, then by insertion.
#[derive(Debug)]
struct At(f64, u64);

impl PartialEq for At {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for At {}

impl PartialOrd for At {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for At {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
    }
}

/// The fleet's ranking of every node for each run: the daemon's ownership code, once per run.
fn rankings(shape: &Shape) -> Vec<Vec<usize>> {
    let members: Vec<Member> = (0..shape.nodes)
        .map(|i| Member {
            id: format!("n{i}"),
            rack: Some(format!("r{}", rack_of(i, shape))),
        })
        .collect();
    let index: HashMap<&str, usize> = members
        .iter()
        .enumerate()
        .map(|(i, m)| (m.id.as_str(), i))
        .collect();
    let object = *blake3::hash(b"simulated model").as_bytes();
    (0..runs(shape))
        .map(|part| {
            let run = RunId { object, part };
            owner::candidates(&members, &run, None)
                .into_iter()
                .map(|m| index[m.id.as_str()])
                .collect()
        })
        .collect()
}

fn runs(shape: &Shape) -> u64 {
    (shape.size / shape.run_size).ceil() as u64
}

fn rack_of(node: usize, shape: &Shape) -> usize {
    node * shape.racks / shape.nodes
}

/// Simulates the scale-up of `nodes`; with `peers`, through their owners.
fn simulate(
    name: &'static str,
    shape: &Shape,
    nodes: &[Node],
    ranked: &[Vec<usize>],
    peers: bool,
) -> Outcome {
    let mut links = Links::new(shape);
    let run_count = runs(shape) as usize;
    let alive = |n: usize, t: f64| nodes[n].joins <= t && nodes[n].dies.is_none_or(|d| t < d);
    // The source of run `r` for node `n` asking at `t`, by the live ranking.
    let source = |n: usize, r: usize, t: f64| -> Supplier {
        if !peers {
            return Supplier::Origin;
        }
        let rack = nodes[n].rack;
        let mut live = ranked[r].iter().copied().filter(|&m| alive(m, t) || m == n);
        let fleet = live.next().unwrap_or(n);
        let rack_owner = ranked[r]
            .iter()
            .copied()
            .find(|&m| nodes[m].rack == rack && (alive(m, t) || m == n))
            .unwrap_or(n);
        if rack_owner != n {
            Supplier::Node(rack_owner)
        } else if fleet != n {
            Supplier::Node(fleet)
        } else {
            Supplier::Origin
        }
    };
    let mut have: Vec<Vec<Option<f64>>> = vec![vec![None; run_count]; nodes.len()];
    let mut waiting: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    let mut queue: BinaryHeap<Reverse<(At, usize, usize, Supplier)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let (mut origin_bytes, mut spine_bytes, mut rack_bytes) = (0.0, 0.0, 0.0);
    let mut filled = vec![0u64; nodes.len()];
    // Asks for run `r` for node `n` at `t`: a transfer now, or a wait for its source.
    let mut ask = |n: usize,
                   r: usize,
                   t: f64,
                   links: &mut Links,
                   have: &Vec<Vec<Option<f64>>>,
                   waiting: &mut HashMap<(usize, usize), Vec<usize>>,
                   queue: &mut BinaryHeap<Reverse<(At, usize, usize, Supplier)>>| {
        let from = source(n, r, t);
        let bytes = shape.run_size.min(shape.size - r as f64 * shape.run_size);
        let path = match from {
            Supplier::Origin => vec![Links::ORIGIN, links.down(nodes[n].rack), links.ingress(n)],
            Supplier::Node(m) if nodes[m].rack == nodes[n].rack => vec![links.egress(m), links.ingress(n)],
            Supplier::Node(m) => vec![
                links.egress(m),
                links.up(nodes[m].rack),
                links.down(nodes[n].rack),
                links.ingress(n),
            ],
        };
        match from {
            Supplier::Node(m) if have[m][r].is_none_or(|got| got > t) => {
                waiting.entry((m, r)).or_default().push(n);
            }
            _ => {
                let end = links.transfer(&path, bytes, t, shape.run_cost);
                seq += 1;
                queue.push(Reverse((At(end, seq), n, r, from)));
            }
        }
    };
    for (n, node) in nodes.iter().enumerate() {
        for r in 0..run_count {
            ask(n, r, node.joins, &mut links, &have, &mut waiting, &mut queue);
        }
    }
    // Deaths: who waits on a dead node asks again once it has found it out.
    let mut deaths: Vec<(f64, usize)> = nodes
        .iter()
        .enumerate()
        .filter_map(|(n, node)| Some((node.dies?, n)))
        .collect();
    deaths.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut deaths = deaths.into_iter().peekable();
    while let Some(Reverse((At(t, _), n, r, from))) = queue.pop() {
        while let Some(&(when, dead)) = deaths.peek()
            && when <= t
        {
            deaths.next();
            let orphans: Vec<(usize, Vec<usize>)> = waiting
                .iter()
                .filter(|((m, _), _)| *m == dead)
                .map(|(&(_, r), askers)| (r, askers.clone()))
                .collect();
            waiting.retain(|(m, _), _| *m != dead);
            for (r, askers) in orphans {
                for asker in askers {
                    ask(
                        asker,
                        r,
                        when + shape.detect,
                        &mut links,
                        &have,
                        &mut waiting,
                        &mut queue,
                    );
                }
            }
        }
        // A transfer from a node that died before it ended, or to one: lost.
        if let Supplier::Node(m) = from
            && nodes[m].dies.is_some_and(|d| d < t)
        {
            let found_out = nodes[m].dies.unwrap_or(t) + shape.detect;
            ask(
                n,
                r,
                found_out.max(t),
                &mut links,
                &have,
                &mut waiting,
                &mut queue,
            );
            continue;
        }
        if nodes[n].dies.is_some_and(|d| d < t) || have[n][r].is_some() {
            continue;
        }
        have[n][r] = Some(t);
        let bytes = shape.run_size.min(shape.size - r as f64 * shape.run_size);
        match from {
            Supplier::Origin => {
                origin_bytes += bytes;
                filled[n] += 1;
            }
            Supplier::Node(m) if nodes[m].rack == nodes[n].rack => rack_bytes += bytes,
            Supplier::Node(_) => spine_bytes += bytes,
        }
        for asker in waiting.remove(&(n, r)).unwrap_or_default() {
            ask(asker, r, t, &mut links, &have, &mut waiting, &mut queue);
        }
    }
    let mut ready: Vec<f64> = nodes
        .iter()
        .enumerate()
        .filter(|(_, node)| node.dies.is_none())
        .map(|(n, node)| {
            have[n]
                .iter()
                .map(|t| t.unwrap_or(f64::INFINITY))
                .fold(0.0, f64::max)
                - node.joins
        })
        .collect();
    ready.sort_by(f64::total_cmp);
    let owners: Vec<u64> = filled.iter().copied().filter(|&f| f > 0).collect();
    let mean = owners.iter().sum::<u64>() as f64 / owners.len().max(1) as f64;
    let owner_balance = owners.iter().copied().max().unwrap_or(0) as f64 / mean.max(1.0);
    Outcome {
        name,
        ready,
        origin_bytes,
        spine_bytes,
        rack_bytes,
        owner_balance,
    }
}

/// The `q` quantile of sorted `values`.
fn quantile(values: &[f64], q: f64) -> f64 {
    let i = ((values.len() as f64 - 1.0) * q).round() as usize;
    values.get(i).copied().unwrap_or(f64::NAN)
}

/// `share` of the nodes, chosen by a hash of `seed`, `what` and the node: the same every run.
fn chosen(nodes: usize, share: f64, seed: u64, what: &str) -> Vec<usize> {
    let mut ranked: Vec<(u64, usize)> = (0..nodes)
        .map(|n| {
            let hash = blake3::hash(format!("{seed}/{what}/{n}").as_bytes());
            let mut first = [0; 8];
            first.copy_from_slice(&hash.as_bytes()[..8]);
            (u64::from_le_bytes(first), n)
        })
        .collect();
    ranked.sort();
    let count = (nodes as f64 * share).round() as usize;
    ranked.into_iter().take(count).map(|(_, n)| n).collect()
}

impl Shape {
    fn of(args: &SimulateArgs) -> Self {
        Self {
            nodes: args.nodes,
            racks: args.racks,
            size: args.size.as_u64() as f64,
            run_size: args.run_size.as_u64() as f64,
            origin_rate: args.origin_rate.as_u64() as f64 * args.efficiency,
            uplink_rate: args.uplink_rate.as_u64() as f64 * args.efficiency,
            node_rate: args.node_rate.as_u64() as f64 * args.efficiency,
            run_cost: args.run_cost,
            detect: args.detect,
        }
    }

    fn healthy(&self) -> Vec<Node> {
        (0..self.nodes)
            .map(|n| Node {
                rack: rack_of(n, self),
                joins: 0.0,
                dies: None,
            })
            .collect()
    }
}

/// The four scenarios of one fleet.
fn scenarios(args: &SimulateArgs, shape: &Shape) -> Vec<Outcome> {
    let ranked = rankings(shape);
    let healthy = shape.healthy();
    let alone = simulate("every node alone", shape, &healthy, &ranked, false);
    let peers = simulate("with peers", shape, &healthy, &ranked, true);
    let halfway = quantile(&peers.ready, 0.5) / 2.0;
    let mut dying = healthy.clone();
    for n in chosen(shape.nodes, args.die, args.seed, "die") {
        dying[n].dies = Some(halfway);
    }
    let dies = simulate("with peers, 5% die halfway", shape, &dying, &ranked, true);
    let mut joining = healthy;
    for n in chosen(shape.nodes, args.late, args.seed, "late") {
        joining[n].joins = halfway;
    }
    let late = simulate("with peers, 10% join halfway", shape, &joining, &ranked, true);
    vec![alone, peers, dies, late]
}

/// Runs the simulation and writes the report and the plot.
pub(crate) fn run(args: SimulateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.nodes > 0 && (1..=args.nodes).contains(&args.racks),
        "--nodes must be positive and --racks 1 to --nodes"
    );
    anyhow::ensure!(
        args.size.as_u64() > 0 && args.run_size.as_u64() > 0,
        "--size and --run-size must be positive"
    );
    anyhow::ensure!(
        (0.0..1.0).contains(&args.die) && (0.0..1.0).contains(&args.late),
        "--die and --late are shares below 1"
    );
    anyhow::ensure!(
        args.efficiency > 0.0 && args.efficiency <= 1.0,
        "--efficiency is a share above 0, at most 1"
    );
    let started = std::time::Instant::now();
    let shape = Shape::of(&args);
    let outcomes = scenarios(&args, &shape);
    let mut out = String::new();
    let _ = writeln!(out, "# Simulated fleet\n");
    let _ = writeln!(
        out,
        "{}; simulated in {:.1} s\n",
        machine(),
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(
        out,
        "{} nodes in {} racks read a {} model (runs of {}) at once; origin link {:.0} MB/s for the fleet, \
         rack uplinks {:.0} MB/s and node links {:.0} MB/s each way, of which a transfer gets {:.0}%; {:.0} ms a run; a dead member found \
         out in {:.1} s. Ownership is the daemon's (`larder_peer_proto::owner`); links serve transfers in \
         turn (see `bench/src/simulate/mod.rs` for what the model leaves out). Times to ready are from \
         each node's start; the nodes that die are left out of them.\n",
        args.nodes,
        args.racks,
        args.size,
        args.run_size,
        args.origin_rate.as_u64() as f64 / 1e6,
        args.uplink_rate.as_u64() as f64 / 1e6,
        args.node_rate.as_u64() as f64 / 1e6,
        args.efficiency * 100.0,
        shape.run_cost * 1e3,
        shape.detect
    );
    let _ = writeln!(
        out,
        "| scenario | origin ÷ model | across racks ÷ model | within racks ÷ model | p50 ready (s) | p99 ready (s) | last ready (s) | busiest fleet owner ÷ mean |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    for o in &outcomes {
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} |",
            o.name,
            o.origin_bytes / shape.size,
            o.spine_bytes / shape.size,
            o.rack_bytes / shape.size,
            quantile(&o.ready, 0.5),
            quantile(&o.ready, 0.99),
            quantile(&o.ready, 1.0),
            o.owner_balance
        );
    }
    if args.check {
        let _ = writeln!(out, "\n{}", check(&args));
    }
    let _ = writeln!(out, "\n![time to ready and bytes by level]({}.svg)", args.name);
    print!("{out}");
    std::fs::create_dir_all(&args.out_dir)?;
    let report = args.out_dir.join(format!("{}.md", args.name));
    std::fs::write(&report, &out).with_context(|| format!("writing {}", report.display()))?;
    let plot = args.out_dir.join(format!("{}.svg", args.name));
    std::fs::write(&plot, svg::plot(&outcomes, shape.size))
        .with_context(|| format!("writing {}", plot.display()))?;
    Ok(())
}

/// The fleet benchmark's runs (`bench/results`), modelled: the time until the last node was
/// done, measured and modelled, and the model's error.
fn check(args: &SimulateArgs) -> String {
    // (what, nodes, racks, model, uplink, measured: one alone, without peers, with peers)
    let measured = [
        (
            "4 nodes, 1 GiB (2026-12-04-fleet.md)",
            4,
            1,
            1u64 << 30,
            1250e6,
            [None, Some(45.0), Some(11.7)],
        ),
        (
            "8 nodes in 2 racks, 512 MiB (2026-12-04-fleet-8-nodes-2-racks.md)",
            8,
            2,
            512 << 20,
            250e6,
            [Some(5.7), Some(45.0), Some(6.9)],
        ),
    ];
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Against the fleet benchmark (origin 100 MB/s, node links 1250 MB/s, the same efficiency and run cost): the time until the last node was done.\n"
    );
    let _ = writeln!(out, "| run | kind | measured (s) | modelled (s) | error |");
    let _ = writeln!(out, "|---|---|---|---|---|");
    for (what, nodes, racks, size, uplink, times) in measured {
        let shape = Shape {
            nodes,
            racks,
            size: size as f64,
            run_size: args.run_size.as_u64() as f64,
            origin_rate: 100e6 * args.efficiency,
            uplink_rate: uplink * args.efficiency,
            node_rate: 1250e6 * args.efficiency,
            run_cost: args.run_cost,
            detect: args.detect,
        };
        let ranked = rankings(&shape);
        let one = Shape {
            nodes: 1,
            racks: 1,
            ..shape
        };
        let modelled = [
            simulate("one", &one, &one.healthy(), &rankings(&one), false),
            simulate("alone", &shape, &shape.healthy(), &ranked, false),
            simulate("peers", &shape, &shape.healthy(), &ranked, true),
        ];
        for ((kind, measured), modelled) in ["one node alone", "without peers", "with peers"]
            .into_iter()
            .zip(times)
            .zip(modelled)
        {
            let Some(measured) = measured else { continue };
            let last = quantile(&modelled.ready, 1.0);
            let _ = writeln!(
                out,
                "| {what} | {kind} | {measured:.1} | {last:.1} | {:+.0}% |",
                (last - measured) / measured * 100.0
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(nodes: usize, racks: usize) -> Shape {
        Shape {
            nodes,
            racks,
            size: (1u64 << 30) as f64,
            run_size: (16u64 << 20) as f64,
            origin_rate: 1e9,
            uplink_rate: 1e10,
            node_rate: 3e9,
            run_cost: 0.005,
            detect: 0.5,
        }
    }

    /// A healthy fleet with peers moves the model once from the origin, once into each other
    /// rack, once to every other member of a rack; alone, once per node from the origin.
    #[test]
    fn bytes_by_level_follow_the_owners() {
        let shape = shape(48, 3);
        let ranked = rankings(&shape);
        let peers = simulate("peers", &shape, &shape.healthy(), &ranked, true);
        assert_eq!(peers.origin_bytes / shape.size, 1.0);
        assert_eq!(peers.spine_bytes / shape.size, 2.0);
        assert_eq!(peers.rack_bytes / shape.size, 45.0);
        assert_eq!(peers.ready.len(), 48);
        let alone = simulate("alone", &shape, &shape.healthy(), &ranked, false);
        assert_eq!(alone.origin_bytes / shape.size, 48.0);
    }

    /// Members that die halfway cost their runs once more at most, and every survivor ends
    /// ready.
    #[test]
    fn the_dead_members_runs_go_to_their_next_candidate() {
        let shape = shape(40, 4);
        let ranked = rankings(&shape);
        let mut nodes = shape.healthy();
        let dead = chosen(40, 0.1, 7, "die");
        for &n in &dead {
            nodes[n].dies = Some(0.5);
        }
        let outcome = simulate("die", &shape, &nodes, &ranked, true);
        assert_eq!(outcome.ready.len(), 36);
        assert!(outcome.ready.iter().all(|t| t.is_finite()), "{:?}", outcome.ready);
        assert!(outcome.origin_bytes / shape.size <= 1.0 + dead.len() as f64 / 40.0 + 0.05);
    }
}
