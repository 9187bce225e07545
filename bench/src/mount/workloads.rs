//! The reads of each workload, the same through a mount and on a local file: timed, with the
//! CPU the reading threads spent.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::{Rng, SeedableRng};

use super::measure::thread_cpu;

/// Size of a sequential read request, as `cp` and most loaders make.
pub(crate) const READ_SIZE: usize = 1 << 20;

/// What one run of a workload did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Work {
    pub(crate) elapsed: Duration,
    /// Bytes handed to the readers.
    pub(crate) bytes: u64,
    /// Read calls made (random reads: the operations counted).
    pub(crate) ops: u64,
    /// CPU seconds of the reading threads; None where the reader is not a thread of ours.
    pub(crate) reader_cpu: Option<f64>,
    /// Percentiles of the time each read took, where the reads were timed one by one.
    pub(crate) latency: Option<Latency>,
}

/// Percentiles of the times single reads took, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Latency {
    /// The median.
    pub(crate) p50_us: f64,
    /// The 99th percentile.
    pub(crate) p99_us: f64,
}

impl Latency {
    /// The median and 99th percentile (nearest rank) of `times`; None for no times.
    pub(crate) fn of(mut times: Vec<Duration>) -> Option<Self> {
        times.sort_unstable();
        let rank = |p: f64| {
            let index = ((p * times.len() as f64).ceil() as usize).clamp(1, times.len()) - 1;
            times[index].as_secs_f64() * 1e6
        };
        (!times.is_empty()).then(|| Latency {
            p50_us: rank(0.50),
            p99_us: rank(0.99),
        })
    }
}

/// Runs `work(i)` on `threads` threads started together; the time is from the start until the
/// last one is done. `work` returns the bytes it read and the read calls it made.
fn in_threads(
    threads: usize,
    work: impl Fn(usize) -> std::io::Result<(u64, u64)> + Sync,
) -> anyhow::Result<Work> {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let (barrier, work) = (&barrier, &work);
                scope.spawn(move || {
                    barrier.wait();
                    let cpu = thread_cpu();
                    let done = work(i);
                    (done, thread_cpu() - cpu)
                })
            })
            .collect();
        barrier.wait();
        let started = Instant::now();
        let mut total = Work {
            elapsed: Duration::ZERO,
            bytes: 0,
            ops: 0,
            reader_cpu: Some(0.0),
            latency: None,
        };
        let mut cpu = 0.0;
        for handle in handles {
            let (done, spent) = handle
                .join()
                .map_err(|_| anyhow::anyhow!("a reader thread panicked"))?;
            let (bytes, ops) = done?;
            total.bytes += bytes;
            total.ops += ops;
            cpu += spent;
        }
        total.elapsed = started.elapsed();
        total.reader_cpu = Some(cpu);
        Ok(total)
    })
}

/// Reads `path` from start to end in `READ_SIZE` requests; returns (bytes, requests).
pub(crate) fn read_whole(path: &Path) -> std::io::Result<(u64, u64)> {
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; READ_SIZE];
    let (mut bytes, mut ops) = (0, 0);
    loop {
        let n = file.read(&mut buf)?;
        ops += 1;
        if n == 0 {
            return Ok((bytes, ops));
        }
        bytes += n as u64;
    }
}

/// One reader reads the whole file sequentially.
pub(crate) fn sequential(path: &Path, size: u64) -> anyhow::Result<Work> {
    let work = in_threads(1, |_| read_whole(path))?;
    anyhow::ensure!(
        work.bytes == size,
        "read {} of {size} bytes of {}",
        work.bytes,
        path.display()
    );
    Ok(work)
}

/// One reader maps the whole file and copies it out in `READ_SIZE` pieces, as a loader that
/// maps a checkpoint and copies its tensors does.
pub(crate) fn mapped(path: &Path, size: u64) -> anyhow::Result<Work> {
    let work = in_threads(1, |_| {
        let file = File::open(path)?;
        // SAFETY: the file is not written while mapped (read-only mounts and a private copy).
        let map = unsafe { memmap2::Mmap::map(&file)? };
        map.advise(memmap2::Advice::Sequential)?;
        let mut buf = vec![0u8; READ_SIZE];
        let mut ops = 0;
        for chunk in map.chunks(READ_SIZE) {
            buf[..chunk.len()].copy_from_slice(chunk);
            ops += 1;
        }
        std::hint::black_box(&buf);
        Ok((map.len() as u64, ops))
    })?;
    anyhow::ensure!(
        work.bytes == size,
        "mapped {} of {size} bytes of {}",
        work.bytes,
        path.display()
    );
    Ok(work)
}

/// `readers` threads, each reading the whole file sequentially with its own descriptor.
pub(crate) fn concurrent(path: &Path, size: u64, readers: usize) -> anyhow::Result<Work> {
    let work = in_threads(readers, |_| read_whole(path))?;
    let expected = size * readers as u64;
    anyhow::ensure!(work.bytes == expected, "read {} of {expected} bytes", work.bytes);
    Ok(work)
}

/// One thread per file, each reading its own file sequentially; checks that the files have
/// `size` bytes each.
pub(crate) fn many_files(paths: &[PathBuf], size: u64) -> anyhow::Result<Work> {
    let work = in_threads(paths.len(), |i| read_whole(&paths[i]))?;
    let expected = size * paths.len() as u64;
    anyhow::ensure!(work.bytes == expected, "read {} of {expected} bytes", work.bytes);
    Ok(work)
}

/// `count` reads of `len` bytes at offsets drawn from `seed`, 4 KiB-aligned, one at a time (a
/// loader that jumps from tensor to tensor), each one timed.
pub(crate) fn random(path: &Path, size: u64, len: u64, count: u64, seed: u64) -> anyhow::Result<Work> {
    let len = len.min(size);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let offsets: Vec<u64> = (0..count)
        .map(|_| rng.random_range(0..=(size - len) / 4096) * 4096)
        .collect();
    let times = Mutex::new(Vec::with_capacity(offsets.len()));
    let work = in_threads(1, |_| {
        let file = File::open(path)?;
        let mut buf = vec![0u8; len as usize];
        let mut mine = Vec::with_capacity(offsets.len());
        for &offset in &offsets {
            let started = Instant::now();
            file.read_exact_at(&mut buf, offset)?;
            mine.push(started.elapsed());
        }
        *times.lock().unwrap_or_else(|e| e.into_inner()) = mine;
        Ok((count * len, count))
    })?;
    let times = times.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(Work {
        latency: Latency::of(times),
        ..work
    })
}

/// Lists `dir` and reads every file in it, spread over `readers` threads; checks that there
/// are `files` files of `size` bytes. The time covers the listing and the reads.
pub(crate) fn small_files(dir: &Path, files: usize, size: u64, readers: usize) -> anyhow::Result<Work> {
    let started = Instant::now();
    let cpu = thread_cpu();
    let names: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    let listing_cpu = thread_cpu() - cpu;
    anyhow::ensure!(names.len() == files, "listed {} of {files} files", names.len());
    let reads = in_threads(readers, |i| {
        let mut buf = Vec::with_capacity(size as usize);
        let (mut bytes, mut ops) = (0, 0);
        for name in names.iter().skip(i).step_by(readers) {
            buf.clear();
            bytes += File::open(name)?.read_to_end(&mut buf)? as u64;
            ops += 1;
        }
        Ok((bytes, ops))
    })?;
    anyhow::ensure!(
        reads.bytes == files as u64 * size,
        "read {} of {} bytes",
        reads.bytes,
        files as u64 * size
    );
    Ok(Work {
        elapsed: started.elapsed(),
        reader_cpu: reads.reader_cpu.map(|c| c + listing_cpu),
        ..reads
    })
}

/// Checks a few ranges of `path` against the content its object was made with: a system that
/// serves wrong bytes fails instead of being measured.
pub(crate) fn check_content(path: &Path, seed: u64, size: u64) -> anyhow::Result<()> {
    let file = File::open(path)?;
    let len = 4096.min(size);
    for offset in [0, size / 3, size - len] {
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, offset)?;
        anyhow::ensure!(
            buf == larder_tests::content(seed, offset, len as usize),
            "{} has wrong bytes at {offset}",
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles_are_nearest_ranks() {
        assert_eq!(Latency::of(Vec::new()), None);
        let one = Latency::of(vec![Duration::from_micros(7)]);
        assert_eq!(
            one,
            Some(Latency {
                p50_us: 7.0,
                p99_us: 7.0
            })
        );
        // 1..=200 µs, in reverse order: the 100th and the 198th smallest.
        let times = (1..=200u64).rev().map(Duration::from_micros).collect();
        assert_eq!(
            Latency::of(times),
            Some(Latency {
                p50_us: 100.0,
                p99_us: 198.0
            })
        );
    }
}
