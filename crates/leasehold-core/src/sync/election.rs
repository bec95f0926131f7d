use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::Target;
use crate::backend::{LockState, Mode};
use crate::context::Context;
use crate::engine::Wait;
use crate::error::{LossReason, Result};
use crate::fencing::FencingToken;
use crate::name::{LockName, OwnerId};
use crate::options::LockOptions;
use crate::sync::Guard;

/// Leader election: candidates campaign with a value (an address, an id); one at a time leads.
/// Leadership is the exclusive half of the name's lock, so a leader is lost exactly as a
/// lock is, and its term is its fencing token.
///
/// ```
/// use leasehold_core::{Client, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let client = Client::new(InMemory::new());
/// let election = client.election("scheduler")?;
/// let mut observer = election.observe();
/// assert!(observer.next().await?.is_none()); // nobody leads yet
///
/// let leadership = election.campaign("10.0.0.7:8080").await?;
/// let leader = observer.next().await?.expect("a leader");
/// assert_eq!(leader.value, b"10.0.0.7:8080");
/// assert_eq!(leader.term, leadership.term());
///
/// leadership.resign().await?;
/// assert!(observer.next().await?.is_none());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Election {
    target: Target,
}

/// The current leader, as the server reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leader's owner id.
    pub owner: OwnerId,
    /// The leader's term: its fencing token.
    pub term: FencingToken,
    /// The value it campaigned with.
    pub value: Vec<u8>,
    /// Time left on its lease on the server, if leases expire.
    pub remaining: Option<Duration>,
}

impl Election {
    pub(crate) fn new(ctx: Arc<Context>, name: LockName) -> Self {
        Self {
            target: Target::new(ctx, name),
        }
    }

    /// The election's name.
    pub fn name(&self) -> &LockName {
        &self.target.name
    }

    /// This handle with other options.
    /// Pass an `Arc` to share one copy among many handles (many held locks).
    pub fn with_options(mut self, options: impl Into<Arc<LockOptions>>) -> Self {
        self.target.options = options.into();
        self
    }

    /// Waits until elected, then leads with `value` until resigning or losing the lease.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future withdraws the candidacy; see [`Mutex::lock`](crate::Mutex::lock).
    ///
    /// # Errors
    ///
    /// As for [`Mutex::lock`](crate::Mutex::lock).
    pub async fn campaign(&self, value: impl Into<Vec<u8>>) -> Result<Leadership> {
        let value: Arc<[u8]> = value.into().into();
        let guard = self
            .target
            .acquire_forever(Mode::Exclusive, Some(value.clone()))
            .await?;
        Ok(Leadership { guard, value })
    }

    /// Leads with `value` if nobody leads now; `Ok(None)` if somebody does.
    /// One attempt, without joining a queue.
    ///
    /// # Cancel safety
    ///
    /// As for [`campaign`](Election::campaign).
    ///
    /// # Errors
    ///
    /// As for [`campaign`](Election::campaign).
    pub async fn try_campaign(&self, value: impl Into<Vec<u8>>) -> Result<Option<Leadership>> {
        let value: Arc<[u8]> = value.into().into();
        let guard = self
            .target
            .acquire(Mode::Exclusive, Some(value.clone()), Wait::No)
            .await?;
        Ok(guard.map(|guard| Leadership { guard, value }))
    }

    /// Campaigns for up to `wait`; `Ok(None)` if not elected in time (the candidacy is withdrawn).
    ///
    /// # Cancel safety
    ///
    /// As for [`campaign`](Election::campaign).
    ///
    /// # Errors
    ///
    /// As for [`campaign`](Election::campaign).
    pub async fn campaign_timeout(
        &self,
        value: impl Into<Vec<u8>>,
        wait: Duration,
    ) -> Result<Option<Leadership>> {
        let value: Arc<[u8]> = value.into().into();
        let guard = self
            .target
            .acquire(Mode::Exclusive, Some(value.clone()), Wait::UpTo(wait))
            .await?;
        Ok(guard.map(|guard| Leadership { guard, value }))
    }

    /// The current leader, if any.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    ///
    /// # Errors
    ///
    /// Backend errors.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        Ok(leader_of(&self.state().await?))
    }

    /// A watcher of leadership changes.
    pub fn observe(&self) -> Observer {
        Observer {
            election: self.clone(),
            last: None,
        }
    }

    async fn state(&self) -> Result<LockState> {
        let ctx = &self.target.ctx;
        ctx.call(
            self.target.options.request_timeout(),
            ctx.backend.inspect(&self.target.name),
        )
        .await
    }
}

fn leader_of(state: &LockState) -> Option<Leader> {
    state
        .holders
        .iter()
        .find(|holder| holder.mode == Mode::Exclusive)
        .map(|holder| Leader {
            owner: holder.owner.clone(),
            term: holder.token,
            value: holder.value.as_deref().unwrap_or_default().to_vec(),
            remaining: holder.remaining,
        })
}

/// Leading an [`Election`].
#[must_use = "dropping a leadership resigns it at once (in the background)"]
#[derive(Debug)]
pub struct Leadership {
    guard: Guard,
    value: Arc<[u8]>,
}

impl Leadership {
    /// This leadership's term: its fencing token, greater than every earlier term.
    pub fn term(&self) -> FencingToken {
        self.guard.token()
    }

    /// The value campaigned with.
    pub fn value(&self) -> &[u8] {
        &self.value
    }

    /// Whether the leadership is still valid by the local deadline.
    pub fn is_held(&self) -> bool {
        self.guard.is_held()
    }

    /// Completes when leadership is lost (see [`Guard::lost`]).
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        self.guard.lost()
    }

    /// The underlying guard (remaining validity, scoped runs).
    pub fn guard(&self) -> &Guard {
        &self.guard
    }

    /// The underlying guard, owned: leadership ends when it is released or dropped.
    pub fn into_guard(self) -> Guard {
        self.guard
    }

    /// Steps down.
    ///
    /// # Cancel safety
    ///
    /// As for [`Guard::release`].
    ///
    /// # Errors
    ///
    /// As for [`Guard::release`].
    pub async fn resign(self) -> Result<()> {
        self.guard.release().await
    }
}

/// Reports leadership changes of an [`Election`], one at a time.
#[derive(Debug)]
pub struct Observer {
    election: Election,
    last: Option<Option<(OwnerId, FencingToken)>>,
}

impl Observer {
    /// The first call returns the current leader (or `None`), later calls the next one.
    /// Each later call waits until the leader differs from the one last returned, and
    /// returns the new one (`None` when nobody leads). Changes that come and go between two
    /// calls may be skipped.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future loses nothing; the next call compares against the
    /// last leader returned.
    ///
    /// # Errors
    ///
    /// Backend errors.
    pub async fn next(&mut self) -> Result<Option<Leader>> {
        let target = &self.election.target;
        let slice = (target.options.ttl() / 3).max(Duration::from_millis(1));
        loop {
            let state = self.election.state().await?;
            let leader = leader_of(&state);
            let key = leader.as_ref().map(|l| (l.owner.clone(), l.term));
            if self.last.as_ref() != Some(&key) {
                self.last = Some(key);
                return Ok(leader);
            }
            let ctx = &target.ctx;
            ctx.call(
                slice.saturating_add(target.options.request_timeout()),
                ctx.backend.wait(&target.name, &state.hint, slice),
            )
            .await?;
        }
    }
}
