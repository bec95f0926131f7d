//! `leasehold run` against a real PostgreSQL: 20 processes at once on one name, and a
//! holder paused past its lease.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;

use leasehold_testkit::Postgres;
use rustix::process::{Pid, Signal, kill_process, test_kill_process};
use tokio::process::Command;

#[tokio::test]
async fn twenty_processes_count_exactly_and_see_increasing_tokens() {
    let server = Postgres::start().await.unwrap();
    common::twenty_runs_share_a_counter(&server.url()).await;
}

fn fifo(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap()
            .success()
    );
    path
}

async fn read(fifo: &Path) -> String {
    let fifo = fifo.to_path_buf();
    tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo))
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn a_paused_holder_is_stopped_on_resume_and_the_next_holder_has_a_larger_token() {
    let server = Postgres::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let first_ready = fifo(dir.path(), "first");
    let second_ready = fifo(dir.path(), "second");
    let run = |script: String| {
        let mut cmd = Command::new(common::BIN);
        cmd.args([
            "run",
            "--url",
            &server.url(),
            "--ttl",
            "2s",
            "--grace",
            "1s",
            "job",
        ])
        .args(["--", "sh", "-c", &script])
        .env_remove("LEASEHOLD_URL")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        cmd
    };

    let first = run(format!(
        "echo $$ $LEASEHOLD_TOKEN > {}; exec sleep 1000",
        first_ready.display()
    ))
    .spawn()
    .unwrap();
    let first_pid = Pid::from_raw(first.id().unwrap() as i32).unwrap();
    let written = read(&first_ready).await;
    let (command, first_token) = written.trim().split_once(' ').unwrap();
    let command = Pid::from_raw(command.parse().unwrap()).unwrap();
    let first_token: u64 = first_token.parse().unwrap();

    // The holder stops renewing; its lease runs out on the server.
    kill_process(first_pid, Signal::STOP).unwrap();
    let second = run(format!(
        "echo $LEASEHOLD_TOKEN > {}",
        second_ready.display()
    ))
    .spawn()
    .unwrap();
    let second_token: u64 = read(&second_ready).await.trim().parse().unwrap();
    let out = second.wait_with_output().await.unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        second_token > first_token,
        "{second_token} after {first_token}"
    );

    // On resume, the first notices at once that its lease is gone: command stopped, 80.
    kill_process(first_pid, Signal::CONT).unwrap();
    let out = first.wait_with_output().await.unwrap();
    assert_eq!(
        out.status.code(),
        Some(80),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("lost the lock"));
    assert_eq!(test_kill_process(command), Err(rustix::io::Errno::SRCH));
}
