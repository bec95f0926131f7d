//! `leasehold chaos` through the `leasehold` binary: the binary starts itself again as the
//! checker's workers and resource (`leasehold chaos worker …`, `leasehold chaos resource …`).

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

#[test]
fn a_scenario_runs_through_the_leasehold_binary_and_reports_as_json() {
    let out = Command::new(BIN)
        .args([
            "chaos",
            "--backend",
            "memory",
            "--scenario",
            "full-partition",
            "--seed",
            "3",
            "--json",
        ])
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
    assert_eq!(run["backend"], "memory");
    assert_eq!(run["scenario"], "full-partition");
    assert_eq!(run["seed"], 3);
    assert_eq!(run["outcome"], "ran");
    assert_eq!(run["verdicts"].as_array().unwrap().len(), 10);
    assert!(run["stats"]["faults"].as_u64().unwrap() > 0);
    assert_eq!(
        run["replay"],
        "leasehold chaos --backend memory --scenario full-partition --seed 3"
    );
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
