//! The trait a lock server implements, and the values it exchanges with the engine.
//!
//! A backend answers a handful of questions atomically on its server and nothing more. All
//! that users see — waiting, timeouts, fairness from the engine's side, reentrancy, the
//! watchdog, loss signals, scoped runs, read-write locks, semaphores and elections — is
//! built once on top of it, so every backend behaves the same and one conformance suite
//! holds them all to it.
//!
//! # The model
//!
//! Each lock name has two independent sets of holders, each with a FIFO queue of waiters:
//!
//! - the *lock* set, used by [`Mode::Exclusive`] and [`Mode::Shared`] requests: an exclusive
//!   holder excludes everyone, shared holders exclude only exclusive ones (a read-write lock;
//!   a mutex and an election are its exclusive half);
//! - the *permit* set, used by [`Mode::Permit`] requests: at most `limit` holders (a
//!   counting semaphore whose permits are individual leases).
//!
//! Who holds is one rule for every backend ([`support::queue`](crate::support::queue)):
//! in a set's queue, in arrival order, a request holds when every request before it holds
//! and it fits beside them — exclusive: it is first; shared: no exclusive request is before
//! it; a permit: fewer requests are before it than *its own* limit (requests of one name
//! may ask for different limits). Holders are a prefix of the queue: no request overtakes
//! one queued before it (a reader a waiting writer, a permit of a larger limit a waiting
//! one of a smaller limit). A backend that grants a waiter only when it comes back to ask
//! may grant a request before waiters ahead of it that would hold but have not claimed
//! their place, as long as each of them still holds after it. A request that is not fair
//! ignores the waiters and is compared with the holders only.
//!
//! Tokens strictly increase *within each set* of a name: every grant of the lock set gets a
//! token greater than every earlier grant of the lock set, and likewise for the permit set.
//! A backend whose tokens come from one counter per name (memory, Redis, the file backend)
//! also orders them across the two sets; a backend whose token is the creation order of a
//! queue entry (etcd's create revision, ZooKeeper's czxid) does not: a permit that waited
//! may carry a token lower than a mutex grant of the same name that came and went while it
//! waited. Protect one resource with one set.
//!
//! # The contract
//!
//! - **acquire** is atomic on the server and idempotent per owner: if `req.owner` already
//!   holds the lock it is granted again with the same token and a fresh lease (this is how an
//!   acquire whose reply was lost gets adopted). Otherwise it grants if the request is
//!   compatible with the holders — and, when `req.fair`, with the waiters queued ahead of
//!   it — or answers busy. When `req.waiting`, a busy request may leave a waiter entry (a
//!   place in the FIFO queue when `req.fair`, or other waiting state such as a writer's
//!   claim); the engine calls acquire again at least every `ttl / 3` while it waits, a
//!   backend may drop a waiter entry not refreshed within `ttl`, and release removes it.
//! - **renew** extends the owner's grant only if it is still the owner's (compare and
//!   extend); otherwise it answers [`Renewal::Lost`].
//! - **release** removes the owner's grant or queue entry, and nothing else.
//! - **wait** returns when the state of the name may have changed since `hint` was taken,
//!   or after `max` at the latest. Returning early is allowed; missing a change that
//!   happened after the hint was taken is not.
//! - Every future is cancel-safe in the sense that dropping it leaves the server in a state
//!   the owner-checked release can clean up.

use std::any::Any;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::clock::Instant;
use crate::error::{Error, LossReason, Result};
use crate::fencing::FencingToken;
use crate::name::{LockName, NamePrefix, OwnerId, RecordKey};

/// The longest record value [`Backend::put_record`] is given, in bytes.
pub const MAX_RECORD_LEN: usize = 4096;

/// How a request wants to hold a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Alone: no other holder of the name's lock set (mutex, writer, leader).
    Exclusive,
    /// Together with other shared holders, but no exclusive one (reader).
    Shared,
    /// One of at most `limit` holders of the name's permit set (semaphore permit).
    Permit {
        /// The most permits of this name held at once.
        limit: NonZeroU32,
    },
}

impl Mode {
    /// Whether the mode uses the name's permit set rather than its lock set.
    pub fn is_permit(self) -> bool {
        matches!(self, Mode::Permit { .. })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Exclusive => f.write_str("exclusive"),
            Mode::Shared => f.write_str("shared"),
            Mode::Permit { limit } => write!(f, "permit/{limit}"),
        }
    }
}

/// One acquisition's request, passed unchanged to acquire, renew and release.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Request {
    /// The lock.
    pub name: LockName,
    /// Who asks; unique per acquisition.
    pub owner: OwnerId,
    /// How it wants to hold the lock.
    pub mode: Mode,
    /// The lease length to grant (and to extend by on renewal).
    pub ttl: Duration,
    /// Respect the FIFO queue: grant only if nobody incompatible waits ahead.
    pub fair: bool,
    /// The caller will wait: if busy, keep a waiter entry (a place in the queue if `fair`).
    pub waiting: bool,
    /// Keep the lock closed this long after this grant expires without a release.
    pub lock_delay: Option<Duration>,
    /// Data stored with the grant and shown by inspect (an election candidate's value).
    pub value: Option<Arc<[u8]>>,
    /// Which of the client's current acquisitions this is, the same in all of its requests.
    /// It is the client's base lane plus the lowest index free among them when it began. A
    /// backend that spreads requests over several connections keeps one lane on one
    /// connection, so the server runs an acquisition's requests in the order they were
    /// sent, and a client that holds one lock at a time stays on one connection.
    pub lane: u32,
    /// When the acquisition began, in ms since the Unix epoch.
    /// It is read from this process's steady clock on the wall clock's scale
    /// ([`steady_ms_now`](crate::events::steady_ms_now)). A backend that queues waiters on several independent servers (Redlock) orders them
    /// by it on each, so that every server has the same waiter at its head.
    pub began_ms: u64,
}

impl Request {
    /// A request of `owner` for `name` in `mode` with a lease of `ttl`, beginning now.
    /// It is not fair, not waiting, with no lock-delay, no value, lane 0 (set those fields
    /// as needed).
    pub fn new(name: LockName, owner: OwnerId, mode: Mode, ttl: Duration) -> Self {
        Self {
            name,
            owner,
            mode,
            ttl,
            fair: false,
            waiting: false,
            lock_delay: None,
            value: None,
            lane: 0,
            began_ms: crate::events::steady_ms_now(),
        }
    }
}

/// The answer to [`Backend::acquire`].
#[derive(Debug)]
pub enum Acquire {
    /// The lock is ours.
    Granted(Grant),
    /// Someone incompatible holds or waits ahead.
    /// The hint lets [`Backend::wait`] notice the next change.
    Busy(WaitHint),
}

/// A successful grant.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Grant {
    /// The grant's fencing token.
    pub token: FencingToken,
    /// How long the server keeps it without renewal.
    pub expiry: Expiry,
    /// The hand-off: how long the name stood released before this grant, if measured.
    /// The server's measure, from the release that left the lock free to the grant. `None`
    /// when the backend does not measure it, or no release came just before.
    pub handoff: Option<Duration>,
}

impl Grant {
    /// A grant with `token`, kept as `expiry` says.
    pub fn new(token: FencingToken, expiry: Expiry) -> Self {
        Self {
            token,
            expiry,
            handoff: None,
        }
    }

    /// The same grant, made `handoff` after the release before it.
    #[must_use]
    pub fn with_handoff(mut self, handoff: Option<Duration>) -> Self {
        self.handoff = handoff;
        self
    }
}

/// How long a server keeps a grant (or a renewal) without hearing from its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expiry {
    /// This long from when the server applied the request.
    /// May be longer than asked when the server rounds up; never shorter. The engine renews
    /// the grant.
    After(Duration),
    /// Until released or until the holding process dies (the OS drops the lock); nothing to renew.
    Never,
    /// As long as the backend's session lives; the engine renews nothing and follows the session.
    /// The session is an etcd lease or a ZooKeeper session, kept alive for all the client's
    /// grants at once.
    Session(SessionLiveness),
}

/// Whether a session is alive, and until when it can be counted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Alive until at least this instant of [`SystemClock`](crate::clock::SystemClock).
    /// That holds unless it is kept alive further; the backend computes it conservatively
    /// (from when its last keep-alive was sent, minus a drift allowance).
    Alive {
        /// The session's local deadline.
        until: Instant,
    },
    /// Ended: every grant bound to it is lost.
    Ended,
}

/// What the server knows of a session, as far as its acknowledged keep-alives show.
///
/// The server heard from the session at or after `heard` (the send time of the last
/// keep-alive it acknowledged: it restarted its timer when that arrived, later), and ends
/// the session no sooner than `ttl` after it last heard: at [`ServerView::until`] at the
/// earliest, unless the client closes it first. The backend's deadline
/// ([`Liveness::Alive`]) comes before that by its drift allowance. The engine counts on
/// the deadline only; this is for checkers that hold a client's deadline against the
/// server's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerView {
    /// The server heard from the session at or after this instant of the system clock.
    /// The clock is [`SystemClock`](crate::clock::SystemClock).
    pub heard: Instant,
    /// The session's ttl as the server granted it.
    pub ttl: Duration,
}

impl ServerView {
    /// The server heard from the session at or after `heard` and keeps it `ttl` from then.
    pub fn new(heard: Instant, ttl: Duration) -> Self {
        Self { heard, ttl }
    }

    /// The earliest instant the server may end the session (saturating).
    pub fn until(&self) -> Instant {
        self.heard.saturating_add(self.ttl)
    }
}

/// What a [`SessionKeeper`] publishes.
/// The session's liveness, whether its link is down, and what the server knows of it (if
/// the backend says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Published {
    liveness: Liveness,
    suspended: bool,
    server: Option<ServerView>,
}

/// The engine's view of a backend session.
/// It changes when the backend keeps the session alive, suspends it or loses it. Session
/// deadlines are on the system clock. A grant's view may also carry the grant's own
/// loss signal ([`revocable_by`](SessionLiveness::revocable_by)).
#[derive(Debug, Clone)]
pub struct SessionLiveness {
    session: watch::Receiver<Published>,
    revocation: Option<watch::Receiver<Option<LossReason>>>,
}

impl SessionLiveness {
    /// The session's liveness now.
    pub fn current(&self) -> Liveness {
        self.session.borrow().liveness
    }

    /// This view, for one grant that `revoker` can also end.
    /// The grant is then lost when the session ends or when the backend revokes it,
    /// whichever comes first.
    #[must_use]
    pub fn revocable_by(mut self, revoker: &Revoker) -> Self {
        self.revocation = Some(revoker.0.subscribe());
        self
    }

    /// Why the grant was revoked, if the backend revoked it.
    /// Always `None` for a view that is not [revocable](SessionLiveness::revocable_by).
    pub fn revoked(&self) -> Option<LossReason> {
        self.revocation.as_ref().and_then(|r| *r.borrow())
    }

    /// Whether the session is suspended (in jeopardy): its link to the server is down.
    /// Its grants still count only until the deadline, unless a keep-alive gets through
    /// before it. Always `false` once the session ended.
    pub fn is_suspended(&self) -> bool {
        let published = *self.session.borrow();
        published.suspended && matches!(published.liveness, Liveness::Alive { .. })
    }

    /// What the server was last shown to know of the session, if the backend says.
    /// See [`ServerView`].
    pub fn server_view(&self) -> Option<ServerView> {
        self.session.borrow().server
    }

    /// Completes when the liveness changes, or the grant is revoked.
    /// It completes at once if the keeper is gone, which ends the session.
    pub async fn changed(&mut self) {
        let Self {
            session,
            revocation,
        } = self;
        let revoked = async {
            // A revoker dropped without revoking revokes nothing.
            let revoked = match revocation {
                Some(revocation) => revocation.changed().await.is_ok(),
                None => false,
            };
            if !revoked {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            changed = session.changed() => {
                if changed.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            () = revoked => {}
        }
    }
}

impl PartialEq for SessionLiveness {
    fn eq(&self, other: &Self) -> bool {
        let revocation = match (&self.revocation, &other.revocation) {
            (Some(a), Some(b)) => a.same_channel(b),
            (a, b) => a.is_none() && b.is_none(),
        };
        self.session.same_channel(&other.session) && revocation
    }
}

impl Eq for SessionLiveness {}

/// The backend's side of a session: it reports each keep-alive, a suspension, or the end.
#[derive(Debug)]
pub struct SessionKeeper(watch::Sender<Published>);

impl SessionKeeper {
    /// A session alive until `until`.
    pub fn new(until: Instant) -> Self {
        Self(watch::Sender::new(Published {
            liveness: Liveness::Alive { until },
            suspended: false,
            server: None,
        }))
    }

    /// Moves the session's deadline and ends a suspension.
    /// A keep-alive was acknowledged, so the link works. Never revives an ended session,
    /// and never moves the deadline back.
    pub fn alive_until(&self, until: Instant) {
        self.extend(until, None);
    }

    /// As [`alive_until`](SessionKeeper::alive_until), with what the server was shown.
    /// It is for a keep-alive (or the session's creation) that the server acknowledged,
    /// with what that shows of the server's view (see [`ServerView`]; it never moves back
    /// either). Backends that know when the server last heard from the session call this
    /// rather than `alive_until`.
    pub fn kept_alive(&self, until: Instant, server: ServerView) {
        self.extend(until, Some(server));
    }

    fn extend(&self, until: Instant, server: Option<ServerView>) {
        self.0
            .send_if_modified(|published| match &mut published.liveness {
                Liveness::Alive { until: current } => {
                    let later = until > *current;
                    if later {
                        *current = until;
                    }
                    let resumed = std::mem::replace(&mut published.suspended, false);
                    let newer = server
                        .filter(|new| published.server.is_none_or(|old| new.heard > old.heard));
                    if newer.is_some() {
                        published.server = newer;
                    }
                    later || resumed || newer.is_some()
                }
                Liveness::Ended => false,
            });
    }

    /// Suspends the session: its link to the server is down (a disconnect, an overdue keep-alive).
    /// The deadline stays; grants are lost at it unless
    /// [`alive_until`](SessionKeeper::alive_until) reports a keep-alive first, and the loss
    /// reason is then [`LossReason::Disconnected`].
    pub fn suspend(&self) {
        self.0.send_if_modified(|published| {
            let alive = matches!(published.liveness, Liveness::Alive { .. });
            let changed = alive && !published.suspended;
            published.suspended |= alive;
            changed
        });
    }

    /// Ends the session: every grant bound to it is lost.
    pub fn end(&self) {
        self.0.send_modify(|published| {
            published.liveness = Liveness::Ended;
            published.suspended = false;
        });
    }

    /// The liveness now.
    pub fn current(&self) -> Liveness {
        self.0.borrow().liveness
    }

    /// Whether the session is suspended (see [`SessionLiveness::is_suspended`]).
    pub fn is_suspended(&self) -> bool {
        self.liveness().is_suspended()
    }

    /// A view for grants bound to this session.
    pub fn liveness(&self) -> SessionLiveness {
        SessionLiveness {
            session: self.0.subscribe(),
            revocation: None,
        }
    }
}

/// The backend's side of one grant's own loss signal, beside its session's liveness.
///
/// A grant that lives by a session has no renewal of its own at which to hear that it is
/// gone while the session lives on (evicted by an operator). A backend that learns of
/// that by push revokes the grant here; the grant's
/// [`SessionLiveness`](SessionLiveness::revocable_by) carries the signal, so the engine
/// follows it as it follows the session, with no task per grant.
#[derive(Debug)]
pub struct Revoker(watch::Sender<Option<LossReason>>);

impl Revoker {
    /// A grant's signal, not revoked.
    pub fn new() -> Self {
        Self(watch::Sender::new(None))
    }

    /// Revokes the grant for `reason`: it is lost, and stays lost.
    /// A second revocation changes nothing (the first reason stays).
    pub fn revoke(&self, reason: LossReason) {
        self.0.send_if_modified(|revoked| {
            let first = revoked.is_none();
            if first {
                *revoked = Some(reason);
            }
            first
        });
    }

    /// Why the grant was revoked, if it was.
    pub fn revoked(&self) -> Option<LossReason> {
        *self.0.borrow()
    }
}

impl Default for Revoker {
    fn default() -> Self {
        Self::new()
    }
}

impl LockState {
    /// No holders and no waiters, with `hint` for waiting on the next change.
    pub fn new(hint: WaitHint) -> Self {
        Self {
            hint,
            ..Self::default()
        }
    }
}

/// The answer to [`Backend::renew`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renewal {
    /// Still ours, with a fresh lease.
    Renewed(Expiry),
    /// Not ours any more.
    Lost(LossReason),
}

/// The answer to [`Backend::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The owner's grant or queue entry was removed.
    Released,
    /// The owner had neither.
    NotHeld,
}

/// Opaque data a backend hands out and gets back in [`Backend::wait`].
/// It comes with a busy answer or a [`LockState`]: a version number, a revision, a key to
/// watch.
#[derive(Clone, Default)]
pub struct WaitHint(Option<Arc<dyn Any + Send + Sync>>);

impl WaitHint {
    /// Wraps backend-specific data.
    pub fn new<T: Any + Send + Sync>(data: T) -> Self {
        Self(Some(Arc::new(data)))
    }

    /// A hint that carries nothing: wait returns at once.
    pub fn none() -> Self {
        Self(None)
    }

    /// The data, if it is a `T`.
    pub fn get<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.0.as_deref()?.downcast_ref()
    }
}

impl fmt::Debug for WaitHint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "WaitHint(..)"
        } else {
            "WaitHint(none)"
        })
    }
}

/// A holder, as reported by [`Backend::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// Who holds.
    pub owner: OwnerId,
    /// How.
    pub mode: Mode,
    /// The grant's token.
    pub token: FencingToken,
    /// Time left on the server's lease; `None` for grants that do not expire.
    pub remaining: Option<Duration>,
    /// Data stored with the grant.
    pub value: Option<Arc<[u8]>>,
    /// How long the grant has been held.
    /// `None` where the backend does not record when a grant was made.
    pub held: Option<Duration>,
    /// The grant is kept: its holder let go of it.
    /// It ends, unrenewed, when its time left runs out
    /// ([`Guard::keep_for`](crate::Guard::keep_for)). Set by
    /// [`Client::inspect`](crate::Client::inspect); backends leave it `false`.
    pub kept: bool,
}

impl Holder {
    /// A holder `owner` in `mode` with `token`.
    /// It has no expiry known, no value (set those fields as needed).
    pub fn new(owner: OwnerId, mode: Mode, token: FencingToken) -> Self {
        Self {
            owner,
            mode,
            token,
            remaining: None,
            value: None,
            held: None,
            kept: false,
        }
    }

    /// This holder with `remaining` time left on its lease.
    pub fn with_remaining(mut self, remaining: Option<Duration>) -> Self {
        self.remaining = remaining;
        self
    }

    /// This holder with `value` stored with its grant.
    pub fn with_value(mut self, value: Option<Arc<[u8]>>) -> Self {
        self.value = value;
        self
    }

    /// This holder, having held its grant for `held`.
    pub fn with_held(mut self, held: Option<Duration>) -> Self {
        self.held = held;
        self
    }
}

/// A queued waiter, as reported by [`Backend::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Waiter {
    /// Who waits.
    pub owner: OwnerId,
    /// For what.
    pub mode: Mode,
}

impl Waiter {
    /// A waiter `owner` in `mode`.
    pub fn new(owner: OwnerId, mode: Mode) -> Self {
        Self { owner, mode }
    }
}

/// What the server knows about one name.
/// Holders of both sets, queued waiters in queue order, and a hint for waiting on the next
/// change.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct LockState {
    /// Current holders (lock set first, then permits).
    pub holders: Vec<Holder>,
    /// Queued waiters, in the order they will be served (per set).
    pub waiters: Vec<Waiter>,
    /// Pass to [`Backend::wait`] to wait for the next change.
    pub hint: WaitHint,
    /// The name's recent evictions, newest first, where the backend records them.
    pub evictions: Vec<Eviction>,
}

/// A forced release: whose grant was evicted, by whom, when and why.
/// Recorded beside the name by [`Backend::evict`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Eviction {
    /// The evicted grant's owner.
    pub owner: OwnerId,
    /// The evicted grant's token: every later grant's is greater.
    pub token: FencingToken,
    /// Who evicted it, as `user@host`.
    pub by: String,
    /// Why, in the operator's words.
    pub reason: String,
    /// When, in milliseconds since the Unix epoch, by the evicting host's clock.
    pub at_ms: u64,
}

impl Eviction {
    /// The eviction of `owner`'s grant with `token`, by `by`, for `reason`, now.
    pub fn new(owner: OwnerId, token: FencingToken, by: String, reason: String) -> Self {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self {
            owner,
            token,
            by,
            reason,
            at_ms,
        }
    }
}

/// Where a listing goes on: opaque, made by the backend that returned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListCursor(String);

impl ListCursor {
    /// A cursor holding `position`, in the backend's own terms.
    pub fn new(position: impl Into<String>) -> Self {
        Self(position.into())
    }

    /// The position, as the backend wrote it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// One page of [`Backend::list`].
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Listing {
    /// Locks with a holder or a waiter, each with what the server knows about it.
    /// Their hints are [`WaitHint::none`].
    pub locks: Vec<(LockName, LockState)>,
    /// Where the next page starts; `None` after the last page.
    pub next: Option<ListCursor>,
}

impl Listing {
    /// A page of `locks`, followed by the page at `next`.
    pub fn new(locks: Vec<(LockName, LockState)>, next: Option<ListCursor>) -> Self {
        Self { locks, next }
    }
}

/// A notice of [`Backend::changes`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Change {
    /// This lock's holders, waiters or evictions may have changed.
    Lock(LockName),
    /// Notices may have been missed (the feed fell behind or was re-established).
    /// Any lock under the prefix may have changed.
    Resync,
}

/// How many notices a change feed holds for a watcher that has not read them yet.
/// One more and the watcher gets a single [`Change::Resync`] instead.
pub const CHANGE_FEED_CAPACITY: usize = 4096;

/// The sending side of a change feed, kept by the backend task that serves it.
///
/// Sending never waits: a watcher that falls behind gets one [`Change::Resync`] in place of
/// what did not fit. The task ends its subscription when [`closed`](ChangeSender::closed)
/// completes.
#[derive(Debug, Clone)]
pub struct ChangeSender {
    tx: tokio::sync::mpsc::Sender<Change>,
    missed: Arc<std::sync::atomic::AtomicBool>,
}

impl ChangeSender {
    /// Tells the watcher that `name` may have changed.
    pub fn changed(&self, name: LockName) {
        self.send(Change::Lock(name));
    }

    /// Tells the watcher that notices may have been missed.
    pub fn resync(&self) {
        self.send(Change::Resync);
    }

    fn send(&self, change: Change) {
        use tokio::sync::mpsc::error::TrySendError;
        if let Err(TrySendError::Full(_)) = self.tx.try_send(change) {
            self.missed
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Whether the watcher has dropped its feed.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Completes when the watcher drops its feed.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// A feed of [`Change`]s pushed by a backend (see [`Backend::changes`]).
/// Dropping it ends the subscription on the backend.
#[derive(Debug)]
pub struct Changes {
    rx: tokio::sync::mpsc::Receiver<Change>,
    missed: Arc<std::sync::atomic::AtomicBool>,
}

impl Changes {
    /// A new feed and its sending side, holding up to [`CHANGE_FEED_CAPACITY`] notices.
    pub fn channel() -> (ChangeSender, Changes) {
        let (tx, rx) = tokio::sync::mpsc::channel(CHANGE_FEED_CAPACITY);
        let missed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        (
            ChangeSender {
                tx,
                missed: missed.clone(),
            },
            Changes { rx, missed },
        )
    }

    /// The next notice; `None` once the backend has ended the feed for good (closed).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a notice is taken only when it is returned.
    pub async fn next(&mut self) -> Option<Change> {
        if self
            .missed
            .swap(false, std::sync::atomic::Ordering::Acquire)
        {
            return Some(Change::Resync);
        }
        self.rx.recv().await
    }

    /// A notice already waiting, without waiting for one.
    pub fn try_next(&mut self) -> Option<Change> {
        if self
            .missed
            .swap(false, std::sync::atomic::Ordering::Acquire)
        {
            return Some(Change::Resync);
        }
        self.rx.try_recv().ok()
    }
}

/// How far a backend's fencing tokens can be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenDurability {
    /// Replicated by consensus: survive crashes and failover of a minority (etcd, ZooKeeper).
    Consensus,
    /// Stored durably on one server or disk: they survive restarts, not the loss of its storage.
    /// PostgreSQL, the file backend on a persistent directory.
    Durable,
    /// Kept while the server keeps its data.
    /// A restart without persistence or an async failover can lose them (the backend must
    /// detect and refuse going backwards).
    WhileServerKeepsData,
    /// Kept in this process only (the in-memory backend).
    Process,
}

/// What a backend can do.
/// The engine checks requests against it; docs and the conformance suite read it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Short name for messages ("memory", "file", "redis", ...).
    pub backend: &'static str,
    /// Grants are leases that expire unless renewed (a holder can lose its lock).
    pub expiring_leases: bool,
    /// Granted lease lengths are multiples of this (etcd: 1 s); ttls are rounded up.
    pub ttl_granularity: Duration,
    /// How far tokens survive.
    pub tokens: TokenDurability,
    /// A FIFO queue of waiters is available (`fair` requests).
    pub fair: bool,
    /// Waiters are woken by the server (pub/sub, watch, inotify), not by polling.
    pub push_wakeups: bool,
    /// Shared mode (read-write locks).
    pub shared: bool,
    /// Permit mode (semaphores).
    pub permits: bool,
    /// `lock_delay` is honoured.
    pub lock_delay: bool,
    /// `Some(ttl)` when grants are bound to one session of the client ([`Expiry::Session`]).
    /// Then they are not renewed one by one: the session, kept alive for all of them, lasts
    /// `ttl` without a keep-alive, and that is every grant's lease length whatever a lock's
    /// options ask (a hold cap cannot stop one grant's renewal).
    pub session_ttl: Option<Duration>,
    /// Grants that live by a session can be moved off it to be kept.
    /// Kept after their holder lets go ([`Backend::keep`]). See [`can_keep`](Capabilities::can_keep).
    pub keeps_session_grants: bool,
}

impl Capabilities {
    /// Capabilities with every flag off, for a backend to fill in.
    pub fn new(backend: &'static str, tokens: TokenDurability) -> Self {
        Self {
            backend,
            expiring_leases: false,
            ttl_granularity: Duration::from_millis(1),
            tokens,
            fair: false,
            push_wakeups: false,
            shared: false,
            permits: false,
            lock_delay: false,
            session_ttl: None,
            keeps_session_grants: false,
        }
    }

    /// Whether grants are bound to a session of the client.
    /// See [`session_ttl`](Capabilities::session_ttl).
    pub fn has_sessions(&self) -> bool {
        self.session_ttl.is_some()
    }

    /// Whether a grant can be kept after its holder lets go ([`Backend::keep`]).
    /// Leases renewed one by one can (a last renewal sets their end); grants that live by
    /// a session only where the backend moves them off it; grants that never expire cannot.
    pub fn can_keep(&self) -> bool {
        self.expiring_leases && (!self.has_sessions() || self.keeps_session_grants)
    }
}

/// A lock server. Implement this to add a backend; use [`Client`](crate::Client) to lock.
///
/// See the [module documentation](self) for the model and the contract every method keeps.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Grants the lock to `req.owner` or answers busy (see the contract).
    async fn acquire(&self, req: &Request) -> Result<Acquire>;

    /// Extends the owner's grant by `req.ttl` if it is still the owner's.
    async fn renew(&self, req: &Request) -> Result<Renewal>;

    /// Renews each grant of `reqs` as [`renew`](Backend::renew) does.
    /// The answers are in the order of `reqs`. The engine sends the renewals that fall due together in one
    /// call, so a backend that can extend many leases in one request (one script, one
    /// statement) should. The default renews them all at the same time, one call each.
    ///
    /// # Cancel safety
    ///
    /// As `renew`'s: dropped before its answers, any of the grants may have been extended.
    async fn renew_many(&self, reqs: &[&Request]) -> Vec<Result<Renewal>> {
        futures_util::future::join_all(reqs.iter().map(|req| self.renew(req))).await
    }

    /// Removes the owner's grant or queue entry; never anyone else's.
    async fn release(&self, req: &Request) -> Result<Release>;

    /// Returns when `name` may have changed since `hint` was taken, or after `max`.
    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()>;

    /// The grant the server handed `req` while it waited on `hint`, if it says so.
    /// A server that hands a released lock straight to the waiter at the head of its queue
    /// (Redis) tells that waiter in the wake-up itself, so that the grant costs it no
    /// request. It is the late answer of the request that returned `hint`: its expiry
    /// counts from when that request was sent. The engine asks after each wait of a waiter
    /// (while at least half of that lease is left); `None` (the default) makes it send its
    /// next acquire, which finds a grant made meanwhile as its own.
    async fn handed(&self, req: &Request, hint: &WaitHint) -> Option<Grant> {
        let _ = (req, hint);
        None
    }

    /// Holders, waiters and a wait hint for `name`.
    async fn inspect(&self, name: &LockName) -> Result<LockState>;

    /// One page of the held or queued locks whose names begin with `prefix`.
    /// The page starts at `cursor` (`None`: the first page).
    ///
    /// `page` is how many names to look at per call, a hint that keeps each request short:
    /// a listing never blocks the server for long, and pages may hold fewer locks or more.
    /// A name may appear on two pages (a Redis `SCAN` repeats names when the keyspace
    /// grows); a lock held or freed meanwhile may or may not appear. The default says the
    /// backend cannot list.
    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        let _ = (prefix, cursor, page);
        Err(Error::Unsupported {
            backend: self.capabilities().backend,
            feature: "listing locks",
        })
    }

    /// A feed of notices, pushed by the server, of the locks under `prefix` that change.
    ///
    /// Once this returns, every later grant, release, queued or departed waiter and
    /// eviction of a lock under `prefix` is followed by a notice naming that lock, or by a
    /// [`Change::Resync`]; notices may also come when nothing changed. A lease that runs
    /// out is noticed when the server frees it — where expiry is by time alone (memory,
    /// PostgreSQL lease mode) not at all, so a watcher reads a lock again at its holders'
    /// lease end. The feed is pushed (pub/sub, watch, `NOTIFY`, inotify), never polled.
    /// Dropping it ends the subscription: no connection, watch or listener outlives it.
    /// The default says the backend has no change feed.
    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        let _ = prefix;
        Err(Error::Unsupported {
            backend: self.capabilities().backend,
            feature: "a change feed (watching locks)",
        })
    }

    /// Force-releases the grant `eviction` names, and records `eviction` beside the name.
    /// That is its owner's grant in `mode` with its token — never a newer grant.
    ///
    /// The name stays closed to new grants until the evicted grant's lease would have
    /// ended on the server, so the evicted holder learns of it — at its next renewal,
    /// answered [`LossReason::Evicted`], or at its deadline — before anyone else can hold
    /// the lock. `Ok(false)` if that grant is not held (released, expired, or another
    /// token). The default says the backend cannot evict.
    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        let _ = (name, mode, eviction);
        Err(Error::Unsupported {
            backend: self.capabilities().backend,
            feature: "force-release",
        })
    }

    /// Writes `value` under `key` beside `req.name`, if `req`'s grant is still held.
    /// The check and the write are one atomic step on the server, so a holder that has
    /// lost its grant — expired, evicted, its session gone — can no longer write: a record
    /// is *fenced* by the lock it sits beside. It replaces any record under `key`.
    ///
    /// The server keeps the record at least `keep` and may drop it after that. `value` is
    /// at most [`MAX_RECORD_LEN`] bytes (the client checks). `Ok(false)`: the grant is not
    /// held, and nothing was written. The default says the backend cannot keep records.
    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        let _ = (req, key, value, keep);
        Err(Error::Unsupported {
            backend: self.capabilities().backend,
            feature: "records beside a lock (scheduled jobs)",
        })
    }

    /// The record under `key` beside `name`, if the server keeps one.
    /// A record written before a release of `name` is seen by every grant that follows that
    /// release. The default says the backend cannot keep records.
    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        let _ = (name, key);
        Err(Error::Unsupported {
            backend: self.capabilities().backend,
            feature: "records beside a lock (scheduled jobs)",
        })
    }

    /// Leaves `req`'s grant on the server for `hold` more, unrenewed, and lets go of it.
    /// The grant then ends `hold` after the server applied this, by the server's clock,
    /// whether or not its holder still runs: a lock held *at least* that long (ShedLock's
    /// `lockAtLeastFor`). It is checked like a renewal: `Ok(false)` if the grant is no
    /// longer the owner's.
    ///
    /// The default renews the grant with a ttl of `hold` where grants are leases renewed
    /// one by one (the renewal sets the lease's end); a backend whose grants live by a
    /// session or a connection must move the grant off it, or say it cannot.
    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        let caps = self.capabilities();
        if !caps.can_keep() || caps.has_sessions() {
            return Err(Error::Unsupported {
                backend: caps.backend,
                feature: "holding a lock after its holder lets go (--at-least)",
            });
        }
        let mut kept = req.clone();
        kept.ttl = hold;
        Ok(matches!(self.renew(&kept).await?, Renewal::Renewed(_)))
    }

    /// Called when the release of `req`'s grant or queue entry could not be confirmed.
    /// The engine retried it while the session it lives by was healthy (see
    /// [`session_liveness`](Backend::session_liveness)) and the server never answered, or
    /// it refused — or that session has ended meanwhile. A backend whose grants live by a
    /// session must make sure this one does not stay alive under it, for instance by ending
    /// the session (its other grants are lost with it) or by moving the grant to a lease
    /// that expires; for a session that has ended already, by letting go of whatever still
    /// keeps it open. The default does nothing: on a backend whose grants expire, the
    /// engine keeps retrying the release until the grant's lease has ended.
    async fn abandon(&self, req: &Request) -> Result<()> {
        let _ = req;
        Ok(())
    }

    /// The liveness of the session this backend's grants live by now, if it has one open.
    ///
    /// The engine reads it while it retries a release that was not confirmed: while the
    /// session is suspended it keeps retrying rather than [`abandon`](Backend::abandon)
    /// the grant (a short outage must not end every grant of the session); once the
    /// session has ended it abandons the grant at once. A grant's own
    /// [`Expiry::Session`] is used where there is one; this serves an acquisition whose
    /// grant never arrived. The default, `None`, makes the engine abandon an unconfirmed
    /// release after two request timeouts whatever the link does; a backend that wraps
    /// another must pass this on.
    async fn session_liveness(&self) -> Option<SessionLiveness> {
        None
    }
}

#[async_trait]
impl<B: Backend + ?Sized> Backend for Arc<B> {
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        (**self).acquire(req).await
    }
    async fn renew(&self, req: &Request) -> Result<Renewal> {
        (**self).renew(req).await
    }
    async fn renew_many(&self, reqs: &[&Request]) -> Vec<Result<Renewal>> {
        (**self).renew_many(reqs).await
    }
    async fn release(&self, req: &Request) -> Result<Release> {
        (**self).release(req).await
    }
    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        (**self).wait(name, hint, max).await
    }
    async fn handed(&self, req: &Request, hint: &WaitHint) -> Option<Grant> {
        (**self).handed(req, hint).await
    }
    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        (**self).inspect(name).await
    }
    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        (**self).list(prefix, cursor, page).await
    }
    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        (**self).evict(name, mode, eviction).await
    }
    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        (**self).changes(prefix).await
    }
    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        (**self).put_record(req, key, value, keep).await
    }
    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        (**self).get_record(name, key).await
    }
    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        (**self).keep(req, hold).await
    }
    async fn abandon(&self, req: &Request) -> Result<()> {
        (**self).abandon(req).await
    }
    async fn session_liveness(&self) -> Option<SessionLiveness> {
        (**self).session_liveness().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_origin(Duration::from_millis(ms))
    }

    #[test]
    fn a_session_publishes_the_servers_view_of_its_keep_alives_forward_only() {
        let keeper = SessionKeeper::new(at(990));
        let liveness = keeper.liveness();
        assert_eq!(liveness.server_view(), None);
        keeper.kept_alive(at(1_290), ServerView::new(at(300), Duration::from_secs(1)));
        assert_eq!(liveness.current(), Liveness::Alive { until: at(1_290) });
        let view = liveness.server_view().unwrap();
        assert_eq!((view.heard, view.until()), (at(300), at(1_300)));
        // An older keep-alive's answer, arriving late, moves neither back.
        keeper.kept_alive(at(1_190), ServerView::new(at(200), Duration::from_secs(1)));
        assert_eq!(liveness.current(), Liveness::Alive { until: at(1_290) });
        assert_eq!(liveness.server_view().unwrap().heard, at(300));
        // A deadline moved without a view keeps the last view; an ended session keeps it.
        keeper.alive_until(at(1_400));
        assert_eq!(liveness.server_view().unwrap().heard, at(300));
        keeper.end();
        keeper.kept_alive(
            at(2_000),
            ServerView::new(at(1_000), Duration::from_secs(1)),
        );
        assert_eq!(liveness.current(), Liveness::Ended);
        assert_eq!(liveness.server_view().unwrap().heard, at(300));
    }
}
