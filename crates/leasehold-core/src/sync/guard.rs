use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{MAX_RECORD_LEN, Mode, Release};
use crate::clock::Instant;
use crate::error::{Error, LossReason, Result};
use crate::fencing::FencingToken;
use crate::lease::{Lease, State};
use crate::name::{LockName, OwnerId, RecordKey};

/// Proof of holding a lock (or a read lock, a permit, a leadership).
/// It carries its fencing token, its remaining validity and its loss signal.
///
/// The guard is owned — `'static`, `Send`, movable across tasks — and ownership is the
/// guard, never a thread. While it exists a watchdog renews its lease (on backends whose
/// leases expire); the moment the lease can no longer be trusted, [`lost`](Guard::lost)
/// completes.
///
/// Release it with [`release`](Guard::release) to learn the outcome. Dropping it also
/// releases, without waiting for the server: dropped on a thread of its runtime, the
/// release request is sent by the drop itself where the backend can send without waiting
/// (so on a backend that answers one connection or session in order — ZooKeeper, Redis —
/// this client's later requests there find it done); its answer is awaited in the
/// background, and errors are only logged ([`Client::settle`](crate::Client::settle) waits
/// for such releases).
#[must_use = "dropping a guard releases its lock at once (in the background)"]
pub struct Guard {
    lease: Arc<Lease>,
    released: bool,
}

/// The guard of a [`Mutex`](crate::Mutex).
pub type MutexGuard = Guard;
/// The guard of a read lock of an [`RwLock`](crate::RwLock).
pub type ReadGuard = Guard;
/// The guard of a write lock of an [`RwLock`](crate::RwLock).
pub type WriteGuard = Guard;
/// One permit of a [`Semaphore`](crate::Semaphore).
pub type Permit = Guard;

impl Guard {
    pub(crate) fn new(lease: Arc<Lease>) -> Self {
        Self {
            lease,
            released: false,
        }
    }

    pub(crate) fn lease(&self) -> &Arc<Lease> {
        &self.lease
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.lease.request.name
    }

    /// The fencing token of this grant.
    /// Pass it with every write to the protected resource, which must refuse tokens lower
    /// than the highest it has seen.
    pub fn token(&self) -> FencingToken {
        self.lease.token
    }

    /// How the lock is held.
    pub fn mode(&self) -> Mode {
        self.lease.request.mode
    }

    /// The owner id the server records for this grant.
    pub fn owner(&self) -> &OwnerId {
        &self.lease.request.owner
    }

    /// Whether the lease is still valid by the local deadline. `false` once lost.
    pub fn is_held(&self) -> bool {
        self.lease.is_held()
    }

    /// Whether the lock is held but in jeopardy.
    /// The backend's session lost its link to the server (a ZooKeeper disconnect). The
    /// guard stays held until its deadline ([`remaining`](Guard::remaining)) and is lost
    /// then — with [`LossReason::Disconnected`] — unless the link comes back first; work
    /// that cannot be undone is better not started while suspended. Always `false` on
    /// backends without sessions, and once lost.
    pub fn is_suspended(&self) -> bool {
        self.lease.is_suspended()
    }

    /// Time left until the local deadline (renewals move it).
    /// `Duration::MAX` on backends whose grants do not expire; zero once lost.
    pub fn remaining(&self) -> Duration {
        self.lease.remaining()
    }

    /// The local deadline, on the client's [`Clock`](crate::clock::Clock).
    /// The lock counts as held until then, unless a renewal (or the keep-alive of the
    /// session the grant lives by) moves it. `Ok(None)` for a grant that does not expire.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] once the lease was lost.
    pub fn deadline(&self) -> Result<Option<Instant>> {
        held(self.lease.state())
    }

    /// Completes when [`deadline`](Guard::deadline) no longer answers `Ok(seen)`.
    /// A renewal or a session keep-alive moved the deadline, or the lease was lost. A
    /// deadline that passes unrenewed is [`lost`](Guard::lost)'s to report; this future
    /// notices it only if polled after it.
    ///
    /// The future owns what it needs; it can be moved into another task.
    ///
    /// # Cancel safety
    ///
    /// It only reads: dropping it changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] if the lease was lost.
    pub fn deadline_changed(
        &self,
        seen: Option<Instant>,
    ) -> impl Future<Output = Result<Option<Instant>>> + Send + 'static {
        let changed = self.lease.changed_from(seen);
        async move { held(changed.await) }
    }

    /// Completes when the lease is lost.
    /// That is at its local deadline without a renewal, or as soon as the server says it is
    /// no longer ours. Never completes while the lease is held, nor after a release.
    ///
    /// The future owns what it needs; it can be moved into another task.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        self.lease.lost()
    }

    /// How many reentrant holds share this grant (see [`Owner`](crate::Owner)).
    pub fn hold_count(&self) -> usize {
        self.lease.holds()
    }

    /// Runs `work` while the lock is held.
    /// If the lease is lost first, `work` is dropped (cancelled at its next await point)
    /// and [`Error::Lost`] is returned.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops `work`; the guard keeps the lock.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] if the lease was lost before `work` completed (or before it started).
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output> {
        if let State::Lost(reason) = self.lease.state() {
            return Err(Error::Lost(reason));
        }
        let lost = self.lost();
        tokio::select! {
            biased;
            reason = lost => Err(Error::Lost(reason)),
            output = work => Ok(output),
        }
    }

    /// Releases the lock and says how it went.
    /// Of reentrant holds, only the last one releases on the server.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the lease ends (renewals stop) before the request is sent, and a
    /// release that was not confirmed by the server — the future was dropped, or the
    /// server did not answer — goes on in the background, retried with backoff until the
    /// server confirms it or the grant's lease (or session) has surely ended there; on a
    /// backend whose grants live by a session, it is retried through a suspension of the
    /// session (a short outage), and a grant whose release cannot be confirmed while the
    /// session is healthy is abandoned (see [`Backend::abandon`](crate::Backend::abandon))
    /// rather than left alive under the session.
    /// [`Client::settle`](crate::Client::settle) waits for all of that.
    ///
    /// # Errors
    ///
    /// - [`Error::Lost`] if the lease had been lost: the work done under it may have
    ///   overlapped another holder's (the release is still attempted, owner-checked).
    /// - [`Error::NotHeld`] if the server had no grant for this owner (it lost it without
    ///   the holder noticing). After an attempt that went unanswered (a timeout, an
    ///   unreachable server: it may be what released the grant), a later "not held"
    ///   counts as released.
    /// - Backend errors, once retrying them for about one request timeout has not helped;
    ///   the release then goes on in the background.
    pub async fn release(mut self) -> Result<()> {
        self.released = true;
        let lease = &self.lease;
        if !lease.drop_hold() {
            return match lease.state() {
                State::Lost(reason) => Err(Error::Lost(reason)),
                _ => Ok(()),
            };
        }
        let ended = lease.finish();
        let answer = lease
            .pending_release()
            .run(lease.options.request_timeout())
            .await;
        match (ended, answer) {
            (State::Lost(reason), _) => Err(Error::Lost(reason)),
            (_, Ok(Release::Released)) => Ok(()),
            (_, Ok(Release::NotHeld)) => Err(Error::NotHeld),
            (_, Err(error)) => Err(error),
        }
    }
}

impl Guard {
    /// Writes a record beside the lock, fenced by this grant.
    /// The server writes it only if the grant is still held there, in the same atomic step
    /// (see [`Backend::put_record`](crate::Backend::put_record)); it keeps it at least
    /// `keep`. `Ok(false)`: the grant was gone on the server, nothing was written.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the record written or not; writing it again is
    /// harmless.
    ///
    /// # Errors
    ///
    /// - [`Error::Lost`] if the lease is lost here (nothing is sent).
    /// - [`Error::InvalidArgument`] for a value over
    ///   [`MAX_RECORD_LEN`](crate::backend::MAX_RECORD_LEN) bytes.
    /// - [`Error::Unsupported`] where the backend keeps no records; backend errors.
    pub async fn put_record(&self, key: &RecordKey, value: &[u8], keep: Duration) -> Result<bool> {
        if value.len() > MAX_RECORD_LEN {
            return Err(Error::invalid(
                "record",
                format!("{} bytes; the limit is {MAX_RECORD_LEN}", value.len()),
            ));
        }
        held(self.lease.state())?;
        let lease = &self.lease;
        let write = lease
            .ctx
            .backend
            .put_record(&lease.request, key, value, keep);
        lease.ctx.call(lease.options.request_timeout(), write).await
    }

    /// Lets go of the lock but leaves it held on the server for `hold` more.
    /// Nobody can take it until then, even if this process exits: a lock held *at least*
    /// that long (ShedLock's `lockAtLeastFor`). The grant is neither renewed nor released
    /// after this; the server ends it `hold` after it applied the request, by its clock
    /// (see [`Backend::keep`](crate::Backend::keep)). A zero `hold` releases. Of reentrant
    /// holds, only the last one acts.
    ///
    /// # Cancel safety
    ///
    /// Renewals stop before the request is sent. Dropped before the answer, the lock is
    /// released in the background, as a dropped guard's is (whether the hold was applied
    /// or not).
    ///
    /// # Errors
    ///
    /// - [`Error::Lost`] if the lease had been lost; [`Error::NotHeld`] if the server had
    ///   no grant for this owner.
    /// - [`Error::Unsupported`] where grants cannot be kept
    ///   ([`Capabilities::can_keep`](crate::Capabilities::can_keep)); the lock is released
    ///   instead, before this returns (a failed release is left to the background).
    /// - Backend errors: whether the hold was applied is unknown. A grant that expires ends
    ///   at the end of its last lease or `hold` after the request, whichever the server
    ///   applied; one that lives by a session is released.
    pub async fn keep_for(mut self, hold: Duration) -> Result<()> {
        if hold.is_zero() {
            return self.release().await;
        }
        self.released = true;
        let lease = &self.lease;
        if !lease.drop_hold() {
            return match lease.state() {
                State::Lost(reason) => Err(Error::Lost(reason)),
                _ => Ok(()),
            };
        }
        let ended = lease.finish();
        // Armed until the server answers: dropped, it releases by owner.
        let mut pending = lease.pending_release();
        if let State::Lost(reason) = ended {
            return Err(Error::Lost(reason));
        }
        pending.sent(lease.ctx.clock.now(), hold);
        // Which grant is kept, for `inspect` to say; fenced like any record, kept as long.
        // Only a label: a backend that keeps no records, or a failed write, keeps the grant
        // all the same.
        if lease.ctx.capabilities.can_keep() {
            let owner = lease.request.owner.as_str().as_bytes();
            let label = (lease.ctx.backend).put_record(&lease.request, kept_record(), owner, hold);
            let _ = lease.ctx.call(lease.options.request_timeout(), label).await;
        }
        let keep = lease.ctx.backend.keep(&lease.request, hold);
        let kept = lease.ctx.call(lease.options.request_timeout(), keep).await;
        if let Err(error @ Error::Unsupported { .. }) = kept {
            // Released before this returns: the caller finds the lock free once it learns
            // that it was not kept.
            let _ = pending.run(lease.options.request_timeout()).await;
            return Err(error);
        }
        let release = match &kept {
            Err(_) => lease.session.is_some(),
            Ok(_) => false,
        };
        if !release {
            pending.disarm();
        }
        match kept {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::NotHeld),
            Err(error) => Err(error),
        }
    }
}

/// The key of the record naming the owner whose grant of a name is kept.
pub(crate) fn kept_record() -> &'static RecordKey {
    static KEY: std::sync::OnceLock<RecordKey> = std::sync::OnceLock::new();
    KEY.get_or_init(|| RecordKey::new("kept").expect("a valid record key"))
}

/// The deadline of a held lease, or why it is not held.
fn held(state: State) -> Result<Option<Instant>> {
    match state {
        State::Held { deadline, .. } => Ok(deadline),
        State::Lost(reason) => Err(Error::Lost(reason)),
        State::Released => Err(Error::NotHeld),
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.released || !self.lease.drop_hold() {
            return;
        }
        self.lease.finish();
        // Dropped armed: the release is sent now and finished in the background.
        drop(self.lease.pending_release());
    }
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("name", self.name())
            .field("mode", &self.mode())
            .field("token", &self.token())
            .field("owner", self.owner())
            .field("held", &self.is_held())
            .finish()
    }
}
