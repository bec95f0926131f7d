//! The session: one etcd lease per backend, kept alive by a keep-alive stream.
//! It is shared by every lock, permit and candidacy of that backend.
//!
//! The session's deadline is the moment the last acknowledged keep-alive was *sent*, plus
//! the lease's ttl, minus a drift allowance. It is suspended while its link is down (a
//! keep-alive unanswered for a tenth of the ttl, the keep-alive stream broken) and resumed
//! by the next acknowledged keep-alive. A keep-alive answered with a ttl of zero (the
//! lease expired or is unknown), or no acknowledged keep-alive before the deadline, ends the
//! session: every guard on it is lost. A new session is started for later acquisitions.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use leasehold_core::backend::{Liveness, ServerView, SessionKeeper, SessionLiveness};
use leasehold_core::clock::{Clock, Instant, SystemClock};
use leasehold_core::{Error, Result};
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::JoinHandle;

use crate::error::map_error;
use crate::layout::Layout;
use crate::rpc::{PutRequest, Rpc};

/// How long after sending an acknowledged keep-alive a lease of `ttl` is counted on.
/// The ttl minus the drift allowance, 1 % of it + `margin`.
pub(crate) fn validity(ttl: Duration, margin: Duration) -> Duration {
    ttl.saturating_sub(ttl / 100 + margin)
}

/// One etcd lease and the task keeping it alive, with the session's fence.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) id: i64,
    /// The ttl etcd granted: whole seconds, what was asked.
    pub(crate) ttl: Duration,
    /// The fixed part of the drift allowance.
    margin: Duration,
    keeper: Arc<SessionKeeper>,
    task: JoinHandle<()>,
    /// Lock-delay leases, by delay in whole seconds (see [`Session::delay_lease`]).
    delays: AsyncMutex<HashMap<u64, Lease>>,
    /// The fence key (see [`Layout::anchor`](crate::layout::Layout::anchor)).
    pub(crate) anchor: String,
    /// The fence key's mod revision as last seen: every put of a contender key compares it.
    fence: AtomicI64,
}

/// A lease kept alive by a task of its own.
#[derive(Debug)]
struct Lease {
    id: i64,
    keeper: Arc<SessionKeeper>,
    task: JoinHandle<()>,
}

/// `ttl` in whole seconds, rounded up.
fn whole_seconds(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0))
        .unwrap_or(i64::MAX)
        .max(1)
}

/// Grants a lease of at least `ttl` (rounded up to whole seconds).
/// It returns its id and the ttl etcd granted, with the time the request was sent.
async fn grant(rpc: &Rpc, ttl: Duration, what: &str) -> Result<(i64, Duration, Instant)> {
    let asked = whole_seconds(ttl);
    let sent = SystemClock.now();
    let granted = rpc
        .lease_grant(asked)
        .await
        .map_err(|e| map_error(e, &format!("granting the {what}")))?;
    if !granted.error.is_empty() {
        return Err(Error::backend(
            format!("etcd refused the {what}: {}", granted.error),
            true,
        ));
    }
    let ttl = u64::try_from(granted.ttl)
        .ok()
        .filter(|t| *t > 0)
        .map(Duration::from_secs)
        .ok_or_else(|| {
            Error::backend(
                format!("etcd granted the {what} a ttl of {} s", granted.ttl),
                false,
            )
        })?;
    Ok((granted.id, ttl, sent))
}

/// etcd's longest lease ttl, in seconds (its `MaxLeaseTTL`, about 285 years).
const MAX_LEASE_TTL: u64 = 9_000_000_000;

/// Grants the lease `lease` of `ttl` (rounded up to whole seconds) that nobody keeps alive.
/// etcd ends it `ttl` after it granted it, or later (its minimum ttl may be longer, and a
/// new leader renews every lease). Returns its id and the time it should end by, counted
/// from the request's send time.
///
/// # Errors
///
/// [`Error::InvalidArgument`] about the argument `ttl` came from, `arg`, for a `ttl` over
/// etcd's longest; errors of the request.
pub(crate) async fn grant_unkept(
    rpc: &Rpc,
    ttl: Duration,
    arg: &'static str,
    lease: &str,
) -> Result<(i64, Instant)> {
    if ttl > Duration::from_secs(MAX_LEASE_TTL) {
        return Err(Error::invalid(
            arg,
            format!("{ttl:?}: etcd keeps a lease at most {MAX_LEASE_TTL} s"),
        ));
    }
    let (id, granted, sent) = grant(rpc, ttl, lease).await?;
    Ok((id, sent.saturating_add(granted)))
}

impl Session {
    /// Grants a lease of `ttl` (rounded up to whole seconds) and starts keeping it alive.
    /// It puts the session's fence (where `layout` says) bound to it; the session is
    /// counted on until the last acknowledged keep-alive's send time + ttl − (1 % +
    /// `margin`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if etcd grants a longer ttl than asked (its minimum ttl
    /// is longer): the lease is revoked again, since locks would be held longer than the
    /// options say. Errors of the requests otherwise.
    pub(crate) async fn start(
        rpc: &Rpc,
        ttl: Duration,
        margin: Duration,
        layout: &Layout,
    ) -> Result<Session> {
        let (id, granted, sent) = grant(rpc, ttl, "session lease").await?;
        let anchor = layout.anchor(id);
        let revoke = async || {
            let _ = rpc.lease_revoke(id).await;
        };
        let asked = Duration::from_secs(whole_seconds(ttl).unsigned_abs());
        if granted != asked {
            revoke().await;
            return Err(Error::invalid(
                "session ttl",
                format!(
                    "etcd grants leases of at least {granted:?} (its minimum ttl follows its \
                     election timeout): a session ttl of {asked:?} cannot be honoured"
                ),
            ));
        }
        let put = rpc
            .put(PutRequest {
                key: anchor.clone().into_bytes(),
                value: b"leasehold session".to_vec(),
                lease: id,
                ..PutRequest::default()
            })
            .await;
        let fence = match put {
            Ok(revision) => Some(revision).filter(|r| *r > 0),
            Err(e) => {
                revoke().await;
                return Err(map_error(e, "starting a session"));
            }
        };
        let Some(fence) = fence else {
            revoke().await;
            return Err(Error::backend(
                "etcd: a put was answered without its revision",
                true,
            ));
        };
        let until = sent.saturating_add(validity(granted, margin));
        let keeper = Arc::new(SessionKeeper::new(until));
        keeper.kept_alive(until, ServerView::new(sent, granted));
        let task = tokio::spawn(keep_alive(
            rpc.clone(),
            id,
            cadence(granted),
            margin,
            keeper.clone(),
            None,
        ));
        Ok(Session {
            id,
            ttl: granted,
            margin,
            keeper,
            task,
            delays: AsyncMutex::new(HashMap::new()),
            anchor,
            fence: AtomicI64::new(fence),
        })
    }

    /// The fence's mod revision as last seen.
    pub(crate) fn fence(&self) -> i64 {
        self.fence.load(Ordering::SeqCst)
    }

    /// The fence was seen at mod revision `revision` (it only moves forward).
    pub(crate) fn saw_fence(&self, revision: i64) {
        self.fence.fetch_max(revision, Ordering::SeqCst);
    }

    /// The lease for lock-delay markers of `delay`.
    /// Its ttl is the session's plus a keep-alive period plus the delay (whole seconds,
    /// rounded up), and it is kept alive only while the session is. When the session's
    /// lease runs out, the markers outlive the session's keys by at least the delay; a
    /// normal release deletes them with the lock key.
    pub(crate) async fn delay_lease(&self, rpc: &Rpc, delay: Duration) -> Result<i64> {
        let secs = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
        let mut delays = self.delays.lock().await;
        if let Some(lease) = delays.get(&secs)
            && matches!(lease.keeper.current(), Liveness::Alive { .. })
        {
            return Ok(lease.id);
        }
        if !self.is_alive() {
            return Err(Error::Lost(leasehold_core::LossReason::SessionEnded));
        }
        // Kept alive as often as the session, and longer by one keep-alive period: its last
        // keep-alive may be that much older than the session's.
        let every = cadence(self.ttl);
        let total = self.ttl + every + Duration::from_secs(secs);
        let (id, ttl, sent) = grant(rpc, total, "lock-delay lease").await?;
        let keeper = Arc::new(SessionKeeper::new(
            sent.saturating_add(validity(ttl, self.margin)),
        ));
        let task = tokio::spawn(keep_alive(
            rpc.clone(),
            id,
            every,
            self.margin,
            keeper.clone(),
            Some(self.keeper.clone()),
        ));
        if let Some(old) = delays.insert(secs, Lease { id, keeper, task }) {
            old.task.abort();
        }
        Ok(id)
    }

    /// Whether the session can still be counted on.
    pub(crate) fn is_alive(&self) -> bool {
        match self.keeper.current() {
            Liveness::Alive { until } => SystemClock.now() < until,
            Liveness::Ended => false,
        }
    }

    /// A view for grants bound to this session.
    pub(crate) fn liveness(&self) -> SessionLiveness {
        self.keeper.liveness()
    }

    /// Ends the session here.
    /// Its guards are lost, and its lease is no longer kept alive (etcd expires it within
    /// one ttl unless [`revoke`](Session::revoke)d first).
    pub(crate) fn end(&self) {
        self.task.abort();
        self.keeper.end();
    }

    /// Ends the session and revokes its leases.
    /// Every key bound to them is deleted at once (a close is a release of everything: no
    /// lock-delay follows it).
    pub(crate) async fn close(&self, rpc: &Rpc) -> Result<()> {
        self.end();
        self.revoke(rpc).await
    }

    /// Revokes the session's leases (see [`close`](Session::close)).
    async fn revoke(&self, rpc: &Rpc) -> Result<()> {
        let delays: Vec<i64> = self.delays.lock().await.values().map(|l| l.id).collect();
        // Every lease is tried: a delay lease left behind would close its locks after all.
        let mut first_error = None;
        for (id, what) in std::iter::once((self.id, "the session lease"))
            .chain(delays.into_iter().map(|id| (id, "a lock-delay lease")))
        {
            if let Err(e) = rpc.lease_revoke(id).await {
                first_error.get_or_insert(map_error(e, &format!("revoking {what}")));
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Stops keeping the session alive without revoking it.
    /// Its keys stay until the lease runs out (for a process handing its locks over to its
    /// own successor).
    pub(crate) async fn orphan(&self) {
        self.task.abort();
        for lease in self.delays.lock().await.values() {
            lease.task.abort();
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
        if let Ok(delays) = self.delays.try_lock() {
            for lease in delays.values() {
                lease.task.abort();
            }
        }
    }
}

/// How often a session's lease is kept alive: every third of its ttl.
fn cadence(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(100))
}

/// How long a keep-alive sent `every` so often may go unanswered before the session is suspended.
/// It is three tenths of that, a tenth of the ttl (as a ZooKeeper session's probe).
fn overdue(every: Duration) -> Duration {
    every * 3 / 10
}

/// Keeps the lease alive.
/// It sends a keep-alive `every` so often on a keep-alive stream, re-opening the stream
/// after errors, until the lease is gone or the deadline passes — or, for a lease that
/// follows a session (`parent`), until that session has ended.
///
/// The session is suspended while its link is down: a keep-alive unanswered for
/// [`overdue`], the stream broken or not opened again. The next acknowledged keep-alive
/// resumes it.
async fn keep_alive(
    rpc: Rpc,
    id: i64,
    every: Duration,
    margin: Duration,
    keeper: Arc<SessionKeeper>,
    parent: Option<Arc<SessionKeeper>>,
) {
    let parent_alive = || {
        parent.as_ref().is_none_or(|p| match p.current() {
            Liveness::Alive { until } => SystemClock.now() < until,
            Liveness::Ended => false,
        })
    };
    let deadline = || match keeper.current() {
        Liveness::Alive { until } if parent_alive() => Some(until),
        _ => {
            // Ended, or its session has: let the lease run out.
            keeper.end();
            None
        }
    };
    let end = |why: &str| {
        tracing::warn!(lease = id, "etcd lease no longer kept alive: {why}");
        keeper.end();
    };
    let late = overdue(every);
    'stream: loop {
        let Some(until) = deadline() else { return };
        let left = until.saturating_duration_since(SystemClock.now());
        if left.is_zero() {
            return end("no keep-alive was acknowledged in time");
        }
        // Opening the stream sends its first keep-alive.
        let mut sent = SystemClock.now();
        let opened = tokio::time::timeout(left, rpc.lease_keep_alive(id)).await;
        let Ok(Ok((sender, mut stream))) = opened else {
            keeper.suspend();
            tokio::time::sleep(every.min(left) / 4).await;
            continue 'stream;
        };
        loop {
            let Some(until) = deadline() else { return };
            let left = until.saturating_duration_since(SystemClock.now());
            if left.is_zero() {
                return end("no keep-alive was acknowledged in time");
            }
            let wait = left.min(every);
            let answer = {
                let mut answer = std::pin::pin!(tokio::time::timeout(wait, stream.message()));
                match tokio::time::timeout(late.min(wait), &mut answer).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        // Overdue: the link is down or the member does not answer.
                        keeper.suspend();
                        answer.await
                    }
                }
            };
            match answer {
                Ok(Ok(Some(answer))) if answer.ttl > 0 => {
                    let granted = Duration::from_secs(u64::try_from(answer.ttl).unwrap_or(0));
                    keeper.kept_alive(
                        sent.saturating_add(validity(granted, margin)),
                        ServerView::new(sent, granted),
                    );
                }
                Ok(Ok(Some(_))) => return end("the lease expired or is unknown to etcd"),
                // A lost stream or a late answer: open a new stream (maybe to another
                // member) while the deadline allows.
                Ok(Ok(None) | Err(_)) | Err(_) => {
                    keeper.suspend();
                    continue 'stream;
                }
            }
            // Until the next keep-alive is due, a broken stream (the connection dropped
            // after its pings went unanswered) suspends the session at once.
            tokio::select! {
                () = SystemClock.sleep_until(sent.saturating_add(every)) => {}
                _ = stream.message() => {
                    keeper.suspend();
                    continue 'stream;
                }
            }
            let Some(until) = deadline() else { return };
            if until <= SystemClock.now() {
                return end("no keep-alive was acknowledged in time");
            }
            sent = SystemClock.now();
            if sender.send().is_err() {
                keeper.suspend();
                continue 'stream;
            }
        }
    }
}

impl std::fmt::Display for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "lease {:x} ({:?})", self.id, self.ttl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_counts_on_its_ttl_minus_the_drift_from_the_send_time() {
        let sent = Instant::from_origin(Duration::from_secs(100));
        let deadline = |ttl, margin| sent.saturating_add(validity(ttl, margin));
        assert_eq!(
            deadline(Duration::from_secs(10), Duration::from_millis(2)),
            Instant::from_origin(Duration::from_millis(109_898))
        );
        assert_eq!(
            deadline(Duration::from_secs(2), Duration::from_millis(600)),
            Instant::from_origin(Duration::from_millis(101_380))
        );
        assert_eq!(whole_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(whole_seconds(Duration::from_secs(3)), 3);
    }
}
