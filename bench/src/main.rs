//! Larder's benchmarks. Every figure is a ratio to a reference measured in the same round
//! (BENCH.md): absolute numbers on these shared machines do not carry from one run to the next.
//!
//! `larder-bench engine` measures the block cache engine against SeaweedFS on loopback:
//! - cold fill: a sequential read through a cold cache vs a raw parallel ranged download of the
//!   same object with the same part size and concurrency;
//! - prefetch: a prefetch job of the object into a cold cache vs the same raw download;
//! - warm read: the same read from a warm cache (restarted, page cache dropped) vs reading the
//!   cache's data file directly;
//! - restart: time from opening a cache of N recorded blocks to its first hit.
//!
//! `larder-bench mount` compares `larder daemon` with rclone and s3fs-fuse through real kernel
//! mounts of the same bucket, against the same limits: cold, warm and page-cache reads, random
//! reads, many small files, concurrent readers and many readers of many files (see `mount`).
//!
//! `larder-bench models` loads generated safetensors models through the same mounts with the
//! real `safetensors` library, as inference engines load them (see `models`).

mod common;
mod engine;
mod fleet;
mod images;
mod models;
mod mount;
mod simulate;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use larder_config::ByteSize;

#[derive(Debug, Parser)]
#[command(about = "Larder benchmarks: ratios against the limit, measured side by side")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The block cache engine: cold fill, warm read, restart.
    Engine(EngineArgs),
    /// Reads through kernel mounts: Larder, rclone and s3fs-fuse against the limit.
    Mount(MountArgs),
    /// N daemons in network namespaces read one model at once, without and with rack peers.
    Fleet(FleetArgs),
    /// Safetensors loaders (key order, tensor-parallel ranks, load_file, a sharded model)
    /// through Larder, rclone and s3fs-fuse, against the download and the local file.
    Models(ModelsArgs),
    /// containerd pulls an image directly and through Larder's mirror: cold, warm, pre-pulled.
    Images(ImagesArgs),
    /// A discrete-event model of a fleet (1,000 nodes by default) scaling up one model, with the
    /// daemon's ownership code.
    Simulate(simulate::SimulateArgs),
}

/// Arguments of `larder-bench images`.
#[derive(Debug, clap::Args)]
pub(crate) struct ImagesArgs {
    /// Bytes of layers per platform of the two-platform image.
    #[arg(long, default_value = "1GiB")]
    layers: ByteSize,
    /// Rounds (BENCH.md asks for at least 5); the report gives the median and the spread.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// The `larder` binary under test.
    #[arg(long, default_value = "target/release/larder")]
    larder: PathBuf,
    /// Where the cache dirs go (the disk under test).
    #[arg(long, default_value = "bench/work")]
    work_dir: PathBuf,
    /// Write the report to this file as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Arguments of `larder-bench engine`.
#[derive(Debug, clap::Args)]
pub(crate) struct EngineArgs {
    /// Size of the benchmark object.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Cache block size.
    #[arg(long, default_value = "4MiB")]
    block_size: ByteSize,
    /// Interleaved rounds; the report gives the median and the spread.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Blocks in the synthetic cache of the restart benchmark.
    #[arg(long, default_value_t = 100_000)]
    restart_blocks: u32,
    /// The SeaweedFS binary (`bench/setup` installs it in bench/.venv).
    #[arg(long, default_value = "bench/.venv/bin/weed")]
    weed: PathBuf,
    /// Where the cache dirs go (the disk under test).
    #[arg(long, default_value = "bench/work")]
    work_dir: PathBuf,
    /// Write the report to this file as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Arguments of `larder-bench mount`.
#[derive(Debug, clap::Args)]
pub(crate) struct MountArgs {
    /// Size of the large file (cold, warm, page-cache, random and concurrent reads).
    #[arg(long, default_value = "2GiB")]
    size: ByteSize,
    /// Interleaved rounds; the report gives the median and the spread.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Number of small files, listed and read cold.
    #[arg(long, default_value_t = 10_000)]
    small_files: usize,
    /// Size of each small file.
    #[arg(long, default_value = "64KiB")]
    small_size: ByteSize,
    /// Concurrent readers of one cold file; also the threads reading the small files.
    #[arg(long, default_value_t = 16)]
    readers: usize,
    /// Readers of many cold files at once, each reading a file of its own (0 leaves the
    /// workload out); the mount's peak RSS is the figure to watch.
    #[arg(long, default_value_t = 64)]
    many_files: usize,
    /// Size of each of those files.
    #[arg(long, default_value = "32MiB")]
    many_size: ByteSize,
    /// The object store read: SeaweedFS over S3, or the emulator of GCS or Azure
    /// (`scripts/test` installs them); rclone and s3fs-fuse run over S3 only.
    #[arg(long, value_enum, default_value = "s3")]
    origin: mount::OriginKind,
    #[command(flatten)]
    systems: SystemArgs,
    /// Where mounts, cache dirs and the local copy go (the disk under test).
    #[arg(long, default_value = "bench/work")]
    work_dir: PathBuf,
    /// Write the report to this file as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The mounts compared by `larder-bench mount` and `larder-bench models`, and the store they
/// read.
#[derive(Debug, clap::Args)]
pub(crate) struct SystemArgs {
    /// The `larder` binary under test.
    #[arg(long, default_value = "target/release/larder")]
    larder: PathBuf,
    /// The SeaweedFS binary (`bench/setup` installs it in bench/.venv).
    #[arg(long, default_value = "bench/.venv/bin/weed")]
    weed: PathBuf,
    /// The rclone binary (`bench/setup` installs it in bench/.venv).
    #[arg(long, default_value = "bench/.venv/bin/rclone")]
    rclone: PathBuf,
    /// The s3fs binary (`bench/setup` installs the Debian package).
    #[arg(long, default_value = "s3fs")]
    s3fs: PathBuf,
    /// Leave rclone out (where it is not installed).
    #[arg(long)]
    no_rclone: bool,
    /// Leave s3fs-fuse out (where it is not installed).
    #[arg(long)]
    no_s3fs: bool,
}

/// Arguments of `larder-bench models`.
#[derive(Debug, clap::Args)]
pub(crate) struct ModelsArgs {
    /// Size of the model: one file, and the same tensors in 8 shards.
    #[arg(long, default_value = "2GiB")]
    size: ByteSize,
    /// Interleaved rounds; the report gives the median and the spread.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[command(flatten)]
    systems: SystemArgs,
    /// The Python that runs the loaders, with safetensors and numpy (`bench/setup` installs
    /// them in bench/.venv).
    #[arg(long, default_value = "bench/.venv/bin/python")]
    python: PathBuf,
    /// Where mounts, cache dirs and the local copy go (the disk under test).
    #[arg(long, default_value = "bench/work")]
    work_dir: PathBuf,
    /// Write the report to this file as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Arguments of `larder-bench fleet`.
#[derive(Debug, clap::Args)]
pub(crate) struct FleetArgs {
    /// Nodes: daemons, each in a network namespace of its own.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Size of the model every node reads.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Bandwidth of the origin's link, shared by all nodes, in bytes a second.
    #[arg(long, default_value = "100MB")]
    origin_rate: ByteSize,
    /// Bandwidth of each node's link to the rack, each way, in bytes a second.
    #[arg(long, default_value = "1250MB")]
    rack_rate: ByteSize,
    /// Racks the nodes are split into, in order (each rack's nodes on a bridge of its own).
    #[arg(long, default_value_t = 1)]
    racks: usize,
    /// Bandwidth of each rack's uplink to the spine (where the origin is), each way, in bytes
    /// a second; with one rack there is no uplink.
    #[arg(long, default_value = "1250MB")]
    uplink_rate: ByteSize,
    /// Rounds, each without peers and then with; the report gives the median and the spread.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The `larder` binary under test.
    #[arg(long, default_value = "target/release/larder")]
    larder: PathBuf,
    /// The SeaweedFS binary (`bench/setup` installs it in bench/.venv).
    #[arg(long, default_value = "bench/.venv/bin/weed")]
    weed: PathBuf,
    /// Where mounts and cache dirs go (the disk under test).
    #[arg(long, default_value = "bench/work")]
    work_dir: PathBuf,
    /// Write the report to this file as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep each daemon's log of each round in this directory
    /// (`round-R-{alone,peers}-nI.log`).
    #[arg(long)]
    keep_logs: Option<PathBuf>,
    /// The daemons' log filter (`LARDER_LOG`), e.g. `info,larder_peers=debug`.
    #[arg(long, default_value = "info")]
    daemon_log: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Engine(args) => engine::run(args).await,
        Command::Mount(args) => {
            // The mount benchmark blocks on file reads; the runtime keeps serving the proxy.
            let runtime = tokio::runtime::Handle::current();
            tokio::task::spawn_blocking(move || mount::run(args, &runtime)).await?
        }
        Command::Models(args) => {
            // Loads block on child processes; the runtime keeps serving the proxy.
            let runtime = tokio::runtime::Handle::current();
            tokio::task::spawn_blocking(move || models::run(args, &runtime)).await?
        }
        Command::Simulate(args) => tokio::task::spawn_blocking(move || simulate::run(args)).await?,
        Command::Images(args) => {
            let runtime = tokio::runtime::Handle::current();
            tokio::task::spawn_blocking(move || images::run(args, &runtime)).await?
        }
        Command::Fleet(args) => {
            let runtime = tokio::runtime::Handle::current();
            let mut run = tokio::task::spawn_blocking(move || fleet::run(args, &runtime));
            // Ctrl-C stops the daemons; the run then fails and deletes its namespaces.
            tokio::select! {
                result = &mut run => result?,
                _ = tokio::signal::ctrl_c() => {
                    eprintln!("interrupted: stopping the daemons and deleting the namespaces");
                    fleet::interrupt();
                    run.await?
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_defaults_are_the_full_size_run() {
        let Command::Mount(args) = Cli::try_parse_from(["larder-bench", "mount"]).unwrap().command else {
            panic!("not the mount command");
        };
        assert_eq!(args.size, ByteSize::gib(2));
        assert_eq!(args.small_size, ByteSize::kib(64));
        assert_eq!((args.rounds, args.small_files, args.readers), (5, 10_000, 16));
        assert_eq!((args.many_files, args.many_size), (64, ByteSize::mib(32)));
        assert_eq!(args.systems.larder, PathBuf::from("target/release/larder"));
        assert!(!args.systems.no_rclone && !args.systems.no_s3fs && args.out.is_none());
    }

    #[test]
    fn models_defaults_are_a_2_gib_model_in_3_rounds() {
        let Command::Models(args) = Cli::try_parse_from(["larder-bench", "models"]).unwrap().command else {
            panic!("not the models command");
        };
        assert_eq!((args.size, args.rounds), (ByteSize::gib(2), 3));
        assert_eq!(args.python, PathBuf::from("bench/.venv/bin/python"));
        assert_eq!(args.systems.larder, PathBuf::from("target/release/larder"));
        assert!(!args.systems.no_rclone && !args.systems.no_s3fs && args.out.is_none());
    }

    #[test]
    fn fleet_defaults_are_four_nodes_behind_a_100_mb_s_origin() {
        let Command::Fleet(args) = Cli::try_parse_from(["larder-bench", "fleet"]).unwrap().command else {
            panic!("not the fleet command");
        };
        assert_eq!((args.nodes, args.rounds), (4, 3));
        assert_eq!(args.size, ByteSize::gib(1));
        assert_eq!(args.origin_rate.as_u64(), 100_000_000);
        assert_eq!(args.rack_rate.as_u64(), 1_250_000_000);
        assert!(args.out.is_none());
    }
}
