//! The `larder` command.

use clap::{Parser, Subcommand};
use larder_cache_daemon::daemon::{self, DaemonArgs};

/// Larder: a node-local cache for GPU clusters.
#[derive(Debug, Parser)]
#[command(name = "larder", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the sources through a FUSE mount backed by the NVMe block cache.
    Daemon(DaemonArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LARDER_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Command::Daemon(args) => runtime.block_on(daemon::run(args))?,
    }
    Ok(())
}
