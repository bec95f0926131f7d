//! What the failover tests of Sentinel and Cluster share.
//! Clients, waits, and the fenced resource of a superseded holder.

#![allow(dead_code)] // each test binary uses its own part of it

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_core::backend::{Backend, Change, Changes};
use leasehold_core::{Client, Guard, LockOptions, LossReason};
use leasehold_redis::RedisBackend;
use leasehold_redis::fence::RedisFence;
use leasehold_redis::redis::aio::ConnectionManager;
use leasehold_testkit::probe::Resp;
use leasehold_testkit::{Deployment, Redis};

/// Redis servers of some set-up (Sentinel, Cluster), a conformance deployment by URL.
pub(crate) struct RedisAt<S> {
    url: String,
    /// Kept running while the deployment lives.
    _servers: S,
}

impl<S> RedisAt<S> {
    /// `servers`, which clients reach at `url`.
    pub(crate) fn new(servers: S, url: String) -> Self {
        Self {
            url,
            _servers: servers,
        }
    }
}

#[async_trait]
impl<S: Send + Sync> Deployment for RedisAt<S> {
    async fn connect(&self) -> Arc<dyn Backend> {
        Arc::new(RedisBackend::connect(&self.url).await.unwrap())
    }
}

/// The lease of the failover tests, far longer than a failover takes on a loaded machine.
/// Renewals accepted by the old master until the client moves never reach the new one,
/// which counts from the last renewal it got (a 10 s lease did not always survive that).
pub(crate) const TTL: Duration = Duration::from_secs(30);

/// A client of `url` with leases of `ttl`.
/// Its requests may take (and fail) for up to a third of `ttl` or 10 s. The engine retries a request that fails for up to one request
/// timeout: long enough for a failover on a loaded machine.
pub(crate) async fn client_of(url: &str, ttl: Duration) -> Client {
    let options = LockOptions::builder()
        .ttl(ttl)
        .request_timeout((ttl / 3).min(Duration::from_secs(10)))
        .build()
        .unwrap();
    Client::builder(RedisBackend::connect(url).await.unwrap())
        .options(options)
        .build()
}

/// Waits for `times` renewals of `guard` that found its lock (its deadline moved).
pub(crate) async fn renewed(guard: &Guard, times: usize) {
    for _ in 0..times {
        let seen = guard.deadline().unwrap();
        tokio::time::timeout(guard.remaining(), guard.deadline_changed(seen))
            .await
            .expect("no renewal within the lease")
            .expect("the lock was lost");
    }
}

/// The keys of lock `name` on `server`.
pub(crate) async fn lock_keys(server: &Redis, name: &str) -> Vec<String> {
    match server
        .command(&["KEYS", &format!("leasehold:{{{name}}}:*")])
        .await
        .unwrap()
    {
        Resp::Array(Some(keys)) => keys.iter().filter_map(Resp::text).collect(),
        other => panic!("KEYS: {other:?}"),
    }
}

/// `name` for `client` once the client has found the new master.
/// An answer of the old master (`READONLY`, `MOVED`, a lost connection) is retryable and
/// moves the client.
pub(crate) async fn lock_after_failover(client: &Client, name: &str) -> Guard {
    let mut errors = Vec::new();
    for _ in 0..20 {
        match client.mutex(name).unwrap().try_lock().await {
            Ok(Some(guard)) => return guard,
            Ok(None) => panic!("{name} is held"),
            Err(error) if error.is_retryable() => errors.push(error.to_string()),
            Err(error) => panic!("{error}"),
        }
    }
    panic!("the client did not find the new master: {errors:#?}");
}

/// A resource on a Redis of its own, written through a [`RedisFence`].
pub(crate) struct Resource {
    _server: Redis,
    conn: ConnectionManager,
    fence: RedisFence,
}

impl Resource {
    pub(crate) async fn start() -> Resource {
        let server = Redis::start().await.unwrap();
        let conn = leasehold_redis::redis::Client::open(server.url())
            .unwrap()
            .get_connection_manager()
            .await
            .unwrap();
        Resource {
            _server: server,
            conn,
            fence: RedisFence::new("{stock}:fence"),
        }
    }

    /// Writes `value` with `guard`'s token: whether the fence let it through.
    pub(crate) async fn write(&mut self, guard: &Guard, value: i64) -> bool {
        self.fence
            .set(&mut self.conn, guard.token(), "{stock}:count", value)
            .await
            .unwrap()
            .is_ok()
    }
}

/// The end of a failover to `new_master`, a replica that lacks `guard`'s grant.
/// Asynchronous replication can lose it (the test deletes it there): `other` gets the lock
/// with a higher token and writes, the old holder learns from its renewals that its lock
/// is gone, and the resource refuses its writes.
pub(crate) async fn a_lost_grant_is_told_and_fenced(
    guard: Guard,
    new_master: &Redis,
    other: &Client,
    resource: &mut Resource,
) {
    let name = guard.name().to_string();
    let keys = lock_keys(new_master, &name).await;
    let mut del = vec!["DEL"];
    del.extend(keys.iter().map(String::as_str));
    new_master.command(&del).await.unwrap();
    let next = lock_after_failover(other, &name).await;
    assert!(next.token() > guard.token());
    assert!(resource.write(&next, 2).await);
    let lost = tokio::time::timeout(TTL * 3, guard.lost())
        .await
        .expect("the holder was not told");
    assert!(
        matches!(lost, LossReason::NotOwner | LossReason::Expired),
        "{lost:?}"
    );
    assert!(!guard.is_held());
    assert!(
        !resource.write(&guard, 3).await,
        "the superseded holder wrote"
    );
}

/// Has `waiter` wait for `name`, which `holder`'s client holds, and returns once it is queued.
pub(crate) async fn queued(
    holder: &Client,
    waiter: &Client,
    name: &str,
) -> tokio::task::JoinHandle<leasehold_core::Result<Guard>> {
    let mutex = waiter.mutex(name).unwrap();
    let waiting = tokio::spawn(async move { mutex.lock().await });
    // Nothing to await from outside the server: asked until the waiter is queued.
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    while holder.inspect(name).await.unwrap().waiters.is_empty() {
        assert!(
            std::time::Instant::now() < give_up,
            "the waiter never queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    waiting
}

/// After a failover that kept `guard`'s grant, holder and waiter carry on.
/// The holder's renewal finds the new master (the old one is dead) and its lock there, and
/// its release serves the waiter with a higher token.
pub(crate) async fn holder_and_waiter_carry_on(
    guard: Guard,
    waiting: tokio::task::JoinHandle<leasehold_core::Result<Guard>>,
) {
    renewed(&guard, 1).await;
    let token = guard.token();
    guard.release().await.unwrap();
    let next = tokio::time::timeout(TTL, waiting)
        .await
        .expect("the waiter was lost in the failover")
        .unwrap()
        .unwrap();
    assert!(next.token() > token);
}

/// How long a test waits for a change feed's notice, or its connection, that must come.
pub(crate) const NOTICE: Duration = Duration::from_secs(10);

/// The ids of the server's clients that track keys (`t` in their `CLIENT LIST` flags).
pub(crate) async fn tracking_clients(server: &Redis) -> Vec<String> {
    let list = server.command(&["CLIENT", "LIST"]).await.unwrap();
    let list = match list {
        Resp::Bulk(Some(list)) => String::from_utf8(list).unwrap(),
        other => panic!("CLIENT LIST: {other:?}"),
    };
    list.lines()
        .filter(|client| {
            client.split(' ').any(|field| {
                field
                    .strip_prefix("flags=")
                    .is_some_and(|f| f.contains('t'))
            })
        })
        .filter_map(|client| {
            let id = client.split(' ').find_map(|f| f.strip_prefix("id="))?;
            Some(id.to_owned())
        })
        .collect()
}

/// Waits until `server` has `n` tracking clients, for up to a minute.
/// The server closes a client when it reads the end of its connection, and a feed moves
/// after a failover when the sentinels or the Cluster say so: no event of either reaches
/// the test, so the server is asked again after each answer, with a short pause.
pub(crate) async fn until_tracking_clients(server: &Redis, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let clients = tracking_clients(server).await;
        if clients.len() == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server has {} tracking clients, not {n}",
            clients.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The next notice of `feed` that `want` accepts, within [`NOTICE`].
pub(crate) async fn until_notice(
    feed: &mut Changes,
    what: &str,
    want: impl Fn(&Change) -> bool,
) -> Change {
    let seen = async {
        loop {
            let change = feed.next().await.expect("the feed ended");
            if want(&change) {
                return change;
            }
        }
    };
    tokio::time::timeout(NOTICE, seen)
        .await
        .unwrap_or_else(|_| panic!("the feed never told of {what}"))
}
