//! [`RedisBackend`]: the [`Backend`] of one Redis server.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::join_all;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Changes, Eviction, Expiry, Grant, ListCursor, Listing,
    LockState, Mode, Release, Renewal, Request, TokenDurability, WaitHint,
};
use leasehold_core::{
    Error, FencingToken, LockName, LossReason, NamePrefix, OwnerId, RecordKey, Result,
};
use redis::FromRedisValue;

use crate::changes;
use crate::connection::{self, Connection};
use crate::error::{map_error, unexpected};
use crate::eviction;
use crate::floors::{Floor, Floors};
use crate::link::{Address, Link};
use crate::listing::{self, LISTED, Position};
use crate::options::{RedisOptions, ReplicaAck, parse_url};
use crate::reply::{self, Acquired};
use crate::script::{
    Call, Calls, Key, Keys, RENEW_MANY, Values, millis_up, renew_many_cmd, renews_in_batch,
};
use crate::sentinel;
use crate::wakeups::{Hint, Router, Wakeups};

/// A Redis server holding locks. Clones share one multiplexed connection.
#[derive(Debug, Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    conn: Arc<Connection>,
    wakeups: Arc<Wakeups>,
    /// Per name: the highest token this client saw granted, and to whom.
    floors: Mutex<Floors>,
    warnings: Vec<String>,
    /// Dropped with the backend: ends its watch of the sentinels.
    _failovers: Option<tokio::sync::watch::Sender<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Ends the sweep of unused wake-up channels.
        self.wakeups.close();
    }
}

/// Drops and unsubscribes wake-up channels nobody has used for a while (see `wakeups.rs`).
/// It runs as long as the backend lives, and holds the backend only while it sweeps.
async fn sweep_unused_channels(inner: Weak<Inner>, wakeups: Arc<Wakeups>) {
    while let Some(due) = wakeups.next_sweep().await {
        tokio::time::sleep_until(due).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let limit = inner.conn.options().connect_limit();
        wakeups.sweep(&inner.conn, limit).await;
    }
}

/// How a Redlock node's acquire differs from a single server's.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct NodeAcquire {
    /// How long after its start the node refuses grants, in ms (0: not at all).
    pub(crate) quarantine_ms: u64,
    /// A Redlock node, whose tokens come from its counter alone, fresh on every grant.
    /// An owner that holds already gets a fresh token rather than its stored one, and
    /// tokens are not raised to the node's clock (Redlock's majority compares the nodes'
    /// counters, which clocks would set apart on every grant). A fair waiter takes its
    /// place in the queue by when its acquisition began ([`Request::began_ms`]), the same
    /// place on every node.
    pub(crate) redlock: bool,
}

impl RedisBackend {
    /// Connects to the server at `url` (see the crate docs for the URL form).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection attempt.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a malformed URL (credentials redacted);
    /// [`Error::Unavailable`] if the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        let (url, options) = parse_url(url)?;
        Self::connect_with(&url, options).await
    }

    /// Connects with explicit options (URL query parameters are not read).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection attempt.
    ///
    /// # Errors
    ///
    /// As for [`connect`](RedisBackend::connect).
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self> {
        Ok(Self::open(url, options, false).await?.0)
    }

    /// Connects to `url`, within the options' connect timeout.
    /// As a Redlock node (`node`), it also reads the server's run id, and counts only the
    /// requests Redlock says it gave up on as unanswered (see [`Connection`]).
    pub(crate) async fn open(
        url: &str,
        options: RedisOptions,
        node: bool,
    ) -> Result<(Self, Option<String>)> {
        let address = Address::of(url)?;
        let wakeups = Arc::new(Wakeups::new());
        let connected =
            connection::connect(&address, &options, Router(wakeups.clone()), node, None).await?;
        let limit = options.connect_limit();
        let (failovers, gone) = tokio::sync::watch::channel(());
        let sentinels = match &address {
            Address::Sentinel(sentinels) => Some(sentinels.clone()),
            Address::Fixed(_) | Address::Cluster(_) => None,
        };
        let (warnings, run_id) = (connected.warnings.clone(), connected.run_id.clone());
        let inner = Arc::new(Inner {
            conn: Connection::new(connected, address, options, wakeups.clone(), !node),
            wakeups: wakeups.clone(),
            floors: Mutex::new(Floors::default()),
            warnings,
            _failovers: sentinels.is_some().then_some(failovers),
        });
        tokio::spawn(sweep_unused_channels(Arc::downgrade(&inner), wakeups));
        if let Some(sentinels) = sentinels {
            let connection = Arc::downgrade(&inner.conn);
            tokio::spawn(sentinel::watch_failovers(
                sentinels, limit, gone, connection,
            ));
        }
        Ok((Self { inner }, run_id))
    }

    /// Configuration problems found on connecting (an eviction policy that can delete lock keys).
    pub fn warnings(&self) -> &[String] {
        &self.inner.warnings
    }

    /// The health of the connection, for a Redlock node's own timeouts.
    pub(crate) fn connection(&self) -> &Connection {
        &self.inner.conn
    }

    /// How many lock names this client keeps wake-up state (and a subscription) for.
    /// They are the names with a waiter or an observer in this process, and for about a
    /// second those whose last one left. For monitoring: it does not grow with the names
    /// ever locked.
    pub fn wakeup_channels(&self) -> usize {
        self.inner.wakeups.channels()
    }

    /// The script calls for this backend's server (see [`Connection::calls`]).
    fn calls(&self) -> &'static Calls {
        self.inner.conn.calls()
    }

    fn keys(&self, name: &LockName) -> Keys {
        Keys::new(self.inner.conn.options().key_prefix(), name)
    }

    /// Runs `call` with `keys` and `values`, loading its script if the server lost it.
    async fn run<T: FromRedisValue>(
        &self,
        call: &Call,
        keys: &Keys,
        values: &Values<'_>,
    ) -> Result<T> {
        let cmd = call.cmd(keys, values);
        self.run_script(call.script(), &cmd, &values.req.name).await
    }

    /// Sends `cmd`, an `EVALSHA` of `script`, loading the script if the server lost it.
    /// Errors name `what`.
    async fn run_script<T: FromRedisValue>(
        &self,
        script: &redis::Script,
        cmd: &redis::Cmd,
        what: &(dyn std::fmt::Display + Sync),
    ) -> Result<T> {
        let connection = &self.inner.conn;
        let mut conn = connection.for_request().await?;
        match connection.query(&mut conn, cmd).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                script
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| map_error(e, what))?;
                connection.query(&mut conn, cmd).await
            }
            answer => answer,
        }
        .map_err(|e| map_error(e, what))
    }

    /// Runs [`RENEW_MANY`] for `reqs` (each [`renews_in_batch`]): its answer per grant.
    async fn renew_batch(&self, reqs: &[&Request]) -> Result<Vec<i64>> {
        let keys: Vec<Keys> = reqs.iter().map(|req| self.keys(&req.name)).collect();
        let cmd = renew_many_cmd(reqs, &keys);
        self.run_script(&RENEW_MANY, &cmd, &"(a batch of renewals)")
            .await
    }

    /// An acquire as one Redlock node (no token-floor check: Redlock's majority does it).
    pub(crate) async fn acquire_node(&self, req: &Request, node: NodeAcquire) -> Result<Acquire> {
        let keys = self.keys(&req.name);
        self.acquire_once(req, &keys, node).await
    }

    /// Raises the name's fencing counter to at least `floor`.
    /// If `req.owner` holds a grant, the raised counter becomes its token too (a repair
    /// here, Redlock's write-back).
    pub(crate) async fn raise(&self, req: &Request, floor: u64) -> Result<()> {
        let keys = self.keys(&req.name);
        let values = Values {
            floor,
            ..Values::of(req)
        };
        let _: i64 = self.run(&self.calls().raise, &keys, &values).await?;
        Ok(())
    }

    /// Runs the release script for `req`: whether it removed something.
    async fn release_script(&self, req: &Request, keys: &Keys) -> Result<bool> {
        self.release_with(req, keys, Values::of(req)).await
    }

    async fn release_with(&self, req: &Request, keys: &Keys, values: Values<'_>) -> Result<bool> {
        let call = self.calls().release_of(req);
        let answer: i64 = self.run(call, keys, &values).await?;
        reply::yes_or_no(answer, call.name)
    }

    /// Gives back `req.owner`'s grant as a Redlock node, keeping its place in the queue.
    /// The owner waits again at its place (see [`NodeAcquire::redlock`]) until its grant
    /// would have ended; a waiter entry is left as it is. Whether a grant went back.
    pub(crate) async fn give_back(&self, req: &Request) -> Result<bool> {
        let keys = self.keys(&req.name);
        let values = Values {
            place: Self::place(req, true),
            ..Values::of(req)
        };
        self.release_with(req, &keys, values).await
    }

    /// Where `req` queues: [`Arg::Place`](crate::script::Arg::Place) (0: after the last).
    /// On a Redlock node a waiter's place is when its acquisition began (never 0).
    fn place(req: &Request, redlock_node: bool) -> u64 {
        if redlock_node && req.fair && req.waiting {
            req.began_ms.max(1)
        } else {
            0
        }
    }

    /// Why `req.owner`'s grant is gone, which a renewal just found.
    /// The records are read for at most [`LOSS_LOOKUP`].
    /// [`LossReason::Evicted`] if the name's eviction records name the owner (one more
    /// round trip, on this path only), else [`LossReason::NotOwner`], also when the records
    /// cannot be read: the grant is lost either way.
    async fn loss_reason(&self, req: &Request, keys: &Keys) -> LossReason {
        let mut lrange = redis::cmd("LRANGE");
        keys.write(&mut lrange, Key::Evicted);
        lrange.arg(0).arg(eviction::KEPT - 1);
        let connection = &self.inner.conn;
        let lookup = async {
            let mut conn = connection.for_request().await?;
            (connection.query(&mut conn, &lrange).await).map_err(|e| map_error(e, &req.name))
        };
        // Bounded: the loss is certain already, and must not wait on a slow server.
        let records: Result<Vec<Vec<u8>>> = tokio::time::timeout(LOSS_LOOKUP, lookup)
            .await
            .unwrap_or_else(|_| Err(Error::Timeout(LOSS_LOOKUP)));
        match records {
            Ok(records) => {
                let evictions = eviction::decode_all(records.iter().map(Vec::as_slice));
                if evictions.iter().any(|e| e.owner == req.owner) {
                    return LossReason::Evicted;
                }
            }
            Err(error) => {
                tracing::debug!(lock = %req.name, %error, "the eviction records could not be read");
            }
        }
        LossReason::NotOwner
    }

    fn floors(&self) -> std::sync::MutexGuard<'_, Floors> {
        self.inner.floors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One acquire, and the floor it must not break.
    /// The floor is the highest token seen granted before its request was sent (see
    /// `floors.rs`).
    async fn acquire_checked(&self, req: &Request, keys: &Keys) -> Result<(Acquire, Option<u64>)> {
        let seen = self.floors().get(&req.name);
        let answer = self.acquire_once(req, keys, NodeAcquire::default()).await?;
        let broken = match &answer {
            Acquire::Granted(grant) => {
                Floor::broken_by(seen.as_ref(), grant.token.get(), &req.owner)
            }
            Acquire::Busy(_) => None,
        };
        Ok((answer, broken))
    }

    /// One acquire round trip (two when the fast path does not apply).
    async fn acquire_once(&self, req: &Request, keys: &Keys, node: NodeAcquire) -> Result<Acquire> {
        // Register for wake-ups before the request leaves, so that a release published
        // after the script ran cannot be missed. Only a request that will wait records
        // anything (no state per name for try_lock).
        let channel = keys.channel();
        let ticket = req
            .waiting
            .then(|| self.inner.wakeups.ticket(channel, Some(req.owner.as_str())))
            .flatten();
        let values = Values {
            quarantine_ms: node.quarantine_ms,
            fresh_token: node.redlock,
            place: Self::place(req, node.redlock),
            ..Values::of(req)
        };
        // An exclusive request tries the fast path first, with only the keys it touches,
        // unless this client waits on the name already (it is subscribed to it: the name
        // is contended); if the name is not simply free, the script says so and the full
        // call follows.
        let fast = req.mode == Mode::Exclusive
            && req.lock_delay.is_none()
            && req.value.is_none()
            && ticket.is_none();
        let (fast_call, full_call) = self.calls().acquire_of(node.redlock);
        let mut answer = Acquired::NotFast;
        if fast {
            answer = reply::acquired(&self.run(fast_call, keys, &values).await?)?;
        }
        if answer == Acquired::NotFast {
            answer = reply::acquired(&self.run(full_call, keys, &values).await?)?;
        }
        match answer {
            Acquired::Granted(token, handoff) => Ok(Acquire::Granted(
                Grant::new(
                    FencingToken::new(token),
                    Expiry::After(Duration::from_millis(millis_up(req.ttl))),
                )
                .with_handoff(handoff),
            )),
            Acquired::Busy(..) if !req.waiting => Ok(Acquire::Busy(WaitHint::none())),
            Acquired::Busy(retry, counter) => {
                let hint = Hint::new(channel, ticket, retry);
                Ok(Acquire::Busy(WaitHint::new(match counter {
                    Some(counter) => hint.may_be_handed(counter),
                    None => hint,
                })))
            }
            Acquired::NotFast => Err(unexpected("acquire", 0)),
        }
    }

    /// The names one `SCAN` from `at` finds under `prefix`, and where the next one starts.
    /// Each name once, in order. In a Cluster, when a master's scan ends, the next master
    /// is looked up (`CLUSTER SLOTS`). A name found may have neither holder nor waiter
    /// (its keys are about to expire).
    pub(crate) async fn scan(
        &self,
        prefix: &NamePrefix,
        at: Position,
        page: usize,
    ) -> Result<(Vec<LockName>, Option<Position>)> {
        let key_prefix = self.inner.conn.options().key_prefix();
        let mut scan = redis::cmd("SCAN");
        scan.arg(at.scan)
            .arg("MATCH")
            .arg(Keys::pattern(key_prefix, prefix, &LISTED))
            .arg("COUNT")
            .arg(page.max(1));
        let connection = &self.inner.conn;
        let mut conn = connection.for_request().await?;
        let (cursor, keys): (u64, Vec<Vec<u8>>) = connection
            .query_in(&mut conn, at.slot(), &scan)
            .await
            .map_err(|e| map_error(e, "(listing)"))?;
        let names: BTreeSet<LockName> = keys
            .iter()
            .filter_map(|key| Keys::name_in(key_prefix, key, &LISTED))
            .filter(|name| prefix.matches(name))
            .collect();
        let next = match (cursor, at.master) {
            (0, None) => None,
            (0, Some(master)) => {
                let slots: redis::Value = connection
                    .query(&mut conn, redis::cmd("CLUSTER").arg("SLOTS"))
                    .await
                    .map_err(|e| map_error(e, "(listing)"))?;
                listing::next_master(&slots, master)?.map(|slot| Position {
                    master: Some(slot),
                    scan: 0,
                })
            }
            (scan, master) => Some(Position { master, scan }),
        };
        Ok((names.into_iter().collect(), next))
    }

    /// Holders and waiters of each of `names`, as [`inspect`](Backend::inspect) reads them.
    /// The inspect script runs for all of them in one pipeline, sent to the server that
    /// holds `slot` (in a Cluster the master a [`scan`](RedisBackend::scan) of it found
    /// them on). The states' hints are [`WaitHint::none`]. A name whose keys do not read
    /// as a lock is logged and reads as free.
    pub(crate) async fn inspect_all(
        &self,
        names: &[LockName],
        slot: u16,
    ) -> Result<Vec<LockState>> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let call = &self.calls().inspect;
        let mut pipeline = redis::Pipeline::with_capacity(names.len());
        for name in names {
            pipeline.add_command(call.cmd(&self.keys(name), &Values::of(&probe(name))));
        }
        let connection = &self.inner.conn;
        let mut conn = connection.for_request().await?;
        let send = async |conn: &mut Link| {
            connection
                .pipeline_in(conn, slot, &pipeline)
                .await
                .map_err(|e| map_error(e, "(listing)"))
        };
        let mut replies = send(&mut conn).await?;
        let no_script = |reply: &redis::Value| {
            matches!(reply, redis::Value::ServerError(e)
                if e.kind() == Some(redis::ServerErrorKind::NoScript))
        };
        if replies.iter().any(no_script) {
            call.script()
                .load_async(&mut conn)
                .await
                .map_err(|e| map_error(e, "(listing)"))?;
            replies = send(&mut conn).await?;
        }
        if replies.len() != names.len() {
            return Err(unexpected("a pipeline of inspects", replies.len()));
        }
        names
            .iter()
            .zip(replies)
            .map(|(name, reply)| {
                let state = reply
                    .extract_error()
                    .map_err(|e| map_error(e, name))
                    .and_then(|reply| Ok(reply::inspected(&reply)?.0));
                match state {
                    // Keys that do not read as a lock (written by something else): one
                    // such name must not stop every listing at its page.
                    Err(error) if !error.is_retryable() => {
                        tracing::warn!(lock = %name, %error, "listing: left out");
                        Ok(LockState::default())
                    }
                    state => state,
                }
            })
            .collect()
    }

    async fn wait_for_replicas(&self, req: &Request, ack: ReplicaAck) -> Result<()> {
        let what = format!("the grant of {}", req.name);
        let Some(problem) = self.replicas_short(&req.name, ack, &what).await? else {
            return Ok(());
        };
        if !ack.required {
            tracing::warn!("{problem}; keeping it");
            return Ok(());
        }
        self.release_script(req, &self.keys(&req.name)).await?;
        Err(Error::backend(format!("{problem}; released it"), true))
    }

    /// `WAIT`s for `ack`'s replicas on the server of `name`.
    /// `None` if they acknowledged its writes so far, else what fell short (`what` names
    /// the write).
    async fn replicas_short(
        &self,
        name: &LockName,
        ack: ReplicaAck,
        what: &str,
    ) -> Result<Option<String>> {
        let mut conn = self.inner.conn.for_request().await?;
        let mut wait = redis::cmd("WAIT");
        wait.arg(ack.replicas).arg(millis_up(ack.timeout));
        let keys = self.keys(name);
        let acked: i64 = (self.inner.conn)
            .query_at(&mut conn, keys.channel(), &wait)
            .await
            .map_err(|e| map_error(e, name))?;
        Ok((acked < i64::from(ack.replicas)).then(|| {
            format!(
                "only {acked} of {} replicas acknowledged {what} within {:?}",
                ack.replicas, ack.timeout
            )
        }))
    }

    /// Deletes the record under `key` beside `name` if it is still `value` (`lua/drop_record.lua`).
    /// For a Redlock node whose write did not make a majority: whether it deleted it.
    pub(crate) async fn drop_record(
        &self,
        name: &LockName,
        key: &RecordKey,
        value: &[u8],
    ) -> Result<bool> {
        let req = probe(name);
        let values = Values {
            record: value,
            record_key: key.as_str(),
            ..Values::of(&req)
        };
        let call = &self.calls().drop_record;
        let answer: i64 = self.run(call, &self.keys(name), &values).await?;
        reply::yes_or_no(answer, call.name)
    }
}

/// `keep` in whole milliseconds, rounded up, as a record's `PX`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] past half of what Redis can expire (about 146 million
/// years): it refuses an expiry whose end overflows its clock, ms since 1970 in an i64.
pub(crate) fn keep_millis(keep: Duration) -> Result<u64> {
    let ms = millis_up(keep);
    if ms > i64::MAX.unsigned_abs() / 2 {
        return Err(Error::invalid(
            "record keep",
            format!("{keep:?} is longer than redis can keep a key"),
        ));
    }
    Ok(ms)
}

/// How long a renewal that found its grant gone looks for an eviction record of it.
/// Past that the loss is reported as [`LossReason::NotOwner`].
const LOSS_LOOKUP: Duration = Duration::from_millis(500);

#[async_trait]
impl Backend for RedisBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("redis", TokenDurability::WhileServerKeepsData);
        caps.expiring_leases = true;
        caps.fair = true;
        caps.push_wakeups = true;
        caps.shared = true;
        caps.permits = true;
        caps.lock_delay = true;
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let keys = self.keys(&req.name);
        let (mut answer, broken) = self.acquire_checked(req, &keys).await?;
        if let (Acquire::Granted(grant), Some(floor)) = (&answer, broken) {
            tracing::warn!(lock = %req.name, token = grant.token.get(), seen = floor,
                "redis handed out a fencing token not above one already seen (it lost data: \
                 failover or restart); raising its counter and granting again");
            let handoff = grant.handoff;
            self.release_script(req, &keys).await?;
            self.raise(req, floor).await?;
            let broken;
            (answer, broken) = self.acquire_checked(req, &keys).await?;
            // The hand-off was the first grant's; the second follows our own release.
            if let Acquire::Granted(grant) = answer {
                answer = Acquire::Granted(grant.with_handoff(handoff));
            }
            if broken.is_some() {
                self.release_script(req, &keys).await?;
                return Err(Error::backend(
                    format!(
                        "redis keeps handing out stale fencing tokens for {}",
                        req.name
                    ),
                    false,
                ));
            }
        }
        if let Acquire::Granted(grant) = &answer {
            self.floors()
                .record(&req.name, grant.token.get(), &req.owner);
            if let Some(ack) = self.inner.conn.options().replica_ack() {
                self.wait_for_replicas(req, ack).await?;
            }
        }
        Ok(answer)
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        let keys = self.keys(&req.name);
        let call = self.calls().renew_of(req);
        let renewed: i64 = self.run(call, &keys, &Values::of(req)).await?;
        Ok(if reply::yes_or_no(renewed, call.name)? {
            Renewal::Renewed(Expiry::After(Duration::from_millis(millis_up(req.ttl))))
        } else {
            Renewal::Lost(self.loss_reason(req, &keys).await)
        })
    }

    /// Renews the plain exclusive grants in one script call (`lua/renew_many.lua`).
    /// Those are the grants without a lock-delay or a stored value; the others are renewed
    /// one by one at the same time. A grant the batch
    /// finds with waiters about (its lease written in its value) is renewed alone after it.
    /// In a Cluster, where one script cannot reach keys of other slots, each goes alone.
    ///
    /// # Cancel safety
    ///
    /// As `renew`'s: dropped before the answers, any of the grants may have been extended.
    async fn renew_many(&self, reqs: &[&Request]) -> Vec<Result<Renewal>> {
        let (batched, alone): (Vec<usize>, Vec<usize>) =
            (0..reqs.len()).partition(|&i| renews_in_batch(reqs[i]));
        if batched.len() < 2 || self.inner.conn.is_cluster() {
            return join_all(reqs.iter().map(|req| self.renew(req))).await;
        }
        let batch: Vec<&Request> = batched.iter().map(|&i| reqs[i]).collect();
        let (codes, alone_answers) = tokio::join!(
            self.renew_batch(&batch),
            join_all(alone.iter().map(|&i| self.renew(reqs[i])))
        );
        let mut answers: Vec<Option<Result<Renewal>>> = reqs.iter().map(|_| None).collect();
        for (i, answer) in alone.into_iter().zip(alone_answers) {
            answers[i] = Some(answer);
        }
        let codes = match codes {
            Ok(codes) if codes.len() == batch.len() => Ok(codes),
            Ok(codes) => Err(unexpected("a batch of renewals", codes)),
            Err(error) => Err(error),
        };
        match codes {
            Ok(codes) => {
                // A renewed grant is answered here; the few that need another request
                // (the loss's reason, a full renewal) make it at the same time.
                let mut others = Vec::new();
                for (i, code) in batched.into_iter().zip(codes) {
                    let req = reqs[i];
                    match code {
                        1 => {
                            let lease = Duration::from_millis(millis_up(req.ttl));
                            answers[i] = Some(Ok(Renewal::Renewed(Expiry::After(lease))));
                        }
                        0 | 2 => others.push((i, code)),
                        other => answers[i] = Some(Err(unexpected("a batch of renewals", other))),
                    }
                }
                let each = others.iter().map(|&(i, code)| async move {
                    let req = reqs[i];
                    if code == 0 {
                        let reason = self.loss_reason(req, &self.keys(&req.name)).await;
                        Ok(Renewal::Lost(reason))
                    } else {
                        self.renew(req).await
                    }
                });
                for ((i, _), answer) in others.iter().zip(join_all(each).await) {
                    answers[*i] = Some(answer);
                }
            }
            Err(error) => {
                for i in batched {
                    answers[i] = Some(Err(error.clone()));
                }
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| Err(unexpected("a batch of renewals", "none"))))
            .collect()
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let keys = self.keys(&req.name);
        Ok(if self.release_script(req, &keys).await? {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(hint) = hint.get::<Hint>() else {
            return Ok(());
        };
        if !hint.subscribed() {
            // Subscribe, then let the caller try again with the subscription in place.
            return self
                .inner
                .wakeups
                .subscribe(&self.inner.conn, hint.channel())
                .await;
        }
        self.inner.wakeups.wait(hint, max).await;
        Ok(())
    }

    /// A grant a release handed over (`lua/release.lua`), told by the wake-up.
    /// Its lease is the waiter entry's: `req.ttl` from when the request that queued it ran.
    /// With replicas to wait for, or a token not above one seen (see `acquire`), it is
    /// left to the next acquire, which adopts it (and checks all that).
    async fn handed(&self, req: &Request, hint: &WaitHint) -> Option<Grant> {
        let token = hint.get::<Hint>()?.handed()?;
        if self.inner.conn.options().replica_ack().is_some() {
            return None;
        }
        let mut floors = self.floors();
        if Floor::broken_by(floors.get(&req.name).as_ref(), token, &req.owner).is_some() {
            return None;
        }
        floors.record(&req.name, token, &req.owner);
        let lease = Expiry::After(Duration::from_millis(millis_up(req.ttl)));
        Some(Grant::new(FencingToken::new(token), lease).with_handoff(Some(Duration::ZERO)))
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let keys = self.keys(name);
        let ticket = self.inner.wakeups.ticket(keys.channel(), None);
        let reply: redis::Value = self
            .run(&self.calls().inspect, &keys, &Values::of(&probe(name)))
            .await?;
        let (mut state, retry) = reply::inspected(&reply)?;
        state.hint = WaitHint::new(Hint::new(keys.channel(), ticket, retry));
        Ok(state)
    }

    /// Force-releases the grant `eviction` names, in one script (`lua/evict.lua`).
    ///
    /// Atomically on the server: checks the grant's owner and token, removes it, keeps
    /// `mode`'s set closed to new grants until the evicted lease would have ended (longer
    /// if the grant's own lock-delay says so), records the eviction (the last 10 of the
    /// name, kept 7 days after the latest) and wakes the name's waiters to look again.
    ///
    /// # Cancel safety
    ///
    /// The script runs whole or not at all: dropped before its reply, the eviction may or
    /// may not have happened, and calling again with the same eviction answers `false`
    /// if it did.
    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        let keys = self.keys(name);
        let req = Request::new(
            name.clone(),
            eviction.owner.clone(),
            mode,
            Duration::from_millis(1),
        );
        let record = eviction::encode(eviction);
        let values = Values {
            grant: eviction.token.get(),
            record: record.as_bytes(),
            ..Values::of(&req)
        };
        let call = &self.calls().evict;
        let answer: i64 = self.run(call, &keys, &values).await?;
        reply::yes_or_no(answer, call.name)
    }

    /// Writes the record in one script (`lua/put_record.lua`), if `req`'s grant holds.
    ///
    /// The script checks the grant as a renewal does (the exclusive holder in the lock
    /// key's value, or an unexpired entry of the readers' or permits' set) and then sets
    /// `<prefix>:{<name>}:rec:<key>` with `PX keep`: in the lock's Cluster slot, expiring
    /// on the server's clock, and not a key a listing looks for. With `replicas=N` it then
    /// `WAIT`s for the replicas, as a grant does.
    ///
    /// # Cancel safety
    ///
    /// The script runs whole or not at all: dropped before its reply, the record may or
    /// may not be written; writing it again is harmless.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a `keep` past what Redis can expire; with
    /// `replicas_required`, a retryable [`Error::Backend`] if the replicas did not
    /// acknowledge the record (it is written on the master, and may be lost in a failover).
    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        let keep_ms = keep_millis(keep)?;
        let values = Values {
            record: value,
            keep_ms,
            record_key: key.as_str(),
            ..Values::of(req)
        };
        let call = &self.calls().put_record;
        let answer: i64 = self.run(call, &self.keys(&req.name), &values).await?;
        if !reply::yes_or_no(answer, call.name)? {
            return Ok(false);
        }
        if let Some(ack) = self.inner.conn.options().replica_ack() {
            let what = format!("the record {key} of {}", req.name);
            if let Some(problem) = self.replicas_short(&req.name, ack, &what).await? {
                if ack.required {
                    return Err(Error::backend(problem, true));
                }
                tracing::warn!("{problem}; keeping it");
            }
        }
        Ok(true)
    }

    /// Reads the record with a `GET` on the master (in a Cluster, of the lock's slot).
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if the key holds data of another type (not written by leasehold).
    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        let mut get = redis::cmd("GET");
        self.keys(name).write_record(&mut get, key.as_str());
        let connection = &self.inner.conn;
        let mut conn = connection.for_request().await?;
        connection
            .query(&mut conn, &get)
            .await
            .map_err(|e| map_error(e, name))
    }

    /// Renews `req`'s grant to end `hold` from now, and wakes the name's waiters.
    /// The renewal script with the ttl `hold`: its `PEXPIRE`, lease end in the lock value
    /// or zset score is set, not extended, so a shorter `hold` shortens the lease; waiters
    /// told of the old end look again.
    ///
    /// # Cancel safety
    ///
    /// One script, whole or not at all: dropped, the grant ends at the end of its last
    /// lease or `hold` after the script ran.
    ///
    /// # Errors
    ///
    /// Backend errors; the grant then ends at one of those two ends.
    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        let mut kept = req.clone();
        kept.ttl = hold;
        let call = &self.calls().keep;
        let answer: i64 = self
            .run(call, &self.keys(&req.name), &Values::of(&kept))
            .await?;
        reply::yes_or_no(answer, call.name)
    }

    /// One page of the locks under `prefix`.
    /// A `SCAN` for their keys, then one pipeline of inspects of the names it found (two
    /// round trips; a third in a Cluster when a master's scan ends).
    ///
    /// The cursor is the `SCAN` cursor, in a Cluster with the master scanned: its lowest
    /// slot. Holders' `held` is `None`: the server does not record when a grant was made.
    ///
    /// # Cancel safety
    ///
    /// Read-only; dropping the future changes nothing on the server.
    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        let cluster = self.inner.conn.is_cluster();
        let at = match cursor {
            None => Position::start(cluster),
            Some(cursor) => Position::parse(cursor.as_str(), cluster)?,
        };
        let (names, next) = self.scan(prefix, at, page).await?;
        let states = self.inspect_all(&names, at.slot()).await?;
        let locks = names
            .into_iter()
            .zip(states)
            .filter(|(_, state)| !state.holders.is_empty() || !state.waiters.is_empty())
            .collect();
        Ok(Listing::new(
            locks,
            next.map(|next| ListCursor::new(next.to_string())),
        ))
    }

    /// A feed of the server's invalidations of the keys of the locks under `prefix`.
    ///
    /// On a connection of the feed's own, `CLIENT TRACKING ON BCAST PREFIX
    /// <key prefix>:{<prefix>` (Redis 6 or later): the server pushes every write, deletion,
    /// expiry and eviction of those keys, and each lock key is turned back into its name.
    /// Through Sentinel the feed follows the master; in a Cluster it tracks on every master
    /// and follows their changes. A new connection (after a loss, a move or a change of
    /// masters) and a flush of the server's tracking state are each followed by a
    /// [`Change::Resync`](leasehold_core::backend::Change::Resync). Locking costs nothing
    /// more while nobody watches.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, the connections it opened are closed.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a server without `CLIENT TRACKING`; [`Error::Backend`]
    /// for a user that may not run it; [`Error::Unavailable`] if a server cannot be reached.
    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        changes::server_feed(&self.inner.conn, prefix).await
    }
}

/// The request an inspect passes: the script reads only the name's keys.
fn probe(name: &LockName) -> Request {
    Request::new(
        name.clone(),
        OwnerId::parse("inspect").unwrap_or_else(|_| OwnerId::generate()),
        Mode::Exclusive,
        Duration::from_millis(1),
    )
}
