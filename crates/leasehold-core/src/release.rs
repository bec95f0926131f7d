//! Releasing by owner until the server confirms it.
//! It is done in the foreground for about one request timeout, then in the background.
//!
//! Whatever an acquisition or a guard may have left on the server (a grant, a queue entry,
//! a grant whose reply never came) is a [`PendingRelease`] from before the request that
//! may create it is sent. Until a release is confirmed — the server answered released or
//! not held — dropping it (a guard was dropped, the caller's future was cancelled) or
//! failing in the foreground hands it to a background task that retries with backoff:
//!
//! - on a backend whose grants expire, until the server confirms or the grant's lease has
//!   surely ended there ([`PendingRelease::new`] says how that bound is found);
//! - on a backend whose grants live by a session, until the server confirms. Failures
//!   while the session is suspended (its link down) do not count: a short outage ends
//!   nothing, and the release completes once the link is back. The backend is told to
//!   [`abandon`](crate::Backend::abandon) the grant (so that it does not stay alive under
//!   the session) only when the session is demonstrably healthy and the release still
//!   fails — for two request timeouts since the session was last seen suspended, with a
//!   keep-alive acknowledged meanwhile, or, on a link that keeps flapping, for a session
//!   ttl and two request timeouts in all — or once the session has ended (its grants are
//!   gone or going; the backend lets go of whatever keeps a session open). A suspension
//!   lasts until the session's deadline at most, so this ends;
//! - on a backend whose grants never expire, for two request timeouts; then the backend is
//!   told to abandon the grant.
//!
//! The drop makes the task's first attempt itself, as far as it goes without waiting
//! (usually until the request is sent), so a release dropped before the client's
//! next request on the same connection is sent ahead of it.
//! [`Client::settle`](crate::Client::settle) waits for the background tasks.

use std::panic::{self, AssertUnwindSafe};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task;
use std::time::Duration;

use tokio::runtime::Handle;

use crate::backend::{Liveness, Release, Request, SessionLiveness};
use crate::clock::Instant;
use crate::context::Context;
use crate::error::Result;
use crate::events::{self, EventKind};
use crate::fencing::FencingToken;
use crate::name::LockName;
use crate::options::LockOptions;
use crate::telemetry;

/// The first pause after a failed request; doubled per failure up to [`MAX_RETRY_PAUSE`].
pub(crate) const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(20);
/// The longest pause between two attempts.
pub(crate) const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// How many request timeouts a release of a grant that never expires is retried.
/// The background keeps retrying for that long (under a healthy session, if the grant lives
/// by one) before it abandons the grant.
const ABANDON_AFTER_TIMEOUTS: u32 = 2;

/// Consecutive failures of one request.
/// They say how long to pause before the next try, and when to give up (after failing for
/// longer than `budget`).
#[derive(Debug, Default)]
pub(crate) struct Failures {
    since: Option<Instant>,
    pause: Duration,
}

impl Failures {
    /// The pause before the next try after a failure at `now`.
    /// It is `None` once failing has lasted `budget`.
    pub(crate) fn next(&mut self, now: Instant, budget: Duration) -> Option<Duration> {
        let since = *self.since.get_or_insert(now);
        if now.saturating_duration_since(since) >= budget {
            return None;
        }
        self.pause = (self.pause * 2).clamp(FIRST_RETRY_PAUSE, MAX_RETRY_PAUSE);
        Some(self.pause)
    }

    /// The latest a caller's last answer comes, after the first failed request's send.
    /// That is for a `timeout` per call and as the budget: the first call may take a
    /// timeout to fail; retries are sent for one budget after its send, the last of them
    /// may take a timeout too; then one pause and a last call.
    pub(crate) fn give_up_within(timeout: Duration) -> Duration {
        timeout.saturating_mul(3).saturating_add(MAX_RETRY_PAUSE)
    }
}

/// A release by owner that has not been confirmed yet.
/// Dropped while armed, it is sent from the drop (see [`start_here`]) and goes on in the
/// background.
#[derive(Debug)]
pub(crate) struct PendingRelease {
    ctx: Arc<Context>,
    request: Request,
    /// On a backend whose grants expire: when the grant has surely ended on the server.
    /// After that (for a queue entry too) nothing is left to release.
    lease_end: Option<Instant>,
    /// The session the grant lives by, if known (else the backend's is asked).
    session: Option<SessionLiveness>,
    /// The grant's token, for a guard's release.
    /// A "not held" answer to its first attempt is then a lock event (a later attempt's may
    /// follow an earlier one that was applied).
    token: Option<FencingToken>,
    /// The grant was lost: the first attempt is recorded as a `released` event.
    lost: bool,
    /// An acquire request went unanswered and nothing has told what became of it.
    /// The first attempt resolves it as released. It holds the acquisition's options, for
    /// the metric's labels.
    unresolved: Option<LockOptions>,
    /// An attempt was sent: the server may have applied it.
    sent: bool,
    runtime: Option<Handle>,
    armed: bool,
}

impl PendingRelease {
    /// A release of `request`, armed.
    /// `last_sent` is when the last request that could create or extend the grant was sent,
    /// and `granted` the lease length it asked or was given: on a backend whose grants
    /// expire, the server keeps the grant no longer than `last_sent + granted`, plus one
    /// request timeout for a request still on its way.
    pub(crate) fn new(
        ctx: &Arc<Context>,
        request: Request,
        last_sent: Instant,
        granted: Duration,
        runtime: Option<Handle>,
    ) -> Self {
        let mut pending = Self {
            ctx: ctx.clone(),
            request,
            lease_end: None,
            session: None,
            token: None,
            lost: false,
            unresolved: None,
            sent: false,
            runtime: runtime.or_else(|| Handle::try_current().ok()),
            armed: true,
        };
        pending.sent(last_sent, granted);
        pending
    }

    /// Arms the release again: a request that may create or extend the grant is sent.
    /// It is sent at `sent` and may extend it for `granted`.
    pub(crate) fn sent(&mut self, sent: Instant, granted: Duration) {
        let caps = &self.ctx.capabilities;
        self.armed = true;
        self.lease_end = (caps.expiring_leases && !caps.has_sessions()).then(|| {
            sent.saturating_add(granted.max(caps.ttl_granularity))
                .saturating_add(self.ctx.options.request_timeout())
        });
    }

    /// The grant lives by `session`.
    /// A suspension of it delays abandoning the grant, and its end abandons it at once.
    pub(crate) fn bound_to(mut self, session: Option<SessionLiveness>) -> Self {
        self.session = session;
        self
    }

    /// It releases the grant of `token` (a guard's), which was `lost` already.
    pub(crate) fn of_grant(mut self, token: FencingToken, lost: bool) -> Self {
        self.token = Some(token);
        self.lost = lost;
        self
    }

    /// An acquire request of `options` went unanswered; returns whether that is news.
    /// Until [`PendingRelease::resolve`], the release resolves the unknown outcome.
    pub(crate) fn unanswered(&mut self, options: &LockOptions) -> bool {
        let news = self.unresolved.is_none();
        if news {
            self.unresolved = Some(options.clone());
        }
        news
    }

    /// An answer told what became of the requests; returns whether one had gone unanswered.
    pub(crate) fn resolve(&mut self) -> bool {
        self.unresolved.take().is_some()
    }

    /// The first attempt is about to be sent: what it says to record, once.
    /// See [`Announce`].
    fn sending(&mut self) -> Announce {
        let announce = Announce {
            unresolved: self.unresolved.take(),
            lost: (self.lost && !self.sent).then_some(self.token),
        };
        self.sent = true;
        announce
    }

    /// Nothing is left on the server: no release needed.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Whether a release is still needed.
    pub(crate) fn is_armed(&self) -> bool {
        self.armed
    }

    /// Releases now, retrying failures that may pass for about one request timeout.
    /// An answer confirms the release; an error leaves it to the background.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future hands the release to the background.
    pub(crate) async fn run(mut self, timeout: Duration) -> Result<Release> {
        let first = !self.sent;
        self.sending().record(&self.ctx, &self.request);
        let mut attempts = 0;
        let answer = release(&self.ctx, &self.request, timeout, &mut attempts).await;
        if let Ok(answered) = &answer {
            self.armed = false;
            if first && attempts == 1 {
                not_held(&self.ctx, &self.request, self.token, *answered);
            }
        }
        answer
    }
}

impl Drop for PendingRelease {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Some(runtime) = self.runtime.take() else {
            tracing::warn!(lock = %self.request.name, owner = %self.request.owner,
                "no runtime to release on: the grant stays until its lease or session ends");
            return;
        };
        // A "not held" is news only if no attempt went before.
        let token = self.token.filter(|_| !self.sent);
        let announce = self.sending();
        let ctx = self.ctx.clone();
        let request = self.request.clone();
        let name = request.name.clone();
        let retry = Retry::new(&ctx, self.lease_end, self.session.take());
        // Recorded by the task as it starts: a task never run sends nothing.
        let mut task = Box::pin(async move {
            announce.record(&ctx, &request);
            in_background(ctx, request, token, retry).await;
        });
        if !start_here(&runtime, task.as_mut(), &name) {
            self.ctx.spawn_background(&runtime, task);
        }
    }
}

/// The lock events of a release's first attempt, recorded as it is sent.
#[derive(Debug)]
struct Announce {
    /// An unknown outcome it resolves, with the acquisition's options (for the metric).
    unresolved: Option<LockOptions>,
    /// The release of a lost grant, of this token.
    /// Had the server still kept the grant, this gives it up, which an auditor needs to know.
    lost: Option<Option<FencingToken>>,
}

impl Announce {
    fn record(self, ctx: &Context, request: &Request) {
        if let Some(options) = self.unresolved {
            telemetry::unknown_resolved(ctx, &request.name, &options, "released");
            events::record(
                ctx,
                EventKind::Unknown("released"),
                request,
                None,
                None,
                None,
            );
        }
        if let Some(token) = self.lost {
            events::record(ctx, EventKind::Released, request, token, None, None);
        }
    }
}

/// Polls `task` once here, so that its first attempt is sent before the drop returns.
/// On a backend that answers one connection (or session) in order, the client's later
/// requests there come after it, and a lock dropped and taken again at once finds itself
/// free. Returns whether the task finished. Only on a thread of `runtime` that is not
/// unwinding (elsewhere the runtime may be gone, and a panic here would abort), outside the
/// task's budget (a spent budget would stop it before it sends), and with a panic kept in,
/// as it would be in a task.
fn start_here(
    runtime: &Handle,
    task: Pin<&mut (impl Future<Output = ()> + ?Sized)>,
    name: &LockName,
) -> bool {
    let on_runtime = Handle::try_current().is_ok_and(|current| current.id() == runtime.id());
    if !on_runtime || std::thread::panicking() {
        return false;
    }
    let mut cx = task::Context::from_waker(task::Waker::noop());
    let mut first = pin!(tokio::task::unconstrained(task));
    match panic::catch_unwind(AssertUnwindSafe(|| first.as_mut().poll(&mut cx))) {
        Ok(poll) => poll.is_ready(),
        Err(_) => {
            tracing::error!(lock = %name, "a release panicked; the grant stays until its lease or session ends");
            true
        }
    }
}

/// Releases `request`, retrying failures that may pass for about `timeout`.
/// Such failures are a refused connection or a failover; a release is owner-checked, so a
/// retry is harmless.
/// `attempts` counts the requests sent.
async fn release(
    ctx: &Context,
    request: &Request,
    timeout: Duration,
    attempts: &mut u32,
) -> Result<Release> {
    let mut failures = Failures::default();
    // An earlier attempt got no answer: it may have released the grant.
    let mut maybe_applied = false;
    loop {
        let sent = ctx.now();
        *attempts += 1;
        match ctx.call(timeout, ctx.backend.release(request)).await {
            Err(error) if error.is_retryable() => {
                maybe_applied |= error.is_unknown_outcome();
                let Some(pause) = failures.next(sent, timeout) else {
                    return Err(error);
                };
                tracing::debug!(lock = %request.name, %error, "release failed; retrying");
                tokio::time::sleep(pause).await;
            }
            // After an attempt that went unanswered, "not held" is no news: that attempt
            // may be what released it. (An error that says nothing was applied, a replica
            // refusing a write, leaves a later "not held" as it is: the grant was gone.)
            Ok(Release::NotHeld) if maybe_applied => return Ok(Release::Released),
            answer => return answer,
        }
    }
}

/// What the background does after a release failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    /// Try again after a pause.
    Retry,
    /// Nothing is left to release: the grant's lease has ended.
    Stop,
    /// Tell the backend to abandon the grant.
    Abandon,
}

/// How the session a grant lives by stands at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Health {
    /// Kept alive: counted on until `until`.
    Healthy { until: Instant },
    /// Its link is down; it ends at its deadline unless a keep-alive gets through first.
    Suspended,
    /// Ended, or past its deadline: its grants are gone with it, or go once nothing keeps it open.
    Ended,
}

impl Health {
    fn of(session: &SessionLiveness, now: Instant) -> Self {
        match session.current() {
            Liveness::Alive { until } if now < until => {
                if session.is_suspended() {
                    Health::Suspended
                } else {
                    Health::Healthy { until }
                }
            }
            _ => Health::Ended,
        }
    }
}

/// When the background stops retrying a release that keeps failing (see the module docs).
#[derive(Debug)]
struct Retry {
    lease_end: Option<Instant>,
    session: Option<SessionLiveness>,
    /// Whether to ask the backend for its session when `session` is unknown.
    has_sessions: bool,
    /// How long releases fail before the grant is abandoned.
    budget: Duration,
    /// How long they fail in all before a grant is abandoned under a flapping session.
    limit: Duration,
    started: Instant,
    /// Since when releases under a healthy session have failed, and the session's deadline then.
    /// The deadline is the one when the first of them failed.
    healthy: Option<(Instant, Instant)>,
}

impl Retry {
    fn new(ctx: &Context, lease_end: Option<Instant>, session: Option<SessionLiveness>) -> Self {
        let budget = ctx
            .options
            .request_timeout()
            .saturating_mul(ABANDON_AFTER_TIMEOUTS);
        let session_ttl = ctx.capabilities.session_ttl.unwrap_or_default();
        Self {
            lease_end,
            session,
            has_sessions: ctx.capabilities.has_sessions(),
            budget,
            limit: budget.saturating_add(session_ttl),
            started: ctx.now(),
            healthy: None,
        }
    }

    /// Whether the session is suspended now (when a request is sent).
    fn suspended(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(SessionLiveness::is_suspended)
    }

    /// Whether the session the grant lives by is to be asked of the backend.
    /// It is when the grant may live by one and its own is not known (an acquisition whose
    /// grant never came).
    fn needs_session(&self) -> bool {
        self.has_sessions && self.lease_end.is_none() && self.session.is_none()
    }

    /// What to do after a release sent at `sent` failed at `now`: refused, or with no answer.
    /// `suspended`: the session was, if the grant lives by one.
    fn failed(&mut self, sent: Instant, suspended: bool, refused: bool, now: Instant) -> Then {
        if let Some(end) = self.lease_end {
            return if now >= end {
                Then::Stop
            } else if refused {
                Then::Abandon
            } else {
                Then::Retry
            };
        }
        let Some(session) = &self.session else {
            let over = now.saturating_duration_since(self.started) >= self.budget;
            return if refused || over {
                Then::Abandon
            } else {
                Then::Retry
            };
        };
        match Health::of(session, now) {
            Health::Ended => Then::Abandon,
            Health::Suspended => {
                self.healthy = None;
                Then::Retry
            }
            Health::Healthy { .. } if suspended => {
                self.healthy = None;
                Then::Retry
            }
            Health::Healthy { .. } if refused => Then::Abandon,
            Health::Healthy { until } => {
                let (since, then) = *self.healthy.get_or_insert((sent, until));
                // A keep-alive was acknowledged after the failures began: the session's
                // link works, and the release still fails.
                let proven = until > then && now.saturating_duration_since(since) >= self.budget;
                if proven || now.saturating_duration_since(self.started) >= self.limit {
                    Then::Abandon
                } else {
                    Then::Retry
                }
            }
        }
    }
}

/// Retries the release until the server confirms it or nothing is left to release.
/// It gives the grant up to the backend ([`Backend::abandon`](crate::Backend::abandon))
/// when `retry` says so. A "not held" answer to its first attempt is recorded for the
/// grant of `token`, if given.
async fn in_background(
    ctx: Arc<Context>,
    request: Request,
    mut token: Option<FencingToken>,
    mut retry: Retry,
) {
    let timeout = ctx.options.request_timeout();
    let mut pause = FIRST_RETRY_PAUSE;
    loop {
        let sent = ctx.now();
        let suspended = retry.suspended();
        let refused = match ctx.call(timeout, ctx.backend.release(&request)).await {
            Ok(answer) => return not_held(&ctx, &request, token, answer),
            Err(error) if !error.is_retryable() => {
                tracing::warn!(lock = %request.name, %error, "background release refused");
                true
            }
            Err(error) => {
                tracing::debug!(lock = %request.name, %error, "background release failed; retrying");
                false
            }
        };
        // The failed attempt may have been applied: a later "not held" says nothing.
        token = None;
        if retry.needs_session() {
            retry.session = ctx.backend.session_liveness().await;
        }
        match retry.failed(sent, suspended, refused, ctx.now()) {
            Then::Retry => {}
            Then::Stop => {
                tracing::debug!(lock = %request.name,
                    "the grant's lease has ended: nothing left to release");
                return;
            }
            Then::Abandon => break,
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_RETRY_PAUSE);
    }
    tracing::warn!(lock = %request.name, owner = %request.owner,
        "the release could not be confirmed; abandoning the grant");
    if let Err(error) = ctx.call(timeout, ctx.backend.abandon(&request)).await {
        tracing::warn!(lock = %request.name, %error, "abandoning the grant failed");
    }
}

/// Records a `not_held` event if a guard's release (of `token`) was answered so.
fn not_held(ctx: &Context, request: &Request, token: Option<FencingToken>, answer: Release) {
    if token.is_some() && answer == Release::NotHeld {
        events::record(ctx, EventKind::NotHeld, request, token, None, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SessionKeeper;

    const BUDGET: Duration = Duration::from_secs(4);
    const SESSION_TTL: Duration = Duration::from_secs(30);

    fn at(ms: u64) -> Instant {
        Instant::from_origin(Duration::from_millis(ms))
    }

    /// The retries of a release of a grant that lives by `keeper`'s session, begun at 0.
    fn retries(keeper: Option<&SessionKeeper>) -> Retry {
        Retry {
            lease_end: None,
            session: keeper.map(SessionKeeper::liveness),
            has_sessions: keeper.is_some(),
            budget: BUDGET,
            limit: BUDGET + SESSION_TTL,
            started: at(0),
            healthy: None,
        }
    }

    #[test]
    fn a_suspended_session_is_waited_for_and_an_ended_one_abandoned_at_once() {
        let keeper = SessionKeeper::new(at(30_000));
        let mut retry = retries(Some(&keeper));
        keeper.suspend();
        // Failures through the whole suspension do not count, refusals neither.
        assert_eq!(retry.failed(at(0), false, false, at(2_000)), Then::Retry);
        assert_eq!(
            retry.failed(at(2_000), true, false, at(20_000)),
            Then::Retry
        );
        assert_eq!(
            retry.failed(at(20_000), true, true, at(29_000)),
            Then::Retry
        );
        // Suspended past its deadline: the grant goes with the session; the backend lets
        // go of whatever may still keep it open.
        assert_eq!(
            retry.failed(at(29_000), true, false, at(30_000)),
            Then::Abandon
        );
        let keeper = SessionKeeper::new(at(30_000));
        let mut retry = retries(Some(&keeper));
        keeper.end();
        assert_eq!(retry.failed(at(0), false, false, at(2_000)), Then::Abandon);
    }

    #[test]
    fn a_healthy_session_abandons_once_a_keep_alive_got_through_and_releases_still_fail() {
        let keeper = SessionKeeper::new(at(30_000));
        let mut retry = retries(Some(&keeper));
        assert_eq!(retry.failed(at(0), false, false, at(2_000)), Then::Retry);
        // The budget is spent, but no keep-alive was acknowledged since the failures
        // began: the link may be down without the session knowing yet.
        assert_eq!(
            retry.failed(at(2_000), false, false, at(4_000)),
            Then::Retry
        );
        assert_eq!(
            retry.failed(at(4_000), false, false, at(6_000)),
            Then::Retry
        );
        keeper.alive_until(at(36_000));
        assert_eq!(
            retry.failed(at(6_000), false, false, at(8_000)),
            Then::Abandon
        );
    }

    #[test]
    fn failures_count_again_from_the_first_one_sent_after_a_suspension() {
        let keeper = SessionKeeper::new(at(30_000));
        let mut retry = retries(Some(&keeper));
        assert_eq!(retry.failed(at(0), false, false, at(2_000)), Then::Retry);
        keeper.suspend();
        assert_eq!(
            retry.failed(at(2_000), false, false, at(4_000)),
            Then::Retry
        );
        keeper.alive_until(at(34_000));
        // Sent while suspended, failed once resumed: not a failure of a healthy session.
        assert_eq!(retry.failed(at(4_000), true, false, at(6_000)), Then::Retry);
        assert_eq!(
            retry.failed(at(6_000), false, false, at(8_000)),
            Then::Retry
        );
        keeper.alive_until(at(38_000));
        assert_eq!(
            retry.failed(at(8_000), false, false, at(9_000)),
            Then::Retry
        );
        assert_eq!(
            retry.failed(at(9_000), false, false, at(10_000)),
            Then::Abandon
        );
    }

    #[test]
    fn a_refusal_under_a_healthy_session_abandons_at_once() {
        let keeper = SessionKeeper::new(at(30_000));
        let mut retry = retries(Some(&keeper));
        assert_eq!(retry.failed(at(0), false, true, at(10)), Then::Abandon);
    }

    #[test]
    fn a_flapping_link_abandons_after_a_session_ttl_and_the_budget() {
        let keeper = SessionKeeper::new(at(30_000));
        let mut retry = retries(Some(&keeper));
        let mut now = 0;
        // Suspended at every other failure: the healthy failures never last the budget.
        while now + 2_000 < 34_000 {
            keeper.suspend();
            assert_eq!(
                retry.failed(at(now), false, false, at(now + 1_000)),
                Then::Retry
            );
            keeper.alive_until(at(now + 31_000));
            assert_eq!(
                retry.failed(at(now + 1_000), false, false, at(now + 2_000)),
                Then::Retry
            );
            now += 2_000;
        }
        keeper.suspend();
        assert_eq!(
            retry.failed(at(now), false, false, at(now + 1_000)),
            Then::Retry
        );
        keeper.alive_until(at(now + 31_000));
        assert_eq!(
            retry.failed(at(now + 1_000), false, false, at(34_000)),
            Then::Abandon
        );
    }

    #[test]
    fn without_a_session_a_grant_is_abandoned_after_the_budget_or_a_refusal() {
        let mut retry = retries(None);
        assert!(!retry.needs_session());
        assert_eq!(retry.failed(at(0), false, false, at(2_000)), Then::Retry);
        assert_eq!(
            retry.failed(at(2_000), false, false, at(4_000)),
            Then::Abandon
        );
        let mut retry = retries(None);
        assert_eq!(retry.failed(at(0), false, true, at(10)), Then::Abandon);
    }

    #[test]
    fn a_grant_that_expires_is_retried_until_its_lease_ended() {
        let mut retry = retries(None);
        retry.lease_end = Some(at(10_000));
        assert_eq!(retry.failed(at(0), false, false, at(9_000)), Then::Retry);
        assert_eq!(
            retry.failed(at(9_000), false, false, at(10_000)),
            Then::Stop
        );
    }

    #[test]
    fn the_backend_is_asked_for_its_session_only_when_the_grants_is_unknown() {
        let keeper = SessionKeeper::new(at(30_000));
        assert!(!retries(Some(&keeper)).needs_session());
        let mut leftover = retries(None);
        leftover.has_sessions = true;
        assert!(leftover.needs_session());
    }
}
