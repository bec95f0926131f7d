//! The primitives, all on the one engine, and their [`Guard`].
//! [`Mutex`], [`RwLock`], [`Semaphore`], [`Election`].
//!
//! Which one to use:
//!
//! - [`Mutex`]: one holder at a time. The default.
//! - [`RwLock`]: many readers or one writer, for work that is mostly read-only.
//! - [`Semaphore`]: at most N holders (N workers on a rate-limited API); each permit is its
//!   own lease.
//! - [`Election`]: one leader among candidates, with a value (an address) others can read
//!   and watch; the leader's term is its fencing token.
//! - [`MultiLock`]: several mutexes and read-write lock sides, taken all or none in one
//!   canonical order (no deadlock between overlapping sets).
//!
//! Every waiting method has three forms: wait as long as it takes (`lock`), do not wait
//! (`try_lock`, `Ok(None)` when busy), or wait up to a limit (`lock_timeout`, `Ok(None)`
//! when it runs out). Contention is never an error.

mod election;
mod guard;
mod job;
mod multi;
mod mutex;
mod owner;
mod rwlock;
mod semaphore;

use std::sync::Arc;

pub use election::{Election, Leader, Leadership, Observer};
pub(crate) use guard::kept_record;
pub use guard::{Guard, MutexGuard, Permit, ReadGuard, WriteGuard};
pub use job::{Claim, Completion, Job, JobRun, JobTicket, Outcome, Window};
pub use multi::{MultiGuard, MultiLock, Part};
pub use mutex::Mutex;
pub use owner::Owner;
pub use rwlock::RwLock;
pub use semaphore::Semaphore;

use crate::backend::Mode;
use crate::context::Context;
use crate::engine::{self, Spec, Wait};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::options::LockOptions;

/// What every primitive handle holds: where, what, how, and for whom.
#[derive(Debug, Clone)]
struct Target {
    ctx: Arc<Context>,
    name: LockName,
    options: Arc<LockOptions>,
    owner: Option<Owner>,
}

impl Target {
    fn new(ctx: Arc<Context>, name: LockName) -> Self {
        Self {
            options: ctx.options.clone(),
            ctx,
            name,
            owner: None,
        }
    }

    async fn acquire(
        &self,
        mode: Mode,
        value: Option<Arc<[u8]>>,
        wait: Wait,
    ) -> Result<Option<Guard>> {
        if let Some(owner) = &self.owner
            && let Some(guard) = owner.reenter(&self.name, mode)?
        {
            return Ok(Some(guard));
        }
        let spec = Spec {
            name: self.name.clone(),
            mode,
            options: self.options.clone(),
            value,
        };
        let Some(lease) = engine::acquire(&self.ctx, &spec, wait).await? else {
            return Ok(None);
        };
        let guard = Guard::new(lease);
        if let Some(owner) = &self.owner {
            owner.register(&guard);
        }
        Ok(Some(guard))
    }

    async fn acquire_forever(&self, mode: Mode, value: Option<Arc<[u8]>>) -> Result<Guard> {
        // The engine answers `None` only when a wait runs out, and this one does not.
        self.acquire(mode, value, Wait::Forever)
            .await?
            .ok_or(Error::Timeout(std::time::Duration::MAX))
    }
}
