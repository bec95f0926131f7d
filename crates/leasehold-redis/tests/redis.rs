//! What only the Redis backend promises, against real redis-servers.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use leasehold_core::backend::{
    Acquire, Backend, Eviction, Expiry, Mode, Release, Renewal, Request, WaitHint,
};
use leasehold_core::{
    Client, Error, FencingToken, LockName, LockOptions, LossReason, NamePrefix, OwnerId, RecordKey,
};
use leasehold_redis::{RedisBackend, RedisOptions, ReplicaAck};
use leasehold_testkit::faulty::{Faulty, Op};
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
    // Tokens ahead of the server's clock (handed out by a server whose clock ran ahead)...
    server
        .command(&["SET", "leasehold:{job}:token", "9000000000000000"])
        .await
        .unwrap();
    let first = a.mutex("job").unwrap().lock().await.unwrap();
    let seen = first.token();
    first.release().await.unwrap();
    // ...then the counter lost, as an async failover to a lagging replica would: the clock
    // alone no longer keeps the next token above the ones seen.
    server
        .command(&["SET", "leasehold:{job}:token", "5"])
        .await
        .unwrap();
    let next = a.mutex("job").unwrap().lock().await.unwrap();
    assert!(next.token() > seen, "{} after {seen}", next.token());
    // Exactly one holder: the stale grant was given back.
    assert_eq!(a.inspect("job").await.unwrap().holders.len(), 1);
}

/// A counter that lags still grants tokens above the ones handed out before.
/// A replica promoted before the last increments reached it grants them to a client that
/// never saw them: tokens are never below the server's clock, so the fence refuses the
/// superseded holder.
#[tokio::test]
async fn a_lagging_counter_still_grants_tokens_above_earlier_ones_to_other_clients() {
    let server = Redis::start().await.unwrap();
    let a = client(&server, Duration::from_secs(5)).await;
    let first = a.mutex("job").unwrap().lock().await.unwrap();
    let handed_out = first.token();
    first.release().await.unwrap();
    server
        .command(&["SET", "leasehold:{job}:token", "5"])
        .await
        .unwrap();
    let b = client(&server, Duration::from_secs(5)).await;
    let next = b.mutex("job").unwrap().lock().await.unwrap();
    assert!(
        next.token() > handed_out,
        "token {} after {handed_out}",
        next.token()
    );
    let fence = leasehold_core::Fence::new();
    fence.apply(next.token(), || ()).unwrap();
    assert!(fence.apply(handed_out, || ()).is_err());
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

/// Asserts that `answer` is a backend error whose message contains `says`.
fn refused<T: std::fmt::Debug>(answer: Result<T, Error>, says: &str) {
    match answer {
        Err(Error::Backend { message, .. }) => assert!(message.contains(says), "{message}"),
        other => panic!("expected a backend error saying {says:?}, got {other:?}"),
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
    refused(
        a.mutex("job")
            .unwrap()
            .lock_timeout(Duration::from_secs(1))
            .await,
        "not written by leasehold",
    );
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
    refused(a.rwlock("other").unwrap().try_read().await, "another type");

    // A fencing counter that is not a number: refused (as INCR refuses it), kept, and no
    // lock granted.
    for garbage in ["not a number", "1e300"] {
        server
            .command(&["SET", "leasehold:{count}:token", garbage])
            .await
            .unwrap();
        refused(a.mutex("count").unwrap().try_lock().await, "not an integer");
        assert_eq!(
            server
                .command(&["GET", "leasehold:{count}:token"])
                .await
                .unwrap(),
            Resp::Bulk(Some(garbage.as_bytes().to_vec()))
        );
        assert!(a.inspect("count").await.unwrap().holders.is_empty());
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

/// A guard dropped sends its release script from the drop.
/// It goes ahead of the client's next command on the one connection: the lock taken again
/// at once is free.
#[tokio::test]
async fn a_dropped_guard_is_gone_before_the_clients_next_command() {
    let server = Redis::start().await.unwrap();
    let client = client(&server, Duration::from_secs(30)).await;
    let mutex = client.mutex("dropped").unwrap();
    for _ in 0..20 {
        drop(mutex.lock().await.unwrap());
        // The release went out in the drop, before this acquire on the same connection.
        // (Redis's acquire happens to yield once before it sends, so the old spawned
        // release also got there first: this checks the outcome, not the mechanism; the
        // engine and ZooKeeper tests check the mechanism.)
        let again = mutex.try_lock().await.unwrap();
        assert!(again.is_some(), "the dropped guard still held the lock");
    }
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

/// A busy answer's hint, after the wait that subscribes to the name's wake-ups.
/// The acquire is sent again with the subscription in place, as the engine does.
async fn queued(backend: &RedisBackend, req: &Request) -> WaitHint {
    let Acquire::Busy(hint) = backend.acquire(req).await.unwrap() else {
        panic!("not busy");
    };
    backend
        .wait(&req.name, &hint, Duration::ZERO)
        .await
        .unwrap();
    match backend.acquire(req).await.unwrap() {
        Acquire::Busy(hint) => hint,
        Acquire::Granted(_) => panic!("granted"),
    }
}

/// A release hands the lock straight to the exclusive waiter at the head of the queue.
/// The wake-up tells the grant, so the waiter takes it without a request: a token above
/// the last, a lease counted from when its busy request was sent, a hand-off of zero. A
/// waiter with a value to store at its grant is woken to take it itself.
#[tokio::test]
async fn a_release_hands_the_lock_to_the_next_waiter_in_the_wake_up() {
    let server = Redis::start().await.unwrap();
    let a = RedisBackend::connect(&server.url()).await.unwrap();
    let b = RedisBackend::connect(&server.url()).await.unwrap();
    let ttl = Duration::from_secs(30);
    let holder = request(ttl, false);
    let Acquire::Granted(first) = a.acquire(&holder).await.unwrap() else {
        panic!("the free name was not granted");
    };
    let next = request(ttl, true);
    let hint = queued(&b, &next).await;
    let mut valued = request(ttl, true);
    valued.value = Some(Arc::from(&b"v"[..]));
    let behind = queued(&b, &valued).await;
    assert!(
        b.handed(&next, &hint).await.is_none(),
        "handed before the release"
    );

    let calls = script_calls(&server).await;
    a.release(&holder).await.unwrap();
    b.wait(&next.name, &hint, Duration::from_secs(5))
        .await
        .unwrap();
    let grant = b
        .handed(&next, &hint)
        .await
        .expect("no grant in the wake-up");
    assert_eq!(
        script_calls(&server).await,
        calls + 1,
        "the waiter sent a request"
    );
    assert!(grant.token.get() > first.token.get());
    assert_eq!(grant.handoff, Some(Duration::ZERO));
    // The lease of the busy request's waiter entry: counted from when that request was sent
    // (by the engine), it ends before the server's does.
    assert_eq!(grant.expiry, Expiry::After(ttl));
    let lease = server
        .command(&["PTTL", &format!("leasehold:{{{}}}:lock", next.name)])
        .await
        .unwrap();
    assert!(
        matches!(lease, Resp::Integer(ms) if ms > 0 && ms <= 30_000),
        "{lease:?}"
    );
    let state = b.inspect(&next.name).await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].owner, next.owner);
    assert_eq!(state.holders[0].token, grant.token);

    // Its release wakes the waiter with a value, which is not handed the lock (its value
    // must be stored with the grant) and takes it with a request.
    b.release(&next).await.unwrap();
    b.wait(&valued.name, &behind, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(b.handed(&valued, &behind).await.is_none());
    let Acquire::Granted(taken) = b.acquire(&valued).await.unwrap() else {
        panic!("the woken waiter was not granted");
    };
    assert!(taken.token.get() > grant.token.get());
    assert_eq!(
        b.inspect(&valued.name).await.unwrap().holders[0]
            .value
            .as_deref(),
        Some(&b"v"[..])
    );
    b.release(&valued).await.unwrap();
}

/// A waiter's grant after a release carries the hand-off, measured by the server.
/// It is the time from the release to the grant on the server's clock, so at most the time
/// from the release's send to the grant's answer here; a grant after no release (a free
/// name, a lease that ended) carries none. (The waiters here have values: a plain one is
/// handed the lock by the release.)
#[tokio::test]
async fn a_waiters_grant_after_a_release_carries_the_servers_handoff() {
    let server = Redis::start().await.unwrap();
    let a = RedisBackend::connect(&server.url()).await.unwrap();
    let b = RedisBackend::connect(&server.url()).await.unwrap();
    let granted = |answer| match answer {
        Acquire::Granted(grant) => grant,
        other => panic!("not granted: {other:?}"),
    };
    let request = |ttl, waiting| {
        let mut req = request(ttl, waiting);
        req.value = Some(Arc::from(&b"v"[..]));
        req
    };
    let first = request(Duration::from_secs(30), false);
    assert_eq!(granted(a.acquire(&first).await.unwrap()).handoff, None);
    let waiting = request(Duration::from_secs(30), true);
    assert!(matches!(
        b.acquire(&waiting).await.unwrap(),
        Acquire::Busy(_)
    ));
    let released = std::time::Instant::now();
    assert!(matches!(
        a.release(&first).await.unwrap(),
        Release::Released
    ));
    let next = granted(b.acquire(&waiting).await.unwrap());
    let bound = released.elapsed();
    let handoff = next.handoff.expect("no hand-off after a release");
    // The server's wall clock against ours: a millisecond for their rates and rounding.
    assert!(
        handoff > Duration::ZERO && handoff <= bound + Duration::from_millis(1),
        "{handoff:?} against {bound:?} from the release's send"
    );

    // A lease that ends while a waiter waits: no release, so no hand-off.
    let short = request(Duration::from_millis(300), true);
    assert!(matches!(a.acquire(&short).await.unwrap(), Acquire::Busy(_)));
    assert!(matches!(
        b.release(&waiting).await.unwrap(),
        Release::Released
    ));
    assert!(granted(a.acquire(&short).await.unwrap()).handoff.is_some());
    let after = request(Duration::from_secs(30), true);
    assert!(matches!(b.acquire(&after).await.unwrap(), Acquire::Busy(_)));
    // `short` is neither renewed nor released: `after` waits for its lease to end.
    let next = loop {
        match b.acquire(&after).await.unwrap() {
            Acquire::Granted(grant) => break grant,
            Acquire::Busy(hint) => b
                .wait(&after.name, &hint, Duration::from_secs(1))
                .await
                .unwrap(),
        }
    };
    assert_eq!(next.handoff, None, "a lease that ended is no hand-off");
    b.release(&after).await.unwrap();

    // Queued behind a reader that the release let in first, a writer's hand-off counts
    // from the reader's release, not the writer's before it.
    let writer = request(Duration::from_secs(30), false);
    granted(a.acquire(&writer).await.unwrap());
    let mut reader = request(Duration::from_secs(30), true);
    reader.mode = Mode::Shared;
    let waiting = request(Duration::from_secs(30), true);
    for (backend, req) in [(&b, &reader), (&a, &waiting)] {
        assert!(matches!(
            backend.acquire(req).await.unwrap(),
            Acquire::Busy(_)
        ));
    }
    a.release(&writer).await.unwrap();
    granted(b.acquire(&reader).await.unwrap());
    assert!(matches!(
        a.acquire(&waiting).await.unwrap(),
        Acquire::Busy(_)
    ));
    // Held long enough that a figure from the writer's release would show it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released = std::time::Instant::now();
    b.release(&reader).await.unwrap();
    let handoff = granted(a.acquire(&waiting).await.unwrap()).handoff.unwrap();
    let bound = released.elapsed();
    assert!(
        handoff <= bound + Duration::from_millis(1),
        "{handoff:?} against {bound:?} from the reader's release"
    );
}

/// A holder's lease that ends while someone waits behind it.
/// The lock key lives on for the waiter (it keeps the acquire fast path shut), with the
/// holder's own lease end in its value. After that end the holder can neither renew nor
/// release, nobody barges in ahead of the waiter, and the waiter gets the lock; the last
/// release removes the key.
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

/// A waiter is told to try again when the lease before it ends.
/// Its own entry lasts far longer than that lease, and the key lives on for the waiter, so
/// its expiry is no guide.
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

/// A waiter that gave up leaves the lock key behind as a gate, until the next grant.
/// Its release call does not see every key; the gate sends the next acquire down the full
/// path, that grant replaces the gate, and from then on an uncontended cycle is two script
/// calls again.
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

/// How many lock channels the server has subscribers for.
async fn lock_channels(server: &Redis) -> usize {
    match server
        .command(&["PUBSUB", "CHANNELS", "leasehold:*"])
        .await
        .unwrap()
    {
        Resp::Array(Some(channels)) => channels.len(),
        other => panic!("{other:?}"),
    }
}

/// Wake-up state is kept per lock name only while something needs it.
/// After observers of 100,000 distinct names and waiters on 1,000 more are done, the server
/// has no subscription of ours left, and the client no wake-up state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_name_wakeup_state_returns_to_its_baseline() {
    const OBSERVED: usize = 100_000;
    const WAITED: usize = 1_000;
    let server = Redis::start().await.unwrap();
    let observer = RedisBackend::connect(&server.url()).await.unwrap();
    let waiter = RedisBackend::connect(&server.url()).await.unwrap();
    assert_eq!(lock_channels(&server).await, 0);
    // Observers (an election's observe: inspect, then wait): each name gets a subscription.
    futures_util::stream::iter(0..OBSERVED)
        .for_each_concurrent(256, |i| {
            let observer = observer.clone();
            async move {
                let name = LockName::new(&format!("order-{i}")).unwrap();
                let state = observer.inspect(&name).await.unwrap();
                observer
                    .wait(&name, &state.hint, Duration::from_secs(1))
                    .await
                    .unwrap();
            }
        })
        .await;
    assert!(lock_channels(&server).await > 0, "no subscription was made");
    // Waiters woken by a release, through the whole engine.
    let holder = client(&server, Duration::from_secs(30)).await;
    futures_util::stream::iter(0..WAITED)
        .for_each_concurrent(64, |i| {
            let (holder, waiter) = (&holder, &waiter);
            async move {
                let name = format!("job-{i}");
                let held = holder.mutex(&name).unwrap().lock().await.unwrap();
                let faults = Faulty::wrap(Arc::new(waiter.clone()));
                let mutex = Client::builder(faults.clone())
                    .options(options(Duration::from_secs(30)))
                    .build()
                    .mutex(&name)
                    .unwrap();
                let waiting = tokio::spawn(async move { mutex.lock().await.unwrap() });
                // Subscribed (the first wait) and asleep (the second): woken by the push.
                faults.until_calls(Op::Wait, 2).await;
                held.release().await.unwrap();
                waiting.await.unwrap().release().await.unwrap();
            }
        })
        .await;
    // Freed in the background once nothing needs them: wait for the server to say so.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let left = lock_channels(&server).await;
        if left == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{left} lock channels are still subscribed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(observer.wakeup_channels() + waiter.wakeup_channels(), 0);
    // Uncontended locks make no wake-up state and no (un)subscription at all.
    let subscriptions = || async {
        let info = server.command(&["INFO", "commandstats"]).await.unwrap();
        let info = info.text().unwrap();
        ["cmdstat_subscribe:", "cmdstat_unsubscribe:"].map(|stat| {
            info.lines()
                .find(|l| l.starts_with(stat))
                .map(str::to_owned)
        })
    };
    let before = subscriptions().await;
    for i in 0..100 {
        let guard = holder
            .mutex(&format!("free-{i}"))
            .unwrap()
            .lock()
            .await
            .unwrap();
        guard.release().await.unwrap();
    }
    assert_eq!(subscriptions().await, before);
}

/// Connecting is done within the connect timeout or fails.
/// Connecting is the connection, loading the scripts and reading the configuration: a
/// server that answers each request after a second is refused by a 1.5 s connect timeout,
/// since connecting takes at least two round trips (the handshake alone fits in the
/// timeout).
#[tokio::test]
async fn connecting_is_bounded_by_the_connect_timeout() {
    let server = Redis::start().await.unwrap();
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    proxy.set_delay(Direction::ToClient, Duration::from_secs(1));
    let options = RedisOptions::default().connect_timeout(Duration::from_millis(1500));
    let url = format!("redis://127.0.0.1:{}", proxy.port());
    let started = std::time::Instant::now();
    match RedisBackend::connect_with(&url, options).await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("timed out"), "{message}");
        }
        other => panic!(
            "{:?} after {:?}: connecting took longer than its timeout",
            other.map(|_| "connected"),
            started.elapsed()
        ),
    }
}

/// Concurrent shared and permit grants of one client, on a multi-thread runtime.
/// They finish in any order: none of them is taken for a token regression (given back and
/// granted again, or refused). Every try gets its grant in exactly one script call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_grants_are_not_taken_for_lost_data() {
    const TRIES: usize = 2_000;
    let server = Redis::start().await.unwrap();
    let c = client(&server, Duration::from_secs(30)).await;
    for (name, shared) in [("readers", true), ("permits", false)] {
        let before = server.scripts_run().await.unwrap();
        let tries = (0..TRIES).map(|_| {
            let c = c.clone();
            tokio::spawn(async move {
                if shared {
                    let guard = c.rwlock(name).unwrap().try_read().await;
                    guard.map(|g| g.map(|g| Box::new(g) as Box<dyn std::any::Any + Send>))
                } else {
                    let permits = c.semaphore(name, 1_000_000).unwrap();
                    let permit = permits.try_acquire().await;
                    permit.map(|p| p.map(|p| Box::new(p) as Box<dyn std::any::Any + Send>))
                }
            })
        });
        let guards: Vec<_> = futures_util::future::join_all(tries)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        if let Some(refused) = guards.iter().find(|g| !matches!(g, Ok(Some(_)))) {
            let refused = refused.as_ref().map(|_| "None");
            panic!("{name}: free, yet {refused:?}");
        }
        let scripts = server.scripts_run().await.unwrap() - before;
        assert_eq!(
            scripts, TRIES as u64,
            "{name}: grants were given back and made again"
        );
        drop(guards);
        c.settle().await;
    }
}

/// A Redis fence is one key holding the highest token it accepted.
/// It does not grow with the writes that go through it.
#[tokio::test]
async fn a_fence_is_one_key_whatever_the_number_of_writes() {
    use leasehold_core::FencingToken;
    use leasehold_redis::fence::RedisFence;

    let server = Redis::start().await.unwrap();
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let accesses = Arc::new(Accesses::default());
    let fence = RedisFence::new("{stock}:fence").reporting_to(accesses.clone());
    for token in 1..=2_000u64 {
        let written = fence
            .incr_by(&mut conn, FencingToken::new(token), "{stock}:count", 1)
            .await
            .unwrap();
        assert_eq!(written, Ok(i64::try_from(token).unwrap()));
        // A stale holder's write is refused and leaves nothing either.
        let stale = fence
            .incr_by(&mut conn, FencingToken::new(token - 1), "{stock}:count", 1)
            .await
            .unwrap();
        assert!(token == 1 || stale.is_err());
    }
    assert_eq!(
        server.command(&["DBSIZE"]).await.unwrap(),
        Resp::Integer(2),
        "the fence and the count"
    );
    assert_eq!(
        server.command(&["GET", "{stock}:fence"]).await.unwrap(),
        Resp::Bulk(Some(b"2000".to_vec()))
    );
    // Each access was reported, with the fence's key as the resource.
    let accesses = accesses.0.lock().unwrap();
    let accepted = accesses.iter().filter(|a| a.accepted).count();
    assert_eq!(accepted, 2_000);
    assert!(accesses.len() - accepted >= 1_999);
    assert!(
        accesses
            .iter()
            .all(|a| a.resource == "{stock}:fence" && a.fence == "redis")
    );
    let refused = accesses.iter().find(|a| !a.accepted).unwrap();
    assert_eq!(
        refused.highest.map(|h| h.get()),
        Some(refused.token.get() + 1)
    );
}

/// Keeps the fence accesses reported to it.
#[derive(Debug, Default)]
struct Accesses(Mutex<Vec<leasehold_core::events::AccessEvent>>);

impl leasehold_core::events::EventSink for Accesses {
    fn record(&self, _: &leasehold_core::events::LockEvent) {}

    fn record_access(&self, event: &leasehold_core::events::AccessEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

/// A connection that goes silent without closing is replaced once requests time out on it.
/// That is a partition that drops packets; once requests have timed out on it with nothing
/// coming back, the client serves requests again on a new connection, and the wake-up
/// channels in use are subscribed on it.
#[tokio::test]
async fn a_blackholed_connection_is_replaced_after_requests_time_out() {
    let server = Redis::start().await.unwrap();
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    let url = format!("redis://127.0.0.1:{}", proxy.port());
    // A waiter comes back to the server every third of the lease: a long lease keeps it
    // asleep on its wake-up channel while the connection breaks and is replaced.
    let long_lease = LockOptions::builder()
        .ttl(Duration::from_secs(60))
        .request_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let faults = Faulty::wrap(Arc::new(RedisBackend::connect(&url).await.unwrap()));
    let cut_off = Client::builder(faults.clone()).options(long_lease).build();
    let other = client(&server, Duration::from_secs(5)).await;
    let held = other.mutex("blackholed").unwrap().lock().await.unwrap();
    // A waiter subscribed to the name's wake-ups through the connection before it broke;
    // it gives up long before it would come back to the server on its own.
    let waiting = {
        let mutex = cut_off.mutex("blackholed").unwrap();
        tokio::spawn(async move { mutex.lock_timeout(Duration::from_secs(15)).await })
    };
    // Subscribed (the first wait) and asleep on its channel (the second).
    faults.until_calls(Op::Wait, 2).await;

    proxy.cut_open(Direction::Both);
    // The first request times out with nothing heard back (its clean-up too); the next is
    // sent on a new connection.
    let first = cut_off.mutex("elsewhere").unwrap().try_lock().await;
    assert!(matches!(first, Err(Error::Timeout(_))), "{first:?}");
    let second = cut_off.mutex("elsewhere").unwrap().try_lock().await;
    assert!(
        matches!(second, Ok(Some(_))),
        "the client still sends into the silent connection: {second:?}"
    );
    // The waiter's wake-up comes through the new connection.
    held.release().await.unwrap();
    let woken = waiting.await.unwrap().unwrap();
    assert!(woken.is_some(), "the waiter was not woken");
}

/// An acquire held on a connection given up as silent never runs after its release.
/// The acquisition's requests are held in the network; the connection is replaced, the
/// acquisition is granted on the new one and released. When the old link heals, the
/// acquires it held must not reach the server: they would grant the lock again, to an owner
/// that has gone, for a whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_held_on_a_replaced_connection_grants_nothing_late() {
    held_acquires_grant_nothing_late(false).await;
}

/// As above, on a connection that redis-rs had reconnected by itself before it went silent.
/// The server knows a reconnected connection under another id: it is named again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_held_on_a_reconnected_then_replaced_connection_grants_nothing_late() {
    held_acquires_grant_nothing_late(true).await;
}

async fn held_acquires_grant_nothing_late(reconnect_first: bool) {
    let server = Redis::start().await.unwrap();
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    let url = format!("redis://127.0.0.1:{}", proxy.port());
    let impatient = LockOptions::builder()
        .ttl(Duration::from_secs(60))
        .request_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let a = Client::builder_from_arc(Arc::new(RedisBackend::connect(&url).await.unwrap()))
        .options(impatient)
        .build();
    // The connection `a` sends its requests on, which the held acquires will reach.
    let mut old = named_clients(&server).await;
    assert_eq!(old.len(), 1, "{old:?}");
    if reconnect_first {
        proxy.reset();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            // Requests after the reset reconnect, and name the new connection.
            let _ = a.inspect("job").await;
            let named = named_clients(&server).await;
            if named.len() == 1 && named != old {
                old = named;
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the reconnected connection was not named: {named:?} (before: {old:?})"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    proxy.cut_open(Direction::Both);
    let mutex = a.mutex("job").unwrap();
    match mutex.lock_timeout(Duration::from_secs(30)).await {
        Ok(Some(guard)) => guard.release().await.unwrap(),
        gave_up => assert!(
            matches!(gave_up, Err(ref e) if e.is_unknown_outcome()),
            "{gave_up:?}"
        ),
    }
    a.settle().await;
    let probe = client(&server, Duration::from_secs(5)).await;
    assert!(probe.inspect("job").await.unwrap().holders.is_empty());
    proxy.heal();
    // The held acquires are delivered to a connection that is gone, or run before the
    // server reads its end.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while named_clients(&server)
        .await
        .iter()
        .any(|id| old.contains(id))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replaced connection is still open"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        probe
            .mutex("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some(),
        "an acquire held on the replaced connection granted the lock after its release"
    );
}

/// The ids of the server's clients that leasehold named (its request connections).
async fn named_clients(server: &Redis) -> Vec<String> {
    let list = leasehold_testkit::probe::redis_command(server.addr(), &["CLIENT", "LIST"])
        .await
        .unwrap();
    let list = list.text().unwrap();
    list.lines()
        .filter(|line| line.contains(" name=leasehold-"))
        .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
        .map(str::to_owned)
        .collect()
}

/// Replacing a connection while a wake-up channel is being dropped leaves no subscription.
/// The channel was subscribed on the old connection; the sweep that drops it unsubscribes
/// it where it is subscribed now (the new connection), not only on the connection it
/// started with.
#[tokio::test]
async fn a_replaced_connection_keeps_no_subscription_of_a_dropped_channel() {
    /// How long a channel nobody uses stays subscribed (`wakeups::LINGER`).
    const LINGER: Duration = Duration::from_secs(1);
    let server = Redis::start().await.unwrap();
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    let backend = RedisBackend::connect(&format!("redis://127.0.0.1:{}", proxy.port()))
        .await
        .unwrap();
    let name = |name: &str| LockName::new(name).unwrap();
    // An observer of "left" subscribes to it (its first wait) and is gone: the channel
    // is unused from now on, and swept a linger later.
    let state = backend.inspect(&name("left")).await.unwrap();
    backend
        .wait(&name("left"), &state.hint, Duration::from_secs(1))
        .await
        .unwrap();
    drop(state);
    assert_eq!(lock_channels(&server).await, 1);
    // The connection goes silent while an observer of "stuck" subscribes through it: its
    // SUBSCRIBE holds the subscriptions' order until the link heals.
    let stuck = backend.inspect(&name("stuck")).await.unwrap();
    proxy.cut_open(Direction::Both);
    let subscribing = {
        let backend = backend.clone();
        tokio::spawn(async move {
            backend
                .wait(&name("stuck"), &stuck.hint, Duration::from_secs(1))
                .await
        })
    };
    // The sweep of "left" is due now: it starts, and waits behind that SUBSCRIBE. (Only
    // the old code's race needs this pause to show; the outcome must not depend on it.)
    tokio::time::sleep(LINGER + LINGER / 2).await;
    // Two requests given up on in silence; the third goes out on a new connection, with
    // "left" (not swept yet) subscribed on it.
    let probe = name("probe");
    for _ in 0..2 {
        let given_up = tokio::time::timeout(Duration::from_millis(200), backend.inspect(&probe));
        assert!(given_up.await.is_err());
    }
    backend.inspect(&probe).await.unwrap();
    // The old link heals: the SUBSCRIBE fails there (the replacement ended that
    // connection; the waiter would ask again), and the sweep goes on.
    proxy.heal();
    if let Err(error) = subscribing.await.unwrap() {
        assert!(error.is_retryable(), "{error:?}");
    }
    let deadline = tokio::time::Instant::now() + 30 * LINGER;
    loop {
        let left = lock_channels(&server).await;
        if left == 0 && backend.wakeup_channels() == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{left} lock channels are still subscribed, {} known to the client",
            backend.wakeup_channels()
        );
        tokio::time::sleep(LINGER / 10).await;
    }
}

/// A listing of 100,000 held locks finds each of them once, with its holder.
/// It pages through the keyspace with `SCAN` (many calls, each short) and never runs
/// `KEYS`, which would block the server for the whole keyspace at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_a_hundred_thousand_locks_pages_through_scan() {
    const LOCKS: usize = 100_000;
    let server = Redis::start().await.unwrap();
    let redis = backend(&server).await;
    // The backend's acquire (the scripts a client's lock runs), many at once on its
    // connection; the leases outlast the test, so nothing needs renewing.
    let grant = |name: String| {
        let redis = redis.clone();
        async move {
            let owner = OwnerId::generate();
            let name = LockName::new(&name).unwrap();
            let req = Request::new(
                name,
                owner.clone(),
                Mode::Exclusive,
                Duration::from_secs(600),
            );
            match redis.acquire(&req).await.unwrap() {
                Acquire::Granted(grant) => (req.name.to_string(), owner, grant.token),
                Acquire::Busy(_) => panic!("{} is free, yet busy", req.name),
            }
        }
    };
    let mut expected: Vec<(String, OwnerId, leasehold_core::FencingToken)> =
        futures_util::stream::iter(0..LOCKS)
            .map(|i| grant(format!("bulk:{i}")))
            .buffer_unordered(1024)
            .collect()
            .await;
    expected.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    // Held too, but outside the prefix.
    grant("bulky".into()).await;
    // Command statistics count from here. The server also forgets its scripts (as after a
    // restart): the listing's first page loads the inspect script again.
    for command in [["CONFIG", "RESETSTAT"], ["SCRIPT", "FLUSH"]] {
        assert_eq!(
            server.command(&command).await.unwrap(),
            Resp::Simple("OK".into())
        );
    }

    let c = Client::builder_from_arc(redis)
        .options(options(Duration::from_secs(5)))
        .build();
    let listed = c.locks("bulk:").await.unwrap();
    assert_eq!(listed.len(), LOCKS, "locks listed");
    for ((name, state), (want, owner, token)) in listed.iter().zip(&expected) {
        assert_eq!(name.as_str(), want);
        assert_eq!(state.holders.len(), 1, "holders of {name}");
        let holder = &state.holders[0];
        assert_eq!(
            (&holder.owner, holder.token, holder.mode),
            (owner, *token, Mode::Exclusive),
            "{name}"
        );
        assert!(state.waiters.is_empty(), "waiters of {name}");
    }

    let stats = match server.command(&["INFO", "commandstats"]).await.unwrap() {
        Resp::Bulk(Some(text)) => String::from_utf8(text).unwrap(),
        other => panic!("INFO commandstats: {other:?}"),
    };
    let calls = |command: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
    };
    assert!(calls("scan") > 1, "SCAN calls: {stats}");
    assert_eq!(calls("keys"), 0, "KEYS calls: {stats}");
}

/// A force release removes the named grant only, in every mode, and only with its token.
/// A reader's or a permit's eviction leaves the other holders of the set their grants; a
/// stale eviction (the right owner, a token not its grant's, or another mode) removes
/// nothing. The evicted holder's renewal says why it lost, the set stays closed to new
/// grants (the exclusive fast path included) while the evicted lease lasts, and the
/// record is kept as the audit trail.
#[tokio::test]
async fn an_eviction_removes_the_named_grant_only_and_fences_it_out() {
    let server = Redis::start().await.unwrap();
    let redis = backend(&server).await;
    let ttl = Duration::from_secs(60);
    let limit = std::num::NonZeroU32::new(3).unwrap();
    let granted = async |req: &Request| match redis.acquire(req).await.unwrap() {
        Acquire::Granted(grant) => grant.token,
        Acquire::Busy(_) => panic!("{} is busy for {}", req.name, req.mode),
    };
    for (i, mode) in [Mode::Shared, Mode::Permit { limit }, Mode::Exclusive]
        .into_iter()
        .enumerate()
    {
        let name = LockName::new(&format!("evict:{i}")).unwrap();
        let request = |mode| Request::new(name.clone(), OwnerId::generate(), mode, ttl);
        let (a, b) = (request(mode), request(mode));
        let a_token = granted(&a).await;
        // Exclusive: the other holder is a permit, in the name's other set.
        let b = if mode == Mode::Exclusive {
            request(Mode::Permit { limit })
        } else {
            b
        };
        granted(&b).await;
        let eviction = |token| {
            Eviction::new(
                a.owner.clone(),
                token,
                "ops@host".into(),
                format!("stuck {mode}"),
            )
        };

        // Stale: an earlier token of the same owner, a later one, another mode.
        let earlier = FencingToken::new(a_token.get() - 1);
        let later = FencingToken::new(a_token.get() + 1);
        let other = if mode == Mode::Shared {
            Mode::Exclusive
        } else {
            Mode::Shared
        };
        for (evict_mode, token) in [(mode, earlier), (mode, later), (other, a_token)] {
            let evicted = redis.evict(&name, evict_mode, &eviction(token)).await;
            assert!(
                !evicted.unwrap(),
                "{mode}: evicted {evict_mode} with {token}"
            );
        }
        let state = redis.inspect(&name).await.unwrap();
        assert_eq!(state.holders.len(), 2, "{mode}: {:?}", state.holders);
        assert!(state.evictions.is_empty(), "{mode}: {:?}", state.evictions);
        assert!(matches!(
            redis.renew(&a).await.unwrap(),
            Renewal::Renewed(_)
        ));

        let record = eviction(a_token);
        assert!(redis.evict(&name, mode, &record).await.unwrap(), "{mode}");
        let state = redis.inspect(&name).await.unwrap();
        let holders: Vec<&OwnerId> = state.holders.iter().map(|h| &h.owner).collect();
        assert_eq!(holders, [&b.owner], "{mode}");
        assert_eq!(state.evictions, std::slice::from_ref(&record), "{mode}");
        // The evicted holder learns why; the other keeps its grant and renews.
        assert_eq!(
            redis.renew(&a).await.unwrap(),
            Renewal::Lost(LossReason::Evicted),
            "{mode}"
        );
        assert!(matches!(
            redis.renew(&b).await.unwrap(),
            Renewal::Renewed(_)
        ));
        // Closed to new grants of the set while the evicted lease lasts: the exclusive
        // fast path (no value, no lock-delay, not waiting) too.
        let c = request(mode);
        assert!(
            matches!(redis.acquire(&c).await.unwrap(), Acquire::Busy(_)),
            "{mode}: granted while the evicted lease lasts"
        );
        // Evicted once: again is nothing; its owner's release removes nothing of anyone's.
        assert!(!redis.evict(&name, mode, &record).await.unwrap());
        assert_eq!(redis.release(&a).await.unwrap(), Release::NotHeld);
        assert_eq!(redis.release(&b).await.unwrap(), Release::Released);
        assert_eq!(redis.inspect(&name).await.unwrap().evictions, [record]);

        // The records are an audit trail that expires a week after the latest.
        let key = format!("leasehold:{{{name}}}:evicted");
        let Resp::Integer(left) = server.command(&["PTTL", &key]).await.unwrap() else {
            panic!("PTTL {key}");
        };
        assert!(
            left > 6 * 24 * 3600 * 1000 && left <= 7 * 24 * 3600 * 1000,
            "{left}"
        );
    }
}

/// Every page of the locks whose names begin with `prefix`.
async fn listed(redis: &dyn Backend, prefix: &str) -> Vec<LockName> {
    let prefix = NamePrefix::new(prefix).unwrap();
    let (mut names, mut cursor) = (Vec::new(), None);
    loop {
        let page = redis.list(&prefix, cursor.as_ref(), 100).await.unwrap();
        names.extend(page.locks.into_iter().map(|(name, _)| name));
        match page.next {
            Some(next) => cursor = Some(next),
            None => return names,
        }
    }
}

/// A record beside a reader's, a permit's or a writer's grant is written while it holds.
/// Only then (as the server sees it). It lies in the lock's hash tag, expires on the
/// server's clock and is no lock; a key of another type under its name is reported, not
/// read.
#[tokio::test]
async fn records_beside_every_kind_of_grant_are_fenced_expire_and_are_no_locks() {
    let server = Redis::start().await.unwrap();
    let redis = backend(&server).await;
    let ttl = Duration::from_secs(60);
    let keep = Duration::from_secs(600);
    let limit = std::num::NonZeroU32::new(2).unwrap();
    let key = RecordKey::new("window:1").unwrap();
    for (i, mode) in [Mode::Shared, Mode::Permit { limit }, Mode::Exclusive]
        .into_iter()
        .enumerate()
    {
        let name = LockName::new(&format!("records:{i}")).unwrap();
        let request = |mode| Request::new(name.clone(), OwnerId::generate(), mode, ttl);
        let holder = request(mode);
        assert!(matches!(
            redis.acquire(&holder).await.unwrap(),
            Acquire::Granted(_)
        ));
        // Neither another owner nor the holder's owner in the name's other set holds it.
        let mut elsewhere = holder.clone();
        elsewhere.mode = match mode {
            Mode::Exclusive => Mode::Shared,
            _ => Mode::Exclusive,
        };
        for stranger in [&request(mode), &elsewhere] {
            let written = redis.put_record(stranger, &key, b"x", keep).await;
            assert!(!written.unwrap(), "{mode}: written by {stranger:?}");
        }
        assert_eq!(redis.get_record(&name, &key).await.unwrap(), None);
        assert!(redis.put_record(&holder, &key, b"one", keep).await.unwrap());
        assert_eq!(
            redis.get_record(&name, &key).await.unwrap().as_deref(),
            Some(&b"one"[..])
        );
        let record = format!("leasehold:{{{name}}}:rec:window:1");
        let Resp::Integer(left) = server.command(&["PTTL", &record]).await.unwrap() else {
            panic!("PTTL {record}");
        };
        assert!(left > 590_000 && left <= 600_000, "{mode}: {left} ms");
        assert_eq!(
            listed(&*redis, "records:").await,
            std::slice::from_ref(&name),
            "{mode}"
        );

        assert_eq!(redis.release(&holder).await.unwrap(), Release::Released);
        let written = redis.put_record(&holder, &key, b"two", keep).await;
        assert!(!written.unwrap(), "{mode}: written after the release");
        assert_eq!(
            redis.get_record(&name, &key).await.unwrap().as_deref(),
            Some(&b"one"[..])
        );
        // The record outlives the lock, and is not listed as one.
        assert!(listed(&*redis, "records:").await.is_empty(), "{mode}");
        assert!(redis.inspect(&name).await.unwrap().holders.is_empty());
    }
    let name = LockName::new("records:0").unwrap();
    let foreign = RecordKey::new("window:2").unwrap();
    server
        .command(&["HSET", "leasehold:{records:0}:rec:window:2", "f", "v"])
        .await
        .unwrap();
    let read = redis.get_record(&name, &foreign).await;
    assert!(matches!(read, Err(Error::Backend { .. })), "{read:?}");
}

/// A grant kept for a short hold ends then, and its waiters are told so at once.
/// They were told of its longer lease, and would otherwise look again only at its end or a
/// third of their own ttl (100 s here): a writer behind a reader, a permit behind the
/// semaphore's only permit, and a lock's waiter behind its holder.
#[tokio::test]
async fn a_kept_grant_ends_at_its_hold_and_its_waiters_are_told() {
    let server = Redis::start().await.unwrap();
    let long = Duration::from_secs(300);
    let hold = Duration::from_millis(500);
    for kind in ["read", "permit", "lock"] {
        let name = format!("kept:{kind}");
        let holder = client(&server, long).await;
        let (waiter, faults) = faulty_client(&server, long).await;
        let (guard, waiting) = match kind {
            "read" => {
                let rw = waiter.rwlock(&name).unwrap();
                let guard = holder.rwlock(&name).unwrap().read().await.unwrap();
                (
                    guard,
                    tokio::spawn(async move { rw.write_timeout(Duration::from_secs(10)).await }),
                )
            }
            "permit" => {
                let semaphore = waiter.semaphore(&name, 1).unwrap();
                let guard = holder.semaphore(&name, 1).unwrap().acquire().await;
                (
                    guard.unwrap(),
                    tokio::spawn(async move {
                        semaphore.acquire_timeout(Duration::from_secs(10)).await
                    }),
                )
            }
            _ => {
                let mutex = waiter.mutex(&name).unwrap();
                let guard = holder.mutex(&name).unwrap().lock().await.unwrap();
                (
                    guard,
                    tokio::spawn(async move { mutex.lock_timeout(Duration::from_secs(10)).await }),
                )
            }
        };
        // Subscribed (the first wait), then waiting with the holder's lease end as its hint.
        faults.until_calls(Op::Wait, 2).await;
        let owner = guard.owner().clone();
        let kept_at = std::time::Instant::now();
        guard.keep_for(hold).await.unwrap();
        holder.settle().await;
        let state = holder.inspect(&name).await.unwrap();
        let kept = (state.holders.iter())
            .find(|h| h.owner == owner)
            .expect("the kept grant is held");
        assert!(kept.remaining.unwrap() <= hold, "{kind}: {kept:?}");
        let next = waiting.await.unwrap().unwrap();
        // Its wait would otherwise end only at its timeout (10 s), when it tries once more.
        assert!(
            kept_at.elapsed() < Duration::from_secs(5),
            "{kind}: granted {:?} after a hold of {hold:?}",
            kept_at.elapsed()
        );
        next.expect("the waiter was not told the kept grant's end")
            .release()
            .await
            .unwrap();
    }
}

/// How many `EVALSHA` calls the server has run.
async fn script_calls(server: &Redis) -> u64 {
    let stats = server.command(&["INFO", "commandstats"]).await.unwrap();
    let stats = stats.text().unwrap_or_default();
    stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// A batch of renewals answers each grant as its own renewal would.
/// The plain exclusive grants go in one script call: renewed, not the owner's, evicted; a
/// grant with a waiter
/// behind it, a shared grant and one with a lock-delay are renewed by their own scripts.
#[tokio::test]
async fn a_batch_renews_each_grant_as_its_own_renewal_would() {
    let server = Redis::start().await.unwrap();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    let short = Duration::from_secs(2);
    let request = |name: &str, mode| {
        Request::new(
            LockName::new(name).unwrap(),
            OwnerId::generate(),
            mode,
            short,
        )
    };
    let plain = request("plain", Mode::Exclusive);
    let waited = request("waited", Mode::Exclusive);
    let stolen = request("stolen", Mode::Exclusive);
    let evicted = request("evicted", Mode::Exclusive);
    let shared = request("shared", Mode::Shared);
    let mut delayed = request("delayed", Mode::Exclusive);
    delayed.lock_delay = Some(Duration::from_millis(100));
    // Held by "owner-abc"; a renewal by "owner-ab" (a prefix of it) is not the owner's.
    let mut longer = request("prefix", Mode::Exclusive);
    longer.owner = OwnerId::parse("owner-abc").unwrap();
    let mut prefix = longer.clone();
    prefix.owner = OwnerId::parse("owner-ab").unwrap();
    let mut tokens = Vec::new();
    for req in [
        &plain, &waited, &stolen, &evicted, &shared, &delayed, &longer,
    ] {
        match redis.acquire(req).await.unwrap() {
            Acquire::Granted(grant) => tokens.push(grant.token),
            busy => panic!("{}: {busy:?}", req.name),
        }
    }
    let mut waiter = request("waited", Mode::Exclusive);
    waiter.waiting = true;
    assert!(matches!(
        redis.acquire(&waiter).await.unwrap(),
        Acquire::Busy(_)
    ));
    assert!(matches!(
        redis.release(&stolen).await.unwrap(),
        Release::Released
    ));
    let eviction = Eviction::new(
        evicted.owner.clone(),
        tokens[3],
        "ops@host".into(),
        "stuck".into(),
    );
    assert!(
        redis
            .evict(&evicted.name, Mode::Exclusive, &eviction)
            .await
            .unwrap()
    );

    let long = Duration::from_secs(30);
    let renewals: Vec<Request> = [
        &plain, &waited, &stolen, &evicted, &shared, &delayed, &prefix,
    ]
    .into_iter()
    .map(|req| {
        let mut renewal = req.clone();
        renewal.ttl = long;
        renewal
    })
    .collect();
    let before = script_calls(&server).await;
    let answers = redis.renew_many(&renewals.iter().collect::<Vec<_>>()).await;
    // One batch (plain, waited, stolen, evicted, prefix), then waited again by its own script,
    // and the shared and delayed grants by theirs.
    assert_eq!(script_calls(&server).await - before, 4);
    let answers: Vec<Renewal> = answers.into_iter().map(Result::unwrap).collect();
    assert!(matches!(answers[0], Renewal::Renewed(_)), "{answers:?}");
    assert!(matches!(answers[1], Renewal::Renewed(_)), "{answers:?}");
    assert_eq!(answers[2], Renewal::Lost(LossReason::NotOwner));
    assert_eq!(answers[3], Renewal::Lost(LossReason::Evicted));
    assert!(matches!(answers[4], Renewal::Renewed(_)), "{answers:?}");
    assert!(matches!(answers[5], Renewal::Renewed(_)), "{answers:?}");
    assert_eq!(answers[6], Renewal::Lost(LossReason::NotOwner));
    match server
        .command(&["PTTL", "leasehold:{prefix}:lock"])
        .await
        .unwrap()
    {
        Resp::Integer(ms) => assert!(ms <= 2_000, "extended by a prefix of its owner: {ms} ms"),
        other => panic!("{other:?}"),
    }
    match server
        .command(&["PTTL", "leasehold:{plain}:lock"])
        .await
        .unwrap()
    {
        Resp::Integer(ms) => assert!(ms > 20_000, "not extended: {ms} ms"),
        other => panic!("{other:?}"),
    }
    // The renewed grants are still their owners': each renews again on its own.
    for req in [&renewals[0], &renewals[1], &renewals[4], &renewals[5]] {
        assert!(
            matches!(redis.renew(req).await.unwrap(), Renewal::Renewed(_)),
            "{}",
            req.name
        );
    }
}
