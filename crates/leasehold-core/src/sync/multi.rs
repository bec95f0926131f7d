use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{Guard, Mutex, RwLock, Target};
use crate::backend::Mode;
use crate::clock::{Clock, Instant};
use crate::engine::Wait;
use crate::error::{Error, LossReason, Result};
use crate::fencing::FencingToken;
use crate::name::LockName;

/// One lock of a [`MultiLock`]: a mutex, or one side of a read-write lock.
#[derive(Debug, Clone)]
pub struct Part {
    target: Target,
    mode: Mode,
}

impl Part {
    /// The read side of `lock`.
    pub fn read(lock: &RwLock) -> Part {
        Part {
            target: lock.target.clone(),
            mode: Mode::Shared,
        }
    }

    /// The write side of `lock`.
    pub fn write(lock: &RwLock) -> Part {
        Part {
            target: lock.target.clone(),
            mode: Mode::Exclusive,
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.target.name
    }
}

impl From<Mutex> for Part {
    fn from(mutex: Mutex) -> Part {
        Part {
            target: mutex.target,
            mode: Mode::Exclusive,
        }
    }
}

impl From<&Mutex> for Part {
    fn from(mutex: &Mutex) -> Part {
        Part::from(mutex.clone())
    }
}

/// Several locks taken all or none.
/// As Redisson's `MultiLock` and Curator's `InterProcessMultiLock` do.
///
/// All parts are first asked for at once, without waiting (one round trip when they are
/// free); if any is busy, the parts granted are given back and the parts are taken one
/// after the other in one canonical order — by name — whatever order they were given in,
/// so two clients taking overlapping sets never wait for each other in a circle. Each part keeps its own grant, lease and fencing token; the set is
/// lost when any part is.
///
/// ```
/// use leasehold_core::{Client, MultiLock, Part, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let client = Client::new(InMemory::new());
/// let transfer = client.multi([
///     Part::from(client.mutex("account-17")?),
///     Part::from(client.mutex("account-4")?),
///     Part::read(&client.rwlock("rates")?),
/// ])?;
/// let guards = transfer.lock().await?;
/// let token = guards.token("account-4"); // send with every write to that account
/// # assert!(token.is_some());
/// guards.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MultiLock {
    parts: Vec<Part>,
}

impl MultiLock {
    /// The locks `parts`, to be taken together.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for no parts, or for one name twice (two sides of one
    /// read-write lock included: a set cannot wait for itself).
    pub fn new(parts: impl IntoIterator<Item = Part>) -> Result<MultiLock> {
        let mut parts: Vec<Part> = parts.into_iter().collect();
        if parts.is_empty() {
            return Err(Error::invalid(
                "parts",
                "a multi-lock needs at least one lock",
            ));
        }
        parts.sort_by(|a, b| a.name().as_str().cmp(b.name().as_str()));
        if let Some(twice) = parts.windows(2).find(|w| w[0].name() == w[1].name()) {
            return Err(Error::invalid(
                "parts",
                format!(
                    "{} is named twice: a set cannot wait for itself",
                    twice[0].name()
                ),
            ));
        }
        Ok(MultiLock { parts })
    }

    /// The parts, in the order they are taken.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Waits until every part is granted.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves nothing held: the parts already granted are released
    /// (their guards drop), and the one being asked for is released as a cancelled
    /// [`Mutex::lock`] is.
    ///
    /// # Errors
    ///
    /// The first error of a part, after every part granted so far was released; see
    /// [`Mutex::lock`].
    pub async fn lock(&self) -> Result<MultiGuard> {
        // Without a limit a part's wait never runs out.
        self.take(None).await?.ok_or(Error::Timeout(Duration::MAX))
    }

    /// Takes every part if each is available now, or none.
    ///
    /// # Cancel safety
    ///
    /// As for [`lock`](MultiLock::lock).
    ///
    /// # Errors
    ///
    /// As for [`lock`](MultiLock::lock).
    pub async fn try_lock(&self) -> Result<Option<MultiGuard>> {
        self.take(Some(Duration::ZERO)).await
    }

    /// Waits up to `wait`, in all, for every part.
    /// `Ok(None)` (nothing held) when it runs out.
    ///
    /// # Cancel safety
    ///
    /// As for [`lock`](MultiLock::lock).
    ///
    /// # Errors
    ///
    /// As for [`lock`](MultiLock::lock).
    pub async fn lock_timeout(&self, wait: Duration) -> Result<Option<MultiGuard>> {
        self.take(Some(wait)).await
    }

    /// Takes the parts in order, each waiting for what is left of `limit`.
    /// On a busy part or an error, the parts taken are released before it returns. A set
    /// in which a part was lost while a later one was waited for is given back and taken
    /// again (within the limit).
    async fn take(&self, limit: Option<Duration>) -> Result<Option<MultiGuard>> {
        // The limit runs on the client's clock, as each part's own wait does.
        let until = match (limit, self.parts.first()) {
            (Some(limit), Some(first)) => {
                let clock = first.target.ctx.clock.clone();
                Some((clock.now().saturating_add(limit), clock))
            }
            _ => None,
        };
        if let Some(set) = self.take_at_once(limit).await? {
            return Ok(set);
        }
        loop {
            let Some(set) = self.take_once(until.as_ref()).await? else {
                return Ok(None);
            };
            if set.is_held() {
                return Ok(Some(set));
            }
            tracing::debug!("a part of a multi-lock was lost while a later one was waited for");
            give_back(set.guards).await;
        }
    }

    /// Tries every part at once, without waiting: the uncontended set in one round trip.
    /// The requests go out together (pipelined where the backend multiplexes one
    /// connection), so the set costs one request's latency instead of one per part. No
    /// request waits or queues, so two sets can never wait for each other; if any part is
    /// busy, the parts granted are given back and the set is taken part by part, in order
    /// ([`take_once`](MultiLock::take_once)).
    ///
    /// `Some(answer)`: the answer (the set; for a `try_lock`, also `None` when a part is
    /// busy; an error that retrying would not cure). `None`: go on part by part.
    async fn take_at_once(&self, limit: Option<Duration>) -> Result<Option<Option<MultiGuard>>> {
        if self.parts.len() < 2 {
            return Ok(None);
        }
        let tries = (self.parts.iter()).map(|part| part.target.acquire(part.mode, None, Wait::No));
        let answers = futures_util::future::join_all(tries).await;
        let mut guards = Vec::with_capacity(answers.len());
        let mut busy = false;
        let mut failed = None;
        for answer in answers {
            match answer {
                Ok(Some(guard)) => guards.push(guard),
                Ok(None) => busy = true,
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        if !busy && failed.is_none() {
            let set = MultiGuard { guards };
            if set.is_held() {
                return Ok(Some(Some(set)));
            }
            give_back(set.guards).await;
            return Ok(None);
        }
        give_back(guards).await;
        match failed {
            Some(error) if !error.is_retryable() => Err(error),
            // A try does not wait: busy is its answer.
            None if limit == Some(Duration::ZERO) => Ok(Some(None)),
            _ => Ok(None),
        }
    }

    /// One pass of [`take`](MultiLock::take).
    /// `until` is the limit's end and the clock it is read on (`None`: no limit).
    async fn take_once(
        &self,
        until: Option<&(Instant, Arc<dyn Clock>)>,
    ) -> Result<Option<MultiGuard>> {
        let mut guards = Vec::with_capacity(self.parts.len());
        for part in &self.parts {
            let wait = match until {
                None => Wait::Forever,
                Some((until, clock)) => Wait::UpTo(until.saturating_duration_since(clock.now())),
            };
            match part.target.acquire(part.mode, None, wait).await {
                Ok(Some(guard)) => guards.push(guard),
                Ok(None) => {
                    give_back(guards).await;
                    return Ok(None);
                }
                Err(error) => {
                    give_back(guards).await;
                    return Err(error);
                }
            }
        }
        Ok(Some(MultiGuard { guards }))
    }
}

/// Releases the parts of a set that was not taken whole.
/// A release that fails goes on in the background (see [`Guard::release`]).
async fn give_back(guards: Vec<Guard>) {
    if let Err(error) = release_all(guards).await {
        tracing::debug!(%error, "releasing a part of an untaken set failed");
    }
}

/// Releases `guards`, all at once; the first error, if any.
/// One round trip where the backend pipelines.
async fn release_all(guards: Vec<Guard>) -> Result<()> {
    let released = futures_util::future::join_all(guards.into_iter().map(Guard::release)).await;
    released.into_iter().collect()
}

impl From<Guard> for MultiGuard {
    /// One guard as a set of one.
    fn from(guard: Guard) -> MultiGuard {
        MultiGuard {
            guards: vec![guard],
        }
    }
}

/// Proof of holding every lock of a [`MultiLock`]: one [`Guard`] per part.
///
/// Dropping it drops every guard, which releases each (see [`Guard`]).
#[derive(Debug)]
#[must_use = "dropping the guards releases every lock at once (in the background)"]
pub struct MultiGuard {
    guards: Vec<Guard>,
}

impl MultiGuard {
    /// The guards, in the order the parts were taken (by name).
    pub fn guards(&self) -> &[Guard] {
        &self.guards
    }

    /// The fencing token of the part named `name`, if it is one.
    /// Each part has its own: send each with the writes it protects.
    pub fn token(&self, name: &str) -> Option<FencingToken> {
        (self.guards.iter())
            .find(|g| g.name().as_str() == name)
            .map(Guard::token)
    }

    /// Whether every part is still held.
    pub fn is_held(&self) -> bool {
        self.guards.iter().all(Guard::is_held)
    }

    /// The time left until the first part's local deadline.
    pub fn remaining(&self) -> Duration {
        (self.guards.iter())
            .map(Guard::remaining)
            .min()
            .unwrap_or(Duration::ZERO)
    }

    /// The earliest local deadline of the parts (`None`: none expires).
    ///
    /// # Errors
    ///
    /// As for [`Guard::deadline`], for the first part not held.
    pub fn deadline(&self) -> Result<Option<Instant>> {
        let parts = (self.guards.iter())
            .map(Guard::deadline)
            .collect::<Result<Vec<_>>>()?;
        Ok(parts.into_iter().flatten().min())
    }

    /// Completes when [`deadline`](MultiGuard::deadline) no longer answers `Ok(seen)`.
    /// A part's renewal moved the earliest deadline, or a part was lost. As
    /// [`Guard::deadline_changed`] for one part.
    ///
    /// # Cancel safety
    ///
    /// It only reads: dropping it changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] if a part was lost.
    pub async fn deadline_changed(&self, seen: Option<Instant>) -> Result<Option<Instant>> {
        loop {
            // Each part's deadline read once: the earliest is compared with `seen`, and
            // each part waits for a move from the very value read (a renewal in between is
            // a change, not a miss).
            let parts = (self.guards.iter())
                .map(Guard::deadline)
                .collect::<Result<Vec<_>>>()?;
            let earliest = parts.iter().flatten().min().copied();
            if earliest != seen {
                return Ok(earliest);
            }
            let moves: Vec<_> = (self.guards.iter().zip(parts))
                .map(|(g, read)| Box::pin(g.deadline_changed(read)))
                .collect();
            if moves.is_empty() {
                return std::future::pending().await;
            }
            futures_util::future::select_all(moves).await.0?;
        }
    }

    /// Completes when any part is lost, with its name and why: the set is lost then.
    ///
    /// The future owns what it needs; it can be moved into another task.
    pub fn lost(&self) -> impl Future<Output = (LockName, LossReason)> + Send + 'static {
        let losses: Vec<_> = (self.guards.iter())
            .map(|g| {
                let (name, lost) = (g.name().clone(), g.lost());
                Box::pin(async move { (name, lost.await) })
            })
            .collect();
        async move {
            if losses.is_empty() {
                // No part (there always is one): nothing to lose.
                return std::future::pending().await;
            }
            futures_util::future::select_all(losses).await.0
        }
    }

    /// Runs `work` while every part is held.
    /// If any part is lost first, `work` is dropped and [`Error::Lost`] is returned.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops `work`; the guards keep their locks.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] if a part was lost before `work` completed (or before it started).
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output> {
        if let Some(guard) = self.guards.iter().find(|g| !g.is_held()) {
            return Err(guard.deadline().err().unwrap_or(Error::NotHeld));
        }
        let lost = self.lost();
        tokio::select! {
            biased;
            (_, reason) = lost => Err(Error::Lost(reason)),
            output = work => Ok(output),
        }
    }

    /// Releases every part, all at once, and says how it went.
    ///
    /// # Cancel safety
    ///
    /// As for [`Guard::release`]: a part whose release was not confirmed goes on in the
    /// background (its guard drops).
    ///
    /// # Errors
    ///
    /// The first error of a part's release (see [`Guard::release`]); every part is released
    /// all the same.
    pub async fn release(self) -> Result<()> {
        release_all(self.guards).await
    }

    /// The guards, to hold or release one by one.
    pub fn into_guards(self) -> Vec<Guard> {
        self.guards
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::InMemory;
    use crate::{Client, LockOptions};

    #[tokio::test]
    async fn a_set_needs_parts_with_a_name_each() {
        let client = Client::new(InMemory::new());
        let none = client.multi(Vec::new());
        assert!(
            matches!(none, Err(Error::InvalidArgument { .. })),
            "{none:?}"
        );
        let twice = client.multi([
            Part::from(client.mutex("a").unwrap()),
            Part::read(&client.rwlock("a").unwrap()),
        ]);
        assert!(
            matches!(twice, Err(Error::InvalidArgument { .. })),
            "{twice:?}"
        );
    }

    #[tokio::test]
    async fn the_earliest_deadline_moves_with_the_parts_renewals() {
        let options = LockOptions::builder()
            .ttl(Duration::from_millis(600))
            .build()
            .unwrap();
        let client = Client::builder(InMemory::new()).options(options).build();
        let set = client
            .multi([
                Part::from(client.mutex("b").unwrap()),
                Part::write(&client.rwlock("a").unwrap()),
            ])
            .unwrap();
        let guards = set.lock().await.unwrap();
        let names: Vec<&str> = guards.guards().iter().map(|g| g.name().as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        let first = guards.deadline().unwrap();
        let moved = guards.deadline_changed(first).await.unwrap();
        assert!(moved > first, "{moved:?} after {first:?}");
        guards.release().await.unwrap();
        assert!(set.try_lock().await.unwrap().is_some());
    }
}
