//! One grant as the client sees it: its local deadline, its state and its loss signal.
//!
//! The rules (see `docs/safety.md`):
//!
//! - The deadline is `sent + validity(granted)`: counted from when the granting request was
//!   *sent*, on the [`Clock`](crate::clock::Clock), minus the drift allowance. The server
//!   started its own timer later than `sent`, so the holder gives up first.
//! - The lease is held only while `now < deadline`, whatever any reply says.
//! - Lost and Released are final: a renewal reply arriving after the deadline, or after a
//!   "not owner", never revives the lease.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::backend::{Expiry, Liveness, Renewal, Request, SessionLiveness};
use crate::clock::Instant;
use crate::context::{Context, LaneHold};
use crate::error::{Error, LossReason, Result};
use crate::events::{self, EventKind};
use crate::fencing::FencingToken;
use crate::options::LockOptions;
use crate::release::{MAX_RETRY_PAUSE, PendingRelease};
use crate::telemetry;
use crate::watchdog::{Renewable, Slot, Watchdog};

/// Where a lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// Held until `deadline` (`None`: no expiry) unless renewed.
    /// `capped` once renewal stopped at the hold cap, so the deadline is final.
    Held {
        deadline: Option<Instant>,
        capped: bool,
    },
    /// Lost; final.
    Lost(LossReason),
    /// Released by its holder; final.
    Released,
}

/// Why a lease that reached its deadline was lost.
/// Its hold cap, a suspended session (its link down), or a deadline that passed without a
/// renewal.
fn at_deadline(capped: bool, session: Option<&SessionLiveness>) -> LossReason {
    if capped {
        LossReason::MaxHoldReached
    } else if session.is_some_and(SessionLiveness::is_suspended) {
        LossReason::Disconnected
    } else {
        LossReason::Expired
    }
}

/// A held state of a lease bound to `session` takes the session's deadline, or is lost.
/// It is lost when the session ended, or when the backend revoked the grant.
fn with_session(state: State, session: Option<&SessionLiveness>) -> State {
    // The grant's own loss signal (an eviction the backend was told of) comes first.
    if let (State::Held { .. }, Some(reason)) = (state, session.and_then(SessionLiveness::revoked))
    {
        return State::Lost(reason);
    }
    match (state, session.map(SessionLiveness::current)) {
        (State::Held { capped, .. }, Some(Liveness::Alive { until })) => State::Held {
            deadline: Some(until),
            capped,
        },
        (State::Held { .. }, Some(Liveness::Ended)) => State::Lost(LossReason::SessionEnded),
        (state, _) => state,
    }
}

/// The local deadline of a lease of length `granted` whose request was sent at `sent`.
/// It is `None` if the drift allowance leaves nothing of it.
pub(crate) fn local_deadline(
    options: &LockOptions,
    sent: Instant,
    granted: Duration,
) -> Option<Instant> {
    sent.checked_add(options.validity(granted)?)
}

/// The shared state of one grant.
/// Guards (one per reentrant hold) point at it; the client's renewal schedule holds it
/// weakly.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) ctx: Arc<Context>,
    pub(crate) request: Request,
    pub(crate) options: Arc<LockOptions>,
    pub(crate) token: FencingToken,
    /// When the granting request was sent.
    pub(crate) acquired_at: Instant,
    state: std::sync::Mutex<State>,
    /// Notified on every change of `state` (loss signals and a renewal in progress wait on it).
    /// One `Notify` rather than a watch channel: a lease is made and ended per acquisition,
    /// and nobody may be listening.
    changed: Notify,
    holds: AtomicUsize,
    /// The runtime the lease was granted on: a guard dropped outside of it releases there.
    pub(crate) runtime: Option<Handle>,
    /// Its place in the client's renewal schedule.
    slot: std::sync::Mutex<Option<Slot>>,
    /// The backend session the grant lives by, if it is bound to one.
    /// Then the session's deadline is the lease's.
    pub(crate) session: Option<SessionLiveness>,
    /// When the last request that could extend the grant was sent, and the lease it was granted.
    /// The server keeps the grant no longer than their sum.
    extended: std::sync::Mutex<(Instant, Duration)>,
    /// The acquisition's lane (`request.lane`), the client's until the lease is dropped.
    _lane: LaneHold,
    /// Its end (released or lost) was counted in the metrics.
    end_counted: AtomicBool,
    /// The last batch it was renewed in failed as a whole (see `renew_together`).
    batch_failed: AtomicBool,
}

impl Lease {
    /// A lease for a grant whose request was sent at `sent`, with one hold.
    /// It is `None` if its deadline has already passed (the reply came too late to be of
    /// use).
    pub(crate) fn new(
        ctx: Arc<Context>,
        request: Request,
        lane: LaneHold,
        options: Arc<LockOptions>,
        token: FencingToken,
        sent: Instant,
        expiry: Expiry,
    ) -> Option<Arc<Lease>> {
        let granted = match &expiry {
            Expiry::After(granted) => *granted,
            Expiry::Never | Expiry::Session(_) => request.ttl,
        };
        let (deadline, session) = match expiry {
            Expiry::After(granted) => (Some(local_deadline(&options, sent, granted)?), None),
            Expiry::Never => (None, None),
            Expiry::Session(session) => (None, Some(session)),
        };
        let initial = with_session(
            State::Held {
                deadline,
                capped: false,
            },
            session.as_ref(),
        );
        match initial {
            State::Held {
                deadline: Some(d), ..
            } if ctx.now() >= d => return None,
            State::Held { .. } => {}
            _ => return None,
        }
        Some(Arc::new(Lease {
            ctx,
            request,
            options,
            token,
            acquired_at: sent,
            state: std::sync::Mutex::new(State::Held {
                deadline,
                capped: false,
            }),
            changed: Notify::new(),
            holds: AtomicUsize::new(1),
            runtime: Handle::try_current().ok(),
            slot: std::sync::Mutex::new(None),
            session,
            extended: std::sync::Mutex::new((sent, granted)),
            _lane: lane,
            end_counted: AtomicBool::new(false),
            batch_failed: AtomicBool::new(false),
        }))
    }

    fn now(&self) -> Instant {
        self.ctx.now()
    }

    /// The state as last set (without the deadline or the session taken into account).
    fn recorded(&self) -> State {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the state with `change`, which says whether it changed anything.
    /// It wakes the waiters if it did.
    fn update(&self, change: impl FnOnce(&mut State) -> bool) -> bool {
        let changed = change(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()));
        if changed {
            self.changed.notify_waiters();
        }
        changed
    }

    /// The state, with a passed deadline read as lost even before a renewal marks it.
    /// A session's deadline or end is taken into account too.
    ///
    /// A loss found this way is recorded: once a reader saw the lease lost, it stays lost,
    /// whatever a session's late keep-alive says afterwards.
    pub(crate) fn state(&self) -> State {
        let state = match with_session(self.recorded(), self.session.as_ref()) {
            State::Held {
                deadline: Some(deadline),
                capped,
            } if self.now() >= deadline => State::Lost(at_deadline(capped, self.session.as_ref())),
            state => state,
        };
        if let State::Lost(reason) = state {
            let found = self.update(|recorded| match recorded {
                State::Held { .. } => {
                    *recorded = State::Lost(reason);
                    true
                }
                _ => false,
            });
            if found {
                self.lost_now(reason);
            }
        }
        state
    }

    pub(crate) fn is_held(&self) -> bool {
        matches!(self.state(), State::Held { .. })
    }

    /// Whether the lease is held but its session is suspended (its link to the server is down).
    /// It is held until the deadline, lost then unless the session is restored first.
    pub(crate) fn is_suspended(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(SessionLiveness::is_suspended)
            && self.is_held()
    }

    /// The local deadline while held.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        match self.state() {
            State::Held { deadline, .. } => deadline,
            _ => None,
        }
    }

    /// Time left until the local deadline.
    /// `Duration::MAX` for a lease without expiry, zero once lost or released.
    pub(crate) fn remaining(&self) -> Duration {
        match self.state() {
            State::Held { deadline: None, .. } => Duration::MAX,
            State::Held {
                deadline: Some(deadline),
                ..
            } => deadline.saturating_duration_since(self.now()),
            _ => Duration::ZERO,
        }
    }

    /// Applies a renewal whose request was sent at `sent`.
    /// Returns whether the lease is still held; a renewal that arrives after the deadline
    /// (or after a loss) changes nothing and marks the lease lost.
    pub(crate) fn extend(&self, sent: Instant, expiry: Expiry) -> bool {
        let now = self.now();
        let options = &self.options;
        let mut lost = None;
        self.update(|state| match state {
            State::Held { deadline, capped } if !*capped && deadline.is_none_or(|d| now < d) => {
                match &expiry {
                    Expiry::After(granted) => match local_deadline(options, sent, *granted) {
                        Some(new) if now < new => *deadline = Some(new),
                        _ => lost = Some(LossReason::Expired),
                    },
                    Expiry::Never | Expiry::Session(_) => *deadline = None,
                }
                if let Some(reason) = lost {
                    *state = State::Lost(reason);
                }
                true
            }
            State::Held { deadline, capped } => {
                if deadline.is_some_and(|d| now >= d) {
                    let reason = at_deadline(*capped, None);
                    lost = Some(reason);
                    *state = State::Lost(reason);
                    return true;
                }
                false
            }
            State::Lost(_) | State::Released => false,
        });
        if let Some(reason) = lost {
            self.lost_now(reason);
        }
        self.is_held()
    }

    /// Renewal stopped at the hold cap: the current deadline is final.
    /// Reaching it counts as [`LossReason::MaxHoldReached`].
    pub(crate) fn cap(&self) {
        self.update(|state| match state {
            State::Held { capped, .. } if !*capped => {
                *capped = true;
                true
            }
            _ => false,
        });
    }

    /// Marks the lease lost for `reason` unless it already ended.
    /// A lease whose deadline passed is recorded as lost at its deadline, whatever `reason`
    /// says.
    pub(crate) fn mark_lost(&self, reason: LossReason) {
        let now = self.now();
        let changed = self.update(|state| match *state {
            State::Held { deadline, capped } => {
                let passed = deadline.is_some_and(|d| now >= d);
                *state = State::Lost(if passed {
                    at_deadline(capped, self.session.as_ref())
                } else {
                    reason
                });
                true
            }
            _ => false,
        });
        if changed && let State::Lost(reason) = self.recorded() {
            self.lost_now(reason);
        }
    }

    /// The lease was just recorded lost for `reason`: said in the log, counted in the metrics.
    fn lost_now(&self, reason: LossReason) {
        tracing::warn!(lock = %self.request.name, owner = %self.request.owner,
            token = %self.token, ?reason, "lock lost");
        self.count_end(Some(reason));
    }

    /// Counts the lease's end in the metrics, once: released (`lost`: `None`) or lost.
    fn count_end(&self, lost: Option<LossReason>) {
        if self.end_counted.swap(true, Ordering::AcqRel) {
            return;
        }
        let held_for = self.now().saturating_duration_since(self.acquired_at);
        telemetry::ended(&self.ctx, &self.request.name, &self.options, held_for, lost);
        let kind = lost.map_or(EventKind::Released, EventKind::Lost);
        // A session still alive says how far the server's promise had come (keep-alives
        // move it); one that ended says nothing more.
        let alive = (self.session.iter())
            .find(|s| matches!(s.current(), Liveness::Alive { .. }))
            .map(|s| Expiry::Session(s.clone()));
        let token = Some(self.token);
        events::record(&self.ctx, kind, &self.request, token, None, alive.as_ref());
    }

    /// Ends the lease on release, and returns the state it ended in.
    /// It takes the lease off the renewal schedule and stops a renewal in progress; the
    /// state is `Held` if it was still held, else how it was lost.
    pub(crate) fn finish(&self) -> State {
        // Records a loss that a passed deadline or an ended session implies.
        self.state();
        // Decided under the lock: a loss recorded meanwhile stays (lost is final).
        let mut before = State::Released;
        self.update(|state| {
            before = *state;
            if let State::Held { .. } = state {
                *state = State::Released;
            }
            true
        });
        self.ctx.watchdog.forget(self);
        if let State::Held { .. } = before {
            self.count_end(None);
        }
        before
    }

    /// A release of this grant by owner, armed.
    /// Dropped unconfirmed, it goes on in the background until the server confirms or the
    /// grant's lease or session has ended. Of a lease already lost, its sending is recorded
    /// as a `released` event, after the `lost` one.
    pub(crate) fn pending_release(&self) -> PendingRelease {
        let lost = self.ctx.events.is_some() && matches!(self.recorded(), State::Lost(_));
        let (sent, granted) = *self.extended.lock().unwrap_or_else(|e| e.into_inner());
        PendingRelease::new(
            &self.ctx,
            self.request.clone(),
            sent,
            granted,
            self.runtime.clone(),
        )
        .bound_to(self.session.clone())
        .of_grant(self.token, lost)
    }

    /// Starts renewing the lease, if it expires.
    /// The first renewal is due `renew_every` after its grant was requested.
    pub(crate) fn start_renewals(self: &Arc<Self>) {
        if self.session.is_some() || self.deadline().is_none() {
            return;
        }
        let at = self.acquired_at.saturating_add(self.options.renew_every());
        self.ctx.watchdog.schedule(self, at);
    }

    /// Completes once the lease was released or marked lost (a renewal in progress stops).
    pub(crate) async fn ended(&self) {
        loop {
            // Registered before the state is read: a change after the read wakes us.
            let mut changed = std::pin::pin!(self.changed.notified());
            changed.as_mut().enable();
            if !matches!(self.recorded(), State::Held { .. }) {
                return;
            }
            changed.await;
        }
    }

    /// A future that completes with the state once it is no longer "held until `seen`".
    /// A renewal or a session keep-alive moved the deadline, or the lease ended. A deadline
    /// that passes while nobody reads the state is not noticed here (that is
    /// [`lost`](Lease::lost)'s); read after it, it is. Owns what it needs.
    pub(crate) fn changed_from(
        self: &Arc<Self>,
        seen: Option<Instant>,
    ) -> impl Future<Output = State> + Send + 'static {
        let lease = self.clone();
        let mut session = self.session.clone();
        async move {
            loop {
                // Registered before the state is read: a change after the read wakes us.
                let mut changed = std::pin::pin!(lease.changed.notified());
                changed.as_mut().enable();
                match lease.state() {
                    State::Held { deadline, .. } if deadline == seen => {}
                    state => return state,
                }
                let session_changed = async {
                    match &mut session {
                        Some(session) => session.changed().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = changed => {}
                    () = session_changed => {}
                }
            }
        }
    }

    /// A future that completes when the lease is lost.
    /// It never completes if the lease is released first. Owns what it needs.
    pub(crate) fn lost(self: &Arc<Self>) -> impl Future<Output = LossReason> + Send + 'static {
        let lease = self.clone();
        let mut session = self.session.clone();
        let clock = self.ctx.clock.clone();
        async move {
            loop {
                // Registered before the state is read: a change after the read wakes us.
                let mut changed = std::pin::pin!(lease.changed.notified());
                changed.as_mut().enable();
                // Read afresh on every turn, the deadline included: a renewal may have moved
                // it while the previous turn slept towards the old one.
                let deadline = match lease.state() {
                    State::Lost(reason) => return reason,
                    State::Released => None,
                    State::Held { deadline, .. } => deadline,
                };
                let session_changed = async {
                    match &mut session {
                        Some(session) => session.changed().await,
                        None => std::future::pending().await,
                    }
                };
                // The deadline itself is the signal; renewals only move it.
                let deadline_passed = async {
                    match deadline {
                        Some(d) => clock.sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = changed => {}
                    () = session_changed => {}
                    () = deadline_passed => {}
                }
            }
        }
    }

    /// Adds a reentrant hold if the lease still has one (and is held).
    pub(crate) fn add_hold(&self) -> bool {
        self.is_held()
            && self
                .holds
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                    (h > 0).then_some(h + 1)
                })
                .is_ok()
    }

    /// Drops one hold; returns whether it was the last one.
    pub(crate) fn drop_hold(&self) -> bool {
        self.holds.fetch_sub(1, Ordering::AcqRel) == 1
    }

    pub(crate) fn holds(&self) -> usize {
        self.holds.load(Ordering::Acquire)
    }
}

impl Renewable for Lease {
    fn is_held(&self) -> bool {
        Lease::is_held(self)
    }

    /// A quarter of the renewal interval.
    /// Renewed that much early, a lease still has most of its margin.
    fn slack(&self) -> Duration {
        self.options.renew_every() / 4
    }

    fn renew_batch(
        batch: Vec<Arc<Self>>,
        watchdog: Arc<Watchdog<Self>>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(renew_together(batch, watchdog))
    }

    fn set_slot(&self, slot: Option<Slot>) -> Option<Slot> {
        std::mem::replace(
            &mut *self.slot.lock().unwrap_or_else(|e| e.into_inner()),
            slot,
        )
    }
}

/// What to do after one renewal's answer.
enum Renewed {
    /// Renew again at this instant (`None`: never: lost, released or at the hold cap).
    Next(Option<Instant>),
    /// It failed: try again before the deadline.
    Retry,
}

/// Renews `batch` (leases of one client due together) with one backend call.
/// A lease whose renewal failed goes on alone, retrying until its deadline; each lease
/// to renew again goes back on `watchdog`.
///
/// Cancel safety: dropped before the answer (the client is gone), the leases run out at
/// their deadlines; the grants on the server may or may not have been extended.
async fn renew_together(batch: Vec<Arc<Lease>>, watchdog: Arc<Watchdog<Lease>>) {
    let mut batch: Vec<(Arc<Lease>, Instant)> = batch
        .into_iter()
        .filter(|lease| lease.may_renew())
        .filter_map(|lease| lease.deadline().map(|deadline| (lease, deadline)))
        .collect();
    if batch.len() == 1 {
        let (lease, _) = batch.remove(0);
        if let Some(at) = lease.renew_once().await {
            watchdog.schedule(&lease, at);
        }
        return;
    }
    let Some((first, _)) = batch.first() else {
        return;
    };
    let ctx = first.ctx.clone();
    let limit = batch
        .iter()
        .map(|(lease, _)| lease.options.request_timeout())
        .min()
        .unwrap_or_default();
    let sent = ctx.now();
    for (lease, _) in &batch {
        lease.note_sent(sent);
    }
    let requests: Vec<&Request> = batch.iter().map(|(lease, _)| &lease.request).collect();
    let answers = ctx
        .call(limit, async { Ok(ctx.backend.renew_many(&requests).await) })
        .await;
    let answers = match answers {
        Ok(answers) if answers.len() == batch.len() => answers,
        Ok(answers) => {
            let wrong = Error::backend(
                format!("{} answers to {} renewals", answers.len(), batch.len()),
                true,
            );
            vec![Err(wrong); batch.len()]
        }
        Err(error) => vec![Err(error); batch.len()],
    };
    drop(requests);
    // No answer at all (the server or the link is down): the leases try again together
    // after a pause, rather than each at once on its own. A lease whose batch failed
    // twice in a row goes on alone, in case it is the batch that fails.
    let all_failed = answers.iter().all(Result::is_err);
    for ((lease, deadline), answer) in batch.into_iter().zip(answers) {
        let failed_before = lease.batch_failed.swap(all_failed, Ordering::AcqRel);
        match lease.after_renewal(sent, deadline, answer) {
            Renewed::Next(Some(at)) => watchdog.schedule(&lease, at),
            Renewed::Next(None) => {}
            Renewed::Retry if all_failed && !failed_before => {
                let again = lease.now().saturating_add(lease.retry_pause());
                watchdog.schedule(&lease, again);
            }
            Renewed::Retry => {
                let watchdog = watchdog.clone();
                tokio::spawn(async move {
                    if let Some(at) = lease.renew_once().await {
                        watchdog.schedule(&lease, at);
                    }
                });
            }
        }
    }
}

impl Lease {
    /// How long to wait before trying a failed renewal again.
    fn retry_pause(&self) -> Duration {
        (self.options.renew_every() / 4).clamp(Duration::from_millis(1), MAX_RETRY_PAUSE)
    }

    /// When the hold cap ends the lease, if it has one.
    fn hold_cap(&self) -> Option<Instant> {
        self.options
            .max_hold()
            .map(|cap| self.acquired_at.saturating_add(cap))
    }

    /// Whether to renew now: not once the hold cap is reached.
    /// Then renewal stops, and the lease runs out at its deadline.
    fn may_renew(&self) -> bool {
        if self.hold_cap().is_some_and(|cap| self.now() >= cap) {
            self.cap();
            return false;
        }
        true
    }

    /// Applies the answer to a renewal sent at `sent`, while the deadline was `deadline`.
    /// A renewal confirmed moves the deadline (from `sent`) and says when the next is due;
    /// "not owner" ends the lease at once; a failure says to retry.
    fn after_renewal(&self, sent: Instant, deadline: Instant, answer: Result<Renewal>) -> Renewed {
        let (ctx, name, options) = (&self.ctx, &self.request.name, &self.options);
        match answer {
            Ok(Renewal::Renewed(expiry)) => {
                let margin = Some(deadline.saturating_duration_since(self.now()));
                telemetry::renewed(ctx, name, options, "renewed", margin);
                let (req, token) = (&self.request, Some(self.token));
                events::record(
                    ctx,
                    EventKind::Renewed,
                    req,
                    token,
                    Some(sent),
                    Some(&expiry),
                );
                if let Expiry::After(granted) = expiry {
                    self.note_granted(granted);
                }
                if !self.extend(sent, expiry) {
                    return Renewed::Next(None);
                }
                let next = sent.saturating_add(options.renew_every());
                if self.hold_cap().is_some_and(|cap| next >= cap) {
                    self.cap();
                    return Renewed::Next(None);
                }
                Renewed::Next(Some(next))
            }
            Ok(Renewal::Lost(reason)) => {
                telemetry::renewed(ctx, name, options, "lost", None);
                self.mark_lost(reason);
                Renewed::Next(None)
            }
            Err(error) => {
                telemetry::renewed(ctx, name, options, "failed", None);
                let (req, token) = (&self.request, Some(self.token));
                events::record(ctx, EventKind::RenewalFailed, req, token, Some(sent), None);
                tracing::debug!(lock = %name, %error, "renewal failed; retrying");
                Renewed::Retry
            }
        }
    }

    /// One renewal, retried until it succeeds or the lease is lost or released.
    /// Returns when the next renewal is due, if any.
    ///
    /// - The renewal is the backend's owner-checked compare-and-extend; "not owner" ends
    ///   the lease at once.
    /// - A failed or unanswered renewal is retried until the deadline; at the deadline the
    ///   lease is lost whether or not a reply ever comes. The new deadline counts from the
    ///   moment the renewal was sent.
    /// - Renewal stops at the optional hold cap.
    async fn renew_once(&self) -> Option<Instant> {
        let clock = self.ctx.clock.clone();
        let retry_pause = self.retry_pause();
        if !self.may_renew() {
            return None;
        }
        loop {
            let deadline = self.deadline()?;
            let sent = clock.now();
            self.note_sent(sent);
            let answer = tokio::select! {
                () = self.ended() => return None,
                () = clock.sleep_until(deadline) => {
                    self.mark_lost(LossReason::Expired);
                    return None;
                }
                answer = self.ctx.call(
                    self.options.request_timeout(),
                    self.ctx.backend.renew(&self.request),
                ) => answer,
            };
            if let Renewed::Next(next) = self.after_renewal(sent, deadline, answer) {
                return next;
            }
            let retry_at = clock.now().saturating_add(retry_pause);
            tokio::select! {
                () = self.ended() => return None,
                () = clock.sleep_until(deadline) => {
                    self.mark_lost(LossReason::Expired);
                    return None;
                }
                () = clock.sleep_until(retry_at) => {}
            }
        }
    }

    /// A request that may extend the grant is being sent at `sent`.
    fn note_sent(&self, sent: Instant) {
        self.extended.lock().unwrap_or_else(|e| e.into_inner()).0 = sent;
    }

    /// The server granted a lease of `granted`.
    fn note_granted(&self, granted: Duration) {
        self.extended.lock().unwrap_or_else(|e| e.into_inner()).1 = granted;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Mode, SessionKeeper};
    use crate::clock::{Clock, ManualClock};
    use crate::memory::InMemory;
    use crate::name::{LockName, OwnerId};

    fn context(clock: &ManualClock) -> Arc<Context> {
        Context::new(
            Arc::new(InMemory::new()),
            Arc::new(clock.clone()),
            LockOptions::default(),
            None,
        )
    }

    fn lease_at(clock: &ManualClock, sent: Instant, granted: Duration) -> Option<Arc<Lease>> {
        let options = LockOptions::builder()
            .ttl(granted)
            .drift_factor(0.1)
            .drift_margin(Duration::from_millis(100))
            .build()
            .unwrap();
        let ctx = context(clock);
        let lane = ctx.lanes.take();
        let request = Request {
            name: LockName::new("lease").unwrap(),
            owner: OwnerId::generate(),
            mode: Mode::Exclusive,
            ttl: granted,
            fair: false,
            waiting: false,
            lock_delay: None,
            value: None,
            lane: lane.lane(),
            began_ms: 0,
        };
        Lease::new(
            ctx,
            request,
            lane,
            Arc::new(options),
            FencingToken::new(1),
            sent,
            Expiry::After(granted),
        )
    }

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn deadline_counts_from_send_time_minus_drift() {
        let clock = ManualClock::new();
        let sent = clock.now();
        // The reply takes 2 s to arrive.
        clock.advance(2 * SEC);
        let lease = lease_at(&clock, sent, 10 * SEC).unwrap();
        // 10 s - (1 s + 100 ms) from the send time: 8.9 s, of which 2 s already went by.
        assert_eq!(lease.remaining(), Duration::from_millis(6_900));
        clock.advance(Duration::from_millis(6_899));
        assert!(lease.is_held());
        clock.advance(Duration::from_millis(1));
        assert!(!lease.is_held(), "held at the deadline");
        assert_eq!(lease.state(), State::Lost(LossReason::Expired));
        assert_eq!(lease.remaining(), Duration::ZERO);
    }

    #[test]
    fn a_grant_arriving_after_its_deadline_is_refused() {
        let clock = ManualClock::new();
        let sent = clock.now();
        clock.advance(9 * SEC);
        assert!(lease_at(&clock, sent, 10 * SEC).is_none());
    }

    #[test]
    fn a_late_renewal_never_revives_a_lost_lease() {
        let clock = ManualClock::new();
        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        let renewal_sent = clock.now().checked_add(3 * SEC).unwrap();
        // The renewal's reply arrives after the first deadline.
        clock.advance(9 * SEC);
        assert!(!lease.extend(renewal_sent, Expiry::After(10 * SEC)));
        assert_eq!(lease.state(), State::Lost(LossReason::Expired));
        // Nor after an explicit loss.
        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        lease.mark_lost(LossReason::NotOwner);
        assert!(!lease.extend(clock.now(), Expiry::After(10 * SEC)));
        assert_eq!(lease.state(), State::Lost(LossReason::NotOwner));
    }

    #[test]
    fn a_timely_renewal_moves_the_deadline_from_its_send_time() {
        let clock = ManualClock::new();
        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        clock.advance(3 * SEC);
        let sent = clock.now();
        clock.advance(SEC);
        assert!(lease.extend(sent, Expiry::After(10 * SEC)));
        // 8.9 s from the renewal's send time, 1 s of which passed.
        assert_eq!(lease.remaining(), Duration::from_millis(7_900));
    }

    #[test]
    fn release_is_final_and_reports_the_state_it_ended_in() {
        let clock = ManualClock::new();
        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        assert!(matches!(lease.finish(), State::Held { .. }));
        assert_eq!(lease.state(), State::Released);
        assert!(!lease.extend(clock.now(), Expiry::After(10 * SEC)));
        // A renewal in progress stops.
        assert!(futures_util::FutureExt::now_or_never(lease.ended()).is_some());

        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        clock.advance(10 * SEC);
        assert_eq!(lease.finish(), State::Lost(LossReason::Expired));
    }

    #[test]
    fn holds_are_counted() {
        let clock = ManualClock::new();
        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        assert!(lease.add_hold());
        assert_eq!(lease.holds(), 2);
        assert!(!lease.drop_hold());
        assert!(lease.drop_hold());
        assert!(!lease.add_hold(), "a lease without holds was re-entered");
    }

    fn session_lease(clock: &ManualClock, keeper: &SessionKeeper) -> Option<Arc<Lease>> {
        session_lease_on(clock, keeper.liveness())
    }

    fn session_lease_on(clock: &ManualClock, liveness: SessionLiveness) -> Option<Arc<Lease>> {
        let ctx = context(clock);
        let lane = ctx.lanes.take();
        let request = Request {
            name: LockName::new("lease").unwrap(),
            owner: OwnerId::generate(),
            mode: Mode::Exclusive,
            ttl: 10 * SEC,
            fair: false,
            waiting: false,
            lock_delay: None,
            value: None,
            lane: lane.lane(),
            began_ms: 0,
        };
        Lease::new(
            ctx,
            request,
            lane,
            Arc::new(LockOptions::default()),
            FencingToken::new(1),
            clock.now(),
            Expiry::Session(liveness),
        )
    }

    #[tokio::test]
    async fn a_session_lease_follows_its_session() {
        let clock = ManualClock::new();
        let keeper = SessionKeeper::new(clock.now().checked_add(5 * SEC).unwrap());
        let lease = session_lease(&clock, &keeper).unwrap();
        assert_eq!(lease.remaining(), 5 * SEC);
        // A keep-alive moves the deadline; the lease follows.
        clock.advance(4 * SEC);
        keeper.alive_until(clock.now().checked_add(5 * SEC).unwrap());
        assert_eq!(lease.remaining(), 5 * SEC);
        // Without the next keep-alive, the deadline is the signal.
        let mut lost = std::pin::pin!(lease.lost());
        assert!(futures_util::poll!(&mut lost).is_pending());
        clock.advance(5 * SEC);
        assert_eq!(lost.await, LossReason::Expired);
        assert!(!lease.is_held());
    }

    #[tokio::test]
    async fn an_ended_session_ends_its_leases_at_once() {
        let clock = ManualClock::new();
        let keeper = SessionKeeper::new(clock.now().checked_add(60 * SEC).unwrap());
        let lease = session_lease(&clock, &keeper).unwrap();
        let lost = lease.lost();
        keeper.end();
        assert_eq!(lost.await, LossReason::SessionEnded);
        assert_eq!(lease.state(), State::Lost(LossReason::SessionEnded));
        // An ended session is never revived, and grants on it are refused.
        keeper.alive_until(clock.now().checked_add(60 * SEC).unwrap());
        assert!(!lease.is_held());
        assert!(session_lease(&clock, &keeper).is_none());
    }

    #[tokio::test]
    async fn a_revoked_grant_is_lost_at_once_while_its_session_lives() {
        use crate::backend::Revoker;
        let clock = ManualClock::new();
        let keeper = SessionKeeper::new(clock.now().checked_add(60 * SEC).unwrap());
        let revoker = Revoker::new();
        let lease = session_lease_on(&clock, keeper.liveness().revocable_by(&revoker)).unwrap();
        let other = session_lease(&clock, &keeper).unwrap();
        let lost = lease.lost();
        revoker.revoke(LossReason::Evicted);
        assert_eq!(lost.await, LossReason::Evicted);
        // Final: a later reason or keep-alive changes nothing; the session's other grants hold.
        revoker.revoke(LossReason::NotOwner);
        keeper.alive_until(clock.now().checked_add(60 * SEC).unwrap());
        assert_eq!(lease.finish(), State::Lost(LossReason::Evicted));
        assert!(other.is_held());
    }

    #[tokio::test]
    async fn a_suspended_session_is_resumed_by_a_keep_alive_or_lost_as_disconnected() {
        let clock = ManualClock::new();
        let keeper = SessionKeeper::new(clock.now().checked_add(5 * SEC).unwrap());
        let lease = session_lease(&clock, &keeper).unwrap();
        assert!(!lease.is_suspended());
        // The link goes down: still held, until the same deadline.
        keeper.suspend();
        assert!(lease.is_suspended() && lease.is_held());
        assert_eq!(lease.remaining(), 5 * SEC);
        // A keep-alive gets through: resumed, with a later deadline.
        clock.advance(2 * SEC);
        keeper.alive_until(clock.now().checked_add(5 * SEC).unwrap());
        assert!(!lease.is_suspended());
        assert_eq!(lease.remaining(), 5 * SEC);
        // Suspended again, and nothing gets through: lost at the deadline, as disconnected.
        keeper.suspend();
        let mut lost = std::pin::pin!(lease.lost());
        assert!(futures_util::poll!(&mut lost).is_pending());
        clock.advance(5 * SEC);
        assert_eq!(lost.await, LossReason::Disconnected);
        assert_eq!(lease.state(), State::Lost(LossReason::Disconnected));
        assert!(!lease.is_suspended(), "a lost lease is not suspended");
        // A late keep-alive revives nothing.
        keeper.alive_until(clock.now().checked_add(5 * SEC).unwrap());
        assert_eq!(lease.finish(), State::Lost(LossReason::Disconnected));
        // An ended session is not suspended.
        keeper.end();
        keeper.suspend();
        assert!(!keeper.is_suspended());
    }

    #[tokio::test]
    async fn a_deadline_watcher_wakes_for_a_renewal_a_keep_alive_and_a_loss() {
        let clock = ManualClock::new();
        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        let first = lease.deadline();
        let mut moved = std::pin::pin!(lease.changed_from(first));
        assert!(futures_util::poll!(&mut moved).is_pending());
        // Capping the lease changes its state, not its deadline.
        lease.cap();
        assert!(futures_util::poll!(&mut moved).is_pending());
        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        let first = lease.deadline();
        let mut moved = std::pin::pin!(lease.changed_from(first));
        assert!(futures_util::poll!(&mut moved).is_pending());
        clock.advance(3 * SEC);
        assert!(lease.extend(clock.now(), Expiry::After(10 * SEC)));
        let State::Held { deadline, .. } = moved.await else {
            panic!("not held after a renewal");
        };
        assert!(deadline > first);
        // Lost: the watcher of the current deadline completes with the loss.
        let lost = lease.changed_from(deadline);
        lease.mark_lost(LossReason::NotOwner);
        assert_eq!(lost.await, State::Lost(LossReason::NotOwner));

        // A session lease: a keep-alive moves the deadline.
        let keeper = SessionKeeper::new(clock.now().checked_add(5 * SEC).unwrap());
        let lease = session_lease(&clock, &keeper).unwrap();
        let first = lease.deadline();
        let mut moved = std::pin::pin!(lease.changed_from(first));
        assert!(futures_util::poll!(&mut moved).is_pending());
        keeper.alive_until(clock.now().checked_add(6 * SEC).unwrap());
        assert_eq!(
            moved.await,
            State::Held {
                deadline: clock.now().checked_add(6 * SEC),
                capped: false
            }
        );
        // Read after the deadline passed, the loss is reported at once.
        let seen = lease.deadline();
        clock.advance(6 * SEC);
        assert_eq!(
            lease.changed_from(seen).await,
            State::Lost(LossReason::Expired)
        );
    }

    #[tokio::test]
    async fn lost_fires_at_the_deadline_without_any_reply() {
        let clock = ManualClock::new();
        let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
        let mut lost = std::pin::pin!(lease.lost());
        assert!(futures_util::poll!(&mut lost).is_pending());
        clock.advance(Duration::from_millis(8_899));
        assert!(futures_util::poll!(&mut lost).is_pending());
        clock.advance(Duration::from_millis(1));
        assert_eq!(lost.await, LossReason::Expired);
    }

    #[tokio::test]
    async fn lost_does_not_fire_for_a_lease_renewed_just_before_its_deadline() {
        // The loss future slept towards the first deadline; a renewal moves the deadline
        // just before it, and the future is polled again only after the first deadline:
        // the change and the old deadline are both ready, and only the state may decide.
        for _ in 0..200 {
            let clock = ManualClock::new();
            let lease = lease_at(&clock, clock.now(), 10 * SEC).unwrap();
            let mut lost = std::pin::pin!(lease.lost());
            assert!(futures_util::poll!(&mut lost).is_pending());
            clock.advance(Duration::from_millis(8_800));
            assert!(lease.extend(clock.now(), Expiry::After(10 * SEC)));
            // Past the first deadline (8.9 s), long before the new one.
            clock.advance(Duration::from_millis(200));
            assert!(lease.is_held());
            assert!(
                futures_util::poll!(&mut lost).is_pending(),
                "the loss signal fired for a lease that is held"
            );
        }
    }

    #[tokio::test]
    async fn a_late_keep_alive_never_revives_a_session_lease_seen_lost() {
        let clock = ManualClock::new();
        let keeper = SessionKeeper::new(clock.now().checked_add(5 * SEC).unwrap());
        let lease = session_lease(&clock, &keeper).unwrap();
        // The keep-alive sent at 4 s is answered only after the deadline.
        let sent = clock.now().checked_add(4 * SEC).unwrap();
        clock.advance(5 * SEC);
        assert!(!lease.is_held());
        keeper.alive_until(sent.checked_add(5 * SEC).unwrap());
        assert!(!lease.is_held(), "a late keep-alive revived a lost lease");
        assert_eq!(lease.state(), State::Lost(LossReason::Expired));
    }
}
