//! A master managed by Redis Sentinel: the conformance suite, and failovers.
//! Against 3 real sentinels watching a master and two replicas.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::backend::{Backend, Change};
use leasehold_core::{Client, Error, LockName, NamePrefix};
use leasehold_redis::RedisBackend;
use leasehold_testkit::probe::Resp;
use leasehold_testkit::{Redis, RedisSentinel, free_port};

mod common;
use common::{
    Resource, TTL, a_lost_grant_is_told_and_fenced, client_of, holder_and_waiter_carry_on,
    lock_after_failover, lock_keys, queued, renewed, tracking_clients, until_notice,
    until_tracking_clients,
};

mod conformance {
    use super::{RedisSentinel, common::RedisAt};
    leasehold_testkit::conformance_suite!(async {
        let set = RedisSentinel::start(2, 3).await.expect("redis sentinel");
        let url = set.url();
        RedisAt::new(set, url)
    });
}

async fn client(set: &RedisSentinel, ttl: Duration) -> Client {
    client_of(&set.url(), ttl).await
}

/// A client's role as its master sees it: the master's `ROLE`.
async fn role(server: &Redis) -> String {
    match server.command(&["ROLE"]).await.unwrap() {
        Resp::Array(Some(role)) => role[0].text().unwrap(),
        other => panic!("ROLE: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_moves_the_client_and_a_replicated_lock_stays_held() {
    let mut set = RedisSentinel::start(2, 3).await.unwrap();
    // Every grant is acknowledged by both replicas (WAIT) before it is reported.
    let a = client_of(&format!("{}?replicas=2&replica_timeout=5s", set.url()), TTL).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    let old = set.master().await.unwrap();
    let new = set.failover().await.unwrap();
    assert_ne!(new, old);
    // The same client moves to the new master on its own (the announcement, or the old
    // master's READONLY once it is demoted): a grant then lands there. Until then the old
    // master still takes writes; no event says when the client moved, so grants are tried.
    let give_up = std::time::Instant::now() + Duration::from_secs(60);
    let mut tries = 0;
    let other = loop {
        tries += 1;
        let name = format!("other-{tries}");
        let other = lock_after_failover(&a, &name).await;
        if !lock_keys(&set.servers()[new], &name).await.is_empty() {
            break other;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "the client stayed on the old master"
        );
        let _ = other.release().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(other.token() > guard.token());
    // The lock came along.
    assert!(a.mutex("job").unwrap().try_lock().await.unwrap().is_none());
    // The holder's renewals reach the new master and find its lock (two: the first may
    // have gone to the old master before it was demoted).
    renewed(&guard, 2).await;
    // The sentinels demote the old master once it reports in (no event to await: polled).
    let give_up = std::time::Instant::now() + Duration::from_secs(60);
    while role(&set.servers()[old]).await != "slave" {
        assert!(
            std::time::Instant::now() < give_up,
            "the old master was not demoted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its renewals and requests meanwhile went to the new master: the lock is still held.
    assert!(guard.is_held());
    let b = client(&set, TTL).await;
    assert!(b.mutex("job").unwrap().try_lock().await.unwrap().is_none());
    let token = guard.token();
    guard.release().await.unwrap();
    let next = b.mutex("job").unwrap().try_lock().await.unwrap().unwrap();
    assert!(next.token() > token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_grant_the_new_master_lacks_learns_it_and_its_writes_are_fenced() {
    let mut set = RedisSentinel::start(2, 3).await.unwrap();
    let mut resource = Resource::start().await;
    let a = client(&set, TTL).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    assert!(resource.write(&guard, 1).await);
    let new = set.failover().await.unwrap();
    let b = client(&set, TTL).await;
    a_lost_grant_is_told_and_fenced(guard, &set.servers()[new], &b, &mut resource).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_hold_is_replaced_and_its_holder_and_waiter_carry_on() {
    let mut set = RedisSentinel::start(2, 3).await.unwrap();
    set.until_sentinels_know_each_other().await.unwrap();
    let a = client_of(&format!("{}?replicas=2&replica_timeout=5s", set.url()), TTL).await;
    let b = client(&set, TTL).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    let waiting = queued(&a, &b, "job").await;
    let old = set.master().await.unwrap();
    set.servers()[old].kill();
    // The sentinels agree it is down (after 1 s) and promote a replica.
    let new = set.master_other_than(Some(old)).await.unwrap();
    assert_ne!(new, old);
    holder_and_waiter_carry_on(guard, waiting).await;
}

#[tokio::test]
async fn a_sentinel_that_names_a_replica_is_seen_through() {
    let mut set = RedisSentinel::start(1, 3).await.unwrap();
    let master = set.master().await.unwrap();
    let (_stray, port) = set.stray_sentinel(1 - master).await.unwrap();
    // The stray sentinel is asked first: it names the replica, which says it is one.
    let first = format!("redis+sentinel://127.0.0.1:{port},");
    let url = set.url().replace("redis+sentinel://", &first);
    let client = client_of(&url, TTL).await;
    let guard = client.mutex("job").unwrap().lock().await.unwrap();
    assert!(!lock_keys(&set.servers()[master], "job").await.is_empty());
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_dropped_client_leaves_no_subscription_on_the_sentinels() {
    let set = RedisSentinel::start(0, 2).await.unwrap();
    let subscribed = async |n: usize| {
        let give_up = std::time::Instant::now() + Duration::from_secs(30);
        while set.subscribers().await.unwrap() != n {
            assert!(std::time::Instant::now() < give_up, "never {n} subscribers");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let backend = RedisBackend::connect(&set.url()).await.unwrap();
    // It listens for failovers on one sentinel.
    subscribed(1).await;
    drop(backend);
    subscribed(0).await;
}

#[tokio::test]
async fn sentinels_that_cannot_be_reached_are_named_in_a_typed_error() {
    let (p1, p2) = (free_port(), free_port());
    let url = format!("redis+sentinel://127.0.0.1:{p1},127.0.0.1:{p2}/leasehold-master");
    match RedisBackend::connect(&url).await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains(&format!("127.0.0.1:{p1}")), "{message}");
            assert!(message.contains(&format!("127.0.0.1:{p2}")), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let set = RedisSentinel::start(0, 1).await.unwrap();
    let unknown = set.url().replace("leasehold-master", "nosuch");
    match RedisBackend::connect(&unknown).await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("does not know nosuch"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

/// A change feed follows the master across a failover.
/// It tracks on the master only; once it tracks on the new one it says so with a resync,
/// and the new master's changes come through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_feed_follows_the_master_across_a_failover() {
    let set = RedisSentinel::start(2, 3).await.unwrap();
    let redis = RedisBackend::connect(&set.url()).await.unwrap();
    let mut feed = redis
        .changes(&NamePrefix::new("jobs:").unwrap())
        .await
        .unwrap();
    let old = set.master().await.unwrap();
    for i in 0..3 {
        let tracking = tracking_clients(set.server(i).unwrap()).await.len();
        assert_eq!(tracking, usize::from(i == old), "server {i}");
    }
    let new = set.failover().await.unwrap();
    // The backend moves when a sentinel names the new master, and the feed with it.
    until_tracking_clients(set.server(new).unwrap(), 1).await;
    until_notice(&mut feed, "the move", |c| *c == Change::Resync).await;
    until_tracking_clients(set.server(old).unwrap(), 0).await;
    let b = client(&set, TTL).await;
    let guard = b.mutex("jobs:1").unwrap().lock().await.unwrap();
    assert!(
        !lock_keys(set.server(new).unwrap(), "jobs:1")
            .await
            .is_empty()
    );
    let name = LockName::new("jobs:1").unwrap();
    until_notice(&mut feed, "the grant", |c| *c == Change::Lock(name.clone())).await;
    guard.release().await.unwrap();
}
