//! The acquire loop shared by every primitive.
//!
//! try → (busy) wait for a change → try again, until granted or out of time, with:
//!
//! - one fresh owner id per acquisition, reused by every retry of it, so a retry after a
//!   lost reply adopts the grant that reply would have announced;
//! - deadlines counted from the send time of the request that was granted;
//! - a grant whose reply came back after its deadline given back at once;
//! - everything the acquisition may have left on the server (a queue entry, a grant of
//!   unknown outcome) released by owner when it gives up, fails, or is cancelled.

use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::backend::{Acquire, Capabilities, Mode, Request, WaitHint};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::events::{self, EventKind};
use crate::lease::Lease;
use crate::name::{LockName, OwnerId};
use crate::options::{LockOptions, MAX_DURATION};
use crate::release::{Failures, PendingRelease};
use crate::telemetry;

/// What to acquire.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    pub(crate) name: LockName,
    pub(crate) mode: Mode,
    pub(crate) options: Arc<LockOptions>,
    pub(crate) value: Option<Arc<[u8]>>,
}

/// How long to wait for a busy lock.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Wait {
    No,
    UpTo(Duration),
    Forever,
}

/// Acquires `spec`, waiting as `wait` says. `Ok(None)`: busy for the whole wait.
///
/// # Cancel safety
///
/// From the first request on, whatever the acquisition may have left on the server is a
/// [`PendingRelease`]: dropping the future releases it by owner in the background.
pub(crate) async fn acquire(
    ctx: &Arc<Context>,
    spec: &Spec,
    wait: Wait,
) -> Result<Option<Arc<Lease>>> {
    let waits = !matches!(wait, Wait::No | Wait::UpTo(Duration::ZERO));
    let measured = telemetry::Acquiring::start(ctx, &spec.name, &spec.options, spec.mode, waits);
    let acquired = take(ctx, spec, wait)
        .instrument(measured.span.clone())
        .await;
    measured.finish(&acquired);
    acquired
}

/// [`acquire`], unmeasured.
async fn take(ctx: &Arc<Context>, spec: &Spec, wait: Wait) -> Result<Option<Arc<Lease>>> {
    let options = &spec.options;
    let fair = check_supported(&ctx.capabilities, options, spec.mode)?;
    let started = ctx.now();
    let wait = match wait {
        Wait::UpTo(d) if d.is_zero() => Wait::No,
        Wait::UpTo(d) if d > MAX_DURATION => {
            return Err(Error::invalid(
                "wait",
                format!("{d:?} is longer than the limit of {MAX_DURATION:?}"),
            ));
        }
        other => other,
    };
    let give_up_at = match wait {
        Wait::No => Some(started),
        Wait::UpTo(d) => Some(started.saturating_add(d)),
        Wait::Forever => None,
    };
    let lane = ctx.lanes.take();
    let request = Request {
        name: spec.name.clone(),
        owner: OwnerId::generate(),
        mode: spec.mode,
        ttl: options.ttl(),
        fair,
        waiting: !matches!(wait, Wait::No),
        lock_delay: options.lock_delay(),
        value: spec.value.clone(),
        lane: lane.lane(),
        began_ms: crate::events::steady_ms_now(),
    };
    let timeout = options.request_timeout();
    let mut leftover = PendingRelease::new(ctx, request.clone(), started, request.ttl, None);
    let mut failures = Failures::default();
    // When the last wait for a change ended (a wake-up, or its slice running out).
    let mut woken_at = None;
    // A grant the server handed over while we waited (see `Backend::handed`).
    let mut handed = None;
    let resolved = |how, token| {
        telemetry::unknown_resolved(ctx, &spec.name, options, how);
        events::record(ctx, EventKind::Unknown(how), &request, token, None, None);
    };
    loop {
        let (sent, answer) = match handed.take() {
            // The answer, made while we waited, to the request that queued us.
            Some((sent, grant)) => (sent, Ok(Acquire::Granted(grant))),
            None => {
                let sent = ctx.now();
                // From here on the request may have created something on the server.
                leftover.sent(sent, request.ttl);
                (sent, ctx.call(timeout, ctx.backend.acquire(&request)).await)
            }
        };
        let hint = match answer {
            Ok(Acquire::Granted(grant)) => {
                failures = Failures::default();
                let was_unknown = leftover.resolve();
                let promise = ctx.events.is_some().then(|| grant.expiry.clone());
                let handoff = grant.handoff;
                let lease = Lease::new(
                    ctx.clone(),
                    request.clone(),
                    lane.clone(),
                    options.clone(),
                    grant.token,
                    sent,
                    grant.expiry,
                );
                if let Some(lease) = lease {
                    if was_unknown {
                        resolved("adopted", Some(grant.token));
                    }
                    let token = Some(grant.token);
                    let promise = promise.as_ref();
                    events::record(
                        ctx,
                        EventKind::Granted,
                        &request,
                        token,
                        Some(sent),
                        promise,
                    );
                    // A waiter's hand-off: the server's measure from the release, where
                    // the backend has one; else from the wake-up that ended its wait.
                    if let Some(woken) = woken_at {
                        let took =
                            handoff.unwrap_or_else(|| ctx.now().saturating_duration_since(woken));
                        telemetry::handed_off(ctx, &request.name, options, took);
                    }
                    leftover.disarm();
                    telemetry::granted(ctx, &request.name, options);
                    lease.start_renewals();
                    return Ok(Some(lease));
                }
                if was_unknown {
                    resolved("released", None);
                }
                tracing::debug!(lock = %request.name, "the grant arrived after its deadline; giving it back");
                let _ = ctx.call(timeout, ctx.backend.release(&request)).await;
                WaitHint::none()
            }
            Ok(Acquire::Busy(hint)) => {
                failures = Failures::default();
                let was_unknown = leftover.resolve();
                if was_unknown {
                    resolved("not_granted", None);
                }
                // A busy answer leaves a queue entry only for a request that waits. After
                // one that went unanswered, that request may yet arrive late and grant
                // (on another connection than the retry's): giving up releases it.
                if !request.waiting && !was_unknown {
                    leftover.disarm();
                }
                hint
            }
            Err(error) if error.is_retryable() => {
                // Maybe applied, maybe not: the next acquire with the same owner adopts a
                // grant the unanswered one made; giving up (or being dropped) releases it.
                if leftover.unanswered(options) {
                    let resolved_within = Failures::give_up_within(timeout);
                    let kind = EventKind::Unanswered { resolved_within };
                    events::record(ctx, kind, &request, None, Some(sent), None);
                }
                let pause = failures
                    .next(sent, timeout)
                    .filter(|pause| give_up_at.is_none_or(|at| sent.saturating_add(*pause) < at));
                let Some(pause) = pause else {
                    give_up(leftover, timeout).await;
                    return Err(error);
                };
                tracing::debug!(lock = %request.name, %error, "acquire failed; retrying");
                tokio::time::sleep(pause).await;
                continue;
            }
            Err(error) => {
                give_up(leftover, timeout).await;
                return Err(error);
            }
        };

        let now = ctx.now();
        let left = give_up_at.map(|at| at.saturating_duration_since(now));
        if left == Some(Duration::ZERO) {
            give_up(leftover, timeout).await;
            return Ok(None);
        }
        // Come back at least every ttl/3 so that a queue entry stays fresh.
        let slice = (options.ttl() / 3)
            .max(Duration::from_millis(1))
            .min(left.unwrap_or(Duration::MAX));
        let waited = ctx
            .call(
                slice.saturating_add(timeout),
                ctx.backend.wait(&request.name, &hint, slice),
            )
            .await;
        woken_at = Some(ctx.now());
        match waited {
            // With less than half of the lease of the request that queued us left, a grant
            // handed over is left to the next acquire, which adopts it afresh.
            Ok(()) | Err(Error::Timeout(_)) if ctx.now() < sent.saturating_add(request.ttl / 2) => {
                handed = (ctx.backend.handed(&request, &hint).await).map(|grant| (sent, grant));
            }
            Ok(()) | Err(Error::Timeout(_)) => {}
            Err(error) if error.is_retryable() => {
                let Some(pause) = failures.next(now, timeout) else {
                    give_up(leftover, timeout).await;
                    return Err(error);
                };
                tokio::time::sleep(pause).await;
            }
            Err(error) => {
                give_up(leftover, timeout).await;
                return Err(error);
            }
        }
    }
}

/// Gives up an acquisition.
/// It releases what it may have left, now if that works, else in the background.
async fn give_up(leftover: PendingRelease, timeout: Duration) {
    if leftover.is_armed()
        && let Err(error) = leftover.run(timeout).await
    {
        tracing::debug!(%error, "clean-up release failed; retrying in the background");
    }
}

/// Rejects what the backend cannot do; returns whether the request queues fairly.
fn check_supported(caps: &Capabilities, options: &LockOptions, mode: Mode) -> Result<bool> {
    let unsupported = |feature| {
        Err(Error::Unsupported {
            backend: caps.backend,
            feature,
        })
    };
    match mode {
        Mode::Shared if !caps.shared => return unsupported("shared (read) mode"),
        Mode::Permit { .. } if !caps.permits => return unsupported("semaphore permits"),
        _ => {}
    }
    if options.lock_delay().is_some() && !caps.lock_delay {
        return unsupported("lock delay");
    }
    if options.max_hold().is_some() && !caps.expiring_leases {
        return unsupported("a maximum hold time (its grants do not expire)");
    }
    if options.max_hold().is_some() && caps.has_sessions() {
        return unsupported("a maximum hold time (grants live as long as the client's session)");
    }
    if let (Some(session), Some(asked)) = (caps.session_ttl, options.chosen_ttl())
        && round_up(asked, caps.ttl_granularity) != session
    {
        return Err(Error::invalid(
            "ttl",
            format!(
                "the {} backend's grants live by its session, whose ttl is {session:?}: a \
                 lock cannot have a ttl of {asked:?}; set the session's ttl instead, or leave \
                 the lock's unset",
                caps.backend
            ),
        ));
    }
    match options.fair() {
        Some(true) if !caps.fair => unsupported("fair (FIFO) queueing"),
        fair => Ok(fair.unwrap_or(caps.fair)),
    }
}

/// `d` rounded up to a multiple of `granularity`.
fn round_up(d: Duration, granularity: Duration) -> Duration {
    let step = granularity.as_nanos().max(1);
    let steps = d.as_nanos().div_ceil(step);
    Duration::from_nanos(u64::try_from(steps * step).unwrap_or(u64::MAX))
}
