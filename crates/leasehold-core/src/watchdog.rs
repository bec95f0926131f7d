//! The renewal loop of one expiring lease.
//!
//! Input: the lease (deadline, cadence, request). Output: the lease renewed, or marked lost.
//!
//! - Renews every [`renew_every`](crate::LockOptions::renew_every) (a third of the lease by
//!   default) with the backend's owner-checked renewal.
//! - A renewal answering "not owner" ends the lease at once.
//! - Failed or unanswered renewals are retried until the deadline; at the deadline the
//!   lease is lost, whether or not a reply ever comes. Each renewal's new deadline counts
//!   from the moment that renewal was sent.
//! - It stops when the lease is released (the last guard released or dropped), and stops
//!   renewing once the optional hold cap is reached, so an abandoned or runaway holder is
//!   not renewed forever.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Renewal;
use crate::clock::Instant;
use crate::error::LossReason;
use crate::lease::Lease;

/// The longest pause between two attempts of a failing renewal.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Renews `lease` until it is released or lost.
pub(crate) async fn run(lease: Arc<Lease>) {
    let clock = lease.client.clock().clone();
    let every = lease.options.renew_every();
    let retry_pause = (every / 4).clamp(Duration::from_millis(1), MAX_RETRY_PAUSE);
    let cap = lease
        .options
        .max_hold()
        .map(|cap| lease.acquired_at.saturating_add(cap));
    let mut last_sent = lease.acquired_at;

    // Sleeps until `until`; returns false if the lease was released or lost meanwhile.
    let pause = |until: Instant| {
        let lease = &lease;
        let clock = &clock;
        async move {
            let Some(deadline) = lease.deadline() else {
                return false;
            };
            tokio::select! {
                () = lease.stop.cancelled() => false,
                () = clock.sleep_until(deadline) => {
                    lease.mark_lost(LossReason::Expired);
                    false
                }
                () = clock.sleep_until(until) => true,
            }
        }
    };

    loop {
        let next = last_sent.saturating_add(every);
        if cap.is_some_and(|cap| next >= cap) {
            // Stop renewing; the lease runs out at its deadline.
            lease.cap();
            if let Some(deadline) = lease.deadline() {
                tokio::select! {
                    () = lease.stop.cancelled() => {}
                    () = clock.sleep_until(deadline) => lease.mark_lost(LossReason::MaxHoldReached),
                }
            }
            return;
        }
        if !pause(next).await {
            return;
        }
        loop {
            let Some(deadline) = lease.deadline() else {
                return;
            };
            let sent = clock.now();
            let renewal = tokio::select! {
                () = lease.stop.cancelled() => return,
                () = clock.sleep_until(deadline) => {
                    lease.mark_lost(LossReason::Expired);
                    return;
                }
                answer = lease.client.call(
                    lease.options.request_timeout(),
                    lease.client.backend().renew(&lease.request),
                ) => answer,
            };
            match renewal {
                Ok(Renewal::Renewed(expiry)) => {
                    if !lease.extend(sent, expiry) {
                        return;
                    }
                    last_sent = sent;
                    break;
                }
                Ok(Renewal::Lost(reason)) => {
                    lease.mark_lost(reason);
                    return;
                }
                Err(error) => {
                    tracing::debug!(lock = %lease.request.name, %error, "renewal failed; retrying");
                    if !pause(clock.now().saturating_add(retry_pause)).await {
                        return;
                    }
                }
            }
        }
    }
}
