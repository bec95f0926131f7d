//! One Redis server as a Redlock node.
//! The requests Redlock makes of a node, and nothing else of the single-server backend.

use std::time::Duration;

use leasehold_core::backend::{
    Acquire, Backend, Eviction, LockState, Mode, Release, Renewal, Request, WaitHint,
};
use leasehold_core::support::health::Silence;
use leasehold_core::{LockName, NamePrefix, RecordKey, Result};

use crate::backend::{NodeAcquire, RedisBackend};
use crate::listing::Position;
use crate::options::RedisOptions;
use crate::script::millis_up;
use crate::wakeups::Hint;

/// A Redlock node.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    redis: RedisBackend,
    run_id: String,
}

impl Node {
    /// Connects to the node at `url` and reads its run id, within the options' connect timeout.
    pub(crate) async fn connect(url: &str, options: &RedisOptions) -> Result<Node> {
        let (redis, run_id) = RedisBackend::open(url, options.clone(), true).await?;
        let run_id = run_id.ok_or_else(|| crate::error::unexpected("INFO server", "no run id"))?;
        Ok(Node { redis, run_id })
    }

    /// What the node's connection has answered so far (see [`Node::timed_out`]).
    pub(crate) fn silence(&self) -> Silence {
        self.redis.connection().silence()
    }

    /// A request sent at `since` got no answer within the node timeout.
    /// After a few in a row with nothing answered, the node's connection is replaced.
    pub(crate) fn timed_out(&self, since: Silence) {
        self.redis.connection().given_up(since);
    }

    /// The server's run id: two nodes with one run id are one server.
    pub(crate) fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The lease a node grants for `ttl`: whole milliseconds, rounded up.
    pub(crate) fn lease(ttl: Duration) -> Duration {
        Duration::from_millis(millis_up(ttl))
    }

    /// Grants `req` here or answers busy.
    /// A node that started less than `quarantine` ago refuses (zero: no quarantine).
    ///
    /// Every grant comes with a token drawn from the node's counter now, also when
    /// `req.owner` holds here already (a retry adopting what an earlier attempt left): the
    /// token stored by that attempt may lie below grants made since, which Redlock's
    /// majority rule (the next grant's majority meets this one's) cannot see.
    pub(crate) async fn acquire(&self, req: &Request, quarantine: Duration) -> Result<Acquire> {
        let node = NodeAcquire {
            quarantine_ms: if quarantine.is_zero() {
                0
            } else {
                millis_up(quarantine)
            },
            redlock: true,
        };
        self.redis.acquire_node(req, node).await
    }

    /// Raises the name's counter to at least `floor`: the fencing write-back.
    /// It also records it as `req.owner`'s token if it holds here.
    pub(crate) async fn raise(&self, req: &Request, floor: u64) -> Result<()> {
        self.redis.raise(req, floor).await
    }

    /// Extends `req.owner`'s grant here if it is still its own.
    pub(crate) async fn renew(&self, req: &Request) -> Result<Renewal> {
        self.redis.renew(req).await
    }

    /// Removes `req.owner`'s grant or waiter entry here.
    pub(crate) async fn release(&self, req: &Request) -> Result<Release> {
        self.redis.release(req).await
    }

    /// Gives back a grant of a waiting `req` that made no majority, keeping its place here.
    /// A request that does not wait has no place: its grant is released.
    pub(crate) async fn give_back(&self, req: &Request) -> Result<Release> {
        if !req.waiting {
            return self.release(req).await;
        }
        Ok(if self.redis.give_back(req).await? {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    /// Force-releases the grant `eviction` names here, if it is held here with its token.
    pub(crate) async fn evict(
        &self,
        name: &LockName,
        mode: Mode,
        eviction: &Eviction,
    ) -> Result<bool> {
        self.redis.evict(name, mode, eviction).await
    }

    /// Leaves `req.owner`'s grant here to end `hold` from now, if it is still its own.
    pub(crate) async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        self.redis.keep(req, hold).await
    }

    /// Writes the record here if `req.owner`'s grant holds here.
    pub(crate) async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        self.redis.put_record(req, key, value, keep).await
    }

    /// The record under `key` beside `name` here.
    pub(crate) async fn get_record(
        &self,
        name: &LockName,
        key: &RecordKey,
    ) -> Result<Option<Vec<u8>>> {
        self.redis.get_record(name, key).await
    }

    /// Deletes the record under `key` beside `name` here if it is still `value`.
    pub(crate) async fn drop_record(
        &self,
        name: &LockName,
        key: &RecordKey,
        value: &[u8],
    ) -> Result<bool> {
        self.redis.drop_record(name, key, value).await
    }

    /// Holders and waiters here.
    pub(crate) async fn inspect(&self, name: &LockName) -> Result<LockState> {
        self.redis.inspect(name).await
    }

    /// The names one `SCAN` from `scan` finds here under `prefix`, and the next cursor.
    /// `None` once the scan has gone through every key.
    pub(crate) async fn scan(
        &self,
        prefix: &NamePrefix,
        scan: u64,
        page: usize,
    ) -> Result<(Vec<LockName>, Option<u64>)> {
        let at = Position { master: None, scan };
        let (names, next) = self.redis.scan(prefix, at, page).await?;
        Ok((names, next.map(|next| next.scan)))
    }

    /// Holders and waiters of each of `names` here, in one round trip.
    pub(crate) async fn inspect_all(&self, names: &[LockName]) -> Result<Vec<LockState>> {
        self.redis.inspect_all(names, 0).await
    }

    /// Whether this node's busy answer can be waited on (it carries a wake-up hint).
    pub(crate) fn can_wait(hint: &WaitHint) -> bool {
        hint.get::<Hint>().is_some()
    }

    /// Whether waiting on this node's busy answer first needs a subscription.
    /// The first [`wait`](Node::wait) makes it and returns.
    pub(crate) fn must_subscribe(hint: &WaitHint) -> bool {
        hint.get::<Hint>().is_some_and(|h| !h.subscribed())
    }

    /// How many lock names this node's connection keeps wake-up state for.
    pub(crate) fn wakeup_channels(&self) -> usize {
        self.redis.wakeup_channels()
    }

    /// Returns when this node published a wake-up for the hint's waiter, or after `max`.
    pub(crate) async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        self.redis.wait(name, hint, max).await
    }
}
