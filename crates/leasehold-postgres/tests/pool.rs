//! Which pooled connection lease mode's requests take.
//! One acquisition's requests always the same (the server then runs them in order); one
//! lock at a time, always the first; concurrent acquisitions, all of them.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use leasehold_core::Client;
use leasehold_postgres::PostgresBackend;
use leasehold_postgres::tokio_postgres::{self, NoTls};
use leasehold_testkit::Postgres;

/// How many of the pooled connections of `application` ran a statement since `since`.
/// The listening connection is left out.
async fn connections_used(
    db: &tokio_postgres::Client,
    application: &str,
    since: std::time::SystemTime,
) -> i64 {
    db.query_one(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = $1 AND state_change > $2 AND query NOT LIKE 'LISTEN%'",
        &[&application, &since],
    )
    .await
    .unwrap()
    .get(0)
}

async fn server_now(db: &tokio_postgres::Client) -> std::time::SystemTime {
    db.query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lock_at_a_time_stays_on_one_connection_and_concurrent_ones_spread() {
    let server = Postgres::start().await.unwrap();
    let (db, connection) = tokio_postgres::connect(&server.url(), NoTls).await.unwrap();
    tokio::spawn(connection);
    let url = format!("{}?application_name=lanes&pool_size=2", server.url());
    let client = Client::builder(PostgresBackend::connect(&url).await.unwrap()).build();
    let mutex = client.mutex("one-at-a-time").unwrap();
    mutex.lock().await.unwrap().release().await.unwrap();

    // 50 acquisitions one after the other: with a connection picked by owner id, both
    // would run some (all but certainly).
    let since = server_now(&db).await;
    for _ in 0..50 {
        mutex.lock().await.unwrap().release().await.unwrap();
    }
    assert_eq!(connections_used(&db, "lanes", since).await, 1);

    // Two held at once: one on each connection.
    let since = server_now(&db).await;
    let a = client.mutex("a").unwrap().lock().await.unwrap();
    let b = client.mutex("b").unwrap().lock().await.unwrap();
    assert_eq!(connections_used(&db, "lanes", since).await, 2);
    a.release().await.unwrap();
    b.release().await.unwrap();
}
