//! Metrics of every lock, through the [`metrics`] facade (docs/metrics.md lists them).
//!
//! Nothing is recorded until the application installs a recorder — an exporter such as
//! `metrics-exporter-prometheus` — and then every backend reports the same metrics, from
//! the one engine. Each carries the backend's name as the label `backend`; a lock's name
//! is a label (`name`) only where its options ask for it
//! ([`LockOptionsBuilder::metric_name`](crate::LockOptionsBuilder::metric_name)), since
//! names can be countless.

use std::time::Duration;

use metrics::Label;

use crate::backend::Mode;
use crate::context::Context;
use crate::error::{LossReason, Result};
use crate::name::LockName;
use crate::options::LockOptions;

/// Seconds from the start of an acquisition to its outcome.
/// By `outcome`: `granted`, `busy` (not waiting), `timeout` (the wait ran out), `error` or
/// `cancelled`.
pub const ACQUIRE_SECONDS: &str = "leasehold_acquire_seconds";
/// Seconds from a grant to its end, by `end`: `released` or `lost`.
pub const HOLD_SECONDS: &str = "leasehold_hold_seconds";
/// Leases held now (granted, not yet released, dropped or lost).
pub const HELD: &str = "leasehold_held";
/// Acquisitions waiting now.
pub const WAITING: &str = "leasehold_waiting";
/// Leases lost.
/// By `reason`: `expired`, `not_owner`, `disconnected`, `session_ended` or
/// `max_hold_reached`.
pub const LOSSES: &str = "leasehold_losses_total";
/// Renewals of expiring leases.
/// By `result`: `renewed`, `lost` (the server said the grant is gone) or `failed` (no
/// answer, or an error: retried until the deadline).
pub const RENEWALS: &str = "leasehold_renewals_total";
/// Seconds of lease left, by the holder's own deadline, when a renewal was confirmed.
/// How close the holder came to losing its lock.
pub const RENEWAL_MARGIN_SECONDS: &str = "leasehold_renewal_margin_seconds";
/// Acquire requests that went unanswered, by how their outcome was resolved.
/// By `resolved`: `adopted` (a retry with the same owner found the grant), `not_granted`
/// (the next answer was busy) or `released` (given up: released by owner).
pub const UNKNOWN_OUTCOMES: &str = "leasehold_unknown_outcomes_total";
/// Seconds from a waiter's last wake-up to its grant: the hand-off, as the waiter sees it.
/// The wake-up is the backend's push (or the end of a wait slice, on a backend without
/// one); acquisitions granted without waiting have none.
pub const HANDOFF_SECONDS: &str = "leasehold_handoff_seconds";
/// Accesses a fence refused.
/// By `fence`: `fence` (in process), `redis`, `postgres`, `postgres_token` and `etcd`.
/// PostgreSQL's `StillOwner::verify` and etcd's `put_if_owner`/`delete_if_owner` count
/// their own refusals; a refusal inside the application's own statement (and every one of
/// `postgres_token`) is counted where the application calls `count_refusal`.
pub const FENCE_REFUSALS: &str = "leasehold_fence_refusals_total";

/// Counts an access the fence `fence` refused.
/// Its token was superseded, or its holder's lock is gone. The fences leasehold ships call it; a fence of the application's own can too.
pub fn fence_refused(fence: &'static str) {
    metrics::counter!(FENCE_REFUSALS, "fence" => fence).increment(1);
}

/// The labels of one lock's metrics, and more.
fn labels(
    ctx: &Context,
    name: &LockName,
    options: &LockOptions,
    more: &[(&'static str, &'static str)],
) -> Vec<Label> {
    let mut labels = vec![Label::new("backend", ctx.capabilities.backend)];
    if options.metric_name() {
        labels.push(Label::new("name", name.as_str().to_owned()));
    }
    labels.extend(more.iter().map(|(k, v)| Label::new(*k, *v)));
    labels
}

/// One acquisition being measured and traced: waiting (if it waits) until it ends.
/// Dropped before [`finish`](Acquiring::finish), it counts as cancelled.
pub(crate) struct Acquiring<'a> {
    ctx: &'a Context,
    name: &'a LockName,
    options: &'a LockOptions,
    waits: bool,
    started: std::time::Instant,
    done: bool,
    /// Its span, `leasehold.acquire`; the outcome is recorded on it at the end.
    pub(crate) span: tracing::Span,
}

impl<'a> Acquiring<'a> {
    pub(crate) fn start(
        ctx: &'a Context,
        name: &'a LockName,
        options: &'a LockOptions,
        mode: Mode,
        waits: bool,
    ) -> Self {
        if waits {
            metrics::gauge!(WAITING, labels(ctx, name, options, &[])).increment(1.0);
        }
        Acquiring {
            ctx,
            name,
            options,
            waits,
            started: std::time::Instant::now(),
            done: false,
            span: tracing::debug_span!(
                "leasehold.acquire",
                lock = %name,
                backend = ctx.capabilities.backend,
                ?mode,
                outcome = tracing::field::Empty,
            ),
        }
    }

    /// Records how the acquisition ended.
    pub(crate) fn finish<T>(mut self, result: &Result<Option<T>>) {
        let outcome = match result {
            Ok(Some(_)) => "granted",
            Ok(None) if self.waits => "timeout",
            Ok(None) => "busy",
            Err(_) => "error",
        };
        self.end(outcome);
    }

    fn end(&mut self, outcome: &'static str) {
        self.done = true;
        self.span.record("outcome", outcome);
        let (ctx, name, options) = (self.ctx, self.name, self.options);
        if self.waits {
            metrics::gauge!(WAITING, labels(ctx, name, options, &[])).decrement(1.0);
        }
        let labels = labels(ctx, name, options, &[("outcome", outcome)]);
        metrics::histogram!(ACQUIRE_SECONDS, labels).record(self.started.elapsed());
    }
}

impl Drop for Acquiring<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.end("cancelled");
        }
    }
}

/// A lease was granted: one more held.
pub(crate) fn granted(ctx: &Context, name: &LockName, options: &LockOptions) {
    metrics::gauge!(HELD, labels(ctx, name, options, &[])).increment(1.0);
}

/// A lease ended after `held_for`: released (`lost` is `None`), or lost for that reason.
pub(crate) fn ended(
    ctx: &Context,
    name: &LockName,
    options: &LockOptions,
    held_for: Duration,
    lost: Option<LossReason>,
) {
    metrics::gauge!(HELD, labels(ctx, name, options, &[])).decrement(1.0);
    let end = if lost.is_some() { "lost" } else { "released" };
    metrics::histogram!(HOLD_SECONDS, labels(ctx, name, options, &[("end", end)])).record(held_for);
    if let Some(reason) = lost {
        let reason = reason_label(reason);
        metrics::counter!(LOSSES, labels(ctx, name, options, &[("reason", reason)])).increment(1);
    }
}

/// A renewal was answered (or failed); `margin`: the lease left when it was confirmed.
pub(crate) fn renewed(
    ctx: &Context,
    name: &LockName,
    options: &LockOptions,
    result: &'static str,
    margin: Option<Duration>,
) {
    metrics::counter!(RENEWALS, labels(ctx, name, options, &[("result", result)])).increment(1);
    if let Some(margin) = margin {
        metrics::histogram!(RENEWAL_MARGIN_SECONDS, labels(ctx, name, options, &[])).record(margin);
    }
}

/// A waiter was granted `took` after its last wake-up.
pub(crate) fn handed_off(ctx: &Context, name: &LockName, options: &LockOptions, took: Duration) {
    metrics::histogram!(HANDOFF_SECONDS, labels(ctx, name, options, &[])).record(took);
}

/// An acquire request's unknown outcome was resolved, `how`.
pub(crate) fn unknown_resolved(
    ctx: &Context,
    name: &LockName,
    options: &LockOptions,
    how: &'static str,
) {
    let labels = labels(ctx, name, options, &[("resolved", how)]);
    metrics::counter!(UNKNOWN_OUTCOMES, labels).increment(1);
}

fn reason_label(reason: LossReason) -> &'static str {
    match reason {
        LossReason::Expired => "expired",
        LossReason::NotOwner => "not_owner",
        LossReason::Disconnected => "disconnected",
        LossReason::SessionEnded => "session_ended",
        LossReason::MaxHoldReached => "max_hold_reached",
        LossReason::Evicted => "evicted",
    }
}
