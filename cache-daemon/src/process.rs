//! What every Prometheus exporter says of its own process (the `process_*` family: memory,
//! CPU time, file descriptors, start time), read from `/proc/self` at each scrape.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The daemon process at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcessStats {
    /// Resident memory.
    pub resident_bytes: u64,
    /// Virtual memory.
    pub virtual_bytes: u64,
    /// User and system CPU time.
    pub cpu: Duration,
    /// File descriptors open.
    pub open_fds: u64,
    /// The soft limit of open file descriptors.
    pub max_fds: u64,
    /// When the process started, in seconds since the Unix epoch.
    pub start_time_seconds: f64,
}

impl ProcessStats {
    /// Reads this process's figures; `None` if `/proc` cannot be read (they are then left out
    /// of the exposition rather than shown as zeros).
    pub fn of_self() -> Option<Self> {
        // The boot time does not change: read once.
        static BOOT: std::sync::OnceLock<Option<SystemTime>> = std::sync::OnceLock::new();
        let boot = (*BOOT.get_or_init(|| boot_time(&std::fs::read_to_string("/proc/stat").ok()?)))?;
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        Self::parse(&stat, boot, open_fds, limit.current.unwrap_or(u64::MAX))
    }

    /// The figures in `stat` (a `/proc/<pid>/stat` line), for a machine booted at `boot`.
    fn parse(stat: &str, boot: SystemTime, open_fds: u64, max_fds: u64) -> Option<Self> {
        // The command name (field 2) is in parentheses and may hold spaces and parentheses:
        // the fields after it start past the last ')'. Field 3 is the state.
        let fields: Vec<&str> = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
        let ticks = rustix::param::clock_ticks_per_second();
        let seconds = |t: u64| Duration::from_secs_f64(t as f64 / ticks as f64);
        let started = boot + seconds(field(22)?);
        Some(Self {
            cpu: seconds(field(14)? + field(15)?),
            virtual_bytes: field(23)?,
            resident_bytes: field(24)? * rustix::param::page_size() as u64,
            open_fds,
            max_fds,
            start_time_seconds: started.duration_since(UNIX_EPOCH).ok()?.as_secs_f64(),
        })
    }
}

/// The boot time in `/proc/stat` (its `btime` line, seconds since the epoch).
fn boot_time(proc_stat: &str) -> Option<SystemTime> {
    let line = proc_stat.lines().find_map(|l| l.strip_prefix("btime "))?;
    Some(UNIX_EPOCH + Duration::from_secs(line.trim().parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_with_a_name_of_spaces_and_parentheses_parses() {
        let ticks = rustix::param::clock_ticks_per_second();
        let page = rustix::param::page_size() as u64;
        // Fields 14 and 15 (utime, stime), 22 (starttime), 23 (vsize), 24 (rss).
        let stat = format!(
            "4242 (lar der) (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 {} {} 0 0 20 0 9 0 {} 8192000 300 \
             18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0",
            3 * ticks,
            ticks,
            10 * ticks
        );
        let boot = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let process = ProcessStats::parse(&stat, boot, 12, 1024).expect("parses");
        assert_eq!(process.cpu, Duration::from_secs(4));
        assert_eq!(process.start_time_seconds, 1_700_000_010.0);
        assert_eq!(process.virtual_bytes, 8_192_000);
        assert_eq!(process.resident_bytes, 300 * page);
        assert_eq!((process.open_fds, process.max_fds), (12, 1024));
        assert_eq!(ProcessStats::parse("4242 (cut", boot, 0, 0), None);
    }

    #[test]
    fn boot_time_is_the_btime_line() {
        let text = "cpu  1 2 3\nintr 5\nbtime 1700000000\nprocesses 9\n";
        assert_eq!(
            boot_time(text),
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        assert_eq!(boot_time("cpu 1\n"), None);
    }

    #[test]
    fn this_process_reads() {
        let process = ProcessStats::of_self().expect("/proc/self");
        assert!(process.resident_bytes > 0 && process.open_fds > 0, "{process:?}");
        assert!(process.max_fds >= process.open_fds, "{process:?}");
    }
}
