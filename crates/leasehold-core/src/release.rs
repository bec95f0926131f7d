//! Releasing by owner until the server confirms it — in the foreground for about one
//! request timeout, then in the background.
//!
//! Whatever an acquisition or a guard may have left on the server (a grant, a queue entry,
//! a grant whose reply never came) is a [`PendingRelease`] from before the request that
//! may create it is sent. Until a release is confirmed — the server answered released or
//! not held — dropping it (a guard was dropped, the caller's future was cancelled) or
//! failing in the foreground hands it to a background task that retries with backoff:
//!
//! - on a backend whose grants expire, until the server confirms or the grant's lease has
//!   surely ended there ([`PendingRelease::new`] says how that bound is found);
//! - on a backend whose grants live by a session (or never expire), for two request
//!   timeouts; then the backend is told to [`abandon`](crate::Backend::abandon) the grant,
//!   so that it does not stay alive under the session.
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

use crate::backend::{Release, Request};
use crate::clock::Instant;
use crate::context::Context;
use crate::error::Result;
use crate::name::LockName;

/// The first pause after a failed request; doubled per failure up to [`MAX_RETRY_PAUSE`].
pub(crate) const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(20);
/// The longest pause between two attempts.
pub(crate) const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// How many request timeouts the background keeps retrying the release of a grant that
/// does not expire on its own before it abandons it.
const ABANDON_AFTER_TIMEOUTS: u32 = 2;

/// Consecutive failures of one request: how long to pause before the next try, and when
/// to give up (after failing for longer than `budget`).
#[derive(Debug, Default)]
pub(crate) struct Failures {
    since: Option<Instant>,
    pause: Duration,
}

impl Failures {
    /// The pause before the next try after a failure at `now`, or `None` once failing has
    /// lasted `budget`.
    pub(crate) fn next(&mut self, now: Instant, budget: Duration) -> Option<Duration> {
        let since = *self.since.get_or_insert(now);
        if now.saturating_duration_since(since) >= budget {
            return None;
        }
        self.pause = (self.pause * 2).clamp(FIRST_RETRY_PAUSE, MAX_RETRY_PAUSE);
        Some(self.pause)
    }
}

/// A release by owner that has not been confirmed yet. Dropped while armed, it is sent
/// from the drop (see [`start_here`]) and goes on in the background.
#[derive(Debug)]
pub(crate) struct PendingRelease {
    ctx: Arc<Context>,
    request: Request,
    /// On a backend whose grants expire: when the grant (or queue entry) has surely ended
    /// on the server, so that nothing is left to release.
    lease_end: Option<Instant>,
    runtime: Option<Handle>,
    armed: bool,
}

impl PendingRelease {
    /// A release of `request`, armed. `last_sent` is when the last request that could
    /// create or extend the grant was sent, and `granted` the lease length it asked or was
    /// given: on a backend whose grants expire, the server keeps the grant no longer than
    /// `last_sent + granted`, plus one request timeout for a request still on its way.
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
            runtime: runtime.or_else(|| Handle::try_current().ok()),
            armed: true,
        };
        pending.sent(last_sent, granted);
        pending
    }

    /// Arms the release again: a request that may create or extend the grant for
    /// `granted` is sent at `sent`.
    pub(crate) fn sent(&mut self, sent: Instant, granted: Duration) {
        let caps = &self.ctx.capabilities;
        self.armed = true;
        self.lease_end = (caps.expiring_leases && !caps.has_sessions()).then(|| {
            sent.saturating_add(granted.max(caps.ttl_granularity))
                .saturating_add(self.ctx.options.request_timeout())
        });
    }

    /// Nothing is left on the server: no release needed.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Whether a release is still needed.
    pub(crate) fn is_armed(&self) -> bool {
        self.armed
    }

    /// Releases now, retrying failures that may pass for about one request timeout. An
    /// answer confirms the release; an error leaves it to the background.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future hands the release to the background.
    pub(crate) async fn run(mut self, timeout: Duration) -> Result<Release> {
        let answer = release(&self.ctx, &self.request, timeout).await;
        if answer.is_ok() {
            self.armed = false;
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
        let ctx = self.ctx.clone();
        let request = self.request.clone();
        let name = request.name.clone();
        let mut task = Box::pin(in_background(ctx, request, self.lease_end));
        if !start_here(&runtime, task.as_mut(), &name) {
            self.ctx.spawn_background(&runtime, task);
        }
    }
}

/// Polls `task` once here, so that its first attempt is sent before the drop returns: on
/// a backend that answers one connection (or session) in order, the client's later
/// requests there come after it, and a lock dropped and taken again at once finds itself
/// free. Returns whether the task finished. Only on a thread of `runtime` that is not
/// unwinding (elsewhere the runtime may be gone, and a panic here would abort), outside
/// the task's budget (a spent budget would stop it before it sends), and with a panic
/// kept in, as it would be in a task.
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

/// Releases `request`, retrying failures that may pass (a refused connection, a failover)
/// for about `timeout`; a release is owner-checked, so a retry is harmless.
async fn release(ctx: &Context, request: &Request, timeout: Duration) -> Result<Release> {
    let mut failures = Failures::default();
    loop {
        let sent = ctx.now();
        match ctx.call(timeout, ctx.backend.release(request)).await {
            Err(error) if error.is_retryable() => {
                let Some(pause) = failures.next(sent, timeout) else {
                    return Err(error);
                };
                tracing::debug!(lock = %request.name, %error, "release failed; retrying");
                tokio::time::sleep(pause).await;
            }
            answer => return answer,
        }
    }
}

/// Retries the release until the server confirms it, the grant's lease has ended, or the
/// budget for a grant that does not expire on its own ran out — then abandons it.
async fn in_background(ctx: Arc<Context>, request: Request, lease_end: Option<Instant>) {
    let timeout = ctx.options.request_timeout();
    let started = ctx.now();
    let mut pause = FIRST_RETRY_PAUSE;
    loop {
        match ctx.call(timeout, ctx.backend.release(&request)).await {
            Ok(_) => return,
            Err(error) if !error.is_retryable() => {
                tracing::warn!(lock = %request.name, %error, "background release refused");
                break;
            }
            Err(error) => {
                tracing::debug!(lock = %request.name, %error, "background release failed; retrying");
            }
        }
        let now = ctx.now();
        let over = match lease_end {
            Some(end) => now >= end,
            None => now.saturating_duration_since(started) >= timeout * ABANDON_AFTER_TIMEOUTS,
        };
        if over {
            break;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_RETRY_PAUSE);
    }
    if lease_end.is_some_and(|end| ctx.now() >= end) {
        tracing::debug!(lock = %request.name, "the grant's lease has ended: nothing left to release");
        return;
    }
    tracing::warn!(lock = %request.name, owner = %request.owner,
        "the release could not be confirmed; abandoning the grant");
    if let Err(error) = ctx.call(timeout, ctx.backend.abandon(&request)).await {
        tracing::warn!(lock = %request.name, %error, "abandoning the grant failed");
    }
}
