//! `leasehold run` against a real PostgreSQL.
//! 20 processes at once on one name, a holder paused past its lease, and `--ttl` on
//! advisory locks.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::process::Stdio;

use common::BIN;
use leasehold_testkit::Postgres;
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;

#[tokio::test]
async fn twenty_processes_count_exactly_and_see_increasing_tokens() {
    let server = Postgres::start().await.unwrap();
    common::twenty_runs_share_a_counter(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_run_has_its_command_stopped_by_the_deadline_and_exits_80_on_resume() {
    let server = Postgres::start().await.unwrap();
    common::a_paused_run_has_its_command_stopped_by_the_deadline(&server.url()).await;
}

#[tokio::test]
async fn ttl_sets_the_session_ttl_of_advisory_locks() {
    let server = Postgres::start().await.unwrap();
    let url = format!("{}?mode=advisory", server.url());
    let mut holder = Command::new(BIN)
        .args(["run", "--url", &url, "--ttl", "60s", "job"])
        .args(["--", "sh", "-c", "echo started; exec sleep 1000"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("started"));

    // The lock lives by a session of --ttl's 60 s, not the backend's default 10 s.
    let out = Command::new(BIN)
        .args(["inspect", "--json", "--url", &url, "job"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let remaining = json["locks"][0]["holders"][0]["remaining_ms"]
        .as_u64()
        .unwrap();
    assert!((10_001..=60_000).contains(&remaining), "{json}");
    holder.start_kill().unwrap();
    holder.wait().await.unwrap();

    // A session ttl in the URL that disagrees with --ttl is a usage error.
    let out = Command::new(BIN)
        .args(["run", "--url", &format!("{url}&session_ttl=5s")])
        .args(["--ttl", "60s", "job", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("disagree"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_watch_shows_a_lock_change_hands_in_both_modes() {
    let server = Postgres::start().await.unwrap();
    common::a_terminal_watch_shows_a_lock_change_hands(&server.url()).await;
    let advisory = format!("{}?mode=advisory", server.url());
    common::a_terminal_watch_shows_a_lock_change_hands(&advisory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elect_hands_on_leadership_and_observers_see_each_leader_in_both_modes() {
    let server = Postgres::start().await.unwrap();
    common::elect_hands_on_leadership_and_observers_see_each_leader(&server.url()).await;
    let advisory = format!("{}?mode=advisory", server.url());
    common::elect_hands_on_leadership_and_observers_see_each_leader(&advisory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_stops_the_holders_command_and_is_recorded() {
    let server = Postgres::start().await.unwrap();
    common::a_forced_release_stops_the_holders_command_and_is_recorded(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_hosts_with_skewed_clocks_run_a_job_once_per_window() {
    let server = Postgres::start().await.unwrap();
    common::ten_hosts_run_a_job_once_per_window(&server.url(), 30).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_jobs_window_goes_to_the_next_host_in_both_modes() {
    let server = Postgres::start().await.unwrap();
    common::a_frozen_jobs_window_goes_to_the_next_host(&server.url()).await;
    // Its own schema: the windows are the same, and records are kept per schema.
    let advisory = format!("{}?mode=advisory&schema=frozen", server.url());
    common::a_frozen_jobs_window_goes_to_the_next_host(&advisory).await;
}

#[tokio::test]
async fn failed_jobs_close_their_window_unless_retried_in_both_modes() {
    let server = Postgres::start().await.unwrap();
    common::failed_jobs_close_their_window_unless_retried(&server.url()).await;
    // Its own schema: the windows are the same, and records are kept per schema.
    let advisory = format!("{}?mode=advisory&schema=failing", server.url());
    common::failed_jobs_close_their_window_unless_retried(&advisory).await;
}

#[tokio::test]
async fn at_least_holds_the_lock_after_the_command_in_lease_mode_only() {
    let server = Postgres::start().await.unwrap();
    common::at_least_holds_the_lock_after_the_command(&server.url(), true).await;
    let advisory = format!("{}?mode=advisory", server.url());
    common::at_least_holds_the_lock_after_the_command(&advisory, false).await;
}
