use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex as StdMutex, Weak};

use crate::backend::Mode;
use crate::error::{Error, Result};
use crate::lease::Lease;
use crate::name::LockName;
use crate::sync::Guard;

/// An explicit identity for reentrant locking.
/// A [`Mutex`](crate::Mutex) or [`RwLock`](crate::RwLock) bound to an `Owner` (with
/// `owned_by`) grants again, without asking the server, while that owner already holds it,
/// and counts the holds. The lock is released on the server when the last hold is released
/// or dropped.
///
/// Reentrancy is never tied to a thread or task: whoever has a clone of the `Owner` is the
/// owner. An owner holding the write lock may take the read lock (it gets another hold of
/// the write lock); taking the write lock while holding only the read lock is refused, as
/// it would wait for itself forever.
///
/// ```
/// use leasehold_core::{Client, Owner, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let client = Client::new(InMemory::new());
/// let owner = Owner::new();
/// let mutex = client.mutex("config")?.owned_by(&owner);
/// let outer = mutex.lock().await?;
/// let inner = mutex.lock().await?; // re-entered: same grant, same token
/// assert_eq!(inner.token(), outer.token());
/// assert_eq!(outer.hold_count(), 2);
/// inner.release().await?;
/// assert!(outer.is_held());
/// outer.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct Owner {
    holds: Arc<StdMutex<HashMap<LockName, Weak<Lease>>>>,
}

impl Owner {
    /// A new owner, holding nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Another hold of `name` if this owner holds it in a mode that covers `mode`.
    /// An error for a read-to-write upgrade; `None` otherwise.
    pub(crate) fn reenter(&self, name: &LockName, mode: Mode) -> Result<Option<Guard>> {
        let holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        let Some(lease) = holds.get(name).and_then(Weak::upgrade) else {
            return Ok(None);
        };
        match (lease.request.mode, mode) {
            (Mode::Exclusive, Mode::Exclusive | Mode::Shared) | (Mode::Shared, Mode::Shared) => {
                Ok(lease.add_hold().then(|| Guard::new(lease)))
            }
            (Mode::Shared, Mode::Exclusive) if lease.is_held() => Err(Error::invalid(
                "lock upgrade",
                format!(
                    "this owner holds a read lock on {name}; release it before taking the \
                     write lock (an upgrade would wait for itself)"
                ),
            )),
            _ => Ok(None),
        }
    }

    /// Records that this owner now holds `guard`'s lock.
    pub(crate) fn register(&self, guard: &Guard) {
        let mut holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        holds.retain(|_, lease| lease.strong_count() > 0);
        holds.insert(guard.name().clone(), Arc::downgrade(guard.lease()));
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("Owner")
            .field("holds", &holds.keys().collect::<Vec<_>>())
            .finish()
    }
}
