//! The store's health: a cache disk that fails (no file handed to the kernel until a block
//! write succeeds again or the disk answers a recheck), and a cache dir lost under the daemon
//! (given up for good), told apart from a disk that fails its calls.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use larder_engine::{ALIGN, AlignedBuf};
use rustix::fs::OFlags;

use crate::index::State;
use crate::{BlockStore, StoreError, io_error};

/// The file under the objects dir that [`BlockStore::recheck_disk`] writes and reads back (start-up
/// looks only into the fan-out dirs, so it is left alone).
const PROBE_FILE: &str = "probe";

impl BlockStore {
    /// Why the cache disk is taken to be failing, if it is (see
    /// [`Usage::disk_failing`](crate::Usage::disk_failing)).
    pub fn disk_failure(&self) -> Option<String> {
        self.state.lock().disk_failing.clone()
    }

    /// The disk failed `error` (an I/O error): no file is handed to the kernel from now on
    /// (the kernel's reads of it would fail where the daemon's fall back to the origin), and
    /// the daemon is not ready, until a block write succeeds again or the disk answers a
    /// recheck ([`BlockStore::recheck_disk`]). Said once.
    pub(crate) fn disk_failed(&self, error: &StoreError) {
        let StoreError::Io { .. } = error else {
            return;
        };
        let mut state = self.state.lock();
        state.disk_failed_at = Some(Instant::now());
        if state.disk_failing.is_none() {
            tracing::error!(
                dir = %self.held.dir().display(),
                %error,
                "the cache disk fails: no file is handed to the kernel (passthrough) and reads go \
                 through the daemon, to the origin where the disk fails them, until a block \
                 write succeeds again"
            );
        }
        state.disk_failing = Some(error.to_string());
    }

    /// A block write succeeded, or the disk answered a recheck: the disk works (again).
    pub(crate) fn disk_works(&self) {
        let mut state = self.state.lock();
        if state.disk_failing.take().is_some() {
            tracing::info!(dir = %self.held.dir().display(), "the cache disk works again");
        }
    }

    /// If the disk is taken to be failing and has failed nothing for `quiet`, writes a page to
    /// a probe file beside the objects and reads it back, straight from the disk; when both
    /// succeed, the disk works again. A node whose reads all hit writes no block, so without
    /// this it would stay not ready after a transient error for as long as it stays warm. The
    /// blocks that failed were dropped when they did, so a working disk serves none of them.
    pub async fn recheck_disk(&self, quiet: Duration) {
        let due = {
            let state = self.state.lock();
            state.disk_failing.is_some() && state.disk_failed_at.is_none_or(|at| at.elapsed() >= quiet)
        };
        if !due {
            return;
        }
        match self.probe_disk().await {
            Ok(()) => self.disk_works(),
            Err(error) => {
                tracing::debug!(%error, "the cache disk still fails");
                self.disk_failed(&error);
            }
        }
    }

    /// Writes a page of bytes that differ from the last probe's to the probe file, and reads
    /// it back (O_DIRECT where the file system has it).
    async fn probe_disk(&self) -> Result<(), StoreError> {
        let path = self.held.path(PROBE_FILE);
        let file = Arc::new(self.held.open_file(PROBE_FILE, OFlags::RDWR | OFlags::DIRECT)?);
        let mut page = AlignedBuf::new(ALIGN);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        page.extend_from_slice(&nanos.to_le_bytes().repeat(ALIGN / 16));
        let page = Arc::new(page);
        let written = self.engine.write(file.clone(), 0, page.clone()).await;
        written.map_err(io_error("probe write", &path))?;
        let (read, result) = self.engine.read(file, 0, AlignedBuf::new(ALIGN)).await;
        result.map_err(io_error("probe read", &path))?;
        if read.as_ref() != page.as_ref().as_ref() {
            return Err(StoreError::Io {
                op: "probe read",
                path,
                source: std::io::Error::other("the page read back is not the page written"),
            });
        }
        Ok(())
    }

    /// Gives the cache dir up: it was deleted or replaced under the daemon (see held_dir.rs).
    /// The index is emptied, so every read goes to the network and the files of the lost dir
    /// are closed (their space freed) once reads in flight end; no write is made again. Only a
    /// restart takes a dir (and its lock) again.
    pub(crate) fn give_up(&self) {
        let mut state = self.state.lock();
        if state.dir_lost {
            return;
        }
        tracing::error!(
            dir = %self.held.dir().display(),
            "the cache dir was deleted or replaced under the daemon: it caches nothing more and \
             serves every read from the network; restart it to cache again"
        );
        *state = State {
            // Writes in flight give their reservations back.
            reserved: state.reserved,
            next_generation: state.next_generation,
            dir_lost: true,
            ..State::new(0)
        };
    }
}
