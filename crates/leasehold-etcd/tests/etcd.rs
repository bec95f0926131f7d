//! What only the etcd backend promises, against real etcd members.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client as Etcd3, Txn, TxnOp};
use leasehold_core::backend::Backend;
use leasehold_core::{Client, Error, Guard, LockName, LockOptions, LossReason};
use leasehold_etcd::{EtcdBackend, EtcdOptions};
use leasehold_testkit::{Direction, Etcd, FaultProxy};

fn options() -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_secs(3))
        .request_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

async fn backend(endpoints: &[String], session_ttl: Duration) -> EtcdBackend {
    let endpoints: Vec<String> = endpoints.iter().map(|e| format!("http://{e}")).collect();
    let options = EtcdOptions::default().session_ttl(session_ttl).unwrap();
    EtcdBackend::connect_with(&endpoints, options)
        .await
        .unwrap()
}

async fn client(endpoints: &[String], session_ttl: Duration) -> Client {
    Client::builder(backend(endpoints, session_ttl).await)
        .options(options())
        .build()
}

/// A plain etcd-client connection to `etcd`, for looking at and writing keys directly.
async fn raw(etcd: &Etcd) -> Etcd3 {
    let endpoints: Vec<String> = etcd
        .endpoints()
        .iter()
        .map(|e| format!("http://{e}"))
        .collect();
    Etcd3::connect(endpoints, None).await.unwrap()
}

/// The lock "job" for `client` within `within`; fails the test with `why` if not granted.
async fn job_within(client: &Client, within: Duration, why: &str) -> Guard {
    client
        .mutex("job")
        .unwrap()
        .lock_timeout(within)
        .await
        .unwrap()
        .expect(why)
}

/// Waits, without polling, until `check` holds for the state of `name` as `observer` sees it.
async fn until(observer: &Client, name: &str, check: impl Fn(&leasehold_core::LockState) -> bool) {
    let lock = LockName::new(name).unwrap();
    loop {
        let state = observer.inspect(name).await.unwrap();
        if check(&state) {
            return;
        }
        observer
            .backend()
            .wait(&lock, &state.hint, Duration::from_secs(5))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_cut_session_loses_its_guards_before_etcd_frees_the_lock() {
    let mut etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.members()[0].addr()).await.unwrap();
    let cut_off = client(
        &[format!("127.0.0.1:{}", proxy.port())],
        Duration::from_secs(2),
    )
    .await;
    let other = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let guard = cut_off.mutex("job").unwrap().lock().await.unwrap();
    // The other client queues first, so it holds the moment etcd frees the lock.
    let waiter = other.mutex("job").unwrap();
    let next = tokio::spawn(async move {
        let next = waiter
            .lock_timeout(Duration::from_secs(15))
            .await
            .unwrap()
            .expect("free once etcd expired the lease");
        (next, std::time::Instant::now())
    });
    until(&other, "job", |state| !state.waiters.is_empty()).await;
    proxy.cut(Direction::Both);
    let reason = tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("no loss signal while the session was cut off");
    let lost_at = std::time::Instant::now();
    assert!(
        matches!(reason, LossReason::Expired | LossReason::SessionEnded),
        "{reason:?}"
    );
    let (next, granted_at) = next.await.unwrap();
    assert!(
        lost_at <= granted_at,
        "the next holder was granted before the loss signal"
    );
    assert!(next.token() > guard.token());
    proxy.heal();
}

#[tokio::test]
async fn a_waiter_whose_session_expires_while_queued_is_never_granted() {
    let mut etcd = Etcd::start().await.unwrap();
    let proxy = FaultProxy::start(etcd.members()[0].addr()).await.unwrap();
    let holder = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let waiter = client(
        &[format!("127.0.0.1:{}", proxy.port())],
        Duration::from_secs(2),
    )
    .await;
    let held = holder.mutex("job").unwrap().lock().await.unwrap();
    let mutex = waiter.mutex("job").unwrap();
    let waiting = tokio::spawn(async move { mutex.lock().await });
    until(&holder, "job", |s| s.waiters.len() == 1).await;
    // The waiter's keep-alives stop reaching etcd: its lease, and its queue entry, expire.
    proxy.cut(Direction::Both);
    until(&holder, "job", |s| s.waiters.is_empty()).await;
    held.release().await.unwrap();
    proxy.heal();
    let answer = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the waiter never answered")
        .unwrap();
    assert!(
        matches!(answer, Err(Error::Lost(LossReason::SessionEnded))),
        "a waiter was granted on a dead session: {answer:?}"
    );
    assert!(
        holder
            .mutex("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test]
async fn a_paused_leader_never_lets_two_guards_be_held_at_once() {
    let mut etcd = Etcd::cluster(3).await.unwrap();
    let endpoints = etcd.endpoints();
    let a = client(&endpoints, Duration::from_secs(3)).await;
    let b = client(&endpoints, Duration::from_secs(3)).await;
    let first = a.mutex("job").unwrap().lock().await.unwrap();
    let leader = etcd.leader().await.unwrap();
    etcd.members()[leader].process().pause();
    // The others elect a new leader; A keeps its session alive through them or loses it.
    let second = b
        .mutex("job")
        .unwrap()
        .lock_timeout(Duration::from_secs(8))
        .await
        .unwrap_or(None);
    if let Some(second) = &second {
        assert!(!first.is_held(), "two guards held at once");
        assert!(second.token() > first.token());
    }
    // Neither outcome of the pause is required (A may keep its lease through the new
    // leader, or lose it while B's requests still sit on the paused member), but once the
    // member is back the lock must be grantable again, and never to two at once.
    etcd.members()[leader].process().resume();
    if second.is_none() {
        let first_token = first.token();
        // Held or lost by now; either way giving it back must not fail the lock for B.
        let _ = first.release().await;
        let next = job_within(
            &b,
            Duration::from_secs(20),
            "the lock stayed closed after the member came back",
        )
        .await;
        assert!(next.token() > first_token);
    }
}

#[tokio::test]
async fn the_member_the_client_talks_to_paused_costs_it_the_lock_at_its_deadline() {
    let mut etcd = Etcd::cluster(3).await.unwrap();
    let endpoints = etcd.endpoints();
    let only_first = client(&endpoints[..1], Duration::from_secs(2)).await;
    let others = client(&endpoints[1..], Duration::from_secs(2)).await;
    let guard = only_first.mutex("job").unwrap().lock().await.unwrap();
    etcd.members()[0].process().pause();
    tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the guard outlived its unreachable session");
    let next = job_within(
        &others,
        Duration::from_secs(15),
        "granted once the lease expired",
    )
    .await;
    assert!(next.token() > guard.token());
    etcd.members()[0].process().resume();
}

#[tokio::test]
async fn a_client_moves_on_to_the_next_member_when_its_member_pauses() {
    let mut etcd = Etcd::cluster(3).await.unwrap();
    let endpoints = etcd.endpoints();
    // A client connects to the first member it is given.
    let client = client(&endpoints, Duration::from_secs(2)).await;
    let guard = job_within(&client, Duration::from_secs(5), "the lock was free").await;
    etcd.members()[0].process().pause();
    // The session's keep-alives sit on the paused member longer than its lease lasts.
    tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the guard outlived its unreachable session");
    // The same client, with a new session on another member, gets the lock once the
    // lease of the old one has run out on the others. Requests already on the paused
    // member fail (unavailable) when its connection is given up; they are tried again.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    let next = loop {
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        assert!(
            !left.is_zero(),
            "the client did not move on from the paused member"
        );
        match client.mutex("job").unwrap().lock_timeout(left).await {
            Ok(Some(next)) => break next,
            Ok(None) => {}
            Err(error) => assert!(error.is_retryable(), "{error}"),
        }
    };
    assert!(next.token() > guard.token());
    etcd.members()[0].process().resume();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_over_a_thousand_grants_with_a_member_restarting() {
    let mut etcd = Etcd::cluster(3).await.unwrap();
    let endpoints = etcd.endpoints();
    let clients = [
        client(&endpoints, Duration::from_secs(5)).await,
        client(&endpoints, Duration::from_secs(5)).await,
    ];
    let tokens = Arc::new(Mutex::new(Vec::new()));
    for round in 0..10 {
        let mut tasks = Vec::new();
        for c in &clients {
            let mutex = c.mutex("counter").unwrap();
            let tokens = tokens.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..50 {
                    let guard = mutex.lock().await.unwrap();
                    tokens.lock().unwrap().push(guard.token());
                    guard.release().await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let member = &mut etcd.members()[round % 3];
        member.process().kill();
        member.restart().await.unwrap();
    }
    let tokens = tokens.lock().unwrap();
    assert_eq!(tokens.len(), 1000);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens went backwards"
    );
}

#[tokio::test]
async fn the_owner_predicate_guards_writes_in_the_callers_own_transactions() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(5)).await;
    let c = Client::builder(locks.clone()).options(options()).build();
    let mut kv = raw(&etcd).await;
    let guard = c.mutex("ledger").unwrap().lock().await.unwrap();
    let write = |value: &'static str| {
        Txn::new()
            .when([locks.still_owner(&guard)])
            .and_then([TxnOp::put("ledger/balance", value, None)])
    };
    assert!(kv.txn(write("100")).await.unwrap().succeeded());
    let stale = write("42");
    guard.release().await.unwrap();
    assert!(
        !kv.txn(stale).await.unwrap().succeeded(),
        "a write after the release"
    );
    let balance = kv.get("ledger/balance", None).await.unwrap();
    assert_eq!(balance.kvs()[0].value(), b"100");
}

#[tokio::test]
async fn session_ttls_are_rounded_up_to_whole_seconds_and_reported() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_millis(1500)).await;
    let c = Client::new(locks.clone());
    let guard = c.mutex("job").unwrap().lock().await.unwrap();
    assert_eq!(locks.session_ttl().await, Some(Duration::from_secs(2)));
    assert!(guard.remaining() <= Duration::from_secs(2));
    assert!(matches!(
        EtcdOptions::default().session_ttl(Duration::from_millis(500)),
        Err(Error::InvalidArgument { .. })
    ));
}

#[tokio::test]
async fn closing_the_session_frees_every_lock_at_once() {
    let etcd = Etcd::start().await.unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(30)).await;
    let c = Client::new(locks.clone());
    let other = client(&etcd.endpoints(), Duration::from_secs(30)).await;
    let a = c.mutex("a").unwrap().lock().await.unwrap();
    let b = c.semaphore("b", 1).unwrap().acquire().await.unwrap();
    locks.close().await.unwrap();
    assert_eq!(a.lost().await, LossReason::SessionEnded);
    assert_eq!(b.lost().await, LossReason::SessionEnded);
    // No waiting for the 30 s lease: revoked.
    assert!(
        other
            .mutex("a")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        other
            .semaphore("b", 1)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_some()
    );
    // A later acquisition starts a new session.
    drop(a);
    assert!(c.mutex("c").unwrap().try_lock().await.unwrap().is_some());
}

#[tokio::test]
async fn a_busy_name_reuses_its_keys_instead_of_piling_up_deleted_ones() {
    let etcd = Etcd::start().await.unwrap();
    let c = client(&etcd.endpoints(), Duration::from_secs(5)).await;
    let mut kv = raw(&etcd).await;
    let mut keys = std::collections::BTreeSet::new();
    let held_keys = async |kv: &mut Etcd3| -> Vec<String> {
        let found = kv
            .get(
                "leasehold/",
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        found
            .kvs()
            .iter()
            .map(|k| k.key_str().unwrap().to_owned())
            .collect()
    };
    let semaphore = c.semaphore("pool", 2).unwrap();
    for _ in 0..10 {
        let a = semaphore.acquire().await.unwrap();
        let b = semaphore.acquire().await.unwrap();
        let now = held_keys(&mut kv).await;
        assert_eq!(now.len(), 2, "{now:?}");
        keys.extend(now);
        a.release().await.unwrap();
        b.release().await.unwrap();
    }
    assert!(held_keys(&mut kv).await.is_empty());
    assert_eq!(keys.len(), 2, "keys used: {keys:?}");
}

#[tokio::test]
async fn lock_delay_keeps_a_vanished_holders_lock_closed_but_not_a_released_one() {
    let etcd = Etcd::start().await.unwrap();
    let delay = Duration::from_secs(2);
    let with_delay = options().to_builder().lock_delay(delay).build().unwrap();
    let locks = backend(&etcd.endpoints(), Duration::from_secs(1)).await;
    let a = Client::builder(locks.clone()).options(with_delay).build();
    // B asks for no lock-delay of its own: it must respect A's all the same.
    let b = client(&etcd.endpoints(), Duration::from_secs(2)).await;
    let try_b = || async { b.mutex("job").unwrap().try_lock().await.unwrap() };

    // A release opens the lock at once, and so does closing the session.
    a.mutex("job")
        .unwrap()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    try_b()
        .await
        .expect("open after a release")
        .release()
        .await
        .unwrap();
    let closed = a.mutex("job").unwrap().lock().await.unwrap();
    locks.close().await.unwrap();
    assert!(!closed.is_held());
    try_b()
        .await
        .expect("open after a close")
        .release()
        .await
        .unwrap();

    // A holder that vanishes (its session is no longer kept alive) keeps it closed.
    let vanished = a.mutex("job").unwrap().lock().await.unwrap();
    locks.orphan().await;
    tokio::time::timeout(Duration::from_secs(10), vanished.lost())
        .await
        .expect("the orphaned session outlived its ttl");
    let lost_at = std::time::Instant::now();
    until(&b, "job", |s| s.holders.is_empty()).await;
    assert!(
        try_b().await.is_none(),
        "granted as soon as the vanished holder's key expired"
    );
    let next = job_within(
        &b,
        Duration::from_secs(20),
        "open once the lock-delay is over",
    )
    .await;
    // etcd expired A's lease no earlier than A's own deadline; the delay runs from there.
    assert!(
        lost_at.elapsed() >= delay,
        "granted {:?} after the vanished holder's deadline; the delay is {delay:?}",
        lost_at.elapsed()
    );
    assert!(next.token() > vanished.token());
    next.release().await.unwrap();
    assert!(try_b().await.is_some(), "closed again after a release");
}
