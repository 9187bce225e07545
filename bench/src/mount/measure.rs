//! What a workload cost: CPU of the reading thread, of the mount and of the object store's
//! server, the mount's peak RSS, and the origin requests a stretch of the proxy's log shows.

use larder_tests::ServedRequest;

use super::Origin;
use crate::common::{peak_rss_mib, process_cpu, reset_peak_rss};

/// What a run of a workload cost, besides the readers' own CPU.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cost {
    /// CPU seconds of the mount process during the workload.
    pub(crate) mount_cpu: Option<f64>,
    /// CPU seconds of the object store's server during the workload: on a machine
    /// where it shares the cores with the mount, the part of them the mount could not have.
    pub(crate) origin_cpu: Option<f64>,
    /// Peak RSS of the mount process during the workload (or since it started, where the
    /// high-water mark could not be reset).
    pub(crate) peak_rss_mib: Option<f64>,
    pub(crate) origin: OriginUse,
}

/// Runs `work` and measures what it cost the mount process `pid` (if any), the server of
/// `origin`, and the origin: the requests its proxy logged meanwhile, `size_of` giving the size
/// of the object a request path names (None for listings).
pub(crate) fn measure<T>(
    origin: &Origin,
    pid: Option<u32>,
    size_of: impl Fn(&str) -> Option<u64>,
    work: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<(T, Cost)> {
    let from = origin.proxy.requests().len();
    if let Some(pid) = pid {
        reset_peak_rss(pid);
    }
    let cpu = pid.and_then(process_cpu);
    let server_cpu = process_cpu(origin.pid());
    let work = work()?;
    let spent = |before: Option<f64>, pid: Option<u32>| Some(pid.and_then(process_cpu)? - before?);
    let cost = Cost {
        mount_cpu: spent(cpu, pid),
        origin_cpu: spent(server_cpu, Some(origin.pid())),
        peak_rss_mib: pid.and_then(peak_rss_mib),
        origin: origin_use(&origin.proxy.requests()[from..], size_of),
    };
    Ok((work, cost))
}

/// CPU seconds (user + system) the calling thread has used.
pub(crate) fn thread_cpu() -> f64 {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct it is given, which lives through the call.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Requests an origin received, and the object bytes they asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct OriginUse {
    /// Every request: GETs of objects, HEADs, listings.
    pub(crate) requests: u64,
    /// Object bytes asked for by GETs: the length of each range (to the object's end for an
    /// open range), the whole object for a GET without one. A client that closes a response
    /// early got fewer bytes than this.
    pub(crate) bytes: u64,
}

/// What `requests` (a stretch of the proxy's log) cost the origin. `size_of` gives the size of
/// the object a request path (`/bucket/key`) names, and None for other paths (listings).
pub(crate) fn origin_use(requests: &[ServedRequest], size_of: impl Fn(&str) -> Option<u64>) -> OriginUse {
    let bytes = requests
        .iter()
        .filter(|r| r.method == "GET")
        .filter_map(|r| {
            let size = size_of(&r.path)?;
            Some(
                r.range
                    .as_deref()
                    .and_then(|range| range_len(range, size))
                    .unwrap_or(size),
            )
        })
        .sum();
    OriginUse {
        requests: requests.len() as u64,
        bytes,
    }
}

/// Bytes a `Range` header asks for from an object of `size` bytes; None if it is not one
/// range in bytes.
fn range_len(range: &str, size: u64) -> Option<u64> {
    let (first, last) = range.strip_prefix("bytes=")?.split_once('-')?;
    match (first.parse::<u64>(), last.parse::<u64>()) {
        (Ok(first), Ok(last)) => Some(last.saturating_add(1).min(size).saturating_sub(first)),
        (Ok(first), Err(_)) if last.is_empty() => Some(size.saturating_sub(first)),
        (Err(_), Ok(suffix)) if first.is_empty() => Some(suffix.min(size)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(path: &str, range: Option<&str>) -> ServedRequest {
        ServedRequest {
            method: "GET".into(),
            path: path.into(),
            query: None,
            range: range.map(str::to_owned),
            authorization: None,
        }
    }

    #[test]
    fn ranges_count_the_bytes_they_ask_for_within_the_object() {
        assert_eq!(range_len("bytes=0-1023", 4096), Some(1024));
        assert_eq!(range_len("bytes=4000-9999", 4096), Some(96));
        assert_eq!(range_len("bytes=1000-", 4096), Some(3096));
        assert_eq!(range_len("bytes=-100", 4096), Some(100));
        assert_eq!(range_len("bytes=5000-", 4096), Some(0));
        assert_eq!(range_len("bytes=0-1,4-5", 4096), None);
        assert_eq!(range_len("items=0-1", 4096), None);
    }

    #[test]
    fn origin_use_counts_every_request_and_the_bytes_of_object_gets() {
        let size_of = |path: &str| (path == "/b/big").then_some(1 << 20);
        let mut head = get("/b/big", None);
        head.method = "HEAD".into();
        let log = [
            get("/b/big", Some("bytes=0-1023")),
            get("/b/big", None),
            get("/b/", None),
            head,
        ];
        assert_eq!(
            origin_use(&log, size_of),
            OriginUse {
                requests: 4,
                bytes: 1024 + (1 << 20)
            }
        );
    }

    #[test]
    fn this_process_has_used_cpu_and_memory() {
        let pid = std::process::id();
        assert!(process_cpu(pid).is_some_and(|s| s >= 0.0));
        assert!(peak_rss_mib(pid).is_some_and(|m| m > 0.0));
        assert!(thread_cpu() >= 0.0);
        assert_eq!(process_cpu(u32::MAX), None);
    }
}
