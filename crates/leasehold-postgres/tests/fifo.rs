//! 100 contending waiters on one lock.
//! They are served in arrival order, and each release wakes the next waiter only.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_core::{Client, LockOptions};
use leasehold_postgres::PostgresBackend;
use leasehold_testkit::Postgres;
use leasehold_testkit::faulty::{Faulty, Op};

const WAITERS: usize = 100;
const CLIENTS: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_waiters_are_served_in_order_and_each_release_wakes_one() {
    let server = Postgres::start().await.unwrap();
    // Leases long enough that no waiter refreshes its place while the test runs: every
    // acquire call is a first try or a wake-up.
    let options = LockOptions::builder()
        .ttl(Duration::from_secs(120))
        .build()
        .unwrap();
    let mut faults = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let f = Faulty::wrap(Arc::new(
            PostgresBackend::connect(&server.url()).await.unwrap(),
        ));
        clients.push(
            Client::builder_from_arc(Arc::new(f.clone()))
                .options(options.clone())
                .build(),
        );
        faults.push(f);
    }
    let probe = Client::new(PostgresBackend::connect(&server.url()).await.unwrap());
    let holder = probe.mutex("queue").unwrap().lock().await.unwrap();

    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let mutex = clients[i % CLIENTS].mutex("queue").unwrap();
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let guard = mutex.lock().await.unwrap();
            order.lock().unwrap().push(i);
            guard.release().await.unwrap();
        }));
        // Queued on the server before the next one comes.
        while probe.inspect("queue").await.unwrap().waiters.len() < i + 1 {
            tokio::task::yield_now().await;
        }
    }
    let tries: u64 = faults.iter().map(|f| f.calls(Op::Acquire)).sum();
    assert_eq!(tries, WAITERS as u64);
    holder.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    // One more try per waiter: the one its wake-up caused. A release that woke everyone
    // would cost thousands.
    let tries: u64 = faults.iter().map(|f| f.calls(Op::Acquire)).sum();
    assert!(
        tries <= 2 * WAITERS as u64 + 5,
        "{tries} acquire calls for {WAITERS} waiters"
    );
    assert!(probe.inspect("queue").await.unwrap().waiters.is_empty());
}
