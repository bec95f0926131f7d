//! `leasehold chaos` through the `leasehold` binary, against the servers given with `--url`.
//! The binary starts itself again as the checker's workers and resource (`leasehold chaos
//! worker …`, `leasehold chaos resource …`). It starts none of its own: the product links
//! no server spawner (that is the checker's own program, `leasehold-chaos`).

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::process::Command;

use leasehold_testkit::Redis;

const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

#[test]
fn a_scenario_runs_against_a_users_server_and_reports_as_json() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let redis = runtime.block_on(Redis::start()).unwrap();
    let out = Command::new(BIN)
        .args([
            "chaos",
            "--backend",
            "redis",
            "--url",
            &redis.url(),
            "--scenario",
            "full-partition",
            "--seed",
            "3",
            "--json",
        ])
        .env_remove("LEASEHOLD_URL")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&text).unwrap();
    let run = &report["runs"][0];
    assert_eq!(run["backend"], "redis");
    assert_eq!(run["scenario"], "full-partition");
    assert_eq!(run["seed"], 3);
    assert_eq!(run["outcome"], "ran");
    assert_eq!(run["verdicts"].as_array().unwrap().len(), 10);
    assert!(run["stats"]["faults"].as_u64().unwrap() > 0);
    assert_eq!(
        run["replay"],
        format!(
            "leasehold chaos --backend redis --scenario full-partition --seed 3 --url {}",
            redis.url()
        )
    );
}

/// Without `--url`, a backend on servers is refused, and so is the in-memory backend.
/// Both exit 64, saying what to do (the in-memory backend's in-process links are the
/// harness's): no run starts.
#[test]
fn without_url_no_server_is_started_and_the_message_says_what_to_do() {
    for (backend, says) in [("redis", "--url"), ("memory", "leasehold-chaos")] {
        let out = Command::new(BIN)
            .args([
                "chaos",
                "--backend",
                backend,
                "--scenario",
                "full-partition",
            ])
            .env_remove("LEASEHOLD_URL")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{backend}: {stderr}");
        assert!(stderr.contains(says), "{backend}: {stderr}");
        assert!(out.stdout.is_empty(), "{backend}: a run started");
    }
    let list = Command::new(BIN).args(["chaos", "list"]).output().unwrap();
    let text = String::from_utf8_lossy(&list.stdout);
    let row = |name: &str, rest: &str| format!("  {name:<14} {rest}");
    assert!(
        text.contains(&row("redis", "redis:// (with --url)")),
        "{text}"
    );
    assert!(
        text.contains(&row("redis-cluster", "redis+cluster:// (with --url)")),
        "{text}"
    );
    assert!(
        text.contains(&row("memory", "memory:// (leasehold-chaos only)")),
        "{text}"
    );
    assert!(text.contains(&row("file", "file://\n")), "{text}");
}

#[test]
fn bad_chaos_usage_is_exit_64() {
    for args in [
        &["chaos", "--backend", "nosuch"][..],
        &["chaos", "--scenario", "nosuch"],
        &["chaos", "--runs", "0"],
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(64), "{args:?}");
    }
    let list = Command::new(BIN).args(["chaos", "list"]).output().unwrap();
    assert_eq!(list.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&list.stdout).contains("pause-holder"));
}
