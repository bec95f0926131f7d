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
//!   holds as long as nodes do not lose data.
//! - A node that restarted refuses grants for a quarantine (by default the request's ttl),
//!   so that the locks it may have forgotten expire everywhere first.
//! - Configurations that break the quorum are refused: no nodes, or one server twice
//!   (by address, or by run id behind different addresses). An even N is warned about.
//!
//! See `docs/backends/redlock.md` for what this can and cannot promise.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use futures_util::future::{join_all, select_all};
use futures_util::stream::FuturesUnordered;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Holder, LockState, Release, Renewal, Request,
    TokenDurability, WaitHint, Waiter,
};
use leasehold_core::{
    Error, FencingToken, LockName, LossReason, OwnerId, Result, parse_duration, redact_url,
};

use crate::{RedisBackend, RedisOptions, millis_up};

/// Options of a [`RedlockBackend`] (also settable as URL query parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedlockOptions {
    redis: RedisOptions,
    node_timeout: Duration,
    fencing: bool,
    quarantine: Option<Duration>,
}

impl Default for RedlockOptions {
    /// 50 ms per node, fencing write-back on, quarantine = each request's ttl, key prefix
    /// `leasehold`.
    fn default() -> Self {
        Self {
            redis: RedisOptions::default(),
            node_timeout: Duration::from_millis(50),
            fencing: true,
            quarantine: None,
        }
    }
}

impl RedlockOptions {
    /// Key prefix and connect timeout, as for a single server.
    pub fn redis(mut self, redis: RedisOptions) -> Self {
        self.redis = redis;
        self
    }

    /// How long one node may take to answer; keep it small next to the lease.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero or more than 10 s.
    pub fn node_timeout(mut self, timeout: Duration) -> Result<Self> {
        if timeout.is_zero() || timeout > Duration::from_secs(10) {
            return Err(Error::invalid(
                "node timeout",
                format!("{timeout:?} is not between 1 ms and 10 s"),
            ));
        }
        self.node_timeout = timeout;
        Ok(self)
    }

    /// `true` (the default): unless a majority already stands at the grant's token, write
    /// it back to a majority before the grant is used, so tokens strictly increase.
    /// `false`: never a second round, but tokens taken from different majorities may go
    /// backwards; do not fence with them.
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    /// How long a node refuses grants after it (re)started: it may have lost locks (an
    /// empty restart, or a snapshot older than the last grants). Must be at least the
    /// longest lease any client uses on these nodes; by default each request's own ttl.
    /// Zero turns the check off (then restart nodes only after the longest lease, or run
    /// them with `appendfsync always`).
    pub fn quarantine(mut self, quarantine: Duration) -> Self {
        self.quarantine = Some(quarantine);
        self
    }
}

/// Locks held by a majority of independent Redis masters.
#[derive(Debug, Clone)]
pub struct RedlockBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    nodes: Vec<RedisBackend>,
    quorum: usize,
    options: RedlockOptions,
    warnings: Vec<String>,
}

/// What a busy Redlock attempt hands to `wait`: the nodes' own hints.
#[derive(Debug)]
struct Hint {
    nodes: Vec<WaitHint>,
    /// Upper bound of the random pause after a wake-up, so that competitors woken together
    /// do not split the vote again.
    jitter: Duration,
}

impl RedlockBackend {
    /// Connects to `redlock://[user:password@]host:port,host:port,...[/db][?params]`.
    ///
    /// Parameters: `prefix`, `connect_timeout`, `node_timeout` (default `50ms`), `fencing`
    /// (`true`/`false`), `quarantine` (a duration).
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
        let (nodes, options) = parse_url(url)?;
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
        if urls.is_empty() {
            return Err(Error::invalid(
                "redlock nodes",
                "at least one node is needed",
            ));
        }
        refuse_same_address(urls).await?;
        let quorum = urls.len() / 2 + 1;
        let mut warnings = Vec::new();
        if urls.len().is_multiple_of(2) {
            warnings.push(format!(
                "{} nodes: an even number tolerates no more failures than {} nodes and needs a \
                 larger majority ({quorum}); use an odd number",
                urls.len(),
                urls.len() - 1
            ));
        }
        // Connect to all at once; nodes that are down now are reached lazily later.
        let eager = join_all(
            urls.iter()
                .map(|url| RedisBackend::open(url, options.redis.clone(), false)),
        )
        .await;
        let mut nodes = Vec::with_capacity(urls.len());
        let mut reached = Vec::new();
        for (url, node) in urls.iter().zip(eager) {
            match node {
                Ok(node) => {
                    reached.push((url, node.clone()));
                    nodes.push(node);
                }
                Err(error) => {
                    warnings.push(format!("{} is not reachable yet: {error}", redact_url(url)));
                    nodes.push(RedisBackend::open(url, options.redis.clone(), true).await?);
                }
            }
        }
        if reached.len() < quorum {
            return Err(Error::unavailable(format!(
                "only {} of {} redis nodes are reachable; a majority ({quorum}) is needed",
                reached.len(),
                urls.len()
            )));
        }
        // The same server behind two addresses (an alias, NAT) would count twice.
        let mut seen: HashMap<String, &String> = HashMap::new();
        for (url, node) in &reached {
            let id = node.run_id().await?;
            if let Some(first) = seen.insert(id, url) {
                return Err(Error::invalid(
                    "redlock nodes",
                    format!(
                        "{} and {} are the same redis server; every node must be independent",
                        redact_url(first),
                        redact_url(url)
                    ),
                ));
            }
        }
        for warning in &warnings {
            tracing::warn!("redlock: {warning}");
        }
        Ok(Self {
            inner: Arc::new(Inner {
                nodes,
                quorum,
                options,
                warnings,
            }),
        })
    }

    /// Configuration problems found on connecting (an even number of nodes, unreachable
    /// nodes).
    pub fn warnings(&self) -> &[String] {
        &self.inner.warnings
    }

    /// The number of nodes that must agree.
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// Runs `call` on every node at once, each bounded by the node timeout.
    async fn each<'a, T, F, Fut>(&'a self, call: F) -> Vec<Result<T>>
    where
        F: Fn(&'a RedisBackend) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let limit = self.inner.options.node_timeout;
        join_all(self.inner.nodes.iter().map(|node| {
            let request = call(node);
            async move {
                tokio::time::timeout(limit, request)
                    .await
                    .unwrap_or(Err(Error::Timeout(limit)))
            }
        }))
        .await
    }

    /// Runs `call` on every node at once (each bounded by the node timeout) and returns as
    /// soon as `enough` says the answers so far suffice, or all have answered. Requests
    /// still under way when it returns go on; their effects are covered by the caller.
    async fn until<'a, T, F, Fut>(
        &'a self,
        call: F,
        enough: impl Fn(&[(usize, Result<T>)]) -> bool,
    ) -> Vec<(usize, Result<T>)>
    where
        F: Fn(&'a RedisBackend) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let limit = self.inner.options.node_timeout;
        let mut pending: FuturesUnordered<_> = self
            .inner
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let request = call(node);
                async move {
                    let answer = tokio::time::timeout(limit, request)
                        .await
                        .unwrap_or(Err(Error::Timeout(limit)));
                    (i, answer)
                }
            })
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

    /// Releases on every node; errors are logged, a node that cannot be reached lets the
    /// lease run out.
    async fn release_everywhere(&self, req: &Request) -> Vec<Result<Release>> {
        let answers = self.each(|node| node.release(req)).await;
        for error in answers.iter().filter_map(|a| a.as_ref().err()) {
            tracing::debug!(lock = %req.name, %error, "redlock: release on a node failed");
        }
        answers
    }

    /// A busy answer. Waiters woken together retry after a random pause, so that they do
    /// not split the vote: up to 1 ms after a plain wake-up, longer after a split vote
    /// (some nodes granted, no majority).
    fn busy(&self, req: &Request, hints: Vec<WaitHint>, split: bool) -> Acquire {
        let jitter = if split {
            (req.ttl / 10).clamp(Duration::from_millis(1), Duration::from_millis(20))
        } else {
            Duration::from_millis(1)
        };
        Acquire::Busy(WaitHint::new(Hint {
            nodes: hints,
            jitter,
        }))
    }

    fn node_request(req: &Request) -> Request {
        // No FIFO across independent queues: each node would order waiters its own way.
        let mut req = req.clone();
        req.fair = false;
        req
    }
}

/// Refuses two URLs that resolve to a common address.
async fn refuse_same_address(urls: &[String]) -> Result<()> {
    let mut owners: HashMap<SocketAddr, &String> = HashMap::new();
    for url in urls {
        let authority = url
            .split_once("://")
            .map_or(url.as_str(), |(_, rest)| rest)
            .split(['/', '?'])
            .next()
            .unwrap_or_default();
        let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let Ok(addrs) = tokio::net::lookup_host(hostport).await else {
            continue; // unresolvable now: the connection attempt will say so
        };
        let addrs: HashSet<SocketAddr> = addrs.collect();
        for addr in addrs {
            if let Some(first) = owners.insert(addr, url)
                && first != url
            {
                return Err(Error::invalid(
                    "redlock nodes",
                    format!(
                        "{} and {} both reach {addr}; every node must be independent",
                        redact_url(first),
                        redact_url(url)
                    ),
                ));
            }
        }
    }
    let unique: HashSet<&String> = urls.iter().collect();
    if unique.len() != urls.len() {
        return Err(Error::invalid(
            "redlock nodes",
            "a node is listed twice; every node must be independent",
        ));
    }
    Ok(())
}

/// Splits `redlock://[auth@]h1:p1,h2:p2[/db][?params]` into node URLs and options.
fn parse_url(url: &str) -> Result<(Vec<String>, RedlockOptions)> {
    let shown = redact_url(url);
    let invalid = |reason: String| Error::invalid("url", format!("{shown}: {reason}"));
    let Some(rest) = url.strip_prefix("redlock://") else {
        return Err(invalid("expected redlock://host:port,host:port,...".into()));
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (auth, hosts) = match authority.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), authority),
    };
    let mut options = RedlockOptions::default();
    let mut scheme = "redis";
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = param.split_once('=').unwrap_or((param, ""));
        match key {
            "tls" => {
                let on: bool = value
                    .parse()
                    .map_err(|_| invalid(format!("tls={value:?} is not true or false")))?;
                scheme = if on { "rediss" } else { "redis" };
            }
            tls if options.redis.tls.read_param(tls, value)? => {}
            "prefix" => options.redis = options.redis.prefix(value)?,
            "connect_timeout" => {
                options.redis = options.redis.connect_timeout(parse_duration(value)?);
            }
            "node_timeout" => options = options.node_timeout(parse_duration(value)?)?,
            "quarantine" => options = options.quarantine(parse_duration(value)?),
            "fencing" => {
                options.fencing = value
                    .parse()
                    .map_err(|_| invalid(format!("fencing={value:?} is not true or false")))?;
            }
            other => {
                return Err(invalid(format!(
                    "unknown parameter {other:?}; known: prefix, connect_timeout, node_timeout, \
                     quarantine, fencing, tls, tls_ca, tls_cert, tls_key"
                )));
            }
        }
    }
    let nodes: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.trim().is_empty())
        .map(|h| format!("{scheme}://{auth}{}{path}", h.trim()))
        .collect();
    if nodes.is_empty() {
        return Err(invalid(
            "no nodes; list them as host:port,host:port,...".into(),
        ));
    }
    Ok((nodes, options))
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
        // each find a majority with a free slot among five nodes of two permits), and
        // independent queues cannot agree on one order.
        caps.permits = false;
        caps.fair = false;
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let node_req = Self::node_request(req);
        let quarantine = match self.inner.options.quarantine {
            Some(q) if q.is_zero() => 0,
            Some(q) => millis_up(q),
            None => millis_up(req.ttl),
        };
        let quorum = self.inner.quorum;
        let started = std::time::Instant::now();
        // Done as soon as a majority granted: a node that grants later grants to the same
        // owner, and renewal and release reach every node.
        let answers = self
            .until(
                |node| node.acquire_node(&node_req, quarantine),
                |answers| {
                    answers
                        .iter()
                        .filter(|(_, a)| matches!(a, Ok(Acquire::Granted(_))))
                        .count()
                        >= quorum
                },
            )
            .await;
        let mut tokens = Vec::new();
        let mut hints = vec![WaitHint::none(); self.inner.nodes.len()];
        // Nodes where a grant exists or may exist (no answer): released on failure. Nodes
        // that answered busy keep the waiter entry (a waiting writer keeps readers out).
        let mut to_release = Vec::new();
        let mut answered = 0;
        for (i, answer) in answers {
            let node = &self.inner.nodes[i];
            match answer {
                Ok(Acquire::Granted(grant)) => {
                    answered += 1;
                    tokens.push(grant.token);
                    to_release.push(node);
                }
                Ok(Acquire::Busy(hint)) => {
                    answered += 1;
                    hints[i] = hint;
                }
                Err(_) => to_release.push(node),
            }
        }
        if tokens.len() >= self.inner.quorum
            && let Some(&token) = tokens.iter().max()
        {
            // A majority whose counters already stand at the token needs no write-back:
            // the write-back would leave the same state (the next grant's majority meets
            // one of them, whose INCR goes above the token).
            let at_max = tokens.iter().filter(|&&t| t == token).count();
            let written = if self.inner.options.fencing && at_max < quorum {
                let raised = self
                    .until(
                        |node| node.raise_node(&node_req, token.get()),
                        |answers| answers.iter().filter(|(_, a)| a.is_ok()).count() >= quorum,
                    )
                    .await;
                raised.iter().filter(|(_, a)| a.is_ok()).count()
            } else {
                self.inner.nodes.len()
            };
            let ttl = Duration::from_millis(millis_up(req.ttl));
            let elapsed = started.elapsed();
            if written >= quorum && elapsed < ttl {
                return Ok(Acquire::Granted(Grant::new(
                    token,
                    Expiry::After(ttl - elapsed),
                )));
            }
        }
        // Not granted: give back every part, also where the answer was lost. Without enough
        // answers it is not contention but an outage: release everywhere.
        if answered < self.inner.quorum || tokens.len() >= self.inner.quorum {
            self.release_everywhere(&node_req).await;
        } else {
            let limit = self.inner.options.node_timeout;
            join_all(
                to_release
                    .into_iter()
                    .map(|node| tokio::time::timeout(limit, node.release(&node_req))),
            )
            .await;
        }
        if answered < self.inner.quorum {
            return Err(Error::unavailable(format!(
                "only {answered} of {} redis nodes answered; a majority ({}) is needed",
                self.inner.nodes.len(),
                self.inner.quorum
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
        let ttl = Duration::from_millis(millis_up(req.ttl));
        if renewed >= self.inner.quorum {
            return Ok(Renewal::Renewed(Expiry::After(
                ttl.saturating_sub(started.elapsed()),
            )));
        }
        if gone > self.inner.nodes.len() - self.inner.quorum {
            // Too few nodes still hold it for a majority ever to renew again.
            return Ok(Renewal::Lost(LossReason::NotOwner));
        }
        Err(Error::unavailable(format!(
            "only {renewed} of {} redis nodes renewed {}; a majority ({}) is needed",
            self.inner.nodes.len(),
            req.name,
            self.inner.quorum
        )))
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let answers = self.release_everywhere(&Self::node_request(req)).await;
        if answers.iter().any(|a| matches!(a, Ok(Release::Released))) {
            return Ok(Release::Released);
        }
        if answers.iter().any(Result::is_ok) {
            return Ok(Release::NotHeld);
        }
        Err(Error::unavailable(format!(
            "no redis node answered the release of {}",
            req.name
        )))
    }

    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        let Some(hint) = hint.get::<Hint>() else {
            return Ok(());
        };
        let nodes = &self.inner.nodes;
        // First make sure every node will push a wake-up (a node's first wait subscribes).
        let unsubscribed: Vec<_> = nodes
            .iter()
            .zip(&hint.nodes)
            .filter(|(_, h)| {
                h.get::<crate::wakeups::Ticket>()
                    .is_some_and(|t| !t.subscribed)
            })
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
        let waits: Vec<_> = nodes
            .iter()
            .zip(&hint.nodes)
            .filter(|(_, h)| h.get::<crate::wakeups::Ticket>().is_some())
            .map(|(node, h)| Box::pin(node.wait(name, h, max)))
            .collect();
        if waits.is_empty() {
            // Nothing to wait on (the request will not wait): pause as after a split vote.
            tokio::time::sleep(hint.jitter.max(Duration::from_millis(1)).min(max)).await;
            return Ok(());
        }
        let _ = select_all(waits).await;
        if !hint.jitter.is_zero() {
            let pause = rand::random_range(Duration::ZERO..=hint.jitter);
            tokio::time::sleep(pause).await;
        }
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let answers = self.each(|node| node.inspect(name)).await;
        // A holder counts if a majority of nodes report it.
        let mut holders: HashMap<(OwnerId, String), Vec<Holder>> = HashMap::new();
        let mut waiters: Vec<Waiter> = Vec::new();
        let mut hints = Vec::new();
        for answer in answers {
            match answer {
                Ok(state) => {
                    for holder in state.holders {
                        holders
                            .entry((holder.owner.clone(), holder.mode.to_string()))
                            .or_default()
                            .push(holder);
                    }
                    for waiter in state.waiters {
                        if !waiters.iter().any(|w| w.owner == waiter.owner) {
                            waiters.push(waiter);
                        }
                    }
                    hints.push(state.hint);
                }
                Err(_) => hints.push(WaitHint::none()),
            }
        }
        let quorum = self.inner.quorum;
        let mut state = LockState::new(WaitHint::new(Hint {
            nodes: hints,
            jitter: Duration::ZERO,
        }));
        state.waiters = waiters;
        for (_, mut copies) in holders {
            if copies.len() < quorum {
                continue;
            }
            // Held until fewer than a majority of nodes hold it; its token is the one a
            // majority holds (the grant wrote it back to at least a majority; a node that
            // granted late may hold a token of its own).
            copies.sort_by_key(|h| std::cmp::Reverse(h.remaining));
            let remaining = copies[quorum - 1].remaining;
            let mut tokens: Vec<FencingToken> = copies.iter().map(|h| h.token).collect();
            tokens.sort_by_key(|t| std::cmp::Reverse(*t));
            let token = tokens[quorum - 1];
            let mut first = copies.swap_remove(0);
            first.remaining = remaining;
            first.token = token;
            state.holders.push(first);
        }
        state.holders.sort_by_key(|h| h.token);
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_node_urls_with_shared_credentials() {
        let (nodes, options) =
            parse_url("redlock://u:pw@h1:1,h2:2,h3:3/2?node_timeout=20ms&fencing=false").unwrap();
        assert_eq!(
            nodes,
            [
                "redis://u:pw@h1:1/2",
                "redis://u:pw@h2:2/2",
                "redis://u:pw@h3:3/2"
            ]
        );
        assert_eq!(options.node_timeout, Duration::from_millis(20));
        assert!(!options.fencing);
        for bad in [
            "redlock://",
            "redlock://h:1?nosuch=1",
            "redlock://h:1?node_timeout=0ms",
            "redlock://h:1?fencing=maybe",
            "redis://h:1",
        ] {
            assert!(
                matches!(parse_url(bad), Err(Error::InvalidArgument { .. })),
                "{bad}"
            );
        }
        let err = parse_url("redlock://u:hunter2@h:1?nosuch=1").unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
    }

    #[tokio::test]
    async fn the_same_address_twice_is_refused() {
        for urls in [
            vec![
                "redis://127.0.0.1:7001".to_owned(),
                "redis://127.0.0.1:7001".to_owned(),
            ],
            vec![
                "redis://localhost:7001".to_owned(),
                "redis://127.0.0.1:7001".to_owned(),
            ],
        ] {
            let err = refuse_same_address(&urls).await.unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        }
        refuse_same_address(&[
            "redis://127.0.0.1:7001".to_owned(),
            "redis://127.0.0.1:7002".to_owned(),
        ])
        .await
        .unwrap();
    }
}
