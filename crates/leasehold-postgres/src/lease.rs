//! Lease mode: a row per grant in `<schema>.grants`, its expiry on the server's clock.
//!
//! Every request is one statement on one of the pooled connections: acquire, release and
//! evict call the schema's functions (which lock the name's row first, so that changes of a
//! name happen one at a time), renewal is one owner-checked `UPDATE` (the renewals falling
//! due together, one per pooled connection), a record's write one owner-checked upsert.
//! See `sql/v1.sql`, `sql/v2.sql` and `sql/v3.sql`.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use leasehold_core::backend::{
    Acquire, Eviction, Expiry, Grant, Listing, LockState, Mode, Release, Renewal, Request, WaitHint,
};
use leasehold_core::{Error, LockName, LossReason, RecordKey, Result};
use tokio::task::JoinHandle;

use crate::connection::{Conn, Pool};
use crate::error::undecodable;
use crate::fence::token_param;
use crate::listing::Page;
use crate::reply::{self, Acquired};
use crate::statements::Stmt;
use crate::wakeups::{Ticket, Wakeups, poll_pause};

/// How often an observer (inspect) polls when no message can come.
const OBSERVER_POLL: Duration = Duration::from_millis(100);

/// The lease-mode backend.
#[derive(Debug)]
pub(crate) struct Lease {
    pool: Pool,
    wakeups: Arc<Wakeups>,
    listener: Option<JoinHandle<()>>,
}

/// What a busy request or an inspect hands to `wait`.
#[derive(Debug)]
struct Hint {
    ticket: Ticket,
    /// The state may change without a message after this long.
    retry: Option<Duration>,
    /// The pause between polls when no message can come.
    poll: Duration,
}

/// A duration in whole milliseconds, rounded up (leases are never shortened).
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(i64::MAX)
}

/// A renewal's answer when the grant was extended by `ttl` milliseconds.
fn renewed_by(ttl: i64) -> Renewal {
    Renewal::Renewed(Expiry::After(Duration::from_millis(ttl.unsigned_abs())))
}

/// Why `req`'s grant, which a renewal found gone, was lost: evicted, or not the owner's.
/// Only once the grant is found gone is this asked (a second round trip, never taken by a
/// renewal that succeeds). Any failure to read the records (a role without rights on the
/// table, a dropped connection) still reports the loss, as not the owner's: it is certain
/// already.
async fn loss_reason(conn: &Conn, req: &Request) -> LossReason {
    let evicted = conn
        .query_one(
            Stmt::Evicted,
            &[&req.name.as_str(), &req.owner.as_str()],
            "renew",
        )
        .await
        .and_then(|row| reply::single(&row, "renew"));
    match evicted.unwrap_or(false) {
        true => LossReason::Evicted,
        false => LossReason::NotOwner,
    }
}

/// A mode as the schema stores it, with its permit limit.
fn mode(mode: Mode) -> (i8, Option<i32>) {
    match mode {
        Mode::Exclusive => (b'x' as i8, None),
        Mode::Shared => (b's' as i8, None),
        Mode::Permit { limit } => (
            b'p' as i8,
            Some(i32::try_from(limit.get()).unwrap_or(i32::MAX)),
        ),
    }
}

impl Lease {
    pub(crate) fn new(pool: Pool, wakeups: Arc<Wakeups>, listener: Option<JoinHandle<()>>) -> Self {
        Self {
            pool,
            wakeups,
            listener,
        }
    }

    /// The pooled connections.
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    pub(crate) async fn acquire(&self, req: &Request) -> Result<Acquire> {
        // Registered before the request is sent: a wake-up right after the answer counts.
        let ticket = req.waiting.then(|| {
            self.wakeups
                .ticket(req.name.as_str(), Some(req.owner.as_str()))
        });
        let conn = self.pool.get_for(req).await?;
        let (code, limit) = mode(req.mode);
        let ttl = millis(req.ttl);
        let delay = req.lock_delay.map_or(0, millis);
        let value = req.value.as_deref();
        let row = conn
            .query_one(
                Stmt::Acquire,
                &[
                    &req.name.as_str(),
                    &req.owner.as_str(),
                    &code,
                    &limit,
                    &ttl,
                    &req.fair,
                    &req.waiting,
                    &delay,
                    &value,
                ],
                "acquire",
            )
            .await?;
        match reply::acquired(&row)? {
            Acquired::Granted(token) => Ok(Acquire::Granted(Grant::new(
                token,
                Expiry::After(Duration::from_millis(ttl.unsigned_abs())),
            ))),
            Acquired::Busy {
                retry,
                waited,
                blocked,
            } => Ok(Acquire::Busy(match ticket {
                Some(ticket) => {
                    let poll = poll_pause(waited);
                    // Nothing is sent when a fenced write ends: poll as without messages.
                    let retry = match blocked {
                        true => Some(retry.map_or(poll, |r| r.min(poll))),
                        false => retry,
                    };
                    WaitHint::new(Hint {
                        ticket,
                        retry,
                        poll,
                    })
                }
                None => WaitHint::none(),
            })),
        }
    }

    /// Leaves the owner's grant to end `hold` from now, and wakes the name's waiters.
    /// One statement; `Ok(false)` if the grant is not the owner's live one.
    pub(crate) async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        let conn = self.pool.get_for(req).await?;
        let hold = millis(hold);
        let kept = conn
            .query(
                Stmt::Keep,
                &[&req.name.as_str(), &req.owner.as_str(), &hold],
                "keeping a grant",
            )
            .await?;
        Ok(!kept.is_empty())
    }

    pub(crate) async fn renew(&self, req: &Request) -> Result<Renewal> {
        let conn = self.pool.get_for(req).await?;
        let ttl = millis(req.ttl);
        let renewed = conn
            .query(
                Stmt::Renew,
                &[&req.name.as_str(), &req.owner.as_str(), &ttl],
                "renew",
            )
            .await?;
        Ok(match renewed.is_empty() {
            false => renewed_by(ttl),
            true => Renewal::Lost(loss_reason(&conn, req).await),
        })
    }

    /// Renews each grant of `reqs` as [`renew`](Lease::renew) does, one statement per connection.
    /// The requests of one connection (one place of the pool, see [`Pool::place_for`]) go
    /// in one `Stmt::RenewMany` on it, where the server runs them in the order they were
    /// sent among that acquisition's other requests, as their own renewals would be run; the
    /// connections' statements are sent at the same time (one round trip in all). A grant
    /// it finds gone is then looked up as `renew` does (was it evicted?), those alone. A
    /// connection with a single request, and a name and owner given twice, take `renew`.
    /// A statement that fails answers its error for each of its requests.
    pub(crate) async fn renew_many(&self, reqs: &[&Request]) -> Vec<Result<Renewal>> {
        let mut places: Vec<Vec<usize>> = vec![Vec::new(); self.pool.size()];
        let mut alone = Vec::new();
        let mut seen = std::collections::HashSet::with_capacity(reqs.len());
        for (i, req) in reqs.iter().enumerate() {
            match seen.insert((req.name.as_str(), req.owner.as_str())) {
                true => places[self.pool.place_for(req)].push(i),
                false => alone.push(i),
            }
        }
        let (batches, single): (Vec<Vec<usize>>, Vec<Vec<usize>>) =
            places.into_iter().partition(|place| place.len() > 1);
        alone.extend(single.into_iter().flatten());
        let (batched, alone_answers) = tokio::join!(
            join_all(batches.iter().map(|batch| self.renew_batch(reqs, batch))),
            join_all(alone.iter().map(|&i| self.renew(reqs[i])))
        );
        let mut answers: Vec<Option<Result<Renewal>>> = reqs.iter().map(|_| None).collect();
        let places = batches.iter().flatten().chain(&alone);
        for (&i, answer) in places.zip(batched.into_iter().flatten().chain(alone_answers)) {
            answers[i] = Some(answer);
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| Err(undecodable("renew", "no answer"))))
            .collect()
    }

    /// The answers to the renewals `batch` (places in `reqs`, on one connection), in its order.
    async fn renew_batch(&self, reqs: &[&Request], batch: &[usize]) -> Vec<Result<Renewal>> {
        let failed = |error: Error| -> Vec<Result<Renewal>> {
            batch.iter().map(|_| Err(error.clone())).collect()
        };
        let Some(&first) = batch.first() else {
            return Vec::new();
        };
        let conn = match self.pool.get_for(reqs[first]).await {
            Ok(conn) => conn,
            Err(error) => return failed(error),
        };
        let names: Vec<&str> = batch.iter().map(|&i| reqs[i].name.as_str()).collect();
        let owners: Vec<&str> = batch.iter().map(|&i| reqs[i].owner.as_str()).collect();
        let ttls: Vec<i64> = batch.iter().map(|&i| millis(reqs[i].ttl)).collect();
        let renewed = conn
            .query(Stmt::RenewMany, &[&names, &owners, &ttls], "renew")
            .await
            .and_then(|rows| {
                let mut renewed = vec![false; batch.len()];
                for row in &rows {
                    let place: i64 = reply::single(row, "renew")?;
                    let found = usize::try_from(place - 1)
                        .ok()
                        .and_then(|i| renewed.get_mut(i))
                        .ok_or_else(|| undecodable("renew", place))?;
                    *found = true;
                }
                Ok(renewed)
            });
        let renewed = match renewed {
            Ok(renewed) => renewed,
            Err(error) => return failed(error),
        };
        // Only the grants found gone take a second statement each (which `renew` would
        // send too), all at the same time.
        let answers = batch
            .iter()
            .zip(renewed)
            .zip(ttls)
            .map(|((&i, renewed), ttl)| {
                let conn = &conn;
                async move {
                    Ok(match renewed {
                        true => renewed_by(ttl),
                        false => Renewal::Lost(loss_reason(conn, reqs[i]).await),
                    })
                }
            });
        join_all(answers).await
    }

    pub(crate) async fn release(&self, req: &Request) -> Result<Release> {
        let conn = self.pool.get_for(req).await?;
        let row = conn
            .query_one(
                Stmt::Release,
                &[&req.name.as_str(), &req.owner.as_str()],
                "release",
            )
            .await?;
        Ok(if reply::single::<bool>(&row, "release")? {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    pub(crate) async fn wait(&self, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(hint) = hint.get::<Hint>() else {
            return Ok(());
        };
        let limit = hint.retry.map_or(max, |retry| retry.min(max));
        self.wakeups.wait(&hint.ticket, limit, hint.poll).await;
        Ok(())
    }

    pub(crate) async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let ticket = self.wakeups.ticket(name.as_str(), None);
        let conn = self.pool.get().await?;
        let rows = conn
            .query(Stmt::Inspect, &[&name.as_str()], "inspect")
            .await?;
        let mut state = reply::lease_state(&rows)?;
        let retry = state.holders.iter().filter_map(|h| h.remaining).min();
        state.hint = WaitHint::new(Hint {
            ticket,
            retry: retry.map(|r| r + Duration::from_millis(1)),
            poll: OBSERVER_POLL,
        });
        Ok(state)
    }

    /// Force-releases the grant `eviction` names and records it, in one statement.
    /// The grant is `eviction.owner`'s in `set`'s set with `eviction.token`, live. The
    /// statement (`evict` in `sql/v2.sql`) removes its row (or, while a fenced write holds
    /// the row, cuts its lease short), closes the set until the lease's old expiry through
    /// the lock-delay columns that acquire obeys, records the eviction beside the last 9,
    /// and tells the waiters to look again. `false`: no such live grant.
    ///
    /// # Cancel safety
    ///
    /// One statement in one transaction: dropped before it completed, the server either
    /// evicted and recorded, or did neither.
    pub(crate) async fn evict(
        &self,
        name: &LockName,
        set: Mode,
        eviction: &Eviction,
    ) -> Result<bool> {
        let conn = self.pool.get().await?;
        let (code, _) = mode(set);
        let at = i64::try_from(eviction.at_ms).unwrap_or(i64::MAX);
        let row = conn
            .query_one(
                Stmt::Evict,
                &[
                    &name.as_str(),
                    &eviction.owner.as_str(),
                    &code,
                    &token_param(eviction.token),
                    &eviction.by.as_str(),
                    &eviction.reason.as_str(),
                    &at,
                ],
                "evict",
            )
            .await?;
        reply::single(&row, "evict")
    }

    /// Writes a record beside `req.name` if `req`'s lease is live, in one statement.
    /// The statement (`Stmt::PutRecord`) finds the grant as renew does — the owner's, in
    /// `req.mode`'s set, unexpired by the server's clock — and locks its row as a fenced
    /// write does, so a release or eviction racing it cannot let the next grant in before
    /// it commits. It is sent on the acquisition's lane, after its earlier requests.
    /// `keep` is in milliseconds. `false`: no such grant, nothing written.
    ///
    /// # Cancel safety
    ///
    /// One statement in one transaction: dropped before it completed, the server either
    /// wrote the record or did not.
    pub(crate) async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: i64,
    ) -> Result<bool> {
        let conn = self.pool.get_for(req).await?;
        let permit = matches!(req.mode, Mode::Permit { .. });
        let row = conn
            .query_one(
                Stmt::PutRecord,
                &[
                    &req.name.as_str(),
                    &req.owner.as_str(),
                    &permit,
                    &key.as_str(),
                    &value,
                    &keep,
                ],
                "writing a record",
            )
            .await?;
        reply::single(&row, "writing a record")
    }

    /// One page of the names under a prefix with a live grant or a queued waiter.
    /// Each with what [`inspect`](Lease::inspect) would answer (no grant time: the schema
    /// keeps none). One statement reads the page's names from the `names` table's primary
    /// key, and each name's grants and waiters from theirs.
    ///
    /// # Cancel safety
    ///
    /// Read-only: dropped, it leaves nothing behind on the server.
    pub(crate) async fn list(&self, page: &Page) -> Result<Listing> {
        let rows = page.query(&self.pool, Stmt::List).await?;
        reply::lease_listing(&rows, page.limit())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(listener) = &self.listener {
            listener.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_round_up() {
        assert_eq!(millis(Duration::from_millis(5)), 5);
        assert_eq!(millis(Duration::from_micros(5_001)), 6);
        assert_eq!(millis(Duration::from_nanos(1)), 1);
        assert_eq!(millis(Duration::MAX), i64::MAX);
    }
}
