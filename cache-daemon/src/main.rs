//! The `larder` command.

use std::io::Write as _;

use clap::{Parser, Subcommand};
use larder_cache_daemon::cli::{self, PrefetchArgs, SealArgs, StatusArgs, UnpinArgs};
use larder_cache_daemon::containerd::{self, ContainerdConfigArgs};
use larder_cache_daemon::daemon::{self, DaemonArgs};
use larder_config::Redacted;

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
    Daemon(Box<DaemonArgs>),
    /// Fill the cache with objects before a job needs them.
    Prefetch(PrefetchArgs),
    /// Release objects pinned by `prefetch --pin`.
    Unpin(UnpinArgs),
    /// Show how the cache is doing.
    Status(StatusArgs),
    /// Write a manifest of each object's block hashes into its source, against which blocks
    /// from rack peers are checked.
    Seal(SealArgs),
    /// Write containerd's hosts.toml files: the configured registries pulled through the
    /// node's registry mirror, straight from the registry when it does not answer.
    ContainerdConfig(Box<ContainerdConfigArgs>),
}

/// One log line, written to stderr whole when dropped, with the secrets of every URL in it
/// hidden: the daemon's own lines name source URLs redacted already, but the errors of the
/// stores and HTTP clients it uses quote request URLs, queries included.
#[derive(Default)]
struct RedactedLine(Vec<u8>);

impl std::io::Write for RedactedLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for RedactedLine {
    fn drop(&mut self) {
        let line = String::from_utf8_lossy(&self.0);
        let _ = write!(std::io::stderr().lock(), "{}", Redacted(&line));
    }
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LARDER_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(RedactedLine::default)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            // One line with its causes; a backtrace helps nobody who ran a command.
            eprintln!("larder: {}", Redacted(&cli::error_line(&error)));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let ok = std::process::ExitCode::SUCCESS;
    match cli.command {
        Command::Daemon(args) => runtime
            .block_on(daemon::run(*args))
            .map(|()| ok)
            .map_err(Into::into),
        Command::Prefetch(args) => runtime.block_on(cli::prefetch(args)),
        Command::Unpin(args) => runtime.block_on(cli::unpin(args)).map(|()| ok),
        Command::Status(args) => runtime.block_on(cli::status(args)).map(|()| ok),
        Command::Seal(args) => runtime.block_on(cli::seal(args)),
        Command::ContainerdConfig(args) => containerd::run(*args).map(|()| ok),
    }
}
