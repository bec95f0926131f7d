//! `leasehold run` against a real ZooKeeper.
//! 20 processes at once on one name, and a run paused past its session timeout while
//! another takes the lock.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use leasehold_testkit::ZooKeeper;

#[tokio::test]
async fn twenty_processes_count_exactly_and_see_increasing_tokens() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    // The session's timeout is the lock's ttl (`--ttl` keeps its default, 30 s).
    let url = format!("zk://{}?session_timeout=30s", zookeeper.connect_string());
    common::twenty_runs_share_a_counter(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_run_has_its_command_stopped_by_the_deadline_and_exits_80_on_resume() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("zk://{}?session_timeout=2s", zookeeper.connect_string());
    common::a_paused_run_has_its_command_stopped_by_the_deadline(&url).await;
}
