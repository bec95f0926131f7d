//! The [`Backend`] implementation: acquire, renew, release, wait and inspect as etcd
//! requests, and what their answers mean.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{GetOptions, TxnOpResponse, WatchFilterType, WatchOptions};
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Holder, LockState, Mode, Release, Renewal,
    Request, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::{Error, FencingToken, LockName, LossReason, OwnerId, Result};

use crate::connection::EtcdBackend;
use crate::error::map_error;
use crate::keys::Placed;
use crate::reply::{
    Entry, decode, encode, header_revision, holding, holding_owned, in_the_way, queue_of,
};
use crate::requests::{self, AcquireShape};
use crate::session::Session;

/// What a busy request hands to `wait`: what to watch, and what it looked like when read.
#[derive(Debug)]
struct Hint {
    key: Vec<u8>,
    /// Watch every key under `key`.
    prefix: bool,
    /// Only deletions matter (a queued entry: nothing put later gets ahead of it).
    deletes_only: bool,
    /// The watched key's create revision, for a single key.
    created: Option<i64>,
    /// The revision after the read: a change at or after it may matter.
    from: i64,
}

impl EtcdBackend {
    /// Whether what `hint` watches may have changed since it was read, now that a watch
    /// created at revision `now` is in place: a single key is looked up (gone or created
    /// again); a range counts as changed if anything was written since the read.
    async fn moved(&self, hint: &Hint, now: i64) -> Result<bool> {
        let Some(created) = hint.created else {
            return Ok(now >= hint.from);
        };
        let now = self
            .kv()
            .get(hint.key.clone(), Some(GetOptions::new().with_keys_only()))
            .await
            .map_err(|e| map_error(e, "watching"))?;
        Ok(now
            .kvs()
            .first()
            .is_none_or(|kv| kv.create_revision() != created))
    }

    fn forget(&self, owner: &OwnerId) {
        self.keys().forget(owner, false);
    }

    /// Deletes the owner's key (with its lock-delay marker, if `marker`) and forgets it;
    /// `None` if the owner has no key, else whether a key was deleted. See
    /// [`Keys::start_delete`](crate::keys::Keys::start_delete) for why no compare is
    /// needed.
    async fn delete(&self, owner: &OwnerId, marker: bool, doing: &str) -> Result<Option<bool>> {
        let Some((placed, first)) = self.keys().start_delete(owner) else {
            return Ok(None);
        };
        let deleted = if marker {
            // A release is not a vanishing: the lock opens at once.
            let answer = self
                .kv()
                .txn(requests::delete_with_marker(&placed))
                .await
                .map_err(|e| map_error(e, doing))?;
            matches!(answer.op_responses().first(), Some(TxnOpResponse::Delete(d)) if d.deleted() > 0)
        } else {
            let answer = self
                .kv()
                .delete(placed.key(), None)
                .await
                .map_err(|e| map_error(e, doing))?;
            answer.deleted() > 0
        };
        self.keys().finish_delete(owner, first);
        Ok(Some(deleted))
    }

    /// The grant of `placed`, whose key holds at create revision `revision`: recorded, with
    /// its lock-delay marker put first if the request has a lock-delay.
    async fn granted(
        &self,
        session: &Session,
        placed: &Placed,
        req: &Request,
        revision: i64,
    ) -> Result<Acquire> {
        self.keys().record(&req.owner, revision);
        if let Some(delay) = req.lock_delay {
            self.put_marker(session, placed, &req.owner, revision, delay)
                .await?;
        }
        Ok(Acquire::Granted(Grant {
            token: FencingToken::new(u64::try_from(revision).unwrap_or(0)),
            expiry: Expiry::Session(session.liveness()),
        }))
    }

    /// Puts the lock-delay marker of a grant, if its key is still the one granted; the
    /// grant is reported only after this, so no holder ever works without its marker.
    async fn put_marker(
        &self,
        session: &Session,
        placed: &Placed,
        owner: &OwnerId,
        revision: i64,
        delay: Duration,
    ) -> Result<()> {
        let lease = session.delay_lease(&self.inner.client, delay).await?;
        let answer = self
            .kv()
            .txn(requests::put_marker(
                placed,
                owner.as_str(),
                revision,
                lease,
            ))
            .await
            .map_err(|e| map_error(e, "marking a grant for lock-delay"))?;
        if answer.succeeded() {
            Ok(())
        } else {
            // The key is gone: the session's lease ran out since the grant.
            self.forget(owner);
            Err(Error::Lost(LossReason::SessionEnded))
        }
    }
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
        // etcd grants whole seconds, rounded up (it may grant more: its minimum ttl).
        let asked = self.inner.options.session_ttl;
        caps.session_ttl = Some(Duration::from_secs(
            asked.as_secs() + u64::from(asked.subsec_nanos() > 0),
        ));
        // Markers bound to a lease that outlives the session's by the delay.
        caps.lock_delay = true;
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let session = self.session().await?;
        let dir = self.dir(&req.name, req.mode);
        let placed = self.keys().place(&req.owner, &dir, session.id);
        if placed.lease != session.id {
            // Queued under a session that has ended: the key went with it.
            self.forget(&req.owner);
            return Err(Error::Lost(LossReason::SessionEnded));
        }
        let key = placed.key();
        let queued = placed.revision.is_some();
        let shape = if queued {
            AcquireShape::Woken
        } else if !req.waiting && req.mode == Mode::Exclusive {
            AcquireShape::Try
        } else {
            AcquireShape::Join
        };
        let value = encode(req.mode, &req.owner, req.value.as_deref());
        let txn = requests::acquire(shape, &key, &dir, &value, session.id);
        let answer = self
            .kv()
            .txn(txn)
            .await
            .map_err(|e| map_error(e, "acquiring"))?;
        let revision = answer.header().map_or(0, |h| h.revision());
        if queued && !answer.succeeded() {
            // The key is gone: its lease expired (or someone deleted it) while we waited.
            self.forget(&req.owner);
            return Err(Error::Lost(LossReason::SessionEnded));
        }
        if !queued && answer.succeeded() {
            // The queue was empty and the transaction's one write put the key: it holds, and
            // was created at the transaction's revision.
            if revision <= 0 {
                // Retryable: the retry reads the queue and adopts the key put here.
                return Err(Error::backend(
                    "etcd: a granting transaction was answered without its revision",
                    true,
                ));
            }
            return self.granted(&session, &placed, req, revision).await;
        }
        let responses = answer.op_responses();
        let (queue, closed_by) = queue_of(&responses);
        let from = header_revision(&responses, revision) + 1;
        let Some(me) = queue.iter().position(|e| e.owner == req.owner) else {
            // A try that found the queue occupied: nothing was written.
            self.forget(&req.owner);
            return Ok(Acquire::Busy(WaitHint::new(Hint {
                key: dir.into_bytes(),
                prefix: true,
                deletes_only: true,
                created: None,
                from,
            })));
        };
        let mine = &queue[me];
        if mine.lease != session.id || mine.key != key.as_bytes() {
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
            return self.granted(&session, &placed, req, mine.revision).await;
        }
        if !req.waiting {
            // Not granted and not waiting: take the key out of the queue again.
            self.keys().record(&req.owner, mine.revision);
            self.delete(&req.owner, false, "withdrawing").await?;
            return Ok(Acquire::Busy(WaitHint::none()));
        }
        self.keys().record(&req.owner, mine.revision);
        let hint = match (in_the_way(&queue, me), closed_by) {
            // First in line, but a vanished holder's lock-delay is not over.
            (_, Some((marker, created))) if granted => Hint {
                key: marker,
                prefix: false,
                deletes_only: true,
                created: Some(created),
                from,
            },
            (Some(before), _) => Hint {
                key: before.key.clone(),
                prefix: false,
                deletes_only: true,
                created: Some(before.revision),
                from,
            },
            (None, _) => Hint {
                key: dir.into_bytes(),
                prefix: true,
                deletes_only: true,
                created: None,
                from,
            },
        };
        Ok(Acquire::Busy(WaitHint::new(hint)))
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        // Grants live by the session; this only says whether the key is still ours.
        let Some(placed) = self.keys().by_owner.get(&req.owner).cloned() else {
            return Ok(Renewal::Lost(LossReason::NotOwner));
        };
        let found = self
            .kv()
            .get(placed.key(), None)
            .await
            .map_err(|e| map_error(e, "checking a key"))?;
        let session = self.current_session().await;
        match (found.kvs().first(), session) {
            (Some(kv), Some(session))
                if kv.lease() == session.id
                    && session.is_alive()
                    && placed.revision == Some(kv.create_revision()) =>
            {
                Ok(Renewal::Renewed(Expiry::Session(session.liveness())))
            }
            _ => Ok(Renewal::Lost(LossReason::NotOwner)),
        }
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let deleted = self
            .delete(&req.owner, req.lock_delay.is_some(), "releasing")
            .await?;
        Ok(if deleted == Some(true) {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(hint) = hint.get::<Hint>() else {
            return Ok(());
        };
        // The watch starts at the current revision, not at `hint.from`: etcd serves a watch
        // that starts in the past from a catch-up loop that runs every 100 ms, one that
        // starts now at once. What changed before the watch was in place is looked up once
        // it is: etcd fixes a new watch's start revision before it registers it, and a
        // write in between also leaves it to the catch-up loop.
        let mut options = WatchOptions::new();
        if hint.prefix {
            options = options.with_prefix();
        }
        if hint.deletes_only {
            options = options.with_filters([WatchFilterType::NoPut]);
        }
        let watched = async {
            let mut stream = self
                .client()
                .watch(hint.key.clone(), Some(options))
                .await
                .map_err(|e| map_error(e, "watching"))?;
            loop {
                match stream
                    .message()
                    .await
                    .map_err(|e| map_error(e, "watching"))?
                {
                    Some(answer) if answer.created() => {
                        let now = answer.header().map_or(i64::MAX, |h| h.revision());
                        if self.moved(hint, now).await? {
                            return Ok(());
                        }
                    }
                    Some(answer) if !answer.events().is_empty() || answer.canceled() => {
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
        let sets = [
            self.dir(name, Mode::Exclusive),
            self.dir(
                name,
                Mode::Permit {
                    limit: std::num::NonZeroU32::MIN,
                },
            ),
        ];
        let answer = self
            .kv()
            .txn(requests::read_all(&sets))
            .await
            .map_err(|e| map_error(e, "inspecting"))?;
        let revision = answer.header().map_or(0, |h| h.revision());
        let mut state = LockState {
            hint: WaitHint::new(Hint {
                key: format!("{}/{name}/", self.inner.options.prefix).into_bytes(),
                prefix: true,
                deletes_only: false,
                created: None,
                from: revision + 1,
            }),
            ..LockState::default()
        };
        let mut ttls: HashMap<i64, Option<Duration>> = HashMap::new();
        for response in answer.op_responses() {
            let TxnOpResponse::Get(get) = response else {
                continue;
            };
            let queue: Vec<Entry> = get.kvs().iter().filter_map(decode).collect();
            for (entry, holds) in queue.into_iter().zip(holding_owned(get.kvs())) {
                if holds {
                    if let std::collections::hash_map::Entry::Vacant(slot) = ttls.entry(entry.lease)
                    {
                        let left = self
                            .client()
                            .lease_time_to_live(entry.lease, None)
                            .await
                            .ok()
                            .and_then(|t| u64::try_from(t.ttl()).ok())
                            .map(Duration::from_secs);
                        slot.insert(left);
                    }
                    state.holders.push(Holder {
                        owner: entry.owner,
                        mode: entry.mode,
                        token: FencingToken::new(u64::try_from(entry.revision).unwrap_or(0)),
                        remaining: ttls.get(&entry.lease).copied().flatten(),
                        value: entry.value,
                    });
                } else {
                    state.waiters.push(Waiter {
                        owner: entry.owner,
                        mode: entry.mode,
                    });
                }
            }
        }
        Ok(state)
    }
}
