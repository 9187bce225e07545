//! The reads of each workload, the same through a mount and on a local file: timed, with the
//! CPU the reading threads spent.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
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

/// `count` reads of `len` bytes at offsets drawn from `seed`, 4 KiB-aligned, one at a time (a
/// loader that jumps from tensor to tensor).
pub(crate) fn random(path: &Path, size: u64, len: u64, count: u64, seed: u64) -> anyhow::Result<Work> {
    let len = len.min(size);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let offsets: Vec<u64> = (0..count)
        .map(|_| rng.random_range(0..=(size - len) / 4096) * 4096)
        .collect();
    in_threads(1, |_| {
        let file = File::open(path)?;
        let mut buf = vec![0u8; len as usize];
        for &offset in &offsets {
            file.read_exact_at(&mut buf, offset)?;
        }
        Ok((count * len, count))
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
