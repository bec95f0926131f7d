//! The session: one etcd lease per backend, kept alive by a keep-alive stream, shared by
//! every lock, permit and candidacy of that backend.
//!
//! The session's deadline is the moment the last acknowledged keep-alive was *sent*, plus
//! the lease's ttl, minus a drift allowance. A keep-alive answered with a ttl of zero (the
//! lease expired or is unknown), or no acknowledged keep-alive before the deadline, ends the
//! session: every guard on it is lost. A new session is started for later acquisitions.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use leasehold_core::backend::{Liveness, SessionKeeper, SessionLiveness};
#[cfg(test)]
use leasehold_core::clock::Instant;
use leasehold_core::clock::{Clock, SystemClock};
use leasehold_core::{Error, Result};
use tokio::task::JoinHandle;

use crate::map_error;

/// The drift allowance subtracted from every lease ttl: 1 % + 2 ms, as for the engine.
fn validity(ttl: Duration) -> Duration {
    ttl.saturating_sub(ttl / 100 + Duration::from_millis(2))
}

/// One etcd lease and the task keeping it alive.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) id: i64,
    /// The ttl etcd granted (whole seconds, at least what was asked).
    pub(crate) ttl: Duration,
    keeper: Arc<SessionKeeper>,
    task: JoinHandle<()>,
}

impl Session {
    /// Grants a lease of at least `ttl` and starts keeping it alive.
    pub(crate) async fn start(client: &Client, ttl: Duration) -> Result<Session> {
        let asked = i64::try_from(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0))
            .unwrap_or(i64::MAX)
            .max(1);
        let sent = SystemClock.now();
        let granted = client
            .clone()
            .lease_grant(asked, None)
            .await
            .map_err(|e| map_error(e, "granting the session lease"))?;
        if !granted.error().is_empty() {
            return Err(Error::backend(
                format!("etcd refused the session lease: {}", granted.error()),
                true,
            ));
        }
        let ttl = Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(0));
        if granted.ttl() > asked {
            tracing::warn!(
                asked,
                granted = granted.ttl(),
                "etcd granted a longer session lease than asked (its minimum ttl)"
            );
        }
        let keeper = Arc::new(SessionKeeper::new(sent.saturating_add(validity(ttl))));
        let task = tokio::spawn(keep_alive(
            client.clone(),
            granted.id(),
            ttl,
            keeper.clone(),
        ));
        Ok(Session {
            id: granted.id(),
            ttl,
            keeper,
            task,
        })
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

    /// Ends the session and revokes its lease: every key bound to it is deleted at once.
    pub(crate) async fn close(&self, client: &Client) -> Result<()> {
        self.task.abort();
        self.keeper.end();
        client
            .clone()
            .lease_revoke(self.id)
            .await
            .map(|_| ())
            .map_err(|e| map_error(e, "revoking the session lease"))
    }

    /// Stops keeping the session alive without revoking it: its keys stay until the lease
    /// runs out (for a process handing its locks over to its own successor).
    pub(crate) fn orphan(&self) {
        self.task.abort();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Keeps the lease alive: a keep-alive every third of its ttl on a keep-alive stream,
/// re-opening the stream after errors, until the lease is gone or the deadline passes.
async fn keep_alive(client: Client, id: i64, ttl: Duration, keeper: Arc<SessionKeeper>) {
    let every = (ttl / 3).max(Duration::from_millis(100));
    let deadline = || match keeper.current() {
        Liveness::Alive { until } => Some(until),
        Liveness::Ended => None,
    };
    let end = |why: &str| {
        tracing::warn!(lease = id, "etcd session ended: {why}");
        keeper.end();
    };
    'stream: loop {
        let Some(until) = deadline() else { return };
        let left = until.saturating_duration_since(SystemClock.now());
        if left.is_zero() {
            return end("no keep-alive was acknowledged in time");
        }
        let opened = tokio::time::timeout(left, client.clone().lease_keep_alive(id)).await;
        let Ok(Ok((mut sender, mut stream))) = opened else {
            tokio::time::sleep(every.min(left) / 4).await;
            continue 'stream;
        };
        loop {
            let Some(until) = deadline() else { return };
            let left = until.saturating_duration_since(SystemClock.now());
            if left.is_zero() {
                return end("no keep-alive was acknowledged in time");
            }
            let sent = SystemClock.now();
            if sender.keep_alive().await.is_err() {
                continue 'stream;
            }
            match tokio::time::timeout(left.min(every), stream.message()).await {
                Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                    let granted = Duration::from_secs(u64::try_from(answer.ttl()).unwrap_or(0));
                    keeper.alive_until(sent.saturating_add(validity(granted)));
                }
                Ok(Ok(Some(_))) => return end("the lease expired or is unknown to etcd"),
                // A lost stream or a late answer: open a new stream (maybe to another
                // member) while the deadline allows.
                Ok(Ok(None) | Err(_)) | Err(_) => continue 'stream,
            }
            let next = sent.saturating_add(every);
            SystemClock.sleep_until(next).await;
        }
    }
}

impl std::fmt::Display for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "lease {:x} ({:?})", self.id, self.ttl)
    }
}

/// The deadline of a session that starts now, for tests of the arithmetic.
#[cfg(test)]
pub(crate) fn deadline_after(sent: Instant, ttl: Duration) -> Instant {
    sent.saturating_add(validity(ttl))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_counts_on_its_ttl_minus_the_drift_from_the_send_time() {
        let sent = Instant::from_origin(Duration::from_secs(100));
        assert_eq!(
            deadline_after(sent, Duration::from_secs(10)),
            Instant::from_origin(Duration::from_millis(109_898))
        );
    }
}
