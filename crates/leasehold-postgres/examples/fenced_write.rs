//! A write that commits only while the lock is held.
//! It uses [`still_owner`] in the caller's own tokio-postgres transaction.
//!
//! ```sh
//! cargo run -p leasehold-postgres --example fenced_write        # starts its own PostgreSQL
//! LEASEHOLD_POSTGRES_URL=postgres://me@127.0.0.1/shop cargo run -p leasehold-postgres --example fenced_write
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // an example: failures should be loud

use leasehold_core::Client;
use leasehold_postgres::tokio_postgres::{self, NoTls};
use leasehold_postgres::{PostgresBackend, still_owner};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server;
    let url = match std::env::var("LEASEHOLD_POSTGRES_URL") {
        Ok(url) => url,
        Err(_) => {
            server = leasehold_testkit::Postgres::start()
                .await
                .expect("start PostgreSQL (or set LEASEHOLD_POSTGRES_URL)");
            server.url()
        }
    };
    // The application's own connection, and its data.
    let (mut db, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS accounts (id integer PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO accounts VALUES (1, 0) ON CONFLICT (id) DO UPDATE SET balance = 0;",
    )
    .await?;

    // The lock, in the same database (lease mode, schema `leasehold`).
    let locks = Client::new(PostgresBackend::connect(&url).await?);
    let guard = locks.mutex("account:1")?.lock().await?;
    let fence = still_owner(&guard);
    let deposit = format!(
        "UPDATE accounts SET balance = balance + 10 WHERE id = 1 AND {}",
        fence.condition(1)
    );

    // Held: the write goes in, and until this transaction ends no one else can be granted
    // the lock (the grant's row is locked for share).
    let tx = db.transaction().await?;
    let changed = tx
        .execute(&deposit, &[&fence.name(), &fence.token(), &fence.owner()])
        .await?;
    tx.commit().await?;
    println!(
        "while held (token {}): {changed} row changed",
        guard.token()
    );

    // Released (or lost: a lease that ran out, a session that ended): the same write, as a
    // holder that does not know it lost the lock would send it, changes nothing.
    guard.release().await?;
    let tx = db.transaction().await?;
    let changed = tx
        .execute(&deposit, &[&fence.name(), &fence.token(), &fence.owner()])
        .await?;
    tx.commit().await?;
    println!("after the release: {changed} rows changed");

    let balance: i64 = db
        .query_one("SELECT balance FROM accounts WHERE id = 1", &[])
        .await?
        .get(0);
    println!("balance: {balance}");
    Ok(())
}
