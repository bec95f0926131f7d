//! The [`Backend`] implementation: etcd requests, and what their answers mean.
//! Acquire, renew, release, wait, inspect, list, changes, records, keep and abandon.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroU32;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::join_all;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Changes, Eviction, Expiry, Grant, Holder, ListCursor, Listing,
    LockState, Mode, Release, Renewal, Request, SessionLiveness, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::clock::{Clock, SystemClock};
use leasehold_core::support::evictions;
use leasehold_core::support::queue::{blocker, holding};
use leasehold_core::{Error, LockName, LossReason, NamePrefix, OwnerId, RecordKey, Result};

use crate::changes;
use crate::connection::EtcdBackend;
use crate::error::map_error;
use crate::layout::MARKER;
use crate::registry::Placed;
use crate::reply::{Entry, decode, encode, queue_of, ranges, token};
use crate::requests::{self, AcquireShape, EvictionWrites, Fence};
use crate::rpc::{
    FilterType, OpAnswer, RangeRequest, RangeResponse, ResponseOp, WatchCreateRequest,
};
use crate::session::{Session, grant_unkept};

/// What a busy request hands to `wait`: what to watch, and what it looked like when read.
#[derive(Debug)]
struct Hint {
    /// The key to watch, or (with `prefix`) the prefixes.
    keys: Vec<Vec<u8>>,
    /// Watch every key under each of `keys`.
    prefix: bool,
    /// Only deletions matter (a queued entry: nothing put later gets ahead of it).
    deletes_only: bool,
    /// The watched key's create revision, for a single key.
    created: Option<i64>,
    /// The revision after the read: a change at or after it may matter.
    from: i64,
}

impl Hint {
    /// Deletions of the one key `key`, created at `created`.
    fn deletion_of(key: Vec<u8>, created: i64, from: i64) -> Self {
        Self {
            keys: vec![key],
            prefix: false,
            deletes_only: true,
            created: Some(created),
            from,
        }
    }

    /// Deletions of any key under `dir`.
    fn deletions_under(dir: &str, from: i64) -> Self {
        Self {
            keys: vec![dir.as_bytes().to_vec()],
            prefix: true,
            deletes_only: true,
            created: None,
            from,
        }
    }
}

/// What one acquire request came to.
enum Step {
    Done(Acquire),
    /// Nothing was written: the session's fence moved or its lease is gone; ask again.
    Again,
}

/// How often an acquire is sent again because the session's fence moved meanwhile.
/// Only an acquisition that gave up after an unanswered put moves it.
const ATTEMPTS: usize = 4;

/// How many names one transaction reads whole, two queue reads each.
/// etcd allows 128 operations in a transaction by default (`--max-txn-ops`).
const NAMES_PER_READ: usize = 64;

/// The queues of one name, oldest first: the lock set's, then the permit set's.
type Queues = [Vec<Entry>; 2];

/// How long after a read found a kept key still there its slot is looked at again.
const KEPT_RECHECK: Duration = Duration::from_secs(1);

/// How much longer than the holder's session an eviction's marker lease is asked for.
/// It covers the time until the transaction is answered, should the renewal after it fail.
const MARKER_MARGIN: Duration = Duration::from_secs(2);

impl EtcdBackend {
    /// Whether what `hint` watches may have changed from its read to a watch at `now`.
    /// The watch, created at revision `now`, is in place: a single key is looked up (gone
    /// or created again); a range counts as changed if anything was written since the read.
    async fn moved(&self, hint: &Hint, now: i64) -> Result<bool> {
        let (Some(created), Some(key)) = (hint.created, hint.keys.first()) else {
            return Ok(now >= hint.from);
        };
        let read = RangeRequest {
            keys_only: true,
            ..requests::get(key.clone())
        };
        let now = self
            .rpc()
            .range(read)
            .await
            .map_err(|e| map_error(e, "watching"))?;
        Ok(now
            .kvs
            .first()
            .is_none_or(|kv| kv.create_revision != created))
    }

    /// Whether the fence `read` shows is the one `session` put under.
    /// If it moved, notes where it is; if it is gone, the session's lease is gone on the
    /// server and the session ends here too.
    fn fence_held(&self, session: &Session, read: &RangeResponse) -> bool {
        match read.kvs.first() {
            Some(kv) if kv.mod_revision == session.fence() => true,
            Some(kv) => {
                session.saw_fence(kv.mod_revision);
                false
            }
            None => {
                tracing::warn!(lease = session.id, "etcd: the session's lease is gone");
                session.end();
                false
            }
        }
    }

    /// One acquire request (see [`requests::acquire`] for its shapes and answers).
    async fn acquire_once(&self, req: &Request) -> Result<Step> {
        let session = self.session().await?;
        self.check_kept(&session).await;
        let set = self.set(&req.name, req.mode);
        let placed = self.registry().place(&req.owner, &set, session.id);
        if placed.lease != session.id {
            self.registry().forget(&req.owner);
            if placed.revision.is_some() {
                // Queued under a session that has ended: the key went with it.
                return Err(Error::Lost(LossReason::SessionEnded));
            }
            // Never seen under the session that ended; a put of it still in flight can
            // land only while that lease lives, which nobody keeps alive any more.
            return Ok(Step::Again);
        }
        let shape = if placed.revision.is_some() {
            AcquireShape::Woken
        } else if !req.waiting && req.mode == Mode::Exclusive {
            AcquireShape::Try
        } else {
            AcquireShape::Join
        };
        let value = encode(req.mode, &req.owner, req.value.as_deref());
        let fence = Fence {
            key: &session.anchor,
            revision: session.fence(),
        };
        let txn = requests::acquire(shape, &placed, &value, fence);
        let puts = shape != AcquireShape::Woken;
        if puts {
            self.registry().put_sent(&req.owner);
        }
        let answer = self
            .rpc()
            .txn(txn)
            .await
            .map_err(|e| map_error(e, "acquiring"))?;
        let revision = answer.revision();
        if revision <= 0 {
            // The put stays unanswered: a retry adopts it, a give-up removes it by value.
            return Err(Error::backend(
                "etcd: an acquire was answered without its revision",
                true,
            ));
        }
        if puts {
            self.registry().put_answered(&req.owner);
        }
        let responses = answer.responses;
        match (shape, answer.succeeded) {
            (AcquireShape::Woken, false) => {
                // The key is gone: its lease expired (or someone deleted it) while we
                // waited.
                self.registry().forget(&req.owner);
                Err(Error::Lost(LossReason::SessionEnded))
            }
            // The queue was empty and the transaction's one write put the key: it holds,
            // and was created at the transaction's revision.
            (_, true) if puts => self.granted(&session, &placed, req, revision).await,
            (_, true) => {
                let [contenders, markers] = reads(&responses)?;
                self.settle(&session, &placed, req, contenders, markers, revision)
                    .await
            }
            (AcquireShape::Try, false) => {
                let [contenders, markers, fence] = reads(&responses)?;
                if !self.fence_held(&session, fence) {
                    self.registry().forget_if_unseen(&req.owner);
                    return Ok(Step::Again);
                }
                self.settle(&session, &placed, req, contenders, markers, revision)
                    .await
            }
            (_, false) => {
                let Some(ResponseOp {
                    response: Some(OpAnswer::ResponseTxn(joined)),
                }) = responses.first()
                else {
                    return Err(Error::backend(
                        "etcd: a queueing transaction was answered without its nested one",
                        false,
                    ));
                };
                let responses = &joined.responses;
                if joined.succeeded {
                    let [contenders, markers] = reads(responses)?;
                    return self
                        .settle(&session, &placed, req, contenders, markers, revision)
                        .await;
                }
                let [fence] = reads(responses)?;
                self.fence_held(&session, fence);
                self.registry().forget_if_unseen(&req.owner);
                Ok(Step::Again)
            }
        }
    }

    /// Frees the slots of this session's kept keys that are gone (see [`Registry::keep`]).
    /// A slot is due once its key's lease should have run out; each due key is read, and
    /// its slot freed if it is gone, else looked at again [`KEPT_RECHECK`] later. A read
    /// that fails leaves the slot taken, due at the next acquisition.
    ///
    /// [`Registry::keep`]: crate::registry::Registry::keep
    async fn check_kept(&self, session: &Session) {
        let due = self.registry().kept_due(session.id, SystemClock.now());
        for kept in due {
            let read = RangeRequest {
                keys_only: true,
                ..requests::get(kept.key())
            };
            match self.rpc().range(read).await {
                Ok(found) if found.kvs.is_empty() => self.registry().kept_gone(&kept),
                Ok(_) => {
                    let later = SystemClock.now().saturating_add(KEPT_RECHECK);
                    self.registry().kept_until(&kept, later);
                }
                Err(e) => tracing::debug!(key = kept.key(), "etcd: reading a kept key: {e}"),
            }
        }
    }

    /// The owner's key and the create revision it was granted with, if `req` holds.
    /// `None` if this client has no grant of `req`: no key, not granted yet, or a key in
    /// another name's or mode's queue.
    fn granted_key(&self, req: &Request) -> Option<(Placed, i64)> {
        let placed = self.registry().get(&req.owner)?;
        let revision = placed.revision.filter(|_| placed.granted)?;
        (placed.set == self.set(&req.name, req.mode)).then_some((placed, revision))
    }

    /// Revokes `lease`, which no key needs, best-effort: it runs out by itself otherwise.
    async fn drop_lease(&self, lease: i64) {
        if let Err(e) = self.rpc().lease_revoke(lease).await {
            tracing::debug!(lease, "etcd: revoking an unused lease: {e}");
        }
    }

    /// What a queue read means for `placed`: a grant, a place to wait from, or busy.
    /// The read, at `revision`, gave `contenders` (with `markers`).
    async fn settle(
        &self,
        session: &Session,
        placed: &Placed,
        req: &Request,
        contenders: &RangeResponse,
        markers: &RangeResponse,
        revision: i64,
    ) -> Result<Step> {
        let dir = &placed.set.dir;
        let (queue, closed_by) = queue_of(dir, contenders, markers);
        let from = revision + 1;
        let Some(me) = queue
            .iter()
            .position(|e| !e.foreign && e.owner == req.owner)
        else {
            // A try that found the queue occupied: nothing was written.
            self.registry().forget_if_unseen(&req.owner);
            return Ok(Step::Done(Acquire::Busy(WaitHint::new(
                Hint::deletions_under(dir, from),
            ))));
        };
        let mine = &queue[me];
        // From now on a release removes it, whatever happens here.
        self.registry().record(&req.owner, mine.revision);
        if mine.lease != session.id || mine.key != placed.key().as_bytes() {
            return Err(Error::backend(
                format!(
                    "etcd: the key of {} is not where this session put it",
                    req.name
                ),
                false,
            ));
        }
        let granted = holding(&queue)[me];
        if granted && closed_by.is_none() {
            return self.granted(session, placed, req, mine.revision).await;
        }
        if !req.waiting {
            // Not granted and not waiting: take the key out of the queue again.
            self.remove(req, "withdrawing").await?;
            return Ok(Step::Done(Acquire::Busy(WaitHint::none())));
        }
        let hint = match (blocker(&queue, me).map(|i| &queue[i]), closed_by) {
            // First in line, but a vanished holder's lock-delay is not over.
            (_, Some((marker, created))) if granted => Hint::deletion_of(marker, created, from),
            (Some(before), _) => Hint::deletion_of(before.key.clone(), before.revision, from),
            (None, _) => Hint::deletions_under(dir, from),
        };
        Ok(Step::Done(Acquire::Busy(WaitHint::new(hint))))
    }

    /// Removes and forgets the owner's key if it is still the one this acquisition wrote.
    /// Its lock-delay marker goes with it, if the request has a lock-delay. Returns whether
    /// a key was removed. An acquisition with a put that was never answered also moves its
    /// session's fence in the same transaction (see
    /// [`Layout::anchor`](crate::layout::Layout::anchor)).
    async fn remove(&self, req: &Request, doing: &str) -> Result<Release> {
        // Its own deletion is no news to the grant.
        self.inner.grants.unwatch(&req.owner);
        let Some(placed) = self.registry().get(&req.owner) else {
            return Ok(Release::NotHeld);
        };
        let bump = placed.unanswered_puts > 0;
        if placed.revision.is_none() && !bump {
            // No put of it was ever applied.
            self.registry().forget(&req.owner);
            return Ok(Release::NotHeld);
        }
        let anchor = bump.then(|| self.inner.layout.anchor(placed.lease));
        let value = encode(req.mode, &req.owner, req.value.as_deref());
        let txn = requests::remove(&placed, &value, req.lock_delay.is_some(), anchor.as_deref());
        let answer = self.rpc().txn(txn).await.map_err(|e| map_error(e, doing))?;
        if bump
            && let Some(session) = self.current_session().await
            && session.id == placed.lease
        {
            // The fence moved at this transaction's revision (or is gone with the lease).
            session.saw_fence(answer.revision());
        }
        let removed = answer.succeeded
            && matches!(
                answer.responses.first().and_then(|r| r.response.as_ref()),
                Some(OpAnswer::ResponseDeleteRange(d)) if d.deleted > 0
            );
        self.registry().forget(&req.owner);
        Ok(if removed {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    /// Records the grant of `placed`, whose key holds at create revision `revision`.
    /// Its lock-delay marker is put before the grant is returned, if the request has a
    /// lock-delay.
    async fn granted(
        &self,
        session: &Session,
        placed: &Placed,
        req: &Request,
        revision: i64,
    ) -> Result<Step> {
        self.registry().grant(&req.owner, revision);
        let token = token(revision)?;
        if let Some(delay) = req.lock_delay {
            self.put_marker(session, placed, &req.owner, revision, delay)
                .await?;
        }
        // Its deletion by anyone but its release is pushed to the grant (see `grants.rs`).
        let liveness = self.inner.grants.watch(
            &req.owner,
            &req.name,
            placed.key(),
            revision,
            session.liveness(),
        );
        Ok(Step::Done(Acquire::Granted(Grant::new(
            token,
            Expiry::Session(liveness),
        ))))
    }

    /// Puts the lock-delay marker of a grant, if its key is still the one granted.
    /// The grant is reported only after this, so no holder ever works without its marker.
    async fn put_marker(
        &self,
        session: &Session,
        placed: &Placed,
        owner: &OwnerId,
        revision: i64,
        delay: Duration,
    ) -> Result<()> {
        let lease = session.delay_lease(&self.inner.rpc, delay).await?;
        let answer = self
            .rpc()
            .txn(requests::put_marker(
                placed,
                owner.as_str(),
                revision,
                lease,
            ))
            .await
            .map_err(|e| map_error(e, "marking a grant for lock-delay"))?;
        if answer.succeeded {
            Ok(())
        } else {
            // The key is gone: the session's lease ran out since the grant.
            self.registry().forget(owner);
            Err(Error::Lost(LossReason::SessionEnded))
        }
    }

    /// The contender directories of `name`: the lock set's, then the permit set's.
    fn dirs(&self, name: &LockName) -> [String; 2] {
        let limit = NonZeroU32::MIN;
        [Mode::Exclusive, Mode::Permit { limit }].map(|mode| self.set(name, mode).dir)
    }

    /// Holders (lock set first) and waiters of a name whose queues are `queues`.
    /// `left` keeps the time left on each lease looked up, for the next name.
    async fn state_of(
        &self,
        queues: Queues,
        left: &mut HashMap<i64, Option<Duration>>,
    ) -> Result<LockState> {
        let mut state = LockState::default();
        for mut queue in queues {
            queue.sort_by_key(|entry| entry.revision);
            for (entry, holds) in queue.iter().zip(holding(&queue)) {
                if !holds {
                    state
                        .waiters
                        .push(Waiter::new(entry.owner.clone(), entry.mode));
                    continue;
                }
                let remaining = match left.get(&entry.lease) {
                    Some(remaining) => *remaining,
                    None => {
                        let remaining = self.time_left(entry.lease).await?;
                        left.insert(entry.lease, remaining);
                        remaining
                    }
                };
                // etcd keeps no grant time, and the key's value records none: `held` is
                // unknown.
                state.holders.push(
                    Holder::new(entry.owner.clone(), entry.mode, token(entry.revision)?)
                        .with_remaining(remaining)
                        .with_value(entry.value.clone()),
                );
            }
        }
        Ok(state)
    }

    /// The states of `names`, each read whole: both queues of a name in one transaction.
    async fn read_whole(
        &self,
        names: &[LockName],
        left: &mut HashMap<i64, Option<Duration>>,
    ) -> Result<Vec<(LockName, LockState)>> {
        let mut states = Vec::with_capacity(names.len());
        for chunk in names.chunks(NAMES_PER_READ) {
            let dirs: Vec<[String; 2]> = chunk.iter().map(|name| self.dirs(name)).collect();
            let answer = self
                .rpc()
                .txn(requests::read_all(dirs.concat().as_slice()))
                .await
                .map_err(|e| map_error(e, "listing"))?;
            let reads = ranges(&answer.responses);
            if reads.len() != 2 * chunk.len() {
                return Err(Error::backend(
                    format!(
                        "etcd: a transaction of {} reads was answered with {}",
                        2 * chunk.len(),
                        reads.len()
                    ),
                    false,
                ));
            }
            for ((name, dirs), reads) in chunk.iter().zip(&dirs).zip(reads.chunks(2)) {
                let queues = [0, 1].map(|set| {
                    let dir = &dirs[set];
                    reads[set].kvs.iter().map(|kv| decode(dir, kv)).collect()
                });
                states.push((name.clone(), self.state_of(queues, left).await?));
            }
        }
        Ok(states)
    }

    /// Adds each lock's latest evictions to its state.
    /// They are read in one transaction per [`NAMES_PER_READ`] locks.
    async fn read_evictions(&self, locks: &mut [(LockName, LockState)]) -> Result<()> {
        let layout = &self.inner.layout;
        for chunk in locks.chunks_mut(NAMES_PER_READ) {
            let reads = chunk.iter().map(|(name, _)| {
                requests::evictions(&layout.evictions(name), evictions::KEPT).into()
            });
            let answer = self
                .rpc()
                .txn(requests::read_ops(reads))
                .await
                .map_err(|e| map_error(e, "listing"))?;
            let records = ranges(&answer.responses);
            if records.len() != chunk.len() {
                return Err(Error::backend(
                    format!(
                        "etcd: a transaction of {} reads was answered with {}",
                        chunk.len(),
                        records.len()
                    ),
                    false,
                ));
            }
            for ((_, state), records) in chunk.iter_mut().zip(records) {
                state.evictions =
                    evictions::decode_all(records.kvs.iter().map(|kv| kv.value.as_slice()));
            }
        }
        Ok(())
    }

    /// The time left on each of `leases`, asked at once (see [`time_left`](Self::time_left)).
    async fn times_left(
        &self,
        leases: impl IntoIterator<Item = i64>,
    ) -> Result<HashMap<i64, Option<Duration>>> {
        let leases: HashSet<i64> = leases.into_iter().collect();
        let answers = join_all(leases.iter().map(|lease| self.time_left(*lease))).await;
        leases
            .into_iter()
            .zip(answers)
            .map(|(lease, left)| left.map(|left| (lease, left)))
            .collect()
    }

    /// The ttl etcd granted `lease` (zero for a key without a lease, or a lease gone).
    async fn granted_ttl(&self, lease: i64) -> Result<Duration> {
        if lease == 0 {
            return Ok(Duration::ZERO);
        }
        let answer = self
            .rpc()
            .lease_time_to_live(lease)
            .await
            .map_err(|e| map_error(e, "inspecting a lease"))?;
        Ok(Duration::from_secs(
            u64::try_from(answer.granted_ttl).unwrap_or(0),
        ))
    }

    /// Whether `lease` is a session's: one with the session's fence key on it.
    /// A kept grant's hold lease has none (see [`Layout::anchor`](crate::layout::Layout::anchor)).
    async fn is_session_lease(&self, lease: i64) -> Result<bool> {
        if lease == 0 {
            return Ok(false);
        }
        let read = RangeRequest {
            count_only: true,
            ..requests::get(self.inner.layout.anchor(lease))
        };
        let found = self
            .rpc()
            .range(read)
            .await
            .map_err(|e| map_error(e, "reading a session's fence"))?;
        Ok(found.count > 0)
    }

    /// Renews `lease` once: its full ttl counts from now.
    /// Best effort, within [`MARKER_MARGIN`]; a lease not renewed keeps its first term.
    async fn renew_once(&self, lease: i64) {
        let renewed = tokio::time::timeout(MARKER_MARGIN, async {
            let (_sender, mut answers) = self.rpc().lease_keep_alive(lease).await?;
            answers.message().await
        })
        .await;
        match renewed {
            Ok(Ok(Some(answer))) if answer.ttl > 0 => {}
            Ok(Ok(_)) => tracing::warn!(lease, "etcd: an eviction's marker lease is gone"),
            Ok(Err(e)) => tracing::warn!(lease, "etcd: renewing an eviction's marker: {e}"),
            Err(_) => tracing::warn!(lease, "etcd: an eviction's marker not renewed in time"),
        }
    }

    /// Whether the record of `eviction`'s token names `eviction` itself: it was applied.
    async fn evicted_by(&self, name: &LockName, eviction: &Eviction) -> Result<bool> {
        let Ok(revision) = i64::try_from(eviction.token.get()) else {
            return Ok(false);
        };
        let read = requests::get(self.inner.layout.eviction(name, revision));
        let found = self
            .rpc()
            .range(read)
            .await
            .map_err(|e| map_error(e, "reading an eviction record"))?;
        Ok((found.kvs.first())
            .and_then(|kv| evictions::decode(&kv.value))
            .is_some_and(|recorded| recorded == *eviction))
    }

    /// The time left on `lease` as etcd says: `None` for a key without a lease.
    async fn time_left(&self, lease: i64) -> Result<Option<Duration>> {
        if lease == 0 {
            return Ok(None);
        }
        let answer = self
            .rpc()
            .lease_time_to_live(lease)
            .await
            .map_err(|e| map_error(e, "inspecting a lease"))?;
        match u64::try_from(answer.ttl) {
            Ok(left) => Ok(Some(Duration::from_secs(left))),
            // A lease that expired since the read: etcd answers -1.
            Err(_) if answer.ttl == -1 => Ok(Some(Duration::ZERO)),
            Err(_) => Err(Error::backend(
                format!("etcd: lease {lease:x} has {} s left", answer.ttl),
                false,
            )),
        }
    }
}

/// The `N` range reads of `responses`, in order.
///
/// # Errors
///
/// [`Error::Backend`] if the answer does not hold them.
fn reads<const N: usize>(responses: &[ResponseOp]) -> Result<[&RangeResponse; N]> {
    ranges(responses).try_into().map_err(|found: Vec<_>| {
        Error::backend(
            format!(
                "etcd: a transaction was answered with {} reads, not {N}",
                found.len()
            ),
            false,
        )
    })
}

/// A listing's cursor: the next key to read, in hex.
fn encode_cursor(key: &[u8]) -> ListCursor {
    ListCursor::new(key.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// The key a cursor made by [`encode_cursor`] names.
fn decode_cursor(cursor: &ListCursor) -> Option<Vec<u8>> {
    let hex = cursor.as_str().as_bytes();
    if !hex.len().is_multiple_of(2) || !hex.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    hex.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

#[async_trait]
impl Backend for EtcdBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("etcd", TokenDurability::Consensus);
        caps.expiring_leases = true;
        caps.ttl_granularity = Duration::from_secs(1);
        caps.fair = true;
        caps.push_wakeups = true;
        caps.shared = true;
        caps.permits = true;
        // What etcd grants: whole seconds, rounded up (a session that etcd would grant a
        // longer ttl is refused, see `Session::start`).
        caps.session_ttl = Some(self.inner.options.granted_ttl());
        // Markers bound to a lease that outlives the session's by the delay.
        caps.lock_delay = true;
        // `keep` moves a grant off the session onto a lease of its own.
        caps.keeps_session_grants = true;
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        for _ in 0..ATTEMPTS {
            if let Step::Done(answer) = self.acquire_once(req).await? {
                return Ok(answer);
            }
        }
        Err(Error::backend(
            "etcd: the session's fence kept moving while acquiring",
            true,
        ))
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        // Grants live by the session; this only says whether the key is still ours.
        let Some(placed) = self.registry().get(&req.owner) else {
            return Ok(Renewal::Lost(LossReason::NotOwner));
        };
        let found = self
            .rpc()
            .range(requests::get(placed.key()))
            .await
            .map_err(|e| map_error(e, "checking a key"))?;
        let session = self.current_session().await;
        match (found.kvs.first(), session) {
            (Some(kv), Some(session))
                if kv.lease == session.id
                    && session.is_alive()
                    && placed.revision == Some(kv.create_revision) =>
            {
                Ok(Renewal::Renewed(Expiry::Session(session.liveness())))
            }
            _ => Ok(Renewal::Lost(LossReason::NotOwner)),
        }
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        self.remove(req, "releasing").await
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(hint) = hint.get::<Hint>() else {
            return Ok(());
        };
        if hint.keys.is_empty() {
            return Ok(());
        }
        // The watch starts at the current revision, not at `hint.from`: etcd serves a watch
        // that starts in the past from a catch-up loop that runs every 100 ms, one that
        // starts now at once. What changed before the watch was in place is looked up once
        // it is: etcd fixes a new watch's start revision before it registers it, and a
        // write in between also leaves it to the catch-up loop.
        let watches = hint
            .keys
            .iter()
            .map(|key| WatchCreateRequest {
                key: key.clone(),
                range_end: if hint.prefix {
                    requests::prefix_end(key)
                } else {
                    Vec::new()
                },
                filters: if hint.deletes_only {
                    vec![FilterType::Noput.into()]
                } else {
                    Vec::new()
                },
                ..WatchCreateRequest::default()
            })
            .collect();
        let watched = async {
            let mut stream = self
                .rpc()
                .watch(watches)
                .await
                .map_err(|e| map_error(e, "watching"))?;
            loop {
                match stream
                    .answers
                    .message()
                    .await
                    .map_err(|e| map_error(e, "watching"))?
                {
                    Some(answer) if answer.created => {
                        let now = answer.header.map_or(i64::MAX, |h| h.revision);
                        if self.moved(hint, now).await? {
                            return Ok(());
                        }
                    }
                    Some(answer) if !answer.events.is_empty() || answer.canceled => {
                        return Ok(());
                    }
                    Some(_) => {}
                    None => return Ok(()),
                }
            }
        };
        match tokio::time::timeout(max, watched).await {
            Ok(result) => result,
            Err(_) => Ok(()),
        }
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let dirs = self.dirs(name);
        let mut read = requests::read_all(&dirs);
        let evicted = self.inner.layout.evictions(name);
        read.success
            .push(requests::evictions(&evicted, evictions::KEPT).into());
        let answer = self
            .rpc()
            .txn(read)
            .await
            .map_err(|e| map_error(e, "inspecting"))?;
        let revision = answer.revision();
        let [lock_set, permit_set, records]: [&RangeResponse; 3] = reads(&answer.responses)?;
        let sets = [lock_set, permit_set];
        let queues = [0, 1].map(|set| {
            let dir = &dirs[set];
            sets[set].kvs.iter().map(|kv| decode(dir, kv)).collect()
        });
        let mut state = self.state_of(queues, &mut HashMap::new()).await?;
        state.evictions = evictions::decode_all(records.kvs.iter().map(|kv| kv.value.as_slice()));
        state.hint = WaitHint::new(Hint {
            keys: self
                .inner
                .layout
                .all_of(name)
                .map(String::into_bytes)
                .into(),
            prefix: true,
            deletes_only: false,
            created: None,
            from: revision + 1,
        });
        Ok(state)
    }

    /// One page of the locks under `prefix`: a read of at most `page` keys from the cursor.
    ///
    /// The keys under the prefix are read in key order from the cursor, lock-delay markers
    /// and foreign keys counted, and grouped by name. A name's keys need not be next to
    /// each other (`a#permits/…` and `a/…` have those of `a.b` and `a-c` between them), so
    /// a name is listed on the page that reads past its last key: from the page's keys if
    /// they are all on it, else read whole (both queues) in one more transaction, which
    /// happens only for names that began before the cursor — the cursor names them. No name
    /// is listed twice or with part of its keys; one with more keys than `page` is listed
    /// by the page that gets past it. Each holder's lease is asked once a page for its time
    /// left. `held` is `None`: etcd keeps no grant time. The cursor is the next key to
    /// read, in hex.
    ///
    /// # Cancel safety
    ///
    /// Read-only; dropping the future changes nothing on the server.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a cursor that is not one of this listing's; backend
    /// errors.
    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        let layout = &self.inner.layout;
        let (start, end) = layout.names_range(prefix);
        let from = match cursor {
            None => start,
            Some(cursor) => decode_cursor(cursor)
                .filter(|key| !key.is_empty() && key.starts_with(&layout.names_start(prefix)))
                .ok_or_else(|| {
                    Error::invalid(
                        "list cursor",
                        format!(
                            "{:?} is no cursor of a listing of {prefix:?}",
                            cursor.as_str()
                        ),
                    )
                })?,
        };
        let read = self
            .rpc()
            .range(requests::page(from.clone(), end, page.max(1)))
            .await
            .map_err(|e| map_error(e, "listing"))?;
        // The last key read, if there are more after it.
        let last = read.kvs.last().filter(|_| read.more).map(|kv| &kv.key[..]);
        let ends_here = |name: &LockName| {
            prefix.matches(name) && last.is_none_or(|last| *layout.span(name).1 <= *last)
        };
        let mut whole: Vec<LockName> = layout.cut_at(&from);
        whole.retain(|name| ends_here(name) && layout.span(name).0 < from);
        let mut found: BTreeMap<LockName, Queues> = BTreeMap::new();
        for kv in &read.kvs {
            let Some((name, permit)) = layout.contender(&kv.key) else {
                continue;
            };
            // A name begun before the cursor is among those read whole.
            if !ends_here(&name) || layout.span(&name).0 < from {
                continue;
            }
            let dir = &self.dirs(&name)[usize::from(permit)];
            found.entry(name).or_default()[usize::from(permit)].push(decode(dir, kv));
        }
        // One lookup per session holding or queued on the page, all at once.
        let leases = found.values().flatten().flatten().map(|entry| entry.lease);
        let mut left = self.times_left(leases).await?;
        let mut locks = self.read_whole(&whole, &mut left).await?;
        for (name, queues) in found {
            locks.push((name, self.state_of(queues, &mut left).await?));
        }
        locks.retain(|(_, state)| !state.holders.is_empty() || !state.waiters.is_empty());
        locks.sort_by(|a, b| a.0.cmp(&b.0));
        self.read_evictions(&mut locks).await?;
        let next = last.map(|last| {
            let mut next = last.to_vec();
            next.push(0);
            encode_cursor(&next)
        });
        Ok(Listing::new(locks, next))
    }

    /// A feed of the locks under `prefix` that change: one etcd watch on their keys.
    ///
    /// The watch covers every key of every name under the prefix (contenders, permits,
    /// lock-delay markers; with no prefix, records too), from the revision at which etcd
    /// created it, which happens before this returns. Each event names the lock its key
    /// belongs to: a put is a waiter queued (or a grant into an empty queue), a delete a
    /// release, a withdrawal or a session lease that ran out on the server. A waiter that
    /// comes to hold writes nothing: the delete before it is its notice. A watch that
    /// breaks or that etcd cancels is watched again from the current revision, and the
    /// feed gets [`Change::Resync`](leasehold_core::Change::Resync) once it is in place.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, the watch stream is dropped with it and etcd cancels the
    /// watch. Dropping the feed does the same.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if no watch is created within the connect timeout; backend
    /// errors if etcd refuses the watch (permissions).
    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        changes::start(
            self.rpc().clone(),
            self.inner.layout.clone(),
            prefix.clone(),
            self.inner.options.connect_timeout,
        )
        .await
    }

    /// Force-releases the grant `eviction` names, in one transaction.
    ///
    /// The set's queue is read to find the grant: the owner's key in `mode`'s set, created
    /// at the token, holding. One transaction compares that key's create revision and
    /// deletes it, deletes the grant's own lock-delay marker (kept alive with the holder's
    /// session), puts a marker that closes the set, and puts the record under
    /// `#evictions/<name>/<token>`, kept a week (the last 10 of a name). The marker is bound
    /// to a lease of its own, granted last, of the holder's session ttl (or the lock-delay
    /// lease's, if longer) and `MARKER_MARGIN` more, and renewed once the transaction is
    /// answered (the margin covers a transaction answered within it whose renewal fails).
    /// So the marker ends no earlier than the transaction + the holder's session ttl: the
    /// holder's session deadline, counted from a keep-alive sent before the transaction,
    /// has passed before the set opens. A key not bound to a session (kept: on a hold
    /// lease) has no holder left to outlast, and gets a marker only for its lock-delay.
    /// The holder's client hears of the eviction by its watch of the key (see `grants.rs`)
    /// and finds the record. The next grant's key is created later: its token is greater.
    /// A grant that is gone, but whose record names this very eviction, was evicted by it
    /// (an attempt whose answer was lost): `true`.
    ///
    /// # Cancel safety
    ///
    /// The transaction is applied whole or not at all: dropped before its answer, the
    /// grant may be evicted or not, and evicting again answers whether it was. Leases
    /// granted for a transaction that never ran out by themselves; those of a transaction
    /// that was answered as not applied are revoked.
    ///
    /// # Errors
    ///
    /// Backend errors, after which the grant may be evicted or not.
    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        let set = self.set(name, mode);
        let layout = &self.inner.layout;
        let evicted_dir = layout.evictions(name);
        let mut read = requests::read_all(&[set.dir.clone(), set.markers.clone()]);
        read.success.push(
            RangeRequest {
                keys_only: true,
                ..requests::evictions(&evicted_dir, usize::MAX)
            }
            .into(),
        );
        let answer = self
            .rpc()
            .txn(read)
            .await
            .map_err(|e| map_error(e, "evicting"))?;
        let [contenders, markers, records]: [&RangeResponse; 3] = reads(&answer.responses)?;
        let (queue, _) = queue_of(&set.dir, contenders, markers);
        let token = eviction.token.get();
        let found = queue.iter().zip(holding(&queue)).find(|(entry, holds)| {
            *holds
                && !entry.foreign
                && entry.owner == eviction.owner
                && entry.mode == mode
                && u64::try_from(entry.revision).ok() == Some(token)
        });
        let Some((entry, _)) = found else {
            return self.evicted_by(name, eviction).await;
        };
        let mut owner_marker = MARKER.to_vec();
        owner_marker.extend_from_slice(eviction.owner.as_str().as_bytes());
        let own_marker = markers.kvs.iter().find(|kv| kv.value == owner_marker);
        // Closed as long as the holder's session could last, or its lock-delay lease.
        let mut closed_for = if self.is_session_lease(entry.lease).await? {
            self.granted_ttl(entry.lease).await?
        } else {
            Duration::ZERO
        };
        if let Some(marker) = own_marker {
            closed_for = closed_for.max(self.granted_ttl(marker.lease).await?);
        }
        let (record_lease, _) = grant_unkept(
            self.rpc(),
            evictions::KEPT_FOR,
            "eviction record keep",
            "lease of an eviction record",
        )
        .await?;
        let marker_lease = if closed_for.is_zero() {
            None
        } else {
            let granted = grant_unkept(
                self.rpc(),
                closed_for.saturating_add(MARKER_MARGIN),
                "session ttl",
                "lease of an eviction",
            )
            .await;
            match granted {
                Ok((lease, _)) => Some(lease),
                Err(e) => {
                    self.drop_lease(record_lease).await;
                    return Err(e);
                }
            }
        };
        // The records of the name past the newest few go, to keep the last `KEPT`.
        let older = (records.kvs.iter().skip(evictions::KEPT - 1)).map(|kv| kv.key.clone());
        let writes = EvictionWrites {
            marker: marker_lease.map(|lease| {
                (
                    format!("{}evicted.{}", set.markers, entry.revision),
                    owner_marker,
                    lease,
                )
            }),
            record: (
                layout.eviction(name, entry.revision),
                evictions::encode(eviction).into_bytes(),
                record_lease,
            ),
            deletes: own_marker
                .map(|kv| kv.key.clone())
                .into_iter()
                .chain(older)
                .collect(),
        };
        let done = self
            .rpc()
            .txn(requests::evict(&entry.key, entry.revision, writes))
            .await
            .map_err(|e| map_error(e, "evicting"))?;
        if !done.succeeded {
            self.drop_lease(record_lease).await;
            if let Some(lease) = marker_lease {
                self.drop_lease(lease).await;
            }
        } else if let Some(lease) = marker_lease {
            self.renew_once(lease).await;
        }
        Ok(done.succeeded)
    }

    async fn session_liveness(&self) -> Option<SessionLiveness> {
        self.current_session()
            .await
            .map(|session| session.liveness())
    }

    /// Writes a record beside `req.name` while `req`'s grant holds, in one transaction.
    ///
    /// The record, `#records/<name>/<key>` (see `layout.rs`), is bound to a lease of its
    /// own of `keep` (whole seconds, rounded up), granted first: etcd deletes it when that
    /// runs out. The transaction compares the grant's key — its create revision, which
    /// only the grant's key has — and puts the record; a replaced record's old lease runs
    /// out with nothing on it. `Ok(false)` (and the new lease revoked) if the key is gone,
    /// or this client holds no such grant.
    ///
    /// # Cancel safety
    ///
    /// Dropped before the answer, the record may be written or not; a lease granted for
    /// it and not used runs out after `keep`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a `keep` over etcd's longest lease (about 285 years);
    /// backend errors, after which the record may be written or not.
    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        let Some((placed, revision)) = self.granted_key(req) else {
            return Ok(false);
        };
        let (lease, _) = grant_unkept(self.rpc(), keep, "record keep", "lease of a record").await?;
        let record = self.inner.layout.record(&req.name, key);
        let txn = requests::put_record(&placed, revision, record, value.to_vec(), lease);
        let answer = self
            .rpc()
            .txn(txn)
            .await
            .map_err(|e| map_error(e, "writing a record"))?;
        if !answer.succeeded {
            self.drop_lease(lease).await;
        }
        Ok(answer.succeeded)
    }

    /// The record under `key` beside `name`: a linearizable read.
    /// etcd answers it only once the member has applied everything committed before it,
    /// so a record written before a release is seen by every grant after that release.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    ///
    /// # Errors
    ///
    /// Backend errors.
    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        // `serializable: false` (the default): linearizable, not the member's local copy.
        let read = requests::get(self.inner.layout.record(name, key));
        let found = self
            .rpc()
            .range(read)
            .await
            .map_err(|e| map_error(e, "reading a record"))?;
        Ok(found.kvs.into_iter().next().map(|kv| kv.value))
    }

    /// Moves `req`'s grant off the session onto a lease of `hold` that nobody keeps alive.
    ///
    /// A lease of `hold` (whole seconds, rounded up; counted from its grant, one round
    /// trip before the move) is granted, then one transaction compares the grant's key's
    /// create revision and puts the key again bound to it, value unchanged (and deletes its
    /// lock-delay marker, if any: the grant ends as planned). The put keeps the key's
    /// create revision, so its place in the queue and its token stand, and waiters, which
    /// watch deletions only, sleep on; etcd deletes the key when the new lease runs out —
    /// whether or not this process still runs, and not when the session ends or is
    /// revoked — and the first waiter wakes. `Ok(false)` (and the new lease revoked) if the
    /// key is gone or this client holds no such grant.
    ///
    /// # Cancel safety
    ///
    /// Dropped before the answer, the key is moved or not; a lease granted and not used
    /// runs out after `hold`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a `hold` over etcd's longest lease; backend errors,
    /// after which the key may be moved or not (its release deletes it either way).
    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        // Its holder lets go of it: whatever becomes of the key is no news to the grant.
        self.inner.grants.unwatch(&req.owner);
        let Some((placed, revision)) = self.granted_key(req) else {
            return Ok(false);
        };
        let (lease, until) =
            grant_unkept(self.rpc(), hold, "hold", "lease of a kept grant").await?;
        let marker = req.lock_delay.is_some();
        let answer = self
            .rpc()
            .txn(requests::keep(&placed, revision, lease, marker))
            .await;
        match answer {
            Ok(answer) if answer.succeeded => {
                // The key outlives the acquisition: its slot stays taken until it is gone.
                self.registry().keep(&req.owner, until);
                Ok(true)
            }
            Ok(_) => {
                // The key is gone: the session's lease ran out, or it was deleted.
                self.registry().forget(&req.owner);
                self.drop_lease(lease).await;
                Ok(false)
            }
            Err(e) => {
                // Moved or not: revoking the lease deletes the key if it was, as the
                // release that follows does if it was not.
                self.drop_lease(lease).await;
                Err(map_error(e, "keeping a grant"))
            }
        }
    }

    /// Ends the session that holds the owner's key, if that key may be on the server.
    /// It may be if an answer showed it or a put of it may still land. Every guard of the
    /// session is lost with it (signalled as [`LossReason::SessionEnded`]), its lease is
    /// revoked (or, if etcd cannot be reached, no longer kept alive, so it runs out within
    /// one session ttl), and later grants get a new session. A key whose release could not
    /// be confirmed is bound to the session's lease, so nothing else ends it. A session
    /// that has ended already is left to run out (its lock-delay markers keep their delay).
    async fn abandon(&self, req: &Request) -> Result<()> {
        self.inner.grants.unwatch(&req.owner);
        let Some(placed) = self.registry().forget(&req.owner) else {
            return Ok(());
        };
        if placed.revision.is_none() && placed.unanswered_puts == 0 {
            // Nothing of it was ever written.
            return Ok(());
        }
        tracing::warn!(
            lock = %req.name,
            lease = placed.lease,
            "etcd: a release could not be confirmed; ending the session that holds it"
        );
        self.end_session(placed.lease).await
    }
}
