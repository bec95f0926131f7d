//! Noticing a blackholed connection: one that stopped answering without closing.
//! A client library never learns about that kind of broken connection from its socket.
//!
//! A partition that drops packets, or a peer that went away without a reset, leaves a TCP
//! connection open and silent: requests go out, nothing comes back, and no error ever
//! arrives. The engine gives up on each request at its timeout (it drops the request's
//! future), but a backend that keeps its connection would send the next request into the
//! same hole. [`Health`] counts, per connection, requests given up on while nothing at all
//! came back on it since they were sent; after [`STALLS_BEFORE_REPLACING`] of them in a
//! row the backend replaces the connection. One answer of any kind resets the count.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// How many requests in a row may be given up on before a connection counts as stalled.
/// Only those given up on with nothing heard from the connection meanwhile count.
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

    /// A request is being sent: call [`InFlight::answered`] when its answer comes.
    /// An error from the connection is an answer too. Dropped without that call, the
    /// request counts as given up on (unless made [`uncounted`](InFlight::uncounted)).
    pub fn request(&self) -> InFlight<'_> {
        InFlight {
            health: self,
            sent: self.silence(),
            counted: true,
            answered: false,
        }
    }

    /// What has been answered so far, for [`given_up`](Health::given_up).
    pub fn silence(&self) -> Silence {
        Silence(self.answers.load(Ordering::Acquire))
    }

    /// A request sent at `since` was given up on: a stall if nothing was answered since.
    pub fn given_up(&self, since: Silence) {
        if self.answers.load(Ordering::Acquire) == since.0 {
            self.stalls.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Whether the connection stalled, and should be replaced.
    /// Stalled: [`STALLS_BEFORE_REPLACING`] requests in a row were given up on while it
    /// said nothing.
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

/// How many answers a connection had given when a request was sent (see [`Health::given_up`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Silence(u64);

/// A request under way on a connection whose [`Health`] it reports to.
#[derive(Debug)]
#[must_use = "dropped without `answered`, the request counts as unanswered"]
pub struct InFlight<'a> {
    health: &'a Health,
    sent: Silence,
    counted: bool,
    answered: bool,
}

impl InFlight<'_> {
    /// Makes this request not count if it is dropped unanswered.
    /// Its caller may drop it for reasons of its own (Redlock stops waiting for the nodes
    /// it no longer needs) and reports the requests it gave up on itself
    /// ([`Health::given_up`]).
    pub fn uncounted(mut self) -> Self {
        self.counted = false;
        self
    }

    /// The connection answered (or failed in a way it reports itself).
    pub fn answered(mut self) {
        self.answered = true;
        self.health.answered();
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.counted && !self.answered {
            self.health.given_up(self.sent);
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

    #[test]
    fn uncounted_requests_stall_only_when_their_caller_says_so() {
        let health = Health::new();
        drop(health.request().uncounted());
        drop(health.request().uncounted());
        assert!(!health.is_stalled());
        let since = health.silence();
        health.given_up(since);
        health.given_up(health.silence());
        assert!(health.is_stalled());
    }
}
