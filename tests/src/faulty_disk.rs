//! A disk that fails reads of chosen byte ranges with a real block-layer EIO, for the file
//! systems the cache lives on. The kernel here has no device-mapper, so: a FUSE file system of
//! this process serves one file, `disk.img`, backed by an image file, every read reaching it
//! (direct I/O) and those that touch a failing range answered EIO; a loop device over that
//! file; ext4 on the loop device, mounted `errors=continue` (so a failed read fails that read,
//! not the file system). A cache dir under [`FaultyDisk::dir`] then meets the errors a dying
//! sector gives, through the page cache, O_DIRECT and passthrough alike.
//!
//! Needs root (mount, losetup, mkfs.ext4). Everything is torn down when dropped: the ext4
//! mount, the loop device, the FUSE mount.

use std::ffi::OsStr;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail, ensure};

use crate::run;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, LockOwner, MountOption,
    OpenFlags, ReplyAttr, ReplyData, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, WriteFlags,
};
use parking_lot::Mutex;

/// The one file the FUSE file system serves.
const IMAGE: &str = "disk.img";
const ROOT: INodeNo = INodeNo(1);
const IMAGE_INO: INodeNo = INodeNo(2);
const TTL: Duration = Duration::from_secs(1);

/// Byte ranges of the image whose reads fail, and how many reads failed.
#[derive(Debug, Default)]
struct Faults {
    failing: Vec<Range<u64>>,
    failed_reads: u64,
}

/// The FUSE file system over the image.
struct ImageFs {
    image: File,
    faults: Arc<Mutex<Faults>>,
}

impl ImageFs {
    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, perm, size) = match ino {
            ROOT => (FileType::Directory, 0o755, 0),
            IMAGE_INO => (FileType::RegularFile, 0o600, self.image.metadata().ok()?.len()),
            _ => return None,
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            crtime: SystemTime::UNIX_EPOCH,
            kind,
            perm,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }
}

impl Filesystem for ImageFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.attr(IMAGE_INO) {
            Some(attr) if parent == ROOT && name == IMAGE => reply.entry(&TTL, &attr, fuser::Generation(0)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // Every read reaches this file system: none is answered from the page cache.
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let end = offset + u64::from(size);
        {
            let mut faults = self.faults.lock();
            if faults.failing.iter().any(|r| r.start < end && offset < r.end) {
                faults.failed_reads += 1;
                return reply.error(Errno::EIO);
            }
        }
        let mut buf = vec![0; size as usize];
        match self.image.read_at(&mut buf, offset) {
            Ok(n) => reply.data(&buf[..n]),
            Err(_) => reply.error(Errno::EIO),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.image.write_all_at(data, offset) {
            Ok(()) => reply.written(data.len() as u32),
            Err(_) => reply.error(Errno::EIO),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.image.sync_data() {
            Ok(()) => reply.ok(),
            Err(_) => reply.error(Errno::EIO),
        }
    }
}

/// An ext4 file system on a disk whose reads of chosen ranges fail (see the module's doc).
pub struct FaultyDisk {
    faults: Arc<Mutex<Faults>>,
    /// Where the ext4 file system is mounted.
    dir: PathBuf,
    loop_device: String,
    /// The FUSE mount serving the image; unmounted when dropped, after the rest.
    fuse: Option<fuser::BackgroundSession>,
}

impl FaultyDisk {
    /// Makes an image of `size` bytes under `work` and mounts ext4 over it at `at`.
    pub fn mount(work: &Path, at: &Path, size: u64) -> anyhow::Result<Self> {
        let backing = work.join("backing.img");
        let image = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&backing)
            .with_context(|| format!("create {}", backing.display()))?;
        image.set_len(size)?;
        let fuse_dir = work.join("faulty");
        let dir = at.to_owned();
        std::fs::create_dir_all(&fuse_dir)?;
        std::fs::create_dir_all(&dir)?;
        let faults = Arc::new(Mutex::new(Faults::default()));
        let fs = ImageFs {
            image,
            faults: faults.clone(),
        };
        let mut config = fuser::Config::default();
        config.mount_options = vec![MountOption::FSName("faulty-disk".into())];
        config.n_threads = Some(2);
        let fuse =
            fuser::spawn_mount(fs, &fuse_dir, &config).context("mount the faulty disk's FUSE file system")?;
        let mut disk = Self {
            faults,
            dir,
            loop_device: String::new(),
            fuse: Some(fuse),
        };
        let image = fuse_dir.join(IMAGE);
        disk.loop_device = run("losetup", &["-f".as_ref(), "--show".as_ref(), image.as_os_str()])?
            .trim()
            .to_owned();
        let device: &OsStr = disk.loop_device.as_ref();
        run("mkfs.ext4", &["-q".as_ref(), "-F".as_ref(), device])?;
        let at = disk.dir.as_os_str();
        run("mount", &["-o".as_ref(), "errors=continue".as_ref(), device, at])?;
        Ok(disk)
    }

    /// Where the file system is mounted.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Fails every read, from now on, that touches the disk's blocks under `file`'s bytes
    /// `range` (found with the FIEMAP of `filefrag`). The page cache still answers what it
    /// holds: drop it to see the errors.
    pub fn fail_reads_of(&self, file: &Path, range: Range<u64>) -> anyhow::Result<()> {
        let extents = physical_extents(file)?;
        let mut faults = self.faults.lock();
        for (logical, physical, len) in extents {
            let start = logical.max(range.start);
            let end = (logical + len).min(range.end);
            if start < end {
                let at = physical + (start - logical);
                faults.failing.push(at..at + (end - start));
            }
        }
        ensure!(
            !faults.failing.is_empty(),
            "{} has no blocks in {range:?}",
            file.display()
        );
        Ok(())
    }

    /// The disk reads everything again.
    pub fn heal(&self) {
        self.faults.lock().failing.clear();
    }

    /// Reads the disk failed so far.
    pub fn failed_reads(&self) -> u64 {
        self.faults.lock().failed_reads
    }
}

impl std::fmt::Debug for FaultyDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyDisk")
            .field("dir", &self.dir)
            .field("loop_device", &self.loop_device)
            .field("faults", &*self.faults.lock())
            .finish_non_exhaustive()
    }
}

impl Drop for FaultyDisk {
    fn drop(&mut self) {
        self.heal();
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        if !self.loop_device.is_empty() {
            let _ = Command::new("losetup").arg("-d").arg(&self.loop_device).status();
        }
        drop(self.fuse.take());
    }
}

/// `(logical, physical, length)` in bytes of each extent of `file`, from `filefrag -v`.
fn physical_extents(file: &Path) -> anyhow::Result<Vec<(u64, u64, u64)>> {
    let out = run("filefrag", &["-v".as_ref(), "-b4096".as_ref(), file.as_os_str()])?;
    let mut extents = Vec::new();
    // Lines like "   0:        0..    8191:      34816..     43007:   8192:   ..."
    for line in out.lines() {
        let fields: Vec<&str> = line.split(':').map(str::trim).collect();
        if fields.len() < 4 || fields[0].parse::<u64>().is_err() {
            continue;
        }
        let range = |field: &str| -> Option<(u64, u64)> {
            let (a, b) = field.split_once("..")?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        };
        let (Some((logical, _)), Some((physical, _)), Ok(len)) =
            (range(fields[1]), range(fields[2]), fields[3].parse::<u64>())
        else {
            bail!("filefrag: cannot read {line:?}");
        };
        extents.push((logical * 4096, physical * 4096, len * 4096));
    }
    Ok(extents)
}
