//! Deliberately broken lock variants, for the checker's own tests.
//! Each must be caught by at least one check. Built as decorators around a real backend and
//! as a clock, without touching leasehold-core; compiled only with the `planted-bugs`
//! feature.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use leasehold::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Liveness, LockState, Release, Renewal, Request,
    SessionKeeper, SessionLiveness, WaitHint,
};
use leasehold::backend::{Eviction, Mode};
use leasehold::clock::{Clock, Instant, Sleep, SystemClock};
use leasehold::{
    Error, FencingToken, ListCursor, Listing, LockName, LossReason, NamePrefix, OwnerId, RecordKey,
    Result,
};
use tokio::task::JoinHandle;

/// A planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bug {
    /// Release deletes whoever holds (a `DEL` without the owner check).
    ReleaseAny,
    /// Renewal extends whoever holds and always says "renewed" (`PEXPIRE` without the compare).
    RenewAny,
    /// Deadlines on the wall clock instead of a monotonic one.
    WallClock,
    /// A grant's validity counted from the reply instead of from the send.
    ValidityFromReply,
    /// A fresh owner id on every acquire call, so a retry cannot adopt a lost grant.
    NewOwnerOnRetry,
    /// The watchdog treats "not owner" as a passing failure and keeps the guard until its deadline.
    IgnoreNotOwner,
    /// A session backend counts its session's deadline from a keep-alive's reply, not its send.
    SessionDeadlineFromReply,
    /// A session backend counts every keep-alive it sends as acknowledged.
    /// The session's deadline moves a ttl past each one sent, answered or not, and a
    /// session ended for want of an answer is kept.
    IgnoreMissedKeepAlive,
    /// Fencing tokens from a counter in each client process, not from the server.
    /// Two processes hand out the same tokens, and a newer grant can carry a lower one.
    LocalToken,
}

impl Bug {
    /// Every planted bug.
    pub const ALL: [Bug; 9] = [
        Bug::ReleaseAny,
        Bug::RenewAny,
        Bug::WallClock,
        Bug::ValidityFromReply,
        Bug::NewOwnerOnRetry,
        Bug::IgnoreNotOwner,
        Bug::SessionDeadlineFromReply,
        Bug::IgnoreMissedKeepAlive,
        Bug::LocalToken,
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
            Bug::SessionDeadlineFromReply => "session-deadline-from-reply",
            Bug::IgnoreMissedKeepAlive => "ignore-missed-keep-alive",
            Bug::LocalToken => "local-token",
        }
    }

    /// Whether it is a bug of the backend itself (its session arithmetic, its tokens), below the recorder.
    /// The history then records the session deadline or token the buggy backend publishes,
    /// as it would record a real backend's; a session bug shows only against the server's
    /// own bound (which the backend reports beside it). The others are planted above the recorder, between
    /// it and the engine.
    pub fn in_backend(self) -> bool {
        matches!(
            self,
            Bug::SessionDeadlineFromReply | Bug::IgnoreMissedKeepAlive | Bug::LocalToken
        )
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
            sessions: Mutex::default(),
            tokens: AtomicU64::new(0),
        })
    }
}

#[derive(Debug)]
struct Planted {
    bug: Bug,
    inner: Arc<dyn Backend>,
    /// For [`Bug::NewOwnerOnRetry`]: the owner id last used for each acquisition.
    owners: Mutex<HashMap<OwnerId, OwnerId>>,
    /// For the session bugs: each session, its buggy view handed to the engine, and its task.
    /// The task keeps that view of the backend's session.
    sessions: Mutex<Vec<(SessionLiveness, SessionLiveness, JoinHandle<()>)>>,
    /// For [`Bug::LocalToken`]: the last token this process handed out.
    tokens: AtomicU64,
}

impl Drop for Planted {
    fn drop(&mut self) {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        for (_, _, task) in sessions.drain(..) {
            task.abort();
        }
    }
}

/// What a correct backend counts on of a session ttl (the engine's default drift).
fn validity(ttl: Duration) -> Duration {
    ttl.saturating_sub(ttl / 100 + Duration::from_millis(2))
}

impl Planted {
    /// The buggy view of the backend's session `inner`, made on its first grant.
    fn session(&self, inner: &SessionLiveness) -> SessionLiveness {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, buggy, _)) = sessions.iter().find(|(i, _, _)| i == inner) {
            return buggy.clone();
        }
        let keeper = match inner.current() {
            Liveness::Alive { until } => SessionKeeper::new(until),
            Liveness::Ended => {
                let keeper = SessionKeeper::new(SystemClock.now());
                keeper.end();
                keeper
            }
        };
        if let (Liveness::Alive { until }, Some(view)) = (inner.current(), inner.server_view()) {
            keeper.kept_alive(until, view);
        }
        let buggy = keeper.liveness();
        let ttl = inner
            .server_view()
            .map(|v| v.ttl)
            .or(self.inner.capabilities().session_ttl)
            .unwrap_or(Duration::from_secs(1));
        let follow = inner.clone();
        let task = match self.bug {
            Bug::IgnoreMissedKeepAlive => tokio::spawn(ignore_missed(follow, keeper, ttl)),
            _ => tokio::spawn(from_reply(follow, keeper)),
        };
        sessions.push((inner.clone(), buggy.clone(), task));
        buggy
    }

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
            Bug::SessionDeadlineFromReply | Bug::IgnoreMissedKeepAlive => {
                Ok(match self.inner.acquire(req).await? {
                    Acquire::Granted(Grant {
                        token,
                        expiry: Expiry::Session(inner),
                        ..
                    }) => {
                        Acquire::Granted(Grant::new(token, Expiry::Session(self.session(&inner))))
                    }
                    other => other,
                })
            }
            Bug::NewOwnerOnRetry => {
                let mut fresh = req.clone();
                fresh.owner = OwnerId::generate();
                self.owners
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(req.owner.clone(), fresh.owner.clone());
                self.inner.acquire(&fresh).await
            }
            Bug::LocalToken => Ok(match self.inner.acquire(req).await? {
                Acquire::Granted(mut grant) => {
                    let local = self.tokens.fetch_add(1, Ordering::Relaxed) + 1;
                    grant.token = FencingToken::new(local);
                    Acquire::Granted(grant)
                }
                other => other,
            }),
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

    /// Nothing: the next acquire adopts a grant handed over, with the planted bug applied.
    async fn handed(&self, _req: &Request, _hint: &WaitHint) -> Option<Grant> {
        None
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        self.inner.inspect(name).await
    }

    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        self.inner.list(prefix, cursor, page).await
    }

    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        self.inner.evict(name, mode, eviction).await
    }

    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        self.inner
            .put_record(&self.mapped(req), key, value, keep)
            .await
    }

    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        self.inner.get_record(name, key).await
    }

    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        self.inner.keep(&self.mapped(req), hold).await
    }

    async fn abandon(&self, req: &Request) -> Result<()> {
        self.inner.abandon(&self.mapped(req)).await
    }

    async fn session_liveness(&self) -> Option<SessionLiveness> {
        self.inner.session_liveness().await
    }
}

/// [`Bug::SessionDeadlineFromReply`]: keep-alives' deadlines counted from their answers.
/// It follows the backend's session, but counts each acknowledged keep-alive's deadline
/// from now, when its answer is seen, rather than from when it was sent — and so, when the
/// backend gives the session up at its own deadline, still counts on its later one.
async fn from_reply(mut inner: SessionLiveness, keeper: SessionKeeper) {
    let mut heard = inner.server_view().map(|v| v.heard);
    let mut deadline = match inner.current() {
        Liveness::Alive { until } => Some(until),
        Liveness::Ended => None,
    };
    loop {
        inner.changed().await;
        match (inner.current(), inner.server_view()) {
            (Liveness::Ended, _) => {
                // Ended before its deadline (the server said so): ended here too. Ended at
                // it: this one's deadline is later, and it is lost at that.
                if deadline.is_none_or(|d| SystemClock.now() < d) {
                    keeper.end();
                }
                return std::future::pending().await;
            }
            (Liveness::Alive { until }, Some(view)) if Some(view.heard) != heard => {
                heard = Some(view.heard);
                deadline = Some(until);
                keeper.kept_alive(SystemClock.now().saturating_add(validity(view.ttl)), view);
            }
            (Liveness::Alive { until }, _) => {
                deadline = Some(until);
                keeper.alive_until(until);
            }
        }
        if inner.is_suspended() {
            keeper.suspend();
        }
    }
}

/// [`Bug::IgnoreMissedKeepAlive`]: an unanswered keep-alive moves the deadline all the same.
/// It follows the backend's acknowledged keep-alives, and when none comes for a third of
/// the ttl (a keep-alive went out and was not answered), moves the deadline a ttl past now
/// all the same; it never suspends nor ends.
async fn ignore_missed(mut inner: SessionLiveness, keeper: SessionKeeper, ttl: Duration) {
    loop {
        tokio::select! {
            () = inner.changed() => match (inner.current(), inner.server_view()) {
                (Liveness::Alive { until }, Some(view)) => keeper.kept_alive(until, view),
                (Liveness::Alive { until }, None) => keeper.alive_until(until),
                (Liveness::Ended, _) => {}
            },
            () = tokio::time::sleep(ttl / 3) => {
                keeper.alive_until(SystemClock.now().saturating_add(validity(ttl)));
            }
        }
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
