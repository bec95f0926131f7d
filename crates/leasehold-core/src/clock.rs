//! The clock every lease deadline is measured on.
//!
//! Lease arithmetic never uses wall-clock time. [`SystemClock`] reads `CLOCK_BOOTTIME` on
//! Linux and Android, a monotonic clock that keeps counting while the machine is suspended,
//! so a laptop lid closed for an hour cannot make a holder believe its lease is still fresh.
//! Elsewhere it falls back to the standard monotonic clock. `ManualClock` (feature `test-util`) is moved by hand
//! and makes deadline and watchdog behaviour testable without real waiting.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// A point in time on a [`Clock`]: the time elapsed since that clock's own origin.
///
/// Instants from different clocks cannot be compared meaningfully. There is no wall-clock
/// meaning attached to an `Instant`; only differences between two readings matter.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(Duration);

impl Instant {
    /// An instant at `since_origin` after the clock's origin.
    pub const fn from_origin(since_origin: Duration) -> Self {
        Self(since_origin)
    }

    /// The time elapsed since the clock's origin.
    pub const fn since_origin(self) -> Duration {
        self.0
    }

    /// `self + d`, or `None` if that is not representable.
    pub fn checked_add(self, d: Duration) -> Option<Instant> {
        self.0.checked_add(d).map(Instant)
    }

    /// `self - d`, or `None` if that would precede the clock's origin.
    pub fn checked_sub(self, d: Duration) -> Option<Instant> {
        self.0.checked_sub(d).map(Instant)
    }

    /// `self + d`, clamped to the largest representable instant.
    pub fn saturating_add(self, d: Duration) -> Instant {
        Instant(self.0.saturating_add(d))
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Debug for Instant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Instant({:?})", self.0)
    }
}

/// A boxed future returned by [`Clock::sleep_until`].
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A monotonic clock with the ability to sleep until one of its instants.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;

    /// A future that completes once [`now`](Clock::now) has reached `deadline`.
    ///
    /// It must complete immediately when the deadline has already passed, and it must not
    /// complete early. The future owns everything it needs (`'static`).
    fn sleep_until(&self, deadline: Instant) -> Sleep;
}

/// The real clock: `CLOCK_BOOTTIME` where the OS has it, otherwise `std::time::Instant`.
#[derive(Debug, Clone, Copy, Default)]
#[allow(
    clippy::exhaustive_structs,
    reason = "a unit struct: nothing to add to it"
)]
pub struct SystemClock;

/// Longest single timer sleep of [`SystemClock::sleep_until`].
/// Tokio's timers run on a clock that stops during suspend; sleeping in slices bounds how
/// late a deadline is noticed after a resume, while the deadline itself is always judged on
/// the boot-time clock.
const MAX_SLEEP_SLICE: Duration = Duration::from_secs(1);

impl SystemClock {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn read() -> Duration {
        let ts = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        // CLOCK_BOOTTIME never reports a negative time.
        Duration::new(
            u64::try_from(ts.tv_sec).unwrap_or(0),
            u32::try_from(ts.tv_nsec).unwrap_or(0),
        )
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn read() -> Duration {
        use std::sync::OnceLock;
        static ORIGIN: OnceLock<std::time::Instant> = OnceLock::new();
        ORIGIN.get_or_init(std::time::Instant::now).elapsed()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant(Self::read())
    }

    fn sleep_until(&self, deadline: Instant) -> Sleep {
        Box::pin(async move {
            loop {
                let left = deadline.saturating_duration_since(SystemClock.now());
                if left.is_zero() {
                    return;
                }
                tokio::time::sleep(left.min(MAX_SLEEP_SLICE)).await;
            }
        })
    }
}

#[cfg(any(test, feature = "test-util"))]
pub use manual::ManualClock;

#[cfg(any(test, feature = "test-util"))]
mod manual {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::sync::watch;

    use super::{Clock, Instant, Sleep};

    /// A clock that moves only when told to. Clones share the same time (feature `test-util`).
    ///
    /// Sleepers wake as soon as [`advance`](ManualClock::advance) or
    /// [`set`](ManualClock::set) moves the time to or past their deadline.
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold_core::clock::{Clock, ManualClock};
    ///
    /// let clock = ManualClock::new();
    /// let start = clock.now();
    /// clock.advance(Duration::from_secs(5));
    /// assert_eq!(clock.now().saturating_duration_since(start), Duration::from_secs(5));
    /// ```
    #[derive(Debug, Clone)]
    pub struct ManualClock {
        now: Arc<watch::Sender<Instant>>,
    }

    impl ManualClock {
        /// A clock standing at an arbitrary origin.
        /// It starts one hour past zero, so that instants a little before "now" are
        /// representable.
        pub fn new() -> Self {
            let (tx, _) = watch::channel(Instant::from_origin(Duration::from_secs(3600)));
            Self { now: Arc::new(tx) }
        }

        /// Moves the time forward by `by`.
        pub fn advance(&self, by: Duration) {
            self.now.send_modify(|now| *now = now.saturating_add(by));
        }

        /// Moves the time to `to`.
        /// A ManualClock never goes backwards, so an earlier `to` is ignored.
        pub fn set(&self, to: Instant) {
            self.now.send_if_modified(|now| {
                if to > *now {
                    *now = to;
                    true
                } else {
                    false
                }
            });
        }
    }

    impl Default for ManualClock {
        fn default() -> Self {
            Self::new()
        }
    }

    impl Clock for ManualClock {
        fn now(&self) -> Instant {
            *self.now.borrow()
        }

        fn sleep_until(&self, deadline: Instant) -> Sleep {
            let mut rx = self.now.subscribe();
            Box::pin(async move {
                // The sender lives as long as any clone of the clock; if every clone is gone the
                // time can never reach the deadline, so sleep forever.
                if rx.wait_for(|now| *now >= deadline).await.is_err() {
                    std::future::pending::<()>().await;
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instant_arithmetic_does_not_overflow() {
        let t = Instant::from_origin(Duration::from_secs(10));
        assert_eq!(t.checked_add(Duration::MAX), None);
        assert_eq!(t.checked_sub(Duration::from_secs(11)), None);
        assert_eq!(
            t.saturating_duration_since(Instant::from_origin(Duration::from_secs(20))),
            Duration::ZERO
        );
    }

    #[test]
    fn system_clock_is_monotonic() {
        let a = SystemClock.now();
        let b = SystemClock.now();
        assert!(b >= a);
    }

    #[tokio::test]
    async fn manual_clock_wakes_sleepers_only_at_their_deadline() {
        let clock = ManualClock::new();
        let deadline = clock.now().checked_add(Duration::from_secs(10)).unwrap();
        let mut sleep = clock.sleep_until(deadline);
        assert!(futures_util::poll!(&mut sleep).is_pending());
        clock.advance(Duration::from_secs(9));
        assert!(futures_util::poll!(&mut sleep).is_pending(), "woke early");
        clock.advance(Duration::from_secs(1));
        assert!(futures_util::poll!(&mut sleep).is_ready());
        // A deadline in the past completes at once.
        assert!(futures_util::poll!(clock.sleep_until(deadline)).is_ready());
    }

    #[tokio::test]
    async fn system_clock_sleep_reaches_deadline() {
        let deadline = SystemClock
            .now()
            .checked_add(Duration::from_millis(20))
            .unwrap();
        SystemClock.sleep_until(deadline).await;
        assert!(SystemClock.now() >= deadline);
    }
}
