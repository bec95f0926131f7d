//! The flash sale.
//! Five items, eight buyers, and the first two buyers to get the lock stall (a GC pause, a
//! slow disk) for longer than the lock's lease. Three ways to sell:
//!
//! 1. **naive** — `SET lock NX PX`, `GET stock`, `SET stock n-1`. While a stalled buyer
//!    sleeps its lease expires, others sell, and when it wakes it writes back its stale
//!    count: items are sold twice.
//! 2. **atomic** — no lock at all: one Lua script checks and decrements.
//! 3. **leasehold + fence** — a leasehold lock (whose renewals stall with its holder), with
//!    the read and the write going through a [`RedisFence`] under the lock's token. The
//!    stalled buyer's write carries an older token than the reads of those who came after:
//!    Redis refuses it, the buyer tries again, and nothing is oversold.
//!
//! ```sh
//! cargo run -p leasehold-redis --example flash_sale               # starts its own redis-server
//! LEASEHOLD_REDIS_URL=redis://127.0.0.1:6379 cargo run -p leasehold-redis --example flash_sale
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // an example: failures should be loud

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use leasehold_core::{Client, LockOptions};
use leasehold_redis::RedisBackend;
use leasehold_redis::fence::RedisFence;
use leasehold_redis::redis::{self, AsyncCommands, aio::ConnectionManager};
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

async fn connect(url: &str) -> ConnectionManager {
    redis::Client::open(url)
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap()
}

async fn outcome(conn: &mut ConnectionManager, stock: &str, tally: &Tally) -> Outcome {
    let left: i64 = conn.get(stock).await.unwrap();
    Outcome {
        sold: tally.sold.load(Ordering::SeqCst),
        stock_left: left,
        refused_writes: tally.refused.load(Ordering::SeqCst),
    }
}

/// 1. The naive lock: SET NX PX, then GET and SET the count.
pub async fn naive(url: &str) -> Outcome {
    let mut conn = connect(url).await;
    let _: () = conn.set("naive:stock", STOCK).await.unwrap();
    let tally = Arc::new(Tally::default());
    let mut buyers = Vec::new();
    for buyer in 0..BUYERS {
        let mut conn = conn.clone();
        let tally = tally.clone();
        buyers.push(tokio::spawn(async move {
            let me = format!("buyer-{buyer}");
            loop {
                let got: Option<String> = redis::cmd("SET")
                    .arg("naive:lock")
                    .arg(&me)
                    .arg("NX")
                    .arg("PX")
                    .arg(TTL.as_millis() as u64)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                if got.is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let left: u64 = conn.get("naive:stock").await.unwrap();
            if tally.stalls() {
                tokio::time::sleep(STALL).await;
            }
            if left > 0 {
                let _: () = conn.set("naive:stock", left - 1).await.unwrap();
                tally.sold.fetch_add(1, Ordering::SeqCst);
            }
            // Even the release is naive: GET, compare, DEL.
            let holder: Option<String> = conn.get("naive:lock").await.unwrap();
            if holder.as_deref() == Some(me.as_str()) {
                let _: () = conn.del("naive:lock").await.unwrap();
            }
        }));
    }
    for buyer in buyers {
        buyer.await.unwrap();
    }
    outcome(&mut conn, "naive:stock", &tally).await
}

/// 2. No lock: an atomic check-and-decrement script.
pub async fn atomic(url: &str) -> Outcome {
    let mut conn = connect(url).await;
    let _: () = conn.set("atomic:stock", STOCK).await.unwrap();
    let take_one = Arc::new(redis::Script::new(
        "local n = tonumber(redis.call('GET', KEYS[1]) or '0') \
         if n > 0 then redis.call('DECR', KEYS[1]) return 1 end return 0",
    ));
    let tally = Arc::new(Tally::default());
    let mut buyers = Vec::new();
    for _ in 0..BUYERS {
        let mut conn = conn.clone();
        let (tally, take_one) = (tally.clone(), take_one.clone());
        buyers.push(tokio::spawn(async move {
            if tally.stalls() {
                tokio::time::sleep(STALL).await;
            }
            let took: i64 = take_one
                .key("atomic:stock")
                .invoke_async(&mut conn)
                .await
                .unwrap();
            tally.sold.fetch_add(took as u64, Ordering::SeqCst);
        }));
    }
    for buyer in buyers {
        buyer.await.unwrap();
    }
    outcome(&mut conn, "atomic:stock", &tally).await
}

/// 3. A leasehold lock, with the read and the write fenced by the lock's token.
pub async fn fenced(url: &str) -> Outcome {
    let mut conn = connect(url).await;
    let _: () = conn.set("{sale}:stock", STOCK).await.unwrap();
    let fence = Arc::new(RedisFence::new("{sale}:fence"));
    let options = LockOptions::builder().ttl(TTL).build().unwrap();
    let tally = Arc::new(Tally::default());
    let mut buyers = Vec::new();
    for _ in 0..BUYERS {
        // Each buyer is its own process, with its own connection; the fault injector lets
        // a stall stop its lease renewals too, as a real pause would.
        let faults = Faulty::new(RedisBackend::connect(url).await.unwrap());
        let client = Client::builder(faults.clone())
            .options(options.clone())
            .build();
        let mut conn = conn.clone();
        let (tally, fence) = (tally.clone(), fence.clone());
        buyers.push(tokio::spawn(async move {
            let mutex = client.mutex("sale").unwrap();
            loop {
                let guard = mutex.lock().await.unwrap();
                let read = fence
                    .get::<_, u64>(&mut conn, guard.token(), "{sale}:stock")
                    .await;
                let Ok(left) = read.unwrap() else {
                    // Someone newer already touched the stock: our lease is gone.
                    tally.refused.fetch_add(1, Ordering::SeqCst);
                    continue;
                };
                if left == 0 {
                    let _ = guard.release().await;
                    return;
                }
                if tally.stalls() {
                    faults.hold_requests(Op::Renew);
                    tokio::time::sleep(STALL).await;
                    faults.resume(Op::Renew);
                }
                let write = fence
                    .set(&mut conn, guard.token(), "{sale}:stock", left - 1)
                    .await
                    .unwrap();
                match write {
                    Ok(()) => {
                        tally.sold.fetch_add(1, Ordering::SeqCst);
                        let _ = guard.release().await;
                        return;
                    }
                    Err(_stale) => {
                        tally.refused.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        }));
    }
    for buyer in buyers {
        buyer.await.unwrap();
    }
    outcome(&mut conn, "{sale}:stock", &tally).await
}

#[allow(dead_code)] // also compiled into the test, which has its own main
#[tokio::main]
async fn main() {
    let server;
    let url = match std::env::var("LEASEHOLD_REDIS_URL") {
        Ok(url) => url,
        Err(_) => {
            server = leasehold_testkit::Redis::start()
                .await
                .expect("start redis-server (or set LEASEHOLD_REDIS_URL)");
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
        ("naive SET NX PX + GET/SET", naive(&url).await),
        ("atomic check-and-decrement", atomic(&url).await),
        ("leasehold lock + fenced get/set", fenced(&url).await),
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
