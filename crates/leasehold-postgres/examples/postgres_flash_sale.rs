//! The flash sale on PostgreSQL.
//! Five items, eight buyers, and the first two buyers to get the lock stall (a GC pause, a
//! slow disk) for longer than the lock's lease. Three ways to sell from a `stock` row:
//!
//! 1. **lock, no fence** — a leasehold lock, then `SELECT left`, then `UPDATE … SET left =
//!    n - 1`. While a stalled buyer sleeps its lease runs out, others sell, and when it
//!    wakes it writes back its stale count: items are sold twice. A lock alone cannot stop
//!    a holder that no longer knows it lost it.
//! 2. **atomic** — no lock at all: `UPDATE … SET left = left - 1 WHERE left > 0`.
//! 3. **lock + fence** — the same lock, with the read and the write in one transaction
//!    whose statements carry [`still_owner`]: they change and return rows only while the
//!    buyer's grant is current, and the next grant waits for the transaction. The stalled
//!    buyer's write is refused; it tries again, and nothing is oversold.
//!
//! ```sh
//! cargo run -p leasehold-postgres --example postgres_flash_sale        # starts its own PostgreSQL
//! LEASEHOLD_POSTGRES_URL=postgres://me@127.0.0.1/shop cargo run -p leasehold-postgres --example postgres_flash_sale
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // an example: failures should be loud

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use leasehold_core::{Client, LockOptions};
use leasehold_postgres::tokio_postgres::{self, NoTls};
use leasehold_postgres::{PostgresBackend, still_owner};
use leasehold_testkit::faulty::{Faulty, Op};

pub const STOCK: u64 = 5;
pub const BUYERS: u64 = 8;
/// The first acquisitions in each strategy stall this long...
const STALL: Duration = Duration::from_millis(700);
const STALLING: u64 = 2;
/// ...while the lock's lease is this long.
const TTL: Duration = Duration::from_millis(300);

/// What one strategy did.
#[derive(Debug, Default, Clone, Copy)]
#[non_exhaustive]
pub struct Outcome {
    pub sold: u64,
    pub stock_left: i64,
    pub refused_writes: u64,
}

impl Outcome {
    pub fn oversold(&self) -> u64 {
        self.sold.saturating_sub(STOCK)
    }
}

#[derive(Default)]
struct Tally {
    acquisitions: AtomicU64,
    sold: AtomicU64,
    refused: AtomicU64,
}

impl Tally {
    /// Whether this acquisition is one of the stalling ones.
    fn stalls(&self) -> bool {
        self.acquisitions.fetch_add(1, Ordering::SeqCst) < STALLING
    }
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// A fresh stock row for `item`.
async fn restock(db: &tokio_postgres::Client, item: &str) {
    db.execute(
        "CREATE TABLE IF NOT EXISTS stock (item text PRIMARY KEY, left_ bigint NOT NULL)",
        &[],
    )
    .await
    .unwrap();
    db.execute(
        "INSERT INTO stock VALUES ($1, $2) ON CONFLICT (item) DO UPDATE SET left_ = $2",
        &[&item, &(STOCK as i64)],
    )
    .await
    .unwrap();
}

async fn outcome(db: &tokio_postgres::Client, item: &str, tally: &Tally) -> Outcome {
    let left: i64 = db
        .query_one("SELECT left_ FROM stock WHERE item = $1", &[&item])
        .await
        .unwrap()
        .get(0);
    Outcome {
        sold: tally.sold.load(Ordering::SeqCst),
        stock_left: left,
        refused_writes: tally.refused.load(Ordering::SeqCst),
    }
}

/// A buyer's own lock client (each buyer is its own process).
/// The fault injector lets a stall stop its lease renewals too, as a real pause would.
async fn buyer(url: &str) -> (Client, Faulty) {
    let faults = Faulty::wrap(Arc::new(PostgresBackend::connect(url).await.unwrap()));
    let client = Client::builder_from_arc(Arc::new(faults.clone()))
        .options(LockOptions::builder().ttl(TTL).build().unwrap())
        .build();
    (client, faults)
}

async fn stall(faults: &Faulty) {
    faults.hold_requests(Op::Renew);
    tokio::time::sleep(STALL).await;
    faults.resume(Op::Renew);
}

/// 1. A leasehold lock around a read and a write, without a fence.
pub async fn unfenced(url: &str) -> Outcome {
    let db = connect(url).await;
    restock(&db, "unfenced").await;
    let tally = Arc::new(Tally::default());
    let mut buyers = Vec::new();
    for _ in 0..BUYERS {
        let (client, faults) = buyer(url).await;
        let db = connect(url).await;
        let tally = tally.clone();
        buyers.push(tokio::spawn(async move {
            let guard = client.mutex("unfenced").unwrap().lock().await.unwrap();
            let left: i64 = db
                .query_one("SELECT left_ FROM stock WHERE item = 'unfenced'", &[])
                .await
                .unwrap()
                .get(0);
            if tally.stalls() {
                stall(&faults).await;
            }
            if left > 0 {
                db.execute(
                    "UPDATE stock SET left_ = $1 WHERE item = 'unfenced'",
                    &[&(left - 1)],
                )
                .await
                .unwrap();
                tally.sold.fetch_add(1, Ordering::SeqCst);
            }
            // A stalled buyer's release reports the loss it did not notice in time.
            let _ = guard.release().await;
        }));
    }
    for buyer in buyers {
        buyer.await.unwrap();
    }
    outcome(&db, "unfenced", &tally).await
}

/// 2. No lock: an atomic check-and-decrement.
pub async fn atomic(url: &str) -> Outcome {
    let db = connect(url).await;
    restock(&db, "atomic").await;
    let tally = Arc::new(Tally::default());
    let mut buyers = Vec::new();
    for _ in 0..BUYERS {
        let db = connect(url).await;
        let tally = tally.clone();
        buyers.push(tokio::spawn(async move {
            if tally.stalls() {
                tokio::time::sleep(STALL).await;
            }
            let took = db
                .execute(
                    "UPDATE stock SET left_ = left_ - 1 WHERE item = 'atomic' AND left_ > 0",
                    &[],
                )
                .await
                .unwrap();
            tally.sold.fetch_add(took, Ordering::SeqCst);
        }));
    }
    for buyer in buyers {
        buyer.await.unwrap();
    }
    outcome(&db, "atomic", &tally).await
}

/// 3. The lock, with the read and the write fenced in one transaction.
pub async fn fenced(url: &str) -> Outcome {
    let db = connect(url).await;
    restock(&db, "fenced").await;
    let tally = Arc::new(Tally::default());
    let mut buyers = Vec::new();
    for _ in 0..BUYERS {
        let (client, faults) = buyer(url).await;
        let mut db = connect(url).await;
        let tally = tally.clone();
        buyers.push(tokio::spawn(async move {
            let mutex = client.mutex("fenced").unwrap();
            loop {
                let guard = mutex.lock().await.unwrap();
                let fence = still_owner(&guard);
                let tx = db.transaction().await.unwrap();
                let read = tx
                    .query_opt(
                        &format!(
                            "SELECT left_ FROM stock WHERE item = 'fenced' AND {}",
                            fence.condition(1)
                        ),
                        &[&fence.name(), &fence.token(), &fence.owner()],
                    )
                    .await
                    .unwrap();
                let Some(row) = read else {
                    // Our grant is no longer current.
                    tally.refused.fetch_add(1, Ordering::SeqCst);
                    continue;
                };
                let left: i64 = row.get(0);
                if left == 0 {
                    tx.commit().await.unwrap();
                    let _ = guard.release().await;
                    return;
                }
                if tally.stalls() {
                    stall(&faults).await;
                }
                let wrote = tx
                    .execute(
                        &format!(
                            "UPDATE stock SET left_ = $4 WHERE item = 'fenced' AND {}",
                            fence.condition(1)
                        ),
                        &[&fence.name(), &fence.token(), &fence.owner(), &(left - 1)],
                    )
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                if wrote == 1 {
                    tally.sold.fetch_add(1, Ordering::SeqCst);
                    let _ = guard.release().await;
                    return;
                }
                tally.refused.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    for buyer in buyers {
        buyer.await.unwrap();
    }
    outcome(&db, "fenced", &tally).await
}

#[allow(dead_code)] // also compiled into the test, which has its own main
#[tokio::main]
async fn main() {
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
    println!(
        "{STOCK} items, {BUYERS} buyers; the first {STALLING} to get the lock stall for \
         {STALL:?} with a {TTL:?} lease\n"
    );
    println!(
        "{:<34} {:>5} {:>11} {:>9} {:>15}",
        "strategy", "sold", "stock left", "oversold", "writes refused"
    );
    for (name, outcome) in [
        ("leasehold lock, no fence", unfenced(&url).await),
        ("atomic check-and-decrement", atomic(&url).await),
        ("leasehold lock + still_owner", fenced(&url).await),
    ] {
        println!(
            "{:<34} {:>5} {:>11} {:>9} {:>15}",
            name,
            outcome.sold,
            outcome.stock_left,
            outcome.oversold(),
            outcome.refused_writes
        );
    }
}
