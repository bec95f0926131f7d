//! `leasehold run` against a real etcd: 20 processes at once on one name.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use leasehold_testkit::Etcd;

#[tokio::test]
async fn twenty_processes_count_exactly_and_see_increasing_tokens() {
    let etcd = Etcd::start().await.unwrap();
    common::twenty_runs_share_a_counter(&etcd.url()).await;
}
