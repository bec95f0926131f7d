//! Lease renewal: one schedule and one timer per client, for all its leases.
//!
//! Input: what to renew and when ([`Renewable`]); output: the renewals due together,
//! started together as one batch, and each lease rescheduled when its renewal says. What a
//! batch does (one backend call for all, the owner-checked requests, retries until the
//! deadline, loss on "not owner") is the lease's business (`lease.rs`).
//!
//! - A renewal may run up to its lease's slack early, so the schedule rounds each time
//!   down to a grid as fine as that slack allows: renewals due close together fall on one
//!   instant and go out in one batch. A client holding a million leases wakes a few times
//!   per renewal period, not a million times.
//! - A released lease leaves the schedule; the schedule holds leases weakly, so an
//!   abandoned guard is not renewed.
//! - A lease released before its first renewal costs an entry in a sorted map and nothing
//!   else: no task, no timer of its own. Only due batches run as tasks.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::clock::{Clock, Instant};

/// A place in the schedule: when, and a sequence number to tell equal times apart.
pub(crate) type Slot = (Instant, u64);

/// The most leases renewed in one batch (one backend call).
pub(crate) const MAX_BATCH: usize = 512;

/// What the watchdog renews: a lease, seen only through what the schedule needs.
pub(crate) trait Renewable: Send + Sync + Sized + 'static {
    /// Whether it is still worth renewing.
    fn is_held(&self) -> bool;

    /// How much earlier than asked it may be renewed without harm.
    fn slack(&self) -> Duration;

    /// Renews `batch`, leases due together, in one go.
    /// Each lease to renew again is put back on `watchdog`'s schedule when its renewal says.
    fn renew_batch(
        batch: Vec<Arc<Self>>,
        watchdog: Arc<Watchdog<Self>>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>>;

    /// Records its place in the schedule; returns the previous one.
    fn set_slot(&self, slot: Option<Slot>) -> Option<Slot>;
}

/// The renewal schedule of one client.
pub(crate) struct Watchdog<R> {
    clock: Arc<dyn Clock>,
    state: Mutex<Schedule<R>>,
    /// Wakes the timer task; it holds this, and the schedule only weakly.
    changed: Arc<Notify>,
}

struct Schedule<R> {
    due: BTreeMap<Slot, Weak<R>>,
    next_seq: u64,
    /// When the timer task will next look at the schedule (`None`: not before a change).
    wakes_at: Option<Instant>,
    task: Option<JoinHandle<()>>,
}

impl<R> Default for Schedule<R> {
    fn default() -> Self {
        Self {
            due: BTreeMap::new(),
            next_seq: 0,
            wakes_at: None,
            task: None,
        }
    }
}

impl<R> std::fmt::Debug for Watchdog<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let schedule = self.schedule_guard();
        f.debug_struct("Watchdog")
            .field("due", &schedule.due.len())
            .field("wakes_at", &schedule.wakes_at)
            .finish()
    }
}

/// `at` rounded down to a grid, at most `slack` earlier.
/// The grid's step is the largest power of two of microseconds not above `slack`, from the
/// clock's origin.
fn on_grid(at: Instant, slack: Duration) -> Instant {
    let slack = u64::try_from(slack.as_micros()).unwrap_or(u64::MAX);
    if slack < 2 {
        return at;
    }
    let step = 1u64 << slack.ilog2();
    let since = u64::try_from(at.since_origin().as_micros()).unwrap_or(u64::MAX);
    Instant::from_origin(Duration::from_micros(since - since % step))
}

impl<R> Watchdog<R> {
    /// An empty schedule on `clock`.
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            state: Mutex::new(Schedule::default()),
            changed: Arc::default(),
        }
    }

    fn schedule_guard(&self) -> std::sync::MutexGuard<'_, Schedule<R>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<R: Renewable> Watchdog<R> {
    /// Renews `lease` at `at` (or up to its slack earlier).
    /// Then again whenever its renewal says, until it is released or lost.
    pub(crate) fn schedule(self: &Arc<Self>, lease: &Arc<R>, at: Instant) {
        if !lease.is_held() {
            return;
        }
        let at = on_grid(at, lease.slack());
        let mut schedule = self.schedule_guard();
        let slot = (at, schedule.next_seq);
        schedule.next_seq += 1;
        schedule.due.insert(slot, Arc::downgrade(lease));
        lease.set_slot(Some(slot));
        let task_alive = schedule.task.as_ref().is_some_and(|t| !t.is_finished());
        if !task_alive && let Ok(runtime) = tokio::runtime::Handle::try_current() {
            schedule.wakes_at = None;
            schedule.task = Some(runtime.spawn(run(
                Arc::downgrade(self),
                self.changed.clone(),
                self.clock.clone(),
            )));
        }
        // Wake the timer only if this renewal is due before it would look anyway.
        if schedule.wakes_at.is_none_or(|wakes| at < wakes) {
            schedule.wakes_at = Some(at);
            drop(schedule);
            self.changed.notify_one();
        }
    }

    /// Takes `lease` off the schedule (it was released).
    pub(crate) fn forget(&self, lease: &R) {
        if let Some(slot) = lease.set_slot(None) {
            self.schedule_guard().due.remove(&slot);
        }
    }

    /// Removes and returns the leases due at `now`, and the next time anything is due.
    fn take_due(&self, now: Instant) -> (Vec<Arc<R>>, Option<Instant>) {
        let mut schedule = self.schedule_guard();
        let later = schedule.due.split_off(&(now, u64::MAX));
        let due = std::mem::replace(&mut schedule.due, later);
        // With nothing left to renew, keep a wake-up already planned for later rather than
        // sleep until the next change: leases that come and go between two looks at the
        // schedule (short holds) would otherwise wake the timer task once each.
        let next = schedule
            .due
            .keys()
            .next()
            .map(|(at, _)| *at)
            .or(schedule.wakes_at.filter(|at| *at > now));
        schedule.wakes_at = next;
        drop(schedule);
        let leases = due
            .into_values()
            .filter_map(|lease| lease.upgrade())
            .collect();
        (leases, next)
    }
}

impl<R> Drop for Watchdog<R> {
    fn drop(&mut self) {
        if let Some(task) = self.schedule_guard().task.take() {
            task.abort();
        }
    }
}

/// The timer task: sleeps until renewals are due, and starts them.
/// They go in batches of at most [`MAX_BATCH`]. It ends when the client is gone.
async fn run<R: Renewable>(
    watchdog: Weak<Watchdog<R>>,
    changed: Arc<Notify>,
    clock: Arc<dyn Clock>,
) {
    loop {
        let Some(dog) = watchdog.upgrade() else {
            return;
        };
        // A change signalled from here on leaves a permit: nothing is missed.
        let (mut due, next) = dog.take_due(clock.now());
        while !due.is_empty() {
            let batch = due.split_off(due.len().saturating_sub(MAX_BATCH));
            tokio::spawn(R::renew_batch(batch, dog.clone()));
        }
        drop(dog);
        let sleep = async {
            match next {
                Some(at) => clock.sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = changed.notified() => {}
            () = sleep => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::lease::Lease;

    #[test]
    fn a_time_on_the_grid_is_at_most_the_slack_earlier() {
        let at = |ms| Instant::from_origin(Duration::from_millis(ms));
        let slack = Duration::from_millis(2_500);
        // The step is 2^21 µs (2.097152 s): times within one step share an instant.
        assert_eq!(on_grid(at(4_300), slack), on_grid(at(5_000), slack));
        assert_ne!(on_grid(at(4_000), slack), on_grid(at(4_300), slack));
        for ms in [0, 1, 2_097, 2_098, 4_300, 9_999_999] {
            let rounded = on_grid(at(ms), slack);
            assert!(rounded <= at(ms));
            assert!(at(ms).saturating_duration_since(rounded) <= slack);
        }
        // No slack: no rounding.
        assert_eq!(on_grid(at(4_300), Duration::ZERO), at(4_300));
    }

    #[test]
    fn an_empty_schedule_keeps_a_planned_wake_up_until_it_has_passed() {
        let clock = ManualClock::new();
        let dog = Watchdog::<Lease>::new(Arc::new(clock.clone()));
        let planned = clock.now().checked_add(Duration::from_secs(10)).unwrap();
        dog.schedule_guard().wakes_at = Some(planned);
        // The lease the wake-up was planned for was released before the task looked: the
        // task still sleeps until then, so the next lease (due later) needs no wake-up.
        let (due, next) = dog.take_due(clock.now());
        assert!(due.is_empty());
        assert_eq!(next, Some(planned));
        assert_eq!(dog.schedule_guard().wakes_at, Some(planned));
        clock.advance(Duration::from_secs(10));
        assert_eq!(dog.take_due(clock.now()).1, None);
        assert_eq!(dog.schedule_guard().wakes_at, None);
    }
}
