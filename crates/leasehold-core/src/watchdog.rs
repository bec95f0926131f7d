//! Lease renewal: one schedule and one timer per client, for all its leases.
//!
//! Input: the leases (deadline, cadence, request). Output: each lease renewed, or marked
//! lost.
//!
//! - Each expiring lease is renewed every [`renew_every`](crate::LockOptions::renew_every)
//!   (a third of the lease by default) with the backend's owner-checked renewal.
//! - A renewal answering "not owner" ends the lease at once.
//! - Failed or unanswered renewals are retried until the deadline; at the deadline the
//!   lease is lost, whether or not a reply ever comes (the lease's own loss signal watches
//!   the deadline too). Each renewal's new deadline counts from the moment it was sent.
//! - A released lease leaves the schedule; the schedule holds leases weakly, so an
//!   abandoned guard is not renewed. Renewal stops at the optional hold cap.
//!
//! A lease released before its first renewal costs an entry in a sorted map and nothing
//! else: no task, no timer of its own. Only due renewals run as tasks.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::backend::Renewal;
use crate::clock::{Clock, Instant};
use crate::error::LossReason;
use crate::lease::Lease;

/// The longest pause between two attempts of a failing renewal.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// A place in the schedule: when, and a sequence number to tell equal times apart.
pub(crate) type Slot = (Instant, u64);

/// The renewal schedule of one client.
#[derive(Debug, Default)]
pub(crate) struct Watchdog {
    state: Mutex<Schedule>,
    /// Wakes the timer task; it holds this, and the schedule only weakly.
    changed: Arc<Notify>,
}

#[derive(Debug, Default)]
struct Schedule {
    due: BTreeMap<Slot, Weak<Lease>>,
    next_seq: u64,
    /// When the timer task will next look at the schedule (`None`: not before a change).
    wakes_at: Option<Instant>,
    task: Option<JoinHandle<()>>,
}

impl Watchdog {
    fn schedule_guard(&self) -> std::sync::MutexGuard<'_, Schedule> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts renewing `lease`: its first renewal is due `renew_every` after its grant
    /// was requested.
    pub(crate) fn watch(self: &Arc<Self>, lease: &Arc<Lease>) {
        let at = lease
            .acquired_at
            .saturating_add(lease.options.renew_every());
        self.schedule(lease, at);
    }

    fn schedule(self: &Arc<Self>, lease: &Arc<Lease>, at: Instant) {
        if !lease.is_held() {
            return;
        }
        let mut schedule = self.schedule_guard();
        let slot = (at, schedule.next_seq);
        schedule.next_seq += 1;
        schedule.due.insert(slot, Arc::downgrade(lease));
        lease.set_slot(Some(slot));
        let task_alive = schedule.task.as_ref().is_some_and(|t| !t.is_finished());
        if !task_alive {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let clock = lease.client.clock().clone();
                schedule.wakes_at = None;
                schedule.task =
                    Some(runtime.spawn(run(Arc::downgrade(self), self.changed.clone(), clock)));
            }
        }
        // Wake the timer only if this renewal is due before it would look anyway.
        if schedule.wakes_at.is_none_or(|wakes| at < wakes) {
            schedule.wakes_at = Some(at);
            drop(schedule);
            self.changed.notify_one();
        }
    }

    /// Takes `lease` off the schedule (it was released).
    pub(crate) fn forget(&self, lease: &Lease) {
        if let Some(slot) = lease.set_slot(None) {
            self.schedule_guard().due.remove(&slot);
        }
    }

    /// Removes and returns the leases due at `now`, and the next time anything is due.
    fn take_due(&self, now: Instant) -> (Vec<Arc<Lease>>, Option<Instant>) {
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

/// The timer task: sleeps until the next renewal is due, starts it, and goes back to
/// sleep. Ends when the client is gone.
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
                if let Some(again) = renew(&lease).await {
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

/// One renewal of `lease`, retried until it succeeds, the lease is lost or released.
/// Returns when the next renewal is due, if any.
async fn renew(lease: &Lease) -> Option<Instant> {
    let clock = lease.client.clock().clone();
    let every = lease.options.renew_every();
    let retry_pause = (every / 4).clamp(Duration::from_millis(1), MAX_RETRY_PAUSE);
    let cap = lease
        .options
        .max_hold()
        .map(|cap| lease.acquired_at.saturating_add(cap));
    if cap.is_some_and(|cap| clock.now() >= cap) {
        // Stop renewing; the lease runs out at its deadline.
        lease.cap();
        return None;
    }
    loop {
        let deadline = lease.deadline()?;
        let sent = clock.now();
        let renewal = tokio::select! {
            () = lease.ended() => return None,
            () = clock.sleep_until(deadline) => {
                lease.mark_lost(LossReason::Expired);
                return None;
            }
            answer = lease.client.call(
                lease.options.request_timeout(),
                lease.client.backend().renew(&lease.request),
            ) => answer,
        };
        match renewal {
            Ok(Renewal::Renewed(expiry)) => {
                if !lease.extend(sent, expiry) {
                    return None;
                }
                let next = sent.saturating_add(every);
                if cap.is_some_and(|cap| next >= cap) {
                    lease.cap();
                    return None;
                }
                return Some(next);
            }
            Ok(Renewal::Lost(reason)) => {
                lease.mark_lost(reason);
                return None;
            }
            Err(error) => {
                tracing::debug!(lock = %lease.request.name, %error, "renewal failed; retrying");
                let retry_at = clock.now().saturating_add(retry_pause);
                tokio::select! {
                    () = lease.ended() => return None,
                    () = clock.sleep_until(deadline) => {
                        lease.mark_lost(LossReason::Expired);
                        return None;
                    }
                    () = clock.sleep_until(retry_at) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    #[test]
    fn an_empty_schedule_keeps_a_planned_wake_up_until_it_has_passed() {
        let clock = ManualClock::new();
        let dog = Watchdog::default();
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
