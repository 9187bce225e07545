//! The cache dir as one daemon holds it: the lock, and the objects dir by descriptor.
//!
//! Object files are created, opened and removed relative to the objects dir's descriptor,
//! never by path. A cache dir deleted (or replaced) under the daemon therefore cannot be
//! recreated by it without its lock, and nothing the daemon does can land in whatever is at
//! the path now, which another daemon may have locked since: creating a file in a deleted
//! directory fails. [`HeldDir::intact`] tells whether the lock still guards the dir at the path;
//! the store asks before every write and gives the dir up when it does not (an I/O error in
//! asking is a failing disk, not a lost dir).

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use larder_object::ObjectId;
use rustix::fs::{AtFlags, FlockOperation, Mode, OFlags};

use super::{StoreError, VALUES_EXTENSION, io_error};

/// The objects dir, under the cache dir.
pub(crate) const OBJECTS_DIR: &str = "v1/objects";

/// The relative names of an object's files under the objects dir.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// The fan-out dir (the first two hex digits of the id).
    pub fanout: String,
    /// `<fanout>/<id>.data`.
    pub data: String,
    /// `<fanout>/<id>.rec`.
    pub rec: String,
    /// `<fanout>/<id>.values16k`: the blocks' group values (larder-block-tree).
    pub values: String,
}

impl Names {
    pub(crate) fn of(id: ObjectId) -> Self {
        let hex = id.to_hex();
        Self::with_stem(&format!("{}/{hex}", &hex[..2]))
    }

    /// The names of `<stem>.*`, where `stem` is `<fanout>/<name>`.
    pub(crate) fn with_stem(stem: &str) -> Self {
        let fanout = stem.split('/').next().unwrap_or_default().to_owned();
        Self {
            fanout,
            data: format!("{stem}.data"),
            rec: format!("{stem}.rec"),
            values: format!("{stem}.{VALUES_EXTENSION}"),
        }
    }
}

/// A locked cache dir.
#[derive(Debug)]
pub(crate) struct HeldDir {
    /// The cache dir, as configured.
    dir: PathBuf,
    /// `<dir>/v1/objects`, for messages.
    objects_path: PathBuf,
    objects: OwnedFd,
    lock: File,
}

impl HeldDir {
    /// Creates the dir if need be (`0700`), takes its lock and opens its objects dir.
    pub(crate) fn lock(dir: &Path) -> Result<Self, StoreError> {
        create_private_dir(dir)?;
        // An existing dir keeps its owner's mode otherwise; the cache is private to the daemon.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_error("chmod", dir))?;
        let lock_path = dir.join("lock");
        let lock: File = rustix::fs::open(
            &lock_path,
            OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io_error("create", &lock_path)(e.into()))?
        .into();
        if rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive).is_err() {
            return Err(StoreError::Locked(dir.to_owned()));
        }
        let objects_path = dir.join(OBJECTS_DIR);
        create_private_dir(&objects_path)?;
        let objects = rustix::fs::open(
            &objects_path,
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_error("open", &objects_path)(e.into()))?;
        Ok(Self {
            dir: dir.to_owned(),
            objects_path,
            objects,
            lock,
        })
    }

    /// The cache dir, as configured.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The objects dir's path, where start-up lists records.
    pub(crate) fn objects_path(&self) -> &Path {
        &self.objects_path
    }

    /// The path of a name under the objects dir, for messages.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.objects_path.join(name)
    }

    /// `Ok(true)` while the file locked at start is still the dir's `lock`: the dir was neither
    /// deleted nor replaced; `Ok(false)` once it was. An error the path's lookup gives that
    /// is not "no such file" (an I/O error of a failing disk, a file system shut down) says
    /// nothing about the dir: the caller takes it for a failing disk, not a lost dir.
    pub(crate) fn intact(&self) -> io::Result<bool> {
        let lock_path = self.lock_path();
        let held = rustix::fs::fstat(&self.lock)?;
        let there = match rustix::fs::stat(&lock_path) {
            Ok(there) => there,
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => return Ok(false),
            Err(error) => return Err(error.into()),
        };
        Ok(held.st_nlink > 0 && (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino))
    }

    /// The lock file's path, for messages.
    pub(crate) fn lock_path(&self) -> PathBuf {
        self.dir.join("lock")
    }

    /// Opens `name` under the objects dir; `create` makes it (`0600`) and its fan-out dir.
    pub(crate) fn open(
        &self,
        names: &Names,
        name: &str,
        flags: OFlags,
        create: bool,
    ) -> Result<File, StoreError> {
        if create {
            match rustix::fs::mkdirat(&self.objects, names.fanout.as_str(), Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(io_error("create", &self.path(&names.fanout))(e.into())),
            }
        }
        let flags = flags | OFlags::CLOEXEC | if create { OFlags::CREATE } else { OFlags::empty() };
        let open = |flags| rustix::fs::openat(&self.objects, name, flags, Mode::from_raw_mode(0o600));
        let opened = match open(flags) {
            // Filesystems without O_DIRECT get buffered I/O.
            Err(rustix::io::Errno::INVAL) if flags.contains(OFlags::DIRECT) => open(flags - OFlags::DIRECT),
            other => other,
        };
        opened
            .map(File::from)
            .map_err(|e| io_error("open", &self.path(name))(e.into()))
    }

    /// Opens (or creates, `0600`) the file `name` directly under the objects dir.
    pub(crate) fn open_file(&self, name: &str, flags: OFlags) -> Result<File, StoreError> {
        self.open(&Names::with_stem(name), name, flags | OFlags::CREATE, false)
    }

    /// Removes `name` under the objects dir; a name already gone is not an error.
    pub(crate) fn remove(&self, name: &str) {
        match rustix::fs::unlinkat(&self.objects, name, AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => {}
            Err(error) => {
                let error = io::Error::from(error);
                tracing::warn!(path = %self.path(name).display(), %error, "could not remove a cache file");
            }
        }
    }

    /// Removes an object's files.
    pub(crate) fn remove_all(&self, names: &Names) {
        for name in [&names.rec, &names.data, &names.values] {
            self.remove(name);
        }
    }

    /// `(available, total)` bytes of the cache filesystem, if it can be read.
    pub(crate) fn free_space(&self) -> Option<(u64, u64)> {
        let stat = rustix::fs::fstatvfs(&self.objects).ok()?;
        Some((stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize))
    }
}

fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_error("create", dir))
}
