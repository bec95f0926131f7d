//! What PostgreSQL answers when things go wrong comes back as typed leasehold errors.
//! Never a panic, and nothing is lost: 55P03 (lock timeout), 57014 (statement timeout),
//! 25006 (read-only), 57P01 (session terminated mid-statement), 40P01 (deadlock), 40001
//! (serialization failure).

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::backend::{Acquire, Backend, Mode, Release, Request};
use leasehold_core::{Client, Error, LockName, LockOptions, LossReason, OwnerId};
use leasehold_postgres::PostgresBackend;
use leasehold_postgres::tokio_postgres;
use leasehold_testkit::Postgres;

mod common;
use common::{database, until};

async fn backend(server: &Postgres, application: &str) -> PostgresBackend {
    PostgresBackend::connect(&format!("{}?application_name={application}", server.url()))
        .await
        .unwrap()
}

fn request(name: &str) -> Request {
    Request::new(
        LockName::new(name).unwrap(),
        OwnerId::generate(),
        Mode::Exclusive,
        Duration::from_secs(30),
    )
}

/// The error of `result`, which must be a retryable backend error naming `sqlstate`.
fn retryable(result: leasehold_core::Result<Acquire>, sqlstate: &str) {
    match result {
        Err(Error::Backend {
            retryable: true,
            message,
            ..
        }) => assert!(message.contains(sqlstate), "{message}"),
        other => panic!("expected a retryable {sqlstate}, got {other:?}"),
    }
}

async fn waiting_on_a_lock(db: &tokio_postgres::Client, application: &str) {
    until(
        db,
        &format!(
            "SELECT count(*) = 1 FROM pg_stat_activity \
             WHERE application_name = '{application}' AND wait_event_type = 'Lock'"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_and_statement_timeouts_are_retryable_errors() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let mut blocker = database(&server.url()).await;
    let first = backend(&server, "first").await;
    assert!(matches!(
        first.acquire(&request("job")).await,
        Ok(Acquire::Granted(_))
    ));
    // Another transaction holds the name's row.
    let tx = blocker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM leasehold.names WHERE name = 'job' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();

    db.batch_execute("ALTER DATABASE postgres SET lock_timeout = '100ms'")
        .await
        .unwrap();
    let impatient = backend(&server, "impatient").await;
    retryable(impatient.acquire(&request("job")).await, "55P03");

    db.batch_execute(
        "ALTER DATABASE postgres RESET lock_timeout; \
         ALTER DATABASE postgres SET statement_timeout = '100ms'",
    )
    .await
    .unwrap();
    let hasty = backend(&server, "hasty").await;
    retryable(hasty.acquire(&request("job")).await, "57014");

    // Nothing broke: once the row is free, the same connections work.
    tx.rollback().await.unwrap();
    assert!(matches!(
        hasty.acquire(&request("other")).await,
        Ok(Acquire::Granted(_))
    ));
    assert!(matches!(
        impatient.acquire(&request("more")).await,
        Ok(Acquire::Granted(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_server_is_a_retryable_error_and_its_holders_lose_at_their_deadline() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let holder = Client::builder(backend(&server, "holder").await)
        .options(
            LockOptions::builder()
                .ttl(Duration::from_secs(1))
                .build()
                .unwrap(),
        )
        .build();
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    // As after a failover to a standby: every new session is read-only.
    db.batch_execute("ALTER DATABASE postgres SET default_transaction_read_only = on")
        .await
        .unwrap();
    db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = 'holder'",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(guard.lost().await, LossReason::Expired);
    let late = backend(&server, "late").await;
    retryable(late.acquire(&request("other")).await, "25006");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_terminated_mid_statement_is_an_unknown_outcome_resolved_by_owner() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let mut blocker = database(&server.url()).await;
    let first = backend(&server, "first").await;
    let req = request("job");
    assert!(matches!(first.acquire(&req).await, Ok(Acquire::Granted(_))));
    assert_eq!(first.release(&req).await.unwrap(), Release::Released);
    db.batch_execute("INSERT INTO leasehold.names (name) VALUES ('job')")
        .await
        .unwrap();
    let tx = blocker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM leasehold.names WHERE name = 'job' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let victim = backend(&server, "victim").await;
    let terminate = "SELECT count(pg_terminate_backend(pid)) = 1 FROM pg_stat_activity \
                     WHERE application_name = 'victim' AND wait_event_type = 'Lock'";

    // The backend's own answer: unknown outcome.
    let acquiring = {
        let victim = victim.clone();
        tokio::spawn(async move { victim.acquire(&request("job")).await })
    };
    waiting_on_a_lock(&db, "victim").await;
    until(&db, terminate).await;
    match acquiring.await.unwrap() {
        Err(error) => assert!(error.is_unknown_outcome(), "{error:?}"),
        other => panic!("expected an unknown outcome, got {other:?}"),
    }

    // Through the engine: resolved by owner, nothing lost, one holder.
    let client = Client::new(victim);
    let mutex = client.mutex("job").unwrap();
    let locking = tokio::spawn(async move { mutex.lock().await });
    waiting_on_a_lock(&db, "victim").await;
    until(&db, terminate).await;
    tx.commit().await.unwrap();
    let guard = locking.await.unwrap().unwrap();
    let state = client.inspect("job").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(&state.holders[0].owner, guard.owner());
    assert_eq!(state.holders[0].token, guard.token());
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_is_a_retryable_error() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let mut other = database(&server.url()).await;
    other
        .batch_execute("SET deadlock_timeout = '10s'")
        .await
        .unwrap();
    let holder = backend(&server, "holder").await;
    let job = request("job");
    assert!(matches!(
        holder.acquire(&job).await,
        Ok(Acquire::Granted(_))
    ));
    // Another transaction holds the grant's row in share mode (stronger than the key-share
    // lock of a fenced write, which a release does not wait for).
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM leasehold.grants WHERE name = 'job' FOR SHARE",
        &[],
    )
    .await
    .unwrap();
    db.batch_execute("ALTER DATABASE postgres SET deadlock_timeout = '100ms'")
        .await
        .unwrap();
    let next = backend(&server, "next").await;
    // The release takes the name's row and waits for the grant's row...
    let releasing = {
        let (next, job) = (next.clone(), job.clone());
        tokio::spawn(async move { next.release(&job).await })
    };
    waiting_on_a_lock(&db, "next").await;
    // ...while the other transaction asks for the name's row: a cycle, found by the
    // release's session (the quicker to look).
    let cycle = tx.execute(
        "SELECT 1 FROM leasehold.names WHERE name = 'job' FOR UPDATE",
        &[],
    );
    let (released, cycle) = tokio::join!(releasing, cycle);
    match released.unwrap() {
        Err(Error::Backend {
            retryable: true,
            message,
            ..
        }) => assert!(message.contains("40P01"), "{message}"),
        other => panic!("expected a retryable 40P01, got {other:?}"),
    }
    cycle.unwrap();
    tx.rollback().await.unwrap();
    // Retried, it goes through.
    assert_eq!(next.release(&job).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_is_a_retryable_error() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let mut writer = database(&server.url()).await;
    // Make the schema, then run every new session at repeatable read.
    drop(backend(&server, "first").await);
    db.batch_execute(
        "INSERT INTO leasehold.names (name) VALUES ('job'); \
         ALTER DATABASE postgres SET default_transaction_isolation = 'repeatable read'",
    )
    .await
    .unwrap();
    let strict = backend(&server, "strict").await;
    let tx = writer
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
        .start()
        .await
        .unwrap();
    tx.execute(
        "UPDATE leasehold.names SET lock_closed_until = NULL WHERE name = 'job'",
        &[],
    )
    .await
    .unwrap();
    let acquiring = {
        let strict = strict.clone();
        tokio::spawn(async move { strict.acquire(&request("job")).await })
    };
    waiting_on_a_lock(&db, "strict").await;
    tx.commit().await.unwrap();
    retryable(acquiring.await.unwrap(), "40001");
    assert!(matches!(
        strict.acquire(&request("job")).await,
        Ok(Acquire::Granted(_))
    ));
}

/// Advisory mode: a statement timeout after `pg_try_advisory_lock` rolls back only the grant.
/// The holders' table is locked by another transaction, so recording the holder waits; the
/// timeout rolls the grant back but not the session's advisory lock. The retry under the
/// same owner must not take it a second time: once the grant is released the lock is free,
/// and the session holds no advisory lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_advisory_grant_leaves_no_second_hold() {
    let server = Postgres::start().await.unwrap();
    let db = database(&server.url()).await;
    let mut blocker = database(&server.url()).await;
    let advisory = async |application: &str| {
        PostgresBackend::connect(&format!(
            "{}?mode=advisory&application_name={application}",
            server.url()
        ))
        .await
        .unwrap()
    };
    let other = advisory("other").await;
    db.batch_execute("ALTER DATABASE postgres SET statement_timeout = '300ms'")
        .await
        .unwrap();
    let hasty = advisory("hasty").await;
    // A connection of its own, with its statements prepared, waits in the idle set.
    let warm = request("warm");
    assert!(matches!(
        hasty.acquire(&warm).await,
        Ok(Acquire::Granted(_))
    ));
    assert_eq!(hasty.release(&warm).await.unwrap(), Release::Released);

    let tx = blocker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE leasehold.advisory IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let job = request("job");
    retryable(hasty.acquire(&job).await, "57014");
    tx.rollback().await.unwrap();
    // The engine's retry, under the same owner.
    assert!(matches!(hasty.acquire(&job).await, Ok(Acquire::Granted(_))));
    assert_eq!(hasty.release(&job).await.unwrap(), Release::Released);

    let next = other.acquire(&request("job")).await;
    assert!(
        matches!(next, Ok(Acquire::Granted(_))),
        "the released lock is still held: {next:?}"
    );
    let held: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s ON s.pid = l.pid \
             WHERE l.locktype = 'advisory' AND s.application_name = 'hasty'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        held, 0,
        "a session of the released lock still holds an advisory lock"
    );
}
