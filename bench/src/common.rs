//! What every benchmark needs: the raw download (the limit of a cold read), uploads,
//! page-cache drops, medians with their spread as a report shows them, and the date and the
//! machine a report was made on.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt};

/// Drops the page cache so reads come from the disk; false where that is not allowed. Dirty
/// pages are written back first: a file written just before (a local copy) would otherwise
/// keep its pages, and a read of it would be a read of memory.
pub(crate) fn drop_page_cache() -> bool {
    // SAFETY: sync takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let dropped = std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
    // These machines are VMs whose host takes freed guest memory back shortly after it is
    // freed (free page reporting); a read that starts at once finds some pages still mapped and
    // is faster than one that starts later. Waiting out the report starts every step alike.
    if dropped {
        std::thread::sleep(PAGE_REPORT_SETTLE);
    }
    dropped
}

/// How long the host takes to reclaim memory freed by dropping the page cache.
const PAGE_REPORT_SETTLE: Duration = Duration::from_secs(3);

/// Starts a new peak-RSS measurement (VmHWM) of process `pid`; false where that is refused,
/// and the peak then covers the process's whole life.
pub(crate) fn reset_peak_rss(pid: u32) -> bool {
    // Writing "5" to clear_refs resets the resident set's high-water mark.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// Peak resident set size of process `pid` since the last reset, in MiB.
pub(crate) fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// CPU seconds (user + system) process `pid` has used since it started; None once it is gone.
pub(crate) fn process_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    // Field 3 (state) is then the first; utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / ticks)
}

/// How a report's figures sum up its `rounds`: medians with their min–max, where there is
/// a median (BENCH.md: with 2 rounds there is none).
pub(crate) fn rounds_note(rounds: usize) -> String {
    match rounds {
        1 => "1 round".to_owned(),
        2 => "2 rounds: no median, the higher of the two with the min–max".to_owned(),
        n => format!("{n} rounds, medians (min–max)"),
    }
}

/// Median and (min, max) of a non-empty sample.
pub(crate) fn summary(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let median = values[values.len() / 2];
    (median, values[0], values[values.len() - 1])
}

/// The limit for a cold read of `key`: ranged GETs of `part` bytes, `concurrency` at a time.
pub(crate) async fn raw_download(
    store: &Arc<dyn ObjectStore>,
    key: &str,
    size: u64,
    part: u64,
    concurrency: usize,
) -> anyhow::Result<Duration> {
    raw_download_all(store, &[(key, size)], part, concurrency).await
}

/// The limit for a cold read of several objects, each `(key, size)`: ranged GETs of `part`
/// bytes of one object after the other, `concurrency` at a time across them.
pub(crate) async fn raw_download_all(
    store: &Arc<dyn ObjectStore>,
    objects: &[(&str, u64)],
    part: u64,
    concurrency: usize,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let ranges = objects.iter().flat_map(|&(key, size)| {
        let path = StorePath::from(key);
        (0..size.div_ceil(part)).map(move |i| (path.clone(), i * part..size.min((i + 1) * part)))
    });
    let mut parts = futures::stream::iter(ranges)
        .map(|(path, range)| async move { store.get_range(&path, range).await })
        .buffer_unordered(concurrency);
    let mut total = 0;
    while let Some(bytes) = parts.next().await {
        total += bytes?.len() as u64;
    }
    let size: u64 = objects.iter().map(|&(_, size)| size).sum();
    anyhow::ensure!(total == size, "downloaded {total} of {size} bytes");
    Ok(started.elapsed())
}

/// Uploads `size` bytes of deterministic content at `key` (seeded by the key), trying three
/// times: the server is sometimes slow to take a large upload.
pub(crate) async fn upload_with_retries(store: &dyn ObjectStore, key: &str, size: u64) -> anyhow::Result<()> {
    with_retries(key, || {
        larder_tests::upload(store, key, larder_tests::seed(key, 0), size)
    })
    .await
}

/// Uploads the file at `path` to `key`, trying three times.
pub(crate) async fn upload_file_with_retries(
    store: &dyn ObjectStore,
    key: &str,
    path: &Path,
) -> anyhow::Result<()> {
    with_retries(key, || upload_file(store, key, path)).await
}

/// Runs the upload of `key` that `attempt` starts until it succeeds, three times at most.
async fn with_retries<F: Future<Output = anyhow::Result<()>>>(
    key: &str,
    attempt: impl Fn() -> F,
) -> anyhow::Result<()> {
    let mut failed = 0;
    while let Err(error) = attempt().await {
        failed += 1;
        anyhow::ensure!(failed < 3, "uploading {key} failed 3 times: {error}");
        eprintln!("upload of {key} failed ({error}); retrying");
    }
    Ok(())
}

/// Uploads a local file in parts of 32 MiB, at most 8 of them held at once.
async fn upload_file(store: &dyn ObjectStore, key: &str, path: &Path) -> anyhow::Result<()> {
    use std::io::Read;
    const PART: usize = 32 << 20;
    let mut file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let upload = store.put_multipart(&StorePath::from(key)).await?;
    let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, PART);
    let mut buf = vec![0; PART];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        writer.wait_for_capacity(8).await?;
        writer.write(&buf[..n]);
    }
    writer.finish().await?;
    Ok(())
}

/// Prints a finished report, and writes it to `out` if given.
pub(crate) fn publish(report: &str, out: Option<&Path>) -> anyhow::Result<()> {
    print!("{report}");
    if let Some(out) = out {
        std::fs::write(out, report).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// The date and time now, in UTC, for a report's header.
pub(crate) fn utc_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%F %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// A number with as many decimals as its size deserves.
pub(crate) fn number(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// A ratio, with two decimals.
pub(crate) fn ratio(x: f64) -> String {
    format!("{x:.2}")
}

/// The median of `values` with its min–max, or a dash for no values.
pub(crate) fn spread(values: Vec<f64>, show: fn(f64) -> String) -> String {
    match values.len() {
        0 => "—".to_owned(),
        1 => show(values[0]),
        _ => {
            let (median, min, max) = summary(values);
            format!("{} ({}–{})", show(median), show(min), show(max))
        }
    }
}

/// One line naming the commit, the cores, the CPU model and the kernel.
pub(crate) fn machine() -> String {
    let commit = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    format!(
        "commit {commit}; {cores} cores, {cpu}; kernel {kernel}",
        cores = std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
    )
}
