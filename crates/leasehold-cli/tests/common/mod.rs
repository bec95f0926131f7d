//! What the binary's end-to-end tests share.

use std::process::Stdio;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process, test_kill_process, test_kill_process_group};
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

/// Starts 20 `leasehold run --url url` processes at once on one name, each doing a slow
/// read-increment-write of a counter file; asserts the counter ends at exactly 20 and the
/// tokens the commands saw, in the order they ran, strictly increase.
pub(crate) async fn twenty_runs_share_a_counter(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let counter = dir.path().join("counter");
    let tokens = dir.path().join("tokens");
    std::fs::write(&counter, "0\n").unwrap();
    // Read, pause, write: without mutual exclusion, increments get lost.
    let script = format!(
        r#"n=$(cat {c}); echo "$LEASEHOLD_TOKEN" >> {t}; sleep 0.02; echo $((n + 1)) > {c}"#,
        c = counter.display(),
        t = tokens.display()
    );
    let args = ["run", "--url", url, "counter", "--", "sh", "-c", &script];
    let children: Vec<_> = (0..20)
        .map(|_| {
            Command::new(BIN)
                .args(args)
                .env_remove("LEASEHOLD_URL")
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output()
        })
        .collect();
    for child in children {
        let out = child.await.unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(std::fs::read_to_string(&counter).unwrap().trim(), "20");
    let seen: Vec<u64> = std::fs::read_to_string(&tokens)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(seen.len(), 20);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "tokens in the order the commands ran: {seen:?}"
    );
}

/// Runs `leasehold run --url url --ttl 2s` and freezes it (SIGSTOP) while its command runs.
/// Another client is granted the lock once the frozen run's lease (or session) is gone, with
/// a larger token; the frozen run's command runs on until it resumes, and then the run stops
/// the command's whole group and exits 80. `url` must give the lock a 2 s lease or session.
#[allow(dead_code, reason = "the file backend's tests have no lease to lose")]
pub(crate) async fn a_paused_run_loses_its_lock_and_exits_80_on_resume(url: &str) {
    let mut paused = Command::new(BIN)
        .args([
            "run", "--url", url, "--ttl", "2s", "--grace", "1s", "paused",
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
        .stderr(Stdio::piped())
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

    // The run is frozen: it renews nothing, and the server gives the lock away.
    kill_process(run, Signal::STOP).unwrap();
    let other = leasehold::connect(url).await.unwrap();
    let next = other
        .mutex("paused")
        .unwrap()
        .lock_timeout(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the lock was given away");
    assert!(next.token().get() > token, "{} after {token}", next.token());
    // Until it resumes, its command runs on.
    assert!(test_kill_process(command).is_ok());

    // On resume it notices at once that its lock is gone.
    kill_process(run, Signal::CONT).unwrap();
    let out = paused.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(80),
        "exit code of the resumed run: {stderr}"
    );
    assert!(stderr.contains("lost the lock"), "{stderr}");
    assert!(
        test_kill_process_group(command).is_err(),
        "the command's process group outlived the lock"
    );
    next.release().await.unwrap();
}
