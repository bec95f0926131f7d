//! What this process holds and waits for, by owner id, across all its backend instances.
//!
//! A record naming this process is live exactly while its owner is in here.

use std::collections::HashMap;
use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::OwnedFd;
use std::sync::{LazyLock, Mutex, MutexGuard};

use leasehold_core::backend::{Mode, Request};
use leasehold_core::{FencingToken, LockName, OwnerId, Result};
use rustix::fs::FlockOperation;

use crate::FileBackend;
use crate::directory::{io_error, reuse};
use crate::lock_files::{LockFile, try_flock};
use crate::semaphore::PermitHold;

/// This process's acquisitions, by owner id (unique per acquisition).
static ACQUISITIONS: LazyLock<Mutex<HashMap<OwnerId, Acquisition>>> = LazyLock::new(Mutex::default);

/// This process's acquisitions, locked.
pub(crate) fn acquisitions() -> MutexGuard<'static, HashMap<OwnerId, Acquisition>> {
    ACQUISITIONS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether `req.owner` holds `req.name` in `req.mode` through this process.
/// Called with the table locked; while it stays locked, no release of this process can
/// close the grant's descriptors.
pub(crate) fn holds(acquisitions: &HashMap<OwnerId, Acquisition>, req: &Request) -> bool {
    acquisitions.get(&req.owner).is_some_and(|held| {
        matches!(held.status, Status::Held(_)) && held.name == req.name && held.mode == req.mode
    })
}

/// One acquisition: its name and mode, where it stands, and its descriptors.
#[derive(Debug)]
pub(crate) struct Acquisition {
    pub(crate) name: LockName,
    pub(crate) mode: Mode,
    pub(crate) status: Status,
    /// Dropping these releases the kernel locks.
    pub(crate) files: Files,
}

/// Where an acquisition stands, as its record says too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// It waits: it keeps its descriptors between tries.
    Waiting,
    /// It holds, with this token.
    Held(FencingToken),
}

/// Descriptors of one acquisition.
/// An exclusive or shared one keeps one (a waiting writer two: the gate too); a permit
/// keeps a share of its instance's semaphore descriptor. A waiter keeps them between
/// tries, so that its tries do not close (and signal) anything.
#[derive(Debug, Default)]
pub(crate) struct Files {
    lock: Option<LockFile>,
    gate: Option<LockFile>,
    permit: Option<PermitHold>,
}

impl Files {
    /// Tries the kernel locks for `req` through `backend`, opening what is missing.
    /// `Ok(true)`: granted.
    pub(crate) fn try_lock(&mut self, backend: &FileBackend, req: &Request) -> Result<bool> {
        let name = &req.name;
        let path = |kind| backend.path(name, kind);
        match req.mode {
            Mode::Exclusive => {
                if req.waiting {
                    // Announce a waiting writer: new readers queue behind it.
                    let gate = reuse(&mut self.gate, || LockFile::open(path("gate")))?;
                    if gate.held.is_none() && !gate.try_lock(true)? {
                        return Ok(false);
                    }
                }
                let lock = reuse(&mut self.lock, || LockFile::open(path("lock")))?;
                let granted = lock.try_lock(true)?;
                if granted {
                    self.gate = None;
                }
                Ok(granted)
            }
            Mode::Shared => {
                // Read-only and never created here, so that taking and dropping the gate
                // signals nothing.
                match File::open(path("gate")) {
                    Ok(gate) => {
                        if !try_flock(&gate, FlockOperation::NonBlockingLockShared)? {
                            return Ok(false);
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(io_error(&format!("opening {name}#gate"), e)),
                }
                let lock = reuse(&mut self.lock, || LockFile::open(path("lock")))?;
                lock.try_lock(false)
            }
            Mode::Permit { limit } => {
                let permit = reuse(&mut self.permit, || {
                    Ok(PermitHold {
                        semaphore: backend.inner.semaphores.get(name, path("sem")),
                        slot: None,
                    })
                })?;
                permit.slot = permit.semaphore.try_acquire(u64::from(limit.get()))?;
                Ok(permit.slot.is_some())
            }
        }
    }
}

/// A duplicate of the descriptor through which this process holds the grant of `owner`.
/// The duplicate is close-on-exec; `None` if the process holds none.
///
/// A process that inherits it (clear close-on-exec on a copy, then start the process) keeps
/// the kernel lock while it lives, even after this process has died; so `leasehold run`
/// makes sure that a lock outlives its holder only as long as the command it runs.
/// Releasing the grant ends it all the same (for a permit the descriptor is the one shared
/// by every permit of that name in the same [`FileBackend`]).
pub fn held_descriptor(owner: &OwnerId) -> Option<std::io::Result<OwnedFd>> {
    let acquisitions = acquisitions();
    let held = acquisitions
        .get(owner)
        .filter(|a| a.status != Status::Waiting)?;
    if let Some(lock) = &held.files.lock {
        return Some(lock.file.try_clone().map(OwnedFd::from));
    }
    held.files.permit.as_ref()?.semaphore.descriptor()
}
