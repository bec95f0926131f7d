//! `leasehold run` against a real etcd.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::path::Path;
use std::process::Stdio;

use common::BIN;
use leasehold_testkit::Etcd;
use tokio::process::Command;

#[tokio::test]
async fn twenty_processes_count_exactly_and_see_increasing_tokens() {
    let etcd = Etcd::start().await.unwrap();
    common::twenty_runs_share_a_counter(&etcd.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_run_has_its_command_stopped_by_the_deadline_and_exits_80_on_resume() {
    let etcd = Etcd::start().await.unwrap();
    // `--ttl 2s` becomes the session's ttl; the other client's session gets the same.
    let url = format!("{}?session_ttl=2s", etcd.url());
    common::a_paused_run_has_its_command_stopped_by_the_deadline(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_stops_the_holders_command_and_is_recorded() {
    let etcd = Etcd::start().await.unwrap();
    common::a_forced_release_stops_the_holders_command_and_is_recorded(&etcd.url()).await;
}

#[tokio::test]
async fn a_terminal_watch_shows_a_lock_change_hands() {
    let etcd = Etcd::start().await.unwrap();
    common::a_terminal_watch_shows_a_lock_change_hands(&etcd.url()).await;
}

/// `etcdctl ARGS -w json` against `etcd`, parsed.
async fn etcdctl(etcd: &Etcd, args: &[&str]) -> serde_json::Value {
    let out = Command::new("etcdctl")
        .arg(format!("--endpoints={}", etcd.endpoints().join(",")))
        .args(args)
        .args(["-w", "json"])
        .env("ETCDCTL_API", "3")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The ttl etcd granted each live lease.
async fn granted_ttls(etcd: &Etcd) -> Vec<i64> {
    let leases = etcdctl(etcd, &["lease", "list"]).await;
    let mut ttls = Vec::new();
    for lease in leases["leases"].as_array().cloned().unwrap_or_default() {
        let id = lease["id"].as_i64().unwrap();
        let alive = etcdctl(etcd, &["lease", "timetolive", &format!("{id:x}")]).await;
        ttls.push(alive["granted-ttl"].as_i64().unwrap());
    }
    ttls
}

async fn read(fifo: &Path) -> String {
    let fifo = fifo.to_path_buf();
    tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo))
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn ttl_sets_the_session_ttl_so_a_dead_holder_blocks_for_it_not_for_10_s() {
    let etcd = Etcd::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&ready)
            .status()
            .unwrap()
            .success()
    );
    let run = |script: String| {
        let mut cmd = Command::new(BIN);
        cmd.args(["run", "--url", &etcd.url(), "--ttl", "2s", "job"])
            .args(["--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    };
    let mut first = run(format!(
        "echo $LEASEHOLD_TOKEN > {}; exec sleep 1000",
        ready.display()
    ))
    .spawn()
    .unwrap();
    let first_token: u64 = tokio::select! {
        written = read(&ready) => written.trim().parse().unwrap(),
        _ = first.wait() => {
            let mut stderr = String::new();
            let mut pipe = first.stderr.take().unwrap();
            tokio::io::AsyncReadExt::read_to_string(&mut pipe, &mut stderr).await.unwrap();
            // Let the reader of the FIFO go, so that the runtime can shut down.
            std::fs::write(&ready, "").unwrap();
            panic!("the first run ended before running its command: {stderr}");
        }
    };

    // The one session lease, as etcd granted it: --ttl's 2 s, not the default 10 s.
    assert_eq!(granted_ttls(&etcd).await, vec![2]);
    // `inspect` shows the time left on that lease.
    let out = Command::new(BIN)
        .args(["inspect", "--json", "--url", &etcd.url(), "job"])
        .output()
        .await
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let remaining = json["locks"][0]["holders"][0]["remaining_ms"]
        .as_u64()
        .unwrap();
    assert!(remaining <= 2000, "{json}");

    // A holder killed with SIGKILL: its command dies with it, its session lease runs out,
    // and the next run is granted then.
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    let second = run("echo $LEASEHOLD_TOKEN".into()).output().await.unwrap();
    assert_eq!(
        second.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let second_token: u64 = String::from_utf8_lossy(&second.stdout)
        .trim()
        .parse()
        .unwrap();
    assert!(second_token > first_token);
}

#[tokio::test]
async fn a_session_ttl_in_the_url_that_disagrees_with_ttl_is_a_usage_error() {
    let etcd = Etcd::start().await.unwrap();
    let url = format!("{}?session_ttl=5s", etcd.url());
    let out = Command::new(BIN)
        .args(["run", "--url", &url, "--ttl", "2s", "job", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("disagree"));
    // Agreeing, or only in the URL, is fine.
    for args in [&["--ttl", "5s"][..], &[]] {
        let out = Command::new(BIN)
            .args(["run", "--url", &url])
            .args(args)
            .args(["job", "--", "true"])
            .output()
            .await
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elect_hands_on_leadership_and_observers_see_each_leader() {
    let etcd = Etcd::start().await.unwrap();
    common::elect_hands_on_leadership_and_observers_see_each_leader(&etcd.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_hosts_with_skewed_clocks_run_a_job_once_per_window() {
    let etcd = Etcd::start().await.unwrap();
    common::ten_hosts_run_a_job_once_per_window(&etcd.url(), 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_jobs_window_goes_to_the_next_host() {
    let etcd = Etcd::start().await.unwrap();
    let url = format!("{}?session_ttl=2s", etcd.url());
    common::a_frozen_jobs_window_goes_to_the_next_host(&url).await;
}

#[tokio::test]
async fn failed_jobs_close_their_window_unless_retried() {
    let etcd = Etcd::start().await.unwrap();
    common::failed_jobs_close_their_window_unless_retried(&etcd.url()).await;
}

#[tokio::test]
async fn at_least_holds_the_lock_after_the_command() {
    let etcd = Etcd::start().await.unwrap();
    common::at_least_holds_the_lock_after_the_command(&etcd.url(), true).await;
}
