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

mod common;
mod engine;

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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Engine(args) => engine::run(args).await,
    }
}
