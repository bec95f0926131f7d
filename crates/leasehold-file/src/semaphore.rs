//! `N#sem`: a semaphore whose permit `K` is a write lock on byte `K` of one file.
//!
//! The locks are Linux open-file-description locks (`ofd.rs`). All permits and permit
//! waiters of one name in one [`FileBackend`](crate::FileBackend) share one descriptor of
//! `N#sem`, however many permits the semaphore has; locks of one description never
//! conflict, so the permits it holds are kept apart in memory. That state lives only while
//! a permit or permit waiter of the name needs it.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use leasehold_core::{Error, LockName, Result};

#[cfg(target_os = "linux")]
use crate::directory::{io_error, is_linked, open_rw, reuse};
#[cfg(target_os = "linux")]
use crate::ofd;

/// This instance's semaphores in use, by name.
#[derive(Debug, Default)]
pub(crate) struct Semaphores(Arc<ByName>);

type ByName = Mutex<HashMap<LockName, Weak<Semaphore>>>;

impl Semaphores {
    /// The semaphore of `name`, made on the file at `path` if there is none.
    pub(crate) fn get(&self, name: &LockName, path: PathBuf) -> Arc<Semaphore> {
        let mut by_name = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(semaphore) = by_name.get(name).and_then(Weak::upgrade) {
            return semaphore;
        }
        // A dead entry still here is being dropped; its drop leaves the new one alone.
        let semaphore = Arc::new(Semaphore {
            name: name.clone(),
            path,
            by_name: Arc::downgrade(&self.0),
            state: Mutex::default(),
        });
        by_name.insert(name.clone(), Arc::downgrade(&semaphore));
        semaphore
    }
}

/// A permit taken or wanted through this instance's semaphore of a name.
#[derive(Debug)]
pub(crate) struct PermitHold {
    pub(crate) semaphore: Arc<Semaphore>,
    pub(crate) slot: Option<u64>,
}

impl Drop for PermitHold {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.semaphore.release(slot);
        }
    }
}

/// This instance's side of one semaphore name: its descriptor and the permits it holds.
/// It leaves its [`Semaphores`] when its last permit or waiter drops it.
#[derive(Debug)]
pub(crate) struct Semaphore {
    name: LockName,
    path: PathBuf,
    by_name: Weak<ByName>,
    state: Mutex<SemaphoreState>,
}

#[derive(Debug, Default)]
struct SemaphoreState {
    file: Option<File>,
    held: Slots,
}

impl Semaphore {
    fn state(&self) -> MutexGuard<'_, SemaphoreState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the lowest free permit below `limit`, if any.
    /// Each step skips a whole run of taken permits (this instance's, or one other
    /// description's), so a try costs about as many system calls as there are runs below
    /// the first free permit, not `limit`.
    #[cfg(target_os = "linux")]
    pub(crate) fn try_acquire(&self, limit: u64) -> Result<Option<u64>> {
        use crate::ofd::Range;
        let failed = |e| io_error(&format!("locking {}", self.path.display()), e);
        let mut guard = self.state();
        let SemaphoreState { file: open, held } = &mut *guard;
        loop {
            let file = reuse(open, || open_rw(&self.path))?;
            let mut slot = 0;
            let found = loop {
                if slot >= limit {
                    break None;
                }
                if let Some(end) = held.run_end(slot) {
                    slot = end;
                    continue;
                }
                if ofd::try_lock(&*file, Range::new(slot, 1)).map_err(failed)? {
                    break Some(slot);
                }
                // Skip the run of the description in the way (freed meanwhile: try again).
                if let Some(blocker) = ofd::blocker(&*file, Range::new(slot, 1)).map_err(failed)? {
                    slot = blocker.end().max(slot + 1);
                }
            };
            let Some(slot) = found else {
                return Ok(None);
            };
            if is_linked(file, &self.path)? {
                held.insert(slot);
                return Ok(Some(slot));
            }
            // Deleted by its last user since we opened it, which happens only when no
            // permit is held on it: take the current file.
            if !held.is_empty() {
                return Err(Error::backend(
                    format!(
                        "{} was deleted while permits were held on it",
                        self.path.display()
                    ),
                    false,
                ));
            }
            *open = None;
        }
    }

    /// Permits need Linux: elsewhere asking for one is unsupported.
    #[cfg(not(target_os = "linux"))]
    pub(crate) fn try_acquire(&self, _limit: u64) -> Result<Option<u64>> {
        Err(Error::Unsupported {
            backend: "file",
            feature: "permits (they need Linux open-file-description locks)",
        })
    }

    /// Gives back one permit and tells waiters.
    /// A byte-range unlock raises no file event, so the file is touched.
    fn release(&self, slot: u64) {
        let mut state = self.state();
        #[cfg(target_os = "linux")]
        if let Some(file) = &state.file {
            let _ = ofd::unlock(file, ofd::Range::new(slot, 1));
            let now = rustix::fs::Timespec {
                tv_sec: 0,
                tv_nsec: rustix::fs::UTIME_NOW,
            };
            let _ = rustix::fs::futimens(
                file,
                &rustix::fs::Timestamps {
                    last_access: now,
                    last_modification: now,
                },
            );
        }
        state.held.remove(slot);
    }

    /// A descriptor of the description holding this instance's permits.
    pub(crate) fn descriptor(&self) -> Option<std::io::Result<OwnedFd>> {
        self.state()
            .file
            .as_ref()
            .map(|f| f.try_clone().map(OwnedFd::from))
    }
}

impl Drop for Semaphore {
    fn drop(&mut self) {
        if let Some(by_name) = self.by_name.upgrade() {
            let mut by_name = by_name.lock().unwrap_or_else(|e| e.into_inner());
            // Only if no newer semaphore took the name meanwhile.
            if by_name
                .get(&self.name)
                .is_some_and(|s| s.strong_count() == 0)
            {
                by_name.remove(&self.name);
            }
        }
        // The last permit and waiter of this instance are gone: delete the file if nobody
        // holds a permit on it, holding all of it meanwhile.
        #[cfg(target_os = "linux")]
        {
            let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
            if let Some(file) = &state.file
                && state.held.is_empty()
                && ofd::try_lock(file, ofd::Range::new(0, 0)).unwrap_or(false)
                && is_linked(file, &self.path).unwrap_or(false)
            {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// Slot numbers held, as disjoint, non-adjacent runs `start..end`.
#[derive(Debug, Default)]
struct Slots(BTreeMap<u64, u64>);

impl Slots {
    /// The end of the run holding `slot`, if one does.
    fn run_end(&self, slot: u64) -> Option<u64> {
        let (_, &end) = self.0.range(..=slot).next_back()?;
        (end > slot).then_some(end)
    }

    /// Adds a slot not held yet.
    fn insert(&mut self, slot: u64) {
        let (mut start, mut end) = (slot, slot + 1);
        if let Some((&before, &before_end)) = self.0.range(..slot).next_back()
            && before_end == slot
        {
            start = before;
        }
        if let Some(after_end) = self.0.remove(&end) {
            end = after_end;
        }
        self.0.insert(start, end);
    }

    /// Removes a slot, splitting its run.
    fn remove(&mut self, slot: u64) {
        let Some((&start, &end)) = self.0.range(..=slot).next_back() else {
            return;
        };
        if end <= slot {
            return;
        }
        self.0.remove(&start);
        if start < slot {
            self.0.insert(start, slot);
        }
        if slot + 1 < end {
            self.0.insert(slot + 1, end);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step fails the test

    use super::*;

    #[test]
    fn a_semaphore_leaves_with_its_last_handle() {
        let semaphores = Semaphores::default();
        let count = || semaphores.0.lock().unwrap().len();
        let name = LockName::new("a").unwrap();
        let a = semaphores.get(&name, "a#sem".into());
        let again = semaphores.get(&name, "b#sem".into());
        assert!(Arc::ptr_eq(&a, &again));
        drop(a);
        assert_eq!(count(), 1);
        drop(again);
        assert_eq!(count(), 0);
        assert_eq!(
            semaphores.get(&name, "c#sem".into()).path,
            PathBuf::from("c#sem")
        );
    }
}
