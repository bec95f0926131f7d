//! Lease renewal: one schedule and one timer per client, for all its leases.
//!
//! Input: what to renew and when ([`Renewable`]); output: each renewal started when due,
//! and rescheduled when it says. What a renewal does (the owner-checked request, retries
//! until the deadline, loss on "not owner") is the lease's business (`lease.rs`).
//!
//! - A released lease leaves the schedule; the schedule holds leases weakly, so an
//!   abandoned guard is not renewed.
//! - A lease released before its first renewal costs an entry in a sorted map and nothing
//!   else: no task, no timer of its own. Only due renewals run as tasks.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::clock::{Clock, Instant};

/// A place in the schedule: when, and a sequence number to tell equal times apart.
pub(crate) type Slot = (Instant, u64);

/// One renewal, as [`Renewable::renew`] returns it.
pub(crate) type Renewing = Pin<Box<dyn Future<Output = Option<Instant>> + Send>>;

/// What the watchdog renews: a lease, seen only through what the schedule needs.
pub(crate) trait Renewable: Send + Sync + 'static {
    /// Whether it is still worth renewing.
    fn is_held(&self) -> bool;

    /// Renews once, retrying until that succeeds or the lease ends.
    /// It resolves to when the next renewal is due, if any.
    fn renew(self: Arc<Self>) -> Renewing;

    /// Records its place in the schedule; returns the previous one.
    fn set_slot(&self, slot: Option<Slot>) -> Option<Slot>;
}

/// The renewal schedule of one client.
pub(crate) struct Watchdog {
    clock: Arc<dyn Clock>,
    state: Mutex<Schedule>,
    /// Wakes the timer task; it holds this, and the schedule only weakly.
    changed: Arc<Notify>,
}

#[derive(Default)]
struct Schedule {
    due: BTreeMap<Slot, Weak<dyn Renewable>>,
    next_seq: u64,
    /// When the timer task will next look at the schedule (`None`: not before a change).
    wakes_at: Option<Instant>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let schedule = self.schedule_guard();
        f.debug_struct("Watchdog")
            .field("due", &schedule.due.len())
            .field("wakes_at", &schedule.wakes_at)
            .finish()
    }
}

impl Watchdog {
    /// An empty schedule on `clock`.
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            state: Mutex::default(),
            changed: Arc::default(),
        }
    }

    fn schedule_guard(&self) -> std::sync::MutexGuard<'_, Schedule> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Renews `lease` at `at`, and then whenever its renewal says, until it is released or lost.
    pub(crate) fn schedule(self: &Arc<Self>, lease: &Arc<dyn Renewable>, at: Instant) {
        if !lease.is_held() {
            return;
        }
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
    pub(crate) fn forget(&self, lease: &dyn Renewable) {
        if let Some(slot) = lease.set_slot(None) {
            self.schedule_guard().due.remove(&slot);
        }
    }

    /// Removes and returns the leases due at `now`, and the next time anything is due.
    fn take_due(&self, now: Instant) -> (Vec<Arc<dyn Renewable>>, Option<Instant>) {
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
        let leases = due
            .into_values()
            .filter_map(|lease| lease.upgrade())
            .collect();
        (leases, next)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(task) = self.schedule_guard().task.take() {
            task.abort();
        }
    }
}

/// The timer task: sleeps until the next renewal is due, starts it, and goes back to sleep.
/// Ends when the client is gone.
async fn run(watchdog: Weak<Watchdog>, changed: Arc<Notify>, clock: Arc<dyn Clock>) {
    loop {
        let Some(dog) = watchdog.upgrade() else {
            return;
        };
        // A change signalled from here on leaves a permit: nothing is missed.
        let (due, next) = dog.take_due(clock.now());
        for lease in due {
            let dog = dog.clone();
            tokio::spawn(async move {
                if let Some(again) = lease.clone().renew().await {
                    dog.schedule(&lease, again);
                }
            });
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
    use std::time::Duration;

    use crate::clock::ManualClock;

    #[test]
    fn an_empty_schedule_keeps_a_planned_wake_up_until_it_has_passed() {
        let clock = ManualClock::new();
        let dog = Watchdog::new(Arc::new(clock.clone()));
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
