//! `larder prefetch`, `unpin`, `seal` and `status`: clients of the daemon's control socket. They speak
//! the wire types of [`larder_control_api`] and nothing else of the daemon.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use indicatif::{HumanBytes, HumanDuration, ProgressBar, ProgressStyle};
use larder_control_api::{
    self as control_api, self, ErrorBody, JobReport, JobState, MemberHealth, Peers, Plan, SealReport,
    SealRequest, SealState, Status, TargetsRequest, Unpinned, printable_key,
};
use serde::de::DeserializeOwned;

/// Where the daemon listens for control requests unless told otherwise.
pub const DEFAULT_SOCKET: &str = larder_config::DEFAULT_CONTROL_SOCKET;

/// Finished jobs `larder status` lists, the most recent.
const STATUS_FINISHED_JOBS: usize = 10;

/// How often `--wait` asks for progress.
const POLL: Duration = Duration::from_millis(250);

/// How often `--wait` prints a line when its output is not a terminal.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

/// Arguments of `larder prefetch`.
#[derive(Debug, Clone, clap::Args)]
pub struct PrefetchArgs {
    /// The daemon's control socket.
    #[arg(long, env = "LARDER_CONTROL_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Wait until every byte is cached and verified; exit non-zero if any is not.
    #[arg(long)]
    pub wait: bool,
    /// Keep the objects in the cache until `larder unpin`.
    #[arg(long)]
    pub pin: bool,
    /// A TOML plan: `targets = ["..."]`, `images = ["..."]`, and optionally `pin = true` and
    /// `platform = "os/arch"`.
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// The platform of image targets, `os/architecture[/variant]`; default the node's.
    #[arg(long)]
    pub platform: Option<String>,
    /// Paths under the mount (`/models/llama/...`, or relative to the current directory),
    /// `SOURCE:PREFIX`, URLs of configured sources (a prefix means every object under it), or
    /// container images as `image:REGISTRY/REPOSITORY[:TAG|@DIGEST]`.
    pub targets: Vec<String>,
}

/// Arguments of `larder status`.
#[derive(Debug, Clone, clap::Args)]
pub struct StatusArgs {
    /// The daemon's control socket.
    #[arg(long, env = "LARDER_CONTROL_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Print the status as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Sends one request to the control socket at `socket`, with the JSON `body`; the answer's JSON
/// body as `T`, or the daemon's error message as an error.
async fn call<T: DeserializeOwned>(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> anyhow::Result<T> {
    let (status, bytes) = exchange(socket, method, path, body)
        .await
        .map_err(|error| unreachable_daemon(socket, error))?;
    if status.is_success() {
        return serde_json::from_slice(&bytes)
            .with_context(|| format!("the daemon answered {status} with a body this client does not read"));
    }
    let message = serde_json::from_slice::<ErrorBody>(&bytes).map_or_else(
        |_| String::from_utf8_lossy(&bytes).into_owned(),
        |body| body.error,
    );
    match status {
        StatusCode::INSUFFICIENT_STORAGE => bail!("refused: {message}"),
        _ => bail!("the daemon answered {status}: {message}"),
    }
}

/// One request on the control socket: the answer's status and body.
async fn exchange(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> anyhow::Result<(hyper::StatusCode, Bytes)> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("connecting to the daemon's control socket {}", socket.display()))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let body = body.unwrap_or_default();
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "larder")
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    let bytes = response.into_body().collect().await?.to_bytes();
    Ok((status, bytes))
}

/// The error of a failed call, with a hint where no daemon listens on `socket`.
fn unreachable_daemon(socket: &Path, error: anyhow::Error) -> anyhow::Error {
    let refused = error.chain().find_map(|cause| {
        cause.downcast_ref::<std::io::Error>().filter(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            )
        })
    });
    match refused {
        Some(io) => anyhow::anyhow!(
            "no daemon answers on {} ({io}): start one with `larder daemon`, or name its \
             socket with --socket PATH (or LARDER_CONTROL_SOCKET)",
            socket.display()
        ),
        None => error,
    }
}

/// A target as the daemon takes it: a path relative to the current directory becomes absolute
/// (lexically: `.` and `..` are resolved here, symlinks are not followed). URLs (`s3://...`)
/// and `SOURCE:PREFIX` pass as they are, and so does an empty target (for the daemon to refuse,
/// naming it); a relative path with a colon is written `./a:b`.
fn absolute_target(target: String, cwd: &Path) -> String {
    let relative = target.starts_with("./") || target.starts_with("../") || target == "." || target == "..";
    if target.is_empty() || target.starts_with('/') || (!relative && target.contains(':')) {
        return target;
    }
    let mut path = cwd.to_path_buf();
    for component in Path::new(&target).components() {
        match component {
            std::path::Component::ParentDir => {
                path.pop();
            }
            std::path::Component::Normal(part) => path.push(part),
            std::path::Component::CurDir
            | std::path::Component::RootDir
            | std::path::Component::Prefix(_) => {}
        }
    }
    // A trailing slash means "everything under this prefix": keep it.
    let mut text = path.display().to_string();
    if target.ends_with('/') && !text.ends_with('/') {
        text.push('/');
    }
    text
}

/// Targets with relative paths made absolute against the current directory.
fn absolute_targets(targets: Vec<String>) -> anyhow::Result<Vec<String>> {
    let cwd = std::env::current_dir().context("finding the current directory for relative targets")?;
    Ok(targets
        .into_iter()
        .map(|target| absolute_target(target, &cwd))
        .collect())
}

/// Runs `larder prefetch`.
pub async fn prefetch(args: PrefetchArgs) -> anyhow::Result<ExitCode> {
    let mut targets = Vec::new();
    let mut pin = args.pin;
    let mut platform = args.platform;
    if let Some(path) = &args.plan {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading plan {}", path.display()))?;
        let plan: Plan = toml::from_str(&text).with_context(|| format!("plan {}", path.display()))?;
        targets.extend(plan.all_targets());
        pin |= plan.pin;
        platform = platform.or(plan.platform);
    }
    targets.extend(args.targets);
    let targets = absolute_targets(targets)?;
    if targets.is_empty() {
        bail!("nothing to prefetch: give targets or --plan FILE");
    }
    let body = TargetsRequest {
        targets,
        pin,
        platform,
    };
    let body = serde_json::to_vec(&body)?;
    let job: JobReport = call(&args.socket, Method::POST, control_api::PREFETCH, Some(body)).await?;
    eprintln!(
        "job {}: {} objects, {} planned{}",
        job.id,
        job.objects,
        HumanBytes(job.planned_bytes),
        if pin { ", pinned" } else { "" }
    );
    if !args.wait {
        return Ok(ExitCode::SUCCESS);
    }
    let job = wait(&args.socket, job).await?;
    let rate = job.fetched_bytes as f64 / job.elapsed_seconds.max(1e-3);
    eprintln!(
        "job {} {}: {} of {} cached ({} fetched at {}/s) in {:.1}s",
        job.id,
        match job.state {
            JobState::Done => "done",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::Running => "running",
        },
        HumanBytes(job.done_bytes),
        HumanBytes(job.planned_bytes),
        HumanBytes(job.fetched_bytes),
        HumanBytes(rate as u64),
        job.elapsed_seconds
    );
    for error in &job.errors {
        eprintln!("  {error}");
    }
    if let Some(line) = weakly_checked(&job) {
        eprintln!("  {line}");
    }
    Ok(
        if job.state == JobState::Done && job.done_bytes == job.planned_bytes {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}

/// Follows a job until it ends: a progress bar on a terminal, a line every few seconds
/// otherwise.
async fn wait(socket: &Path, mut job: JobReport) -> anyhow::Result<JobReport> {
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::new(job.planned_bytes);
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    let mut last_line = Instant::now();
    let path = control_api::job(job.id);
    while job.state == JobState::Running {
        tokio::time::sleep(POLL).await;
        job = call(socket, Method::GET, &path, None)
            .await
            .context("the daemon stopped answering; run the same command again to resume")?;
        match &bar {
            Some(bar) => bar.set_position(job.done_bytes),
            None if last_line.elapsed() >= PLAIN_EVERY => {
                last_line = Instant::now();
                eprintln!(
                    "job {}: {} of {} ({:.0}%)",
                    job.id,
                    HumanBytes(job.done_bytes),
                    HumanBytes(job.planned_bytes),
                    100.0 * job.done_bytes as f64 / job.planned_bytes.max(1) as f64
                );
            }
            None => {}
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(job)
}

fn percent(share: Option<f64>) -> String {
    share.map_or_else(|| "-".to_owned(), |rate| format!("{:.1}%", rate * 100.0))
}

/// A share of the bytes served, since start and over the last 5 minutes, on one line.
fn share_line(
    out: &mut impl std::fmt::Write,
    what: &str,
    all: Option<f64>,
    recent: Option<f64>,
) -> std::fmt::Result {
    writeln!(
        out,
        "{what} (bytes): {} since start, {} last 5 min",
        percent(all),
        percent(recent)
    )
}

/// Runs `larder status`.
pub async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let status: Status = call(&args.socket, Method::GET, control_api::STATUS, None).await?;
    let text = if args.json {
        let mut json = serde_json::to_string_pretty(&status)?;
        json.push('\n');
        json
    } else {
        status_text(&status)?
    };
    print_stdout(&text)
}

/// The status as `larder status` prints it.
fn status_text(status: &Status) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    let errors = &status.origin_errors;
    writeln!(
        out,
        "up {}; cache {} of {} ({} objects, {} pinned, {} blocks)",
        HumanDuration(Duration::from_secs(status.uptime_seconds)),
        HumanBytes(status.used_bytes),
        HumanBytes(status.capacity_bytes),
        status.objects,
        status.pinned_objects,
        status.blocks
    )?;
    if status.cache_dir_lost {
        writeln!(
            out,
            "CACHE DIR LOST: {} was deleted or replaced under the daemon; nothing is cached until it restarts",
            status.settings.cache_dir
        )?;
    }
    if let Some(error) = &status.cache_disk_failing {
        writeln!(
            out,
            "CACHE DISK FAILING: {error}; no file is handed to the kernel and reads go to the origin until a block write succeeds or the disk answers a recheck"
        )?;
    }
    let (all, recent) = (&status.served, &status.served_recent);
    share_line(&mut out, "hit rate", all.hit_rate, recent.hit_rate)?;
    if status.peers.is_some() {
        share_line(&mut out, "from rack peers", all.peer_share, recent.peer_share)?;
    }
    writeln!(
        out,
        "served through the daemon: {} from nvme, {} from peers, {} from origin",
        HumanBytes(status.served.nvme_bytes),
        HumanBytes(status.served.peer_bytes),
        HumanBytes(status.served.origin_bytes)
    )?;
    writeln!(
        out,
        "opened in passthrough: {} files, {} (read by the kernel from the cache disk; at most this much was read)",
        status.served.passthrough_opens,
        HumanBytes(status.served.passthrough_bytes)
    )?;
    let lookups = &status.lookups;
    writeln!(
        out,
        "block lookups: {} hit, {} miss (started a fill), {} joined (waited for a fill under way), {} corrupt; readahead started {} block fills",
        lookups.hit, lookups.miss, lookups.joined, lookups.corrupt, lookups.readahead
    )?;
    writeln!(
        out,
        "evicted: {} blocks ({}); cache writes failed or skipped: {}",
        status.evicted_blocks,
        HumanBytes(status.evicted_bytes),
        status.cache_write_failures
    )?;
    writeln!(
        out,
        "origin: {} requests; errors: {} not found, {} denied, {} changed, {} transient, {} other",
        status.origin_requests,
        errors.not_found,
        errors.permission,
        errors.version_changed,
        errors.transient,
        errors.other
    )?;
    peers_text(&mut out, status.peers.as_ref())?;
    let counts = &status.job_counts;
    writeln!(
        out,
        "prefetch jobs: {} running, {} done, {} failed, {} cancelled",
        counts.running, counts.done, counts.failed, counts.cancelled
    )?;
    let failed: Vec<String> = status
        .failed_objects
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(cause, n)| format!("{n} {}", cause.name()))
        .collect();
    if !failed.is_empty() {
        writeln!(out, "prefetch objects failed: {}", failed.join(", "))?;
    }
    // The running jobs and the last few finished; `--json` has every job the daemon keeps.
    let finished = status
        .jobs
        .iter()
        .filter(|job| job.state != JobState::Running)
        .count();
    let skip = finished.saturating_sub(STATUS_FINISHED_JOBS);
    let mut finished_seen = 0;
    for job in &status.jobs {
        if job.state != JobState::Running {
            finished_seen += 1;
            if finished_seen <= skip {
                continue;
            }
        }
        writeln!(
            out,
            "job {}: {:?}, {} of {}",
            job.id,
            job.state,
            HumanBytes(job.done_bytes),
            HumanBytes(job.planned_bytes)
        )?;
    }
    let settings = &status.settings;
    writeln!(
        out,
        "mount {}; cache dir {}; block size {}",
        settings.mount,
        settings.cache_dir,
        HumanBytes(settings.block_size)
    )?;
    for source in &settings.sources {
        writeln!(out, "source {source}")?;
    }
    Ok(out)
}

/// The rack peers' lines of `larder status`: this node, bytes from each rack, each member.
fn peers_text(out: &mut String, peers: Option<&Peers>) -> std::fmt::Result {
    let Some(peers) = peers else {
        return writeln!(out, "peers: off");
    };
    let rack = |rack: &str| {
        if rack.is_empty() {
            "-".to_owned()
        } else {
            rack.to_owned()
        }
    };
    writeln!(
        out,
        "peers: this node is {} in rack {}; {} other members",
        peers.node_id,
        rack(&peers.rack),
        peers
            .members
            .iter()
            .filter(|m| m.state != MemberHealth::This)
            .count()
    )?;
    if !peers.received_by_rack.is_empty() {
        let racks: Vec<String> = peers
            .received_by_rack
            .iter()
            .map(|r| format!("{} from rack {}", HumanBytes(r.bytes), rack(&r.rack)))
            .collect();
        // By level: within this node's rack, and across racks (from runs' fleet owners).
        let across: u64 = peers
            .received_by_rack
            .iter()
            .filter(|r| r.rack != peers.rack)
            .map(|r| r.bytes)
            .sum();
        writeln!(
            out,
            "received from peers: {} ({} across racks)",
            racks.join(", "),
            HumanBytes(across)
        )?;
    }
    for member in peers.members.iter().filter(|m| m.state != MemberHealth::This) {
        let state = match (member.state, member.retry_in_seconds) {
            (MemberHealth::Down, Some(seconds)) => format!("down (asked again in {seconds} s)"),
            (MemberHealth::Down, None) => "down".to_owned(),
            (MemberHealth::Up, _) => "up".to_owned(),
            (MemberHealth::Unknown | MemberHealth::This, _) => "unknown".to_owned(),
        };
        writeln!(
            out,
            "peer {} (rack {}, {}): {}, {} failures in a row, {} received",
            member.id,
            rack(&member.rack),
            member.address,
            state,
            member.failures,
            HumanBytes(member.received_bytes)
        )?;
        if let Some(note) = &member.note {
            writeln!(out, "  {note}")?;
        }
    }
    Ok(())
}

/// What a finished job says of the objects whose blocks from rack peers were not proven the
/// origin's, if any: they are cached, and no proof against a member that lies.
fn weakly_checked(job: &JobReport) -> Option<String> {
    let (crc, none) = (job.crc_only_objects, job.unchecked_objects);
    if crc + none == 0 {
        return None;
    }
    Some(format!(
        "blocks from rack peers of {crc} object(s) checked against the origin's CRC only and of \
         {none} not checked (the origin publishes nothing stronger): no corruption in the first, \
         but no proof against a member that lies; `larder seal` them for that"
    ))
}

/// An error and its causes on one line, `: ` between them, leaving out each cause whose text
/// the line holds already: most errors here quote their cause in their own message.
pub fn error_line(error: &anyhow::Error) -> String {
    let mut line = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

/// Writes `text` to stdout. A reader that went away (`larder status | head`) is not an
/// error: the command ends quietly, as it would have had it printed everything.
fn print_stdout(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(error).context("writing to stdout"))
        }
        _ => Ok(()),
    }
}

/// Arguments of `larder unpin`.
#[derive(Debug, Clone, clap::Args)]
pub struct UnpinArgs {
    /// The daemon's control socket.
    #[arg(long, env = "LARDER_CONTROL_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// The platform of image targets, as for `larder prefetch`.
    #[arg(long)]
    pub platform: Option<String>,
    /// Targets, as for `larder prefetch`.
    #[arg(required = true)]
    pub targets: Vec<String>,
}

/// Runs `larder unpin`.
pub async fn unpin(args: UnpinArgs) -> anyhow::Result<()> {
    let body = TargetsRequest {
        targets: absolute_targets(args.targets)?,
        pin: false,
        platform: args.platform,
    };
    let body = serde_json::to_vec(&body)?;
    let answer: Unpinned = call(&args.socket, Method::POST, control_api::UNPIN, Some(body)).await?;
    print_stdout(&format!("unpinned {} objects\n", answer.unpinned))
}

/// Arguments of `larder seal`.
#[derive(Debug, Clone, clap::Args)]
pub struct SealArgs {
    /// The daemon's control socket.
    #[arg(long, env = "LARDER_CONTROL_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Wait until every object is sealed; print each one's outcome; exit non-zero if any
    /// failed.
    #[arg(long)]
    pub wait: bool,
    /// `SOURCE:PREFIX`, paths under the mount, or URLs of configured sources; a prefix means
    /// every object under it.
    #[arg(required = true)]
    pub targets: Vec<String>,
}

/// Runs `larder seal`.
pub async fn seal(args: SealArgs) -> anyhow::Result<ExitCode> {
    let body = SealRequest {
        targets: absolute_targets(args.targets)?,
    };
    let body = serde_json::to_vec(&body)?;
    let mut job: SealReport = call(&args.socket, Method::POST, control_api::SEAL, Some(body)).await?;
    eprintln!(
        "seal job {}: {} objects, {} to read and hash",
        job.id,
        job.objects.len(),
        HumanBytes(job.planned_bytes)
    );
    if !args.wait {
        return Ok(ExitCode::SUCCESS);
    }
    let path = control_api::seal_job(job.id);
    let mut last_line = Instant::now();
    while job.state == JobState::Running {
        tokio::time::sleep(POLL).await;
        job = call(&args.socket, Method::GET, &path, None)
            .await
            .context("the daemon stopped answering; run the same command again to seal what is left")?;
        if last_line.elapsed() >= PLAIN_EVERY {
            last_line = Instant::now();
            eprintln!(
                "seal job {}: {} of {} hashed",
                job.id,
                HumanBytes(job.hashed_bytes),
                HumanBytes(job.planned_bytes)
            );
        }
    }
    let mut out = String::new();
    for object in &job.objects {
        match (object.state, &object.error) {
            (SealState::Sealed, _) => writeln!(
                out,
                "sealed {} -> {}",
                printable_key(&object.key),
                printable_key(&object.manifest)
            )?,
            (SealState::Failed, Some(error)) => {
                writeln!(out, "failed {}: {error}", printable_key(&object.key))?
            }
            (state, _) => writeln!(out, "{state:?} {}", printable_key(&object.key))?,
        }
    }
    print_stdout(&out)?;
    let sealed = job
        .objects
        .iter()
        .filter(|o| o.state == SealState::Sealed)
        .count();
    eprintln!(
        "seal job {} {:?}: {sealed} of {} objects sealed in {:.1}s",
        job.id,
        job.state,
        job.objects.len(),
        job.elapsed_seconds
    );
    Ok(if job.state == JobState::Done {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_targets_become_absolute_and_others_pass() {
        let cwd = Path::new("/models/llama");
        for (target, expected) in [
            ("model.safetensors", "/models/llama/model.safetensors"),
            ("./shards/", "/models/llama/shards/"),
            ("../datasets/x", "/models/datasets/x"),
            (".", "/models/llama"),
            ("./a:b", "/models/llama/a:b"),
            ("/models/other", "/models/other"),
            ("models:llama/", "models:llama/"),
            ("s3://bucket/models", "s3://bucket/models"),
            ("", ""),
        ] {
            assert_eq!(absolute_target(target.to_owned(), cwd), expected, "{target}");
        }
    }

    #[test]
    fn status_lists_the_peers_or_says_they_are_off() {
        let mut out = String::new();
        peers_text(&mut out, None).unwrap();
        assert_eq!(out, "peers: off\n");

        let member = |id: &str, rack: &str, state, retry, failures, received| control_api::MemberState {
            id: id.into(),
            rack: rack.into(),
            address: format!("{id}.rack:7070"),
            state,
            retry_in_seconds: retry,
            failures,
            received_bytes: received,
            note: (rack.is_empty()).then(|| "rack not known".to_owned()),
        };
        let peers = Peers {
            node_id: "a".into(),
            rack: "r1".into(),
            members: vec![
                member("a", "r1", MemberHealth::This, None, 0, 0),
                member("b", "r1", MemberHealth::Up, None, 0, 3 << 20),
                member("c", "", MemberHealth::Down, Some(17), 2, 0),
            ],
            received_by_rack: vec![
                control_api::RackBytes {
                    rack: "r1".into(),
                    bytes: 3 << 20,
                },
                control_api::RackBytes {
                    rack: "r2".into(),
                    bytes: 1 << 20,
                },
            ],
        };
        let mut out = String::new();
        peers_text(&mut out, Some(&peers)).unwrap();
        assert_eq!(
            out,
            "peers: this node is a in rack r1; 2 other members\n\
             received from peers: 3.00 MiB from rack r1, 1.00 MiB from rack r2 (1.00 MiB across racks)\n\
             peer b (rack r1, b.rack:7070): up, 0 failures in a row, 3.00 MiB received\n\
             peer c (rack -, c.rack:7070): down (asked again in 17 s), 2 failures in a row, 0 B received\n  \
             rack not known\n"
        );
    }

    #[test]
    fn an_error_line_says_each_cause_once() {
        let quoting = anyhow::Error::new(crate::daemon::DaemonError::PeerListen {
            address: "127.0.0.1:7070".parse().unwrap(),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        });
        let line = error_line(&quoting);
        assert_eq!(line.matches("address in use").count(), 1, "{line}");
        let wrapped = anyhow::anyhow!("inner cause").context("outer");
        assert_eq!(error_line(&wrapped), "outer: inner cause");
    }

    #[test]
    fn a_missing_socket_gets_a_hint() {
        let socket = Path::new("/run/nowhere/control.sock");
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let error = unreachable_daemon(socket, anyhow::Error::new(io).context("connecting"));
        let text = format!("{error:#}");
        assert!(
            text.contains("/run/nowhere/control.sock")
                && text.contains("larder daemon")
                && text.contains("--socket"),
            "{text}"
        );
        let other = unreachable_daemon(socket, anyhow::anyhow!("the daemon answered 500"));
        assert_eq!(other.to_string(), "the daemon answered 500");
    }
}
