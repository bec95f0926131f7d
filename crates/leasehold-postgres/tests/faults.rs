//! PostgreSQL's own faults.
//! A holder's connection terminated, the server killed and restarted during holds, an
//! acquire whose reply is lost.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::{Client, LockOptions, LossReason};
use leasehold_postgres::PostgresBackend;
use leasehold_postgres::tokio_postgres::{self, NoTls};
use leasehold_testkit::{Direction, FaultProxy, Postgres};

mod common;
use common::database;

fn url(port: u16, params: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres?{params}")
}

async fn client(port: u16, params: &str, options: LockOptions) -> Client {
    let backend = PostgresBackend::connect(&url(port, params)).await.unwrap();
    Client::builder(backend).options(options).build()
}

fn lease(ttl: Duration) -> LockOptions {
    LockOptions::builder().ttl(ttl).build().unwrap()
}

/// Advisory mode: a holder's session terminated by an administrator ends its guard at once.
/// Not at the session's deadline, and the lock is free for the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_advisory_session_is_a_loss_at_once() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let params = "mode=advisory&session_ttl=60s";
    let a = client(server.port(), params, LockOptions::default()).await;
    let b = client(server.port(), params, LockOptions::default()).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    db.execute(
        "SELECT pg_terminate_backend(pid) FROM leasehold.advisory WHERE name = 'job'",
        &[],
    )
    .await
    .unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("the loss was signalled before the session's deadline");
    assert_eq!(reason, LossReason::SessionEnded);
    let next = b.mutex("job").unwrap().try_lock().await.unwrap();
    assert!(next.unwrap().token() > guard.token());
}

/// Lease mode: every connection of the holder terminated.
/// Its renewals reconnect and the lease is kept, nobody else gets in meanwhile, and the
/// wake-up connection comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_survives_its_connections_being_terminated() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let a = client(
        server.port(),
        "application_name=holder",
        lease(Duration::from_secs(3)),
    )
    .await;
    let b = client(server.port(), "", LockOptions::default()).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    let terminated: i64 = db
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = 'holder'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(terminated >= 2, "{terminated} connections terminated");
    let at: std::time::SystemTime = db
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    // A renewal sent after the termination reached the server: the lease runs on past
    // the one it had then.
    let renewed = async {
        loop {
            let row = db
                .query_one(
                    "SELECT expires FROM leasehold.grants WHERE name = 'job'",
                    &[],
                )
                .await
                .unwrap();
            let expires: std::time::SystemTime = row.get(0);
            if expires > at + Duration::from_secs(3) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        () = renewed => {}
        reason = guard.lost() => panic!("lost: {reason:?}"),
    }
    assert!(guard.is_held());
    assert!(b.mutex("job").unwrap().try_lock().await.unwrap().is_none());
    // A waiter is woken by the release (through the reconnected wake-up connection, or
    // its timer).
    let mutex = b.mutex("job").unwrap();
    let waiter = tokio::spawn(async move { mutex.lock().await });
    let token = guard.token();
    guard.release().await.unwrap();
    let next = waiter.await.unwrap().unwrap();
    assert!(next.token() > token);
}

/// Lease mode: the server killed (as `pg_ctl stop -m immediate`) and started again under locks.
/// The leases go on (renewals reconnect), nobody else is granted a held lock, and tokens
/// handed out afterwards are larger than every earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_tokens_survive_a_server_restart() {
    let mut server = Postgres::start().await.unwrap();
    let port = server.port();
    let a = client(port, "", lease(Duration::from_secs(10))).await;
    let b = client(port, "", LockOptions::default()).await;
    let held = a.mutex("held").unwrap().lock().await.unwrap();
    let mut highest = held.token();
    for i in 0..5 {
        let guard = b
            .mutex(&format!("other-{i}"))
            .unwrap()
            .lock()
            .await
            .unwrap();
        highest = highest.max(guard.token());
        guard.release().await.unwrap();
    }
    server.restart().await.unwrap();
    let db = database(&server.url()).await;
    let at: std::time::SystemTime = db
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    let renewed = async {
        loop {
            let row = db
                .query_opt(
                    "SELECT expires FROM leasehold.grants WHERE name = 'held'",
                    &[],
                )
                .await
                .unwrap()
                .expect("the grant survived the restart");
            let expires: std::time::SystemTime = row.get(0);
            if expires > at + Duration::from_secs(10) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        () = renewed => {}
        reason = held.lost() => panic!("lost across the restart: {reason:?}"),
    }
    assert!(held.is_held());
    assert!(
        b.mutex("held").unwrap().try_lock().await.unwrap().is_none(),
        "a held lock was granted again after the restart"
    );
    let fresh = b.mutex("fresh").unwrap().lock().await.unwrap();
    assert!(fresh.token() > highest, "{} after {highest}", fresh.token());
    fresh.release().await.unwrap();
    let token = held.token();
    held.release().await.unwrap();
    let next = b.mutex("held").unwrap().lock().await.unwrap();
    assert!(next.token() > token);
}

/// Advisory mode: a restart ends every session, so every guard is lost at once.
/// The lock is then free and the next token larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_ends_advisory_locks_and_tokens_still_grow() {
    let mut server = Postgres::start().await.unwrap();
    let port = server.port();
    let params = "mode=advisory&session_ttl=60s";
    let a = client(port, params, LockOptions::default()).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    server.restart().await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("the loss was signalled before the session's deadline");
    assert_eq!(reason, LossReason::SessionEnded);
    let b = client(port, params, LockOptions::default()).await;
    let next = b.mutex("job").unwrap().try_lock().await.unwrap().unwrap();
    assert!(next.token() > guard.token());
    next.release().await.unwrap();
}

fn impatient() -> LockOptions {
    LockOptions::builder()
        .request_timeout(Duration::from_millis(300))
        .build()
        .unwrap()
}

/// The reply to a grant is held back past the request timeout.
/// The acquisition does not know whether it got the lock. Its retries, sent under the same
/// owner, adopt the grant the server made: one holder, one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_reply_was_lost_is_adopted() {
    let server = Postgres::start().await.unwrap();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = FaultProxy::start(target).await.unwrap();
    let a = client(proxy.port(), "", impatient()).await;
    let probe = client(server.port(), "", LockOptions::default()).await;
    proxy.cut(Direction::ToClient);
    let mutex = a.mutex("job").unwrap();
    let acquiring = tokio::spawn(async move { mutex.lock().await });
    let granted = loop {
        let state = probe.inspect("job").await.unwrap();
        if let Some(holder) = state.holders.first() {
            break holder.clone();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    proxy.heal();
    let guard = acquiring.await.unwrap().unwrap();
    assert_eq!(guard.owner(), &granted.owner);
    assert_eq!(guard.token(), granted.token);
    let state = probe.inspect("job").await.unwrap();
    assert_eq!(state.holders.len(), 1, "{:?}", state.holders);
    guard.release().await.unwrap();
    assert!(
        probe
            .mutex("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
}

/// An acquisition whose replies, then requests, are held back gives up; its grant is released.
/// Its grant was made; the grant it may hold is released by owner once the link heals, long
/// before its 30 s lease would have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_that_gave_up_leaves_nothing_behind() {
    let server = Postgres::start().await.unwrap();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = FaultProxy::start(target).await.unwrap();
    let a = client(proxy.port(), "", impatient()).await;
    let probe = client(server.port(), "", LockOptions::default()).await;
    proxy.cut(Direction::ToClient);
    let mutex = a.mutex("job").unwrap();
    let acquiring = tokio::spawn(async move { mutex.lock_timeout(Duration::from_secs(1)).await });
    while probe.inspect("job").await.unwrap().holders.is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Now nothing gets through: not even the release of the giving-up acquisition.
    proxy.cut(Direction::Both);
    let gave_up = acquiring.await.unwrap();
    assert!(
        matches!(gave_up, Err(ref e) if e.is_unknown_outcome()) || matches!(gave_up, Ok(None)),
        "{gave_up:?}"
    );
    assert_eq!(probe.inspect("job").await.unwrap().holders.len(), 1);
    proxy.heal();
    a.settle().await;
    assert!(
        probe
            .mutex("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_some(),
        "the unknown grant was left behind"
    );
}

/// An acquire held on a connection given up as silent never runs after its release.
/// The acquisition gives up on the connection (its requests, then its release, held
/// back), and its release goes on the connection that replaced it. When the old link heals,
/// the acquires it held arrive at a session that was ended first: they cannot grant the
/// lock again after the release, to an owner that has gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_held_on_a_replaced_connection_grants_nothing_late() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = FaultProxy::start(target).await.unwrap();
    // One pooled connection: every request of `a` goes on it until it is replaced.
    let a = client(
        proxy.port(),
        "pool_size=1&application_name=replaced",
        impatient(),
    )
    .await;
    let probe = client(server.port(), "", LockOptions::default()).await;
    // The server sessions of `a`'s connections (but its wake-up listener's), which the held
    // requests will reach.
    let sessions: Vec<i32> = db
        .query(
            "SELECT pid FROM pg_stat_activity \
             WHERE application_name = 'replaced' AND query NOT LIKE 'LISTEN%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert!(!sessions.is_empty());
    // The connections open now go silent both ways; new ones pass.
    proxy.cut_open(Direction::Both);
    let gave_up = a.mutex("job").unwrap().lock().await;
    assert!(
        matches!(gave_up, Err(ref e) if e.is_unknown_outcome()),
        "{gave_up:?}"
    );
    // The acquires were held, and the release went through on a new connection.
    a.settle().await;
    assert!(probe.inspect("job").await.unwrap().holders.is_empty());
    proxy.heal();
    // The held acquires are delivered, to sessions that are gone or that run them before
    // they read the end of their connection and end.
    while db
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
            &[&sessions],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        > 0
    {
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

/// Advisory mode: a waiter whose client vanished leaves the queue.
/// Its connections closed while it waited in the server's queue; it leaves instead of being
/// granted the lock first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_advisory_waiter_leaves_the_queue() {
    use leasehold_core::backend::{Acquire, Backend, Mode, Request};
    let server = Postgres::start().await.unwrap();
    let params = "mode=advisory&session_ttl=3s";
    let a = client(server.port(), params, LockOptions::default()).await;
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    let vanishing = PostgresBackend::connect(&url(server.port(), params))
        .await
        .unwrap();
    let mut req = Request::new(
        leasehold_core::LockName::new("job").unwrap(),
        leasehold_core::OwnerId::generate(),
        Mode::Exclusive,
        Duration::from_secs(3),
    );
    req.waiting = true;
    req.fair = true;
    assert!(matches!(
        vanishing.acquire(&req).await.unwrap(),
        Acquire::Busy(_)
    ));
    assert_eq!(a.inspect("job").await.unwrap().waiters.len(), 1);
    // The process dies: its connections close, nothing is released.
    drop(vanishing);
    let left = tokio::time::timeout(Duration::from_secs(20), async {
        while !a.inspect("job").await.unwrap().waiters.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(left.is_ok(), "the vanished waiter stayed in the queue");
    guard.release().await.unwrap();
    let b = client(server.port(), params, LockOptions::default()).await;
    assert!(b.mutex("job").unwrap().try_lock().await.unwrap().is_some());
}

/// What vanished holders and waiters left is swept once it has expired.
/// Those are rows nobody will release or touch again; a lock-delay keeps its name until the
/// delay is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_vanished_holders_left_is_swept() {
    use leasehold_core::backend::{Acquire, Backend, Mode, Request};
    let server = Postgres::start().await.unwrap();
    let (db, connection) = tokio_postgres::connect(&server.url(), NoTls).await.unwrap();
    tokio::spawn(connection);
    let vanishing = PostgresBackend::connect(&server.url()).await.unwrap();
    let request = |name: &str, waiting: bool, delay: Option<Duration>| {
        let mut req = Request::new(
            leasehold_core::LockName::new(name).unwrap(),
            leasehold_core::OwnerId::generate(),
            Mode::Exclusive,
            Duration::from_millis(200),
        );
        req.fair = true;
        req.waiting = waiting;
        req.lock_delay = delay;
        req
    };
    // A holder and a waiter that will never come back, and a holder with a lock-delay.
    let held = vanishing
        .acquire(&request("job", false, None))
        .await
        .unwrap();
    assert!(matches!(held, Acquire::Granted(_)));
    let queued = vanishing
        .acquire(&request("job", true, None))
        .await
        .unwrap();
    assert!(matches!(queued, Acquire::Busy(_)));
    let delayed = vanishing
        .acquire(&request("delayed", false, Some(Duration::from_millis(500))))
        .await
        .unwrap();
    assert!(matches!(delayed, Acquire::Granted(_)));
    drop(vanishing);
    let sweeper = PostgresBackend::connect(&server.url()).await.unwrap();
    let count = async |sql: &str| -> i64 { db.query_one(sql, &[]).await.unwrap().get(0) };
    while count(
        "SELECT count(*) FROM (SELECT expires FROM leasehold.grants UNION ALL \
         SELECT expires FROM leasehold.waiters) e WHERE expires > clock_timestamp()",
    )
    .await
        > 0
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        sweeper.sweep().await.unwrap(),
        1,
        "only the name without a delay"
    );
    assert_eq!(count("SELECT count(*) FROM leasehold.grants").await, 0);
    assert_eq!(count("SELECT count(*) FROM leasehold.waiters").await, 0);
    assert_eq!(count("SELECT count(*) FROM leasehold.names").await, 1);
    // Closed for its delay; swept after it.
    while count("SELECT count(*) FROM leasehold.names WHERE lock_closed_until > clock_timestamp()")
        .await
        > 0
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sweeper.sweep().await.unwrap(), 1);
    assert_eq!(count("SELECT count(*) FROM leasehold.names").await, 0);
}

/// A pooled connection that goes dead without closing is replaced after two timeouts in a row.
/// Its bytes are held both ways, its socket open: the acquisition that met it fails with an
/// unknown outcome, the next one is served on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_connection_is_replaced_after_two_timeouts() {
    let server = Postgres::start().await.unwrap();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = FaultProxy::start(target).await.unwrap();
    let timeout = Duration::from_secs(1);
    let options = LockOptions::builder()
        .request_timeout(timeout)
        .build()
        .unwrap();
    // One pooled connection: every request goes on it.
    let a = client(proxy.port(), "pool_size=1", options).await;
    let first = a.mutex("before").unwrap().lock().await.unwrap();
    first.release().await.unwrap();
    proxy.cut_open(Direction::Both);
    // Sent, retried once on the same connection, both timed out: the outcome is unknown.
    let met = a.mutex("during").unwrap().try_lock().await;
    assert!(
        matches!(met, Err(ref e) if e.is_unknown_outcome()),
        "{met:?}"
    );
    let next = a.mutex("after").unwrap().try_lock().await;
    let guard = next
        .expect("the dead connection was not replaced")
        .expect("the lock is free");
    guard.release().await.unwrap();
}
