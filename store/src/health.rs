//! The store's health: a cache disk that fails (no file handed to the kernel until a block
//! write succeeds again), and a cache dir lost under the daemon (given up for good).

use crate::index::State;
use crate::{BlockStore, StoreError};

impl BlockStore {
    /// Why the cache disk is taken to be failing, if it is (see
    /// [`Usage::disk_failing`](crate::Usage::disk_failing)).
    pub fn disk_failure(&self) -> Option<String> {
        self.state.lock().disk_failing.clone()
    }

    /// The disk failed `error` (an I/O error): no file is handed to the kernel from now on
    /// (the kernel's reads of it would fail where the daemon's fall back to the origin), and
    /// the daemon is not ready, until a block write succeeds again. Said once.
    pub(crate) fn disk_failed(&self, error: &StoreError) {
        let StoreError::Io { .. } = error else {
            return;
        };
        let mut state = self.state.lock();
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

    /// A block write succeeded: the disk works (again).
    pub(crate) fn disk_works(&self) {
        let mut state = self.state.lock();
        if state.disk_failing.take().is_some() {
            tracing::info!(dir = %self.held.dir().display(), "the cache disk takes writes again");
        }
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
