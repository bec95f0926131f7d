//! `leasehold audit` on the checker's own runs.
//! The workers write their lock events (as `run --events` does on a host), the audit reads
//! them, and its findings are held against the checker's verdicts: the double grant a
//! planted bug causes is found, and runs that keep every promise raise no alarm.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::path::{Path, PathBuf};

use leasehold_chaos::audit::{Audit, audit};
use leasehold_chaos::bugs::Bug;
use leasehold_chaos::checks::Status;

/// The events files the workers of a run wrote in `dir`.
fn events_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    files
}

/// Runs `scenario` on Redis with `seed` (and `bug`, if any), its workers writing events.
/// It returns the checker's failed checks and the audit of the events (clocks of one host:
/// ±1 ms).
fn run_and_audit(scenario: &str, seed: u64, bug: Option<Bug>) -> (Vec<String>, Audit) {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = common::spec("redis", scenario, seed);
    spec.bug = bug.map(|bug| bug.name().to_owned());
    spec.events_dir = Some(dir.path().to_path_buf());
    let report = common::run(&spec);
    let failed = report
        .verdicts()
        .iter()
        .filter(|v| matches!(v.status, Status::Fail))
        .map(|v| format!("{:?}", v.check))
        .collect();
    let files = events_in(&dir.path().join(format!("redis-{scenario}-{seed}")));
    assert!(!files.is_empty(), "{scenario}: no worker wrote events");
    (failed, audit(&files, 1).unwrap())
}

#[test]
fn the_audit_finds_the_double_grant_of_a_release_without_owner_check() {
    // A release that deletes whoever holds lets a second holder in beside the first.
    for seed in 1..=3 {
        let (failed, found) = run_and_audit("non-owner-release", seed, Some(Bug::ReleaseAny));
        if failed.is_empty() {
            continue;
        }
        let checks: Vec<&str> = found.findings.iter().map(|f| f.check).collect();
        assert!(
            checks.contains(&"double_grant"),
            "the checker failed {failed:?}; the audit found {:?}",
            found.findings
        );
        return;
    }
    panic!("the planted bug was not caught by the checker in 3 seeds");
}

#[test]
fn the_audit_raises_no_alarm_where_every_promise_was_kept() {
    for scenario in [
        "pause-holder",
        "latency-jitter",
        "holder-crash",
        "unknown-outcome",
        "delayed-grant-reply",
        "lost-grant-reply",
    ] {
        let (failed, found) = run_and_audit(scenario, 1, None);
        assert!(
            failed.is_empty(),
            "{scenario}: the checker failed {failed:?}"
        );
        assert!(
            found.events.get("granted").copied().unwrap_or(0) > 0,
            "{scenario}: nothing was granted: {:?}",
            found.events
        );
        assert!(
            found.findings.is_empty(),
            "{scenario}: false alarms {:?}",
            found.findings
        );
    }
}
