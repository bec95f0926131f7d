//! Fencing tokens, and an in-process fence that enforces them.
//!
//! A lease-based lock cannot by itself stop a paused or partitioned holder from acting after
//! its lease ran out. Every grant therefore carries a [`FencingToken`] that is strictly
//! greater than the token of every grant of the same name that completed before it, and the
//! protected resource refuses work carrying a token lower than the highest it has accepted.
//! [`Fence`] is that check for a resource living in the same process (tests, embedded
//! stores); backends ship checks for their own stores.

use std::fmt;
use std::sync::Mutex;

/// A number attached to a grant, strictly increasing per lock name for grants that follow
/// each other in real time.
///
/// How strong that promise is (does it survive a server restart? a failover?) depends on the
/// backend; see [`Capabilities::fencing`](crate::backend::Capabilities::fencing).
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
#[error("stale fencing token {presented}: a write with token {highest} was already accepted")]
pub struct StaleToken {
    /// The token that was refused.
    pub presented: FencingToken,
    /// The highest token accepted so far.
    pub highest: FencingToken,
}

/// An in-process fenced resource: it runs a write only if the write's token is not lower
/// than the highest token it has accepted, and it keeps the order of accepted tokens.
///
/// Equal tokens are accepted: one holder may write many times under one grant.
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
#[derive(Debug, Default)]
pub struct Fence {
    state: Mutex<FenceState>,
}

#[derive(Debug, Default)]
struct FenceState {
    highest: Option<FencingToken>,
    accepted: Vec<FencingToken>,
    rejected: u64,
}

impl Fence {
    /// An empty fence that accepts any first token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `write` if `token` is not older than the highest accepted token, atomically with
    /// the check, and records the token.
    pub fn apply<T>(
        &self,
        token: FencingToken,
        write: impl FnOnce() -> T,
    ) -> Result<T, StaleToken> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(highest) = state.highest
            && token < highest
        {
            state.rejected += 1;
            return Err(StaleToken {
                presented: token,
                highest,
            });
        }
        state.highest = Some(token);
        state.accepted.push(token);
        Ok(write())
    }

    /// The highest token accepted so far.
    pub fn highest(&self) -> Option<FencingToken> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).highest
    }

    /// Every accepted token, in the order the writes were applied.
    pub fn accepted(&self) -> Vec<FencingToken> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .accepted
            .clone()
    }

    /// How many writes were refused.
    pub fn rejected(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .rejected
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
