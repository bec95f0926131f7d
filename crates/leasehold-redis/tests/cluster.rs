//! A Redis Cluster: the conformance suite, slots that move, and failovers.
//! Against a real cluster of 3 masters and 3 replicas.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::backend::{Backend, Change};
use leasehold_core::{Client, Error, LockName, NamePrefix};
use leasehold_redis::{RedisBackend, RedlockBackend, RedlockOptions};
use leasehold_testkit::probe::Resp;
use leasehold_testkit::{RedisCluster, free_port};

mod common;
use common::{
    Resource, TTL, a_lost_grant_is_told_and_fenced, client_of, holder_and_waiter_carry_on,
    lock_keys, queued, renewed, tracking_clients, until_notice, until_tracking_clients,
};

mod conformance {
    use super::{RedisCluster, common::RedisAt};
    leasehold_testkit::conformance_suite!(async {
        let cluster = RedisCluster::start(3, 1).await.expect("redis cluster");
        let url = cluster.url();
        RedisAt::new(cluster, url)
    });
}

/// A cluster whose nodes are seen failing after 2 s: its failovers are quick.
async fn failing_fast() -> RedisCluster {
    RedisCluster::with_node_timeout(3, 1, Duration::from_secs(2))
        .await
        .unwrap()
}

async fn client(cluster: &RedisCluster, ttl: Duration) -> Client {
    client_of(&cluster.url(), ttl).await
}

/// A lock's keys and its wake-up channel live on its slot's master alone.
/// The release reaches the waiter through sharded pub/sub on that master, not by a
/// broadcast.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_through_its_locks_shard() {
    let cluster = RedisCluster::start(3, 1).await.unwrap();
    let (holder, waiter) = (
        client(&cluster, Duration::from_secs(30)).await,
        client(&cluster, Duration::from_secs(30)).await,
    );
    let slot = cluster.slot_of("{shard}").await.unwrap();
    let master = cluster.master_of(slot).await.unwrap();
    let guard = holder.mutex("shard").unwrap().lock().await.unwrap();
    let waiting = tokio::spawn(async move {
        waiter
            .mutex("shard")
            .unwrap()
            .lock()
            .await
            .map(|g| g.token())
    });
    // The waiter's subscription is on the slot's master, and nowhere else.
    let channel = "leasehold:{shard}:wake";
    let subscribers = async |server: usize| match cluster
        .server(server)
        .command(&["PUBSUB", "SHARDNUMSUB", channel])
        .await
        .unwrap()
    {
        Resp::Array(Some(parts)) => parts.get(1).cloned(),
        other => panic!("PUBSUB SHARDNUMSUB: {other:?}"),
    };
    // Nothing to await from outside the server: ask until the waiter has subscribed.
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    while subscribers(master).await != Some(Resp::Integer(1)) {
        assert!(
            std::time::Instant::now() < give_up,
            "the waiter did not subscribe"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for other in (0..6).filter(|&s| s != master) {
        assert_eq!(
            subscribers(other).await,
            Some(Resp::Integer(0)),
            "server {other}"
        );
    }
    let first = guard.token();
    guard.release().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter was not woken (a wait slice is 10 s)")
        .unwrap()
        .unwrap();
    assert!(second > first);
}

/// A held lock's slot moves to another master while a client waits for it.
/// The client keeps trying it and another lock of that master: nobody else gets it
/// meanwhile, the waiter's subscription and the holder's renewals follow the slot, and the
/// release on the new master wakes the waiter, which gets a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_whose_slot_moves_stays_held_and_its_waiter_is_served() {
    let cluster = RedisCluster::start(3, 1).await.unwrap();
    let ttl = Duration::from_secs(9);
    let (holder, waiter) = (client(&cluster, ttl).await, client(&cluster, ttl).await);
    // The waiter's client probes too: the connections that carry its subscription are
    // busy with requests when the slot's old master drops that subscription.
    let prober = waiter.clone();
    let guard = holder.mutex("moving").unwrap().lock().await.unwrap();
    let slot = cluster.slot_of("{moving}").await.unwrap();
    let from = cluster.master_of(slot).await.unwrap();
    let to = (0..3).find(|&m| m != from).unwrap();
    let waiting = queued(&holder, &waiter, "moving").await;
    // Another lock on the same master, taken and released without a pause: while the slot
    // moves, the client always has answers of that master on their way (grants: tokens),
    // which must never be taken for the prober's.
    let mut steady = 0;
    while cluster
        .master_of(
            cluster
                .slot_of(&format!("{{steady-{steady}}}"))
                .await
                .unwrap(),
        )
        .await
        .unwrap()
        != from
    {
        steady += 1;
    }
    let steady = format!("steady-{steady}");
    let busy = async {
        loop {
            if let Ok(Some(guard)) = prober.mutex(&steady).unwrap().try_lock().await {
                let _ = guard.release().await;
            }
        }
    };
    let probing = async {
        loop {
            // Errors are allowed while the slot moves (TRYAGAIN, ASK); a grant is not.
            if let Ok(Some(stolen)) = prober.mutex("moving").unwrap().try_lock().await {
                panic!("granted token {} while held", stolen.token());
            }
        }
    };
    let moving = async {
        cluster.begin_migration(slot, from, to).await.unwrap();
        let moved = cluster.migrate_keys(slot, from, to).await.unwrap();
        cluster.end_migration(slot, to).await.unwrap();
        moved
    };
    let moved = tokio::select! {
        moved = moving => moved,
        () = probing => unreachable!("the prober stops only by panicking"),
        () = busy => unreachable!(),
    };
    assert!(moved > 0, "the lock's keys were not on its slot's master");
    assert_eq!(cluster.master_of(slot).await.unwrap(), to);
    assert!(lock_keys(cluster.server(from), "moving").await.is_empty());
    // The waiter's subscription follows the slot: the old master dropped it, and the
    // waiter subscribed again on the new one (no event to await from outside: asked until
    // it is there, for at most a lease).
    let channel = "leasehold:{moving}:wake";
    let give_up = std::time::Instant::now() + ttl;
    while cluster
        .server(to)
        .command(&["PUBSUB", "SHARDNUMSUB", channel])
        .await
        .unwrap()
        != Resp::Array(Some(vec![
            Resp::Bulk(Some(channel.into())),
            Resp::Integer(1),
        ]))
    {
        assert!(
            std::time::Instant::now() < give_up,
            "the waiter did not subscribe on the new master"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Renewals reach the new master and find the lock.
    renewed(&guard, 2).await;
    assert!(
        prober
            .mutex("moving")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none(),
        "the lock was free after its slot moved"
    );
    let first = guard.token();
    guard.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the waiter was not served after the slot moved")
        .unwrap()
        .unwrap();
    assert!(next.token() > first);
    next.release().await.unwrap();
}

/// The master of a held lock's slot dies, and the cluster promotes its replica.
/// The holder's grant was acknowledged by the replica (`WAIT`), so it survives: the
/// holder's renewals find it on the new master, and its release there serves the waiter
/// with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_hold_is_replaced_and_its_holder_and_waiter_carry_on() {
    let mut cluster = failing_fast().await;
    let a = client_of(
        &format!("{}?replicas=1&replica_timeout=5s", cluster.url()),
        TTL,
    )
    .await;
    let b = client(&cluster, TTL).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    let waiting = queued(&a, &b, "job").await;
    let slot = cluster.slot_of("{job}").await.unwrap();
    let old = cluster.master_of(slot).await.unwrap();
    cluster.servers()[old].kill();
    let new = cluster.master_other_than(slot, old).await.unwrap();
    assert!(!lock_keys(cluster.server(new), "job").await.is_empty());
    holder_and_waiter_carry_on(guard, waiting).await;
}

/// A failover to a replica that lacks a grant, which asynchronous replication can lose.
/// Another client gets the lock on the new master with a higher token, the old holder
/// learns from its renewals that its lock is gone, and the fence refuses its writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_grant_the_new_master_lacks_learns_it_and_its_writes_are_fenced() {
    let mut cluster = failing_fast().await;
    let mut resource = Resource::start().await;
    let a = client(&cluster, TTL).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    assert!(resource.write(&guard, 1).await);
    let slot = cluster.slot_of("{job}").await.unwrap();
    let new = cluster.failover(slot).await.unwrap();
    let b = client(&cluster, TTL).await;
    a_lost_grant_is_told_and_fenced(guard, cluster.server(new), &b, &mut resource).await;
}

/// A Cluster over TLS: clients, bus and replication.
/// Locks spread over every master, a waiter woken through its shard, and a client that
/// does not trust the test CA refused with a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_grants_and_wakes_waiters() {
    let cluster = RedisCluster::with_tls(3, 1).await.unwrap();
    let url = cluster.tls_url().unwrap();
    let (holder, waiter) = (client_of(&url, TTL).await, client_of(&url, TTL).await);
    // Names on every master: the client follows the TLS ports the nodes announce.
    let mut masters = std::collections::BTreeSet::new();
    for i in 0..12 {
        let name = format!("tls-{i}");
        let slot = cluster.slot_of(&format!("{{{name}}}")).await.unwrap();
        masters.insert(cluster.master_of(slot).await.unwrap());
        let guard = holder.mutex(&name).unwrap().lock().await.unwrap();
        guard.release().await.unwrap();
    }
    assert_eq!(masters.len(), 3, "the names did not reach every master");
    let guard = holder.mutex("tls-job").unwrap().lock().await.unwrap();
    let waiting = queued(&holder, &waiter, "tls-job").await;
    let first = guard.token();
    guard.release().await.unwrap();
    let next = tokio::time::timeout(TTL, waiting)
        .await
        .expect("the waiter was not woken")
        .unwrap()
        .unwrap();
    assert!(next.token() > first);
    next.release().await.unwrap();
    // Without the test CA the nodes' certificates are not trusted.
    let untrusted = url.split('?').next().unwrap();
    let error = RedisBackend::connect(untrusted).await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::Unavailable { .. } | Error::InvalidArgument { .. }
        ),
        "{error}"
    );
}

/// Bad input is a typed error.
/// A db in a Cluster URL, TLS files without TLS, a Cluster as a Redlock node, and nodes
/// that cannot be reached.
#[tokio::test]
async fn bad_cluster_urls_are_typed_errors() {
    for url in [
        "redis+cluster://127.0.0.1:1/3",
        "redis+cluster://127.0.0.1:1?tls_ca=/dev/null",
        "redis+cluster://",
    ] {
        let error = RedisBackend::connect(url).await.unwrap_err();
        assert!(
            matches!(error, Error::InvalidArgument { .. }),
            "{url}: {error}"
        );
    }
    let error = RedlockBackend::connect_nodes(
        &["redis+cluster://127.0.0.1:1".to_owned()],
        RedlockOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(error.to_string().contains("not a Redis Cluster"), "{error}");
    let (p1, p2) = (free_port(), free_port());
    let error = RedisBackend::connect(&format!(
        "redis+cluster://127.0.0.1:{p1},127.0.0.1:{p2}?connect_timeout=2s"
    ))
    .await
    .unwrap_err();
    assert!(matches!(error, Error::Unavailable { .. }), "{error}");
    assert!(error.to_string().contains(&p1.to_string()), "{error}");
}

/// A change feed tracks on every master, and follows a failover.
/// Once it tracks on the new master it says so with a resync, leaves the old one (now a
/// replica), and the new master's changes come through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_feed_follows_the_masters_across_a_failover() {
    let mut cluster = failing_fast().await;
    let redis = RedisBackend::connect(&cluster.url()).await.unwrap();
    let mut feed = redis
        .changes(&NamePrefix::new("jobs:").unwrap())
        .await
        .unwrap();
    let slot = cluster.slot_of("{jobs:1}").await.unwrap();
    let old = cluster.master_of(slot).await.unwrap();
    let mut masters = 0;
    for i in 0..cluster.servers().len() {
        let tracking = tracking_clients(cluster.server(i)).await.len();
        assert!(tracking <= 1, "server {i} has {tracking} tracking clients");
        masters += tracking;
    }
    assert_eq!(masters, 3, "the feed does not track on every master");
    let new = cluster.failover(slot).await.unwrap();
    // The feed asks for the masters every few seconds.
    until_tracking_clients(cluster.server(new), 1).await;
    until_notice(&mut feed, "the new master", |c| *c == Change::Resync).await;
    until_tracking_clients(cluster.server(old), 0).await;
    let b = client(&cluster, TTL).await;
    let guard = b.mutex("jobs:1").unwrap().lock().await.unwrap();
    assert!(!lock_keys(cluster.server(new), "jobs:1").await.is_empty());
    let name = LockName::new("jobs:1").unwrap();
    until_notice(&mut feed, "the grant", |c| *c == Change::Lock(name.clone())).await;
    guard.release().await.unwrap();
}
