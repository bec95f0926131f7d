use std::sync::Arc;
use std::time::Duration;

use super::{Owner, Target};
use crate::backend::Mode;
use crate::context::Context;
use crate::engine::Wait;
use crate::error::Result;
use crate::name::LockName;
use crate::options::LockOptions;
use crate::sync::{ReadGuard, WriteGuard};

/// A read-write lock: many readers or one writer.
///
/// On backends with a queue, requests are served in arrival order: a reader that arrives
/// while a writer waits queues behind the writer, so writers are not starved.
///
/// ```
/// use leasehold_core::{Client, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let client = Client::new(InMemory::new());
/// let catalog = client.rwlock("catalog")?;
/// let a = catalog.read().await?;
/// let b = catalog.read().await?; // readers share
/// assert!(catalog.try_write().await?.is_none()); // the writer must wait for both
/// a.release().await?;
/// b.release().await?;
/// assert!(catalog.try_write().await?.is_some());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RwLock {
    pub(super) target: Target,
}

impl RwLock {
    pub(crate) fn new(ctx: Arc<Context>, name: LockName) -> Self {
        Self {
            target: Target::new(ctx, name),
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.target.name
    }

    /// This handle with other options.
    /// Pass an `Arc` to share one copy among many handles (many held locks).
    pub fn with_options(mut self, options: impl Into<Arc<LockOptions>>) -> Self {
        self.target.options = options.into();
        self
    }

    /// This handle, reentrant for `owner` (see [`Owner`]).
    pub fn owned_by(mut self, owner: &Owner) -> Self {
        self.target.owner = Some(owner.clone());
        self
    }

    /// Waits for a read lock.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves nothing held; see [`Mutex::lock`](crate::Mutex::lock).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) on a backend without shared mode;
    /// otherwise as for [`Mutex::lock`](crate::Mutex::lock).
    pub async fn read(&self) -> Result<ReadGuard> {
        self.target.acquire_forever(Mode::Shared, None).await
    }

    /// Takes a read lock if one is available now.
    ///
    /// # Cancel safety
    ///
    /// As for [`read`](RwLock::read).
    ///
    /// # Errors
    ///
    /// As for [`read`](RwLock::read).
    pub async fn try_read(&self) -> Result<Option<ReadGuard>> {
        self.target.acquire(Mode::Shared, None, Wait::No).await
    }

    /// Waits up to `wait` for a read lock.
    ///
    /// # Cancel safety
    ///
    /// As for [`read`](RwLock::read).
    ///
    /// # Errors
    ///
    /// As for [`read`](RwLock::read).
    pub async fn read_timeout(&self, wait: Duration) -> Result<Option<ReadGuard>> {
        self.target
            .acquire(Mode::Shared, None, Wait::UpTo(wait))
            .await
    }

    /// Waits for the write lock.
    ///
    /// # Cancel safety
    ///
    /// As for [`read`](RwLock::read).
    ///
    /// # Errors
    ///
    /// As for [`Mutex::lock`](crate::Mutex::lock);
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if this handle's owner
    /// holds only the read lock.
    pub async fn write(&self) -> Result<WriteGuard> {
        self.target.acquire_forever(Mode::Exclusive, None).await
    }

    /// Takes the write lock if it is free now.
    ///
    /// # Cancel safety
    ///
    /// As for [`read`](RwLock::read).
    ///
    /// # Errors
    ///
    /// As for [`write`](RwLock::write).
    pub async fn try_write(&self) -> Result<Option<WriteGuard>> {
        self.target.acquire(Mode::Exclusive, None, Wait::No).await
    }

    /// Waits up to `wait` for the write lock.
    ///
    /// # Cancel safety
    ///
    /// As for [`read`](RwLock::read).
    ///
    /// # Errors
    ///
    /// As for [`write`](RwLock::write).
    pub async fn write_timeout(&self, wait: Duration) -> Result<Option<WriteGuard>> {
        self.target
            .acquire(Mode::Exclusive, None, Wait::UpTo(wait))
            .await
    }
}
