use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use super::Target;
use crate::backend::Mode;
use crate::context::Context;
use crate::engine::Wait;
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::options::LockOptions;
use crate::sync::Permit;

/// A counting semaphore: at most `permits` holders at once.
/// Each permit is its own lease with its own fencing token, renewed and lost on its own.
///
/// A semaphore and a mutex of the same name are independent (see
/// [`backend`](crate::backend) for the model). All users of one semaphore name should
/// agree on the number of permits; a request is granted while fewer than *its* number are
/// held.
///
/// ```
/// use leasehold_core::{Client, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let client = Client::new(InMemory::new());
/// let api = client.semaphore("partner-api", 2)?;
/// let first = api.acquire().await?;
/// let second = api.acquire().await?;
/// assert!(api.try_acquire().await?.is_none());
/// first.release().await?;
/// assert!(api.try_acquire().await?.is_some());
/// # drop(second);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Semaphore {
    target: Target,
    permits: NonZeroU32,
}

impl Semaphore {
    pub(crate) fn new(ctx: Arc<Context>, name: LockName, permits: u32) -> Result<Self> {
        let permits = NonZeroU32::new(permits)
            .ok_or_else(|| Error::invalid("permits", "a semaphore needs at least one permit"))?;
        Ok(Self {
            target: Target::new(ctx, name),
            permits,
        })
    }

    /// The semaphore's name.
    pub fn name(&self) -> &LockName {
        &self.target.name
    }

    /// The number of permits.
    pub fn permits(&self) -> u32 {
        self.permits.get()
    }

    /// This handle with other options.
    /// Pass an `Arc` to share one copy among many handles (many held locks).
    pub fn with_options(mut self, options: impl Into<Arc<LockOptions>>) -> Self {
        self.target.options = options.into();
        self
    }

    fn mode(&self) -> Mode {
        Mode::Permit {
            limit: self.permits,
        }
    }

    /// Waits for a permit.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves nothing held; see [`Mutex::lock`](crate::Mutex::lock).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] on a backend without permits; otherwise as for
    /// [`Mutex::lock`](crate::Mutex::lock).
    pub async fn acquire(&self) -> Result<Permit> {
        self.target.acquire_forever(self.mode(), None).await
    }

    /// Takes a permit if one is free now.
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](Semaphore::acquire).
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Semaphore::acquire).
    pub async fn try_acquire(&self) -> Result<Option<Permit>> {
        self.target.acquire(self.mode(), None, Wait::No).await
    }

    /// Waits up to `wait` for a permit.
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](Semaphore::acquire).
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Semaphore::acquire).
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<Option<Permit>> {
        self.target
            .acquire(self.mode(), None, Wait::UpTo(wait))
            .await
    }
}
