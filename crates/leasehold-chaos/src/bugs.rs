//! Deliberately broken lock variants, for the checker's own tests: each must be caught by
//! at least one check. Built as decorators around a real backend and as a clock, without
//! touching leasehold-core; compiled only with the `planted-bugs` feature.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use leasehold::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, LockState, Release, Renewal, Request,
    SessionLiveness, WaitHint,
};
use leasehold::clock::{Clock, Instant, Sleep};
use leasehold::{Error, LockName, LossReason, OwnerId, Result};

/// A planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bug {
    /// Release deletes whoever holds (a `DEL` without the owner check).
    ReleaseAny,
    /// Renewal extends whoever holds and always says "renewed" (`PEXPIRE` without the
    /// compare).
    RenewAny,
    /// Deadlines on the wall clock instead of a monotonic one.
    WallClock,
    /// A grant's validity counted from the reply instead of from the send.
    ValidityFromReply,
    /// A fresh owner id on every acquire call, so a retry cannot adopt a lost grant.
    NewOwnerOnRetry,
    /// The watchdog treats "not owner" as a passing failure and keeps the guard until its
    /// deadline.
    IgnoreNotOwner,
}

impl Bug {
    /// Every planted bug.
    pub const ALL: [Bug; 6] = [
        Bug::ReleaseAny,
        Bug::RenewAny,
        Bug::WallClock,
        Bug::ValidityFromReply,
        Bug::NewOwnerOnRetry,
        Bug::IgnoreNotOwner,
    ];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Bug::ReleaseAny => "release-any",
            Bug::RenewAny => "renew-any",
            Bug::WallClock => "wall-clock",
            Bug::ValidityFromReply => "validity-from-reply",
            Bug::NewOwnerOnRetry => "new-owner-on-retry",
            Bug::IgnoreNotOwner => "ignore-not-owner",
        }
    }

    /// Parses a name.
    pub fn parse(name: &str) -> Option<Bug> {
        Bug::ALL.into_iter().find(|b| b.name() == name)
    }

    /// Wraps `inner` (the wall-clock bug leaves the backend alone: see [`WallClock`]).
    pub fn wrap(self, inner: Arc<dyn Backend>) -> Arc<dyn Backend> {
        if self == Bug::WallClock {
            return inner;
        }
        Arc::new(Planted {
            bug: self,
            inner,
            owners: Mutex::default(),
        })
    }
}

#[derive(Debug)]
struct Planted {
    bug: Bug,
    inner: Arc<dyn Backend>,
    /// For [`Bug::NewOwnerOnRetry`]: the owner id last used for each acquisition.
    owners: Mutex<HashMap<OwnerId, OwnerId>>,
}

impl Planted {
    fn mapped(&self, req: &Request) -> Request {
        let owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        let mut req = req.clone();
        if let Some(owner) = owners.get(&req.owner) {
            req.owner = owner.clone();
        }
        req
    }

    /// The request with the current holder's owner id, if someone holds.
    async fn as_holder(&self, req: &Request) -> Result<Option<Request>> {
        let state = self.inner.inspect(&req.name).await?;
        Ok(state.holders.first().map(|h| {
            let mut r = req.clone();
            r.owner = h.owner.clone();
            r
        }))
    }
}

#[async_trait]
impl Backend for Planted {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        match self.bug {
            Bug::NewOwnerOnRetry => {
                let mut fresh = req.clone();
                fresh.owner = OwnerId::generate();
                self.owners
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(req.owner.clone(), fresh.owner.clone());
                self.inner.acquire(&fresh).await
            }
            Bug::ValidityFromReply => {
                let sent = std::time::Instant::now();
                let answer = self.inner.acquire(req).await?;
                Ok(match answer {
                    Acquire::Granted(grant) => match grant.expiry {
                        Expiry::After(d) => Acquire::Granted(Grant::new(
                            grant.token,
                            Expiry::After(d + sent.elapsed()),
                        )),
                        _ => Acquire::Granted(grant),
                    },
                    other => other,
                })
            }
            _ => self.inner.acquire(req).await,
        }
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        let req = self.mapped(req);
        match self.bug {
            Bug::RenewAny => match self.inner.renew(&req).await? {
                Renewal::Lost(_) => {
                    if let Some(holder) = self.as_holder(&req).await? {
                        let _ = self.inner.renew(&holder).await;
                    }
                    Ok(Renewal::Renewed(Expiry::After(req.ttl)))
                }
                renewed => Ok(renewed),
            },
            Bug::IgnoreNotOwner => match self.inner.renew(&req).await? {
                Renewal::Lost(LossReason::NotOwner) => Err(Error::unavailable(
                    "not owner (ignored by the planted bug: retried as if the link failed)",
                )),
                other => Ok(other),
            },
            Bug::ValidityFromReply => {
                let sent = std::time::Instant::now();
                Ok(match self.inner.renew(&req).await? {
                    Renewal::Renewed(Expiry::After(d)) => {
                        Renewal::Renewed(Expiry::After(d + sent.elapsed()))
                    }
                    other => other,
                })
            }
            _ => self.inner.renew(&req).await,
        }
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let req = self.mapped(req);
        if self.bug == Bug::ReleaseAny
            && let Some(holder) = self.as_holder(&req).await?
        {
            return self.inner.release(&holder).await;
        }
        self.inner.release(&req).await
    }

    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        self.inner.wait(name, hint, max).await
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        self.inner.inspect(name).await
    }

    async fn abandon(&self, req: &Request) -> Result<()> {
        self.inner.abandon(&self.mapped(req)).await
    }

    async fn session_liveness(&self) -> Option<SessionLiveness> {
        self.inner.session_liveness().await
    }
}

/// A clock that reads the wall clock: a jump of the system time moves every deadline.
#[derive(Debug, Clone, Copy, Default)]
pub struct WallClock;

impl WallClock {
    fn read() -> Duration {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
    }
}

impl Clock for WallClock {
    fn now(&self) -> Instant {
        Instant::from_origin(Self::read())
    }

    fn sleep_until(&self, deadline: Instant) -> Sleep {
        Box::pin(async move {
            loop {
                let left = deadline.since_origin().saturating_sub(Self::read());
                if left.is_zero() {
                    return;
                }
                tokio::time::sleep(left.min(Duration::from_millis(50))).await;
            }
        })
    }
}
