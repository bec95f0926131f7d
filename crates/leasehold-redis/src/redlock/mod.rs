//! Redlock: one lock over N independent Redis masters, held while a majority holds it.
//!
//! - Every request goes to all N nodes at once, each bounded by a node timeout small next
//!   to the lease; a grant needs a majority (N/2 + 1) and time left: it is reported with a
//!   lease of `ttl − elapsed`, so the holder's deadline is `T1 + ttl − elapsed − drift`.
//! - A failed attempt releases on *every* node, including those that failed or timed out.
//! - Renewal extends on all nodes and counts only if a majority extended.
//! - Fencing: each node's grant increments its own counter; the grant takes the highest
//!   token of its majority and, unless a majority already answered with that token, writes
//!   it back to a majority (a second round) before the guard is returned. Any later
//!   grant's majority meets that one in at least one node, so its token is higher. That
//!   holds as long as nodes do not lose data. A node answers every grant with a token
//!   drawn now, also a retry that finds the owner holding there already (the token stored
//!   by the earlier attempt may lie below grants made since).
//! - A node that restarted refuses grants for a quarantine (by default the request's ttl),
//!   so that the locks it may have forgotten expire everywhere first.
//! - Configurations that break the quorum are refused: no nodes, or one server twice
//!   (by address, or by run id behind different addresses). An even N is warned about.
//! - Connecting returns once a majority of nodes is connected; the others are connected in
//!   the background and used once their run id is checked.
//! - Waiters queue on every node in one order, by when their acquisitions began (each
//!   client's clock); a release wakes only the head of each node's queue, which tries again
//!   once a majority of nodes woke it. A grant that made no majority goes back to the
//!   queue at its place, waking nobody behind it. No herd, and no split vote between
//!   waiters woken together.
//!
//! See `docs/backends/redlock.md` for what this can and cannot promise.
//!
//! The folder: `options.rs` (options and URL parameters), `connect.rs` (refused
//! configurations, reaching the nodes), `quorum.rs` (the majority arithmetic),
//! `listing.rs` (listing over the nodes, and what a majority holds), this file (the
//! [`Backend`]). Each node is a `Node` (`../node.rs`): the few requests Redlock
//! makes of a Redis server.

mod connect;
mod listing;
mod options;
mod quorum;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Changes, Eviction, Expiry, Grant, ListCursor, Listing,
    LockState, Mode, Release, Renewal, Request, TokenDurability, WaitHint,
};
use leasehold_core::{Error, LockName, LossReason, NamePrefix, RecordKey, Result};

use crate::backend::keep_millis;
use crate::changes::{Feed, track_node};
use crate::node::Node;
use listing::Place;
pub use options::RedlockOptions;
use quorum::{Majority, validity};

/// Locks held by a majority of independent Redis masters.
#[derive(Debug, Clone)]
pub struct RedlockBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    nodes: Arc<connect::Nodes>,
    majority: Majority,
    options: RedlockOptions,
    warnings: Vec<String>,
}

/// What a busy Redlock attempt hands to `wait`: the nodes' own hints.
#[derive(Debug)]
struct Hint {
    nodes: Vec<WaitHint>,
    /// Upper bound of the random pause after a wake-up (zero after a plain busy answer).
    /// After a split vote it keeps those that split it from meeting again at once.
    jitter: Duration,
}

impl RedlockBackend {
    /// Connects to `redlock://[user:password@]host:port,host:port,...[/db][?params]`.
    ///
    /// Parameters: `prefix`, `connect_timeout`, `node_timeout` (default `50ms`), `fencing`
    /// (`true`/`false`), `quarantine` (a duration), `tls`, `tls_ca`, `tls_cert`, `tls_key`.
    ///
    /// Returns once a majority of the nodes is connected (each attempt bounded by the
    /// connect timeout) and the others had `node_timeout` more; nodes not connected by then
    /// are tried again in the background, with backoff, and used once connected. A node is
    /// used only after its run id is checked against the others': one found to be another
    /// node's server is refused here, or left out (and logged) if found later.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection attempt.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a malformed URL, no nodes, or a node given twice
    /// (credentials redacted); [`Error::Unavailable`] if fewer than a majority of the nodes
    /// can be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        let (nodes, options) = options::parse_url(url)?;
        Self::connect_nodes(&nodes, options).await
    }

    /// Connects to the nodes at `urls` (`redis://…` each).
    ///
    /// # Cancel safety
    ///
    /// As for [`connect`](RedlockBackend::connect).
    ///
    /// # Errors
    ///
    /// As for [`connect`](RedlockBackend::connect).
    pub async fn connect_nodes(urls: &[String], options: RedlockOptions) -> Result<Self> {
        let (nodes, warnings) = connect::connect(urls, &options).await?;
        for warning in &warnings {
            tracing::warn!("redlock: {warning}");
        }
        Ok(Self {
            inner: Arc::new(Inner {
                majority: Majority::of(urls.len()),
                nodes,
                options,
                warnings,
            }),
        })
    }

    /// Configuration problems found on connecting.
    /// An even number of nodes, nodes not connected yet.
    pub fn warnings(&self) -> &[String] {
        &self.inner.warnings
    }

    /// How many lock names this client keeps wake-up state (and a subscription) for.
    /// It is summed over the nodes: see
    /// [`RedisBackend::wakeup_channels`](crate::RedisBackend::wakeup_channels).
    pub fn wakeup_channels(&self) -> usize {
        self.inner
            .nodes
            .connected()
            .map(Node::wakeup_channels)
            .sum()
    }

    /// The number of nodes that must agree.
    pub fn quorum(&self) -> usize {
        self.inner.majority.quorum()
    }

    /// Runs `call` on node `i`, bounded by the node timeout; an error if it is not connected (yet).
    async fn on<'a, T, F, Fut>(&'a self, i: usize, call: F) -> Result<T>
    where
        F: FnOnce(&'a Node) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let Some(node) = self.inner.nodes.get(i) else {
            return Err(Error::unavailable(format!(
                "redis node {} is not connected yet",
                i + 1
            )));
        };
        let limit = self.inner.options.node_timeout;
        let since = node.silence();
        tokio::time::timeout(limit, call(node))
            .await
            .unwrap_or_else(|_| {
                node.timed_out(since);
                Err(Error::Timeout(limit))
            })
    }

    /// Runs `call` on every node at once, each bounded by the node timeout.
    async fn each<'a, T, F, Fut>(&'a self, call: F) -> Vec<Result<T>>
    where
        F: Fn(&'a Node) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        join_all((0..self.inner.nodes.len()).map(|i| self.on(i, &call))).await
    }

    /// Runs `call` on every node at once, until the answers so far suffice or all have answered.
    /// Each call is bounded by the node timeout; `enough` says when the answers suffice.
    /// Requests still under way when it returns go on; their effects are covered by the
    /// caller.
    async fn until<'a, T, F, Fut>(
        &'a self,
        call: F,
        enough: impl Fn(&[(usize, Result<T>)]) -> bool,
    ) -> Vec<(usize, Result<T>)>
    where
        F: Fn(&'a Node) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let call = &call;
        let mut pending: FuturesUnordered<_> = (0..self.inner.nodes.len())
            .map(|i| async move { (i, self.on(i, call).await) })
            .collect();
        let mut answers = Vec::with_capacity(self.inner.nodes.len());
        while let Some(answer) = pending.next().await {
            answers.push(answer);
            if enough(&answers) {
                break;
            }
        }
        answers
    }

    /// Releases on every node.
    /// Errors are logged, a node that cannot be reached lets the lease run out.
    async fn release_everywhere(&self, req: &Request) -> Vec<Result<Release>> {
        let answers = self.each(|node| node.release(req)).await;
        for error in answers.iter().filter_map(|a| a.as_ref().err()) {
            tracing::debug!(lock = %req.name, %error, "redlock: release on a node failed");
        }
        answers
    }

    /// A busy answer.
    /// After a split vote (some nodes granted, no majority) the waiter retries after a
    /// random pause, so that those who split it do not meet again at once.
    fn busy(&self, req: &Request, hints: Vec<WaitHint>, split: bool) -> Acquire {
        let jitter = if split {
            (req.ttl / 10).clamp(Duration::from_millis(1), Duration::from_millis(20))
        } else {
            Duration::ZERO
        };
        Acquire::Busy(WaitHint::new(Hint {
            nodes: hints,
            jitter,
        }))
    }

    /// What each node is asked.
    /// Every request respects the nodes' queues, and a waiting one queues on every node at
    /// the place its acquisition's start gives it (see `NodeAcquire`), so that the nodes'
    /// queues agree.
    fn node_request(req: &Request) -> Request {
        let mut req = req.clone();
        req.fair = true;
        req
    }
}

#[async_trait]
impl Backend for RedlockBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("redlock", TokenDurability::WhileServerKeepsData);
        caps.expiring_leases = true;
        caps.push_wakeups = true;
        // Readers and writers exclude each other on the node their majorities share.
        caps.shared = true;
        caps.lock_delay = true;
        // Not offered: a semaphore does not compose over majorities (three holders can
        // each find a majority with a free slot among five nodes of two permits), and FIFO:
        // the nodes' queues agree on one order, but it is the order of the clients' clocks.
        // Waiters always queue (`fair(false)` does not change that; see `node_request`).
        caps.permits = false;
        caps.fair = false;
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let node_req = Self::node_request(req);
        let quarantine = self.inner.options.quarantine.unwrap_or(req.ttl);
        let majority = self.inner.majority;
        let started = std::time::Instant::now();
        // Done as soon as a majority granted: a node that grants later grants to the same
        // owner, and renewal and release reach every node.
        let answers = self
            .until(
                |node| node.acquire(&node_req, quarantine),
                |answers| {
                    majority.reached(
                        answers
                            .iter()
                            .filter(|(_, a)| matches!(a, Ok(Acquire::Granted(_))))
                            .count(),
                    )
                },
            )
            .await;
        let mut tokens = Vec::new();
        // Each node's hand-off, on its own clock. The least: a node whose gate is older than
        // the last release (a split vote left it ungranted) overstates it.
        let mut handoff = None;
        let mut hints = vec![WaitHint::none(); self.inner.nodes.len()];
        // Nodes where a grant exists or may exist (no answer): released on failure. Nodes
        // that answered busy keep the waiter entry (a waiting writer keeps readers out).
        let mut to_release = Vec::new();
        let mut answered = 0;
        for (i, answer) in answers {
            match answer {
                Ok(Acquire::Granted(grant)) => {
                    answered += 1;
                    tokens.push(grant.token);
                    handoff = handoff.into_iter().chain(grant.handoff).min();
                    to_release.push(i);
                }
                Ok(Acquire::Busy(hint)) => {
                    answered += 1;
                    hints[i] = hint;
                }
                Err(_) => to_release.push(i),
            }
        }
        // A majority whose counters already stand at the token needs no write-back: the
        // write-back would leave the same state (the next grant's majority meets one of
        // them, whose INCR goes above the token).
        if let Some((token, write_back)) = majority.granted(&tokens) {
            let written = if self.inner.options.fencing && write_back {
                let ok = |answers: &[(usize, Result<()>)]| {
                    answers.iter().filter(|(_, a)| a.is_ok()).count()
                };
                let raised = self
                    .until(
                        |node| node.raise(&node_req, token.get()),
                        |answers| majority.reached(ok(answers)),
                    )
                    .await;
                ok(&raised)
            } else {
                self.inner.nodes.len()
            };
            if majority.reached(written)
                && let Some(left) = validity(Node::lease(req.ttl), started.elapsed())
            {
                return Ok(Acquire::Granted(
                    Grant::new(token, Expiry::After(left)).with_handoff(handoff),
                ));
            }
        }
        // Not granted: give back every part, also where the answer was lost. Without enough
        // answers it is not contention but an outage: release everywhere.
        if majority.release_everywhere(answered, tokens.len()) {
            self.release_everywhere(&node_req).await;
        } else {
            // A split vote: a waiter keeps its place, and giving its grants back wakes
            // nobody behind it, so the nodes' queues still agree on who goes next.
            let node_req = &node_req;
            join_all(
                to_release
                    .into_iter()
                    .map(|i| self.on(i, move |node| node.give_back(node_req))),
            )
            .await;
        }
        if !majority.reached(answered) {
            return Err(Error::unavailable(format!(
                "only {answered} of {} redis nodes answered; a majority ({}) is needed",
                self.inner.nodes.len(),
                majority.quorum()
            )));
        }
        Ok(self.busy(req, hints, !tokens.is_empty()))
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        let node_req = Self::node_request(req);
        let started = std::time::Instant::now();
        let answers = self.each(|node| node.renew(&node_req)).await;
        let renewed = answers
            .iter()
            .filter(|a| matches!(a, Ok(Renewal::Renewed(_))))
            .count();
        let gone = answers
            .iter()
            .filter(|a| matches!(a, Ok(Renewal::Lost(_))))
            .count();
        let majority = self.inner.majority;
        if majority.reached(renewed) {
            let left = validity(Node::lease(req.ttl), started.elapsed());
            return Ok(Renewal::Renewed(Expiry::After(left.unwrap_or_default())));
        }
        if majority.out_of_reach(gone) {
            // Too few nodes still hold it for a majority ever to renew again. An eviction
            // is what took it where a node says so (owner ids are never reused).
            let evicted = answers
                .iter()
                .any(|a| matches!(a, Ok(Renewal::Lost(LossReason::Evicted))));
            return Ok(Renewal::Lost(if evicted {
                LossReason::Evicted
            } else {
                LossReason::NotOwner
            }));
        }
        Err(Error::unavailable(format!(
            "only {renewed} of {} redis nodes renewed {}; a majority ({}) is needed",
            self.inner.nodes.len(),
            req.name,
            majority.quorum()
        )))
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let answers = self.release_everywhere(&Self::node_request(req)).await;
        if answers.iter().any(|a| matches!(a, Ok(Release::Released))) {
            return Ok(Release::Released);
        }
        // Not held only if a majority says so: the grant had a majority, and the nodes that
        // did not answer may be where it still was.
        let not_held = answers
            .iter()
            .filter(|a| matches!(a, Ok(Release::NotHeld)))
            .count();
        if self.inner.majority.reached(not_held) {
            return Ok(Release::NotHeld);
        }
        Err(Error::unavailable(format!(
            "only {not_held} of {} redis nodes answered the release of {}",
            self.inner.nodes.len(),
            req.name
        )))
    }

    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(hint) = hint.get::<Hint>() else {
            return Ok(());
        };
        let nodes = &self.inner.nodes;
        let with_hints = || {
            hint.nodes
                .iter()
                .enumerate()
                .filter_map(|(i, h)| Some((nodes.get(i)?, h)))
        };
        // First make sure every node will push a wake-up (a node's first wait subscribes
        // and returns).
        let unsubscribed: Vec<_> = with_hints()
            .filter(|(_, h)| Node::must_subscribe(h))
            .collect();
        if !unsubscribed.is_empty() {
            join_all(
                unsubscribed
                    .into_iter()
                    .map(|(node, h)| node.wait(name, h, max)),
            )
            .await;
            return Ok(());
        }
        let mut waits: FuturesUnordered<_> = with_hints()
            .filter(|(_, h)| Node::can_wait(h))
            .map(|(node, h)| node.wait(name, h, max))
            .collect();
        if waits.is_empty() {
            // Nothing to wait on (the request will not wait): pause as after a split vote.
            tokio::time::sleep(hint.jitter.max(Duration::from_millis(1)).min(max)).await;
            return Ok(());
        }
        // Each node wakes only the head of its queue: once one has, the head is this waiter
        // on the others too (their queues agree), and it tries again when enough of them
        // have woken it to make a majority. A release goes to every node at once, so their
        // wake-ups come within a round trip of each other: one later than the node timeout
        // (a node with another waiter at its head, the queues disagreeing for a moment) is
        // not waited for.
        let enough = self.inner.majority.quorum().min(waits.len());
        let _ = waits.next().await;
        let _ = tokio::time::timeout(self.inner.options.node_timeout, async {
            for _ in 1..enough {
                let _ = waits.next().await;
            }
        })
        .await;
        if !hint.jitter.is_zero() {
            let pause = rand::random_range(Duration::ZERO..=hint.jitter);
            tokio::time::sleep(pause).await;
        }
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let answers = self.each(|node| node.inspect(name)).await;
        let mut hints = Vec::new();
        let mut states = Vec::new();
        for answer in answers {
            match answer {
                Ok(mut state) => {
                    hints.push(std::mem::take(&mut state.hint));
                    states.push(state);
                }
                Err(_) => hints.push(WaitHint::none()),
            }
        }
        let mut state = listing::merged(self.inner.majority, states);
        state.hint = WaitHint::new(Hint {
            nodes: hints,
            jitter: Duration::ZERO,
        });
        Ok(state)
    }

    /// Force-releases the grant `eviction` names on every node; `true` if a majority evicted it.
    ///
    /// Each node removes the grant only where it holds it with the eviction's token (the
    /// majority's, see [`inspect`](Backend::inspect)), closes the name there until that
    /// lease would have ended, and records the eviction. Once a majority evicted it, no
    /// majority can be granted the name before the evicted lease ends, and the holder's
    /// next renewal finds it lost.
    ///
    /// # Cancel safety
    ///
    /// Each node's eviction is one script, whole or not at all: dropped midway, the grant
    /// may be evicted on some nodes only, each of them closed and recorded; evicting again
    /// finishes the rest.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if too few nodes answered to tell whether a majority evicted.
    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        let answers = self.each(|node| node.evict(name, mode, eviction)).await;
        let evicted = answers.iter().filter(|a| matches!(a, Ok(true))).count();
        let refused = answers.iter().filter(|a| matches!(a, Ok(false))).count();
        let majority = self.inner.majority;
        if majority.reached(evicted) {
            return Ok(true);
        }
        if majority.out_of_reach(refused) {
            return Ok(false);
        }
        for error in answers.iter().filter_map(|a| a.as_ref().err()) {
            tracing::debug!(lock = %name, %error, "redlock: an eviction on a node failed");
        }
        Err(Error::unavailable(format!(
            "only {evicted} of {} redis nodes evicted {name} and {refused} did not hold it; \
             a majority ({}) is needed either way",
            self.inner.nodes.len(),
            majority.quorum()
        )))
    }

    /// Writes the record on every node where `req`'s grant holds; `true` if a majority wrote it.
    ///
    /// Each node checks the grant and writes in one script (see
    /// [`RedisBackend::put_record`](crate::RedisBackend::put_record)). A write that falls
    /// short of a majority is taken back, best effort, on every node that did not refuse
    /// it — deleted where the record is still this value, so never a later holder's — so
    /// that a record a majority did not take does not close anything (see
    /// [`get_record`](Backend::get_record)).
    ///
    /// # Cancel safety
    ///
    /// Dropped midway, the record may be written on some nodes and not taken back; writing
    /// it again is harmless.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a `keep` past what Redis can expire;
    /// [`Error::Unavailable`] if too few nodes answered to tell whether a majority wrote it.
    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        keep_millis(keep)?;
        let node_req = Self::node_request(req);
        let answers = self
            .each(|node| node.put_record(&node_req, key, value, keep))
            .await;
        let written = answers.iter().filter(|a| matches!(a, Ok(true))).count();
        let refused = answers.iter().filter(|a| matches!(a, Ok(false))).count();
        let majority = self.inner.majority;
        if majority.reached(written) {
            return Ok(true);
        }
        let undo = (answers.iter().enumerate())
            .filter(|(_, a)| !matches!(a, Ok(false)))
            .map(|(i, _)| self.on(i, |node| node.drop_record(&req.name, key, value)));
        for error in join_all(undo).await.iter().filter_map(|a| a.as_ref().err()) {
            tracing::debug!(lock = %req.name, %key, %error,
                "redlock: taking back a record a majority did not write failed");
        }
        if majority.out_of_reach(refused) {
            return Ok(false);
        }
        let error = answers.iter().find_map(|a| a.as_ref().err());
        Err(Error::unavailable(format!(
            "only {written} of {} redis nodes wrote the record {key} of {} and {refused} refused \
             it; a majority ({}) is needed either way{}",
            self.inner.nodes.len(),
            req.name,
            majority.quorum(),
            error.map(|e| format!(" ({e})")).unwrap_or_default()
        )))
    }

    /// The record under `key` beside `name`, as read from every node.
    /// It is the value found on the most nodes, any record before none: a record written
    /// by a majority before a release is on at least one node of any majority that
    /// answers, so a later grant sees it. Of values found on equally many nodes, the
    /// greatest is taken.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if fewer than a majority of the nodes answered.
    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        let answers = self.each(|node| node.get_record(name, key)).await;
        let mut found: std::collections::BTreeMap<Vec<u8>, usize> = Default::default();
        let mut answered = 0;
        for answer in answers {
            match answer {
                Ok(value) => {
                    answered += 1;
                    if let Some(value) = value {
                        *found.entry(value).or_default() += 1;
                    }
                }
                Err(error) => {
                    tracing::debug!(lock = %name, %key, %error, "redlock: reading a record failed");
                }
            }
        }
        let majority = self.inner.majority;
        if !majority.reached(answered) {
            return Err(Error::unavailable(format!(
                "only {answered} of {} redis nodes answered a read of the record {key} of \
                 {name}; a majority ({}) is needed",
                self.inner.nodes.len(),
                majority.quorum()
            )));
        }
        // The most copies, then the greatest value: the last of the ascending order.
        Ok(found
            .into_iter()
            .max_by(|(a, n), (b, m)| n.cmp(m).then_with(|| a.cmp(b)))
            .map(|(value, _)| value))
    }

    /// Leaves `req`'s grant to end `hold` from now on every node; `true` if a majority kept it.
    /// Each node renews it with the ttl `hold` and wakes its waiters (as a single server's
    /// [`keep`](crate::RedisBackend::keep) does); the grant then expires by the nodes'
    /// clocks.
    ///
    /// # Cancel safety
    ///
    /// Dropped midway, each node ends the grant at the end of its last lease or `hold`
    /// after it applied the keep.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if too few nodes answered to tell whether a majority kept it.
    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        let node_req = Self::node_request(req);
        let answers = self.each(|node| node.keep(&node_req, hold)).await;
        let kept = answers.iter().filter(|a| matches!(a, Ok(true))).count();
        let gone = answers.iter().filter(|a| matches!(a, Ok(false))).count();
        let majority = self.inner.majority;
        if majority.reached(kept) {
            return Ok(true);
        }
        if majority.out_of_reach(gone) {
            return Ok(false);
        }
        Err(Error::unavailable(format!(
            "only {kept} of {} redis nodes kept {} and {gone} no longer held it; a majority \
             ({}) is needed either way",
            self.inner.nodes.len(),
            req.name,
            majority.quorum()
        )))
    }

    /// One page of the locks under `prefix` that a majority of the nodes holds.
    /// Or that any node queues. Each node still scanning runs one `SCAN`, then every node
    /// reads all the names found in one pipeline (two rounds, each node bounded by the
    /// node timeout).
    ///
    /// The cursor holds each node's `SCAN` cursor. A node that does not answer is left out
    /// for the rest of the listing; the listing fails once fewer than a majority are left.
    /// Holders' `held` is `None`: the nodes do not record when a grant was made.
    ///
    /// # Cancel safety
    ///
    /// Read-only; dropping the future changes nothing on the nodes.
    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        let nodes = self.inner.nodes.len();
        let mut places = match cursor {
            None => vec![Place::At(0); nodes],
            Some(cursor) => listing::places(cursor.as_str(), nodes)?,
        };
        let scans = join_all(places.iter().enumerate().map(|(i, &place)| async move {
            match place {
                Place::At(scan) => Some(self.on(i, |node| node.scan(prefix, scan, page)).await),
                Place::Done | Place::Gone => None,
            }
        }))
        .await;
        let mut names = BTreeSet::new();
        for (place, scan) in places.iter_mut().zip(scans) {
            match scan {
                Some(Ok((found, next))) => {
                    names.extend(found);
                    *place = next.map_or(Place::Done, Place::At);
                }
                Some(Err(error)) => {
                    tracing::debug!(%error, "redlock: a node left out of a listing");
                    *place = Place::Gone;
                }
                None => {}
            }
        }
        let names: Vec<LockName> = names.into_iter().collect();
        let names = &names;
        let read = join_all(places.iter().enumerate().map(|(i, &place)| async move {
            match place {
                Place::Gone => None,
                _ if names.is_empty() => Some(Ok(Vec::new())),
                Place::At(_) | Place::Done => {
                    Some(self.on(i, |node| node.inspect_all(names)).await)
                }
            }
        }))
        .await;
        let mut states = Vec::new();
        for (place, answer) in places.iter_mut().zip(read) {
            match answer {
                Some(Ok(answer)) => states.push(answer.into_iter()),
                Some(Err(error)) => {
                    tracing::debug!(%error, "redlock: a node left out of a listing");
                    *place = Place::Gone;
                }
                None => {}
            }
        }
        let majority = self.inner.majority;
        let gone = places.iter().filter(|&&p| p == Place::Gone).count();
        if majority.out_of_reach(gone) {
            return Err(Error::unavailable(format!(
                "{gone} of {nodes} redis nodes did not answer a listing; a majority ({}) is needed",
                majority.quorum()
            )));
        }
        let mut locks = Vec::new();
        for name in names {
            let copies: Vec<LockState> = states.iter_mut().filter_map(Iterator::next).collect();
            let state = listing::merged(majority, copies);
            if !state.holders.is_empty() || !state.waiters.is_empty() {
                locks.push((name.clone(), state));
            }
        }
        Ok(Listing::new(locks, listing::cursor(&places)))
    }

    /// Every node's feed of its invalidations of the keys of the locks under `prefix`, merged.
    ///
    /// Each node is tracked as a single server is (see
    /// [`RedisBackend::changes`](crate::RedisBackend)), on a connection of the feed's own.
    /// It returns once a majority of the nodes track the prefix: every grant, release and
    /// eviction is made on a majority, which meets this one. The other nodes are tried
    /// again in the background; one that joins later, or whose connection comes back, is
    /// followed by a [`Change::Resync`](leasehold_core::backend::Change::Resync). The feed
    /// goes on while any node is reachable. A lock is named once per node that changed it.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, the connections it opened are closed.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if too few nodes can be reached for a majority;
    /// [`Error::Unsupported`] for a node without `CLIENT TRACKING`; [`Error::Backend`] for
    /// a user that may not run it.
    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        let urls = self.inner.nodes.urls();
        let (feed, changes) = Feed::new("redlock", &self.inner.options.redis, prefix);
        let (first, mut firsts) = tokio::sync::mpsc::unbounded_channel();
        for url in urls {
            tokio::spawn(track_node(feed.clone(), url.clone(), first.clone()));
        }
        drop((feed, first));
        let majority = self.inner.majority;
        let (mut tracking, mut unreachable) = (0, 0);
        while !majority.reached(tracking) {
            match firsts.recv().await {
                Some(Ok(())) => tracking += 1,
                Some(Err(error)) if error.is_retryable() => {
                    unreachable += 1;
                    if majority.out_of_reach(unreachable) {
                        return Err(Error::unavailable(format!(
                            "redlock: a change feed reaches too few of {} redis nodes for a                              majority ({}): {error}",
                            urls.len(),
                            majority.quorum()
                        )));
                    }
                }
                Some(Err(error)) => return Err(error),
                None => return Err(Error::unavailable("redlock: a change feed reached no node")),
            }
        }
        Ok(changes)
    }
}
