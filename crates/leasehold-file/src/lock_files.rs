//! `N#lock` and `N#gate`: `flock` files that their last holder deletes.
//!
//! `N#lock` is locked exclusively by a mutex holder, writer or leader and shared by
//! readers; `N#gate` is held by a waiting writer, and new readers queue behind it.
//!
//! A lock file is deleted by its last holder while it still holds it, and whoever locks a
//! lock file checks afterwards that it is still the file under that name (and otherwise
//! takes the new one), so a deleted file can never be held beside its successor. That check
//! only covers deletions by this backend, not by hand.

use std::fs::File;
use std::path::PathBuf;

use leasehold_core::Result;
use rustix::fs::{FlockOperation, flock};

use crate::directory::{io_error, is_linked, open_rw};

/// One acquisition's descriptor of `N#lock` or `N#gate`.
/// Dropping it releases the lock; a sole holder deletes the file first.
#[derive(Debug)]
pub(crate) struct LockFile {
    path: PathBuf,
    pub(crate) file: File,
    /// `Some(exclusive)` while this descriptor holds the `flock`.
    pub(crate) held: Option<bool>,
}

impl LockFile {
    /// Opens (creating) for writing, so that closing it — or the holder's death — signals waiters.
    pub(crate) fn open(path: PathBuf) -> Result<Self> {
        let file = open_rw(&path)?;
        Ok(Self {
            path,
            file,
            held: None,
        })
    }

    /// Takes the `flock` without waiting: `Ok(false)` if someone else holds it.
    /// A file that was deleted since it was opened is replaced by the current one first.
    pub(crate) fn try_lock(&mut self, exclusive: bool) -> Result<bool> {
        let op = if exclusive {
            FlockOperation::NonBlockingLockExclusive
        } else {
            FlockOperation::NonBlockingLockShared
        };
        loop {
            let locked = try_flock(&self.file, op)?;
            if is_linked(&self.file, &self.path)? {
                if locked {
                    self.held = Some(exclusive);
                }
                return Ok(locked);
            }
            // Its last holder deleted it; a lock on it would exclude nobody.
            self.file = open_rw(&self.path)?;
        }
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        // Delete the file if this is its only holder, while holding it exclusively: anyone
        // who opened it before sees that it is gone once they lock it.
        let sole = match self.held {
            Some(true) => true,
            // Not atomic: on failure the shared lock is gone too, which is what we want.
            Some(false) => {
                try_flock(&self.file, FlockOperation::NonBlockingLockExclusive).unwrap_or(false)
            }
            None => false,
        };
        if sole && is_linked(&self.file, &self.path).unwrap_or(false) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A non-blocking `flock`: `Ok(false)` when someone else holds a conflicting lock.
pub(crate) fn try_flock(file: &File, op: FlockOperation) -> Result<bool> {
    match flock(file, op) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(io_error("flock", e.into())),
    }
}
