use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{Owner, Target};
use crate::backend::Mode;
use crate::context::Context;
use crate::engine::Wait;
use crate::error::Result;
use crate::fencing::FencingToken;
use crate::name::LockName;
use crate::options::LockOptions;
use crate::sync::MutexGuard;

/// An exclusive lock: one holder at a time.
///
/// A `Mutex` is a cheap handle (a name and options); cloning it does not share a hold.
/// Each successful `lock` is a separate acquisition with its own owner id, unless the
/// handle is bound to an [`Owner`] for reentrancy.
///
/// ```
/// use leasehold_core::{Client, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let client = Client::new(InMemory::new());
/// let mutex = client.mutex("invoices")?;
/// let guard = mutex.lock().await?;
/// assert!(mutex.try_lock().await?.is_none()); // busy: not an error
/// guard.release().await?;
/// assert!(mutex.try_lock().await?.is_some());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Mutex {
    pub(super) target: Target,
}

impl Mutex {
    pub(crate) fn new(ctx: Arc<Context>, name: LockName) -> Self {
        Self {
            target: Target::new(ctx, name),
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.target.name
    }

    /// The options this handle locks with.
    pub fn options(&self) -> &LockOptions {
        &self.target.options
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

    /// Waits until the lock is granted.
    ///
    /// On a fair backend waiters are served in arrival order and only the next one is
    /// woken. Transient backend failures are retried for up to one request timeout.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves nothing held: a queue entry, or a
    /// grant whose reply was still in flight, is released by owner in the background
    /// ([`Client::settle`](crate::Client::settle) waits for that).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) for options the backend cannot
    /// honour; backend errors that persisted for a whole request timeout.
    pub async fn lock(&self) -> Result<MutexGuard> {
        self.target.acquire_forever(Mode::Exclusive, None).await
    }

    /// Takes the lock if it is free now.
    /// `Ok(None)` if it is held (or, on a fair backend, if others are queued for it).
    ///
    /// # Cancel safety
    ///
    /// As for [`lock`](Mutex::lock).
    ///
    /// # Errors
    ///
    /// As for [`lock`](Mutex::lock); an unanswered request is not retried but released and
    /// reported as [`Error::Timeout`](crate::Error::Timeout).
    pub async fn try_lock(&self) -> Result<Option<MutexGuard>> {
        self.target.acquire(Mode::Exclusive, None, Wait::No).await
    }

    /// Waits up to `wait` for the lock; `Ok(None)` if it was not granted in time.
    /// Anything the attempt left on the server (a queue entry) is released before
    /// returning.
    ///
    /// # Cancel safety
    ///
    /// As for [`lock`](Mutex::lock).
    ///
    /// # Errors
    ///
    /// As for [`lock`](Mutex::lock); [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// for a wait longer than [`MAX_DURATION`](crate::MAX_DURATION).
    pub async fn lock_timeout(&self, wait: Duration) -> Result<Option<MutexGuard>> {
        self.target
            .acquire(Mode::Exclusive, None, Wait::UpTo(wait))
            .await
    }

    /// Locks, runs `work` with the grant's fencing token while the lock is held, and releases.
    /// If the lock is lost first, `work` is cancelled (dropped at its next await point).
    ///
    /// Once `work` has completed, its output is returned even if the release then fails;
    /// such failures are logged.
    ///
    /// ```
    /// use leasehold_core::{Client, memory::InMemory};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
    /// let client = Client::new(InMemory::new());
    /// let total = client.mutex("nightly")?.run(|token| async move {
    ///     // write to the protected resource, passing `token` along
    ///     token.get()
    /// }).await?;
    /// assert!(total > 0);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops `work` and the guard; the lock is released in the
    /// background.
    ///
    /// # Errors
    ///
    /// As for [`lock`](Mutex::lock), and [`Error::Lost`](crate::Error::Lost) if the lease
    /// was lost before `work` completed.
    pub async fn run<F, Fut>(&self, work: F) -> Result<Fut::Output>
    where
        F: FnOnce(FencingToken) -> Fut,
        Fut: Future,
    {
        let guard = self.lock().await?;
        let output = guard.run(work(guard.token())).await;
        let name = guard.name().clone();
        if let Err(error) = guard.release().await
            && output.is_ok()
        {
            tracing::warn!(lock = %name, %error, "release after a completed run failed");
        }
        output
    }
}
