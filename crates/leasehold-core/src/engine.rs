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

use tokio::runtime::Handle;

use crate::backend::{Acquire, Expiry, Mode, Release, Request, WaitHint};
use crate::client::Client;
use crate::clock::Instant;
use crate::error::{Error, Result};
use crate::lease::Lease;
use crate::name::{LockName, OwnerId};
use crate::options::{LockOptions, MAX_DURATION};
use crate::sync::{Guard, Owner};

/// What to acquire.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    pub(crate) name: LockName,
    pub(crate) mode: Mode,
    pub(crate) options: Arc<LockOptions>,
    pub(crate) owner: Option<Owner>,
    pub(crate) value: Option<Arc<[u8]>>,
}

/// How long to wait for a busy lock.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Wait {
    No,
    UpTo(Duration),
    Forever,
}

/// The first pause after a failed request; doubled per failure up to [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(20);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Acquires `spec`, waiting as `wait` says. `Ok(None)`: busy for the whole wait.
pub(crate) async fn acquire(client: &Client, spec: &Spec, wait: Wait) -> Result<Option<Guard>> {
    if let Some(owner) = &spec.owner
        && let Some(guard) = owner.reenter(&spec.name, spec.mode)?
    {
        return Ok(Some(guard));
    }
    let options = &spec.options;
    let fair = check_supported(client, spec)?;
    let clock = client.clock();
    let started = clock.now();
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
    let request = Request {
        name: spec.name.clone(),
        owner: OwnerId::generate(),
        mode: spec.mode,
        ttl: options.ttl(),
        fair,
        waiting: !matches!(wait, Wait::No),
        lock_delay: options.lock_delay(),
        value: spec.value.clone(),
    };
    let timeout = options.request_timeout();
    let mut cleanup = Cleanup::new(client, &request, timeout);
    // A waiting request may leave a waiter entry behind from its first busy answer on.
    cleanup.needed = request.waiting;
    let mut failures = Failures::default();
    loop {
        let sent = clock.now();
        let answer = client
            .call(timeout, client.backend().acquire(&request))
            .await;
        let hint = match answer {
            Ok(Acquire::Granted(grant)) => {
                failures = Failures::default();
                let renewed = matches!(grant.expiry, Expiry::After(_));
                let lease = Lease::new(
                    client.clone(),
                    request.clone(),
                    options.clone(),
                    grant.token,
                    sent,
                    grant.expiry,
                );
                if let Some(lease) = lease {
                    cleanup.armed = false;
                    if renewed {
                        client.watchdog().watch(&lease);
                    }
                    let guard = Guard::new(lease);
                    if let Some(owner) = &spec.owner {
                        owner.register(&guard);
                    }
                    return Ok(Some(guard));
                }
                tracing::debug!(lock = %request.name, "the grant arrived after its deadline; giving it back");
                cleanup.needed = true;
                let _ = client
                    .call(timeout, client.backend().release(&request))
                    .await;
                WaitHint::none()
            }
            Ok(Acquire::Busy(hint)) => {
                failures = Failures::default();
                hint
            }
            Err(error) if error.is_retryable() => {
                // Maybe applied, maybe not: the next acquire with the same owner adopts a
                // grant the unanswered one made; giving up releases it.
                cleanup.needed = true;
                let pause = failures
                    .next(sent, timeout)
                    .filter(|pause| give_up_at.is_none_or(|at| sent.saturating_add(*pause) < at));
                let Some(pause) = pause else {
                    cleanup.finish().await;
                    return Err(error);
                };
                tracing::debug!(lock = %request.name, %error, "acquire failed; retrying");
                tokio::time::sleep(pause).await;
                continue;
            }
            Err(error) => {
                cleanup.finish().await;
                return Err(error);
            }
        };

        let now = clock.now();
        let left = give_up_at.map(|at| at.saturating_duration_since(now));
        if left == Some(Duration::ZERO) {
            cleanup.finish().await;
            return Ok(None);
        }
        // Come back at least every ttl/3 so that a queue entry stays fresh.
        let slice = (options.ttl() / 3)
            .max(Duration::from_millis(1))
            .min(left.unwrap_or(Duration::MAX));
        let waited = client
            .call(
                slice.saturating_add(timeout),
                client.backend().wait(&request.name, &hint, slice),
            )
            .await;
        match waited {
            Ok(()) | Err(Error::Timeout(_)) => {}
            Err(error) if error.is_retryable() => {
                let Some(pause) = failures.next(now, timeout) else {
                    cleanup.finish().await;
                    return Err(error);
                };
                tokio::time::sleep(pause).await;
            }
            Err(error) => {
                cleanup.finish().await;
                return Err(error);
            }
        }
    }
}

/// Rejects what the backend cannot do; returns whether the request queues fairly.
fn check_supported(client: &Client, spec: &Spec) -> Result<bool> {
    let caps = client.capabilities();
    let unsupported = |feature| {
        Err(Error::Unsupported {
            backend: caps.backend,
            feature,
        })
    };
    match spec.mode {
        Mode::Shared if !caps.shared => return unsupported("shared (read) mode"),
        Mode::Permit { .. } if !caps.permits => return unsupported("semaphore permits"),
        _ => {}
    }
    let options = &spec.options;
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

/// Consecutive failures of one acquisition: how long to pause before the next try, and
/// when to give up (after failing for longer than one request timeout).
#[derive(Debug, Default)]
struct Failures {
    since: Option<Instant>,
    pause: Duration,
}

impl Failures {
    fn next(&mut self, now: Instant, budget: Duration) -> Option<Duration> {
        let since = *self.since.get_or_insert(now);
        if now.saturating_duration_since(since) >= budget {
            return None;
        }
        self.pause = (self.pause * 2).clamp(FIRST_RETRY_PAUSE, MAX_RETRY_PAUSE);
        Some(self.pause)
    }
}

/// Releases by owner whatever an acquisition may have left on the server, when it gives up
/// ([`finish`](Cleanup::finish)) or when it is cancelled (drop, in the background).
struct Cleanup {
    client: Client,
    request: Request,
    timeout: Duration,
    runtime: Option<Handle>,
    /// Dropping while armed releases in the background: the acquisition was cancelled.
    armed: bool,
    /// Something may exist on the server (a queue entry, a grant of unknown outcome).
    needed: bool,
}

impl Cleanup {
    fn new(client: &Client, request: &Request, timeout: Duration) -> Self {
        Self {
            client: client.clone(),
            request: request.clone(),
            timeout,
            runtime: Handle::try_current().ok(),
            armed: true,
            needed: false,
        }
    }

    /// Gives up: releases now if anything may be left; in the background if that fails.
    async fn finish(mut self) {
        self.armed = false;
        if !self.needed {
            return;
        }
        let released = release(&self.client, &self.request, self.timeout).await;
        if let Err(error) = released {
            tracing::debug!(lock = %self.request.name, %error, "clean-up release failed; retrying in the background");
            self.armed = true;
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.armed {
            release_in_background(
                &self.client,
                self.runtime.as_ref(),
                self.request.clone(),
                self.timeout,
            );
        }
    }
}

/// Releases `request`, retrying failures that may pass (a refused connection, a failover)
/// for about one request timeout; a release is owner-checked, so a retry is harmless.
pub(crate) async fn release(
    client: &Client,
    request: &Request,
    timeout: Duration,
) -> Result<Release> {
    let clock = client.clock();
    let mut failures = Failures::default();
    loop {
        let sent = clock.now();
        match client
            .call(timeout, client.backend().release(request))
            .await
        {
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

/// Releases `request` in the background, retrying a few times if the outcome is unknown.
/// Without a runtime to run on, the server's lease expiry is the only clean-up left.
pub(crate) fn release_in_background(
    client: &Client,
    runtime: Option<&Handle>,
    request: Request,
    timeout: Duration,
) {
    let Some(runtime) = runtime.cloned().or_else(|| Handle::try_current().ok()) else {
        tracing::warn!(lock = %request.name, "no runtime to release on; the lease will expire on its own");
        return;
    };
    let task_client = client.clone();
    client.spawn_background(&runtime, async move {
        for attempt in 1..=3u32 {
            match task_client
                .call(timeout, task_client.backend().release(&request))
                .await
            {
                Ok(Release::Released | Release::NotHeld) => return,
                Err(error) if error.is_retryable() && attempt < 3 => {
                    tokio::time::sleep(FIRST_RETRY_PAUSE * attempt).await;
                }
                Err(error) => {
                    tracing::warn!(lock = %request.name, %error, "background release failed; the lease will expire on its own");
                    return;
                }
            }
        }
    });
}
