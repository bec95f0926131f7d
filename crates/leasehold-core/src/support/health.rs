//! Noticing a connection that stopped answering without closing (a blackhole).
//! That is the kind of broken connection a client library never learns about from its
//! socket.
//!
//! A partition that drops packets, or a peer that went away without a reset, leaves a TCP
//! connection open and silent: requests go out, nothing comes back, and no error ever
//! arrives. The engine gives up on each request at its timeout (it drops the request's
//! future), but a backend that keeps its connection would send the next request into the
//! same hole. [`Health`] counts, per connection, requests given up on while nothing at all
//! came back on it since they were sent; after [`STALLS_BEFORE_REPLACING`] of them in a
//! row the backend replaces the connection. One answer of any kind resets the count.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// How many requests in a row may be given up on, silently, before a connection is stalled.
/// Silently: with nothing heard from the connection meanwhile.
pub const STALLS_BEFORE_REPLACING: u32 = 2;

/// What one connection has answered, and how many requests went unanswered since.
#[derive(Debug, Default)]
pub struct Health {
    /// Answers seen, ever.
    answers: AtomicU64,
    /// Requests given up on in a row without any answer since they were sent.
    stalls: AtomicU32,
}

impl Health {
    /// A connection that has not stalled.
    pub fn new() -> Self {
        Self::default()
    }

    /// A request is being sent.
    /// Call [`InFlight::answered`] when its answer (or an error from the connection) comes.
    /// Dropped without it, the request counts as given up on.
    pub fn request(&self) -> InFlight<'_> {
        InFlight {
            health: self,
            answers_before: self.answers.load(Ordering::Acquire),
            answered: false,
        }
    }

    /// Whether the connection stalled, and is to be replaced.
    /// It stalled when [`STALLS_BEFORE_REPLACING`] requests in a row were given up on while
    /// it said nothing.
    pub fn is_stalled(&self) -> bool {
        self.stalls.load(Ordering::Acquire) >= STALLS_BEFORE_REPLACING
    }

    /// Starts afresh (the connection was replaced).
    pub fn reset(&self) {
        self.stalls.store(0, Ordering::Release);
    }

    fn answered(&self) {
        self.answers.fetch_add(1, Ordering::AcqRel);
        self.stalls.store(0, Ordering::Release);
    }
}

/// A request under way on a connection whose [`Health`] it reports to.
#[derive(Debug)]
#[must_use = "dropped without `answered`, the request counts as unanswered"]
pub struct InFlight<'a> {
    health: &'a Health,
    answers_before: u64,
    answered: bool,
}

impl InFlight<'_> {
    /// The connection answered (or failed in a way it reports itself).
    pub fn answered(mut self) {
        self.answered = true;
        self.health.answered();
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        // Given up on: a stall only if nothing else came back meanwhile either.
        if !self.answered && self.health.answers.load(Ordering::Acquire) == self.answers_before {
            self.health.stalls.fetch_add(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_given_up_on_in_silence_stall_the_connection() {
        let health = Health::new();
        drop(health.request());
        assert!(!health.is_stalled());
        drop(health.request());
        assert!(health.is_stalled());
        health.reset();
        assert!(!health.is_stalled());
    }

    #[test]
    fn any_answer_in_between_keeps_it_healthy() {
        let health = Health::new();
        let slow = health.request();
        health.request().answered();
        // Given up on, but the connection answered something since it was sent.
        drop(slow);
        drop(health.request());
        assert!(!health.is_stalled());
        health.request().answered();
        drop(health.request());
        assert!(!health.is_stalled());
    }
}
