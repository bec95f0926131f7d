//! What this process holds and waits for, by owner id, across all its backend instances.
//!
//! A record naming this process is live exactly while its owner is in here. An exclusive
//! or shared acquisition keeps one descriptor (a waiting writer two); a permit keeps a share
//! of its instance's semaphore descriptor.

use std::collections::HashMap;
use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::OwnedFd;
use std::sync::{LazyLock, Mutex, MutexGuard};

use leasehold_core::backend::{Mode, Request};
use leasehold_core::{FencingToken, LockName, OwnerId, Result};
use rustix::fs::FlockOperation;

use crate::FileBackend;
use crate::directory::io_error;
use crate::lock_files::{LockFile, try_flock};
use crate::semaphore::{PermitHold, Semaphore};

/// What this process holds and waits for, by owner id (unique per acquisition).
/// That is across all instances: a record naming this process is live exactly while its
/// owner is in here.
static STATE: LazyLock<Mutex<State>> = LazyLock::new(Mutex::default);

#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) held: HashMap<OwnerId, Held>,
    pub(crate) waiting: HashMap<OwnerId, Files>,
}

#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) name: LockName,
    pub(crate) token: FencingToken,
    /// Dropping these releases the kernel locks.
    pub(crate) files: Files,
}

/// Descriptors of one acquisition.
/// A waiter keeps them between tries, so that its tries do not close (and signal) anything.
#[derive(Debug, Default)]
pub(crate) struct Files {
    pub(crate) name: Option<LockName>,
    lock: Option<LockFile>,
    gate: Option<LockFile>,
    permit: Option<PermitHold>,
    pub(crate) recorded: bool,
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
    let state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let files = &state.held.get(owner)?.files;
    if let Some(lock) = &files.lock {
        return Some(lock.file.try_clone().map(OwnedFd::from));
    }
    files.permit.as_ref()?.semaphore.descriptor()
}

impl FileBackend {
    pub(crate) fn state(&self) -> MutexGuard<'static, State> {
        STATE.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tries the kernel locks for `req`, reusing and keeping `files`. `Ok(true)`: granted.
    pub(crate) fn try_lock(&self, req: &Request, files: &mut Files) -> Result<bool> {
        let name = &req.name;
        match req.mode {
            Mode::Exclusive => {
                if req.waiting {
                    // Announce a waiting writer: new readers queue behind it.
                    let gate = reuse(&mut files.gate, || LockFile::open(self.path(name, "gate")))?;
                    if gate.held.is_none() && !gate.try_lock(true)? {
                        return Ok(false);
                    }
                }
                let lock = reuse(&mut files.lock, || LockFile::open(self.path(name, "lock")))?;
                let granted = lock.try_lock(true)?;
                if granted {
                    files.gate = None;
                }
                Ok(granted)
            }
            Mode::Shared => {
                // Read-only and never created here, so that taking and dropping the gate
                // signals nothing.
                match File::open(self.path(name, "gate")) {
                    Ok(gate) => {
                        if !try_flock(&gate, FlockOperation::NonBlockingLockShared)? {
                            return Ok(false);
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(io_error(&format!("opening {name}#gate"), e)),
                }
                let lock = reuse(&mut files.lock, || LockFile::open(self.path(name, "lock")))?;
                lock.try_lock(false)
            }
            Mode::Permit { limit } => {
                let permit = reuse(&mut files.permit, || {
                    Ok(PermitHold {
                        semaphore: self.inner.semaphores.get_or_insert_with(name.as_str(), || {
                            Semaphore::new(self.path(name, "sem"))
                        }),
                        slot: None,
                    })
                })?;
                permit.slot = permit.semaphore.try_acquire(u64::from(limit.get()))?;
                Ok(permit.slot.is_some())
            }
        }
    }
}

/// The value in `slot`, opened by `open` if there is none yet.
pub(crate) fn reuse<T>(slot: &mut Option<T>, open: impl FnOnce() -> Result<T>) -> Result<&mut T> {
    let value = match slot.take() {
        Some(value) => value,
        None => open()?,
    };
    Ok(slot.insert(value))
}
