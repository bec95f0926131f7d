//! The flash-sale example's three strategies, checked.
//! The naive lock oversells, the atomic script and the fenced lock never do.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

#[path = "../examples/flash_sale.rs"]
#[allow(dead_code, unreachable_pub)]
mod flash_sale;

use leasehold_testkit::Redis;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_naive_lock_oversells() {
    let server = Redis::start().await.unwrap();
    let naive = flash_sale::naive(&server.url()).await;
    assert!(
        naive.oversold() > 0,
        "the naive lock did not oversell: {naive:?}"
    );

    let atomic = flash_sale::atomic(&server.url()).await;
    assert_eq!(atomic.sold, flash_sale::STOCK, "{atomic:?}");
    assert_eq!(atomic.stock_left, 0);

    let fenced = flash_sale::fenced(&server.url()).await;
    assert_eq!(fenced.sold, flash_sale::STOCK, "{fenced:?}");
    assert_eq!(fenced.stock_left, 0);
    assert!(
        fenced.refused_writes > 0,
        "no stale write was refused: {fenced:?}"
    );
}
