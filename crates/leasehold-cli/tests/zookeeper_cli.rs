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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_stops_the_holders_command_and_is_recorded() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    common::a_forced_release_stops_the_holders_command_and_is_recorded(&zookeeper.url()).await;
}

#[tokio::test]
async fn a_terminal_watch_shows_a_lock_change_hands() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    common::a_terminal_watch_shows_a_lock_change_hands(&zookeeper.url()).await;
}

#[tokio::test]
async fn the_lock_ttl_is_the_session_timeout_the_server_negotiated() {
    // The testkit's servers grant sessions of at most 60 s (`maxSessionTimeout`).
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = zookeeper.url();
    let run = |args: &[&str]| {
        tokio::process::Command::new(common::BIN)
            .args(["run", "--url", &url])
            .args(args)
            .args(["job", "--", "true"])
            .env_remove("LEASEHOLD_URL")
            .output()
    };
    // Asked for 90 s, the session lasts 60 s: a grace that fits 90 s but not 60 s is a usage
    // error, not a command stopped 20 s into a healthy session.
    let out = run(&["--ttl", "90s", "--grace", "50s"]).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("60s lease"), "{stderr}");
    // The default grace, 10 s, fits the 60 s granted.
    let out = run(&["--ttl", "90s"]).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elect_hands_on_leadership_and_observers_see_each_leader() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("zk://{}", zookeeper.connect_string());
    common::elect_hands_on_leadership_and_observers_see_each_leader(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_hosts_with_skewed_clocks_run_a_job_once_per_window() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("zk://{}", zookeeper.connect_string());
    common::ten_hosts_run_a_job_once_per_window(&url, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_jobs_window_goes_to_the_next_host() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("zk://{}?session_timeout=2s", zookeeper.connect_string());
    common::a_frozen_jobs_window_goes_to_the_next_host(&url).await;
}

#[tokio::test]
async fn failed_jobs_close_their_window_unless_retried() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("zk://{}", zookeeper.connect_string());
    common::failed_jobs_close_their_window_unless_retried(&url).await;
    // ZooKeeper's grants are ephemeral nodes of the session: none outlives its holder.
    common::at_least_holds_the_lock_after_the_command(&url, false).await;
}
