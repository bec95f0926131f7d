//! Through PgBouncer.
//! Lease mode works in transaction pooling (waiters poll; records and kept grants too),
//! advisory mode is refused there (found out, or declared in the URL) and works through a
//! session pool.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use leasehold_core::{Client, Error, Fence, LockName, RecordKey};
use leasehold_postgres::PostgresBackend;
use leasehold_testkit::faulty::{Faulty, Op};
use leasehold_testkit::servers::PoolMode;
use leasehold_testkit::{PgBouncer, Postgres};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_works_through_a_transaction_pool() {
    let server = Postgres::start().await.unwrap();
    let bouncer = PgBouncer::start(&server, PoolMode::Transaction)
        .await
        .unwrap();
    let backend = PostgresBackend::connect(&bouncer.url()).await.unwrap();
    assert!(
        backend.transaction_pooled(),
        "the transaction pool was not noticed"
    );
    assert!(!leasehold_core::Backend::capabilities(&backend).push_wakeups);

    // Mutual exclusion and a fenced counter, with waiters polling.
    let fence = Arc::new(Fence::new());
    let counter = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let client = Client::new(PostgresBackend::connect(&bouncer.url()).await.unwrap());
        let (fence, counter) = (fence.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            let mutex = client.mutex("counter").unwrap();
            for _ in 0..10 {
                let guard = mutex.lock().await.unwrap();
                let seen = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                fence
                    .apply(guard.token(), || counter.store(seen + 1, Ordering::SeqCst))
                    .unwrap();
                guard.release().await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(counter.load(Ordering::SeqCst), 40);
    assert_eq!(fence.rejected(), 0);

    // The queue still decides the order: three waiters, served as they came.
    let holder = Client::new(backend.clone());
    let guard = holder.mutex("queue").unwrap().lock().await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..3 {
        let faults = Faulty::wrap(Arc::new(
            PostgresBackend::connect(&bouncer.url()).await.unwrap(),
        ));
        let client = Client::new(faults.clone());
        let order = order.clone();
        waiters.push(tokio::spawn(async move {
            let guard = client.mutex("queue").unwrap().lock().await.unwrap();
            order.lock().unwrap().push(i);
            guard.release().await.unwrap();
        }));
        faults.until_calls(Op::Wait, 1).await;
    }
    guard.release().await.unwrap();
    for waiter in waiters {
        waiter.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);

    // A record beside a lock, and a grant kept after its holder lets go.
    let other = Client::new(PostgresBackend::connect(&bouncer.url()).await.unwrap());
    let key = RecordKey::new("window:1").unwrap();
    let guard = holder.mutex("job").unwrap().lock().await.unwrap();
    let keep = Duration::from_secs(600);
    assert!(guard.put_record(&key, b"done", keep).await.unwrap());
    let token = guard.token();
    guard.keep_for(Duration::from_secs(1)).await.unwrap();
    let name = LockName::new("job").unwrap();
    let read = other.backend().get_record(&name, &key).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"done"[..]));
    let mutex = other.mutex("job").unwrap();
    assert!(mutex.try_lock().await.unwrap().is_none(), "the kept grant");
    let next = mutex.lock().await.unwrap();
    assert!(next.token() > token);
    next.release().await.unwrap();
}

fn unsupported(result: Result<PostgresBackend, Error>) -> &'static str {
    match result {
        Err(Error::Unsupported { feature, .. }) => feature,
        other => panic!("advisory mode was not refused: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_mode_is_refused_through_a_transaction_pool() {
    let server = Postgres::start().await.unwrap();
    let bouncer = PgBouncer::start(&server, PoolMode::Transaction)
        .await
        .unwrap();
    // Found out.
    let found =
        unsupported(PostgresBackend::connect(&format!("{}?mode=advisory", bouncer.url())).await);
    assert!(found.contains("transaction-pooling"), "{found}");
    // Declared: refused without looking.
    let declared = unsupported(
        PostgresBackend::connect(&format!(
            "{}?mode=advisory&pooling=transaction",
            server.url()
        ))
        .await,
    );
    assert!(declared.contains("PgBouncer"), "{declared}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_mode_works_through_a_session_pool() {
    let server = Postgres::start().await.unwrap();
    let bouncer = PgBouncer::start(&server, PoolMode::Session).await.unwrap();
    let url = format!("{}?mode=advisory", bouncer.url());
    let a = Client::new(PostgresBackend::connect(&url).await.unwrap());
    let b = Client::new(PostgresBackend::connect(&url).await.unwrap());
    assert!(!a.backend().capabilities().permits);
    let guard = a.mutex("job").unwrap().lock().await.unwrap();
    assert!(b.mutex("job").unwrap().try_lock().await.unwrap().is_none());
    let waiter = tokio::spawn(async move { b.mutex("job").unwrap().lock().await });
    let state = loop {
        let state = a.inspect("job").await.unwrap();
        if !state.waiters.is_empty() {
            break state;
        }
        tokio::task::yield_now().await;
    };
    assert_eq!(state.holders.len(), 1);
    let token = guard.token();
    guard.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(next.token() > token);
    next.release().await.unwrap();
}
