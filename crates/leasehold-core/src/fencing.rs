//! Fencing tokens, and an in-process fence that enforces them.
//!
//! A lease-based lock cannot by itself stop a paused or partitioned holder from acting after
//! its lease ran out. Every grant therefore carries a [`FencingToken`] that is strictly
//! greater than the token of every grant of the same name that completed before it, and the
//! protected resource refuses work carrying a token lower than the highest it has accepted.
//! [`Fence`] is that check for a resource living in the same process (tests, embedded
//! stores); backends ship checks for their own stores.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};

use crate::events::{AccessEvent, EventSink};

/// A number attached to a grant, strictly increasing per lock name.
/// It increases per name (and set: a mutex, a read-write lock and an election share one, a
/// semaphore has its own; see [`backend`](crate::backend)) for grants that follow each
/// other in real time.
///
/// How strong that promise is (does it survive a server restart? a failover?) depends on the
/// backend; see [`Capabilities::tokens`](crate::backend::Capabilities::tokens).
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value.
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The raw value, e.g. to store next to data written under the lock.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.0
    }
}

/// The error a [`Fence`] returns for a token older than one it already accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error("stale fencing token {presented}: a write with token {highest} was already accepted")]
pub struct StaleToken {
    /// The token that was refused.
    pub presented: FencingToken,
    /// The highest token accepted so far.
    pub highest: FencingToken,
}

impl StaleToken {
    /// `presented` was refused: `highest` was accepted before.
    pub fn new(presented: FencingToken, highest: FencingToken) -> Self {
        Self { presented, highest }
    }
}

/// An in-process fenced resource.
/// It runs a write only if the write's token is not lower than the highest token it has
/// accepted, and it keeps the order of the most recently accepted tokens.
///
/// Equal tokens are accepted: one holder may write many times under one grant. Its memory
/// is bounded: counts, the highest token, and the last [`Fence::DEFAULT_HISTORY`] accepted
/// tokens (see [`with_history`](Fence::with_history)).
///
/// ```
/// use leasehold_core::fencing::{Fence, FencingToken};
///
/// let fence = Fence::new();
/// let mut counter = 0;
/// fence.apply(FencingToken::new(7), || counter += 1).unwrap();
/// // A holder from before token 7 arrives late: refused, the counter is untouched.
/// assert!(fence.apply(FencingToken::new(6), || counter += 1).is_err());
/// assert_eq!(counter, 1);
/// ```
#[derive(Debug)]
pub struct Fence {
    state: Mutex<FenceState>,
    /// Where each access is reported, and the resource's name in the reports.
    events: Option<(Arc<dyn EventSink>, String)>,
}

#[derive(Debug)]
struct FenceState {
    highest: Option<FencingToken>,
    /// The most recently accepted tokens, oldest first.
    recent: VecDeque<FencingToken>,
    history: usize,
    accepted: u64,
    rejected: u64,
}

impl Default for Fence {
    fn default() -> Self {
        Self::with_history(Self::DEFAULT_HISTORY)
    }
}

impl Fence {
    /// How many accepted tokens a fence remembers by default.
    pub const DEFAULT_HISTORY: usize = 1024;

    /// An empty fence that accepts any first token.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty fence that remembers the last `history` accepted tokens.
    pub fn with_history(history: usize) -> Self {
        Self {
            state: Mutex::new(FenceState {
                highest: None,
                recent: VecDeque::new(),
                history,
                accepted: 0,
                rejected: 0,
            }),
            events: None,
        }
    }

    /// This fence, reporting every access it judges to `sink`.
    /// Each is an [`AccessEvent`] of `resource`.
    pub fn reporting_to(mut self, sink: Arc<dyn EventSink>, resource: impl Into<String>) -> Self {
        self.events = Some((sink, resource.into()));
        self
    }

    /// Reports an access, if the fence reports.
    fn report(&self, token: FencingToken, accepted: bool, highest: Option<FencingToken>) {
        if let Some((sink, resource)) = &self.events {
            sink.record_access(&AccessEvent::new(
                "fence", resource, token, accepted, highest,
            ));
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FenceState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `write` if `token` is not older than the highest accepted token.
    /// It does so atomically with the check, and records the token.
    ///
    /// # Errors
    ///
    /// [`StaleToken`] if a higher token was accepted before; `write` is not run.
    pub fn apply<T>(
        &self,
        token: FencingToken,
        write: impl FnOnce() -> T,
    ) -> Result<T, StaleToken> {
        let mut state = self.state();
        if let Some(highest) = state.highest
            && token < highest
        {
            state.rejected += 1;
            drop(state);
            crate::telemetry::fence_refused("fence");
            self.report(token, false, Some(highest));
            return Err(StaleToken {
                presented: token,
                highest,
            });
        }
        state.highest = Some(token);
        state.accepted += 1;
        if state.history > 0 {
            if state.recent.len() == state.history {
                state.recent.pop_front();
            }
            state.recent.push_back(token);
        }
        let written = write();
        drop(state);
        self.report(token, true, None);
        Ok(written)
    }

    /// Refuses `token` and every older one from now on.
    /// For a holder evicted with that token: its writes are refused at once, not only
    /// after the next holder's first one.
    pub fn exclude(&self, token: FencingToken) {
        let above = FencingToken::new(token.get().saturating_add(1));
        let mut state = self.state();
        state.highest = Some(state.highest.map_or(above, |h| h.max(above)));
    }

    /// The highest token accepted so far (or just above one [`exclude`](Fence::exclude)d).
    pub fn highest(&self) -> Option<FencingToken> {
        self.state().highest
    }

    /// The most recently accepted tokens.
    /// They are in the order their writes were applied (at most the fence's history
    /// length).
    pub fn accepted(&self) -> Vec<FencingToken> {
        self.state().recent.iter().copied().collect()
    }

    /// How many writes were accepted.
    pub fn accepted_count(&self) -> u64 {
        self.state().accepted
    }

    /// How many writes were refused.
    pub fn rejected(&self) -> u64 {
        self.state().rejected
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_excluded_token_and_older_ones_are_refused_newer_ones_accepted() {
        let fence = Fence::new();
        let t = FencingToken::new;
        assert!(fence.apply(t(7), || ()).is_ok());
        fence.exclude(t(7));
        assert!(fence.apply(t(7), || ()).is_err());
        assert!(fence.apply(t(6), || ()).is_err());
        // Excluding an older token than the highest moves nothing.
        fence.exclude(t(2));
        assert!(fence.apply(t(8), || ()).is_ok());
        assert!(fence.apply(t(8), || ()).is_ok());
    }

    #[test]
    fn accepts_equal_and_newer_rejects_older() {
        let fence = Fence::new();
        let t = FencingToken::new;
        assert!(fence.apply(t(3), || ()).is_ok());
        assert!(fence.apply(t(3), || ()).is_ok());
        assert!(fence.apply(t(5), || ()).is_ok());
        let err = fence.apply(t(4), || ()).unwrap_err();
        assert_eq!(err.presented, t(4));
        assert_eq!(err.highest, t(5));
        assert_eq!(fence.accepted(), vec![t(3), t(3), t(5)]);
        assert_eq!(fence.rejected(), 1);
        assert_eq!(fence.highest(), Some(t(5)));
    }

    #[test]
    fn memory_stays_bounded_however_many_writes() {
        let fence = Fence::new();
        for token in 1..=10_000 {
            fence.apply(FencingToken::new(token), || ()).unwrap();
        }
        assert_eq!(fence.accepted_count(), 10_000);
        let recent = fence.accepted();
        assert_eq!(recent.len(), Fence::DEFAULT_HISTORY);
        assert_eq!(recent.first(), Some(&FencingToken::new(10_001 - 1024)));
        assert_eq!(recent.last(), Some(&FencingToken::new(10_000)));
        assert_eq!(fence.highest(), Some(FencingToken::new(10_000)));

        let counting_only = Fence::with_history(0);
        counting_only.apply(FencingToken::new(1), || ()).unwrap();
        assert!(counting_only.accepted().is_empty());
        assert_eq!(counting_only.accepted_count(), 1);
    }
}
