//! Change feeds (watching locks) against real redis-servers.
//! The server's own invalidations: expiries seen, resyncs after a loss or a flush, and no
//! connection left behind by a dropped feed.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::backend::{Acquire, Backend, Change, Mode, Request};
use leasehold_core::{Error, LockName, NamePrefix, OwnerId};
use leasehold_redis::{RedisBackend, RedlockBackend, RedlockOptions};
use leasehold_testkit::probe::Resp;
use leasehold_testkit::{Redis, redis_servers};
use tokio::time::Instant;

mod common;
use common::{tracking_clients, until_notice, until_tracking_clients};

fn prefix(prefix: &str) -> NamePrefix {
    NamePrefix::new(prefix).unwrap()
}

fn name(name: &str) -> LockName {
    LockName::new(name).unwrap()
}

/// Grants `name` for `ttl` to a new owner, without renewals (no client engine).
async fn grant(backend: &dyn Backend, name: &str, ttl: Duration) {
    let req = Request::new(
        LockName::new(name).unwrap(),
        OwnerId::generate(),
        Mode::Exclusive,
        ttl,
    );
    assert!(matches!(
        backend.acquire(&req).await.unwrap(),
        Acquire::Granted(_)
    ));
}

/// A lease that runs out on the server is noticed.
/// The server's expiry of the lock key is pushed, with nobody touching the lock after its
/// grant.
#[tokio::test]
async fn a_lease_running_out_on_the_server_is_noticed() {
    let server = Redis::start().await.unwrap();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    let mut feed = redis.changes(&prefix("lease:")).await.unwrap();
    let ttl = Duration::from_millis(300);
    let asked = Instant::now();
    grant(&redis, "lease:x", ttl).await;
    until_notice(&mut feed, "the grant", |c| {
        *c == Change::Lock(name("lease:x"))
    })
    .await;
    // The rest of the grant's notices (its keys come in one push) are in already.
    while feed.try_next().is_some() {}
    let key = "leasehold:{lease:x}:lock";
    until_notice(&mut feed, "the expiry", |c| {
        *c == Change::Lock(name("lease:x"))
    })
    .await;
    assert!(
        asked.elapsed() >= ttl,
        "told of the lock after {:?}, before its lease of {ttl:?} ended",
        asked.elapsed()
    );
    assert_eq!(
        server.command(&["EXISTS", key]).await.unwrap(),
        Resp::Integer(0),
        "the notice came while the lock key was still there"
    );
}

/// Dropping a feed closes its connection.
/// The server has a tracking client while the feed lives, and none after: on one server
/// and on every Redlock node.
#[tokio::test]
async fn a_dropped_feed_leaves_no_connection_behind() {
    let server = Redis::start().await.unwrap();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    assert_eq!(tracking_clients(&server).await.len(), 0);
    let feed = redis.changes(&prefix("jobs:")).await.unwrap();
    let other = redis.changes(&prefix("")).await.unwrap();
    // Tracking is on once `changes` returns: no wait.
    assert_eq!(tracking_clients(&server).await.len(), 2);
    drop(feed);
    until_tracking_clients(&server, 1).await;
    drop(other);
    until_tracking_clients(&server, 0).await;

    let servers = redis_servers(3).await.unwrap();
    let urls: Vec<String> = servers.iter().map(Redis::url).collect();
    let options = RedlockOptions::default()
        .quarantine(Duration::ZERO)
        .node_timeout(Duration::from_secs(1))
        .unwrap();
    let redlock = RedlockBackend::connect_nodes(&urls, options).await.unwrap();
    let mut feed = redlock.changes(&prefix("jobs:")).await.unwrap();
    for server in &servers {
        until_tracking_clients(server, 1).await;
    }
    grant(&redlock, "jobs:1", Duration::from_secs(30)).await;
    until_notice(&mut feed, "the grant", |c| {
        *c == Change::Lock(name("jobs:1"))
    })
    .await;
    drop(feed);
    for server in &servers {
        until_tracking_clients(server, 0).await;
    }
}

/// A feed whose connection is lost says so with a resync once it is back, and goes on.
/// A flush of the server's tracking state (`FLUSHALL`) is a resync too.
#[tokio::test]
async fn a_lost_connection_and_a_flush_are_resyncs() {
    let server = Redis::start().await.unwrap();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    let mut feed = redis.changes(&prefix("jobs:")).await.unwrap();
    let clients = tracking_clients(&server).await;
    assert_eq!(clients.len(), 1);
    let killed = server
        .command(&["CLIENT", "KILL", "ID", &clients[0]])
        .await
        .unwrap();
    assert_eq!(killed, Resp::Integer(1));
    until_notice(&mut feed, "the new connection", |c| *c == Change::Resync).await;
    let now = tracking_clients(&server).await;
    assert_eq!(now.len(), 1);
    assert_ne!(now, clients);
    grant(&redis, "jobs:1", Duration::from_secs(30)).await;
    until_notice(&mut feed, "the grant", |c| {
        *c == Change::Lock(name("jobs:1"))
    })
    .await;

    while feed.try_next().is_some() {}
    assert_eq!(
        server.command(&["FLUSHALL"]).await.unwrap(),
        Resp::Simple("OK".into())
    );
    until_notice(&mut feed, "the flush", |c| *c == Change::Resync).await;
}

/// A user that may not run `CLIENT TRACKING` gets a typed error naming it, at once.
#[tokio::test]
async fn a_server_that_refuses_client_tracking_is_a_typed_error_not_a_hang() {
    let server = Redis::start().await.unwrap();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    assert_eq!(
        server
            .command(&["ACL", "SETUSER", "default", "-client|tracking"])
            .await
            .unwrap(),
        Resp::Simple("OK".into())
    );
    let refused = tokio::time::timeout(Duration::from_secs(5), redis.changes(&prefix("")))
        .await
        .expect("asking for a feed hung");
    match refused {
        Err(Error::Backend {
            message,
            retryable: false,
            ..
        }) => assert!(message.contains("CLIENT TRACKING"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(tracking_clients(&server).await.len(), 0);
}

/// A server without `CLIENT TRACKING` is [`Error::Unsupported`], at once.
/// Here `CLIENT` is renamed away, as a server before Redis 6 lacks the subcommand.
#[tokio::test]
async fn a_server_without_client_tracking_is_unsupported_not_a_hang() {
    let config =
        std::env::temp_dir().join(format!("leasehold-no-client-{}.conf", std::process::id()));
    std::fs::write(&config, "rename-command CLIENT \"\"\n").unwrap();
    let server = Redis::builder()
        .config("include", &config.display().to_string())
        .start()
        .await
        .unwrap();
    std::fs::remove_file(&config).unwrap();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(5), redis.changes(&prefix("")))
        .await
        .expect("asking for a feed hung");
    assert!(
        matches!(
            refused,
            Err(Error::Unsupported {
                backend: "redis",
                ..
            })
        ),
        "{refused:?}"
    );
    // The rest of the backend is unaffected.
    grant(&redis, "jobs:1", Duration::from_secs(30)).await;
}

/// A Redlock feed goes on while a majority of its nodes is up.
/// A node that comes back is tracked again, with a resync.
#[tokio::test]
async fn a_redlock_feed_goes_on_without_a_node_and_resyncs_when_it_is_back() {
    let mut servers = redis_servers(3).await.unwrap();
    let urls: Vec<String> = servers.iter().map(Redis::url).collect();
    let options = RedlockOptions::default()
        .quarantine(Duration::ZERO)
        .node_timeout(Duration::from_secs(1))
        .unwrap();
    let redlock = RedlockBackend::connect_nodes(&urls, options).await.unwrap();
    let mut feed = redlock.changes(&prefix("jobs:")).await.unwrap();
    servers[0].kill();
    grant(&redlock, "jobs:1", Duration::from_secs(30)).await;
    until_notice(&mut feed, "the grant", |c| {
        *c == Change::Lock(name("jobs:1"))
    })
    .await;
    servers[0].restart().await.unwrap();
    until_notice(&mut feed, "the node's return", |c| *c == Change::Resync).await;
    until_tracking_clients(&servers[0], 1).await;
    grant(&redlock, "jobs:2", Duration::from_secs(30)).await;
    until_notice(&mut feed, "the next grant", |c| {
        *c == Change::Lock(name("jobs:2"))
    })
    .await;
}
