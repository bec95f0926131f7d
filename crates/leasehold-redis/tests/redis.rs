//! What only the Redis backend promises, against real redis-servers.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use leasehold_core::backend::{Acquire, Backend, Mode, Release, Renewal, Request};
use leasehold_core::faulty::{Faulty, Op};
use leasehold_core::{Client, Error, LockName, LockOptions, LossReason, OwnerId};
use leasehold_redis::{RedisBackend, RedisOptions, ReplicaAck};
use leasehold_testkit::probe::Resp;
use leasehold_testkit::{Direction, FaultProxy, Redis, RedisReplicated};

fn options(ttl: Duration) -> LockOptions {
    LockOptions::builder()
        .ttl(ttl)
        .request_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

async fn backend(server: &Redis) -> Arc<dyn Backend> {
    Arc::new(RedisBackend::connect(&server.url()).await.unwrap())
}

async fn client(server: &Redis, ttl: Duration) -> Client {
    Client::builder_from_arc(backend(server).await)
        .options(options(ttl))
        .build()
}

async fn faulty_client(server: &Redis, ttl: Duration) -> (Client, Faulty) {
    let faults = Faulty::wrap(backend(server).await);
    let client = Client::builder(faults.clone())
        .options(options(ttl))
        .build();
    (client, faults)
}

#[tokio::test]
async fn renewals_survive_a_script_flush() {
    let server = Redis::start().await.unwrap();
    let (a, faults) = faulty_client(&server, Duration::from_millis(600)).await;
    let b = client(&server, Duration::from_secs(5)).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    assert_eq!(
        server.command(&["SCRIPT", "FLUSH"]).await.unwrap(),
        Resp::Simple("OK".into())
    );
    // Several renewals after the flush: each had to reload its script (NOSCRIPT).
    let seen = faults.calls(Op::Renew);
    faults.until_calls(Op::Renew, seen + 3).await;
    assert!(guard.is_held());
    assert!(b.mutex("job").unwrap().try_lock().await.unwrap().is_none());
    guard.release().await.unwrap();
    assert!(b.mutex("job").unwrap().try_lock().await.unwrap().is_some());
}

#[tokio::test]
async fn a_paused_server_costs_the_holder_its_lock_at_the_deadline() {
    let server = Redis::start().await.unwrap();
    let a = client(&server, Duration::from_secs(1)).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    server.pause();
    let reason = tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("no loss signal while the server was paused");
    assert_eq!(reason, LossReason::Expired);
    assert!(!guard.is_held());
    server.resume();
}

#[tokio::test]
async fn an_empty_restart_neither_keeps_the_lock_nor_lowers_tokens() {
    let mut server = Redis::start().await.unwrap();
    let a = client(&server, Duration::from_secs(1)).await;
    let held = a.mutex("job").unwrap().lock().await.unwrap();
    let first = held.token();
    server.restart().await.unwrap();
    // The holder's next renewal finds no lock: lost at once, not at its deadline.
    assert_eq!(held.lost().await, LossReason::NotOwner);
    let b = client(&server, Duration::from_secs(1)).await;
    let next = b.mutex("job").unwrap().lock().await.unwrap();
    assert!(
        next.token() > first,
        "token {} after {first} across an empty restart",
        next.token()
    );
    next.release().await.unwrap();
}

#[tokio::test]
async fn a_client_refuses_a_token_it_has_already_seen_and_repairs_the_counter() {
    let server = Redis::start().await.unwrap();
    let a = client(&server, Duration::from_secs(5)).await;
    let first = a.mutex("job").unwrap().lock().await.unwrap();
    let seen = first.token();
    first.release().await.unwrap();
    // The server "loses" its counter, as an async failover to a lagging replica would.
    server
        .command(&["SET", "leasehold:{job}:token", "5"])
        .await
        .unwrap();
    let next = a.mutex("job").unwrap().lock().await.unwrap();
    assert!(next.token() > seen, "{} after {seen}", next.token());
    // Exactly one holder: the stale grant was given back.
    assert_eq!(a.inspect("job").await.unwrap().holders.len(), 1);
}

#[tokio::test]
async fn grants_wait_for_a_replica_when_asked() {
    let pair = RedisReplicated::start().await.unwrap();
    let ack = ReplicaAck::new(1, Duration::from_millis(200), true);
    let required = Client::new(
        RedisBackend::connect_with(
            &pair.primary.url(),
            RedisOptions::default().replicas(ack).unwrap(),
        )
        .await
        .unwrap(),
    );
    let guard = required.mutex("job").unwrap().lock().await.unwrap();
    guard.release().await.unwrap();

    pair.replica.pause();
    let refused = required.mutex("job").unwrap().try_lock().await;
    match refused {
        Err(Error::Backend {
            retryable, message, ..
        }) => {
            assert!(retryable);
            assert!(message.contains("0 of 1 replicas"), "{message}");
        }
        other => panic!("granted without the replica: {other:?}"),
    }
    assert!(required.inspect("job").await.unwrap().holders.is_empty());

    let reported = Client::new(
        RedisBackend::connect_with(
            &pair.primary.url(),
            RedisOptions::default()
                .replicas(ReplicaAck::new(ack.replicas, ack.timeout, false))
                .unwrap(),
        )
        .await
        .unwrap(),
    );
    assert!(
        reported
            .mutex("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    pair.replica.resume();
}

#[tokio::test]
async fn a_replica_answers_with_a_typed_retryable_error() {
    let pair = RedisReplicated::start().await.unwrap();
    let replica = client(&pair.replica, Duration::from_secs(5)).await;
    match replica.mutex("job").unwrap().try_lock().await {
        Err(Error::Backend {
            retryable, message, ..
        }) => {
            assert!(retryable);
            assert!(message.contains("read-only replica"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn foreign_data_under_lock_keys_is_a_typed_error_not_a_guess() {
    let server = Redis::start().await.unwrap();
    let a = client(&server, Duration::from_secs(5)).await;
    server
        .command(&["SET", "leasehold:{job}:lock", "someone-else"])
        .await
        .unwrap();
    match a
        .mutex("job")
        .unwrap()
        .lock_timeout(Duration::from_secs(1))
        .await
    {
        Err(Error::Backend { message, .. }) => {
            assert!(message.contains("not written by leasehold"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Nothing of ours was written, the foreign value is untouched.
    assert_eq!(
        server
            .command(&["GET", "leasehold:{job}:lock"])
            .await
            .unwrap(),
        Resp::Bulk(Some(b"someone-else".to_vec()))
    );

    server
        .command(&["LPUSH", "leasehold:{other}:readers", "x"])
        .await
        .unwrap();
    match a.rwlock("other").unwrap().try_read().await {
        Err(Error::Backend { message, .. }) => {
            assert!(message.contains("another type"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn an_evicting_policy_is_reported_on_connect() {
    let safe = Redis::start().await.unwrap();
    assert!(
        RedisBackend::connect(&safe.url())
            .await
            .unwrap()
            .warnings()
            .is_empty()
    );
    let evicting = Redis::builder()
        .config("maxmemory", "64mb")
        .config("maxmemory-policy", "volatile-lru")
        .start()
        .await
        .unwrap();
    let backend = RedisBackend::connect(&evicting.url()).await.unwrap();
    assert_eq!(backend.warnings().len(), 1);
    assert!(backend.warnings()[0].contains("volatile-lru"));
}

#[tokio::test]
async fn a_grant_whose_reply_was_lost_in_the_network_is_adopted() {
    let server = Redis::start().await.unwrap();
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    let through_proxy = RedisBackend::connect(&format!("redis://127.0.0.1:{}", proxy.port()))
        .await
        .unwrap();
    let client = Client::builder(through_proxy)
        .options(
            LockOptions::builder()
                .ttl(Duration::from_secs(10))
                .request_timeout(Duration::from_millis(300))
                .build()
                .unwrap(),
        )
        .build();
    // Watch the lock key on the server itself: keyspace notifications.
    server
        .command(&["CONFIG", "SET", "notify-keyspace-events", "K$"])
        .await
        .unwrap();
    let watcher = redis::Client::open(server.url()).unwrap();
    let mut events = watcher.get_async_pubsub().await.unwrap();
    events
        .subscribe("__keyspace@0__:leasehold:{job}:lock")
        .await
        .unwrap();
    let mut events = events.into_on_message();

    proxy.cut(Direction::ToClient);
    let mutex = client.mutex("job").unwrap();
    let attempt = tokio::spawn(async move { mutex.lock_timeout(Duration::from_secs(20)).await });
    // The grant happened on the server; its reply is stuck in the network.
    let event = events.next().await.unwrap();
    assert_eq!(event.get_payload::<String>().unwrap(), "set");
    let owner = server
        .command(&["GET", "leasehold:{job}:lock"])
        .await
        .unwrap();
    proxy.heal();
    let guard = attempt.await.unwrap().unwrap().expect("granted");
    // The retry carried the same owner id and adopted the grant: no orphan until the ttl.
    let value = format!("{} {}", guard.owner(), guard.token());
    assert_eq!(owner, Resp::Bulk(Some(value.into_bytes())));
    let state = client.inspect("job").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].token, guard.token());
}

#[tokio::test]
async fn a_hundred_waiters_are_served_in_arrival_order() {
    const WAITERS: usize = 100;
    let server = Redis::start().await.unwrap();
    let holder = client(&server, Duration::from_secs(10)).await;
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    let connections = [
        backend(&server).await,
        backend(&server).await,
        backend(&server).await,
    ];
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let mut all_faults = Vec::new();
    for i in 0..WAITERS {
        let faults = Faulty::wrap(connections[i % connections.len()].clone());
        all_faults.push(faults.clone());
        let c = Client::builder(faults.clone())
            .options(options(Duration::from_secs(10)))
            .build();
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let guard = c.mutex("job").unwrap().lock().await.unwrap();
            order.lock().unwrap().push(i);
            guard.release().await.unwrap();
        }));
        // Queued before the next one starts: it waits only after its first busy answer.
        faults.until_calls(Op::Wait, 1).await;
    }
    assert_eq!(holder.inspect("job").await.unwrap().waiters.len(), WAITERS);
    guard.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    // Only the head is woken by each release: a few tries per waiter, not one per release
    // per waiter (a herd would make about WAITERS² / 2 = 5000).
    let tries: u64 = all_faults.iter().map(|f| f.calls(Op::Acquire)).sum();
    assert!(
        tries <= 4 * WAITERS as u64,
        "{tries} acquire attempts for {WAITERS} waiters"
    );
}

#[tokio::test]
async fn a_waiter_is_woken_by_the_release_not_by_polling() {
    let server = Redis::start().await.unwrap();
    let holder = client(&server, Duration::from_secs(300)).await;
    // The waiter re-checks on its own only every ttl / 3 = 100 s.
    let (waiter, faults) = faulty_client(&server, Duration::from_secs(300)).await;
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    let mutex = waiter.mutex("job").unwrap();
    let waiting =
        tokio::spawn(
            async move { tokio::time::timeout(Duration::from_secs(5), mutex.lock()).await },
        );
    faults.until_calls(Op::Wait, 2).await;
    guard.release().await.unwrap();
    let got = waiting.await.unwrap();
    assert!(got.is_ok(), "the waiter was not woken by the release");
}

#[tokio::test]
async fn every_key_shares_the_names_hash_tag_and_only_the_counter_stays() {
    let server = Redis::start().await.unwrap();
    let a = client(&server, Duration::from_secs(5)).await;
    let b = client(&server, Duration::from_secs(5)).await;
    let write = a.rwlock("job").unwrap().write().await.unwrap();
    let waiting_reader = {
        let rw = b.rwlock("job").unwrap();
        tokio::spawn(async move { rw.read().await })
    };
    let permit = a.semaphore("job", 2).unwrap().acquire().await.unwrap();
    let keys = match server.command(&["KEYS", "*"]).await.unwrap() {
        Resp::Array(Some(keys)) => keys.iter().filter_map(Resp::text).collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert!(keys.len() >= 4, "{keys:?}");
    assert!(
        keys.iter().all(|k| k.starts_with("leasehold:{job}:")),
        "{keys:?}"
    );
    write.release().await.unwrap();
    waiting_reader
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    permit.release().await.unwrap();
    assert_eq!(
        server.command(&["KEYS", "*"]).await.unwrap(),
        Resp::Array(Some(vec![Resp::Bulk(Some(
            b"leasehold:{job}:token".to_vec()
        ))]))
    );
}

/// A fair exclusive request on "job" by a new owner, with the given ttl and waiting flag.
fn request(ttl: Duration, waiting: bool) -> Request {
    let mut request = Request::new(
        LockName::new("job").unwrap(),
        OwnerId::generate(),
        Mode::Exclusive,
        ttl,
    );
    request.fair = true;
    request.waiting = waiting;
    request
}

/// A holder's lease that ends while someone waits behind it: the lock key lives on for the
/// waiter (it keeps the acquire fast path shut), with the holder's own lease end in its
/// value. After that end the holder can neither renew nor release, nobody barges in ahead
/// of the waiter, and the waiter gets the lock; the last release removes the key.
#[tokio::test]
async fn a_lease_that_ends_while_others_wait_stays_ended() {
    let server = Redis::start().await.unwrap();
    let a = RedisBackend::connect(&server.url()).await.unwrap();
    let b = RedisBackend::connect(&server.url()).await.unwrap();
    let first = request(Duration::from_millis(500), false);
    let Acquire::Granted(grant) = a.acquire(&first).await.unwrap() else {
        panic!("a free lock was busy");
    };
    let granted = tokio::time::Instant::now();
    let waiting = request(Duration::from_secs(30), true);
    assert!(matches!(
        b.acquire(&waiting).await.unwrap(),
        Acquire::Busy(_)
    ));
    let key = "leasehold:{job}:lock";
    match server.command(&["PTTL", key]).await.unwrap() {
        Resp::Integer(ms) => assert!(ms > 10_000, "the key lives as long as the waiter: {ms} ms"),
        other => panic!("{other:?}"),
    }
    // Let the first lease run out on the server (its end is in the value, not an event).
    tokio::time::sleep_until(granted + Duration::from_millis(700)).await;
    assert!(matches!(a.renew(&first).await.unwrap(), Renewal::Lost(_)));
    assert!(matches!(a.release(&first).await.unwrap(), Release::NotHeld));
    let c = client(&server, Duration::from_secs(5)).await;
    assert!(
        c.mutex("job").unwrap().try_lock().await.unwrap().is_none(),
        "barged in"
    );
    let Acquire::Granted(next) = b.acquire(&waiting).await.unwrap() else {
        panic!("the waiter is still busy after the lease before it ended");
    };
    assert!(next.token > grant.token);
    let state = c.inspect("job").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].owner, waiting.owner);
    assert_eq!(state.holders[0].token, next.token);
    assert!(matches!(
        b.release(&waiting).await.unwrap(),
        Release::Released
    ));
    assert_eq!(
        server.command(&["EXISTS", key]).await.unwrap(),
        Resp::Integer(0)
    );
}

/// A waiter whose own entry lasts far longer than the lease before it is told to try again
/// when that lease ends (the key lives on for the waiter, so its expiry is no guide).
#[tokio::test]
async fn a_waiter_retries_when_the_lease_before_it_ends() {
    let server = Redis::start().await.unwrap();
    let a = RedisBackend::connect(&server.url()).await.unwrap();
    let first = request(Duration::from_millis(500), false);
    assert!(matches!(
        a.acquire(&first).await.unwrap(),
        Acquire::Granted(_)
    ));
    let started = std::time::Instant::now();
    let b = client(&server, Duration::from_secs(30)).await;
    let next = b
        .mutex("job")
        .unwrap()
        .lock_timeout(Duration::from_secs(20))
        .await
        .unwrap()
        .expect("granted when the first lease ended");
    // Its next look would otherwise be a third of its ttl away (10 s), or the key's expiry.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "granted {:?} after a 500 ms lease",
        started.elapsed()
    );
    next.release().await.unwrap();
}

/// A waiter that gave up leaves the lock key behind as a gate (its release call does not
/// see every key), which sends the next acquire down the full path; that grant replaces the
/// gate, and from then on an uncontended cycle is two script calls again.
#[tokio::test]
async fn the_fast_path_comes_back_after_contention() {
    let server = Redis::start().await.unwrap();
    let a = client(&server, Duration::from_secs(5)).await;
    let b = client(&server, Duration::from_secs(5)).await;
    let held = a.mutex("job").unwrap().lock().await.unwrap();
    let gave_up = b
        .mutex("job")
        .unwrap()
        .lock_timeout(Duration::from_millis(200))
        .await
        .unwrap();
    assert!(gave_up.is_none());
    held.release().await.unwrap();
    let cycle = || async {
        a.mutex("job")
            .unwrap()
            .lock()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    };
    cycle().await;
    let before = server.scripts_run().await.unwrap();
    for _ in 0..3 {
        cycle().await;
    }
    assert_eq!(server.scripts_run().await.unwrap() - before, 6);
}
