//! The markdown report of a mount benchmark: a summary of ratios to the limit, then one table
//! per workload with every figure, each the median of the rounds with its min–max.

use std::fmt::Write;
use std::time::Duration;

use larder_config::OriginConfig;

use super::run_log::RunLog;
use super::systems::{Setup, System};
use super::workloads::Latency;
use super::{RANDOM_LARGE, RANDOM_SMALL, Round, Sample, Workload};
use crate::MountArgs;
use crate::common::{machine, number, ratio, rounds_note, spread, utc_now};

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

/// What the report is made of.
#[derive(Debug)]
pub(crate) struct Context<'a> {
    pub(crate) args: &'a MountArgs,
    pub(crate) rounds: &'a [Round],
    pub(crate) run: Run<'a>,
}

/// What a report of a benchmark through mounts says of its run besides the figures.
#[derive(Debug)]
pub(crate) struct Run<'a> {
    /// Each mount system and its version.
    pub(crate) versions: Vec<(System, String)>,
    pub(crate) failures: &'a [String],
    /// Whether the page cache could be dropped (root).
    pub(crate) dropped: bool,
    pub(crate) duration: Duration,
    /// `LARDER_MEMORY_LIMIT` as the daemon inherited it; None for its default.
    pub(crate) memory_budget: Option<String>,
    /// The object store read.
    pub(crate) origin: &'static str,
}

impl Workload {
    /// What the systems do.
    fn title(self, args: &MountArgs) -> String {
        match self {
            Workload::Cold => format!(
                "Cold sequential read of the {} file (1 MiB reads; cache wiped, page cache dropped, mount restarted)",
                args.size
            ),
            Workload::Warm => "Warm read: the first whole read after the mount restarted on its cache (and after the random reads), page cache dropped; Larder checks each block on its first read after a start, so this read goes through the daemon".to_owned(),
            Workload::WarmAgain => "Warm read again, page cache dropped: Larder now hands the kernel the cached file (FUSE passthrough)".to_owned(),
            Workload::PageCache => "Page-cache re-read (right after the second warm read; for Larder, after its data file was read as the limit of that read, which leaves the same pages cached, since passthrough reads go to the data file)".to_owned(),
            Workload::Mmap => "Whole file through `mmap` (1 MiB copies out of the mapping, `MADV_SEQUENTIAL`), page cache dropped".to_owned(),
            Workload::Random4k => format!(
                "Random reads: {} × 4 KiB at seeded 4 KiB-aligned offsets, one at a time, cached data, page cache dropped; the first reads after the restart (Larder: through the daemon)",
                RANDOM_SMALL.1
            ),
            Workload::Random1m => format!(
                "Random reads: {} × 1 MiB at seeded 4 KiB-aligned offsets, one at a time, cached data, page cache dropped; right after the 4 KiB reads",
                RANDOM_LARGE.1
            ),
            Workload::SmallFiles => format!(
                "{} files of {}, cold: list the directory, then read every file on {} threads",
                args.small_files, args.small_size, args.readers
            ),
            Workload::Readers => format!(
                "{} concurrent readers of one cold {} file, each reading all of it (throughput: bytes delivered to all readers)",
                args.readers, args.size
            ),
            Workload::ManyFiles => format!(
                "{} concurrent readers, each reading a cold file of {} of its own in 1 MiB reads (cache wiped, page cache dropped, mount restarted); the figure to watch is the mount's peak RSS",
                args.many_files, args.many_size
            ),
        }
    }

    /// What the limit does.
    fn limit(self, args: &MountArgs) -> String {
        let origin = OriginConfig::default();
        let raw = format!(
            "a raw parallel download through the same proxy ({} ranged GETs of {} in flight)",
            origin.concurrency, origin.part_size
        );
        match self {
            Workload::Cold => raw,
            Workload::Warm => "a local copy of the same bytes, read after dropping the page cache".to_owned(),
            Workload::WarmAgain => "Larder's own data file of the large file, read directly in 1 MiB reads after dropping the page cache, right after Larder's read of this row: the same file with the same history (the daemon's first warm read reads it with O_DIRECT, and on these VMs a file last read so reads slower buffered than one last read buffered, as the local copy is); rclone's and s3fs's ratios are to this Larder data file too".to_owned(),
            Workload::PageCache => "the local copy, re-read from the page cache".to_owned(),
            Workload::Mmap => "the local copy through `mmap`, page cache dropped".to_owned(),
            Workload::Random4k | Workload::Random1m => {
                "the same reads on the local copy, page cache dropped".to_owned()
            }
            Workload::SmallFiles => format!(
                "a listing, then a GET of every file, {} in flight, through the proxy",
                args.readers
            ),
            Workload::Readers => format!("{raw}, counted as delivered to each reader"),
            Workload::ManyFiles => format!(
                "a GET of each whole object, all {} in flight, through the proxy",
                args.many_files
            ),
        }
    }

    /// The workload's name in tables.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Workload::Cold => "cold sequential",
            Workload::Warm => "warm sequential, first read",
            Workload::WarmAgain => "warm sequential, again",
            Workload::PageCache => "page-cache re-read",
            Workload::Mmap => "mmap sequential",
            Workload::Random4k => "random 4 KiB",
            Workload::Random1m => "random 1 MiB",
            Workload::SmallFiles => "small files",
            Workload::Readers => "concurrent readers",
            Workload::ManyFiles => "many readers of many files",
        }
    }

    /// Whether the run measured this workload (`--many-files 0` leaves one out).
    fn measured(self, args: &MountArgs) -> bool {
        self != Workload::ManyFiles || args.many_files > 0
    }

    /// Whether each read was timed: the random reads, one at a time.
    fn timed(self) -> bool {
        matches!(self, Workload::Random4k | Workload::Random1m)
    }

    /// Random 4 KiB reads are counted in operations, the rest in bytes.
    fn per_op(self) -> bool {
        self == Workload::Random4k
    }

    pub(crate) fn unit(self) -> &'static str {
        if self.per_op() { "ops/s" } else { "MiB/s" }
    }
}

impl Sample {
    /// MiB/s, or operations/s for random 4 KiB reads.
    pub(crate) fn throughput(&self, workload: Workload) -> f64 {
        let per_s = if workload.per_op() {
            self.work.ops as f64
        } else {
            self.work.bytes as f64 / MIB
        };
        per_s / self.work.elapsed.as_secs_f64()
    }

    /// GiB handed to the readers.
    fn served_gib(&self) -> f64 {
        self.work.bytes as f64 / GIB
    }
}

impl Context<'_> {
    /// `figure` of `system`'s sample in each round where it has one.
    fn each(&self, workload: Workload, system: System, figure: impl Fn(&Sample) -> Option<f64>) -> Vec<f64> {
        self.rounds
            .iter()
            .filter_map(|round| round.get(&(workload, system)).and_then(&figure))
            .collect()
    }

    /// The ratio of `a`'s throughput to `b`'s, in each round where both have one.
    fn ratios(&self, workload: Workload, a: System, b: System) -> Vec<f64> {
        self.rounds
            .iter()
            .filter_map(|round| {
                let a = round.get(&(workload, a))?.throughput(workload);
                let b = round.get(&(workload, b))?.throughput(workload);
                Some(a / b)
            })
            .collect()
    }

    fn systems(&self) -> impl Iterator<Item = System> + '_ {
        std::iter::once(System::Limit).chain(self.run.versions.iter().map(|(s, _)| *s))
    }

    fn summary_table(&self, out: &mut String) {
        let mounts: Vec<System> = self.run.versions.iter().map(|(s, _)| *s).collect();
        let _ = write!(out, "| workload | limit |");
        for system in &mounts {
            let _ = write!(out, " {} ÷ limit |", system.name());
        }
        let _ = writeln!(out, "\n|---|---|{}", "---|".repeat(mounts.len()));
        for workload in Workload::ALL.into_iter().filter(|w| w.measured(self.args)) {
            let limit = spread(
                self.each(workload, System::Limit, |s| Some(s.throughput(workload))),
                number,
            );
            let _ = write!(out, "| {} | {limit} {} |", workload.name(), workload.unit());
            for system in &mounts {
                let _ = write!(
                    out,
                    " {} |",
                    spread(self.ratios(workload, *system, System::Limit), ratio)
                );
            }
            let _ = writeln!(out);
        }
    }

    fn workload_table(&self, workload: Workload, out: &mut String) {
        let _ = writeln!(
            out,
            "\n### {}\n\n{}.\nLimit: {}.\n",
            workload.name(),
            workload.title(self.args),
            workload.limit(self.args)
        );
        let (latency_head, latency_rule) = if workload.timed() {
            (" p50 µs | p99 µs |", "---|---|")
        } else {
            ("", "")
        };
        let _ = writeln!(
            out,
            "| system | {} |{latency_head} ÷ limit | Larder ÷ system |{COST_HEAD}",
            workload.unit()
        );
        let _ = writeln!(out, "|---|---|{latency_rule}---|---|{COST_RULE}");
        for system in self.systems() {
            let samples: Vec<&Sample> = self
                .rounds
                .iter()
                .filter_map(|round| round.get(&(workload, system)))
                .collect();
            if samples.is_empty() {
                continue;
            }
            let throughput = samples.iter().map(|s| s.throughput(workload)).collect();
            let to_limit = if system == System::Limit {
                "1".to_owned()
            } else {
                spread(self.ratios(workload, system, System::Limit), ratio)
            };
            let larder_to = if matches!(system, System::Rclone | System::S3fs) {
                spread(self.ratios(workload, System::Larder, system), ratio)
            } else {
                "—".to_owned()
            };
            let latency = if workload.timed() {
                let percentile = |f: fn(&Latency) -> f64| {
                    spread(
                        self.each(workload, system, |s| s.work.latency.as_ref().map(f)),
                        number,
                    )
                };
                format!(" {} | {} |", percentile(|l| l.p50_us), percentile(|l| l.p99_us))
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "| {} | {} |{latency} {to_limit} | {larder_to} |{}",
                system.name(),
                spread(throughput, number),
                cost_cells(&samples),
            );
        }
    }
}

/// The headers of the columns `cost_cells` fills, and their rule.
pub(crate) const COST_HEAD: &str = " mount CPU s/GiB | reader CPU s/GiB | server CPU s/GiB | mount peak RSS MiB | origin requests/GiB | origin GiB/GiB |";
pub(crate) const COST_RULE: &str = "---|---|---|---|---|---|";

/// What one system's runs of a workload cost, as the cells of its row: the median (min–max)
/// of the rounds' figures, per GiB handed to the readers but peak RSS.
pub(crate) fn cost_cells(samples: &[&Sample]) -> String {
    let per_gib = |f: fn(&Sample) -> Option<f64>| {
        let values = samples.iter().filter_map(|s| Some(f(s)? / s.served_gib()));
        spread(values.collect(), number)
    };
    let peak_rss = samples.iter().filter_map(|s| s.cost.peak_rss_mib).collect();
    format!(
        " {} | {} | {} | {} | {} | {} |",
        per_gib(|s| s.cost.mount_cpu),
        per_gib(|s| s.work.reader_cpu),
        per_gib(|s| s.cost.origin_cpu),
        spread(peak_rss, number),
        per_gib(|s| Some(s.cost.origin.requests as f64)),
        per_gib(|s| Some(s.cost.origin.bytes as f64 / GIB)),
    )
}

/// The whole report.
pub(crate) fn render(cx: &Context<'_>) -> String {
    let date = utc_now();
    let mut out = String::new();
    let _ = writeln!(out, "# Mount benchmark\n");
    let _ = writeln!(out, "{date}; {}", machine());
    let _ = writeln!(
        out,
        "large file {}, {} small files of {}, {} concurrent readers, {} readers of files of {}; {}",
        cx.args.size,
        cx.args.small_files,
        cx.args.small_size,
        cx.args.readers,
        cx.args.many_files,
        cx.args.many_size,
        cx.run.note(cx.rounds.len()),
    );
    cx.run.describe_systems(&mut out);
    let _ = writeln!(
        out,
        "\n## Throughput as a ratio to the limit (higher is better)\n"
    );
    cx.summary_table(&mut out);
    let _ = writeln!(
        out,
        "\n## Per workload\n\nThroughput and ratios are medians of per-round values. CPU is user + system \
         time of the mount process (`/proc/PID/stat`), of the reading threads (`RUSAGE_THREAD`) \
         and of the object store's server while the workload ran, per GiB handed to the readers; peak RSS is the mount process's \
         VmHWM, reset before each workload; origin figures count requests of every kind and the \
         object bytes GETs asked for, per GiB handed to the readers."
    );
    for workload in Workload::ALL.into_iter().filter(|w| w.measured(cx.args)) {
        cx.workload_table(workload, &mut out);
    }
    cx.run.failed_runs(&mut out);
    out
}

impl<'a> Run<'a> {
    /// What to say of a run of the systems `setups` with `log`, until now, with the page cache
    /// `dropped` (or not), reading `origin`.
    pub(crate) fn new(setups: &[Setup], log: &'a RunLog, dropped: bool, origin: &'static str) -> Self {
        Self {
            versions: setups.iter().map(|s| (s.system, s.version())).collect(),
            failures: log.failures(),
            dropped,
            duration: log.elapsed(),
            // The daemon inherits the harness's environment, this variable with it.
            memory_budget: std::env::var("LARDER_MEMORY_LIMIT").ok(),
            origin,
        }
    }

    /// How the run went, for the report's header: the daemon's memory budget, the rounds
    /// (`rounds` of them), whether the page cache could be dropped, and how long it took.
    pub(crate) fn note(&self, rounds: usize) -> String {
        format!(
            "Larder memory budget: {}; {}; page cache dropped between steps: {}; whole run {:.0} s",
            self.memory_budget.as_deref().unwrap_or("default"),
            rounds_note(rounds),
            self.dropped,
            self.duration.as_secs_f64()
        )
    }

    /// The origin and the systems compared, with their versions: a paragraph and a list.
    pub(crate) fn describe_systems(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\nOrigin: {} on loopback, behind a recording proxy in the benchmark process that every \
             system and the raw download go through (rclone and s3fs-fuse run over S3 only). Systems:\n",
            self.origin
        );
        for (system, version) in &self.versions {
            let how = match system {
                System::Limit => String::new(),
                System::Larder => match &self.memory_budget {
                    Some(budget) => format!(
                        "`larder daemon`, default settings but `LARDER_MEMORY_LIMIT={budget}`, `--metrics-listen off`, `LARDER_MIN_FREE_FRACTION=0`"
                    ),
                    None => {
                        "`larder daemon`, default settings, `--metrics-listen off`, `LARDER_MIN_FREE_FRACTION=0`"
                            .to_owned()
                    }
                },
                System::Rclone => {
                    "`rclone mount --vfs-cache-mode full --read-only`, otherwise defaults".to_owned()
                }
                System::S3fs => {
                    "`s3fs -f -o ro,use_path_request_style,use_cache=DIR`, otherwise defaults".to_owned()
                }
            };
            let _ = writeln!(out, "- {}: {how} ({version})", system.name());
        }
    }

    /// The section of the runs that failed, if any.
    pub(crate) fn failed_runs(&self, out: &mut String) {
        if !self.failures.is_empty() {
            let _ = writeln!(out, "\n## Failed runs\n");
            for failure in self.failures {
                let _ = writeln!(out, "- {}", failure.replace('\n', " "));
            }
        }
    }
}
