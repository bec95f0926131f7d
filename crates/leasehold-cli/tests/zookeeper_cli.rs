//! `leasehold run` against a real ZooKeeper: 20 processes at once on one name, and a run
//! paused past its session timeout while another takes the lock.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::process::Stdio;
use std::time::Duration;

use leasehold_testkit::ZooKeeper;
use rustix::process::{Pid, Signal, kill_process, test_kill_process, test_kill_process_group};
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;

#[tokio::test]
async fn twenty_processes_count_exactly_and_see_increasing_tokens() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    // The session's timeout is the lock's ttl (`--ttl` keeps its default, 30 s).
    let url = format!("zk://{}?session_timeout=30s", zookeeper.connect_string());
    common::twenty_runs_share_a_counter(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_paused_past_its_session_stops_its_command_and_exits_80_on_resume() {
    let zookeeper = ZooKeeper::start().await.unwrap();
    let url = format!("zk://{}?session_timeout=2s", zookeeper.connect_string());
    let mut paused = Command::new(common::BIN)
        .args([
            "run", "--url", &url, "--ttl", "2s", "--grace", "1s", "paused",
        ])
        .args([
            "--",
            "sh",
            "-c",
            r#"echo "$$ $LEASEHOLD_TOKEN"; exec sleep 60"#,
        ])
        .env_remove("LEASEHOLD_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(paused.stdout.take().unwrap()).lines();
    let started = lines
        .next_line()
        .await
        .unwrap()
        .expect("the command started");
    let (command, token) = started.split_once(' ').unwrap();
    let command = Pid::from_raw(command.parse().unwrap()).unwrap();
    let token: u64 = token.parse().unwrap();
    let run = Pid::from_raw(i32::try_from(paused.id().unwrap()).unwrap()).unwrap();

    // The run is frozen: its session goes silent, and ZooKeeper gives the lock away.
    kill_process(run, Signal::STOP).unwrap();
    let other = leasehold::connect(&url).await.unwrap();
    let next = other
        .mutex("paused")
        .unwrap()
        .lock_timeout(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the lock was given away");
    assert!(next.token().get() > token);
    // Until it resumes, its command runs on.
    assert!(test_kill_process(command).is_ok());

    kill_process(run, Signal::CONT).unwrap();
    let status = paused.wait().await.unwrap();
    assert_eq!(status.code(), Some(80), "exit code of the resumed run");
    assert!(
        test_kill_process_group(command).is_err(),
        "the command's process group outlived the lock"
    );
    next.release().await.unwrap();
}
