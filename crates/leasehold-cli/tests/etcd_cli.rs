//! `leasehold run` against a real etcd: 20 processes at once on one name.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::process::Stdio;

use leasehold_testkit::Etcd;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

#[tokio::test]
async fn twenty_processes_count_exactly_and_see_increasing_tokens() {
    let etcd = Etcd::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let counter = dir.path().join("counter");
    let tokens = dir.path().join("tokens");
    std::fs::write(&counter, "0\n").unwrap();
    let script = format!(
        r#"n=$(cat {c}); echo "$LEASEHOLD_TOKEN" >> {t}; sleep 0.02; echo $((n + 1)) > {c}"#,
        c = counter.display(),
        t = tokens.display()
    );
    let mut children = Vec::new();
    for _ in 0..20 {
        children.push(
            Command::new(BIN)
                .args([
                    "run",
                    "--url",
                    &etcd.url(),
                    "counter",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ])
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        );
    }
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
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
}
